"""Which precision each part of the model runs in: the one place that decides, per device.

`EngineConfig.dtype` names a policy:
- "float32": everything in float32 (the equivalence tolerance against the reference, 1e-4).
- "bfloat16": the FlowLM transformer and its KV cache in bf16, and on the CPU the Mimi decoder
  transformer's linear layers in int8.
- "auto" (default): the fastest mix that holds the fast path's tolerance (docs/benchmarks.md) on
  this device. On a CPU: the linear layers of the FlowLM transformer and of the Mimi decoder
  transformer in int8 (fbgemm, `models/pocket/int8.py`: 4x a float32 GEMM at decode-step row
  counts on AVX2; the reference's `quantize=True` does the same to the FlowLM), activations,
  attention, the KV cache, the flow head and the decoder's convolutions in float32. bf16 is not
  used there: without AVX-512 BF16 or AMX it is emulated (~8-10x slower than float32, measured
  on an AVX2 EPYC), and where it is native (AMX) int8 linears are still faster at decode-step row
  counts (docs/benchmarks.md).
  Elsewhere: float32, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class Precision:
    flow_lm: torch.dtype  # the FlowLM transformer's activations and the KV pool
    decoder_int8: bool  # the Mimi decoder transformer's linear layers
    flow_lm_int8: bool = False  # the FlowLM transformer's linear layers


def resolve_precision(dtype: str, device: str | torch.device) -> Precision:
    if dtype not in DTYPES:
        raise ValueError(f"EngineConfig.dtype must be one of {DTYPES}, not {dtype!r}")
    cpu = torch.device(device).type == "cpu"
    if dtype == "float32":
        return Precision(torch.float32, decoder_int8=False)
    if dtype == "bfloat16":
        return Precision(torch.bfloat16, decoder_int8=cpu)
    if not cpu:
        return Precision(torch.float32, decoder_int8=False)
    return Precision(torch.float32, decoder_int8=True, flow_lm_int8=True)
