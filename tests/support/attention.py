"""The reference attention the model's and the engine's attention paths are checked against,
and the checks themselves.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from intone.engine.models.pocket.kv_cache import KVPool, SequenceStep, plan_step


def embeddings(n: int, dim: int, seed: int) -> torch.Tensor:
    """[n, dim] inputs of a step, the same for the same seed."""
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


class PaddedGatherAttention:
    """The previous read path, kept as the reference: every layer gathers each row's context
    into a padded [G, L, H, D] copy and runs SDPA under a dense mask (block-diagonal over the
    whole packed pass for prefill). KV heads are repeated for grouped-query attention."""

    def __init__(self, pool: KVPool, steps: list[SequenceStep], key_multiple: int = 1):
        self.pool = pool
        lengths = [len(s.slots) for s in steps]
        pairs = zip(steps, lengths, strict=True)
        positions = torch.cat([torch.arange(n - s.num_new, n) for s, n in pairs])
        self.write_slots = torch.cat([s.slots[len(s.slots) - s.num_new :] for s in steps])
        if all(s.num_new == 1 for s in steps):
            longest = -(-max(lengths) // key_multiple) * key_multiple
            self.read_slots = torch.zeros(len(steps), longest, dtype=torch.long)
            for row, s in enumerate(steps):
                self.read_slots[row, : len(s.slots)] = s.slots
            mask = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
            self.mask = mask[:, None, None, :]
        else:
            self.read_slots = torch.cat([s.slots for s in steps])[None, :]
            key_seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
            key_pos = torch.cat([torch.arange(n) for n in lengths])
            query_seq = torch.cat([torch.full((s.num_new,), i) for i, s in enumerate(steps)])
            mask = (query_seq[:, None] == key_seq[None, :]) & (
                key_pos[None, :] <= positions[:, None]
            )
            self.mask = mask[None, None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Slot-major views [S, H, D] of the head-major pool, as the previous path read it.
        keys, values = (
            self.pool.keys[layer].transpose(0, 1),
            self.pool.values[layer].transpose(0, 1),
        )
        keys.index_copy_(0, self.write_slots, k)
        values.index_copy_(0, self.write_slots, v)
        groups = self.read_slots.shape[0]
        n, heads, dim = q.shape
        repeat = heads // keys.shape[1]
        q = q.view(groups, n // groups, heads, dim).transpose(1, 2)
        k_ctx = keys[self.read_slots].repeat_interleave(repeat, dim=2).transpose(1, 2)
        v_ctx = values[self.read_slots].repeat_interleave(repeat, dim=2).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k_ctx, v_ctx, attn_mask=self.mask)
        return out.transpose(1, 2).reshape(n, heads, dim)


def clone_pool(pool: KVPool) -> KVPool:
    copy = KVPool.__new__(KVPool)
    copy.keys, copy.values = pool.keys.clone(), pool.values.clone()
    return copy


def assert_relative(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    error = float((got - want).norm() / want.norm())
    assert error <= rtol, f"relative error {error:.2e}"


@torch.no_grad()
def check_step(
    flow_lm, pool: KVPool, steps: list[SequenceStep], x: torch.Tensor, key_multiple: int = 1
) -> None:
    """The backbone through plan_step equals it through the previous path, and both write the
    same keys and values; the pool then holds the step (as the engine's would)."""
    old_pool = clone_pool(pool)
    positions, attention = plan_step(pool, steps, key_multiple)
    got = flow_lm.backbone(x, positions, attention)
    want = flow_lm.backbone(x, positions, PaddedGatherAttention(old_pool, steps, key_multiple))
    assert_relative(got, want)
    assert_relative(pool.keys, old_pool.keys)
    assert_relative(pool.values, old_pool.values)
