"""A fresh engine's first requests: its slowest decode calls and AR steps, and how late audio came.

    python bench/results/cpu-2core-background-traces/stall_engine.py MODEL CONCURRENCY REQUESTS

bench/loadgen.py's closed loop against a new in-process engine (as fast as possible, lead_s
None), so the decoder's shapes are traced while it serves. Lateness of a request: the most any
chunk arrived after its playback time, playback starting at the first chunk.
"""

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from backends import EngineBackend  # noqa: E402
from loadgen import closed_loop, make_specs  # noqa: E402

from intone.engine.model_runner import ModelRunner  # noqa: E402

SAMPLE_RATE = 24_000
durations: dict[str, list[float]] = {"decode": [], "generate_step": []}


def timed(name: str) -> None:
    original = getattr(ModelRunner, name)

    def call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            durations[name].append((time.perf_counter() - started) * 1e3)

    setattr(ModelRunner, name, call)


timed("decode")
timed("generate_step")
model, concurrency, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


async def main() -> list:
    backend = EngineBackend(
        model, f"{model}/voices/default.wav", "cpu", {"max_active": 128, "lead_s": None}
    )
    await backend.start()
    runs = await closed_loop(backend, make_specs(count, seed=5), concurrency)
    await backend.stop()
    return runs


runs = asyncio.run(main())
for name, values in durations.items():
    values.sort()
    top = [round(v) for v in values[-5:]]
    print(f"{name}: {len(values)} calls, p50 {values[len(values) // 2]:.0f} ms, top 5 {top} ms")
late = []
for run in runs:
    first, played, worst = run.arrivals[0][0], 0.0, 0.0
    for arrived, samples in run.arrivals:
        worst = max(worst, arrived - (first + played))
        played += samples / SAMPLE_RATE
    late.append(worst)
late.sort()
print(
    f"lateness per request: top 5 {[round(x * 1e3) for x in late[-5:]]} ms,"
    f" over 100 ms: {sum(x > 0.1 for x in late)}/{len(late)}"
)
