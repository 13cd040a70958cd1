"""The N-step Euler flow-matching head, against the reference on a checkpoint that uses it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from intone.engine.generate import generate_latents
from intone.engine.loading import load_model
from intone.engine.models.pocket.config import dump_config, load_config
from intone.engine.models.pocket.model import PocketTTS
from intone.engine.options import GenerationOptions
from intone.engine.voices import load_voice

TEXT = "The flow head integrates its velocity field in several steps."
STEPS = 4


@pytest.fixture(scope="module")
def flow_matching_checkpoint(
    tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny checkpoint with a one-time-condition (flow_matching) head in place of LSD's."""
    out = tmp_path_factory.mktemp("flow_matching")
    config = load_config(tiny_checkpoint / "config.yaml")
    config.flow_lm.flow.type = "flow_matching"
    config.weights_path = str(out / "model.safetensors")
    dump_config(config, out / "config.yaml")
    shutil.copytree(tiny_checkpoint / "voices", out / "voices")
    state = safetensors.torch.load_file(str(tiny_checkpoint / "model.safetensors"))
    torch.manual_seed(3)
    fresh = PocketTTS(config).state_dict()
    state = {k: v for k, v in state.items() if not k.startswith("flow_lm.flow_net.")}
    state.update({k: v for k, v in fresh.items() if k.startswith("flow_lm.flow_net.")})
    safetensors.torch.save_file(state, str(out / "model.safetensors"))
    return out


def test_euler_head_equals_reference(flow_matching_checkpoint: Path):
    from pocket_tts import TTSModel

    reference = TTSModel.load_model(
        config=str(flow_matching_checkpoint / "config.yaml"),
        temp=0.0,
        eos_threshold=1e9,
        sampler_decode_steps=STEPS,
    )
    recorded: list[torch.Tensor] = []
    sample = reference.flow_lm._sample_next_latent

    def recording(sequence: torch.Tensor, *args, **kwargs):
        out = sample(sequence, *args, **kwargs)
        if sequence.shape[1] == 1:
            recorded.append(out[0].clone())
        return out

    reference.flow_lm._sample_next_latent = recording
    wav = flow_matching_checkpoint / "voices" / "default.wav"
    reference.generate_audio(reference.get_state_for_audio_prompt(wav), TEXT)

    loaded = load_model(flow_matching_checkpoint)
    assert loaded.model.flow_lm.flow_net.num_time_conds == 1
    voice = load_voice(loaded.model, "default", wav)
    options = GenerationOptions(
        temperature=0.0, eos_threshold=1e9, chain_frames=0, flow_steps=STEPS
    )
    ours = torch.stack([latent for _, latent in generate_latents(loaded, voice, [TEXT], options)])
    theirs = torch.cat(recorded)
    assert ours.shape == theirs.shape
    assert float((ours - theirs).norm() / theirs.norm()) < 1e-4
    # More steps change the result: the steps are really integrated.
    one_step = GenerationOptions(temperature=0.0, eos_threshold=1e9, chain_frames=0, flow_steps=1)
    first = next(generate_latents(loaded, voice, [TEXT], one_step))[1]
    assert float((first - ours[0]).norm()) > 1e-4


def per_row_sample(head, z: torch.Tensor, noise: torch.Tensor, steps: int) -> torch.Tensor:
    """The reference's integration: each step's times as a [rows, 1] column through `forward`."""
    ones = torch.ones_like(noise[..., :1])
    current = noise
    for i in range(steps):
        times = (i / steps * ones, (i + 1) / steps * ones)[: head.num_time_conds]
        current = current + head(z, *times, current) / steps
    return current


@pytest.mark.parametrize("head_type", ["lsd", "flow_matching"])
@pytest.mark.parametrize("steps", [1, 3])
def test_a_schedule_made_once_samples_as_the_times_per_row(
    head_type: str, steps: int, tiny_checkpoint: Path, flow_matching_checkpoint: Path
):
    """`FlowHead.schedule`, made once (as the engine's runner does) or per call, gives each row
    the latent the reference's per-row times give; the steps' times are in their order."""
    checkpoint = tiny_checkpoint if head_type == "lsd" else flow_matching_checkpoint
    head = load_model(checkpoint).model.flow_lm.flow_net
    assert head.flow_type == head_type
    generator = torch.Generator().manual_seed(steps)
    z = torch.randn(5, head.cond_embed.in_features, generator=generator)
    noise = torch.randn(5, head.input_proj.in_features, generator=generator)
    with torch.no_grad():
        expected = per_row_sample(head, z, noise, steps)
        schedule = head.schedule(steps)
        assert len(schedule) == steps
        torch.testing.assert_close(head.sample(z, noise, steps, schedule), expected)
        torch.testing.assert_close(head.sample(z, noise, steps), expected)
        if steps > 1:  # a schedule in another order is another integration
            swapped = head.sample(z, noise, steps, schedule[::-1])
            assert not torch.allclose(swapped, expected, atol=1e-4)
