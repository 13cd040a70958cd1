"""How long each decode call takes around the one that starts its shape's traces.

    python bench/results/cpu-2core-background-traces/stall_call.py MODEL ROWS FRAMES

One `GemmDecoder` (int8 transformer linears, one torch thread) tracing a shape from its fifth
call on; 12 calls of ROWS x FRAMES, 0.3 s apart, so that a trace made beside the calls is ready
before the next one. Prints each call's wall time.
"""

import sys
import time

import torch

from intone.engine.cpu_memory import keep_freed_memory
from intone.engine.loading import load_model
from intone.engine.models.pocket.gemm_decoder import GemmDecoder

torch.set_num_threads(1)
keep_freed_memory()
model = load_model(sys.argv[1]).model
rows, frames = int(sys.argv[2]), int(sys.argv[3])
decoder = GemmDecoder(model.mimi, int8=True, trace_after=5)
state = decoder.init_decoder_state(rows)
latents = torch.randn(rows, frames, decoder.output_proj.shape[1])
times = []
with torch.no_grad():
    for _ in range(12):
        started = time.perf_counter()
        decoder.decode(latents, state)
        times.append((time.perf_counter() - started) * 1e3)
        time.sleep(0.3)
print(rows, frames, " ".join(f"{t:.0f}" for t in times), f"ms; max {max(times):.0f}")
