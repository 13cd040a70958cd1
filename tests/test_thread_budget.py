"""Torch's intra-op thread count follows the busy engine stages (engine/thread_budget.py)."""

from __future__ import annotations

import threading

import pytest
import torch

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
