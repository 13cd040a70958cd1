"""Voice resolution: registry names, OpenAI aliases, explicit aliases, lazy checkpoint voices."""

from __future__ import annotations

import shutil

import pytest
import yaml

from intone.engine import Engine, load_model
from intone.provider.server.voices import (
    OPENAI_VOICES,
    UnknownVoiceError,
    VoiceResolver,
    voice_files,
)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, tmp_path_factory):
    """A checkpoint naming a second voice that the engine does not load up front."""
    directory = tmp_path_factory.mktemp("two-voices")
    shutil.copytree(tiny_checkpoint, directory, dirs_exist_ok=True)
    settings = yaml.safe_load((directory / "intone.yaml").read_text())
    settings["voices"]["second"] = "voices/default.wav"
    (directory / "intone.yaml").write_text(yaml.safe_dump(settings))
    engine = Engine(load_model(directory)).start()
    yield engine
    engine.close()


async def test_checkpoint_voice_loads_on_first_use(engine):
    resolver = VoiceResolver(engine)
    assert "second" not in engine.voices and "second" in resolver.known()
    assert await resolver.resolve("second") == "second"
    assert "second" in engine.voices
    assert await resolver.resolve("second") == "second"  # now a plain registry voice


async def test_aliases(engine):
    resolver = VoiceResolver(engine, {"boss": "default"})
    assert await resolver.resolve(None) == "default"
    assert await resolver.resolve("boss") == "default"
    table = resolver.alias_table()
    assert set(OPENAI_VOICES) <= set(table) and table["alloy"] == engine.default_voice
    for name in OPENAI_VOICES:
        assert await resolver.resolve(name) in engine.voices
    with pytest.raises(UnknownVoiceError, match="known voices"):
        await resolver.resolve("nobody")


def test_voice_files(tmp_path):
    for name in ("a.wav", "b.FLAC", "c.mp3", "d.safetensors", "e.txt"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "sub.wav").mkdir()
    assert sorted(voice_files(tmp_path)) == ["a", "b", "c", "d"]
    (tmp_path / "a.flac").write_bytes(b"")
    with pytest.raises(ValueError, match="two voice files"):
        voice_files(tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        voice_files(tmp_path / "missing")
