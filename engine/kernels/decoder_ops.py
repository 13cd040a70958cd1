"""The CPU decoder's ELU, tanh GELU, direct causal convolution and ring attention as torch
operators (`decoder_ops.cpp`, registered as `torch.ops.intone.*`), where this machine can build
them; torch's own operators elsewhere (`causal_conv` is called by `cpu_decoder._Conv`, whose
GEMMs are its torch path). The int8 FlowLM's GELU is this one too (`precision.serving_model`).

Every native kernel is a torch operator (native.py), and these must be: the decoder runs
as TorchScript traces (traces.py), which record registered operators and replay them without the
GIL. What each saves against the torch path: bench/results/cpu-2core-stages/README.md; why:
`decoder_ops.cpp`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.nn import functional as F

from intone.engine.kernels import native

SOURCE = Path(__file__).with_name("decoder_ops.cpp")
HEADERS = (Path(__file__).with_name("vector_math.h"),)

_LOG2_E = 1.4426950408889634


def load() -> bool:
    """Whether `torch.ops.intone`'s decoder operators are registered: built on first use and
    cached, loaded once per process (`native.load_torch_library`)."""
    return native.load_torch_library(SOURCE, HEADERS)


def elu_into(x: torch.Tensor, out: torch.Tensor, native: bool) -> torch.Tensor:
    """ELU(x) written into `out` ([B, T, C], rows of [T, C] contiguous, as the decoder's
    activations and history buffers are).

    In torch: max(x, 2^(min(x, 0) log2 e) - 1). aten's ELU kernel spends its time in a
    vectorised expm1, and its `exp` is slow too: on one AVX-512 core `exp` takes 0.80 ns per
    element, `exp2` 0.29 and each of the other passes here ~0.05 (1.33 for aten's ELU). 2^y - 1
    is within 1e-7 of expm1 where y <= 0, and e^x - 1 >= x there, so the maximum picks the right
    branch on both sides. The operator does the same in one pass."""
    if native:
        return torch.ops.intone.elu_into(x, out)
    torch.clamp(x, max=0.0, out=out)
    out.mul_(_LOG2_E)
    out.exp2_()
    out.sub_(1.0)
    return torch.maximum(out, x, out=out)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """The tanh-approximated GELU through the operator (float32 on a CPU only)."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return F.gelu(x, approximate="tanh")
    return torch.ops.intone.gelu_tanh(x)
