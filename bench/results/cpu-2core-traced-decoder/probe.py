"""Decode calls beside an AR stage that steps without pause, eager against traced.

    python bench/results/cpu-2core-traced-decoder/probe.py MODEL eager|traced ROWS FRAMES AR_ROWS

The engine's runner (bench/stages.py's `build`), one torch thread per Python thread, the decoder
in one part; its decoder replaced by a `GemmDecoder` that traces every shape on its first call
(traced) or never (eager). Prints each stage's time per call alone (min of 10), then both at
once for 8 s: decode calls and AR steps per second, and the cores the process used.
"""

import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from stages import build  # noqa: E402

from intone.engine.models.pocket.gemm_decoder import GemmDecoder  # noqa: E402

model, mode = sys.argv[1], sys.argv[2]
rows, frames, ar_rows = (int(a) for a in sys.argv[3:6])
torch.set_num_threads(1)
engine, ar_call, decode_call = build(model, "cpu", 64, 150, {})
runner = engine.runner
runner.decode_parts = 1
runner.decoder = GemmDecoder(
    runner.model.mimi, int8=runner.decoder.int8, trace_after=1 if mode == "traced" else None
)
ar, decode = ar_call(ar_rows), decode_call(rows, frames)
for _ in range(4):
    decode()
    ar()


def alone(fn) -> float:
    times = []
    for _ in range(10):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


print(f"{mode} alone: decode {alone(decode):.1f} ms, AR step {alone(ar):.1f} ms")
stop, steps = threading.Event(), [0]


def step_ar() -> None:
    torch.set_num_threads(1)
    while not stop.is_set():
        ar()
        steps[0] += 1


stepping = threading.Thread(target=step_ar)
stepping.start()
time.sleep(0.2)
steps0, t0, cpu0, calls = steps[0], time.perf_counter(), time.process_time(), 0
while time.perf_counter() - t0 < 8:
    decode()
    calls += 1
wall = time.perf_counter() - t0
stop.set()
stepping.join()
ar_steps = steps[0] - steps0
print(
    f"{mode} together: decode {wall / calls * 1e3:.1f} ms/call "
    f"({calls * rows * frames / wall:.0f} row-frames/s), AR {ar_steps / wall:.1f} steps/s "
    f"({wall / ar_steps * 1e3:.1f} ms), cores {(time.process_time() - cpu0) / wall:.2f}"
)
engine.close()
