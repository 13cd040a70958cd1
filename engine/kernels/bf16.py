"""bf16 linear layers with float32 activations, for CPUs that multiply bf16 natively; oneDNN's
packed bf16 weights and product (`pack`, `product`), which the Mimi decoder's widest
convolutions use too (`cpu_decoder.BF16_CONV_MIN_CHANNELS`).

The flow head's linear layers are float32 GEMMs of a few rows (one per stream in an AR step):
bound by reading ~39 MB of weights per step at full size, which bf16 halves, and on a core with
AVX-512 BF16 (or AMX) oneDNN's bf16 GEMM also does twice the multiplications per instruction.
Measured on one AVX-512 BF16 core (2-core AMD EPYC, one thread, min of 30): the full-size flow
head took 4.20 / 6.27 / 8.42 ms at 1 / 8 / 16 rows in float32, 3.99 / 4.88 / 5.98 ms this way.
int8 is not used there: its error fails the fast path's tolerance at temperature 0 (0.83 dB mean
log-spectral distance, bench/results/cpu-2core-stages/README.md), bf16's does not.

The GEMM's operands and its output are rounded to bf16 (it accumulates in float32); the bias,
norms, activations and residual sums stay float32.

On a CPU the weights are packed once into oneDNN's blocked layout (`_reorder_linear_weight`), as
torch's own compiled CPU linears keep them: `F.linear` reorders a plain weight on every call.
The product is the same to the bit; on a Xeon core with AMX, 16 rows through 512 x 1536 weights
155 us against 198, through 512 x 512 54 against 79.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn
from torch.nn import functional as F

M = TypeVar("M", bound=nn.Module)


@functools.cache
def _packed_product() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """oneDNN's product of bf16 rows and packed weights, as a scripted function: the tracer
    cannot record the operator's empty list of optional scalars, but records a scripted call as
    one (and called eagerly it costs what the operator does)."""

    def product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        scalars = torch.jit.annotate(list[int | float | complex | None], [])
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", scalars, None)

    return torch.jit.script(product)


def packs(weight: torch.Tensor) -> bool:
    """Whether `pack` holds `weight` in oneDNN's layout: on a CPU whose oneDNN runs bf16
    (AVX-512, emulated there, or native bf16)."""
    return weight.device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 [out, in] weight in oneDNN's blocked layout for `product` (where `packs`): a
    traced caller must hold it as a module's buffer."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """bf16 rows [N, in] times a `pack`ed weight: [N, out] in bf16 (accumulated in float32)."""
    return _packed_product()(x, packed)


class Bf16Linear(nn.Module):
    """A linear layer whose weights are bf16 and whose input is rounded to bf16 per call; the
    product (accumulated in float32, rounded to bf16 by torch's CPU GEMM) returns as float32,
    and the float32 bias is added to it. On a CPU whose oneDNN runs bf16 the weights are held
    packed (`packed`, in place of `weight`)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().to(torch.bfloat16)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.weight: nn.Parameter | None = None
        packed = None
        # oneDNN's bf16 kernels need AVX-512 (emulated there) or native bf16; elsewhere
        # `dtype="bfloat16"` keeps torch's GEMM.
        if packs(weight):
            packed = pack(weight)
        else:
            self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("packed", packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        y = F.linear(x, self.weight) if self.packed is None else product(x, self.packed)
        y = y.to(torch.float32)
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
