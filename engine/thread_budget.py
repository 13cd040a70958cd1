"""Torch's intra-op threads follow whichever engine stage is busy.

The AR stage and the decoder run on two Python threads. Fixed at half the cores each, a stage
that runs alone (the decoder catching up after the AR side finished its requests, or a prefill
while nothing decodes) leaves half the machine idle; at all the cores each, two busy stages
oversubscribe it (bench/results/cpu-2core/README.md). So every stage call counts itself busy here
and, as it starts, sets its own thread's count (torch's count is per thread, OpenMP's) to the cores
divided among the busy stages, all but one when it starts alone: the slower stage, busy more often
alone, gets the spare cores. (On 2 cores that is one thread each, whatever the load.)

A decode batch of enough rows runs as one part per core on threads of its own
(`ModelRunner.decode_step`), each part counted busy like a stage. So when the AR stage idles the
decoder has every core; while it steps, a part shares its core, which trades AR steps for
decoded frames, worth it where the decoder is the bottleneck
(bench/results/cpu-2core-epyc-avx512-issue16-call-deadline/README.md).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def set_torch_threads(threads: int | None) -> ThreadBudget | None:
    """Torch's threads as `EngineConfig.torch_threads` says: that many (0: torch's own), or for
    None a budget over this machine's cores, starting where two busy stages leave it."""
    budget = None
    if threads is None:
        budget = ThreadBudget(os.cpu_count() or 2)
        threads = budget.threads_for(2)
    if threads:
        torch.set_num_threads(threads)
    return budget


class ThreadBudget:
    def __init__(self, cores: int):
        self.cores = max(1, cores)
        self.busy_stages = 0
        self._lock = threading.Lock()

    def threads_for(self, busy_stages: int) -> int:
        if busy_stages <= 1:
            return max(1, self.cores - 1)
        return max(1, self.cores // busy_stages)

    @contextmanager
    def busy(self) -> Iterator[None]:
        self._change(+1)
        try:
            yield
        finally:
            self._change(-1)

    def _change(self, delta: int) -> None:
        with self._lock:
            self.busy_stages += delta
            # Leaving, keep the count for the stages still busy (or for a lone next stage).
            threads = self.threads_for(self.busy_stages)
            # Torch's count is per thread (OpenMP's): compare with this thread's own, not with
            # what another stage's thread last set.
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
