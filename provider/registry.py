"""One engine per process, shared by every framework session that speaks through it.

Requests only batch when they reach the same `Engine`, so the LiveKit plugin and the Pipecat
service never build engines of their own: they take a lease on the process-wide engine of their
model from this registry. Leases are reference-counted. Releasing one never stops the engine under
the other holders; the engine is closed when the last lease goes, unless it was pinned with
`prewarm()`, which keeps it for the life of the process (what a worker wants: no reload between
jobs). A model's spellings share one engine (`model_names.model_key`).

The registry is thread-safe: LiveKit's thread executor runs each job on its own thread and event
loop, and all of them acquire from here. Loading blocks, so async callers use `acquire_async`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass

from intone.engine import Engine, EngineConfig, GenerationOptions, LoadedModel
from intone.engine.collector import freeze_long_lived
from intone.provider.model_names import ModelSpec, model_key

logger = logging.getLogger(__name__)

# The warm-up utterance: short, but long enough to run a prefill, AR steps and the decoder.
WARMUP_TEXT = "Hello."
WARMUP_MAX_FRAMES = 8


@dataclass
class _Entry:
    key: str
    engine: Engine
    refs: int = 0
    pinned: bool = False


_lock = threading.Lock()
_entries: dict[str, _Entry] = {}
_loading: dict[str, threading.Lock] = {}


class EngineLease:
    """A counted reference to a shared engine. `release()` is idempotent."""

    def __init__(self, entry: _Entry | None, engine: Engine):
        self._entry = entry
        self._engine = engine
        self._released = False

    @property
    def engine(self) -> Engine:
        if self._released:
            raise RuntimeError("this engine lease was released")
        return self._engine

    @property
    def released(self) -> bool:
        return self._released

    @property
    def shared(self) -> bool:
        """False for a borrowed engine (`borrow`), which the registry never closes."""
        return self._entry is not None

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        entry = self._entry
        if entry is None:
            return
        with _lock:
            entry.refs -= 1
            closing = entry.refs <= 0 and not entry.pinned and _entries.get(entry.key) is entry
            if closing:
                del _entries[entry.key]
        if closing:
            logger.info("closing the shared engine of %s: no users left", entry.key)
            entry.engine.close()


def borrow(engine: Engine) -> EngineLease:
    """A lease on an engine the caller owns: nothing is counted and nothing is closed."""
    return EngineLease(None, engine)


def acquire(
    model: ModelSpec = None, *, config: EngineConfig | None = None, warm: bool = True
) -> EngineLease:
    """A lease on the process-wide engine of `model`, loading and starting it on first use.

    Blocks while the model loads; concurrent callers for the same model wait for that one load.
    `config` applies only when this call creates the engine: later callers share the first
    engine whatever they pass (a mismatch is logged).
    """
    key = model_key(model)
    with _lock:
        load_lock = _loading.setdefault(key, threading.Lock())
    with load_lock:
        with _lock:
            entry = _entries.get(key)
            if entry is not None:
                entry.refs += 1
        if entry is None:
            engine = _start_engine(model, config, warm)
            with _lock:
                entry = _entries[key] = _Entry(key, engine, refs=1)
        elif config is not None and config != entry.engine.config:
            logger.warning(
                "the shared engine of %s already runs with %s; ignoring %s",
                key,
                entry.engine.config,
                config,
            )
    return EngineLease(entry, entry.engine)


def acquire_loaded(model: ModelSpec = None) -> EngineLease | None:
    """A lease on the shared engine of `model` if it is already running; never loads."""
    with _lock:
        entry = _entries.get(model_key(model))
        if entry is None:
            return None
        entry.refs += 1
    return EngineLease(entry, entry.engine)


async def acquire_async(
    model: ModelSpec = None, *, config: EngineConfig | None = None, warm: bool = True
) -> EngineLease:
    """`acquire` off the event loop, so a model load never stalls the other sessions."""
    return await asyncio.to_thread(acquire, model, config=config, warm=warm)


def prewarm(model: ModelSpec = None, *, config: EngineConfig | None = None) -> Engine:
    """Load, start and warm the shared engine of `model` and keep it for the process lifetime
    (what is alive then is never walked by the garbage collector again: `freeze_long_lived`)."""
    lease = acquire(model, config=config, warm=True)
    assert lease._entry is not None
    with _lock:
        lease._entry.pinned = True
    lease.release()
    freeze_long_lived()
    return lease._engine


def engines() -> list[Engine]:
    with _lock:
        return [entry.engine for entry in _entries.values()]


def users(model: ModelSpec = None) -> int:
    """How many leases hold the shared engine of `model` (0 if there is none)."""
    with _lock:
        entry = _entries.get(model_key(model))
        return entry.refs if entry is not None else 0


def shutdown() -> None:
    """Close every shared engine, pinned or not (process exit, tests)."""
    with _lock:
        entries = list(_entries.values())
        _entries.clear()
    for entry in entries:
        entry.engine.close()


def _start_engine(model: ModelSpec, config: EngineConfig | None, warm: bool) -> Engine:
    if isinstance(model, LoadedModel):
        engine = Engine(model, config).start()
    else:
        engine = Engine.from_model(model, config).start()
    logger.info("started the shared engine of %s", model_key(model))
    if warm:
        warm_up(engine)
    return engine


def warm_up(engine: Engine) -> None:
    """Make the decoder's traces and run one short generation, so the first real request does
    not pay for lazy setup.

    The generation runs on a thread of its own with a private event loop, so it works whether
    or not the caller is inside one.
    """
    engine.prepare_traces()
    if engine.default_voice is None:
        logger.debug("no default voice: skipping the warm-up")
        return
    options = GenerationOptions(
        max_frames=WARMUP_MAX_FRAMES, chain_frames=engine.config.default_chain_frames
    )
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(engine.synthesize(WARMUP_TEXT, options=options))
        except BaseException as e:  # reported on the caller's thread
            errors.append(e)

    thread = threading.Thread(target=run, name="intone-warmup", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


# ---- load reporting


def occupancy(engine: Engine) -> float:
    """How full the engine is, 0..1: requests generating or queued over its batch slots."""
    metrics = engine.metrics()
    busy = metrics["active_requests"] + metrics["queued_requests"]
    return min(1.0, busy / engine.config.max_active)


def load() -> float:
    """The occupancy of the fullest shared engine of this process, 0..1 (0 with none)."""
    return max((occupancy(engine) for engine in engines()), default=0.0)
