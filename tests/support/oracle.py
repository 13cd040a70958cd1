"""intone's single-request path and the pocket-tts package on the same checkpoint, side by side:
the oracle and model-family suites compare the two.
"""

from __future__ import annotations

from pathlib import Path

import torch

from intone.engine.generate import generate, generate_latents
from intone.engine.loading import LoadedModel
from intone.engine.options import GenerationOptions
from intone.engine.voices import Voice


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


class Reference:
    """pocket_tts at temperature 0, recording every latent it samples."""

    def __init__(self, checkpoint: Path, eos_threshold: float):
        from pocket_tts import TTSModel

        self.model = TTSModel.load_model(
            config=str(checkpoint / "config.yaml"), temp=0.0, eos_threshold=eos_threshold
        )
        self.latents: list[torch.Tensor] = []
        sample = self.model.flow_lm._sample_next_latent

        def recording(sequence: torch.Tensor, *args, **kwargs):
            out = sample(sequence, *args, **kwargs)
            if sequence.shape[1] == 1:  # generation steps, not prompt prefills
                self.latents.append(out[0].clone())
            return out

        self.model.flow_lm._sample_next_latent = recording

    def run(self, wav: Path, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.model.get_state_for_audio_prompt(wav)
        audio = self.model.generate_audio(state, text)
        return torch.cat(self.latents), audio


def ours(
    loaded: LoadedModel, voice: Voice, text: str, eos_threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # The reference reads the text as written: spoken-form normalisation is ours alone.
    options = GenerationOptions(
        temperature=0.0, eos_threshold=eos_threshold, chain_frames=0, normalize=False
    )
    latents = torch.stack(
        [latent for _, latent in generate_latents(loaded, voice, [text], options)]
    )
    audio = torch.cat(list(generate(loaded, voice, [text], options)))
    return latents, audio
