"""int8 linear layers for the CPU: fbgemm's packed int8 GEMM with dynamically quantized activations.

At the row counts of a decode step (1-64 rows) a float32 GEMM on a CPU is bound by reading its
weights and runs far below peak; fbgemm's int8 GEMM reads a quarter of the bytes and does four
times the work per instruction. Measured on an AVX2 core (1024 x 4096 weights, one thread):
0.18 vs 0.51 ms for 1 row, 0.93 vs 3.9 ms for 16, 3.6 vs 8.5 ms for 64.

This is what the reference package's `quantize=True` does (`pocket_tts.quantization`: the
FlowLM transformer's attention and feed-forward linears, the flow head left in float32), with
weights quantized per output channel.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import TypeVar

import torch
from torch import nn

from intone.engine.models.pocket.transformer import TransformerLayer

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)


class Int8Linear(nn.Module):
    """A bias-free linear layer with int8 weights (per output channel) and dynamically quantized
    int8 activations (per call), through fbgemm."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("Int8Linear: linear layers with a bias are not supported")
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
        zero = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            # torch marks its quantized tensor types deprecated; fbgemm's packed int8 GEMM is
            # still the fast int8 matmul on x86 CPUs (`torch._int_mm` runs a slow reference loop).
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch.quantize_per_channel(weight, scale, zero, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(quantized, None)
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        # reduce_range: 7-bit activations, so fbgemm's AVX2 u8 x s8 products cannot saturate.
        y = torch.ops.quantized.linear_dynamic(flat, self.packed, True)
        return y.view(*x.shape[:-1], self.out_features)


def int8_linears(module: M) -> M | None:
    """A copy of `module` whose transformer layers' attention and feed-forward linears run in
    int8 (norms, attention itself and activations stay float32), or None where this torch build
    can't (no fbgemm)."""
    quantized = copy.deepcopy(module)
    try:
        for layer in quantized.modules():
            if isinstance(layer, TransformerLayer):
                attn = layer.self_attn
                attn.in_proj, attn.out_proj = Int8Linear(attn.in_proj), Int8Linear(attn.out_proj)
                layer.linear1, layer.linear2 = Int8Linear(layer.linear1), Int8Linear(layer.linear2)
    except (RuntimeError, AttributeError, ValueError) as e:
        logger.warning("int8 linear layers unavailable (%s); %s runs in float32", e, type(module))
        return None
    return quantized
