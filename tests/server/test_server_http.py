"""HTTP side: the OpenAI-compatible speech API through the real `openai` client, health,
metrics, the demo page, voices from a directory, and the app mounted in a FastAPI app."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil

import av
import httpx
import numpy as np
import openai
import pytest
import soundfile
from fastapi import FastAPI

from intone.provider.client import IntoneClient
from intone.provider.server import ServerSettings, create_app
from intone.provider.server.voices import OPENAI_VOICES

from support.server import (
    LONG_TEXT,
    ServerThread,
    idle_pages,
    running_server,
    wait_engine_idle,
    wait_server_streams,
)

TEXT = "Hello from the OpenAI compatible endpoint. It streams."


@pytest.fixture(scope="module")
def voices_dir(tiny_checkpoint, tmp_path_factory):
    directory = tmp_path_factory.mktemp("voices")
    shutil.copy(tiny_checkpoint / "voices" / "default.wav", directory / "bob.wav")
    samples, rate = soundfile.read(str(tiny_checkpoint / "voices" / "default.wav"))
    soundfile.write(str(directory / "carol.flac"), samples[: rate * 2], rate)
    (directory / "notes.txt").write_text("not a voice")
    return directory


@pytest.fixture(scope="module")
def served(tiny_checkpoint, voices_dir):
    with running_server(tiny_checkpoint, voices_dir=voices_dir) as (server, engine):
        yield server, engine


@pytest.fixture
def server(served):
    return served[0]


@pytest.fixture
def engine(served):
    return served[1]


@pytest.fixture
async def oai(server):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    yield client
    await client.close()


def decode(data: bytes, fmt: str) -> np.ndarray:
    """Float samples at 24 kHz from a response body."""
    if fmt == "pcm":
        assert len(data) % 2 == 0
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768
    if fmt == "wav":
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
        assert rate == 24000
        return samples
    container = av.open(io.BytesIO(data), format="mp3")
    frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
    assert container.streams.audio[0].rate == 24000
    return np.concatenate(frames)


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
@pytest.mark.parametrize("fmt", ["mp3", "wav", "pcm"])
async def test_openai_client_streams_each_format(oai, fmt, stream_format):
    async with oai.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="alloy",
        input=TEXT,
        response_format=fmt,
        stream_format=stream_format,
    ) as response:
        assert response.status_code == 200
        assert response.headers["x-request-id"].startswith("req_")
        content_type = response.headers["content-type"]
        chunks = [chunk async for chunk in response.iter_bytes()]
    assert len(chunks) > 1, "the body was not streamed"
    body = b"".join(chunks)
    if stream_format == "sse":
        assert content_type.startswith("text/event-stream")
        events = [
            json.loads(line[len("data: ") :])
            for line in body.decode().split("\n")
            if line.startswith("data: ")
        ]
        assert events[-1]["type"] == "speech.audio.done"
        assert events[-1]["usage"]["output_tokens"] > 0
        deltas = events[:-1]
        assert deltas and all(e["type"] == "speech.audio.delta" for e in deltas)
        body = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    else:
        assert content_type == {"mp3": "audio/mpeg", "wav": "audio/wav", "pcm": "audio/pcm"}[fmt]
    samples = decode(body, fmt)
    assert len(samples) > 24000 * 0.5
    assert np.abs(samples).max() > 0


async def test_openai_formats_carry_the_same_audio(oai):
    """pcm and wav hold identical samples; mp3 decodes to the same length (within the
    encoder's delay and padding)."""
    bodies = {}
    for fmt in ("pcm", "wav", "mp3"):
        response = await oai.audio.speech.create(
            model="any", voice="alloy", input=TEXT, response_format=fmt, extra_body={}
        )
        bodies[fmt] = decode(response.content, fmt)
    assert len(bodies["wav"]) == len(bodies["pcm"])
    assert abs(len(bodies["mp3"]) - len(bodies["pcm"])) < 3000


async def test_openai_voice_forms_and_sample_rate(oai, server):
    by_id = await oai.audio.speech.create(
        model="x", voice={"id": "bob"}, input="By id.", response_format="pcm"
    )
    assert by_id.content
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{server.url}/v1/audio/speech",
            json={"input": "Telephony.", "voice": "carol", "response_format": "pcm",
                  "sample_rate": 8000, "speed": 1.5, "instructions": "ignored"},
        )  # fmt: skip
        assert response.status_code == 200
        assert response.headers["x-intone-voice"] == "carol"


