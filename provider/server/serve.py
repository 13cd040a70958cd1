"""`intone serve`: build the engine, then run the app under uvicorn with a draining shutdown.

uvicorn has no timeout for a request's headers, so a client could hold a connection open by
sending them a byte at a time (slowloris): `uvicorn_config` installs an HTTP protocol that
closes a connection whose request headers are not complete `header_timeout` seconds after it
opened (or after its previous response).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from intone.engine import Engine, EngineConfig
from intone.provider.model_names import model_key
from intone.provider.server.access import LOOPBACK_HOSTS, is_loopback
from intone.provider.server.app import create_app
from intone.provider.server.logs import configure_logging
from intone.provider.server.model_source import load_serving_model
from intone.provider.server.runtime import EngineUnavailableError
from intone.provider.server.settings import ServerSettings
from intone.provider.server.shutdown import DrainingServer

logger = logging.getLogger(__name__)


@dataclass
class ServeOptions:
    # One engine per model; the first is the default. None or []: the released default model.
    model: str | list[str] | None = None
    voices_dir: Path | None = None
    voice_store: Path | None = None  # uploaded voices kept here; None: a temporary directory
    host: str = "127.0.0.1"
    port: int = 8000
    fallback_preset: str | None = "full"
    log_json: bool = False
    log_level: int = logging.INFO
    engine_config: EngineConfig = field(default_factory=EngineConfig)
    settings: ServerSettings = field(default_factory=ServerSettings)

    def __post_init__(self) -> None:
        # Before any model loads: the socket's own check comes after, as an OverflowError.
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ServeOptions.port must be in 0-65535, got {self.port}")
        # The same model twice would load it twice and split its requests between two engines
        # that never batch together ("ckpt" and "ckpt/config.yaml", "english" and "en").
        seen: dict[str, str | None] = {}
        for spec in self.model if isinstance(self.model, list) else [self.model]:
            key = model_key(spec)
            if key in seen:
                raise ValueError(
                    f"--model {spec} and --model {seen[key]} are the same model: give it once"
                )
            seen[key] = spec


def serve(options: ServeOptions) -> None:
    """Run until SIGTERM/SIGINT, drain, release the engine; returns normally (exit status 0)."""
    configure_logging(options.log_level, options.log_json)
    settings = prepare_settings(options)
    specs: list[str | None] = (
        list(options.model) if isinstance(options.model, list) else [options.model]
    ) or [None]
    # Bound before the models load (seconds, minutes from the Hub): a port in use fails now.
    # Clients are refused until the server listens, once everything is ready.
    sockets = bind_sockets(options.host, options.port)
    engines: list[Engine] = []
    try:
        for spec in specs:
            loaded = load_serving_model(spec, fallback_preset=options.fallback_preset)
            engines.append(Engine(loaded, options.engine_config).start())
        app = create_app(
            engines,
            voices_dir=options.voices_dir,
            settings=settings,
            voice_store=options.voice_store,
        )
        config = uvicorn_config(app, settings, options.host, options.port)
        server = DrainingServer(config, app.state.intone, settings.drain_timeout)
        asyncio.run(_run(server, sockets))
    finally:
        for sock in sockets:
            sock.close()
        for engine in engines:
            engine.close()
        logger.info("engine released; bye")


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of `host` (as asyncio's `create_server` binds them), not
    yet listening. ValueError, which the CLI reports in one line, if one cannot be bound."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                raise ValueError(f"cannot listen on {address[0]}:{port}: {e.strerror}") from None
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def prepare_settings(options: ServeOptions) -> ServerSettings:
    """The settings for serving on `options.host` (also `intone serve --ray`'s proxy): a Host
    check on loopback, validation, and a loud warning when exposed without keys."""
    settings = options.settings
    if is_loopback(options.host) and not settings.allowed_hosts:
        # DNS rebinding: a page from a public name that resolves to 127.0.0.1 is refused.
        settings.allowed_hosts = (*LOOPBACK_HOSTS, options.host)
    settings.validate()
    if not settings.api_keys and not is_loopback(options.host):
        logger.warning(
            "!!! serving on %s WITHOUT API KEYS: anyone who can reach this port can use it. "
            "Set --api-key or INTONE_API_KEYS (docs/server.md, 'Running it on the internet').",
            options.host,
        )
    return settings


def uvicorn_config(app: Any, settings: ServerSettings, host: str, port: int) -> uvicorn.Config:
    """How `intone serve` runs the app (the tests run it the same way)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=header_timeout_protocol(settings.header_timeout, _close_grace(settings)),
        ws=closing_websocket_protocol(_close_grace(settings)),
        log_config=None,  # keep ours: uvicorn's loggers propagate to the root handler
        # Proxy headers are the app's (forwarded.py, --forwarded-allow-ips): uvicorn's own
        # would trust X-Forwarded-For from 127.0.0.1 by default and ignore `Forwarded`.
        proxy_headers=False,
        lifespan="on",
        # Bigger than our own message limit, so an oversized message gets an error event
        # instead of a closed connection.
        ws_max_size=max(16 * 2**20, 4 * settings.max_message_bytes),
        ws_per_message_deflate=False,  # PCM barely compresses; deflate only adds latency
        timeout_graceful_shutdown=5,
    )


