"""Python's cyclic garbage collector, kept from pausing every stream.

A full collection walks every object the process tracks, holding the GIL throughout: meanwhile
the event loop delivers no audio and the engine's threads start no call. With torch, the engine
and a framework loaded that is over 300,000 objects: in a LiveKit run of the 2M model at 64
streams (2-core Xeon), six full collections in 7 s took up to 128 ms each, and turns ran dry
(bench/results/cpu-2core-xeon-amx-2026-12-07/). What is alive once a process's engine is ready
(modules, the model, its traces) stays alive as long as the process, so nothing is lost by never
walking it again: `gc.freeze` moves it out of the collector's reach, and collections then walk only
what was made since.

Only for an engine kept for the life of the process (`intone serve`, the plugins' `prewarm`): a
frozen object is never collected, so an engine closed later would leak if it had been frozen.
"""

from __future__ import annotations

import gc
import logging
import threading

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_frozen = False


def freeze_long_lived() -> None:
    """Collect, then move every object alive now out of the cyclic collector's reach. Once per
    process: objects made later (another engine a test closes again) stay collectable."""
    global _frozen
    with _lock:
        if _frozen:
            return
        _frozen = True
        gc.collect()
        gc.freeze()
    logger.info("%d long-lived objects moved out of the collector's reach", gc.get_freeze_count())
