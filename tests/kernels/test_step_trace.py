"""The AR step replayed as a TorchScript trace (`ModelRunner.step_traces`): one trace, made on one
scratch row, replays every step the engine takes bit for bit, whatever its rows, their contexts'
lengths, and the contexts' reservation (which moves when a context outgrows it)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from intone.engine import Engine, EngineConfig
from intone.engine.kernels.row_contexts import NativeRowAttention, plan_row_context_step
from intone.engine.loading import LoadedModel
from intone.engine.model_runner import GenerateInputs, ModelRunner
from intone.engine.models.pocket.kv_cache import SequenceStep


def step(runner: ModelRunner, lengths: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    """One AR step of rows whose contexts are `lengths` positions of the pool (this one's
    included), in the requests' order, as `ModelRunner.generate` returns it."""
    generator = torch.Generator().manual_seed(seed)
    slots = runner.pool.num_slots - 1
    steps = [SequenceStep(torch.randperm(slots, generator=generator)[:n], 1) for n in lengths]
    latent_dim = runner.flow_lm.latent_dim
    previous = torch.randn(len(lengths), latent_dim, generator=generator)
    noise = torch.randn(len(lengths), latent_dim, generator=generator)
    thresholds = torch.randn(len(lengths), generator=generator)
    owners = [object() for _ in lengths]
    order, positions, attention = plan_row_context_step(
        runner.row_contexts, steps, owners, native=runner.native_row_attention
    )
    assert isinstance(attention, NativeRowAttention)
    order_t = torch.tensor(order)
    back = torch.argsort(order_t)
    inputs = GenerateInputs(
        previous[order_t],
        positions,
        attention,
        noise[order_t],
        thresholds[order_t],
        order_t,
        len(lengths),
        back,
    )
    latents, eos = runner.generate_step(inputs)
    return latents[back], eos[back]


def test_one_trace_replays_every_step_bit_for_bit(tiny_model: LoadedModel) -> None:
    config = EngineConfig(torch_threads=0, max_active=8, dtype="float32", num_pages=256)
    eager = Engine(tiny_model, replace(config, trace_after=None))
    traced = Engine(tiny_model, replace(config, trace_after=1))
    try:
        if not traced.runner.native_row_attention:
            pytest.skip("no native attention here: steps run eagerly in torch")
        assert eager.runner.step_traces is None
        traced.prepare_traces()
        traces = traced.runner.step_traces
        assert traces is not None and len(traces) == 1
        # Both pools hold the same keys and values, and get the same writes.
        for runner in (eager.runner, traced.runner):
            generator = torch.Generator().manual_seed(0)
            for tensor in (runner.pool.keys, runner.pool.values):
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
        capacity = traced.runner.row_contexts.capacity
        cases = [[1], [3, 70, 12], [200, 1, 5, 33, 64, 9, 150], [capacity + 7, 4]]
        assert capacity + 7 < traced.runner.pool.num_slots
        for seed, lengths in enumerate(cases):
            want = step(eager.runner, lengths, seed)
            got = step(traced.runner, lengths, seed)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b), lengths
            assert torch.equal(traced.runner.pool.keys, eager.runner.pool.keys)
            assert torch.equal(traced.runner.pool.values, eager.runner.pool.values)
        # The last case grew the reservation: the same trace read the new one.
        assert traced.runner.row_contexts.capacity > capacity
        assert len(traces) == 1
    finally:
        eager.close()
        traced.close()
