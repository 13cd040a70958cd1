"""Cost of a voice coming back after eviction (`--voice-cache-mb`): its voice-state file read
and written into the KV pool (`Engine.prefill_voice`), against encoding the audio once.

A 3 s prompt (the checkpoint's voice) and a 30 s one (it, repeated), each saved as a voice state
as the server's voice store saves uploads; the engine's budget is 0, so each voice is evicted as
soon as it is idle and every `prefill_voice` loads it again.

    python bench/voice_reload.py --model english --repeats 10 --out results/voice_reload.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from common import machine_info, round_floats  # noqa: E402

from intone.engine import Engine, EngineConfig, load_model  # noqa: E402
from intone.engine.voices import save_voice_state, voice_from_audio  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the released model)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    loaded = load_model(args.model)
    engine = Engine(loaded, EngineConfig(voice_cache_mb=0.0)).start()
    default = loaded.voices[loaded.default_voice]
    samples, rate = soundfile.read(str(default), dtype="float32", always_2d=True)
    samples = samples.mean(axis=1)
    long = np.tile(samples, int(np.ceil(30 * rate / len(samples))))[: 30 * rate]
    results = []
    with tempfile.TemporaryDirectory() as directory:
        for label, audio in (("prompt", samples), ("30 s", long)):
            t0 = time.perf_counter()
            voice = voice_from_audio(engine.model, label, torch.from_numpy(audio), rate)
            encode_s = time.perf_counter() - t0
            path = Path(directory) / f"{len(results)}.safetensors"
            save_voice_state(voice, path)
            engine.add_voice(label, path)  # idle at once: evicted (budget 0)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                engine.prefill_voice(label)
                times.append((time.perf_counter() - t0) * 1e3)
                engine.scheduler.voices.fit()  # idle again: evicted
            results.append(
                {
                    "voice": label,
                    "audio_seconds": len(audio) / rate,
                    "positions": voice.length,
                    "file_mib": path.stat().st_size / 2**20,
                    "encode_ms": encode_s * 1e3,
                    "reload_ms_median": statistics.median(times),
                    "reload_ms_min": min(times),
                    "reload_ms_max": max(times),
                }
            )
            print(json.dumps(round_floats(results[-1], 2)))
    engine.close()
    if args.out is not None:
        report = {"machine": machine_info(), "model": loaded.source, "results": results}
        args.out.write_text(json.dumps(round_floats(report), indent=2) + "\n")


if __name__ == "__main__":
    main()
