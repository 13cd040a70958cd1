"""One interface over the in-process engine and a remote one (`intone serve`).

`SpeechBackend` / `Speech` hide the difference: `EngineBackend` (a lease on the process's
shared engine, `registry.py`) and `RemoteBackend` (a client connection per event loop) open
streams that take text and yield the engine's `AudioChunk` / `ClauseDone` events alike, with the
same clause timing. `make_backend` is the one place that picks between them, for both plugins;
`Backends` keeps a plugin instance's backends, one per model it speaks with (several models per
process: a language change moves later turns to that language's engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Protocol, cast

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
    InvalidTextError,
    LoadedModel,
    Stream,
    StreamClosedError,
)
from intone.engine.events import WordTiming
from intone.engine.options import option_names
from intone.provider import protocol, registry
from intone.provider.model_names import ModelSpec, model_key
from intone.provider.voices import bytes_voice_name, engine_voice

logger = logging.getLogger(__name__)


def make_backend(
    *,
    model: str | Path | LoadedModel | None = None,
    base_url: str | None = None,
    engine: Engine | None = None,
    engine_config: EngineConfig | None = None,
    load: bool = True,
) -> SpeechBackend | None:
    """The backend a plugin's arguments ask for: remote (`base_url`), an engine the caller owns
    (`engine`), or a lease on the shared engine of `model`. `load=False` never loads a model:
    it returns None when the shared engine is not running yet (`Backends.get` loads it off the
    event loop). Blocks while a model loads."""
    if base_url is not None and engine is not None:
        raise ValueError("pass either base_url (remote) or engine (in-process), not both")
    if base_url is not None:
        return RemoteBackend(base_url)
    if engine is not None:
        return EngineBackend(registry.borrow(engine))
    if not load:
        lease = registry.acquire_loaded(model)
        return EngineBackend(lease) if lease is not None else None
    return EngineBackend(registry.acquire(model, config=engine_config))


class Speech(Protocol):
    """What a backend's `open_stream` returns: one request's speech, in-process or remote,
    text in, `AudioChunk`/`ClauseDone` out."""

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
        voice: str | bytes | None,
        settings: dict[str, Any],
        sample_rate: int | None = None,
        model: str | None = None,
    ) -> Speech:
        """A new request. `settings`: GenerationOptions fields. `sample_rate`: the rate wanted,
        which a remote server resamples to; the in-process engine yields its own rate.
        `voice`: a name (or a stored voice id, or a file path in process), or a voice file's
        bytes (registered in process, uploaded once to a server).
        `model`: which of a remote server's models speaks (None: its default); an in-process
        backend is one engine, one model (see `Backends`)."""
        ...

    async def aclose(self) -> None: ...


class EngineSpeech:
    """The engine's `Stream` as a `Speech`.

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
        try:
            self._push(text)
        except InvalidTextError as e:
            # Half of a UTF-16 pair an LLM's stream split: that piece is dropped and the turn
            # speaks on, as the server drops a `text` message it refuses as `bad_text` (which
            # RemoteSpeech logs the same way). Text over the turn's limit still fails the turn.
            logger.warning("intone engine: text dropped: %s", e)

    def _push(self, text: str) -> None:
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

    def __init__(self, lease: registry.EngineLease):
        self._lease = lease

    @property
    def engine(self) -> Engine:
        return self._lease.engine

    @property
    def shared_engine(self) -> Engine | None:
        return self._lease.engine

    async def open_stream(
        self,
        voice: str | bytes | None,
        settings: dict[str, Any],
        sample_rate: int | None = None,
        model: str | None = None,
    ) -> EngineSpeech:
        engine = self._lease.engine
        name: str | None = voice  # type: ignore[assignment]
        if voice is not None and (isinstance(voice, bytes) or voice not in engine.voices):
            # A checkpoint voice, a file or a file's bytes: registered once, off the loop.
            name = await asyncio.to_thread(engine_voice, engine, voice)
        options = engine_options(engine, settings)
        return EngineSpeech(
            engine.stream(name, options),
            engine.sample_rate,
            reopen=lambda: engine.stream(name, options),
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


class RemoteSpeech:
    """A client stream of `intone serve` as a `Speech` (float32 audio, clause events)."""

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
                    sample_count=round(item.audio_seconds * self.sample_rate),
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
        self._uploads: dict[tuple[str, str | None], str] = {}  # voices given as bytes: their ids

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
        voice: str | bytes | None,
        settings: dict[str, Any],
        sample_rate: int | None = None,
        model: str | None = None,
    ) -> RemoteSpeech:
        from intone.provider.client import IntoneConnectionError, IntoneError, IntoneTimeoutError

        for attempt in range(2):
            client = None
            try:
                client = await self._client()  # a draining server refuses at the handshake
                name = await self._uploaded(client, voice, model, fresh=attempt > 0)
                stream = await client.stream(
                    voice=name,
                    sample_rate=sample_rate,
                    format="pcm_f32le",
                    options=settings,
                    model=model,
                )
            except IntoneError as e:
                # The server restarted, the connection idled out, or this server (replica) is
                # draining, or hung: one fresh connection, which a load balancer sends elsewhere.
                retry = isinstance(e, IntoneConnectionError | IntoneTimeoutError)
                # An upload the server no longer has (a restart without --voice-store): again.
                lost = isinstance(voice, bytes) and e.code == "unknown_voice"
                if not retry and not lost and e.code != "shutting_down":
                    raise
                if client is not None:
                    self._forget(client)
                if attempt:
                    raise
                continue
            return RemoteSpeech(self, stream)
        raise AssertionError("unreachable")

    async def _uploaded(
        self, client: Any, voice: str | bytes | None, model: str | None, fresh: bool
    ) -> str | None:
        """The server's id for a voice given as bytes: uploaded once per content and model."""
        if not isinstance(voice, bytes):
            return voice
        key = (bytes_voice_name(voice), model)
        with self._lock:
            known = None if fresh else self._uploads.get(key)
        if known is None:
            known = (await client.add_voice(voice, model=model))["id"]
            with self._lock:
                self._uploads[key] = known
        return known

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


