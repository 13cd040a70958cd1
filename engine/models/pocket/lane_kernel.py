"""Decode attention over `KVLanes` in C (`lane_attention.c`), where this machine can build it,
and the stores of a step's new keys and values into the pool and the lanes.

An AR step's attention reads every row's whole context in every layer. torch runs it as batched
matrix-vector products, one per row and head, which read the lanes at a third of the memory
bandwidth; the kernel streams each (row, KV head) once, up to the row's own length. Measured
full size, one core, 6 layers of 16 rows x 151 positions: 13.3 ms in torch, 7.0 ms here (a plain
sum over the same bytes: 5.5 ms). It agrees with the torch path to ~4e-7 relative.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from intone.engine import native

SOURCE = Path(__file__).with_name("lane_attention.c")

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class LaneKernel:
    """Calls the functions of a library built from `lane_attention.c`. Every call checks the
    bounds the C code trusts, so a wrong argument is an error, not a read or write past a
    tensor."""

    def __init__(self, library: ctypes.CDLL):
        self._attend = library.lane_attention
        self._attend.argtypes = [_PTR] * 5 + [_I64] * 6 + [ctypes.c_float]
        self._attend.restype = ctypes.c_int
        self._store = library.store_rows
        self._store.argtypes = [_PTR] * 3 + [_I64] * 4
        self._store.restype = None

    def store(self, source: torch.Tensor, target: torch.Tensor, offsets: torch.Tensor) -> None:
        """target's head h at element offsets[r] onwards <- source [rows, heads, D], for a
        target whose heads are its dimension -3 and whose last is D: the pool's [heads, slots,
        D] of a layer (offsets: slot * D), or the lanes' [lanes, heads, capacity, D]."""
        rows, heads, dim = source.shape
        if not (source.dtype == target.dtype == torch.float32):
            raise TypeError(f"store_rows takes float32, not {source.dtype}/{target.dtype}")
        if target.shape[-3] != heads or target.shape[-1] != dim or target.stride(-1) != 1:
            raise ValueError(f"[{rows}, {heads}, {dim}] does not fit {tuple(target.shape)}")
        _check_row_vector(offsets, rows)
        head_stride = target.stride(-3)
        sizes = zip(target.shape, target.stride(), strict=True)
        extent = 1 + sum((size - 1) * stride for size, stride in sizes)  # elements it spans
        if rows and not (
            int(offsets.min()) >= 0
            and int(offsets.max()) + (heads - 1) * head_stride + dim <= extent
        ):
            raise ValueError(f"offsets {offsets.tolist()} fall outside {tuple(target.shape)}")
        source = source.contiguous()
        self._store(
            source.data_ptr(), target.data_ptr(), offsets.data_ptr(), rows, heads, dim, head_stride
        )

    def __call__(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """q [rows, heads, D]; one layer's lanes, keys and values [lanes >= rows, kv_heads,
        capacity, D], float32 on the CPU, row i in lane i; lengths [rows] (int64): positions
        row i reads. Returns [rows, heads, D]. The call releases the GIL."""
        rows, heads, dim = q.shape
        _, kv_heads, capacity, _ = keys.shape
        if not (keys.dtype == values.dtype == q.dtype == torch.float32):
            raise TypeError(f"lane_attention takes float32, not {q.dtype}/{keys.dtype}")
        if keys.stride() != values.stride() or keys.stride()[2:] != (dim, 1):
            raise ValueError("lane_attention needs keys and values laid out as KVLanes keeps them")
        _check_row_vector(lengths, rows)
        if heads % kv_heads or rows > keys.shape[0]:
            raise ValueError(f"{rows} rows of {heads} heads over lanes {tuple(keys.shape)}")
        # The kernel trusts these bounds: checked here, where a wrong one is an error, not a
        # read past the lanes.
        if rows and not (int(lengths.min()) >= 1 and int(lengths.max()) <= capacity):
            raise ValueError(f"lengths must lie in 1 .. {capacity}, not {lengths.tolist()}")
        q = q.contiguous()
        out = torch.empty_like(q)
        status = self._attend(
            q.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            lengths.data_ptr(),
            out.data_ptr(),
            rows,
            heads,
            kv_heads,
            dim,
            keys.stride(0),
            keys.stride(1),
            dim**-0.5,
        )
        if status != 0:
            raise MemoryError("lane_attention could not allocate its scores")
        return out


def _check_row_vector(values: torch.Tensor, rows: int) -> None:
    if values.dtype != torch.int64 or values.shape != (rows,) or not values.is_contiguous():
        raise ValueError(f"expected contiguous int64 [{rows}], not {values.dtype} {values.shape}")


def load_lane_kernel() -> LaneKernel | None:
    """The kernel, built on first use and cached (see `native.build`); None where it cannot be
    built."""
    library = native.build(SOURCE)
    return LaneKernel(library) if library is not None else None
