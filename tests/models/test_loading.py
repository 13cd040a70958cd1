"""Loading checkpoints: clear errors for broken ones, encoder-less weights, hf:// paths offline."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from intone.engine.generate import generate
from intone.engine.loading import LoadedModel, ModelUnavailableError, load_model
from intone.engine.models.pocket.config import dump_config, load_config
from intone.engine.models.pocket.model import ENCODER_PREFIXES
from intone.engine.options import GenerationOptions
from intone.engine.voices import Voice, load_voice

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "someone/tiny-tts"
OPTIONS = dict(seed=3, eos_threshold=1e9, max_frames=6)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint directory whose config points at the copy's own files."""
    shutil.copytree(src, dst)
    config = load_config(dst / "config.yaml")
    config.weights_path = str(dst / "model.safetensors")
    config.flow_lm.lookup_table.tokenizer_path = str(dst / "tokenizer.model")
    dump_config(config, dst / "config.yaml")
    return dst


def speak(loaded: LoadedModel, voice: Voice, text: str = "Hello there.") -> torch.Tensor:
    return torch.cat(list(generate(loaded, voice, [text], GenerationOptions(**OPTIONS))))


def write_voice_state(voice: Voice, path: Path) -> Path:
    """`voice` in the reference's voice-state layout (what `pocket-tts export-voice` writes)."""
    state = {}
    for layer in range(voice.keys.shape[0]):
        prefix = f"transformer.layers.{layer}.self_attn"
        state[f"{prefix}/cache"] = torch.stack([voice.keys[layer], voice.values[layer]])[:, None]
        state[f"{prefix}/offset"] = torch.tensor([voice.length])
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


@pytest.fixture(scope="module")
def tiny_weights(tiny_checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(tiny_checkpoint / "model.safetensors")


@pytest.fixture
def broken(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    return copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")


def test_copy_loads(broken: Path) -> None:
    """The copies the error tests break are themselves valid and use their own files."""
    loaded = load_model(broken)
    assert loaded.source == str(broken / "config.yaml")
    assert loaded.config.weights_path == str(broken / "model.safetensors")
    assert loaded.weights == "generated" and loaded.default_voice == "default"
    assert loaded.voices == {"default": str(broken / "voices/default.wav")}
    assert load_model(broken / "config.yaml").source == str(broken / "config.yaml")


# -- broken weights ----------------------------------------------------------------------------


def test_missing_key_is_named(broken: Path, tiny_weights: dict[str, torch.Tensor]) -> None:
    state = dict(tiny_weights)
    del state["flow_lm.bos_emb"]
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="missing keys") as e:
        load_model(broken)
    assert "flow_lm.bos_emb" in str(e.value)
    assert str(broken / "model.safetensors") in str(e.value)


def test_unexpected_key_is_named(broken: Path, tiny_weights: dict[str, torch.Tensor]) -> None:
    state = dict(tiny_weights, **{"flow_lm.something_new": torch.zeros(3)})
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected keys") as e:
        load_model(broken)
    assert "flow_lm.something_new" in str(e.value)


def test_wrong_shape_names_key_and_both_shapes(
    broken: Path, tiny_weights: dict[str, torch.Tensor]
) -> None:
    assert tiny_weights["flow_lm.emb_std"].shape == (32,)
    state = dict(tiny_weights, **{"flow_lm.emb_std": torch.ones(33)})
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="wrong shapes") as e:
        load_model(broken)
    message = str(e.value)
    assert "flow_lm.emb_std" in message and "(33,)" in message and "(32,)" in message


