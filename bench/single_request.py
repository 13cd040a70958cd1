"""Single-request speed: intone's sequential path against the pocket-tts package.

Same checkpoint, same voice WAV, same texts, EOS off (both generate the model's length estimate),
one request at a time. For each text: first-frame latency (call to first audio frame) and RTF
(generation time / audio duration), the median of --repeats runs after one warm-up run.

The reference runs in its own subprocess: importing pocket_tts calls torch.set_num_threads(1)
for the whole process, and it runs generation and Mimi decoding in two Python threads of its own.
intone's sequential path (engine/generate.py) runs both in the calling thread with torch's
default thread count. Each side runs as it ships.

    python bench/single_request.py --model checkpoints/full --out results/single_request.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import NO_EOS, PROMPTS, SAMPLE_RATE, SEED, machine_info, round_floats  # noqa: E402


def _timed(frames) -> tuple[float, float, int]:
    """(first-frame latency, total time, samples) of iterating `frames`."""
    t0 = time.perf_counter()
    first = None
    samples = 0
    for frame in frames:
        if first is None:
            first = time.perf_counter() - t0
        samples += frame.shape[-1]
    return first or float("nan"), time.perf_counter() - t0, samples


def run_intone(model: str, voice_wav: str, texts: list[str], repeats: int, threads: int | None):
    import torch

    from intone.engine.generate import generate
    from intone.engine.loading import load_model
    from intone.engine.options import GenerationOptions
    from intone.engine.text import split_clauses
    from intone.engine.voices import load_voice

    if threads:
        torch.set_num_threads(threads)
    loaded = load_model(model)
    voice = load_voice(loaded.model, "bench", voice_wav)
    rows = []
    for text in texts:
        clauses = split_clauses(loaded.tokenizer, text)
        runs = []
        for i in range(repeats + 1):  # the first run is warm-up
            options = GenerationOptions(eos_threshold=NO_EOS, seed=SEED + i)
            runs.append(_timed(generate(loaded, voice, clauses, options)))
        rows.append(_row(text, runs[1:], {"clauses": len(clauses)}))
    return {"torch_threads": torch.get_num_threads(), "rows": rows}


def run_reference(model: str, voice_wav: str, texts: list[str], repeats: int):
    import torch
    import yaml
    from pocket_tts import TTSModel  # sets torch.set_num_threads(1) for this process

    config = yaml.safe_load(Path(model, "config.yaml").read_text())
    config["default_eos_threshold"] = NO_EOS
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "config.yaml")
        path.write_text(yaml.safe_dump(config))
        tts = TTSModel.load_model(config=str(path))
    state = tts.get_state_for_audio_prompt(Path(voice_wav))
    rows = []
    for text in texts:
        runs = []
        for i in range(repeats + 1):
            torch.manual_seed(SEED + i)  # the reference draws noise from the global RNG
            runs.append(_timed(tts.generate_audio_stream(state, text)))
        rows.append(_row(text, runs[1:], {}))
    return {"torch_threads": torch.get_num_threads(), "rows": rows}


def _row(text: str, runs: list[tuple[float, float, int]], extra: dict) -> dict:
    first = [r[0] for r in runs]
    total = [r[1] for r in runs]
    audio = runs[0][2] / SAMPLE_RATE
    return {
        "text": text,
        "audio_s": audio,
        "frames": runs[0][2] // 1920,
        "first_frame_ms": statistics.median(first) * 1000,
        "first_frame_ms_all": [f * 1000 for f in first],
        "rtf": statistics.median(total) / audio,
        "rtf_all": [t / audio for t in total],
        **extra,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--voice", default=None, help="voice WAV (default: the checkpoint's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--texts", type=int, default=len(PROMPTS), help="how many prompts")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for intone")
    parser.add_argument("--out", type=Path, default=Path("results/single_request.json"))
    parser.add_argument("--side", choices=["intone", "reference"], help=argparse.SUPPRESS)
    parser.add_argument("--side-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    voice = args.voice or str(Path(args.model, "voices", "default.wav"))
    texts = list(PROMPTS[: args.texts])

    if args.side:  # one side, in a process of its own
        run = run_reference if args.side == "reference" else run_intone
        extra = () if args.side == "reference" else (args.threads,)
        result = run(args.model, voice, texts, args.repeats, *extra)
        args.side_out.write_text(json.dumps(result))
        return

    results = {"machine": machine_info(), "model": str(args.model), "voice": voice}
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("intone", "reference"):
            out = Path(tmp, f"{side}.json")
            cmd = [sys.executable, __file__, "--side", side, "--side-out", str(out)]
            cmd += ["--model", args.model, "--voice", voice, "--repeats", str(args.repeats)]
            cmd += ["--texts", str(args.texts)]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            print(f"running {side} ...", file=sys.stderr, flush=True)
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
            results[side] = json.loads(out.read_text())
    results["machine"]["loadavg_end"] = list(os.getloadavg())

    lines = [
        "| text | audio s | intone first frame ms | reference first frame ms "
        "| intone RTF | reference RTF | RTF ratio (ours/ref) |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for ours, ref in zip(results["intone"]["rows"], results["reference"]["rows"], strict=True):
        ratio = ours["rtf"] / ref["rtf"]
        ratios.append(ratio)
        if ours["frames"] != ref["frames"]:
            print(f"warning: frame counts differ for {ours['text']!r}", file=sys.stderr)
        lines.append(
            f"| {ours['text'][:40]} | {ours['audio_s']:.2f} | {ours['first_frame_ms']:.0f} "
            f"| {ref['first_frame_ms']:.0f} | {ours['rtf']:.3f} | {ref['rtf']:.3f} "
            f"| {ratio:.2f} |"
        )
    results["summary"] = {
        "rtf_ratio_geomean": statistics.geometric_mean(ratios),
        "first_frame_ratio_geomean": statistics.geometric_mean(
            [
                o["first_frame_ms"] / r["first_frame_ms"]
                for o, r in zip(
                    results["intone"]["rows"], results["reference"]["rows"], strict=True
                )
            ]
        ),
        "intone_torch_threads": results["intone"]["torch_threads"],
        "reference_torch_threads": results["reference"]["torch_threads"],
    }
    results["table"] = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(round_floats(results), indent=2) + "\n")
    print("\n".join(lines))
    s = results["summary"]
    print(
        f"\nRTF ours/reference (geomean): {s['rtf_ratio_geomean']:.2f}  "
        f"first frame ours/reference: {s['first_frame_ratio_geomean']:.2f}  "
        f"(intone torch threads {s['intone_torch_threads']}, reference "
        f"{s['reference_torch_threads']} + its decoder thread); load avg "
        f"{results['machine']['loadavg_start'][0]:.2f} -> "
        f"{results['machine']['loadavg_end'][0]:.2f}"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
