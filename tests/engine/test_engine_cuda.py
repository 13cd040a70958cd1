"""The engine on a CUDA device: `pytest -m cuda` (skipped where there is none).

The step functions run with `torch.cuda.set_sync_debug_mode("error")`, so a host read-back or a
blocking copy inside a step fails; the engine's equivalence and fault containment are checked on
the device against the single-request path on the CPU. The sync check calls the steps directly:
the mode is process-wide, and the engine's other thread reads audio back while a step runs.
"""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from intone.engine import EngineFailedError
from intone.engine.block_manager import BlockManager
from intone.engine.loading import LoadedModel
from intone.engine.model_runner import ModelRunner

from support import faults
from support.engine import TEXTS, Reference, options, rel_rms, run_request, voice_pages, wait_idle

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


# The device's kernels differ from the CPU's in rounding; the CPU suite uses 1e-4.
MAX_REL_RMS = 2e-3


def runner_on(device: torch.device, loaded: LoadedModel) -> tuple[ModelRunner, list]:
    model = copy.deepcopy(loaded.model).to(device)
    flow_lm = model.flow_lm
    blocks = BlockManager(32, 16)
    runner = ModelRunner(model, blocks, 2, 1, device)
    requests = []
    for i, length in enumerate((5, 9)):
        table = blocks.allocate(0)
        assert blocks.reserve(table, 40)
        blocks.extend(table, length)
        requests.append(
            SimpleNamespace(
                table=table,
                prompt=torch.randn(
                    length, flow_lm.dim, generator=torch.Generator().manual_seed(i)
                ).to(device),
                previous_latent=torch.full((flow_lm.latent_dim,), float("nan"), device=device),
                eos_threshold=0.0,
                temperature=0.3,
                noise_clamp=None,
                generator=torch.Generator().manual_seed(10 + i),
            )
        )
    return runner, requests


def run_steps(runner: ModelRunner, requests: list, sync_check: bool) -> list[torch.Tensor]:
    """Prefill (with the first AR step), one more AR step, one decode step; inputs prepared on
    the host before each step."""
    for request in requests:
        runner.blocks.extend(request.table, 1)  # the first AR step, in the prefill pass
    prefill_inputs = runner.prefill_inputs(requests, [runner.draw_noise(r) for r in requests])
    for request in requests:
        runner.blocks.extend(request.table, 1)
    noise = [runner.draw_noise(r) for r in requests]
    generate_inputs = runner.generate_inputs(requests, noise)
    slots = [runner.decoder_states.acquire() for _ in requests]
    index = torch.tensor(slots).to(runner.device)
    if sync_check:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        runner.prefill_step(prefill_inputs)
        latents, eos = runner.generate_step(generate_inputs)
        audio = runner.decode_step(index, latents[:, None])
    finally:
        if sync_check:
            torch.cuda.set_sync_debug_mode(0)
    return [t.cpu() for t in (latents, eos, audio)]


def test_steps_run_without_host_syncs(tiny_model: LoadedModel) -> None:
    # The generate inputs read the prefill's page tables only, so both can be prepared first.
    gpu = run_steps(*runner_on(torch.device("cuda"), tiny_model), sync_check=True)
    cpu = run_steps(*runner_on(torch.device("cpu"), tiny_model), sync_check=False)
    torch.testing.assert_close(gpu[0], cpu[0], atol=1e-3, rtol=1e-3)
    assert torch.equal(gpu[1], cpu[1])
    torch.testing.assert_close(gpu[2], cpu[2], atol=1e-3, rtol=1e-3)


def assert_close_audio(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, what
    error = rel_rms(got, want)
    assert error < MAX_REL_RMS, f"{what}: relative RMS error {error:.2e}"


async def test_engine_on_cuda_equals_the_single_path(make_engine, reference: Reference) -> None:
    engine = make_engine(device="cuda")
    floor = voice_pages(engine)
    jobs = [(TEXTS[i % 4], ("default", "second")[i % 2], options(60 + i, 0.3)) for i in range(6)]
    outcomes = await asyncio.gather(*[run_request(engine, *job) for job in jobs])
    for i, ((text, voice, opts), outcome) in enumerate(zip(jobs, outcomes, strict=True)):
        assert_close_audio(outcome.audio, reference.audio(text, voice, opts), f"request {i}")
    await wait_idle(engine, floor)


@pytest.mark.parametrize("stage", ["prefill", "ar_step", "decode"])
async def test_a_fault_on_cuda_ends_only_its_request(
    make_engine, reference: Reference, stage: str
) -> None:
    engine = make_engine(device="cuda")
    floor = voice_pages(engine)
    streams = faults.open_streams(engine)
    counts = faults.inject(engine, stage, streams[faults.CULPRIT].request)
    results = await faults.push_all(streams)
    assert counts["raised"] >= 1
    assert isinstance(results[faults.CULPRIT][1], EngineFailedError)
    for i, ((text, voice, opts), (outcome, error)) in enumerate(
        zip(faults.jobs(), results, strict=True)
    ):
        if i != faults.CULPRIT:
            assert error is None, f"stream {i}: {error!r}"
            assert_close_audio(outcome.audio, reference.audio(text, voice, opts), f"stream {i}")
    await wait_idle(engine, floor)
