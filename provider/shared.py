"""One engine per process, shared by every framework session that speaks through it.

Requests only batch when they reach the same `Engine`, so the LiveKit plugin and the Pipecat
service never build engines of their own: they take a lease on the process-wide engine of their
model from this registry. Leases are reference-counted. Releasing one never stops the engine under
the other holders; the engine is closed when the last lease goes, unless it was pinned with
`prewarm()`, which keeps it for the life of the process (what a worker wants: no reload between
jobs).

The registry is thread-safe: LiveKit's thread executor runs each job on its own thread and event
loop, and all of them acquire from here. Loading blocks, so async callers use `acquire_async`.

Both frameworks also drive a remote engine (`intone serve`) through `intone.provider.client`.
`SpeechBackend` / `SpeechStream` hide the difference: `EngineBackend` (a lease on the local
engine) and `RemoteBackend` (a client connection per event loop) open streams that take text and
yield the engine's `AudioChunk` / `ClauseDone` events alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from intone.engine import (
    AudioChunk,
    ClauseDone,
    Engine,
    EngineClosedError,
    EngineConfig,
    GenerationOptions,
    IdleTimeoutError,
    InvalidOptionError,
    LoadedModel,
    Stream,
    StreamClosedError,
    UnknownVoiceError,
    releases,
)
from intone.engine.events import WordTiming
from intone.engine.loading import DEFAULT_MODEL
from intone.engine.options import option_names
from intone.provider.server import protocol
from intone.provider.server.protocol import ErrorCode

logger = logging.getLogger(__name__)

# The warm-up utterance: short, but long enough to run a prefill, AR steps and the decoder.
WARMUP_TEXT = "Hello."
WARMUP_MAX_FRAMES = 8

ModelSpec = str | Path | LoadedModel | None


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
    """Run one short generation so the first real request does not pay for lazy setup.

    It runs on a thread of its own with a private event loop, so it works whether or not the
    caller is inside one.
    """
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


def ensure_voice(engine: Engine, voice: str | None) -> str | None:
    """Register `voice` with the engine if it is a checkpoint voice or a file not yet loaded.

    The engine prefills only the default voice at start; the checkpoint's other named voices
    (the released model has 17) and voice files are added on first use. Blocks: call it off the
    event loop.
    """
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


# ---- audio


def to_pcm16(samples: np.ndarray) -> bytes:
    """float32 in [-1, 1] to little-endian int16 PCM."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


class Resampler:
    """A streaming float32 resampler, or a pass-through when the rates match."""

    def __init__(self, in_rate: int, out_rate: int):
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream = None
        if in_rate != out_rate:
            import soxr

            self._stream = soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32")

    def push(self, samples: np.ndarray) -> np.ndarray:
        if self._stream is None:
            return samples
        return self._stream.resample_chunk(samples.astype(np.float32, copy=False))

    def flush(self) -> np.ndarray:
        if self._stream is None:
            return np.zeros(0, dtype=np.float32)
        return self._stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)


# ---- one interface over the in-process engine and a remote one


class SpeechStream(Protocol):
    """One request, in-process or remote: text in, `AudioChunk`/`ClauseDone` out."""

    @property
    def sample_rate(self) -> int:
        """The rate of the audio it yields."""
        ...

    @property
    def submitted_clauses(self) -> int:
        """Clauses handed to the engine so far (0 where unknown)."""
        ...

    @property
    def request_id(self) -> str:
        """The engine's (or the server's) id of this request, for traces and logs."""
        ...

    async def push_text(self, text: str) -> None: ...
    async def end_input(self) -> None: ...
    def cancel(self) -> None:
        """Stop now: iteration ends, no audio after this, engine state is released."""
        ...

    def __aiter__(self) -> AsyncIterator[AudioChunk | ClauseDone]: ...


class SpeechBackend(Protocol):
    @property
    def shared_engine(self) -> Engine | None: ...
    async def open_stream(
        self,
        voice: str | None,
        settings: dict[str, Any],
        sample_rate: int | None = None,
        model: str | None = None,
    ) -> SpeechStream:
        """A new request. `settings`: GenerationOptions fields. `sample_rate`: the rate wanted,
        which a remote server resamples to; the in-process engine yields its own rate.
        `model`: which of a remote server's models speaks (None: its default); an in-process
        backend is one engine, one model (see `Backends`)."""
        ...

    async def aclose(self) -> None: ...


