"""`intone serve`: build the engine, then run the app under uvicorn with a draining shutdown.

uvicorn has no timeout for a request's headers, so a client could hold a connection open by
sending them a byte at a time (slowloris): `uvicorn_config` installs an HTTP protocol that
closes a connection whose request headers are not complete `header_timeout` seconds after it
opened (or after its previous response).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from intone.engine import Engine, EngineConfig
from intone.engine.pacing import PACING_MODES
from intone.engine.precision import DTYPES
from intone.provider.registry import model_key
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


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    """ServeOptions from `intone serve`'s parsed arguments (`add_serve_command` defines them)."""
    aliases = {}
    for item in args.voice_alias:
        name, sep, voice = item.partition("=")
        if not sep or not name or not voice:
            raise ValueError(f"--voice-alias expects NAME=VOICE, got {item!r}")
        aliases[name] = voice
    keys = list(args.api_key) + [
        key.strip() for key in os.environ.get("INTONE_API_KEYS", "").split(",") if key.strip()
    ]
    origins = [o.strip() for item in args.allowed_origins for o in item.split(",") if o.strip()]
    hosts = [h.strip() for item in args.allowed_hosts for h in item.split(",") if h.strip()]
    proxies = [p.strip() for item in args.forwarded_allow_ips for p in item.split(",") if p.strip()]
    return ServeOptions(
        # One --model stays a plain value, as before several were allowed.
        model=args.model[0] if args.model and len(args.model) == 1 else args.model,
        voices_dir=args.voices,
        voice_store=args.voice_store,
        host=args.host,
        port=args.port,
        fallback_preset=None if args.fallback_preset == "none" else args.fallback_preset,
        log_json=args.log_json,
        log_level=logging.DEBUG if args.verbose else logging.INFO,
        engine_config=EngineConfig(
            device=args.device,
            dtype=args.dtype,
            pacing=args.pacing,
            max_active=args.max_active,
            max_queued=args.max_queued,
            kv_memory_mb=args.kv_memory_mb,
            max_text_chars=args.max_text_chars,
            idle_timeout_s=args.stream_idle_timeout or None,
            max_rows_per_tenant=args.max_rows_per_tenant or None,
            voice_cache_mb=args.voice_cache_mb,
        ),
        settings=ServerSettings(
            api_keys=tuple(keys),
            allowed_origins=tuple(origins),
            allowed_hosts=tuple(hosts),
            public_metrics=args.public_metrics,
            max_connections=args.max_connections,
            max_streams_per_client=args.max_streams_per_client,
            max_chars_per_minute=args.max_chars_per_minute,
            max_message_bytes=args.max_message_bytes,
            max_streams_per_connection=args.max_streams_per_connection,
            ws_idle_timeout=args.ws_idle_timeout,
            max_request_bytes=args.max_request_bytes,
            header_timeout=args.header_timeout,
            body_timeout=args.body_timeout,
            max_stream_seconds=args.max_stream_seconds,
            max_buffered_audio=args.max_buffered_audio,
            slow_client_timeout=args.slow_client_timeout,
            voice_aliases=aliases,
            max_voice_bytes=args.max_voice_bytes,
            max_voice_seconds=args.max_voice_seconds,
            max_voices_per_key=args.max_voices_per_key,
            forwarded_allow_ips=tuple(proxies),
            drain_timeout=args.drain_timeout,
        ),
    )


