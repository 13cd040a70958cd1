"""Helpers for the server and provider tests (no tests here): an in-process server on a free port.

uvicorn runs in a background thread with its own event loop, so tests drive it from their own
loops over real sockets, as any client would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from websockets.asyncio.client import ClientConnection

from intone.engine import Engine, EngineConfig, load_model
from intone.provider.protocol import unpack_audio
from intone.provider.server import ServerSettings, create_app
from intone.provider.server.serve import uvicorn_config

# Small limits so the limit tests are cheap.
TEST_SETTINGS = dict(max_streams_per_connection=4, max_message_bytes=4096)
LONG_TEXT = " ".join(
    f"This is sentence number {i} of a long text that keeps the engine busy for a while."
    for i in range(40)
)


class ServerThread:
    """uvicorn.Server serving `app` on 127.0.0.1:<free port> in a daemon thread, configured as
    `intone serve` configures it (for an intone app)."""

    def __init__(self, app: Any, lifespan: str = "on"):
        self.app = app
        runtime = getattr(getattr(app, "state", None), "intone", None)
        if runtime is not None:
            config = uvicorn_config(app, runtime.settings, "127.0.0.1", 0)
            config.lifespan = lifespan
        else:
            config = uvicorn.Config(
                app,
                host="127.0.0.1",
                port=0,
                log_config=None,
                lifespan=lifespan,
                ws_per_message_deflate=False,
            )
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="test-uvicorn")

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.server.serve())

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=15)

    def call(self, coroutine: Any, timeout: float = 30) -> Any:
        """Run a coroutine on the server's loop (e.g. the runtime's close)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"


# For a test that needs a stream still running when it acts (a barge-in, a lifetime cut):
# unpaced, the tiny engine renders seconds of audio in a fraction of a second; paced to a
# real-time listener a stream lasts about as long as its audio.
LISTENER_PACED: dict[str, Any] = {"pacing": "hold", "lead_s": 1.0}


def make_engine(checkpoint: Path, **config: Any) -> Engine:
    # As fast as the machine goes unless a test asks for playback pacing: these tests read
    # their audio as fast as it comes and wait for the end of long texts.
    config.setdefault("lead_s", None)
    config.setdefault("max_active", 16)  # not "auto": no start-up measurement per server
    return Engine(load_model(checkpoint), EngineConfig(**config)).start()


@contextlib.contextmanager
def running_server(
    checkpoint: Path,
    voices_dir: Path | None = None,
    engine_config: dict[str, Any] | None = None,
    voice_store: Path | None = None,
    **settings: Any,
) -> Iterator[tuple[ServerThread, Engine]]:
    engine = make_engine(checkpoint, **(engine_config or {}))
    app = create_app(
        engine,
        voices_dir=voices_dir,
        settings=ServerSettings(**{**TEST_SETTINGS, **settings}),
        voice_store=voice_store,
    )
    server = ServerThread(app).start()
    try:
        yield server, engine
    finally:
        server.stop()
        engine.close()


def idle_pages(engine: Engine) -> int:
    """KV pages held at rest: the voice prefixes."""
    return engine.metrics()["kv_pages_in_use"]


async def wait_engine_idle(engine: Engine, pages: int, timeout: float = 10.0) -> dict:
    """Poll until no request is active or queued and only `pages` KV pages are held."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = engine.metrics()
        if (
            metrics["active_requests"] == 0
            and metrics["queued_requests"] == 0
            and metrics["kv_pages_in_use"] == pages
            and metrics["decoder_states_in_use"] == 0
        ):
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout} s: {metrics}")
        await asyncio.sleep(0.02)


async def wait_server_streams(url: str, count: int = 0, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as http:
        while True:
            stats = (await http.get(f"{url}/stats")).json()
            if stats["server"]["streams"] == count:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"server streams != {count} after {timeout} s: {stats}")
            await asyncio.sleep(0.02)


async def recv_event(ws: ClientConnection, timeout: float = 10.0, skip_audio: bool = True) -> dict:
    """The next JSON event (binary frames skipped)."""
    while True:
        message = await asyncio.wait_for(ws.recv(), timeout)
        if isinstance(message, str):
            return json.loads(message)
        if not skip_audio:
            raise AssertionError(f"expected an event, got {len(message)} bytes of audio")


async def recv_until(
    ws: ClientConnection, predicate: Any, timeout: float = 10.0
) -> tuple[dict, list[Any]]:
    """Messages until an event matches; returns it and everything before it (events as dicts,
    audio as (channel, sequence, nbytes))."""
    seen: list[Any] = []
    deadline = time.monotonic() + timeout
    while True:
        message = await asyncio.wait_for(ws.recv(), max(0.01, deadline - time.monotonic()))
        if isinstance(message, str):
            event = json.loads(message)
            if predicate(event):
                return event, seen
            seen.append(event)
        else:
            channel, sequence, payload = unpack_audio(message)
            seen.append((channel, sequence, len(payload)))


def send(ws: ClientConnection, **message: Any) -> Any:
    return ws.send(json.dumps(message))


@contextlib.contextmanager
def serving(app):
    """An ASGI app on a free loopback port, on a thread of its own; yields its ws:// URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"ws://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