class EngineSpeech:
    """The engine's `Stream` as a `SpeechStream`.

    A turn may wait on a slow tool call for longer than the engine's idle timeout. If its engine
    stream times out mid-turn (`IdleTimeoutError`) and `reopen` is given, the turn goes on: its
    later text opens a fresh engine stream (`reopen()`), whose audio continues the iteration.
    """

    def __init__(
        self, stream: Stream, sample_rate: int, reopen: Callable[[], Stream] | None = None
    ):
        self.stream = stream
        self.sample_rate = sample_rate
        self._reopen = reopen
        self._earlier_clauses = 0  # submitted to engine streams that timed out
        self._timed_out = False
        self._input_ended = False
        self._changed = asyncio.Event()  # a fresh stream, the end of input, or a cancel

    @property
    def submitted_clauses(self) -> int:
        return self._earlier_clauses + self.stream.metrics.clauses

    def _fresh_stream(self) -> None:
        if self._timed_out and self._reopen is not None:
            self._earlier_clauses += self.stream.metrics.clauses
            self.stream = self._reopen()
            self._timed_out = False
            self._changed.set()

    @property
    def request_id(self) -> str:
        return self.stream.id

    async def push_text(self, text: str) -> None:
        self._fresh_stream()
        try:
            self.stream.push_text(text)
        except StreamClosedError:
            # Closed under us: the idle timeout, not yet seen by the iteration. (Any other end
            # of the stream reaches the iteration as its error.)
            if self._reopen is None or self._input_ended:
                raise
            self._timed_out = True
            self._fresh_stream()
            self.stream.push_text(text)

    async def end_input(self) -> None:
        self._input_ended = True
        self._changed.set()
        if not self._timed_out:
            with contextlib.suppress(StreamClosedError):  # timed out: nothing more to say
                self.stream.end_input()

    def cancel(self) -> None:
        self._input_ended = True
        self._changed.set()
        self.stream.cancel()

    async def __aiter__(self) -> AsyncIterator[AudioChunk | ClauseDone]:
        while True:
            current = self.stream
            try:
                async for event in current:
                    yield event
                return
            except IdleTimeoutError:
                if self._reopen is None or (self._input_ended and current is self.stream):
                    raise
                logger.info("the engine stream timed out mid-turn; later text opens a new one")
            if current is self.stream:  # no text since: wait for some, or for the turn's end
                self._timed_out = True
                while self._timed_out and not self._input_ended:
                    self._changed.clear()
                    await self._changed.wait()
                if self._timed_out:
                    return


class EngineBackend:
    """The in-process engine behind a lease."""

    def __init__(self, lease: EngineLease):
        self._lease = lease

    @property
    def engine(self) -> Engine:
        return self._lease.engine

    @property
    def shared_engine(self) -> Engine | None:
        return self._lease.engine

    async def open_stream(
        self,
        voice: str | None,
        settings: dict[str, Any],
        sample_rate: int | None = None,
        model: str | None = None,
    ) -> EngineSpeech:
        engine = self._lease.engine
        if voice is not None and voice not in engine.voices:
            await asyncio.to_thread(ensure_voice, engine, voice)
        options = engine_options(engine, settings)
        return EngineSpeech(
            engine.stream(voice, options),
            engine.sample_rate,
            reopen=lambda: engine.stream(voice, options),
        )

    async def aclose(self) -> None:
        if not self._lease.released:
            # Closing the last lease joins the engine threads: keep that off the event loop.
            await asyncio.to_thread(self._lease.release)


def engine_options(engine: Engine, settings: dict[str, Any]) -> GenerationOptions:
    """GenerationOptions from the settings given, with this engine's defaults for the rest."""
    unknown = set(settings) - set(option_names())
    if unknown:
        raise InvalidOptionError(f"unknown generation settings: {sorted(unknown)}")
    values = {
        "chain_frames": engine.config.default_chain_frames,
        # Fixed per engine: the flow head's step count is compiled into its batches.
        "flow_steps": engine.config.flow_steps,
    }
    values.update({k: v for k, v in settings.items() if v is not None and k != "flow_steps"})
    return GenerationOptions(**values)


# ---- remote engine (`intone serve`) through intone.provider.client

# Error codes of the server a retry can cure.
_BUSY_CODES = {
    ErrorCode.SERVER_BUSY,
    ErrorCode.TOO_MANY_STREAMS,
    ErrorCode.SHUTTING_DOWN,
    ErrorCode.TOO_MANY_CONNECTIONS,
    ErrorCode.RATE_LIMITED,
}
_SERVER_CODES = {ErrorCode.ENGINE_ERROR, ErrorCode.INTERNAL_ERROR}


