"""`intone serve`: build the engine, then run the app under uvicorn with a draining shutdown."""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from intone.engine import Engine, EngineConfig
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
    host: str = "127.0.0.1"
    port: int = 8000
    fallback_preset: str | None = "full"
    log_json: bool = False
    log_level: int = logging.INFO
    engine_config: EngineConfig = field(default_factory=EngineConfig)
    settings: ServerSettings = field(default_factory=ServerSettings)


def serve(options: ServeOptions) -> None:
    """Run until SIGTERM/SIGINT, drain, release the engine; returns normally (exit status 0)."""
    configure_logging(options.log_level, options.log_json)
    options.settings.validate()
    specs: list[str | None] = (
        list(options.model) if isinstance(options.model, list) else [options.model]
    ) or [None]
    engines: list[Engine] = []
    try:
        for spec in specs:
            loaded = load_serving_model(spec, fallback_preset=options.fallback_preset)
            engines.append(Engine(loaded, options.engine_config).start())
        app = create_app(engines, voices_dir=options.voices_dir, settings=options.settings)
        config = uvicorn.Config(
            app,
            host=options.host,
            port=options.port,
            log_config=None,  # keep ours: uvicorn's loggers propagate to the root handler
            lifespan="on",
            # Bigger than our own message limit, so an oversized message gets an error event
            # instead of a closed connection.
            ws_max_size=max(16 * 2**20, 4 * options.settings.max_message_bytes),
            ws_per_message_deflate=False,  # PCM barely compresses; deflate only adds latency
            timeout_graceful_shutdown=5,
        )
        server = DrainingServer(config, app.state.intone, options.settings.drain_timeout)
        asyncio.run(_run(server))
    finally:
        for engine in engines:
            engine.close()
        logger.info("engine released; bye")


async def _run(server: DrainingServer) -> None:
    # Voices are loaded before the port opens, so the first client finds them all.
    try:
        await server.runtime.ready()
    except EngineUnavailableError as e:
        raise (e.__cause__ or e) from None  # a bad --voices DIR: the CLI reports it, exit 1
    await server.serve()


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    """ServeOptions from `intone serve`'s parsed arguments (engine/cli.py defines them)."""
    aliases = {}
    for item in args.voice_alias:
        name, sep, voice = item.partition("=")
        if not sep or not name or not voice:
            raise ValueError(f"--voice-alias expects NAME=VOICE, got {item!r}")
        aliases[name] = voice
    return ServeOptions(
        # One --model stays a plain value, as before several were allowed.
        model=args.model[0] if args.model and len(args.model) == 1 else args.model,
        voices_dir=args.voices,
        host=args.host,
        port=args.port,
        fallback_preset=None if args.fallback_preset == "none" else args.fallback_preset,
        log_json=args.log_json,
        log_level=logging.DEBUG if args.verbose else logging.INFO,
        engine_config=EngineConfig(
            device=args.device,
            max_active=args.max_active,
            max_queued=args.max_queued,
            kv_memory_mb=args.kv_memory_mb,
        ),
        settings=ServerSettings(
            max_message_bytes=args.max_message_bytes,
            max_streams_per_connection=args.max_streams_per_connection,
            voice_aliases=aliases,
            drain_timeout=args.drain_timeout,
        ),
    )
