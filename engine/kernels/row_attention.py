"""Decode attention over `RowContexts` and the stores of a step's new keys and values as torch
operators (`row_attention.cpp`, registered as `torch.ops.intone.row_attention` and `row_store`),
where this machine can build them; `row_contexts.RowContextAttention` keeps its torch path
elsewhere.

An AR step's attention reads every row's whole context in every layer. torch runs it as batched
matrix-vector products, one per row and head, which read the contexts at a third of the memory
bandwidth; the operator streams each (row, KV head) once, up to the row's own length. Measured
full size, one core, 6 layers of 16 rows x 151 positions: 13.3 ms in torch, 7.0 ms here (a plain
sum over the same bytes: 5.5 ms). It agrees with the torch path to ~4e-7 relative. Over float16
contexts (the CPU fast path's, `Precision.half_row_contexts`) it reads half the bytes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from intone.engine.kernels import native

SOURCE = Path(__file__).with_name("row_attention.cpp")
HEADERS = (Path(__file__).with_name("vector_math.h"),)


def load() -> bool:
    """Whether `torch.ops.intone`'s row attention operators are registered: built on first use
    and cached, loaded once per process (`native.load_torch_library`)."""
    return native.load_torch_library(SOURCE, HEADERS)


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """q [rows, heads, D] (float32); one layer's row contexts, keys and values [contexts >=
    rows, kv_heads, capacity, D], float32 or float16 on the CPU, row i in context i; lengths
    [rows] (int64): positions row i reads. Returns [rows, heads, D] in float32. A call outside
    those bounds raises ValueError (TypeError for another dtype) before it reads anything."""
    return torch.ops.intone.row_attention(q, keys, values, lengths)


def store(source: torch.Tensor, target: torch.Tensor, offsets: torch.Tensor) -> None:
    """target's head h at element offsets[r] onwards <- source [rows, heads, D] (float32), for
    a target whose heads are its dimension -3 and whose last is D: the pool's [heads, slots, D]
    of a layer (offsets: slot * D), or the row contexts' [contexts, heads, capacity, D] (float32,
    or float16: rounded to nearest even, as torch converts). Offsets that would write past the
    target raise ValueError."""
    torch.ops.intone.row_store(source, target, offsets)