def _close_grace(settings: ServerSettings) -> float:
    """How long a closing connection may take to send what is queued for it."""
    return min(10.0, settings.slow_client_timeout)


class _ClosingTransport:
    """A transport whose close() gives up on unsent data after `grace` seconds. asyncio's own
    close() waits for the write buffer to drain, which a client that does not read never lets
    happen: a cut response to such a client would hold its socket forever."""

    def __init__(self, transport: asyncio.Transport, grace: float):
        self._transport = transport
        self._grace = grace

    def close(self) -> None:
        self._transport.close()
        if self._transport.get_write_buffer_size():
            asyncio.get_running_loop().call_later(self._grace, self._transport.abort)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def header_timeout_protocol(timeout: float, close_grace: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol, closing connections whose headers take over `timeout` s, and
    whose close gives up on a client that does not read after `close_grace` s."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:  # no httptools: uvicorn's pure-Python h11 protocol
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base  # type: ignore[assignment]

    class HeaderTimeoutProtocol(Base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(_ClosingTransport(transport, close_grace))
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self.loop.call_later(timeout, self._headers_overdue, self.cycle)

        def _headers_overdue(self, cycle_before: Any) -> None:
            transport = self.transport
            if transport.is_closing() or transport.get_protocol() is not self:
                return  # closed, or upgraded to a WebSocket (which has its own timeouts)
            if self.cycle is cycle_before:  # no request's headers completed since
                logger.info("closing a connection: request headers took over %g s", timeout)
                transport.close()

    return HeaderTimeoutProtocol


def closing_websocket_protocol(grace: float) -> type[asyncio.Protocol] | str:
    """uvicorn's WebSocket protocol, but a close requested while the client is not reading
    (the socket's buffers full) aborts the connection after `grace` seconds: uvicorn would
    otherwise wait for the client to read before it even writes the close frame, and a client
    that never reads would hold the connection open."""
    try:
        from uvicorn.protocols.websockets.websockets_sansio_impl import (
            WebSocketsSansIOProtocol as Base,
        )
    except ImportError:  # another implementation: uvicorn's choice, its own close handling
        return "auto"

    class ClosingWebSocketProtocol(Base):  # type: ignore[misc, valid-type]
        async def send(self, message: Any) -> None:
            if message["type"] == "websocket.close" and not self.writable.is_set():
                self.loop.call_later(grace, self._abort_if_connected)
            await super().send(message)

        def _abort_if_connected(self) -> None:
            if not self.disconnected:
                logger.info("aborting a WebSocket whose client does not read its close frame")
                self.transport.abort()

    return ClosingWebSocketProtocol


async def _run(server: DrainingServer, sockets: list[socket.socket]) -> None:
    # Voices are loaded before the port opens, so the first client finds them all.
    try:
        await server.runtime.ready()
    except EngineUnavailableError as e:
        raise (e.__cause__ or e) from None  # a bad --voices DIR: the CLI reports it, exit 1
    await server.serve(sockets)
