"""The released models: packaged configs, names and shortcuts, loading, presets and tokenizers."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from intone.engine import checkpoint, releases
from intone.engine.corpus import DIGITS, LANGUAGES, PUNCTUATION, alphabet, sentences
from intone.engine.loading import (
    DEFAULT_MODEL,
    ModelUnavailableError,
    load_model,
    resolve_config_path,
)
from intone.engine.models.pocket.config import load_config
from intone.engine.models.pocket.model import PocketTTS
from intone.engine.text import Tokenizer

REFERENCE_CONFIGS = Path(__import__("pocket_tts").__file__).parent / "config"


def test_every_reference_config_is_packaged_unchanged() -> None:
    reference = sorted(p.name for p in REFERENCE_CONFIGS.glob("*.yaml"))
    assert len(reference) == 27
    assert [f"{name}.yaml" for name in releases.release_names()] == reference
    for name in reference:
        assert (releases.CONFIGS_DIR / name).read_bytes() == (REFERENCE_CONFIGS / name).read_bytes()


@pytest.mark.parametrize("name", releases.release_names())
def test_every_release_resolves_and_builds(name: str) -> None:
    path, source = resolve_config_path(name)
    assert path == releases.config_path(name)
    assert source == (DEFAULT_MODEL if name == "english" else name)
    config = load_config(path)
    with torch.device("meta"):
        PocketTTS(config)  # every family's model code accepts its config


@pytest.mark.parametrize(
    ("shortcut", "release"),
    [
        ("kyutai/pocket-tts", "english"),
        ("pocket-tts", "english"),
        ("en", "english"),
        ("fr", "french_24l"),  # as Pipecat's Pocket TTS service maps French
        ("FR", "french_24l"),
        ("de", "german"),
        ("es", "spanish"),
        ("it", "italian"),
        ("pt", "portuguese"),
        ("nl", "dutch"),
        ("french", "french"),
        ("english_2m_2026-10", "english_2m_2026-10"),
    ],
)
def test_shortcuts(shortcut: str, release: str) -> None:
    assert releases.release_name(shortcut) == release
    assert resolve_config_path(shortcut)[0] == releases.config_path(release)


def test_unknown_model_name_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ModelUnavailableError) as e:
        load_model(str(tmp_path / "klingon"))
    message = str(e.value)
    for name in ("english_2m_2026-10", "french_24l", "kyutai/pocket-tts", "fr"):
        assert name in message


@pytest.mark.parametrize(
    ("edit", "path"),
    [
        (lambda raw: raw["flow_lm"]["flow"].update(type="consistency"), "flow_lm.flow.type"),
        (
            lambda raw: raw["flow_lm"]["transformer"].update(sliding=4),
            "flow_lm.transformer.sliding",
        ),
    ],
)
def test_unsupported_field_or_sampler_fails_at_load_with_its_path(
    tmp_path: Path, edit, path: str
) -> None:
    raw = yaml.safe_load(releases.config_path("english_7m_2026-10").read_text())
    edit(raw)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=path.replace(".", r"\.")):
        load_model(config)


def test_models_command_lists_every_release() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "intone.provider.cli", "models"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    for name in releases.release_names():
        assert rows[name][1] == releases.language_of(name)
    # Parameter counts without the voice encoder, as the release notes give them.
    assert rows["english_2m_2026-10"][2] == "1.9M"
    assert rows["english_7m_2026-10"][2] == "6.9M"
    assert rows["english_18m_2026-10"][2] == "18.2M"
    assert "gated" in rows["english"][3]
    assert "fr" in rows["french_24l"][-1]
    for family in checkpoint.TINY_FAMILIES:
        assert family in out


def test_preset_names() -> None:
    names = checkpoint.preset_names()
    assert set(releases.release_names()) <= set(names)
    assert {"tiny", "full", *checkpoint.TINY_FAMILIES} <= set(names)
    assert checkpoint.preset_release("tiny-french_24l") == ("french_24l", True)
    assert checkpoint.preset_release("english_7m_2026-10") == ("english_7m_2026-10", False)
    with pytest.raises(ValueError, match="tiny-NAME"):
        checkpoint.preset_release("tiny-klingon")


@pytest.mark.parametrize("language", LANGUAGES)
def test_generated_tokenizer_covers_the_alphabet(language: str, tmp_path: Path) -> None:
    """Every letter (with diacritics, both cases), digit and punctuation mark has a piece, in
    both tokenizer kinds; the `tokenizers` file reads text as SentencePiece does (ids may differ
    where two segmentations score the same, as "..": "." + ".." or ".." + ".")."""
    sp_model = checkpoint.train_tokenizer(0, 4000, language, normalization="nfkc")
    (tmp_path / "t.model").write_bytes(sp_model)
    (tmp_path / "t.json").write_text(checkpoint.tokenizer_json(sp_model))
    sp = Tokenizer(4000, tmp_path / "t.model", "sentencepiece")
    hf = Tokenizer(4000, tmp_path / "t.json", "tokenizers")
    for char in alphabet(language) + DIGITS + PUNCTUATION:
        assert 0 not in sp.encode(char) and 0 not in hf.encode(char), f"{char!r} is unknown"
    for text in sentences(1, 200, language):
        assert hf.decode(hf.encode(text)) == sp.decode(sp.encode(text)) == text


def release_cache(cache: Path, url: str, local: Path) -> None:
    """Put `local` where the hub cache keeps hf://owner/repo/path@revision."""
    spec, _, revision = url.removeprefix("hf://").partition("@")
    owner, repo, path = spec.split("/", 2)
    target = cache / f"models--{owner}--{repo}" / "snapshots" / revision / path
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(local, target)


def test_release_loads_by_name_from_the_hub_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--model english_2m_2026-10` fetches that release's weights and tokenizer (here random
    ones in its layout, from an offline cache) and gets its voices."""
    import huggingface_hub.constants as constants

    name = "english_2m_2026-10"
    made = checkpoint.make_checkpoint(name, tmp_path / "made", seed=0)
    cache = tmp_path / "hub"
    config = load_config(releases.config_path(name))
    release_cache(cache, config.weights_path, made / "model.safetensors")
    release_cache(cache, config.flow_lm.lookup_table.tokenizer_path, made / "tokenizer.model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    loaded = load_model(name)
    assert loaded.source == name and loaded.weights == "released"
    assert loaded.default_voice == "alba"
    assert f"languages/{name}/embeddings/alba.safetensors" in loaded.voices["alba"]
    assert loaded.config.default_eos_threshold == -1.0
    made_model = load_model(made)
    for key, value in made_model.model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[key], value), key
