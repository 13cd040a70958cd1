"""The `intone` command line, run as a subprocess, offline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
import yaml

SAMPLES_PER_FRAME = 1920
MAX_FRAMES = 20
ARTIFACTS = ("model.safetensors", "tokenizer.model", "voices/default.wav", "intone.yaml")


@pytest.fixture(scope="module")
def offline_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment with an empty Hugging Face cache and the Hub switched off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(tmp_path_factory.mktemp("hf_home")), HF_HUB_OFFLINE="1")
    return env


def intone(env: dict[str, str], *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "intone.provider.cli", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def made(offline_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two `make-checkpoint` runs with the same seed."""
    outs = []
    for name in ("first", "second"):
        out = tmp_path_factory.mktemp(name) / "ckpt"
        result = intone(
            offline_env, "make-checkpoint", "--preset", "tiny", "--out", out, "--seed", 3
        )
        assert result.returncode == 0, result.stderr
        outs.append(out)
    return outs


@pytest.fixture(scope="module")
def said(
    offline_env: dict[str, str], made: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """`intone say` into a 16-bit and a float WAV, same seed."""
    outs = {}
    for kind, flags in (("pcm16", ()), ("float", ("--float",))):
        out = tmp_path_factory.mktemp(kind) / "out.wav"
        result = intone(
            offline_env, "say", "Hello there.", "--model", made[0], "--out", out, *flags,
            "--eos-threshold", "1e9", "--max-frames", MAX_FRAMES, "--seed", 7,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stderr
        outs[kind] = out
    return outs


def test_make_checkpoint_layout(made: list[Path]) -> None:
    out = made[0]
    for name in ("config.yaml", *ARTIFACTS):
        assert (out / name).is_file(), name
    settings = yaml.safe_load((out / "intone.yaml").read_text())
    assert settings["preset"] == "tiny" and settings["seed"] == 3
    assert settings["default_voice"] == "default"


def test_make_checkpoint_is_deterministic(made: list[Path], tiny_checkpoint: Path) -> None:
    first, second = made
    for name in ARTIFACTS:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    # --seed is honoured: the session checkpoint has seed 0.
    weights = (first / "model.safetensors").read_bytes()
    assert weights != (tiny_checkpoint / "model.safetensors").read_bytes()


@pytest.mark.parametrize(("kind", "subtype"), [("pcm16", "PCM_16"), ("float", "FLOAT")])
def test_say_writes_a_wav(said: dict[str, Path], kind: str, subtype: str) -> None:
    info = soundfile.info(str(said[kind]))
    assert (info.samplerate, info.channels, info.subtype) == (24000, 1, subtype)
    assert info.frames > 0 and info.frames % SAMPLES_PER_FRAME == 0
    # EOS never fires, so the one clause runs for exactly --max-frames frames.
    assert info.frames == MAX_FRAMES * SAMPLES_PER_FRAME


def test_say_float_and_pcm16_agree(said: dict[str, Path]) -> None:
    pcm, _ = soundfile.read(str(said["pcm16"]), dtype="float32")
    flt, _ = soundfile.read(str(said["float"]), dtype="float32")
    assert np.abs(flt).max() > 1e-3
    np.testing.assert_allclose(pcm, np.clip(flt, -1, 1), rtol=0, atol=2 / 32768)


def test_say_without_model_offline(offline_env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out.wav"
    result = intone(offline_env, "say", "Hello.", "--out", out)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "--model" in result.stderr and "make-checkpoint" in result.stderr
    assert not out.exists()


def test_say_with_missing_model(offline_env: dict[str, str], tmp_path: Path) -> None:
    result = intone(offline_env, "say", "Hello.", "--model", tmp_path / "nope", "--out", "x.wav")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "no model at" in result.stderr and str(tmp_path / "nope") in result.stderr


# Undecodable bytes in argv (not UTF-8) reach the command as lone surrogates.
@pytest.mark.parametrize(
    ("text", "message"), [(" \n ", "no text to speak"), ("Hi \udcff.", "lone surrogate")]
)
def test_say_refuses_text_it_cannot_speak(
    offline_env: dict[str, str], tiny_checkpoint: Path, tmp_path: Path, text: str, message: str
) -> None:
    out = tmp_path / "out.wav"
    result = intone(offline_env, "say", text, "--model", tiny_checkpoint, "--out", out)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and message in result.stderr
    assert not out.exists()


def test_say_into_a_missing_directory(offline_env: dict[str, str], tmp_path: Path) -> None:
    """Refused before the model loads (here there is none): not found out after speaking."""
    out = tmp_path / "missing" / "out.wav"
    result = intone(offline_env, "say", "Hello.", "--model", tmp_path / "nope", "--out", out)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert f"{out.parent} is not a directory" in result.stderr


def test_say_reads_stdin_and_writes_stdout(
    offline_env: dict[str, str], tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """`-` as the text and as --out, as the reference's `pocket-tts generate` takes them."""
    args = ("--model", tiny_checkpoint, "--seed", "1", "--max-frames", str(MAX_FRAMES))
    to_file = intone(offline_env, "say", "Hello there.", *args, "--out", tmp_path / "a.wav")
    assert to_file.returncode == 0, to_file.stderr
    piped = subprocess.run(
        [sys.executable, "-m", "intone.provider.cli", "say", "-", *map(str, args), "--out", "-"],
        env=offline_env,
        input=b"Hello there.",
        capture_output=True,
        timeout=120,
    )
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == (tmp_path / "a.wav").read_bytes()  # only the WAV: logs go to stderr


@pytest.mark.parametrize("name", ["out.mp3", "out"])
def test_say_refuses_an_output_that_is_not_wav(
    offline_env: dict[str, str], tmp_path: Path, name: str
) -> None:
    """Refused before the model loads: the file would have held WAV whatever its name."""
    out = tmp_path / name
    result = intone(offline_env, "say", "Hello.", "--model", tmp_path / "nope", "--out", out)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "writes WAV" in result.stderr
    assert not out.exists()


def test_say_with_missing_voice(
    offline_env: dict[str, str], tiny_checkpoint: Path, tmp_path: Path
) -> None:
    voice = tmp_path / "nobody.wav"
    result = intone(
        offline_env, "say", "Hello.", "--model", tiny_checkpoint, "--voice", voice,
        "--out", tmp_path / "out.wav",
    )  # fmt: skip
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert str(voice) in result.stderr and "not found" in result.stderr
