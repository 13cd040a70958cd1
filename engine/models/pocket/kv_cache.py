"""FlowLM key/value storage: a flat pool of slots, addressed by slot indices.

A slot holds one position's rotated key and value for every layer. Who decides which slot a
position lives in is the caller's business: the single-request path gives a request one contiguous
run of slots, the engine's block manager hands out fixed-size pages. Either way a step only needs
the slot of every position it reads and writes, so the attention code is the same for both and a
batch never copies caches when its membership changes.

The pool holds `num_kv_heads` heads per position; queries may have more (grouped-query attention,
num_heads a multiple of num_kv_heads): query head h reads KV head h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Self

import torch


def store_slots(
    keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store new keys/values [n, H, D] at slots [n] of one pool layer ([H, slots, D] each)."""
    keys.index_copy_(1, slots, k.transpose(0, 1))
    values.index_copy_(1, slots, v.transpose(0, 1))


class KVPool:
    """Keys and values of the attention's key/value heads, stored head-major:
    [layers, kv_heads, slots, head_dim].

    Head-major because its reads (a prefill's context, a decode row's whole context) are one
    `index_select` per layer straight into the [kv_heads, length, head_dim] layout the batched
    matmuls take: measured on one CPU core (16 rows x 150 positions, 16 heads of 64),
    1.3 ms per gather, against 8.3 ms for advanced indexing into a slot-major pool and 2.3 ms
    for a slot-major gather plus transpose.
    `write`/`read` take and give the slot-major [layers, n, kv_heads, head_dim] of a voice."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (num_layers, num_heads, num_slots, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_slots(self) -> int:
        return self.keys.shape[2]

    @property
    def slot_bytes(self) -> int:
        """Memory one slot (one position, every layer, keys and values) takes."""
        layers, heads, _, dim = self.keys.shape
        return 2 * layers * heads * dim * self.keys.element_size()

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values [layers, n, H, D] computed elsewhere (a voice state) at slots [n]."""
        self.keys.index_copy_(2, slots, keys.transpose(1, 2).to(self.keys))
        self.values.index_copy_(2, slots, values.transpose(1, 2).to(self.values))

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values [layers, n, H, D] at slots [n]."""
        keys = self.keys.index_select(2, slots).transpose(1, 2).contiguous()
        return keys, self.values.index_select(2, slots).transpose(1, 2).contiguous()

    def copy(self, source: slice, target: slice) -> None:
        """Copy the slots `source` to `target` (a shared page's positions into a private one)."""
        self.keys[:, :, target] = self.keys[:, :, source]
        self.values[:, :, target] = self.values[:, :, source]

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's new keys/values [n, H, D] at slots [n]."""
        store_slots(self.keys[layer], self.values[layer], slots, k, v)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys/values at slots [n], head-major: [H, n, D]."""
        return self.keys[layer].index_select(1, slots), self.values[layer].index_select(1, slots)


@dataclass
class SequenceStep:
    """One sequence's part of a FlowLM step.

    slots: the slot of every position of the sequence after this step, history first.
    num_new: how many trailing positions are computed in this step.
    """

    slots: torch.Tensor
    num_new: int


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """Grouped-query attention over gathered keys, head-major.

    q [Hkv, R, g * n, D] (g query heads per KV head, n queries each), keys/values [Hkv, R, L, D],
    bias broadcastable to [Hkv, R, g, n, L] (0 or -inf). The query heads of a group share one
    read of their KV head (no repeat); softmax runs in float32 whatever the KV dtype.
    """
    scores = torch.matmul(q * q.shape[-1] ** -0.5, keys.transpose(-1, -2))
    hkv, rows, gn, length = scores.shape
    scores = scores.view(hkv, rows, -1, bias.shape[-2], length).float() + bias
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(hkv, rows, gn, length)
    return torch.matmul(probs, values)


@dataclass
class DecodeAttention:
    """Attention for a step where every sequence adds one token (implements `KVCache`).

    read_slots [B, L]: each row's slots, padded (to its longest row, or a page multiple) with
    slot 0, which `bias` hides. Each layer gathers the rows' keys and values once from the
    head-major pool, straight into the [Hkv, B, L, D] layout the batched matmuls read.
    """

    pool: KVPool
    write_slots: torch.Tensor  # [B]
    read_slots: torch.Tensor  # [B, L]
    bias: torch.Tensor  # [1, B, 1, 1, L]: 0 where a row may see a key, -inf elsewhere

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.store(layer, self.write_slots, k, v)
        rows, heads, dim = q.shape
        kv_heads = k.shape[1]
        q = q.view(rows, kv_heads, heads // kv_heads, dim).transpose(0, 1)
        k_ctx, v_ctx = self.pool.gather(layer, self.read_slots.view(-1))
        context = (kv_heads, rows, self.read_slots.shape[1], dim)
        out = _attend(q, k_ctx.view(context), v_ctx.view(context), self.bias)  # [Hkv, B, g, D]
        return out.transpose(0, 1).reshape(rows, heads, dim)


def attend_sequence(
    keys: torch.Tensor,
    values: torch.Tensor,
    q: torch.Tensor,
    slots: torch.Tensor,
    bias: torch.Tensor,
) -> torch.Tensor:
    """One sequence's queries q [n, H, D] against its keys and values at `slots` [L] of one
    pool layer ([Hkv, slots, D] each), masked by `bias` [n, L]: [n, Hkv, g, D]. Every size comes
    from a tensor's shape."""
    n, heads, dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    # [n, H, D] -> [Hkv, 1, g * n, D]: a group's queries side by side against its KV head.
    q = q.view(n, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, 1, group * n, dim)
    k_ctx, v_ctx = keys.index_select(1, slots), values.index_select(1, slots)
    out = _attend(q, k_ctx[:, None], v_ctx[:, None], bias)  # [Hkv, 1, g * n, D]
    return out.view(kv_heads, group, n, dim).permute(2, 0, 1, 3)


class TensorFields:
    """A dataclass of tensors only, so that a pass through it can be replayed as a trace with
    its fields as the trace's inputs: `tensors()` for the call, `from_tensors` inside it."""

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> Self:
        """The instance of `tensors()`; entries of other names are left out."""
        return cls(**{f.name: tensors[f.name] for f in fields(cls)})


@dataclass
class VarlenAttention:
    """Attention for a packed pass of sequences adding several tokens each (implements `KVCache`).

    Queries arrive packed, [N, H, D]. Each sequence attends only to its own keys, causally: work
    and memory O(sum n_i * L_i), where a block-diagonal mask over the packed pass would be
    O(N * sum L_i).
    """

    pool: KVPool
    write_slots: torch.Tensor  # [N]
    read_slots: list[torch.Tensor]  # per sequence [L_i]
    num_new: list[int]  # per sequence n_i, in query order
    biases: list[torch.Tensor]  # per sequence [n_i, L_i]: 0 where a query may see a key, -inf

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.store(layer, self.write_slots, k, v)
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        outputs = [
            attend_sequence(keys, values, q_seq, slots, bias)
            for q_seq, slots, bias in zip(
                q.split(self.num_new), self.read_slots, self.biases, strict=True
            )
        ]
        return torch.cat(outputs).reshape(q.shape)


@dataclass
class SequenceAttention(TensorFields):
    """A packed pass as one sequence (`plan_one_sequence`), tensors only (implements
    `KVCache`): no size reaches it but as a tensor's shape, so a pass through it can be replayed
    as a trace for any prompts and context lengths, with these as the trace's inputs (`tensors`,
    `from_tensors`)."""

    keys: torch.Tensor  # the pool's [layers, kv_heads, slots, D]
    values: torch.Tensor
    write_slots: torch.Tensor  # [n]
    read_slots: torch.Tensor  # [L]
    bias: torch.Tensor  # [n, L]: 0 where a query may see a key, -inf elsewhere

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.keys[layer], self.values[layer]
        store_slots(keys, values, self.write_slots, k, v)
        return attend_sequence(keys, values, q, self.read_slots, self.bias).reshape(q.shape)


SlotAttention = DecodeAttention | VarlenAttention


Upload = Callable[[torch.Tensor], torch.Tensor]


def plan_step(
    pool: KVPool,
    steps: list[SequenceStep],
    key_multiple: int = 1,
    upload: Upload | None = None,
) -> tuple[torch.Tensor, SlotAttention]:
    """Positions [N] and attention metadata for one packed FlowLM step.

    In a decode step the key length is rounded up to `key_multiple`, so that step shapes repeat.
    Everything is planned on the host and moved to the pool's device once, by `upload` (the
    engine's `DeviceIO.upload`; default `.to`); no step reads back from the device.
    """
    to_device = upload or _to(pool.keys.device)
    lengths = [len(s.slots) for s in steps]
    positions = _new_positions(lengths, [s.num_new for s in steps])
    write_slots = to_device(torch.cat([s.slots[len(s.slots) - s.num_new :] for s in steps]))
    if all(s.num_new == 1 for s in steps):
        longest = -(-max(lengths) // key_multiple) * key_multiple
        # Pad with slot 0; the bias hides it.
        read_slots = torch.zeros(len(steps), longest, dtype=torch.long)
        for row, s in enumerate(steps):
            read_slots[row, : len(s.slots)] = s.slots
        visible = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
        bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        attention: SlotAttention = DecodeAttention(
            pool, write_slots, to_device(read_slots), to_device(bias[None, :, None, None])
        )
    else:
        attention = VarlenAttention(
            pool,
            write_slots,
            [to_device(s.slots) for s in steps],
            [s.num_new for s in steps],
            [to_device(_causal_bias(n, s.num_new)) for s, n in zip(steps, lengths, strict=True)],
        )
    return to_device(positions), attention


def _new_positions(lengths: list[int], num_new: list[int]) -> torch.Tensor:
    """[sum(num_new)]: the positions each sequence computes in a step, its last `num_new` of
    `length`, sequence after sequence."""
    return torch.cat([torch.arange(n - k, n) for n, k in zip(lengths, num_new, strict=True)])


def _causal_bias(length: int, num_new: int) -> torch.Tensor:
    """[num_new, length]: query r (position length - num_new + r) sees positions 0 .. its own
    (0), not the later ones (-inf)."""
    queries = torch.arange(length - num_new, length)
    hidden = torch.arange(length)[None, :] > queries[:, None]
    return torch.zeros(hidden.shape).masked_fill_(hidden, -math.inf)


@dataclass
class PagedSequence:
    """One sequence of a packed prompt pass by its pages: its positions fill `pages`
    (`page_size` slots each) in order, `length` of them, the last `num_new` computed in the pass.
    Sequences of streams of one voice share its pages."""

    pages: list[int]
    length: int
    num_new: int


def plan_one_sequence(
    pool: KVPool, sequences: list[PagedSequence], page_size: int, upload: Upload | None = None
) -> tuple[torch.Tensor, SequenceAttention]:
    """A packed prompt pass as one `SequenceAttention`, the form a trace replays: the keys of
    every page the sequences use side by side, each page once, each query masked to its own
    sequence's positions (causally). Its attention scores N x U pairs, U the slots of the
    distinct pages, where a sequence at a time scores sum(n_i x L_i); the clauses of streams of
    one voice share its pages, read once here (four full-size clauses on a 150-position voice:
    U ~230 against sum(L_i) 680). Planned on the host from the page lists, every shape known
    before any data (the GPU path reads nothing back: tests/test_fake_cuda.py)."""
    to_device = upload or _to(pool.keys.device)
    offsets = torch.arange(page_size)

    def slots_of(pages: list[int]) -> torch.Tensor:
        return (torch.tensor(pages, dtype=torch.long)[:, None] * page_size + offsets).view(-1)

    used = [s.pages[: -(-s.length // page_size)] for s in sequences]
    distinct = list(dict.fromkeys(page for pages in used for page in pages))
    column = {page: i for i, page in enumerate(distinct)}
    bias = torch.full((sum(s.num_new for s in sequences), len(distinct) * page_size), -math.inf)
    row = 0
    for s, pages in zip(sequences, used, strict=True):
        keys = slots_of([column[page] for page in pages])[: s.length]  # its positions' columns
        bias[row : row + s.num_new, keys] = _causal_bias(s.length, s.num_new)
        row += s.num_new
    write_slots = torch.cat(
        [
            slots_of(pages)[s.length - s.num_new : s.length]
            for s, pages in zip(sequences, used, strict=True)
        ]
    )
    positions = _new_positions([s.length for s in sequences], [s.num_new for s in sequences])
    attention = SequenceAttention(
        pool.keys,
        pool.values,
        to_device(write_slots),
        to_device(slots_of(distinct)),
        to_device(bias),
    )
    return to_device(positions), attention


def _to(device: torch.device) -> Upload:
    return lambda tensor: tensor.to(device)
