"""Several models in one server: selection by name or alias, per-model voices, clear refusals."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families

from intone.engine import UnknownModelError
from intone.provider.client import IntoneClient, IntoneError
from intone.provider.server import ServerSettings, create_app
from intone.provider.server.runtime import Runtime, ServedModel
from intone.provider.server.voices import VoiceResolver

from support.server import TEST_SETTINGS, ServerThread, make_engine, recv_event, send

TEXT = "Two models, one server."


@pytest.fixture(scope="module")
def served(tiny_checkpoint: Path, small_checkpoint: Path):
    engines = [make_engine(tiny_checkpoint), make_engine(small_checkpoint)]
    # A voice only the second model has: voices are per model.
    engines[1].add_voice("second-only", small_checkpoint / "voices" / "default.wav")
    app = create_app(engines, settings=ServerSettings(**TEST_SETTINGS))
    server = ServerThread(app).start()
    try:
        yield server, engines
    finally:
        server.stop()
        for engine in engines:
            engine.close()


def names(tiny_checkpoint: Path, small_checkpoint: Path) -> tuple[str, str]:
    return tiny_checkpoint.name, small_checkpoint.name


async def test_models_are_listed(served, tiny_checkpoint: Path, small_checkpoint: Path) -> None:
    server, _ = served
    first, second = names(tiny_checkpoint, small_checkpoint)
    async with httpx.AsyncClient() as http:
        body = (await http.get(f"{server.url}/v1/models")).json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [first, second]  # the default first
    assert "second-only" in body["data"][1]["voices"]
    assert "second-only" not in body["data"][0]["voices"]
    async with IntoneClient(server.ws_url) as client:
        assert [m["name"] for m in client.hello.models] == [first, second]


async def test_health_stats_and_metrics_cover_every_model(
    served, tiny_checkpoint: Path, small_checkpoint: Path
) -> None:
    """An operator sees each model's load, not only the default's: /metrics labels every engine
    sample with its model (one family per name), /healthz and /stats list every model."""
    server, engines = served
    first, second = names(tiny_checkpoint, small_checkpoint)
    async with IntoneClient(server.ws_url) as client:
        stream = await client.stream(text=TEXT, end=True, model=second, options={"max_frames": 8})
        assert len(b"".join([pcm async for pcm in stream])) > 0
    async with httpx.AsyncClient() as http:
        health = (await http.get(f"{server.url}/healthz")).json()
        stats = (await http.get(f"{server.url}/stats")).json()
        text = (await http.get(f"{server.url}/metrics")).text
    assert [m["name"] for m in health["models"]] == [first, second]
    assert all(m["status"] == "ok" and m["active_requests"] == 0 for m in health["models"])
    assert set(stats["models"]) == {first, second}
    assert stats["models"][second]["requests_completed"] >= 1
    families = {f.name: f for f in text_string_to_metric_families(text)}
    audio = {s.labels["model"]: s.value for s in families["intone_audio_seconds"].samples
             if s.name == "intone_audio_seconds_total"}  # fmt: skip
    assert set(audio) == {first, second}
    assert audio[second] == engines[1].metrics()["audio_seconds"] > 0
    pages = {s.labels["model"] for s in families["intone_kv_pages_in_use"].samples}
    assert pages == {first, second}
    assert text.count("# TYPE intone_kv_pages_in_use ") == 1  # one family, not one per engine


async def test_websocket_start_picks_the_model(
    served, tiny_checkpoint: Path, small_checkpoint: Path
) -> None:
    server, engines = served
    first, second = names(tiny_checkpoint, small_checkpoint)
    before = [e.metrics()["requests_completed"] for e in engines]
    async with IntoneClient(server.ws_url) as client:
        default = await client.stream(text=TEXT, end=True, options={"max_frames": 8})
        other = await client.stream(
            text=TEXT, end=True, model=second, voice="second-only", options={"max_frames": 8}
        )
        assert (default.model, other.model) == (first, second)
        audio = [b"".join([pcm async for pcm in s]) for s in (default, other)]
    assert all(len(a) > 0 for a in audio)
    # Different weights: different audio.
    assert not np.array_equal(audio[0][: len(audio[1])], audio[1][: len(audio[0])])
    after = [e.metrics()["requests_completed"] for e in engines]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]


async def test_unknown_model_is_refused_naming_the_served_ones(
    served, tiny_checkpoint: Path, small_checkpoint: Path
) -> None:
    server, _ = served
    first, second = names(tiny_checkpoint, small_checkpoint)
    async with websockets.connect(server.ws_url) as ws:
        assert (await recv_event(ws))["type"] == "hello"
        await send(ws, type="start", stream="a", model="fr", text=TEXT, end=True)
        error = await recv_event(ws)
        assert error["type"] == "error" and error["code"] == "unknown_model"
        assert error["final"] and error["stream"] == "a"
        assert first in error["message"] and second in error["message"]
    async with IntoneClient(server.ws_url) as client:
        with pytest.raises(IntoneError) as e:  # a voice of the other model
            await client.stream(voice="second-only", text=TEXT, end=True)
        assert e.value.code == "unknown_voice"


async def test_openai_model_field(served, tiny_checkpoint: Path, small_checkpoint: Path) -> None:
    server, _ = served
    first, second = names(tiny_checkpoint, small_checkpoint)
    oai = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    try:
        for model, expected in [(second, second), ("tts-1", first), (first, first)]:
            async with oai.audio.speech.with_streaming_response.create(
                model=model,
                voice="alloy",
                input=TEXT,
                response_format="pcm",
            ) as response:
                assert response.headers["x-intone-model"] == expected
                assert len(await response.read()) > 0
        with pytest.raises(openai.BadRequestError) as e:
            await oai.audio.speech.create(model="german", voice="alloy", input=TEXT)
        assert e.value.body["code"] == "unknown_model"
        assert first in e.value.body["message"] and second in e.value.body["message"]
    finally:
        await oai.close()


def fake_served(source: str, requested: str | None = None) -> ServedModel:
    """A served model whose engine is only what naming reads (no model is loaded)."""
    engine = SimpleNamespace(loaded=SimpleNamespace(source=source, voices={}, weights="released"))
    return ServedModel(requested=requested, engine=engine)  # type: ignore[arg-type]


def test_release_names_languages_and_shortcuts_pick_models() -> None:
    models = [
        fake_served("kyutai/pocket-tts"),
        fake_served("french_24l", requested="fr"),
        fake_served("english_2m_2026-10"),
    ]
    taken: set[str] = set()
    for served in models:
        served.take_names(taken)
        served.voices = VoiceResolver(served.engine)  # type: ignore[arg-type]
    runtime = Runtime(models=models)
    runtime.voices = models[0].voices  # ready: names are set
    assert [m.name for m in models] == ["english", "french_24l", "english_2m_2026-10"]
    for name, index in [
        (None, 0),
        ("tts-1", 0),
        ("kyutai/pocket-tts", 0),
        ("en", 0),
        ("english", 0),
        ("fr", 1),
        ("french", 1),
        ("french_24l", 1),
        ("english_2m_2026-10", 2),
    ]:
        assert runtime.select(name) is models[index], name
    for name in ("de", "german", "spanish_24l", "anything"):
        with pytest.raises(UnknownModelError) as e:
            runtime.select(name)
        assert "english" in str(e.value) and "french_24l (fr, french)" in str(e.value)
    # One model: a name that means no model is its default (OpenAI clients send their own ids),
    # a model or language it does not serve is refused.
    single = Runtime(models=[models[0]])
    single.voices = models[0].voices
    assert single.select("my-favourite-model") is models[0]
    with pytest.raises(UnknownModelError):
        single.select("fr")


async def test_an_uploaded_voice_belongs_to_one_model(
    served, tiny_checkpoint: Path, small_checkpoint: Path
) -> None:
    server, engines = served
    first, second = names(tiny_checkpoint, small_checkpoint)
    wav = (small_checkpoint / "voices" / "default.wav").read_bytes()
    async with IntoneClient(server.url) as client:
        voice = await client.add_voice(wav, model=second)
        assert voice["model"] == second
        assert voice["id"] in engines[1].voices and voice["id"] not in engines[0].voices
        assert await client.synthesize(TEXT, voice=voice["id"], model=second)
        with pytest.raises(IntoneError) as info:
            await client.synthesize(TEXT, voice=voice["id"])  # the default (first) model
        assert info.value.code == "unknown_voice" and second in info.value.message
        listed = await client.list_voices()
        assert {(v["id"], v["model"]) for v in listed if v["shared"]} >= {
            ("default", first),
            ("second-only", second),
        }
        await client.delete_voice(voice["id"])
        assert voice["id"] not in engines[1].voices
