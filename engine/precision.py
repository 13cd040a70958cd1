"""Which precision each part of the model runs in: the one place that decides, per device.

`EngineConfig.dtype` names a policy:
- "float32": everything in float32 (the equivalence tolerance against the reference, 1e-4).
- "bfloat16": the FlowLM transformer and its KV cache in bf16, and on the CPU the Mimi decoder
  transformer's linear layers in int8.
- "auto" (default): the fastest mix that holds the fast path's tolerance (docs/benchmarks.md) on
  this device. On a CPU: the decoder transformer in int8 everywhere (fbgemm, ~1.8x its float32
  GEMMs on AVX2), the FlowLM in bf16 only where the CPU has native bf16 arithmetic (AVX-512 BF16
  or AMX; without it bf16 matmuls are emulated, ~8-10x slower than float32 measured on an AVX2
  EPYC). Elsewhere: float32, as before.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class Precision:
    flow_lm: torch.dtype  # the FlowLM transformer and the KV pool
    decoder_int8: bool  # the Mimi decoder transformer's linear layers


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic in hardware (Linux: /proc/cpuinfo flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


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
    return Precision(torch.bfloat16 if native_bf16() else torch.float32, decoder_int8=True)