class Backends:
    """A TTS instance's speech backends, one per model it speaks with, each made by
    `make_backend`.

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
        self.remote = (
            cast(RemoteBackend, make_backend(base_url=base_url)) if base_url is not None else None
        )

    def _key(self, model: ModelSpec) -> str:
        if self.remote is not None:
            return "remote"
        if self._own_engine is not None:
            return "own"
        return model_key(model)

    def _make(self, model: ModelSpec, load: bool) -> SpeechBackend | None:
        return make_backend(
            model=None if self._own_engine is not None else model,
            engine=self._own_engine,
            engine_config=self._config,
            load=load,
        )

    def adopt_loaded(self, model: ModelSpec) -> None:
        """Take the backend of `model` now if that needs no load: the caller's engine, or a
        shared engine already running. Remote: nothing to take."""
        if self.remote is not None:
            return
        made = self._make(model, load=False)
        if made is None:
            return
        with self._lock:
            if self._key(model) not in self._backends and not self._closed:
                self._backends[self._key(model)] = made
                return
        _close_soon(made)

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
        made = self._make(model, load=True)
        assert made is not None
        with self._lock:
            current = self._backends.get(key)
            if current is None and not self._closed:
                self._backends[key] = made
                return made
        # A concurrent call won the race, or the TTS closed meanwhile: give ours back.
        _close_soon(made)
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
    ) -> Speech:
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


def _close_soon(backend: SpeechBackend) -> None:
    """Give a backend back without blocking the caller (closing the last lease joins threads)."""
    threading.Thread(target=lambda: asyncio.run(backend.aclose()), daemon=True).start()
