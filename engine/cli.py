"""The `intone` command line."""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    from intone.engine.errors import EmptyTextError
    from intone.engine.generate import generate
    from intone.engine.loading import load_model
    from intone.engine.options import GenerationOptions
    from intone.engine.text import split_clauses
    from intone.engine.voices import load_voice

    # Generation and decoding overlap on two threads: one intra-op thread each per core pair
    # (two threads each would oversubscribe the cores; bench/results/cpu-2core/README.md).
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    # Checked before the model loads and speaks, not found out when the WAV is written.
    to_stdout = str(args.out) == "-"
    if not to_stdout:
        if args.out.suffix.lower() != ".wav":
            raise ValueError(f"cannot write {args.out}: intone say writes WAV, name it *.wav")
        if not args.out.parent.is_dir():
            raise ValueError(f"cannot write {args.out}: {args.out.parent} is not a directory")
    text = sys.stdin.read() if args.text == "-" else args.text
    if not text.strip():
        raise EmptyTextError("no text to speak")
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
    clauses = split_clauses(loaded.tokenizer, text)
    if not clauses:
        raise EmptyTextError("no text to speak")
    audio = torch.cat(list(generate(loaded, voice, clauses, options)))
    samples = audio.numpy().astype(np.float32)
    if to_stdout:
        wav = io.BytesIO()  # the WAV header's sizes are written last, by seeking back
        write_wav(wav, samples, loaded.sample_rate, float32=args.float)
        sys.stdout.buffer.write(wav.getvalue())
        sys.stdout.buffer.flush()
    else:
        write_wav(args.out, samples, loaded.sample_rate, float32=args.float)
    logger.info(
        "wrote %.2f s of audio (%d clauses) to %s",
        audio.numel() / loaded.sample_rate,
        len(clauses),
        "stdout" if to_stdout else args.out,
    )


def build_parser(*extra_commands: Callable[[Any], None]) -> argparse.ArgumentParser:
    """The engine's commands, then each of `extra_commands(subparsers)`: `intone.provider.cli`
    adds `serve` that way, so the engine never imports the server."""
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
    say.add_argument("text", help="what to say; - reads it from stdin")
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
    say.add_argument("--out", type=Path, required=True, help="a .wav file; - writes to stdout")
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

    for add_command in extra_commands:
        add_command(commands)
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> None:
    args = (parser or build_parser()).parse_args(argv)
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
