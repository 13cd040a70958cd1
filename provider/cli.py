"""The `intone` command: the engine's commands (make-checkpoint, models, say) and `serve`, with
every flag of `intone serve` parsed here (its defaults are `EngineConfig`'s and
`ServerSettings`' own), for the server, `--ray` and Ray's application builder alike."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from intone.engine import EngineConfig
from intone.engine import cli as engine_cli
from intone.engine.config import PACING_MODES
from intone.engine.precision import DTYPES
from intone.provider.server.ray_serve import RayOptions, build_deployment, serve_ray
from intone.provider.server.serve import ServeOptions, serve
from intone.provider.server.settings import ServerSettings


def build_parser() -> argparse.ArgumentParser:
    return engine_cli.build_parser(add_serve_command)


def main(argv: list[str] | None = None) -> None:
    engine_cli.main(argv, build_parser())


def comma_list(items: list[str]) -> list[str]:
    """A repeatable flag's values, each of which may hold several separated by commas."""
    return [part.strip() for item in items for part in item.split(",") if part.strip()]


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    """ServeOptions from `intone serve`'s parsed arguments (`add_serve_command` defines them)."""
    aliases = {}
    for item in args.voice_alias:
        name, sep, voice = item.partition("=")
        if not sep or not name or not voice:
            raise ValueError(f"--voice-alias expects NAME=VOICE, got {item!r}")
        aliases[name] = voice
    keys = list(args.api_key) + comma_list([os.environ.get("INTONE_API_KEYS", "")])
    origins = comma_list(args.allowed_origins)
    hosts = comma_list(args.allowed_hosts)
    proxies = comma_list(args.forwarded_allow_ips)
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
    engine, settings, options = EngineConfig(), ServerSettings(), ServeOptions()
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
        "--max-voice-bytes",
        type=int,
        default=settings.max_voice_bytes,
        help="size of one uploaded voice file",
    )
    serve.add_argument(
        "--max-voice-seconds", type=float, default=settings.max_voice_seconds, metavar="S",
        help="longest uploaded voice audio accepted (only its first 30 s are used)",
    )  # fmt: skip
    serve.add_argument(
        "--max-voices-per-key", type=int, default=settings.max_voices_per_key, metavar="N",
        help="stored voices per API key (without keys: in all); 0: no limit",
    )  # fmt: skip
    serve.add_argument("--host", default=options.host)
    serve.add_argument(
        "--port", type=int, default=options.port, help="TCP port, 0-65535 (0: any free)"
    )
    serve.add_argument(
        "--drain-timeout", type=float, default=settings.drain_timeout,
        help="seconds in-flight streams get to finish on SIGTERM before they are cancelled",
    )  # fmt: skip
    serve.add_argument("--log-json", action="store_true", help="JSON-lines logs")
    serve.add_argument(
        "--fallback-preset", choices=["full", "tiny", "none"], default=options.fallback_preset,
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
    add_ray_arguments(serve)
    serve.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> None:
    if args.ray:
        serve_ray(options_from_args(args), ray_options_from_args(args))
        return
    serve(options_from_args(args))


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    ray = RayOptions()
    group = parser.add_argument_group("Ray Serve (--ray; needs `pip install 'intone[ray]'`)")
    group.add_argument(
        "--ray", action="store_true", help="serve as Ray Serve replicas, one engine each"
    )
    group.add_argument(
        "--ray-address", default=None, help="a running Ray cluster (default: start one here)"
    )
    group.add_argument("--replicas", type=int, default=ray.replicas, help="fixed replica count")
    group.add_argument("--min-replicas", type=int, default=None, help="autoscaling range: min")
    group.add_argument("--max-replicas", type=int, default=None, help="autoscaling range: max")
    group.add_argument("--replica-cpus", type=float, default=ray.num_cpus, help="CPUs per replica")
    group.add_argument("--replica-gpus", type=float, default=ray.num_gpus, help="GPUs per replica")
    group.add_argument(
        "--ray-streams-per-connection",
        type=int,
        default=ray.streams_per_connection,
        help="concurrent streams per WebSocket connection under Ray (a connection is one Ray "
        "request; replica limits are derived from this and --max-active)",
    )
    group.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="connections/requests waiting for a replica, per proxy (default: what all "
        "replicas hold); past it the proxy answers 503",
    )
    group.add_argument(
        "--target-load",
        type=float,
        default=ray.target_load,
        help="autoscaling: wanted engine occupancy per replica, 0-1",
    )


def ray_options_from_args(args: argparse.Namespace) -> RayOptions:
    return RayOptions(
        address=args.ray_address,
        replicas=args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        num_cpus=args.replica_cpus,
        num_gpus=args.replica_gpus,
        streams_per_connection=args.ray_streams_per_connection,
        max_queued_requests=args.max_queued_requests,
        target_load=args.target_load,
    )


def app_builder(args: dict[str, Any]) -> Any:
    """Ray Serve application builder, for `serve run` and KubeRay's RayService.

    import_path `intone.provider.cli:app_builder`; `args` are `intone serve`'s
    flags without the dashes (`model`, `voices`, `replicas`, `max_active`, ...; true for a
    switch), parsed by the same parser, so both ways of deploying take the same options.
    """
    argv = ["serve", "--ray"]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):  # a repeatable flag: model, api_key, voice_alias, ...
            for item in value:
                argv += [flag, str(item)]
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    parsed = build_parser().parse_args(argv)
    return build_deployment(options_from_args(parsed), ray_options_from_args(parsed))


if __name__ == "__main__":
    main()
