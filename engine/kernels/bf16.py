"""bf16 linear layers with float32 activations, for CPUs that multiply bf16 natively.

The flow head's linear layers are float32 GEMMs of a few rows (one per stream in an AR step):
bound by reading ~39 MB of weights per step at full size, which bf16 halves, and on a core with
AVX-512 BF16 (or AMX) oneDNN's bf16 GEMM also does twice the multiplications per instruction.
Measured on one AVX-512 BF16 core (2-core AMD EPYC, one thread, min of 30): the full-size flow
head took 4.20 / 6.27 / 8.42 ms at 1 / 8 / 16 rows in float32, 3.99 / 4.88 / 5.98 ms this way.
int8 is not used there: its error fails the fast path's tolerance at temperature 0 (0.83 dB mean
log-spectral distance, bench/results/cpu-2core-stages/README.md), bf16's does not.

The GEMM's operands and its output are rounded to bf16 (it accumulates in float32); the bias,
norms, activations and residual sums stay float32.
"""

from __future__ import annotations

import copy
from typing import TypeVar

import torch
from torch import nn
from torch.nn import functional as F

M = TypeVar("M", bound=nn.Module)


class Bf16Linear(nn.Module):
    """A linear layer whose weights are bf16 and whose input is rounded to bf16 per call; the
    product (accumulated in float32, rounded to bf16 by torch's CPU GEMM) returns as float32,
    and the float32 bias is added to it."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(torch.bfloat16), self.weight).to(torch.float32)
        return y if self.bias is None else y.add_(self.bias)


def bf16_linears(module: M, in_place: bool = False) -> M:
    """A copy of `module` (`module` itself, `in_place`) with every `nn.Linear` in it a
    `Bf16Linear`."""
    converted = module if in_place else copy.deepcopy(module)
    for parent in list(converted.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Bf16Linear(child))
    return converted
