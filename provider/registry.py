"""One engine per process, shared by every framework session that speaks through it.

Requests only batch when they reach the same `Engine`, so the LiveKit plugin and the Pipecat
service never build engines of their own: they take a lease on the process-wide engine of their
model from this registry. Leases are reference-counted. Releasing one never stops the engine under
the other holders; the engine is closed when the last lease goes, unless it was pinned with
`prewarm()`, which keeps it for the life of the process (what a worker wants: no reload between
jobs).

The registry is thread-safe: LiveKit's thread executor runs each job on its own thread and event
loop, and all of them acquire from here. Loading blocks, so async callers use `acquire_async`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from intone.engine import Engine, EngineConfig, GenerationOptions, LoadedModel, releases
from intone.engine.errors import UnknownVoiceError
from intone.engine.loading import DEFAULT_MODEL

logger = logging.getLogger(__name__)

ModelSpec = str | Path | LoadedModel | None

# The warm-up utterance: short, but long enough to run a prefill, AR steps and the decoder.
WARMUP_TEXT = "Hello."
WARMUP_MAX_FRAMES = 8


def model_key(model: ModelSpec) -> str:
    """The registry key of a model: one engine per key per process."""
    if isinstance(model, LoadedModel):
        model = model.source
    name = DEFAULT_MODEL if model is None else str(model)
    release = releases.release_name(name)
    if release is not None:  # a release by any of its names ("fr", "french_24l")
        return DEFAULT_MODEL if release == releases.DEFAULT_RELEASE else release
    if name.startswith("hf://"):
        return name
    path = Path(name).expanduser().resolve()
    # A checkpoint directory and its config.yaml are the same model.
    return str(path / "config.yaml") if path.is_dir() else str(path)


def pick_model(model: ModelSpec, language: str | None) -> ModelSpec:
    """The model a TTS speaks with: `model` if given, else `language`'s (a code such as "fr"
    or "fr-FR"; `releases.LANGUAGE_MODELS`), else the default. An unknown language raises
    UnknownModelError naming the known ones: never a silent fallback to English."""
    if model is not None:
        return model
    if language is not None:
        return releases.model_for_language(language)
    return None


@dataclass
class _Entry:
    key: str
    engine: Engine
    refs: int = 0
    pinned: bool = False
    voice_lock: threading.Lock = field(default_factory=threading.Lock)


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
    """Load, start and warm the shared engine of `model` and keep it for the process lifetime."""
    lease = acquire(model, config=config, warm=True)
    assert lease._entry is not None
    with _lock:
        lease._entry.pinned = True
    lease.release()
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
    engine.prepare_decoder()
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


def bytes_voice_name(data: bytes) -> str:
    """The registry name of a voice given as a file's bytes: by content, so the same bytes
    are encoded once."""
    return "bytes-" + hashlib.sha256(data).hexdigest()[:24]


def ensure_voice(engine: Engine, voice: str | bytes | None) -> str | None:
    """Register `voice` with the engine if it is a checkpoint voice, a file not yet loaded or a
    file's bytes (audio or a voice state, checked as the server checks an upload:
    `VoiceRefusedError` with its code); returns the registry name.

    The engine prefills only the default voice at start; the checkpoint's other named voices
    (the released model has 17) and voice files are added on first use. Blocks: call it off the
    event loop.
    """
    if isinstance(voice, bytes):
        return _ensure_bytes_voice(engine, voice)
    if voice is None or voice in engine.voices:
        return voice
    source = engine.loaded.voices.get(voice)
    if source is None and Path(voice).expanduser().is_file():
        source = str(Path(voice).expanduser())
    if source is None and voice.startswith("hf://"):
        source = voice
    if source is None:
        raise UnknownVoiceError(f"unknown voice {voice!r}; known voices: {known_voices(engine)}")
    entry = _entry_of(engine)
    lock = entry.voice_lock if entry is not None else threading.Lock()
    with lock:
        if voice not in engine.voices:
            logger.info("adding voice %r from %s", voice, source)
            engine.add_voice(voice, source)
    return voice


def _ensure_bytes_voice(engine: Engine, data: bytes) -> str:
    from intone.provider.voice_input import decode_voice

    name = bytes_voice_name(data)
    entry = _entry_of(engine)
    lock = entry.voice_lock if entry is not None else threading.Lock()
    with lock:
        if name not in engine.voices:
            source = engine.loaded.source
            model = releases.release_name(source) or Path(source.replace("\\", "/")).stem
            voice, seconds = decode_voice(engine.model, model, data)
            logger.info("adding voice %r from %.1f s of audio given as bytes", name, seconds)
            engine.add_voice(name, voice)
    return name


def known_voices(engine: Engine) -> list[str]:
    return sorted(set(engine.voices) | set(engine.loaded.voices))


def _entry_of(engine: Engine) -> _Entry | None:
    with _lock:
        return next((e for e in _entries.values() if e.engine is engine), None)


# ---- load reporting


def occupancy(engine: Engine) -> float:
    """How full the engine is, 0..1: requests generating or queued over its batch slots."""
    metrics = engine.metrics()
    busy = metrics["active_requests"] + metrics["queued_requests"]
    return min(1.0, busy / engine.config.max_active)


def load() -> float:
    """The occupancy of the fullest shared engine of this process, 0..1 (0 with none)."""
    return max((occupancy(engine) for engine in engines()), default=0.0)