def remote_error_status(e: BaseException) -> tuple[int | None, bool] | None:
    """For a remote failure: (HTTP-like status, or None for a connection failure; retryable).

    None if `e` is not a remote failure.
    """
    from intone.provider.client import IntoneConnectionError, IntoneError

    if isinstance(e, IntoneConnectionError):
        return None, True
    if isinstance(e, IntoneError):
        if e.code in _BUSY_CODES:
            return 503, True
        if e.code in _SERVER_CODES:
            return 500, True
        return 400, False  # the request itself is wrong: unknown voice, bad options or text
    if isinstance(e, OSError):  # refused, unreachable, reset
        return None, True
    try:
        from websockets.exceptions import InvalidHandshake, InvalidURI
    except ImportError:  # pragma: no cover
        return None
    if isinstance(e, InvalidURI):
        return None, False
    if isinstance(e, InvalidHandshake):
        return None, True
    return None


class RemoteSpeech:
    """A client stream of `intone serve` as a `SpeechStream` (float32 audio, clause events)."""

    def __init__(self, backend: RemoteBackend, stream: Any):
        self._backend = backend
        self.stream = stream
        self.sample_rate: int = stream.sample_rate
        self._cancelling = False

    @property
    def submitted_clauses(self) -> int:
        return 0  # the server does not report it while the input is open

    @property
    def request_id(self) -> str:
        return self.stream.request_id or ""

    async def push_text(self, text: str) -> None:
        await self.stream.push_text(text)

    async def end_input(self) -> None:
        await self.stream.end_input()

    def cancel(self) -> None:
        if self._cancelling or self.stream.done:
            return
        self._cancelling = True
        # Callers cancel from `except CancelledError` and `finally`, where awaiting is fragile:
        # the message goes out on a task of its own, and the stream stops yielding at once.
        self._backend._spawn(self.stream.cancel(wait=False))

    async def __aiter__(self) -> AsyncIterator[AudioChunk | ClauseDone]:
        clause = 0
        async for item in self.stream.events():
            if self._cancelling:
                return
            if isinstance(item, bytes):
                yield AudioChunk(np.frombuffer(item, dtype="<f4"), clause)
            elif isinstance(item, protocol.ClauseDoneEvent):
                yield ClauseDone(
                    item.clause,
                    item.text,
                    item.frames,
                    start_sample=round(item.start * self.sample_rate),
                    samples=round(item.audio_seconds * self.sample_rate),
                    words=[WordTiming(w.word, w.start, w.end) for w in item.words],
                )
                clause += 1
            else:
                logger.warning("intone server: %s: %s", item.code, item.message)


class RemoteBackend:
    """`intone serve` over WebSocket: one connection per event loop, many streams on it.

    The client belongs to one event loop; an instance used from several (LiveKit's thread
    executor runs a loop per job) opens a connection on each.
    """

    def __init__(self, base_url: str, *, open_timeout: float = 10.0):
        from intone.provider.client import ws_url

        ws_url(base_url)  # a bad URL fails here, not at the first turn
        self.base_url = base_url
        self.open_timeout = open_timeout
        self._lock = threading.Lock()
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = (
            weakref.WeakKeyDictionary()
        )
        self._connect_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )
        self._tasks: set[asyncio.Task] = set()

    @property
    def shared_engine(self) -> Engine | None:
        return None

    @property
    def server_model(self) -> str | None:
        """The model the server runs, from its hello (None before the first connection)."""
        with self._lock:
            clients = list(self._clients.values())
        return next((c.hello.model for c in clients if c.hello is not None), None)

    async def _client(self) -> Any:
        from intone.provider.client import IntoneClient

        loop = asyncio.get_running_loop()
        with self._lock:
            client = self._clients.get(loop)
            connect_lock = self._connect_locks.setdefault(loop, asyncio.Lock())
        if client is not None:
            return client
        async with connect_lock:
            with self._lock:
                client = self._clients.get(loop)
            if client is None:
                # reconnect: a dropped connection (a restarted server, a dead Ray Serve
                # replica) restarts the turns that had no audio yet on a new one.
                client = IntoneClient(self.base_url, open_timeout=self.open_timeout, reconnect=True)
                await client.connect()
                with self._lock:
                    self._clients[loop] = client
        return client

    def _forget(self, client: Any) -> None:
        with self._lock:
            for loop, known in list(self._clients.items()):
                if known is client:
                    del self._clients[loop]

    async def connect(self) -> None:
        """Open this loop's connection now (prewarm)."""
        await self._client()

    async def open_stream(
        self,
        voice: str | None,
        settings: dict[str, Any],
        sample_rate: int | None = None,
        model: str | None = None,
    ) -> RemoteSpeech:
        from intone.provider.client import IntoneConnectionError, IntoneError

        for attempt in range(2):
            client = None
            try:
                client = await self._client()  # a draining server refuses at the handshake
                stream = await client.stream(
                    voice=voice,
                    sample_rate=sample_rate,
                    format="pcm_f32le",
                    options=settings,
                    model=model,
                )
            except IntoneError as e:
                # The server restarted, the connection idled out, or this server (replica) is
                # draining: one fresh connection, which a load balancer sends elsewhere.
                if not isinstance(e, IntoneConnectionError) and e.code != "shutting_down":
                    raise
                if client is not None:
                    self._forget(client)
                if attempt:
                    raise
                continue
            return RemoteSpeech(self, stream)
        raise AssertionError("unreachable")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        with self._lock:
            clients = list(self._clients.items())
            self._clients.clear()
        current = asyncio.get_running_loop()
        for loop, client in clients:
            if loop is current:
                await client.close()
            elif loop.is_running():
                asyncio.run_coroutine_threadsafe(client.close(), loop)


