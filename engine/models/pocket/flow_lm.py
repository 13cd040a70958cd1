"""The FlowLM: text/voice/audio-latent backbone, EOS head and flow sampling head.

It works on packed tokens [N, D] with a position per token, so one call can mix prompts of
different lengths and requests at different generation steps. Parameter names follow the released
checkpoint (`flow_lm.*`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from intone.engine.models.pocket.config import FlowLMConfig
from intone.engine.models.pocket.flow_head import FlowHead
from intone.engine.models.pocket.kv_cache import KVPool
from intone.engine.models.pocket.transformer import KVCache, Transformer


class LUTConditioner(nn.Module):
    """Token embedding table; n_bins + 1 rows because the last one was the training padding.

    With a `rank`, the table is low-rank: rank-wide rows and a bias-free projection to `dim`.
    """

    def __init__(self, n_bins: int, dim: int, rank: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(n_bins + 1, rank or dim)
        self.proj = None if rank is None else nn.Linear(rank, dim, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return x if self.proj is None else self.proj(x)


class FlowLM(nn.Module):
    emb_std: torch.Tensor
    emb_mean: torch.Tensor

    def __init__(self, config: FlowLMConfig, latent_dim: int, voice_latent_dim: int):
        super().__init__()
        tcfg = config.transformer
        lookup = config.lookup_table
        dim = tcfg.d_model
        self.dim = dim
        self.latent_dim = latent_dim
        self.conditioner = LUTConditioner(lookup.n_bins, lookup.dim, lookup.rank)
        # The sampler and EOS heads read z: the backbone output, projected to z_dim if set.
        z_dim = config.z_dim or dim
        self.flow_net = FlowHead(
            latent_dim, config.flow.dim, z_dim, config.flow.depth, config.flow.type
        )
        self.transformer = Transformer(
            d_model=dim,
            num_heads=tcfg.num_heads,
            num_layers=tcfg.num_layers,
            dim_feedforward=tcfg.dim_feedforward or dim * tcfg.hidden_scale,
            max_period=float(tcfg.max_period),
            attn_dim=tcfg.attn_dim,
            num_kv_heads=tcfg.num_kv_heads,
        )
        self.register_buffer("emb_std", torch.ones(latent_dim))
        self.register_buffer("emb_mean", torch.zeros(latent_dim))
        self.bos_emb = nn.Parameter(torch.randn(latent_dim))
        self.insert_bos_before_voice = config.insert_bos_before_voice
        if self.insert_bos_before_voice:
            self.bos_before_voice = nn.Parameter(torch.randn(1, 1, dim))
        self.input_linear = nn.Linear(latent_dim, dim, bias=False)
        self.out_norm = nn.LayerNorm(dim, eps=1e-5)
        self.z_proj = None if config.z_dim is None else nn.Linear(dim, config.z_dim, bias=False)
        self.out_eos = nn.Linear(z_dim, 1)
        self.speaker_proj_weight = nn.Parameter(torch.randn(dim, voice_latent_dim) * 0.02)

    @property
    def num_layers(self) -> int:
        return len(self.transformer.layers)

    def new_kv_pool(
        self,
        num_slots: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVPool:
        """A key/value pool shaped for this backbone (its key/value heads, not its query heads)."""
        tf = self.transformer
        return KVPool(
            self.num_layers,
            num_slots,
            tf.num_kv_heads,
            tf.head_dim,
            dtype=tf.dtype if dtype is None else dtype,
            device=self.input_linear.weight.device if device is None else device,
        )

    def embed_text(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.conditioner(tokens)

    def embed_voice(self, voice_latents: torch.Tensor) -> torch.Tensor:
        """Voice-prompt embeddings [T, D] from de-normalised Mimi latents [T, latent]."""
        embeddings = F.linear(voice_latents.to(torch.float32), self.speaker_proj_weight)
        if self.insert_bos_before_voice:
            embeddings = torch.cat([self.bos_before_voice[0], embeddings], dim=0)
        return embeddings

    def embed_tail(
        self, latents: torch.Tensor, to_voice_space: nn.Module | None = None
    ) -> torch.Tensor:
        """Prompt embeddings [T, D] for normalised latents [T, latent], like voice frames: how a
        clause continues the previous clause's audio (chaining). `to_voice_space` maps latents
        into the voice frames' space where that is wider (`PocketTTS.tail_projection`)."""
        x = self.denormalize(latents)
        if to_voice_space is not None:
            x = to_voice_space(x.T[None])[0].T
        return F.linear(x, self.speaker_proj_weight)

    def embed_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Backbone inputs [N, D] from normalised latents [N, latent]; NaN rows mean BOS."""
        latents = torch.where(torch.isnan(latents), self.bos_emb, latents)
        return self.input_linear(latents)

    def backbone(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Backbone outputs z [N, z_dim], float32 whatever precision the transformer runs in."""
        x = self.transformer(x.to(self.transformer.dtype), positions, cache)
        z = self.out_norm(x.to(torch.float32))
        return z if self.z_proj is None else self.z_proj(z)

    def eos_logit(self, z: torch.Tensor) -> torch.Tensor:
        return self.out_eos(z.to(torch.float32))[..., 0]

    def sample_latent(
        self,
        z: torch.Tensor,
        noise: torch.Tensor,
        num_steps: int,
        schedule: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`FlowHead.sample`; `schedule`: its `schedule(num_steps)`, made once by the caller."""
        return self.flow_net.sample(z.to(torch.float32), noise, num_steps, schedule)

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        return latents * self.emb_std + self.emb_mean