@pytest.mark.parametrize(
    "body, status, code",
    [
        ({"model": "m", "voice": "nobody", "input": "hi"}, 400, "unknown_voice"),
        ({"model": "m", "voice": {"id": "nobody"}, "input": "hi"}, 400, "unknown_voice"),
        ({"model": "m", "voice": {"name": "alloy"}, "input": "hi"}, 400, "unknown_voice"),
        ({"model": "m", "voice": 7, "input": "hi"}, 400, "unknown_voice"),
        ({"model": "m", "voice": "alloy", "input": ""}, 400, "empty_text"),
        ({"model": "m", "voice": "alloy", "input": "   "}, 400, "empty_text"),
        ({"model": "m", "voice": "alloy"}, 400, "bad_message"),
        ({"model": "m", "voice": "alloy", "input": "hi", "response_format": "opus"}, 400,
         "bad_format"),
        ({"model": "m", "voice": "alloy", "input": "hi", "stream_format": "ws"}, 400,
         "bad_format"),
        ({"model": "m", "voice": "alloy", "input": "hi", "speed": 9}, 400, "bad_options"),
        ({"model": "m", "voice": "alloy", "input": "hi", "speed": 0.25}, 400, "bad_options"),
        ({"model": "m", "voice": "alloy", "input": "hi", "normalize": "no"}, 400, "bad_options"),
        ({"model": "m", "voice": "alloy", "input": "hi", "sample_rate": 1}, 400,
         "bad_sample_rate"),
        ({"model": "m", "voice": "alloy", "input": "x" * 20_001}, 400, "text_too_long"),
    ],
)  # fmt: skip
async def test_openai_bad_requests(server, body, status, code):
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{server.url}/v1/audio/speech", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == code and error["message"]
    assert error["type"] == "invalid_request_error"


async def test_openai_speed_time_scales_the_audio(oai):
    lengths = {}
    for speed in (1.0, 2.0):
        response = await oai.audio.speech.create(
            model="m", voice="alloy", input=TEXT, response_format="pcm", speed=speed,
            extra_body={"normalize": False},
        )  # fmt: skip
        lengths[speed] = len(response.content)
    assert lengths[2.0] / lengths[1.0] == pytest.approx(0.5, rel=0.05)


async def test_openai_client_raises_bad_request(oai):
    with pytest.raises(openai.BadRequestError) as info:
        await oai.audio.speech.create(model="m", voice="nobody", input="hi")
    assert info.value.status_code == 400
    assert info.value.body["code"] == "unknown_voice"


async def test_openai_malformed_and_oversized_bodies(server):
    url = f"{server.url}/v1/audio/speech"
    as_json = {"content-type": "application/json"}
    async with httpx.AsyncClient() as http:
        response = await http.post(url, content=b"{nope", headers=as_json)
        assert response.status_code == 400 and response.json()["error"]["code"] == "bad_json"
        response = await http.post(url, content=b"[]", headers=as_json)
        assert response.json()["error"]["code"] == "bad_message"
        # Not JSON: a cross-site "simple request" a web page could send without a preflight.
        for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"content-type": content_type} if content_type else {}
            response = await http.post(url, content=b'{"input": "Hi."}', headers=headers)
            assert response.status_code == 415, content_type
        big = json.dumps({"input": "x" * 300_000, "voice": "alloy"}).encode()
        response = await http.post(url, content=big, headers=as_json)
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "message_too_large"


async def test_openai_disconnect_releases_engine_state(server, engine):
    pages = idle_pages(engine)
    async with httpx.AsyncClient() as http:
        request = {"input": LONG_TEXT, "voice": "alloy", "response_format": "pcm"}
        async with http.stream("POST", f"{server.url}/v1/audio/speech", json=request) as r:
            async for _ in r.aiter_bytes():
                break  # leave mid-stream
    await wait_engine_idle(engine, pages)
    await wait_server_streams(server.url, 0)


async def test_all_openai_voice_names_work(server):
    async with httpx.AsyncClient() as http:
        health = (await http.get(f"{server.url}/healthz")).json()
    aliases = health["aliases"]
    assert set(OPENAI_VOICES) <= set(aliases)
    assert aliases["alloy"] == "default"  # the first name is the default voice
    assert set(aliases.values()) == {"default", "bob", "carol"}  # spread over the registry
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x") as oai:
        results = await asyncio.gather(
            *(
                oai.audio.speech.create(model="m", voice=v, input="Hi.", response_format="pcm")
                for v in OPENAI_VOICES
            )
        )
    assert all(r.content for r in results)


