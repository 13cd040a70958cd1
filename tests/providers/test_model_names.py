"""One name per model, the same in process and on the server (`intone.provider.model_names`),
and one key per model however it is spelled."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from intone.engine import releases
from intone.provider.client import IntoneClient
from intone.provider.model_names import model_key, model_name
from intone.provider.voices import bytes_voice_name, engine_voice

from support.server import running_server


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ("kyutai/pocket-tts", "english"),
        ("french_24l", "french_24l"),
        ("/models/my-voice/config.yaml", "my-voice"),
        ("C:\\models\\my-voice\\config.yaml", "my-voice"),
        ("/models/other.yml", "other"),
        ("hf://org/repo/config.yaml@main", "hf://org/repo/config.yaml@main"),
        ("config.yaml", "model"),
    ],
)
def test_a_model_is_named_by_its_release_or_its_checkpoint(source: str, name: str) -> None:
    assert model_name(source) == name


def test_every_spelling_of_a_model_has_one_key(tiny_checkpoint: Path) -> None:
    assert {model_key(m) for m in (None, "english", "en", "pocket-tts")} == {releases.DEFAULT_MODEL}
    assert model_key("fr") == model_key("french_24l") != model_key("french")
    assert model_key(tiny_checkpoint) == model_key(tiny_checkpoint / "config.yaml")


async def test_a_voice_state_the_server_stored_is_for_the_same_model_in_process(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """The server writes its name for the model into a stored voice's header; in process, the
    same file's bytes are checked against the name the model goes by there."""
    wav = (tiny_checkpoint / "voices" / "default.wav").read_bytes()
    with running_server(tiny_checkpoint, voice_store=tmp_path) as (server, engine):
        async with IntoneClient(server.url) as client:
            voice = await client.add_voice(wav)
        assert voice["model"] == model_name(engine.loaded.source) == tiny_checkpoint.name
        state = (tmp_path / f"{voice['id']}.safetensors").read_bytes()
        name = await asyncio.to_thread(engine_voice, engine, state)
        assert name == bytes_voice_name(state) and name in engine.voices
