"""Torch's intra-op thread count follows the busy engine stages (engine/thread_budget.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from intone.engine.block_manager import BlockManager
from intone.engine.loading import LoadedModel
from intone.engine.model_runner import ModelRunner
from intone.engine.thread_budget import ThreadBudget


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("cores", "alone", "both"), [(1, 1, 1), (2, 1, 1), (4, 3, 2), (16, 15, 8)])
def test_threads_follow_busy_stages(restore_threads, cores: int, alone: int, both: int):
    budget = ThreadBudget(cores)
    with budget.busy():
        assert torch.get_num_threads() == alone
        with budget.busy():
            assert torch.get_num_threads() == both
            assert budget.busy_stages == 2
        assert torch.get_num_threads() == alone
    assert budget.busy_stages == 0


def test_a_failing_stage_call_still_leaves(restore_threads):
    budget = ThreadBudget(4)
    with pytest.raises(RuntimeError), budget.busy():
        raise RuntimeError("stage failed")
    assert budget.busy_stages == 0


def test_stages_on_two_threads(restore_threads):
    budget = ThreadBudget(8)
    inside, looked = threading.Barrier(3), threading.Barrier(3)
    seen = []

    def stage():
        with budget.busy():
            inside.wait(timeout=10)
            seen.append(torch.get_num_threads())
            looked.wait(timeout=10)

    workers = [threading.Thread(target=stage) for _ in range(2)]
    for w in workers:
        w.start()
    inside.wait(timeout=10)
    looked.wait(timeout=10)
    for w in workers:
        w.join(timeout=10)
    # The count is per thread, set when a call starts: the stage that started alone keeps all
    # cores but one, the one that joined it gets half.
    assert sorted(seen) == [4, 7]
    assert budget.busy_stages == 0


def test_a_decode_splits_over_every_core(restore_threads, tiny_model: LoadedModel):
    """A decode batch runs one part per core, of at least DECODE_SPLIT_ROWS rows each: two parts
    on two cores, idle or not (the AR stage stepping on one of them), one for a small batch."""
    model = tiny_model.model
    budget = ThreadBudget(2)
    runner = ModelRunner(
        model, BlockManager(4, 16), 8, 1, torch.device("cpu"), thread_budget=budget, decode_parts=2
    )
    parts: list[int] = []
    decode = runner.decoder.decode

    def recorded(latents: torch.Tensor, state: dict) -> torch.Tensor:
        parts.append(latents.shape[0])
        return decode(latents, state)

    runner.decoder.decode = recorded
    try:
        slots = [runner.decoder_states.acquire() for _ in range(8)]
        latents = torch.zeros(8, 1, model.flow_lm.latent_dim)
        runner.decode(slots, latents)
        assert sorted(parts) == [4, 4]
        parts.clear()
        with budget.busy():  # the AR stage, stepping on this thread's core
            runner.decode(slots, latents)
        assert sorted(parts) == [4, 4]
        parts.clear()
        runner.decode(slots[:7], latents[:7])  # 3 + 4: a part under DECODE_SPLIT_ROWS
        assert parts == [7]
    finally:
        runner.close()