def pick_model(model: ModelSpec, language: str | None) -> ModelSpec:
    """The model a TTS speaks with: `model` if given, else `language`'s (a code such as "fr"
    or "fr-FR"; `releases.LANGUAGE_MODELS`), else the default. An unknown language raises
    UnknownModelError naming the known ones: never a silent fallback to English."""
    if model is not None:
        return model
    if language is not None:
        return releases.model_for_language(language)
    return None


class Backends:
    """A TTS instance's speech backends, one per model it speaks with.

    Remote (`base_url`): one `RemoteBackend`, the model named in each stream. In-process: a lease
    on each model's shared engine, taken on first use of that model, so a language change moves
    later turns to that language's engine. An engine of the caller's (`engine`): that engine only.
    Thread-safe: LiveKit's thread executor uses one instance from several event loops.
    """

    def __init__(
        self,
        *,
        base_url: str | None = None,
        engine: Engine | None = None,
        config: EngineConfig | None = None,
    ):
        if base_url is not None and engine is not None:
            raise ValueError("pass either base_url (remote) or engine (in-process), not both")
        self.base_url = base_url
        self._own_engine = engine
        self._config = config
        self._lock = threading.Lock()
        self._backends: dict[str, SpeechBackend] = {}
        self._closed = False
        # Created now: a bad URL fails at construction, not at the first turn.
        self.remote = RemoteBackend(base_url) if base_url is not None else None

    def _key(self, model: ModelSpec) -> str:
        if self.remote is not None:
            return "remote"
        if self._own_engine is not None:
            return "own"
        return model_key(model)

    def adopt_loaded(self, model: ModelSpec) -> None:
        """Take the backend of `model` now if that needs no load: the caller's engine, or a
        shared engine already running (`acquire_loaded`). Remote: nothing to take."""
        if self.remote is not None:
            return
        if self._own_engine is not None:
            self.get_sync(model)  # borrowed: nothing to load
            return
        lease = acquire_loaded(model)
        if lease is None:
            return
        with self._lock:
            if self._key(model) not in self._backends and not self._closed:
                self._backends[self._key(model)] = EngineBackend(lease)
                return
        lease.release()

    def current(self, model: ModelSpec) -> SpeechBackend | None:
        """The backend of `model` if one was made, else None."""
        if self.remote is not None:
            return self.remote
        with self._lock:
            return self._backends.get(self._key(model))

    def get_sync(self, model: ModelSpec) -> SpeechBackend:
        """The backend of `model`, loading its engine if needed (blocks)."""
        if self.remote is not None:
            return self.remote
        key = self._key(model)
        with self._lock:
            if self._closed:
                raise EngineClosedError("this TTS is closed")
            backend = self._backends.get(key)
        if backend is not None:
            return backend
        if self._own_engine is not None:
            made: SpeechBackend = EngineBackend(borrow(self._own_engine))
        else:
            made = EngineBackend(acquire(model, config=self._config))
        with self._lock:
            current = self._backends.get(key)
            if current is None and not self._closed:
                self._backends[key] = made
                return made
        # A concurrent call won the race, or the TTS closed meanwhile: give ours back.
        threading.Thread(target=lambda: asyncio.run(made.aclose()), daemon=True).start()
        if current is None:
            raise EngineClosedError("this TTS is closed")
        return current

    async def get(self, model: ModelSpec) -> SpeechBackend:
        """`get_sync` off the event loop when an engine has to be loaded."""
        backend = self.current(model)
        if backend is not None:
            return backend
        return await asyncio.to_thread(self.get_sync, model)

    async def open_stream(
        self,
        model: ModelSpec,
        voice: str | None,
        settings: dict[str, Any],
        sample_rate: int | None = None,
    ) -> SpeechStream:
        backend = await self.get(model)
        if self.remote is not None:
            name = None if model is None else str(getattr(model, "source", model))
            return await backend.open_stream(voice, settings, sample_rate, model=name)
        return await backend.open_stream(voice, settings, sample_rate)

    async def aclose(self) -> None:
        with self._lock:
            self._closed = True
            backends = list(self._backends.values())
            self._backends.clear()
        if self.remote is not None:
            backends.append(self.remote)
        for backend in backends:
            await backend.aclose()