@pytest.mark.parametrize("damage", ["truncated", "tiny", "garbage"])
def test_corrupt_weights_file(broken: Path, damage: str) -> None:
    path = broken / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(
        {"truncated": data[: len(data) // 2], "tiny": data[:5], "garbage": b"\x13" * 4096}[damage]
    )
    with pytest.raises(ValueError, match="cannot read weights file") as e:
        load_model(broken)
    assert str(path) in str(e.value)


def test_missing_weights_file(broken: Path) -> None:
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelUnavailableError, match="weights not found") as e:
        load_model(broken)
    assert str(broken / "model.safetensors") in str(e.value)


def test_missing_tokenizer_file(broken: Path) -> None:
    (broken / "tokenizer.model").unlink()
    with pytest.raises(ModelUnavailableError, match="tokenizer not found") as e:
        load_model(broken)
    assert str(broken / "tokenizer.model") in str(e.value)


# -- broken configs and paths ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "key"), [(None, "surprise_setting"), ("flow_lm", "extra_width")]
)
def test_config_with_unknown_key(broken: Path, section: str | None, key: str) -> None:
    raw = yaml.safe_load((broken / "config.yaml").read_text())
    (raw[section] if section else raw)[key] = 7
    (broken / "config.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="not permitted") as e:
        load_model(broken)
    assert key in str(e.value)


def test_config_without_weights_path(broken: Path) -> None:
    config = load_config(broken / "config.yaml")
    config.weights_path = None
    dump_config(config, broken / "config.yaml")
    with pytest.raises(ValueError, match="no weights_path"):
        load_model(broken)


@pytest.mark.parametrize("where", ["missing", "empty_dir", "missing_yaml"])
def test_no_model_at_path(tmp_path: Path, where: str) -> None:
    path = {
        "missing": tmp_path / "does" / "not" / "exist",
        "empty_dir": tmp_path,
        "missing_yaml": tmp_path / "config.yaml",
    }[where]
    with pytest.raises(ModelUnavailableError, match="no model at") as e:
        load_model(path)
    assert str(path) in str(e.value)
    assert "config.yaml" in str(e.value)


# -- weights without the Mimi encoder (the public release without voice cloning) ---------------


@pytest.fixture(scope="module")
def no_encoder(
    tiny_checkpoint: Path,
    tiny_weights: dict[str, torch.Tensor],
    tmp_path_factory: pytest.TempPathFactory,
) -> LoadedModel:
    directory = copy_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("noenc") / "ckpt")
    state = {k: v for k, v in tiny_weights.items() if not k.startswith(ENCODER_PREFIXES)}
    dropped = set(tiny_weights) - set(state)
    assert {p for p in ENCODER_PREFIXES if any(k.startswith(p) for k in dropped)} == set(
        ENCODER_PREFIXES
    )
    save_file(state, str(directory / "model.safetensors"))
    return load_model(directory)


def test_without_encoder_loads(no_encoder: LoadedModel, tiny_model: LoadedModel) -> None:
    assert no_encoder.model.has_voice_encoder is False
    assert tiny_model.model.has_voice_encoder is True
    ours, full = no_encoder.model.state_dict(), tiny_model.model.state_dict()
    for key, tensor in full.items():
        if not key.startswith(ENCODER_PREFIXES):
            assert torch.equal(ours[key], tensor), key


def test_without_encoder_rejects_audio_voices(
    no_encoder: LoadedModel, tiny_checkpoint: Path
) -> None:
    with pytest.raises(ValueError, match="voice-state"):
        load_voice(no_encoder.model, "default", tiny_checkpoint / "voices/default.wav")


def test_without_encoder_speaks_with_voice_states(
    no_encoder: LoadedModel, tiny_model: LoadedModel, tiny_voice: Voice, tmp_path: Path
) -> None:
    path = write_voice_state(tiny_voice, tmp_path / "default.safetensors")
    voice = load_voice(no_encoder.model, "default", path)
    assert torch.equal(voice.keys, tiny_voice.keys)
    assert torch.equal(voice.values, tiny_voice.values)
    audio = speak(no_encoder, voice)
    assert audio.numel() == OPTIONS["max_frames"] * 1920 and audio.abs().max() > 0
    torch.testing.assert_close(audio, speak(tiny_model, tiny_voice), rtol=0, atol=1e-6)


def test_missing_encoder_does_not_hide_other_missing_keys(
    broken: Path, tiny_weights: dict[str, torch.Tensor]
) -> None:
    state = {
        k: v
        for k, v in tiny_weights.items()
        if not k.startswith(ENCODER_PREFIXES) and k != "flow_lm.bos_emb"
    }
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="missing keys") as e:
        load_model(broken)
    assert "flow_lm.bos_emb" in str(e.value)


