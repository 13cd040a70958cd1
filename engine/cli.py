"""The `intone` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


def _make_checkpoint(args: argparse.Namespace) -> None:
    from intone.engine.checkpoint import make_checkpoint

    out = make_checkpoint(args.preset, args.out, seed=args.seed)
    logger.info("wrote the %s checkpoint to %s", args.preset, out)


def _models(args: argparse.Namespace) -> None:
    from intone.engine.checkpoint import TINY_FAMILIES
    from intone.engine.releases import release_table

    rows = [("model", "language", "params (generation)", "voice cloning", "shortcuts")]
    for info in release_table():
        rows.append(
            (
                info.name,
                info.language,
                f"{info.parameters / 1e6:.1f}M",
                "gated weights" if info.cloning_gated else "open",
                ", ".join(info.shortcuts),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.append("")
    lines.append(
        "Offline checkpoints (`intone make-checkpoint --preset NAME`): every model above "
        "(random weights), tiny-NAME for a small variant of any of them, and one tiny variant "
        "per architecture family:"
    )
    lines += [f"  {name:<16} {release}" for name, release in TINY_FAMILIES.items()]
    sys.stdout.write("\n".join(lines) + "\n")


def _say(args: argparse.Namespace) -> None:
    import torch

    from intone.engine.audio import write_wav
    from intone.engine.generate import generate
    from intone.engine.loading import load_model
    from intone.engine.options import GenerationOptions
    from intone.engine.text import split_clauses
    from intone.engine.voices import load_voice

    # Generation and decoding overlap on two threads: one intra-op thread each per core pair
    # (on 2 cores: RTF 0.97x the reference's instead of 1.06x; bench/results/cpu-2core).
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    loaded = load_model(args.model)
    voice_name = args.voice or loaded.default_voice
    if voice_name is None:
        raise ValueError("this checkpoint has no default voice: pass --voice WAV")
    voice = load_voice(loaded.model, voice_name, loaded.voices.get(voice_name, voice_name))
    options = GenerationOptions(
        temperature=args.temperature,
        eos_threshold=args.eos_threshold,
        frames_after_eos=args.frames_after_eos,
        max_frames=args.max_frames,
        seed=args.seed,
        chain_frames=args.chain_frames,
    )
    clauses = split_clauses(loaded.tokenizer, args.text)
    audio = torch.cat(list(generate(loaded, voice, clauses, options)))
    write_wav(args.out, audio.numpy().astype(np.float32), loaded.sample_rate, float32=args.float)
    logger.info(
        "wrote %.2f s of audio (%d clauses) to %s",
        audio.numel() / loaded.sample_rate,
        len(clauses),
        args.out,
    )


def _serve(args: argparse.Namespace) -> None:
    from intone.provider.server.serve import options_from_args, serve

    if args.ray:
        from intone.provider.server.ray_serve import ray_options_from_args, serve_ray

        serve_ray(options_from_args(args), ray_options_from_args(args))
        return
    serve(options_from_args(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="intone", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)

    make = commands.add_parser(
        "make-checkpoint",
        help="write an offline checkpoint: random weights in the released layout, a locally "
        "trained tokenizer and a synthesised default voice",
    )
    make.add_argument(
        "--preset",
        required=True,
        metavar="NAME",
        help="a released model's name (full size, e.g. english, french_24l, english_2m_2026-10), "
        "tiny-NAME (that model shrunk), a tiny family variant (tiny-standard, tiny-24l, "
        "tiny-2026-01, tiny-drifting, tiny-small, tiny-gqa, tiny-pointwise), or intone's own "
        "'tiny' and 'full'; `intone models` lists them",
    )
    make.add_argument("--out", type=Path, required=True)
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(run=_make_checkpoint)

    models = commands.add_parser(
        "models",
        help="list the released models (--model NAME): language, parameters, whether voice "
        "cloning needs the gated weights, language shortcuts",
    )
    models.set_defaults(run=_models)

    say = commands.add_parser("say", help="synthesise TEXT to a WAV file")
    say.add_argument("text")
    say.add_argument(
        "--model",
        default=None,
        help="released model name (`intone models`: english, french_24l, fr, ...), checkpoint "
        "dir, config .yaml or hf:// path (default: the released kyutai/pocket-tts English model)",
    )
    say.add_argument(
        "--voice",
        default=None,
        help="voice name, audio file or voice-state .safetensors (default: the model's)",
    )
    say.add_argument("--out", type=Path, required=True)
    say.add_argument("--temperature", type=float, default=None)
    say.add_argument("--seed", type=int, default=None)
    say.add_argument("--eos-threshold", type=float, default=None)
    say.add_argument("--frames-after-eos", type=int, default=None)
    say.add_argument("--max-frames", type=int, default=None, help="frame limit per clause")
    say.add_argument(
        "--chain-frames", type=int, default=4, help="latents carried into the next clause"
    )
    say.add_argument("--float", action="store_true", help="write 32-bit float WAV")
    say.set_defaults(run=_say)

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
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--drain-timeout", type=float, default=30.0,
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
    serve.add_argument("--max-connections", type=int, default=512, help="server-wide; 0: no limit")
    serve.add_argument(
        "--max-streams-per-client", type=int, default=128,
        help="concurrent streams per API key (or client address without keys); 0: no limit",
    )  # fmt: skip
    serve.add_argument(
        "--max-chars-per-minute", type=int, default=0,
        help="text per API key (or client address) per minute; 0: no limit",
    )  # fmt: skip
    serve.add_argument("--max-streams-per-connection", type=int, default=32)
    serve.add_argument("--max-message-bytes", type=int, default=64 * 1024)
    serve.add_argument("--max-request-bytes", type=int, default=256 * 1024)
    serve.add_argument("--max-text-chars", type=int, default=20_000, help="text per stream")
    serve.add_argument("--header-timeout", type=float, default=10.0, metavar="S")
    serve.add_argument("--body-timeout", type=float, default=30.0, metavar="S")
    serve.add_argument("--ws-idle-timeout", type=float, default=300.0, metavar="S")
    serve.add_argument("--max-stream-seconds", type=float, default=1200.0, metavar="S")
    serve.add_argument(
        "--max-buffered-audio", type=float, default=10.0, metavar="S",
        help="seconds of audio queued per stream for a client before generation waits",
    )  # fmt: skip
    serve.add_argument(
        "--slow-client-timeout", type=float, default=30.0, metavar="S",
        help="drop a client that takes no audio for this long (WebSocket close 4409)",
    )  # fmt: skip
    serve.add_argument("--max-active", type=int, default=16, help="requests generating at once")
    serve.add_argument("--max-queued", type=int, default=256, help="requests waiting to start")
    serve.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=30.0,
        help="seconds a stream may go without text or audio before it ends (0: never)",
    )
    serve.add_argument("--kv-memory-mb", type=float, default=256.0)
    serve.add_argument("--device", default="cpu")
    from intone.provider.server.ray_serve import add_ray_arguments  # intone serve --ray

    add_ray_arguments(serve)
    serve.set_defaults(run=_serve)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from intone.engine.loading import ModelUnavailableError

    try:
        args.run(args)
    except (ModelUnavailableError, ValueError) as e:
        logger.error("%s", e)
        sys.exit(1)


if __name__ == "__main__":
    main()
