"""What one server process shares: the engine, its voices, the streams in flight, the drain.

The app gets its engine either ready-made (the caller owns it) or from a factory that runs on
first use. Lazy start matters because a sub-app mounted in a user's FastAPI/Starlette app (and
some hosts) never sees lifespan events; the lifespan, when it runs, only makes the start eager.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Protocol

from intone.engine import Engine
from intone.provider.server.metrics import ServerMetrics
from intone.provider.server.settings import ServerSettings
from intone.provider.server.voices import VoiceResolver, add_voice_dir

logger = logging.getLogger(__name__)


def server_version() -> str:
    try:
        return metadata.version("intone")
    except metadata.PackageNotFoundError:  # running from a source tree
        return "unknown"


def model_name(source: str) -> str:
    """What clients are told about the checkpoint: its hub id or its file's stem, never a local
    directory (it would tell a stranger how the host is laid out)."""
    if source.startswith("hf://"):
        return source
    return PurePosixPath(source.replace("\\", "/")).stem or "model"


class EngineUnavailableError(RuntimeError):
    """The engine could not be built; requests get 503."""


class InFlight(Protocol):
    """A stream the drain can end: WebSocket stream or HTTP response."""

    request_id: str

    def shutdown(self) -> None:
        """Cancel now and tell the client with a final event."""


class Closable(Protocol):
    async def close(self, code: int, reason: str) -> None: ...


class Runtime:
    def __init__(
        self,
        engine: Engine | None = None,
        *,
        engine_factory: Callable[[], Engine] | None = None,
        voices_dir: str | Path | None = None,
        settings: ServerSettings | None = None,
    ):
        if engine is None and engine_factory is None:
            raise ValueError("pass an engine or an engine_factory")
        self.settings = settings or ServerSettings()
        self.settings.validate()
        self._engine = engine
        self.owns_engine = engine is None
        self._factory = engine_factory
        self._voices_dir = Path(voices_dir) if voices_dir is not None else None
        self._lock: asyncio.Lock | None = None
        self._failure: Exception | None = None
        self.voices: VoiceResolver | None = None
        self.streams: set[InFlight] = set()
        self.connections: set[Closable] = set()
        self.draining = False
        self.closed = False
        self.version = server_version()
        self.metrics = ServerMetrics(lambda: len(self.connections), lambda: len(self.streams))

    # ---- engine

    @property
    def engine(self) -> Engine | None:
        """The engine once ready(), else None."""
        return self._engine if self.voices is not None else None

    async def ready(self) -> Engine:
        """The started engine with its voices; built on first call."""
        if self.voices is not None and self._engine is not None:
            return self._engine
        if self._failure is not None:
            raise EngineUnavailableError(str(self._failure)) from self._failure
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.voices is None:
                try:
                    await self._prepare()
                except Exception as e:
                    # Building is slow and failures are configuration errors: don't retry.
                    if isinstance(e, ValueError | FileNotFoundError):
                        logger.error("the engine could not be started: %s", e)
                    else:
                        logger.exception("the engine could not be started")
                    self._failure = e
                    raise EngineUnavailableError(str(e)) from e
        assert self._engine is not None
        return self._engine

    async def _prepare(self) -> None:
        if self._engine is None:
            assert self._factory is not None
            started = time.perf_counter()
            self._engine = await asyncio.to_thread(self._factory)
            logger.info("engine built in %.1f s", time.perf_counter() - started)
        self._engine.start()
        if self._voices_dir is not None:
            await asyncio.to_thread(add_voice_dir, self._engine, self._voices_dir)
        known = set(self._engine.voices) | set(self._engine.loaded.voices)
        for alias, target in self.settings.voice_aliases.items():
            if target not in known:
                raise ValueError(f"voice alias {alias}={target}: no voice {target!r}")
        self.voices = VoiceResolver(self._engine, self.settings.voice_aliases)
        loaded = self._engine.loaded
        logger.info(
            "serving %s (%s weights), voices %s",
            loaded.source,
            loaded.weights,
            self._engine.voices,
            extra={"weights": loaded.weights, "source": loaded.source},
        )

    # ---- streams and connections

    def add_stream(self, stream: InFlight) -> None:
        self.streams.add(stream)

    def remove_stream(self, stream: InFlight) -> None:
        self.streams.discard(stream)

    def add_connection(self, connection: Closable) -> None:
        self.connections.add(connection)
        self.metrics.connection_opened()

    def remove_connection(self, connection: Closable) -> None:
        self.connections.discard(connection)

    # ---- shutdown

    async def drain(self, timeout: float | None = None) -> None:
        """Refuse new streams, give in-flight ones `timeout` s to finish, cancel the rest (each
        gets a final event), then close the WebSocket connections with 1001 (going away)."""
        timeout = self.settings.drain_timeout if timeout is None else timeout
        self.draining = True
        self.metrics.draining = True
        logger.info("draining: %d stream(s) in flight, up to %.1f s", len(self.streams), timeout)
        deadline = time.monotonic() + timeout
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.streams:
            logger.warning("drain deadline: cancelling %d stream(s)", len(self.streams))
            for stream in list(self.streams):
                stream.shutdown()
        # Let the final events and HTTP responses go out before the connections close.
        settle = time.monotonic() + 2.0
        while self.streams and time.monotonic() < settle:
            await asyncio.sleep(0.02)
        await asyncio.gather(
            *(c.close(1001, "server shutting down") for c in list(self.connections)),
            return_exceptions=True,
        )
        logger.info("drained")

    async def close(self) -> None:
        """Cancel whatever is left and release an engine this runtime built."""
        if self.closed:
            return
        self.closed = True
        self.draining = True
        for stream in list(self.streams):
            stream.shutdown()
        if self.owns_engine and self._engine is not None:
            await asyncio.to_thread(self._engine.close)
            logger.info("engine closed")