# -- hf:// paths from a pre-filled Hugging Face cache, offline --------------------------------


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache, offline; huggingface_hub reads its env at import, so patch both."""
    import huggingface_hub.constants as constants

    home = tmp_path / "hf_home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    for name, value in (("HF_HOME", home), ("HF_HUB_CACHE", cache), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def hf_url(path: str, revision: str | None = COMMIT) -> str:
    return f"hf://{REPO}/{path}" + (f"@{revision}" if revision else "")


def fill_cache(cache: Path, tiny_checkpoint: Path, extra: tuple[str, ...] = ()) -> Path:
    """The tiny checkpoint as the hub cache lays out a downloaded snapshot of REPO."""
    repo = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for name in ("tokenizer.model", "model.safetensors", *extra):
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tiny_checkpoint / name, snapshot / name)
    config = load_config(tiny_checkpoint / "config.yaml")
    config.weights_path = hf_url("model.safetensors")
    config.flow_lm.lookup_table.tokenizer_path = hf_url("tokenizer.model")
    dump_config(config, snapshot / "config.yaml")
    return snapshot


@pytest.mark.parametrize("revision", [COMMIT, None])
def test_hf_checkpoint_offline(
    hf_cache: Path,
    tiny_checkpoint: Path,
    tiny_model: LoadedModel,
    tiny_voice: Voice,
    revision: str | None,
) -> None:
    snapshot = fill_cache(hf_cache, tiny_checkpoint)
    url = hf_url("config.yaml", revision)
    loaded = load_model(url)
    assert loaded.source == url
    assert loaded.config.weights_path == hf_url("model.safetensors")
    assert loaded.weights == "custom" and loaded.default_voice is None  # no intone.yaml there
    assert loaded.model.has_voice_encoder
    assert loaded.tokenizer.encode("Hello there.") == tiny_model.tokenizer.encode("Hello there.")
    assert str(hf_cache) in str(snapshot)
    torch.testing.assert_close(speak(loaded, tiny_voice), speak(tiny_model, tiny_voice))


def test_hf_checkpoint_with_intone_settings_and_voices(
    hf_cache: Path, tiny_checkpoint: Path, tiny_voice: Voice
) -> None:
    snapshot = fill_cache(hf_cache, tiny_checkpoint, extra=("intone.yaml", "voices/default.wav"))
    write_voice_state(tiny_voice, snapshot / "voices" / "state.safetensors")
    loaded = load_model(hf_url("config.yaml"))
    assert loaded.weights == "generated" and loaded.default_voice == "default"
    voice = load_voice(loaded.model, "default", loaded.voices["default"])
    torch.testing.assert_close(voice.keys, tiny_voice.keys)
    from_state = load_voice(loaded.model, "state", hf_url("voices/state.safetensors"))
    assert torch.equal(from_state.keys, tiny_voice.keys)


@pytest.mark.parametrize("missing", ["model.safetensors", "tokenizer.model", "config.yaml"])
def test_hf_file_missing_offline(hf_cache: Path, tiny_checkpoint: Path, missing: str) -> None:
    snapshot = fill_cache(hf_cache, tiny_checkpoint)
    (snapshot / missing).unlink()
    with pytest.raises(ModelUnavailableError) as e:
        load_model(hf_url("config.yaml"))
    message = str(e.value)
    assert hf_url(missing) in message
    assert "not in the local Hugging Face cache" in message
    assert "--model" in message and "make-checkpoint" in message


def test_hf_voice_missing_offline(hf_cache: Path, tiny_model: LoadedModel) -> None:
    with pytest.raises(ModelUnavailableError, match="--model") as e:
        load_voice(tiny_model.model, "alba", hf_url("voices/alba.safetensors"))
    assert "voice 'alba'" in str(e.value)


@pytest.mark.parametrize("name", [None, "kyutai/pocket-tts"])
def test_default_model_offline_fails_fast(hf_cache: Path, name: str | None) -> None:
    start = time.monotonic()
    with pytest.raises(ModelUnavailableError) as e:
        load_model(name)
    assert time.monotonic() - start < 5
    message = str(e.value)
    assert "hf://kyutai/" in message
    assert "--model" in message and "make-checkpoint" in message
