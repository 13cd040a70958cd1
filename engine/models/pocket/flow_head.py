"""The sampling head: an AdaLN MLP that turns Gaussian noise into the next latent.

It is conditioned on the backbone output z and on flow times. `sample` draws each row's noise from
that row's own generator, so a request's latent never depends on its batch neighbours.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from intone.engine.models.pocket.config import FLOW_TYPES


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.alpha = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The released weights were trained with variance (not mean square) normalisation.
        var = self.eps + x.var(dim=-1, keepdim=True)
        return (x * (self.alpha.to(var) * torch.rsqrt(var))).to(x.dtype)


class LayerNorm(nn.Module):
    """Plain LayerNorm whose affine part may be absent, with the reference's parameter names."""

    def __init__(self, channels: int, eps: float = 1e-6, elementwise_affine: bool = True):
        super().__init__()
        self.eps = eps
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(channels))
            self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = getattr(self, "weight", None), getattr(self, "bias", None)
        return F.layer_norm(x, x.shape[-1:], weight, bias, self.eps)


class TimestepEmbedder(nn.Module):
    freqs: torch.Tensor

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size),
            RMSNorm(hidden_size),
        )
        half = frequency_embedding_size // 2
        self.register_buffer("freqs", torch.exp(-math.log(10000) * torch.arange(half) / half))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        args = t * self.freqs.to(t.dtype)
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))


class ResBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.in_ln = LayerNorm(channels, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(channels, channels), nn.SiLU(), nn.Linear(channels, channels)
        )
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 3 * channels))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.adaLN_modulation(y).chunk(3, dim=-1)
        return x + gate * self.mlp(_modulate(self.in_ln(x), shift, scale))


class FinalLayer(nn.Module):
    def __init__(self, model_channels: int, out_channels: int):
        super().__init__()
        self.norm_final = LayerNorm(model_channels, eps=1e-6, elementwise_affine=False)
        self.linear = nn.Linear(model_channels, out_channels)
        self.adaLN_modulation = nn.Sequential(
            nn.SiLU(), nn.Linear(model_channels, 2 * model_channels)
        )

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(_modulate(self.norm_final(x), shift, scale))


class FlowHead(nn.Module):
    """`SimpleMLPAdaLN` of the reference: velocity(z, times..., x)."""

    def __init__(
        self,
        latent_dim: int,
        model_channels: int,
        cond_channels: int,
        num_res_blocks: int,
        flow_type: str,
    ):
        super().__init__()
        if flow_type not in FLOW_TYPES:
            raise ValueError(f"unsupported flow type {flow_type!r}: use one of {list(FLOW_TYPES)}")
        self.flow_type = flow_type
        self.num_time_conds = FLOW_TYPES[flow_type]
        self.time_embed = nn.ModuleList(
            TimestepEmbedder(model_channels) for _ in range(self.num_time_conds)
        )
        self.cond_embed = nn.Linear(cond_channels, model_channels)
        self.input_proj = nn.Linear(latent_dim, model_channels)
        self.res_blocks = nn.ModuleList(ResBlock(model_channels) for _ in range(num_res_blocks))
        self.final_layer = FinalLayer(model_channels, latent_dim)

    def forward(self, z: torch.Tensor, *times_and_x: torch.Tensor) -> torch.Tensor:
        *times, x = times_and_x
        return self.velocity(z, self.time_conditioning(*times) if times else None, x)

    def time_conditioning(self, *times: torch.Tensor) -> torch.Tensor:
        """The mean of the time embeddings: [rows, C] for times [rows, 1]."""
        return sum(emb(t) for emb, t in zip(self.time_embed, times, strict=True)) / len(times)

    def velocity(
        self, z: torch.Tensor, times: torch.Tensor | None, x: torch.Tensor
    ) -> torch.Tensor:
        """The head's output for conditioning z, the time conditioning (None for a head without
        times) and its input x."""
        x = self.input_proj(x)
        y = self.cond_embed(z)
        if times is not None:
            y = y + times
        for block in self.res_blocks:
            x = block(x, y)
        return self.final_layer(x, y)

    def schedule(self, num_steps: int, device: torch.device | None = None) -> list[torch.Tensor]:
        """Each integration step's time conditioning [1, C] (empty for the one-step heads): it
        depends on the step alone, so a caller that samples many latents computes it once
        instead of per row and call (12-16% of the head's time at 1-16 rows, full size, one
        thread)."""
        if not self.num_time_conds:
            return []
        # A step's times: its start, and for LSD its end too.
        steps = [(i / num_steps, (i + 1) / num_steps) for i in range(num_steps)]
        with torch.no_grad():
            return [
                self.time_conditioning(
                    *(torch.full((1, 1), t, device=device) for t in times[: self.num_time_conds])
                )
                for times in steps
            ]

    def sample(
        self,
        z: torch.Tensor,
        noise: torch.Tensor,
        num_steps: int,
        schedule: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """A latent from noise [B, latent], conditioned on z [B, cond].

        `num_steps` integration steps for "lsd" and "flow_matching"; the one-step heads ignore it.
        `schedule`: `self.schedule(num_steps)`, made once by the caller (else here).
        """
        if self.flow_type == "drifting":
            return self(z, noise)
        if self.flow_type == "pointwise":
            return noise + self(z, noise)
        if schedule is None:
            schedule = self.schedule(num_steps, noise.device)
        current = noise
        for times in schedule:
            current = current + self.velocity(z, times, current) / num_steps
        return current


def draw_noise(
    generators: list[torch.Generator],
    latent_dim: int,
    temperatures: list[float],
    noise_clamps: list[float | None],
    device: torch.device,
) -> torch.Tensor:
    """One noise row per request, each from that request's own generator, never the global RNG.

    std = sqrt(temperature); with a clamp the draw is a truncated normal, as in the reference.
    """
    rows = []
    for generator, temperature, clamp in zip(generators, temperatures, noise_clamps, strict=True):
        row = torch.zeros(latent_dim)
        std = temperature**0.5
        if temperature > 0 and clamp is None:
            row.normal_(0.0, std, generator=generator)
        elif temperature > 0:
            nn.init.trunc_normal_(row, 0.0, std, -clamp, clamp, generator=generator)
        rows.append(row)
    return torch.stack(rows).to(device)
