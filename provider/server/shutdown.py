"""Graceful shutdown under uvicorn: drain on SIGTERM before uvicorn closes anything.

uvicorn's own SIGTERM handling closes every WebSocket at once (code 1012) and only then waits
for HTTP responses; streams in flight would be cut mid-sentence. `DrainingServer` replaces its
signal handler: the first SIGTERM/SIGINT stops accepting connections, lets in-flight streams
finish for up to the drain timeout, cancels the rest with a final `cancelled` event, closes
the WebSockets with 1001 and only then lets uvicorn exit. A second signal forces the exit.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn

from intone.provider.server.runtime import Runtime

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, runtime: Runtime, drain_timeout: float):
        super().__init__(config)
        self.runtime = runtime
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started and self.port is not None:
            host = self.config.host if self.config.host not in ("0.0.0.0", "::") else "127.0.0.1"
            logger.info("demo page: http://%s:%d/", host, self.port)

    @property
    def port(self) -> int | None:
        """The bound port (useful with port 0)."""
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                return sock.getsockname()[1]
        return None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Replaces uvicorn's handler, which also records the signal to re-raise it after
        # shutdown: the process would then die of SIGTERM instead of exiting 0 after a drain.
        if self._drain_task is not None:
            logger.warning("second signal: exiting without waiting for the drain")
            self.force_exit = True
            self.should_exit = True
            return
        if self._loop is None or self.should_exit:
            self.should_exit = True  # not serving yet (or already leaving): nothing to drain
            return
        self._loop.call_soon_threadsafe(self._begin_drain, sig)

    def _begin_drain(self, sig: int) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self.drain(signal.Signals(sig).name))

    async def drain(self, reason: str = "shutdown") -> None:
        logger.info("%s: stop accepting connections and drain", reason)
        for server in getattr(self, "servers", []):
            server.close()  # the listening sockets only; open connections carry on
        try:
            await self.runtime.drain(self.drain_timeout)
        except Exception:
            logger.exception("drain failed")
        finally:
            self.should_exit = True
