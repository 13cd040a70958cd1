"""intone's single-request path against the pocket-tts package on the same checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from intone.engine.generate import generate_latents
from intone.engine.loading import LoadedModel, load_model
from intone.engine.models.pocket.config import dump_config, load_config
from intone.engine.options import GenerationOptions
from intone.engine.voices import Voice, load_voice

from support.engine import NO_EOS
from support.oracle import Reference, ours, relative_error

TEXT = "Hello world, this is a quick test of the streaming system."


def check_equal(checkpoint: Path, loaded: LoadedModel, voice: Voice) -> None:
    wav = checkpoint / "voices" / "default.wav"
    ref_latents, ref_audio = Reference(checkpoint, NO_EOS).run(wav, TEXT)
    latents, audio = ours(loaded, voice, TEXT, NO_EOS)
    assert latents.shape == ref_latents.shape
    assert relative_error(latents, ref_latents) < 1e-4
    assert audio.dtype == torch.float32 and audio.shape == ref_audio.shape
    assert relative_error(audio, ref_audio) < 1e-4


def test_tiny_equals_reference(tiny_checkpoint: Path, tiny_model: LoadedModel, tiny_voice: Voice):
    check_equal(tiny_checkpoint, tiny_model, tiny_voice)


@pytest.mark.full
def test_full_size_equals_reference(full_checkpoint: Path):
    loaded = load_model(full_checkpoint)
    voice = load_voice(loaded.model, "default", full_checkpoint / "voices" / "default.wav")
    check_equal(full_checkpoint, loaded, voice)


def eos_logits(loaded: LoadedModel, voice: Voice) -> list[float]:
    logits: list[float] = []
    eos_logit = loaded.model.flow_lm.eos_logit

    def recording(z: torch.Tensor) -> torch.Tensor:
        out = eos_logit(z)
        logits.append(float(out[0]))
        return out

    loaded.model.flow_lm.eos_logit = recording
    options = GenerationOptions(
        temperature=0.0, eos_threshold=NO_EOS, chain_frames=0, normalize=False
    )
    list(generate_latents(loaded, voice, [TEXT], options))
    return logits


@pytest.fixture(scope="module")
def eos_checkpoint(
    tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, float, int]:
    """The tiny checkpoint with an EOS head whose logit sets a new record mid-utterance.

    The generated EOS head's logit only falls along the utterance, so any threshold fires at
    the first allowed frame. Redrawing the head's direction gives a trajectory with a later
    record; a threshold between that record and everything before it fires there.
    """
    out = tmp_path_factory.mktemp("eos")
    state = safetensors.torch.load_file(str(tiny_checkpoint / "model.safetensors"))
    config = load_config(tiny_checkpoint / "config.yaml")
    config.weights_path = str(out / "model.safetensors")
    dump_config(config, out / "config.yaml")
    shutil.copytree(tiny_checkpoint / "voices", out / "voices")
    for seed in range(50):
        weight = state["flow_lm.out_eos.weight"]
        state["flow_lm.out_eos.weight"] = torch.randn(
            weight.shape, generator=torch.Generator().manual_seed(seed)
        )
        safetensors.torch.save_file(state, str(out / "model.safetensors"))
        loaded = load_model(out)
        voice = load_voice(loaded.model, "default", out / "voices" / "default.wav")
        logits = eos_logits(loaded, voice)
        for frame in range(20, len(logits) - 8):
            before = max(logits[6:frame])
            if logits[frame] > before + 1e-3:
                return out, (logits[frame] + before) / 2, frame
    pytest.fail("no EOS head direction gives a mid-utterance record")


def test_eos_frame_and_length_equal_reference(eos_checkpoint: tuple[Path, float, int]):
    checkpoint, threshold, eos_frame = eos_checkpoint
    loaded = load_model(checkpoint)
    voice = load_voice(loaded.model, "default", checkpoint / "voices" / "default.wav")
    ref_latents, ref_audio = Reference(checkpoint, threshold).run(
        checkpoint / "voices" / "default.wav", TEXT
    )
    latents, audio = ours(loaded, voice, TEXT, threshold)
    frames_after_eos = 1 + 2  # the reference's default for a text of more than 4 words
    assert latents.shape[0] == eos_frame + frames_after_eos
    # The reference samples one more latent, at the frame where it stops, and drops it.
    assert ref_latents.shape[0] == latents.shape[0] + 1
    assert relative_error(latents, ref_latents[:-1]) < 1e-4
    assert audio.shape == ref_audio.shape
    assert relative_error(audio, ref_audio) < 1e-4
