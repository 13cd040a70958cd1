"""The Pocket TTS model as one module whose state_dict is the released checkpoint's layout."""

from __future__ import annotations

import torch
from torch import nn

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

    @property
    def tail_projection(self) -> nn.Module | None:
        """What `FlowLM.embed_tail` needs to put latents where voice frames live: the quantizer's
        output projection where voice frames are wider than a latent, else nothing."""
        return self.mimi.quantizer.output_proj if self.latents_need_projection else None

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame

    @property
    def device(self) -> torch.device:
        return self.flow_lm.input_linear.weight.device
