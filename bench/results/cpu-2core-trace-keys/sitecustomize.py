"""Counts the decoder's traces, and with TK=old keys them by frame count and one row as before.

    TK=old PYTHONPATH=bench/results/cpu-2core-trace-keys python \
        bench/results/cpu-2core-background-traces/stall_engine.py checkpoints/2m 8 48

The traced parts' input is [rows, frames or decoder steps, channels], so adding its second size
and whether it has one row to every key gives each frame count and one-row calls their own
traces again, as commit 6116d2d did.
"""

import atexit
import os

if os.environ.get("TK"):
    from intone.engine.models.pocket import traces

    caches: list[traces.TraceCache] = []
    original_init = traces.TraceCache.__init__
    original_call = traces.TraceCache.__call__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        caches.append(self)

    def call_keyed_by_frames(self, key, fn, x, state, modules=None):
        return original_call(self, (key, x.shape[1], x.shape[0] == 1), fn, x, state, modules)

    traces.TraceCache.__init__ = init
    if os.environ["TK"] == "old":
        traces.TraceCache.__call__ = call_keyed_by_frames
    atexit.register(lambda: print("traces made:", [len(c) for c in caches], flush=True))