def max_active_arg(value: str) -> int | str:
    """`--max-active`: "auto" (measured at start) or a number of rows."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number, got {value!r}") from None


def add_serve_command(commands: Any) -> None:
    """`intone serve` and its flags, on the `intone` command's subparsers. Defaults are
    `EngineConfig`'s and `ServerSettings`' own, except where the server differs (said so)."""
    engine, settings = EngineConfig(), ServerSettings()
    serve = commands.add_parser(
        "serve",
        help="run the server: WebSocket streaming, OpenAI-compatible /v1/audio/speech, demo "
        "page at /, /healthz and /metrics (see docs/server.md)",
    )
    serve.add_argument(
        "--model",
        action="append",
        default=None,
        help="released model name (`intone models`: english, fr, english_2m_2026-10, ...), "
        "checkpoint dir, config .yaml or hf:// path (default: the released English model; if it "
        "can't be had, a generated random-weight checkpoint, with a warning). Repeat to serve "
        "several models, one engine each; the first is the default, requests pick one by name "
        "or alias",
    )
    serve.add_argument(
        "--voices", type=Path, default=None, help="directory of voice prompts "
        "(.wav/.flac/.mp3/.safetensors), each registered under its file stem",
    )  # fmt: skip
    serve.add_argument(
        "--voice-store", type=Path, default=None, metavar="DIR",
        help="keep uploaded voices (POST /v1/voices) here, as voice-state .safetensors, across "
        "restarts (default: a temporary directory, removed at exit)",
    )  # fmt: skip
    serve.add_argument(
        "--voice-cache-mb", type=float, default=None, metavar="MB",
        help="KV pool memory idle voices may hold; past it the least recently used give their "
        "pages back and are loaded again on their next stream (default: every voice stays)",
    )  # fmt: skip
    serve.add_argument(
        "--max-voice-bytes", type=int, default=16 * 2**20, help="size of one uploaded voice file"
    )
    serve.add_argument(
        "--max-voice-seconds", type=float, default=120.0, metavar="S",
        help="longest uploaded voice audio accepted (only its first 30 s are used)",
    )  # fmt: skip
    serve.add_argument(
        "--max-voices-per-key", type=int, default=100, metavar="N",
        help="stored voices per API key (without keys: in all); 0: no limit",
    )  # fmt: skip
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="TCP port, 0-65535 (0: any free)")
    serve.add_argument(
        "--drain-timeout", type=float, default=settings.drain_timeout,
        help="seconds in-flight streams get to finish on SIGTERM before they are cancelled",
    )  # fmt: skip
    serve.add_argument("--log-json", action="store_true", help="JSON-lines logs")
    serve.add_argument(
        "--fallback-preset", choices=["full", "tiny", "none"], default="full",
        help="random-weight checkpoint to serve when the default model is unavailable "
        "('none': fail instead)",
    )  # fmt: skip
    serve.add_argument(
        "--voice-alias", action="append", default=[], metavar="NAME=VOICE",
        help="map a requested voice name (e.g. an OpenAI one: alloy) to a registry voice",
    )  # fmt: skip
    # Access and limits (docs/server.md, "Running it on the internet"). Defaults: ServerSettings.
    serve.add_argument(
        "--api-key", action="append", default=[], metavar="KEY",
        help="require this API key (repeatable; also INTONE_API_KEYS=k1,k2). Off by default",
    )  # fmt: skip
    serve.add_argument(
        "--allowed-origins", action="append", default=[], metavar="ORIGIN[,ORIGIN]",
        help="web origins (https://app.example.com) allowed besides the server's own; '*': any",
    )  # fmt: skip
    serve.add_argument(
        "--allowed-hosts", action="append", default=[], metavar="HOST[,HOST]",
        help="Host header names served (default on loopback: localhost, 127.0.0.1, ::1)",
    )  # fmt: skip
    serve.add_argument(
        "--public-metrics", action="store_true", help="/metrics and /stats without a key"
    )
    serve.add_argument(
        "--forwarded-allow-ips", action="append", default=[], metavar="IP[,NET]",
        help="trusted proxies (addresses or networks such as 10.0.0.0/8; '*': any) whose "
        "X-Forwarded-For / Forwarded header names the client, for per-client limits and logs",
    )  # fmt: skip
    serve.add_argument(
        "--max-connections", type=int, default=settings.max_connections,
        help="server-wide; 0: no limit",
    )  # fmt: skip
    serve.add_argument(
        "--max-streams-per-client", type=int, default=settings.max_streams_per_client,
        help="concurrent streams per API key (or client address without keys); 0: no limit",
    )  # fmt: skip
    serve.add_argument(
        "--max-chars-per-minute", type=int, default=settings.max_chars_per_minute,
        help="text per API key (or client address) per minute; 0: no limit",
    )  # fmt: skip
    serve.add_argument(
        "--max-streams-per-connection", type=int, default=settings.max_streams_per_connection
    )  # fmt: skip
    serve.add_argument("--max-message-bytes", type=int, default=settings.max_message_bytes)
    serve.add_argument("--max-request-bytes", type=int, default=settings.max_request_bytes)
    serve.add_argument(
        "--max-text-chars", type=int, default=engine.max_text_chars, help="text per stream"
    )  # fmt: skip
    serve.add_argument("--header-timeout", type=float, default=settings.header_timeout, metavar="S")
    serve.add_argument("--body-timeout", type=float, default=settings.body_timeout, metavar="S")
    serve.add_argument(
        "--ws-idle-timeout", type=float, default=settings.ws_idle_timeout, metavar="S"
    )  # fmt: skip
    serve.add_argument(
        "--max-stream-seconds", type=float, default=settings.max_stream_seconds, metavar="S"
    )  # fmt: skip
    serve.add_argument(
        "--max-buffered-audio", type=float, default=settings.max_buffered_audio, metavar="S",
        help="seconds of audio queued per stream for a client before generation waits",
    )  # fmt: skip
    serve.add_argument(
        "--slow-client-timeout", type=float, default=settings.slow_client_timeout, metavar="S",
        help="drop a client that takes no audio for this long (WebSocket close 4409); end a"
        " stream paced by playback reports that gets none for this long while it waits",
    )  # fmt: skip
    serve.add_argument(
        "--max-active", type=max_active_arg, default=engine.max_active, metavar="N|auto",
        help="requests generating at once; auto (the default): the real-time capacity of this "
        "model on this machine, measured at start (logged, and in /stats)",
    )  # fmt: skip
    serve.add_argument(
        "--pacing", choices=PACING_MODES, default=engine.pacing,
        help="what a stream more than lead_s ahead of its listener may take: yield (only compute "
        "no stream nearer its listener needs; an idle server renders as fast as it can), hold "
        "(nothing until the listener catches up) or off",
    )  # fmt: skip
    serve.add_argument(
        "--max-queued", type=int, default=engine.max_queued, help="requests waiting to start"
    )  # fmt: skip
    serve.add_argument(
        "--max-rows-per-tenant", type=int, default=0, metavar="N",
        help="generating rows one caller (API key, or client address) may hold while others "
        "wait: fair share of --max-active (0: no cap)",
    )  # fmt: skip
    serve.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=30.0,
        help="seconds a stream may go without text or audio before it ends (0: never)",
    )
    serve.add_argument("--kv-memory-mb", type=float, default=engine.kv_memory_mb)
    serve.add_argument("--device", default=engine.device)
    serve.add_argument(
        "--dtype", choices=DTYPES, default=engine.dtype,
        help="precision policy: auto (on a CPU: int8 linear layers, the fastest within the fast "
        "path's tolerance), float32 (equal to the reference within 1e-4), bfloat16",
    )  # fmt: skip
    from intone.provider.server.ray_serve import add_ray_arguments  # intone serve --ray

    add_ray_arguments(serve)
    serve.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> None:
    if args.ray:
        from intone.provider.server.ray_serve import ray_options_from_args, serve_ray

        serve_ray(options_from_args(args), ray_options_from_args(args))
        return
    serve(options_from_args(args))