async def test_healthz_stats_metrics_and_page(server, engine):
    async with httpx.AsyncClient() as http, IntoneClient(server.url):
        health = (await http.get(f"{server.url}/healthz")).json()
        assert health["status"] == "ok"
        assert health["weights"] == "generated"
        assert "source" not in health and "/" not in health["model"]  # no paths
        assert health["voices"] == ["bob", "carol", "default"]
        assert health["default_voice"] == "default"
        assert health["connections"] == 1
        stats = (await http.get(f"{server.url}/stats")).json()
        assert stats["engine"]["kv_pages_total"] == engine.metrics()["kv_pages_total"]
        assert stats["server"]["connections"] == 1
        metrics = await http.get(f"{server.url}/metrics")
        assert metrics.headers["content-type"].startswith("text/plain")
        text = metrics.text
        for name in (
            "intone_kv_pages_in_use",
            "intone_batch_size_bucket",
            "intone_server_connections 1.0",
            "intone_server_streams",
            "intone_server_streams_finished_total",
        ):
            assert name in text, name
        page = await http.get(f"{server.url}/")
        assert page.status_code == 200 and "<script>" in page.text
        assert "v1/stream" in page.text and "banner" in page.text


async def test_voices_dir_registers_every_audio_file(engine):
    assert {"bob", "carol", "default"} <= set(engine.voices)
    assert "notes" not in engine.voices


async def test_mounted_in_fastapi_with_lazy_engine(tiny_checkpoint):
    """No engine passed and no lifespan (Starlette never runs a mounted app's lifespan): the
    engine starts on the first request."""
    outer = FastAPI()

    @outer.get("/ping")
    def ping() -> dict:
        return {"pong": True}

    tts = create_app(model=tiny_checkpoint, settings=ServerSettings())
    outer.mount("/tts", tts)
    runtime = tts.state.intone
    server = ServerThread(outer).start()
    try:
        assert runtime.engine is None  # nothing started yet
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{server.url}/ping")).json() == {"pong": True}
            health = (await http.get(f"{server.url}/tts/healthz")).json()
            assert health["status"] == "ok" and health["weights"] == "generated"
            page = await http.get(f"{server.url}/tts/")
            assert page.status_code == 200
            response = await http.post(
                f"{server.url}/tts/v1/audio/speech",
                json={"input": "Mounted.", "voice": "alloy", "response_format": "wav"},
            )
            assert response.status_code == 200 and response.content[:4] == b"RIFF"
        async with IntoneClient(f"ws://127.0.0.1:{server.port}/tts/v1/stream") as client:
            assert await client.synthesize("Mounted over the WebSocket too.")
        assert runtime.engine is not None and runtime.owns_engine
    finally:
        server.call(runtime.close())
        server.stop()
    assert runtime.engine.health().reason == "the engine is closed"


async def test_draining_refuses_new_work(server):
    """While draining, new streams get an error with a code and /healthz says so; the drain
    itself (signal, deadline, exit) is tested on a real process in test_server_shutdown.py."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    from support.server import recv_event, send

    runtime = server.app.state.intone
    async with connect(server.ws_url) as ws:
        await recv_event(ws)
        runtime.draining = True
        try:
            await send(ws, type="start", stream="d", text="Hello.", end=True)
            event = await recv_event(ws)
            assert (event["code"], event["final"]) == ("shutting_down", True)
            async with httpx.AsyncClient() as http:
                response = await http.post(
                    f"{server.url}/v1/audio/speech", json={"input": "hi", "voice": "alloy"}
                )
                assert response.status_code == 503
                assert response.headers["retry-after"] == "1"
                assert response.json()["error"]["code"] == "shutting_down"
                health = await http.get(f"{server.url}/healthz")
                assert health.status_code == 503 and health.json()["status"] == "draining"
            # A new connection (where the listener stays open) is told and closed.
            async with connect(server.ws_url) as late:
                event = await recv_event(late)
                assert event["code"] == "shutting_down"
                with pytest.raises(ConnectionClosed):
                    await late.recv()
                assert late.close_code == 1001
        finally:
            runtime.draining = False
