"""One interface over the in-process engine and a remote one (`intone serve`).

`SpeechBackend` / `SpeechStream` hide the difference: `EngineBackend` (a lease on the process's
shared engine, `registry.py`) and `RemoteBackend` (a client connection per event loop) open
streams that take text and yield the engine's `AudioChunk` / `ClauseDone` events alike, with the
same clause timing. `make_backend` is the one place that picks between them, for both plugins.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import AsyncIterator
from dataclasses import fields
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from intone.engine import (
    AudioChunk,
    ClauseDone,
    Engine,
    EngineConfig,
    GenerationOptions,
    LoadedModel,
    Stream,
)
from intone.engine.errors import InvalidOptionError
from intone.engine.timeline import WordTiming
from intone.provider import registry
from intone.provider.server import protocol

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
    it returns None when the shared engine is not running yet (load it off the event loop with
    `make_backend_async`). Blocks while a model loads."""
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


async def make_backend_async(**kwargs: Any) -> SpeechBackend:
    """`make_backend` off the event loop, so a model load never stalls the other sessions."""
    backend = await asyncio.to_thread(make_backend, **kwargs)
    assert backend is not None
    return backend


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
        self, voice: str | None, settings: dict[str, Any], sample_rate: int | None = None
    ) -> SpeechStream:
        """A new request. `settings`: GenerationOptions fields. `sample_rate`: the rate wanted,
        which a remote server resamples to; the in-process engine yields its own rate."""
        ...

    async def aclose(self) -> None: ...


class EngineSpeech:
    """The engine's `Stream` as a `SpeechStream`."""

    def __init__(self, stream: Stream, sample_rate: int):
        self.stream = stream
        self.sample_rate = sample_rate

    @property
    def submitted_clauses(self) -> int:
        return self.stream.metrics.clauses

    @property
    def request_id(self) -> str:
        return self.stream.id

    async def push_text(self, text: str) -> None:
        self.stream.push_text(text)

    async def end_input(self) -> None:
        self.stream.end_input()

    def cancel(self) -> None:
        self.stream.cancel()

    def __aiter__(self) -> AsyncIterator[AudioChunk | ClauseDone]:
        return self.stream.__aiter__()


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
        self, voice: str | None, settings: dict[str, Any], sample_rate: int | None = None
    ) -> EngineSpeech:
        engine = self._lease.engine
        if voice is not None and voice not in engine.voices:
            await asyncio.to_thread(registry.ensure_voice, engine, voice)
        return EngineSpeech(
            engine.stream(voice, engine_options(engine, settings)), engine.sample_rate
        )

    async def aclose(self) -> None:
        if not self._lease.released:
            # Closing the last lease joins the engine threads: keep that off the event loop.
            await asyncio.to_thread(self._lease.release)


def engine_options(engine: Engine, settings: dict[str, Any]) -> GenerationOptions:
    """GenerationOptions from the settings given, with this engine's defaults for the rest."""
    known = {f.name for f in fields(GenerationOptions)}
    unknown = set(settings) - known
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
        self, voice: str | None, settings: dict[str, Any], sample_rate: int | None = None
    ) -> RemoteSpeech:
        from intone.provider.client import IntoneConnectionError, IntoneError

        for attempt in range(2):
            client = await self._client()
            try:
                stream = await client.stream(
                    voice=voice, sample_rate=sample_rate, format="pcm_f32le", options=settings
                )
            except IntoneError as e:
                # The server restarted, the connection idled out, or this server (replica) is
                # draining: one fresh connection, which a load balancer sends elsewhere.
                if not isinstance(e, IntoneConnectionError) and e.code != "shutting_down":
                    raise
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
