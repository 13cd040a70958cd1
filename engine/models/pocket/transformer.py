"""Pre-LN transformer layers shared by the FlowLM backbone and the Mimi decoder.

Attention never owns its keys and values. It computes q/k/v, rotates them at each token's own
position, and hands them to a `KVCache`, which stores them wherever its owner keeps state (flat
slots for FlowLM, a per-row sliding window for Mimi) and runs the attention. That is what lets one
batch mix requests at different positions with different histories.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F


class KVCache(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's k/v for `layer` and return attention output shaped like q.

        q, k, v: [..., T, H, D] with the leading dims the cache expects.
        """
        ...


def rope_rotation(positions: torch.Tensor, head_dim: int, max_period: float) -> torch.Tensor:
    """Unit complex numbers e^(i * pos * freq_k) [*positions.shape, 1, head_dim // 2] that rotate
    interleaved pairs (x[2k], x[2k+1]) at each position. Computed once per pass in float32, as
    the reference does, and shared by every layer's queries and keys."""
    freqs = torch.exp(
        torch.arange(head_dim // 2, device=positions.device, dtype=torch.float32)
        * (-math.log(max_period) * 2 / head_dim)
    )
    angles = positions.to(torch.float32)[..., None, None] * freqs
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x [..., H, D] by `rotation` (`rope_rotation`): one complex
    multiply, in float32."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


class MultiheadAttention(nn.Module):
    """Self-attention with rotary positions.

    Queries and the output are `attn_dim` wide (`embed_dim` by default), split in `num_heads`
    heads; keys and values have `num_kv_heads` heads of the same width (`num_heads` by default),
    each shared by `num_heads // num_kv_heads` query heads. Caches hold the key/value heads only.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        attn_dim: int | None = None,
        num_kv_heads: int | None = None,
    ):
        super().__init__()
        attn_dim = attn_dim or embed_dim
        num_kv_heads = num_kv_heads or num_heads
        if attn_dim % num_heads or num_heads % num_kv_heads:
            raise ValueError(
                f"attention needs attn_dim ({attn_dim}) divisible by num_heads ({num_heads}) and "
                f"num_heads divisible by num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = attn_dim // num_heads
        self.attn_dim = attn_dim
        # Fused q/k/v projection: the released weights store it as one matrix.
        kv_dim = num_kv_heads * self.head_dim
        self.in_proj = nn.Linear(embed_dim, attn_dim + 2 * kv_dim, bias=False)
        self.out_proj = nn.Linear(attn_dim, embed_dim, bias=False)

    def forward(
        self, x: torch.Tensor, rotation: torch.Tensor, cache: KVCache, layer: int
    ) -> torch.Tensor:
        lead = x.shape[:-1]
        projected = self.in_proj(x)
        q = projected[..., : self.attn_dim].reshape(*lead, self.num_heads, self.head_dim)
        kv = projected[..., self.attn_dim :].reshape(*lead, 2, self.num_kv_heads, self.head_dim)
        k, v = kv.unbind(dim=-3)
        q = apply_rope(q, rotation)
        k = apply_rope(k, rotation)
        out = cache.attend(layer, q, k, v)
        return self.out_proj(out.reshape(*lead, -1))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class LayerScale(nn.Module):
    def __init__(self, channels: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((channels,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class TransformerLayer(nn.Module):
    def __init__(
        self,
        d_model: int,
        num_heads: int,
        dim_feedforward: int,
        layer_scale: float | None = None,
        attn_dim: int | None = None,
        num_kv_heads: int | None = None,
    ):
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, num_heads, attn_dim, num_kv_heads)
        self.norm1 = nn.LayerNorm(d_model, eps=1e-5)
        self.norm2 = nn.LayerNorm(d_model, eps=1e-5)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=False)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=False)
        if layer_scale is None:
            self.layer_scale_1: nn.Module = nn.Identity()
            self.layer_scale_2: nn.Module = nn.Identity()
        else:
            self.layer_scale_1 = LayerScale(d_model, layer_scale)
            self.layer_scale_2 = LayerScale(d_model, layer_scale)
        # The feed-forward activation: an owner may swap in a faster kernel of the same function
        # (the CPU decoder's copy does: engine/kernels/cpu_decoder.py).
        self.activation: Callable[[torch.Tensor], torch.Tensor] = gelu_tanh

    def forward(
        self, x: torch.Tensor, rotation: torch.Tensor, cache: KVCache, layer: int
    ) -> torch.Tensor:
        x = x + self.layer_scale_1(self.self_attn(self.norm1(x), rotation, cache, layer))
        update = self.linear2(self.activation(self.linear1(self.norm2(x))))
        return x + self.layer_scale_2(update)


class Transformer(nn.Module):
    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_layers: int,
        dim_feedforward: int,
        max_period: float = 10_000.0,
        layer_scale: float | None = None,
        attn_dim: int | None = None,
        num_kv_heads: int | None = None,
    ):
        super().__init__()
        self.layers = nn.ModuleList(
            TransformerLayer(
                d_model, num_heads, dim_feedforward, layer_scale, attn_dim, num_kv_heads
            )
            for _ in range(num_layers)
        )
        attention = self.layers[0].self_attn
        self.num_heads = attention.num_heads
        # What a key/value cache holds per position and layer: num_kv_heads x head_dim.
        self.num_kv_heads = attention.num_kv_heads
        self.head_dim = attention.head_dim
        self.max_period = max_period

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of its activations (its linears may be int8: engine/kernels/int8.py)."""
        return self.layers[0].norm1.weight.dtype

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """x [..., T, d_model] at `positions` (x's shape minus the last dim)."""
        rotation = rope_rotation(positions, self.head_dim, self.max_period)
        for index, layer in enumerate(self.layers):
            x = layer(x, rotation, cache, index)
        return x
