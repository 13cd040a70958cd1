"""The Pocket TTS model as one module whose state_dict is the released checkpoint's layout."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from intone.engine.models.pocket.config import Config
from intone.engine.models.pocket.flow_lm import FlowLM
from intone.engine.models.pocket.mimi import Mimi

# Keys only the voice-cloning release carries: without them a voice must come as a voice state.
ENCODER_PREFIXES = ("mimi.encoder.", "mimi.encoder_transformer.", "mimi.downsample.")


class PocketTTS(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        voice_latent_dim = config.mimi.inner_dim or config.mimi.seanet.dimension
        self.flow_lm = FlowLM(config.flow_lm, config.latent_dim, voice_latent_dim)
        self.mimi = Mimi(config.mimi)
        self.has_voice_encoder = True
        # Voice frames are Mimi encoder outputs. Where those are wider than a latent (inner_dim
        # 512 in english_2026-01), a generated latent reaches that space through the quantizer's
        # output projection, the decoder's view of the encoder output.
        self.latents_need_projection = voice_latent_dim != config.latent_dim
        if (
            self.latents_need_projection
            and voice_latent_dim != config.mimi.quantizer.output_dimension
        ):
            raise ValueError(
                f"mimi.inner_dim ({voice_latent_dim}) must equal the latent dimension "
                f"({config.latent_dim}) or mimi.quantizer.output_dimension "
                f"({config.mimi.quantizer.output_dimension})"
            )

    def latents_as_voice(self, latents: torch.Tensor) -> torch.Tensor:
        """Prompt embeddings [T, D] for normalised latents [T, latent]: like voice frames.

        This is how a clause's audio continues the previous clause's (chaining).
        """
        x = self.flow_lm.denormalize(latents)
        if self.latents_need_projection:
            x = self.mimi.quantizer.output_proj(x.T[None])[0].T
        return F.linear(x, self.flow_lm.speaker_proj_weight)

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame

    @property
    def device(self) -> torch.device:
        return self.flow_lm.input_linear.weight.device
