"""FlowLM key/value storage: a flat pool of slots, addressed by slot indices.

A slot holds one position's rotated key and value for every layer. Who decides which slot a
position lives in is the caller's business: the single-request path gives a request one contiguous
run of slots, the engine's block manager hands out fixed-size pages. Either way a step only needs
the slot of every position it reads and writes, so the attention code is the same for both and a
batch never copies caches when its membership changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from intone.engine.models.pocket.transformer import expand_kv_heads


class KVPool:
    """Keys and values [layers, slots, kv_heads, head_dim]: the attention's key/value heads."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (num_layers, num_slots, num_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_slots(self) -> int:
        return self.keys.shape[1]

    @property
    def slot_bytes(self) -> int:
        """Memory one slot (one position, every layer, keys and values) takes."""
        layers, _, heads, dim = self.keys.shape
        return 2 * layers * heads * dim * self.keys.element_size()

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values [layers, n, H, D] computed elsewhere (a voice state) at slots [n]."""
        self.keys.index_copy_(1, slots, keys.to(self.keys))
        self.values.index_copy_(1, slots, values.to(self.values))

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.index_select(1, slots), self.values.index_select(1, slots)


@dataclass
class SequenceStep:
    """One sequence's part of a FlowLM step.

    slots: the slot of every position of the sequence after this step, history first.
    num_new: how many trailing positions are computed in this step.
    """

    slots: torch.Tensor
    num_new: int


@dataclass
class SlotAttention:
    """Per-step attention metadata, shared by every layer (implements `KVCache`).

    Queries arrive packed, [N, H, D], with no padding. They are viewed as G groups of equal
    length: one group per sequence when every sequence adds one token (decode), or a single
    group holding everything with a block-diagonal causal mask (packed prefill, mixed steps).
    """

    pool: KVPool
    write_slots: torch.Tensor  # [N]
    read_slots: torch.Tensor  # [G, L]
    mask: torch.Tensor  # [G, 1, N // G, L], True where a query may see a key

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        keys.index_copy_(0, self.write_slots, k)
        values.index_copy_(0, self.write_slots, v)
        groups = self.read_slots.shape[0]
        n, heads, dim = q.shape
        q = q.view(groups, n // groups, heads, dim).transpose(1, 2)
        k_ctx = expand_kv_heads(keys[self.read_slots], heads).transpose(1, 2)
        v_ctx = expand_kv_heads(values[self.read_slots], heads).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k_ctx, v_ctx, attn_mask=self.mask)
        return out.transpose(1, 2).reshape(n, heads, dim)


def plan_step(
    pool: KVPool, steps: list[SequenceStep], key_multiple: int = 1
) -> tuple[torch.Tensor, SlotAttention]:
    """Positions [N] and attention metadata for one packed FlowLM step.

    In a decode step the key length is rounded up to `key_multiple`, so that step shapes repeat.
    """
    device = pool.keys.device
    positions = torch.cat([torch.arange(len(s.slots) - s.num_new, len(s.slots)) for s in steps]).to(
        device
    )
    write_slots = torch.cat([s.slots[len(s.slots) - s.num_new :] for s in steps]).to(device)
    lengths = [len(s.slots) for s in steps]
    if all(s.num_new == 1 for s in steps):
        longest = -(-max(lengths) // key_multiple) * key_multiple
        # Pad with slot 0; the mask hides it.
        read_slots = torch.zeros(len(steps), longest, dtype=torch.long)
        for row, s in enumerate(steps):
            read_slots[row, : len(s.slots)] = s.slots
        mask = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
        mask = mask[:, None, None, :]
    else:
        read_slots = torch.cat([s.slots for s in steps])[None, :]
        key_seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
        key_pos = torch.cat([torch.arange(n) for n in lengths])
        query_seq = torch.cat([torch.full((s.num_new,), i) for i, s in enumerate(steps)])
        mask = (query_seq[:, None] == key_seq[None, :]) & (
            key_pos[None, :] <= positions.cpu()[:, None]
        )
        mask = mask[None, None]
    return positions, SlotAttention(pool, write_slots, read_slots.to(device), mask.to(device))
