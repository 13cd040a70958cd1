"""Voices from audio files of any rate and format, and from reference voice-state files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile
import soxr
import torch
from safetensors.torch import load_file, save_file

from intone.engine import Engine, EngineConfig
from intone.engine.generate import generate
from intone.engine.loading import LoadedModel, ModelUnavailableError
from intone.engine.options import GenerationOptions
from intone.engine.voices import Voice, load_voice, voice_from_audio

LAYERS, HEADS, HEAD_DIM = 2, 4, 16  # the tiny preset's FlowLM
PREFIX = "transformer.layers.{}.self_attn"


@pytest.fixture(scope="module")
def default_samples(tiny_checkpoint: Path) -> np.ndarray:
    """The tiny checkpoint's default voice: 24 kHz mono int16."""
    samples, rate = soundfile.read(tiny_checkpoint / "voices/default.wav", dtype="int16")
    assert rate == 24000 and samples.ndim == 1
    return samples


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path):
    from pocket_tts import TTSModel

    return TTSModel.load_model(config=str(tiny_checkpoint / "config.yaml"))


@pytest.fixture(scope="module")
def reference_state_file(
    reference, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    from pocket_tts.models.model_state import export_model_state

    state = reference.get_state_for_audio_prompt(tiny_checkpoint / "voices/default.wav")
    path = tmp_path_factory.mktemp("states") / "default.safetensors"
    export_model_state(state, path)
    return path


def speak(loaded: LoadedModel, voice: Voice) -> torch.Tensor:
    options = GenerationOptions(seed=5, eos_threshold=1e9, max_frames=6)
    return torch.cat(list(generate(loaded, voice, ["Hello there."], options)))


def as_float(samples: np.ndarray) -> np.ndarray:
    return samples.astype(np.float32) / 32768.0


def write(path: Path, samples: np.ndarray, rate: int, subtype: str) -> Path:
    soundfile.write(str(path), samples, rate, subtype=subtype)
    return path


def check_voice(voice: Voice, name: str) -> None:
    assert voice.name == name
    assert voice.keys.shape == voice.values.shape == (LAYERS, voice.length, HEADS, HEAD_DIM)
    assert voice.keys.dtype == voice.values.dtype == torch.float32
    assert torch.isfinite(voice.keys).all() and torch.isfinite(voice.values).all()
    assert voice.keys.abs().max() > 0 and voice.values.abs().max() > 0


def test_default_voice_shape(tiny_voice: Voice) -> None:
    check_voice(tiny_voice, "default")
    # bos_before_voice plus one frame per 1920 samples of the ~3 s prompt cut at its pause.
    assert 30 <= tiny_voice.length <= 40


# -- audio files of other rates and formats ---------------------------------------------------


@pytest.mark.parametrize(
    ("rate", "subtype", "channels"),
    [
        (16000, "PCM_16", 1),
        (44100, "PCM_16", 1),
        (48000, "PCM_16", 1),
        (44100, "PCM_24", 1),
        (48000, "PCM_32", 1),
        (16000, "FLOAT", 1),
        (48000, "FLOAT", 2),
        (24000, "PCM_24", 2),
    ],
)
def test_voice_from_any_rate_and_format(
    tiny_model: LoadedModel,
    tiny_voice: Voice,
    default_samples: np.ndarray,
    tmp_path: Path,
    rate: int,
    subtype: str,
    channels: int,
) -> None:
    samples = soxr.resample(as_float(default_samples), 24000, rate, quality="VHQ")
    if channels == 2:
        samples = np.stack([samples, 0.5 * samples], axis=1)
    path = write(tmp_path / "voice.wav", samples, rate, subtype)
    info = soundfile.info(str(path))
    assert (info.samplerate, info.subtype, info.channels) == (rate, subtype, channels)
    voice = load_voice(tiny_model.model, "other", path)
    check_voice(voice, "other")
    assert abs(voice.length - tiny_voice.length) <= 1


@pytest.mark.parametrize("subtype", ["FLOAT", "PCM_24", "PCM_32", "DOUBLE"])
def test_int16_voice_equals_same_samples_in_other_formats(
    tiny_model: LoadedModel,
    tiny_checkpoint: Path,
    tiny_voice: Voice,
    default_samples: np.ndarray,
    tmp_path: Path,
    subtype: str,
) -> None:
    path = write(tmp_path / "voice.wav", as_float(default_samples), 24000, subtype)
    voice = load_voice(tiny_model.model, "default", path)
    # The int16 voice again, here: the session's fixture may have been prefilled under another
    # torch thread count (an earlier test's), which moves float sums by ~1e-6.
    expected = load_voice(tiny_model.model, "default", tiny_checkpoint / "voices" / "default.wav")
    assert voice.length == tiny_voice.length == expected.length
    torch.testing.assert_close(voice.keys, expected.keys, rtol=0, atol=1e-6)
    torch.testing.assert_close(voice.values, expected.values, rtol=0, atol=1e-6)


def test_stereo_voice_is_the_channel_mean(
    tiny_model: LoadedModel, default_samples: np.ndarray, tmp_path: Path
) -> None:
    left = as_float(default_samples)
    right = np.roll(left, 240)  # a different channel, so that picking one would show
    stereo = load_voice(
        tiny_model.model, "s", write(tmp_path / "s.wav", np.stack([left, right], 1), 24000, "FLOAT")
    )
    mono = load_voice(
        tiny_model.model, "m", write(tmp_path / "m.wav", (left + right) / 2, 24000, "FLOAT")
    )
    only_left = load_voice(tiny_model.model, "l", write(tmp_path / "l.wav", left, 24000, "FLOAT"))
    torch.testing.assert_close(stereo.keys, mono.keys, rtol=0, atol=1e-5)
    torch.testing.assert_close(stereo.values, mono.values, rtol=0, atol=1e-5)
    assert not torch.allclose(stereo.keys, only_left.keys, atol=1e-3)


def test_48k_voice_is_close_to_the_24k_one(
    tiny_model: LoadedModel, tiny_voice: Voice, default_samples: np.ndarray, tmp_path: Path
) -> None:
    upsampled = soxr.resample(as_float(default_samples), 24000, 48000, quality="VHQ")
    voice = load_voice(
        tiny_model.model, "up", write(tmp_path / "up.wav", upsampled, 48000, "FLOAT")
    )
    assert voice.length == tiny_voice.length
    scale = tiny_voice.keys.abs().max()
    assert (voice.keys - tiny_voice.keys).abs().max() < 0.02 * scale
    assert (voice.values - tiny_voice.values).abs().max() < 0.02 * tiny_voice.values.abs().max()


def test_48k_voice_is_close_to_the_reference(
    reference, tiny_model: LoadedModel, default_samples: np.ndarray, tmp_path: Path
) -> None:
    """Resampled prompts: intone uses soxr, the reference resample_poly; close, not equal."""
    upsampled = soxr.resample(as_float(default_samples), 24000, 48000, quality="VHQ")
    path = write(tmp_path / "up.wav", upsampled, 48000, "PCM_16")  # the reference reads PCM_16
    voice = load_voice(tiny_model.model, "up", path)
    state = reference.get_state_for_audio_prompt(path)
    for layer in range(LAYERS):
        layer_state = state[PREFIX.format(layer)]
        length = int(layer_state["offset"][0])
        assert length == voice.length
        cache = layer_state["cache"][:, 0, :length]
        torch.testing.assert_close(voice.keys[layer], cache[0], rtol=0, atol=1e-2)
        torch.testing.assert_close(voice.values[layer], cache[1], rtol=0, atol=1e-2)


def test_long_prompt_keeps_its_first_30_seconds_as_the_reference_cli_does(
    reference, tiny_model: LoadedModel, default_samples: np.ndarray, tmp_path: Path
) -> None:
    """A 45 s prompt would put ~560 positions in every request's attention for no gain."""
    repeats = int(np.ceil(45 * 24000 / default_samples.size))
    path = write(tmp_path / "long.wav", np.tile(default_samples, repeats), 24000, "PCM_16")
    voice = load_voice(tiny_model.model, "long", path)
    state = reference.get_state_for_audio_prompt(path, truncate=True)
    for layer in range(LAYERS):
        layer_state = state[PREFIX.format(layer)]
        length = int(layer_state["offset"][0])
        assert length == voice.length <= 30 * 12.5 + 2
        cache = layer_state["cache"][:, 0, :length]
        torch.testing.assert_close(voice.keys[layer], cache[0], rtol=0, atol=1e-4)
        torch.testing.assert_close(voice.values[layer], cache[1], rtol=0, atol=1e-4)


# -- unusable audio -----------------------------------------------------------------------------


def test_empty_wav(tiny_model: LoadedModel, tmp_path: Path) -> None:
    path = write(tmp_path / "empty.wav", np.zeros(0, dtype=np.int16), 24000, "PCM_16")
    assert soundfile.info(str(path)).frames == 0
    with pytest.raises(ValueError, match="empty") as e:
        load_voice(tiny_model.model, "empty", path)
    assert str(path) in str(e.value)


def test_empty_samples(tiny_model: LoadedModel) -> None:
    with pytest.raises(ValueError, match="no audio"):
        voice_from_audio(tiny_model.model, "nothing", torch.zeros(0), 24000)


def test_audio_with_nan_or_infinite_samples(tiny_model: LoadedModel, tmp_path: Path) -> None:
    """Refused by name (it failed deep in the trailing-silence cut with an IndexError)."""
    for bad in (np.nan, np.inf):
        samples = np.full(24000, 0.1, dtype=np.float32)
        samples[100] = bad
        path = write(tmp_path / "bad.wav", samples, 24000, "FLOAT")
        with pytest.raises(ValueError, match="NaN or infinite"):
            load_voice(tiny_model.model, "bad", path)


def test_voice_names_are_non_empty_strings(tiny_model: LoadedModel, tiny_checkpoint: Path):
    """ "" could never be asked for (stream(voice="") is the default voice)."""
    engine = Engine(tiny_model, EngineConfig(num_pages=64))
    wav = tiny_checkpoint / "voices" / "default.wav"
    try:
        for name in ("", 123, None):
            with pytest.raises(ValueError, match="voice name"):
                engine.add_voice(name, wav)
    finally:
        engine.close()


def test_unreadable_wav(tiny_model: LoadedModel, tmp_path: Path) -> None:
    path = tmp_path / "noise.wav"
    path.write_bytes(np.random.default_rng(0).bytes(5000))
    with pytest.raises(ValueError, match="cannot read audio file") as e:
        load_voice(tiny_model.model, "noise", path)
    assert str(path) in str(e.value)


def test_missing_voice_file(tiny_model: LoadedModel, tmp_path: Path) -> None:
    path = tmp_path / "nobody.wav"
    with pytest.raises(FileNotFoundError, match="not found") as e:
        load_voice(tiny_model.model, "nobody", path)
    assert isinstance(e.value, ModelUnavailableError)
    assert str(path) in str(e.value) and "nobody" in str(e.value)


# -- voice-state files --------------------------------------------------------------------------


def test_reference_voice_state_equals_our_voice(
    reference_state_file: Path, tiny_model: LoadedModel, tiny_voice: Voice
) -> None:
    saved = load_file(reference_state_file)
    assert set(saved) == {
        f"{PREFIX.format(layer)}/{key}"
        for layer in range(LAYERS)
        for key in ("cache", "offset", "pad")
    }
    voice = load_voice(tiny_model.model, "exported", reference_state_file)
    check_voice(voice, "exported")
    assert voice.length == tiny_voice.length == int(saved[f"{PREFIX.format(0)}/offset"][0])
    torch.testing.assert_close(voice.keys, tiny_voice.keys, rtol=0, atol=1e-5)
    torch.testing.assert_close(voice.values, tiny_voice.values, rtol=0, atol=1e-5)
    audio = speak(tiny_model, voice)
    assert audio.numel() == 6 * 1920 and audio.abs().max() > 0
    torch.testing.assert_close(audio, speak(tiny_model, tiny_voice), rtol=0, atol=1e-5)


def test_voice_state_with_spare_capacity(
    reference_state_file: Path, tiny_model: LoadedModel, tiny_voice: Voice, tmp_path: Path
) -> None:
    """A cache longer than its offset (as saved mid-stream): only the first `offset` positions."""
    state = load_file(reference_state_file)
    for layer in range(LAYERS):
        cache = state[f"{PREFIX.format(layer)}/cache"]
        spare = torch.full((2, 1, 10, HEADS, HEAD_DIM), 1e4)
        state[f"{PREFIX.format(layer)}/cache"] = torch.cat([cache, spare], dim=2).contiguous()
    save_file(state, str(tmp_path / "spare.safetensors"))
    voice = load_voice(tiny_model.model, "spare", tmp_path / "spare.safetensors")
    assert voice.length == tiny_voice.length
    torch.testing.assert_close(voice.keys, tiny_voice.keys, rtol=0, atol=1e-5)


def test_legacy_voice_state_with_current_end(
    reference_state_file: Path, tiny_model: LoadedModel, tiny_voice: Voice, tmp_path: Path
) -> None:
    """Older exports mark the length as the size of `current_end` instead of `offset`."""
    state = load_file(reference_state_file)
    for layer in range(LAYERS):
        offset = state.pop(f"{PREFIX.format(layer)}/offset")
        state[f"{PREFIX.format(layer)}/current_end"] = torch.zeros(int(offset[0]))
    save_file(state, str(tmp_path / "legacy.safetensors"))
    voice = load_voice(tiny_model.model, "legacy", tmp_path / "legacy.safetensors")
    assert voice.length == tiny_voice.length
    torch.testing.assert_close(voice.values, tiny_voice.values, rtol=0, atol=1e-5)


def test_voice_state_for_a_bigger_model(tiny_model: LoadedModel, tmp_path: Path) -> None:
    """The released model's voice states: 6 layers of 16 heads of 64."""
    state = {}
    for layer in range(6):
        state[f"{PREFIX.format(layer)}/cache"] = torch.randn(2, 1, 30, 16, 64)
        state[f"{PREFIX.format(layer)}/offset"] = torch.tensor([30])
    save_file(state, str(tmp_path / "big.safetensors"))
    with pytest.raises(ValueError, match="does not fit this model") as e:
        load_voice(tiny_model.model, "big", tmp_path / "big.safetensors")
    assert "(2, 1, 30, 16, 64)" in str(e.value) and "(4, 16)" in str(e.value)


def test_voice_state_for_a_smaller_model(
    reference_state_file: Path, tiny_model: LoadedModel, tmp_path: Path
) -> None:
    state = {k: v for k, v in load_file(reference_state_file).items() if "layers.1." not in k}
    save_file(state, str(tmp_path / "small.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn/cache"):
        load_voice(tiny_model.model, "small", tmp_path / "small.safetensors")


def test_voice_state_for_a_deeper_model(
    reference_state_file: Path, tiny_model: LoadedModel, tmp_path: Path
) -> None:
    state = load_file(reference_state_file)
    for key in ("cache", "offset", "pad"):
        state[f"{PREFIX.format(LAYERS)}/{key}"] = state[f"{PREFIX.format(0)}/{key}"].clone()
    save_file(state, str(tmp_path / "deeper.safetensors"))
    with pytest.raises(ValueError, match="does not fit this model"):
        load_voice(tiny_model.model, "deeper", tmp_path / "deeper.safetensors")


def test_safetensors_that_is_not_a_voice_state(
    tiny_model: LoadedModel, tiny_checkpoint: Path
) -> None:
    with pytest.raises(ValueError, match="not a voice-state file"):
        load_voice(tiny_model.model, "weights", tiny_checkpoint / "model.safetensors")


def test_corrupt_voice_state(tiny_model: LoadedModel, tmp_path: Path) -> None:
    path = tmp_path / "broken.safetensors"
    path.write_bytes(b"\x00" * 3)
    with pytest.raises(ValueError, match="cannot read voice state") as e:
        load_voice(tiny_model.model, "broken", path)
    assert str(path) in str(e.value)
