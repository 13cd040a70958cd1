"""The random checkpoints made by `intone.engine.checkpoint` load in intone and in pocket_tts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
import yaml
from safetensors.torch import load_file

from intone.engine import checkpoint
from intone.engine.models.pocket.config import load_config

ARTIFACTS = ("tokenizer.model", "model.safetensors", "voices/default.wav", "intone.yaml")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint.make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def reference_tiny(tiny: Path):
    from pocket_tts import TTSModel

    return TTSModel.load_model(config=str(tiny / "config.yaml"))


def test_layout(tiny: Path) -> None:
    for name in ("config.yaml", *ARTIFACTS):
        assert (tiny / name).is_file(), name
    settings = yaml.safe_load((tiny / "intone.yaml").read_text())
    assert settings == {
        "preset": "tiny",
        "language": "english",
        "seed": 0,
        "default_voice": "default",
        "voices": {"default": "voices/default.wav"},
    }


def test_same_seed_same_bytes(tiny: Path, tmp_path: Path) -> None:
    again = checkpoint.make_checkpoint("tiny", tmp_path / "again", seed=0)
    for name in ARTIFACTS:
        assert (tiny / name).read_bytes() == (again / name).read_bytes(), name
    config, config_again = ((d / "config.yaml").read_text() for d in (tiny, again))
    assert config.replace(str(tiny), "OUT") == config_again.replace(str(again), "OUT")


def test_other_seed_other_weights_and_voice(tiny: Path, tmp_path: Path) -> None:
    other = checkpoint.make_checkpoint("tiny", tmp_path, seed=1)
    for name in ("model.safetensors", "voices/default.wav"):
        assert (tiny / name).read_bytes() != (other / name).read_bytes(), name


def test_config_loads_in_intone_and_pocket_tts(tiny: Path) -> None:
    from pocket_tts.utils.config import load_config as load_reference_config

    ours, reference = load_config(tiny / "config.yaml"), load_reference_config(tiny / "config.yaml")
    assert ours.model_dump() == reference.model_dump()
    assert ours.weights_path == str(tiny / "model.safetensors")
    assert ours.weights_path_without_voice_cloning is None
    table = ours.flow_lm.lookup_table
    assert (table.tokenizer, table.tokenizer_path) == (
        "sentencepiece",
        str(tiny / "tokenizer.model"),
    )
    assert Path(table.tokenizer_path).is_absolute() and table.n_bins == 4000
    assert ours.flow_lm.insert_bos_before_voice and ours.flow_lm.flow.type == "lsd"
    assert (ours.latent_dim, ours.sample_rate, ours.samples_per_frame) == (32, 24000, 1920)
    assert ours.mimi.transformer.context == 250
    assert ours.default_eos_threshold == -4.0


def test_pocket_tts_loads_the_weights(tiny: Path, reference_tiny) -> None:
    saved = load_file(tiny / "model.safetensors")
    loaded = reference_tiny.state_dict()
    assert loaded.keys() == saved.keys()
    for key, tensor in saved.items():
        assert tensor.shape == loaded[key].shape, key
        assert torch.equal(tensor, loaded[key]), key


def test_weights_are_not_degenerate(tiny: Path) -> None:
    saved = load_file(tiny / "model.safetensors")
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in saved.values())
    assert torch.equal(saved["flow_lm.emb_std"], torch.ones(32))
    assert torch.equal(saved["flow_lm.emb_mean"], torch.zeros(32))
    for key in ("flow_lm.speaker_proj_weight", "flow_lm.bos_emb", "flow_lm.bos_before_voice"):
        assert saved[key].std() > 0.1, key
    assert saved["flow_lm.speaker_proj_weight"].shape == (64, 32)


def test_tokenizer(tiny: Path) -> None:
    from pocket_tts.modules.text_conditioner import SentencePieceTokenizer

    tokenizer = SentencePieceTokenizer(4000, str(tiny / "tokenizer.model"))
    assert tokenizer.sp.vocab_size() == 4000
    # The reference chunker drops the first token of these strings and splits on the rest.
    _, *ends = tokenizer.sp.encode(".!...?", out_type=str)
    assert {".", "!", "?"} <= set(ends)
    _, *fallbacks = tokenizer.sp.encode(",;:", out_type=str)
    assert {",", ";", ":"} <= set(fallbacks)
    text = "Hello, world! It costs $12.50 at 9:45; see you on May 3rd?"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.sp.unk_id() not in tokenizer.encode(text)


def test_default_voice(tiny: Path) -> None:
    info = soundfile.info(tiny / "voices/default.wav")
    assert (info.samplerate, info.channels, info.subtype) == (24000, 1, "PCM_16")
    assert 2.5 <= info.duration <= 3.5
    audio, _ = soundfile.read(tiny / "voices/default.wav", dtype="float32")
    assert np.sqrt(np.mean(audio[:24000] ** 2)) > 0.05
    assert np.abs(audio[-int(0.25 * 24000) :]).max() < 0.01  # ends on a pause


def test_reference_clones_the_default_voice(tiny: Path, reference_tiny) -> None:
    state = reference_tiny.get_state_for_audio_prompt(str(tiny / "voices/default.wav"))
    audio = reference_tiny.generate_audio(state, "Hi.")
    assert audio.ndim == 1 and audio.numel() > 0 and torch.isfinite(audio).all()


def test_unknown_preset(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        checkpoint.make_checkpoint("huge", tmp_path)


@pytest.mark.parametrize("out", ["file", "file/ckpt"])
def test_out_under_a_file_is_refused(tmp_path: Path, out: str) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ValueError, match="file is a file"):
        checkpoint.make_checkpoint("tiny", tmp_path / out)


@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_bad_seed_is_refused(tmp_path: Path, seed: object) -> None:
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        checkpoint.make_checkpoint("tiny", tmp_path, seed=seed)
    assert not any(tmp_path.iterdir())  # refused before anything is written


@pytest.mark.full
def test_full_preset_matches_released_architecture(tmp_path: Path) -> None:
    from pocket_tts import TTSModel
    from pocket_tts.utils.config import CONFIGS_DIR
    from pocket_tts.utils.config import load_config as load_reference_config

    out = checkpoint.make_checkpoint("full", tmp_path, seed=0)
    ours, released = (
        load_reference_config(p) for p in (out / "config.yaml", CONFIGS_DIR / "english.yaml")
    )
    assert ours.mimi == released.mimi
    assert ours.flow_lm.model_dump(exclude={"lookup_table"}) == released.flow_lm.model_dump(
        exclude={"lookup_table"}
    )
    assert ours.flow_lm.lookup_table.model_dump(
        include={"dim", "n_bins", "rank"}
    ) == released.flow_lm.lookup_table.model_dump(include={"dim", "n_bins", "rank"})

    saved = load_file(out / "model.safetensors")
    loaded = TTSModel.load_model(config=str(out / "config.yaml")).state_dict()
    assert len(saved) == 214
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in loaded.items()}
