"""int8 linear layers for the CPU: a packed int8 GEMM with dynamically quantized activations.

At the row counts of a decode step (1-64 rows) a float32 GEMM on a CPU is bound by reading its
weights and runs far below peak; fbgemm's int8 GEMM reads a quarter of the bytes and does four
times the work per instruction. Measured on an AVX2 core (1024 x 4096 weights, one thread):
0.18 vs 0.51 ms for 1 row, 0.93 vs 3.9 ms for 16, 3.6 vs 8.5 ms for 64.

Where the CPU has AMX, oneDNN's int8 GEMM (the same quantized operators, packed by torch's
"onednn" engine) runs on the tile unit. It costs more per call, so it pays only from some rows
on, the fewer the wider the layer: one Xeon core, fbgemm against oneDNN, 1024 x 4096 at 1 / 16 /
40 / 80 rows 0.28 / 0.42 / 0.76 / 1.41 ms against 0.32 / 0.39 / 0.49 / 0.59; 512 x 1536 at 16 /
32 / 64 / 1024 rows 0.11 / 0.16 / 0.30 / 5.7 against 0.13 / 0.15 / 0.23 / 1.2. So a layer takes
it where its calls carry rows x width >= `ONEDNN_MIN_WORK`: the full-size FlowLM (1024 wide,
AR steps of 16 rows under load: a step 24-26 ms against 28-29, a prompt pass of 40 positions 26
against 31-32) and the Mimi decoder transformer (512 wide, 16 rows a frame, calls of two frames
or more). The 2M model's FlowLM (112 wide) keeps fbgemm: with oneDNN its AR step of 16 rows took
4.4-4.7 ms against 2.8-2.9 (bench/results/cpu-2core-xeon-amx-2026-12-07).

This is what the reference package's `quantize=True` does (`pocket_tts.quantization`: the
FlowLM transformer's attention and feed-forward linears, the flow head left in float32), with
weights quantized per output channel.
"""

from __future__ import annotations

import copy
import logging
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, TypeVar

import torch
from torch import nn

from intone.engine.models.pocket.transformer import TransformerLayer

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)

Kernel = Literal["fbgemm", "onednn"]

# Rows x width from which oneDNN's int8 GEMM beats fbgemm's on a core with AMX (16 rows of a
# 1024-wide layer, 32 of a 512-wide one).
ONEDNN_MIN_WORK = 16 * 1024

# torch's quantized engine, which decides how `linear_prepack` packs, is one setting per process.
_engine_lock = threading.Lock()


def kernel_for(linear: nn.Linear, rows: int) -> Kernel:
    """oneDNN on a CPU with AMX for a layer whose calls carry `rows` rows, where that is enough
    to pay for its cost per call; fbgemm elsewhere."""
    pays = rows * min(linear.in_features, linear.out_features) >= ONEDNN_MIN_WORK
    onednn = "onednn" in torch.backends.quantized.supported_engines
    return "onednn" if pays and onednn and torch.cpu._is_amx_tile_supported() else "fbgemm"


@contextmanager
def _quantized_engine(kernel: Kernel) -> Iterator[None]:
    with _engine_lock:
        before = torch.backends.quantized.engine
        torch.backends.quantized.engine = kernel
        try:
            yield
        finally:
            torch.backends.quantized.engine = before


class Int8Linear(nn.Module):
    """A bias-free linear layer with int8 weights (per output channel) and dynamically quantized
    int8 activations (per call), through `kernel`."""

    def __init__(self, linear: nn.Linear, kernel: Kernel = "fbgemm"):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("Int8Linear: linear layers with a bias are not supported")
        self.kernel = kernel
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
        zero = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            # torch marks its quantized tensor types deprecated; fbgemm's and oneDNN's packed
            # int8 GEMMs are still the fast int8 matmuls on x86 CPUs (`torch._int_mm` runs a slow
            # reference loop).
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch.quantize_per_channel(weight, scale, zero, 0, torch.qint8)
        with _quantized_engine(self.kernel):
            self.packed = torch.ops.quantized.linear_prepack(quantized, None)
        # fbgemm: 7-bit activations, so its AVX2 u8 x s8 products cannot saturate. oneDNN
        # compensates for that itself, and its activations keep all 8 bits.
        self.reduce_range = self.kernel == "fbgemm"
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y = torch.ops.quantized.linear_dynamic(flat, self.packed, self.reduce_range)
        return y.view(*x.shape[:-1], self.out_features)


def int8_linears(module: M, rows: int) -> M | None:
    """A copy of `module` whose transformer layers' attention and feed-forward linears run in
    int8 (norms, attention itself and activations stay float32), each through the kernel
    (`kernel_for`) that suits calls of `rows` rows, or None where this torch build can't (no
    fbgemm)."""
    quantized = copy.deepcopy(module)

    def int8(linear: nn.Linear) -> Int8Linear:
        return Int8Linear(linear, kernel_for(linear, rows))

    try:
        for layer in quantized.modules():
            if isinstance(layer, TransformerLayer):
                attn = layer.self_attn
                attn.in_proj, attn.out_proj = int8(attn.in_proj), int8(attn.out_proj)
                layer.linear1, layer.linear2 = int8(layer.linear1), int8(layer.linear2)
    except (RuntimeError, AttributeError, ValueError) as e:
        logger.warning("int8 linear layers unavailable (%s); %s runs in float32", e, type(module))
        return None
    return quantized
