"""Torch's intra-op threads follow whichever engine stage is busy.

The AR stage and the decoder run on two Python threads. Fixed at half the cores each, a stage
that runs alone (the decoder catching up after the AR side finished its requests, or a prefill
while nothing decodes) leaves half the machine idle; at all the cores each, two busy stages
oversubscribe it (measured on 2 cores: 148 vs 116 frames/s at batch 8,
bench/results/cpu-2core/profile.md). So every stage call counts itself busy here and, as it
starts, sets its own thread's count (torch's count is per thread, OpenMP's) to the cores divided
among the busy stages, all but one when it starts alone: the slower stage, busy more often
alone, gets the spare cores. (On 2 cores that is one thread each, whatever the load.)

A decode batch of enough rows runs as one part per free core (`free_cores`: those no busy stage
holds as it starts) on threads of its own (`ModelRunner.decode_step`), each part counted busy like
a stage. So when the AR stage idles the decoder has every core (measured on 2 cores, closed loop,
full size, 8 and 16 streams: 8.4 and 9.9 audio-s/s against 6.4 and 7.0 unsplit). While the AR stage
steps, a part would share the AR's core, and the AR stage computes new streams' first latents and
frames: a split trades its steps for decoded frames (`bench/stages.py --decode-parts 1,2`, 2 cores,
the AR stage stepping in a loop beside the decode, two parts against one: 2M at 32 x 4, seven
pairs: -1% to +40% row-frames per second and 4-37% fewer AR steps; full size at 16 x 1, four pairs:
-23% to +54% and 14-38% fewer). Not splitting then is the better trade: in the closed loop on 2
cores, first audio came sooner (TTFA p50 2M at 16 streams 85 / 79 / 94 -> 63 / 60 / 77 ms, full
size at 16 streams 342 / 254 / 294 -> 246 / 220 / 204 ms, three alternating pairs each) with no
less audio per second.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class ThreadBudget:
    def __init__(self, cores: int):
        self.cores = max(1, cores)
        self.busy_stages = 0
        self._lock = threading.Lock()

    def threads_for(self, busy_stages: int) -> int:
        if busy_stages <= 1:
            return max(1, self.cores - 1)
        return max(1, self.cores // busy_stages)

    def free_cores(self) -> int:
        """Cores no busy stage holds now (at least one)."""
        return max(1, self.cores - self.busy_stages)

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
