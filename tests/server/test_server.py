"""The WebSocket protocol through the Python client and raw sockets: streaming, concurrency,
resampling, cancel and disconnect (engine state released)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
import soxr
from websockets.asyncio.client import connect

from intone.provider.client import IntoneClient, IntoneConnectionError, IntoneError, ws_url
from intone.provider.protocol import HEADER_BYTES, ClauseDoneEvent, unpack_audio

from support.server import (
    LONG_TEXT,
    idle_pages,
    recv_event,
    recv_until,
    running_server,
    send,
    wait_engine_idle,
    wait_server_streams,
)

SEED = {"seed": 7}


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    with running_server(tiny_checkpoint) as (server, engine):
        yield server, engine


@pytest.fixture
def server(served):
    return served[0]


@pytest.fixture
def engine(served):
    return served[1]


def test_ws_url_forms():
    assert ws_url("http://h:1") == "ws://h:1/v1/stream"
    assert ws_url("https://h") == "wss://h/v1/stream"
    assert ws_url("ws://h:1/tts/v1/stream") == "ws://h:1/tts/v1/stream"
    with pytest.raises(ValueError):
        ws_url("ftp://h")


async def test_hello_and_synthesize(server, engine):
    async with IntoneClient(server.url) as client:
        assert client.hello.protocol == 1 and client.hello.version
        assert "/" not in client.hello.model  # a name, never a local path
        assert client.sample_rate == engine.sample_rate
        assert client.hello.header_bytes == HEADER_BYTES
        assert "default" in client.voices and "alloy" in client.voices
        pcm = await client.synthesize("Hello there. This is a test.", options=SEED)
    assert len(pcm) > 0 and len(pcm) % 2 == 0
    samples = np.frombuffer(pcm, dtype="<i2")
    assert np.abs(samples).max() > 0


async def test_streaming_text_in_pieces(server):
    text = "Well, hello there! How are you doing today? I hope that all is well with you."
    async with IntoneClient(server.url) as client:
        stream = await client.stream(format="pcm_f32le", options=SEED)
        assert stream.format == "pcm_f32le" and stream.sample_rate == 24000
        for word in text.split(" "):
            await stream.push_text(word + " ")
        await stream.flush()
        await stream.end_input()
        items = [item async for item in stream.events()]
    audio = [i for i in items if isinstance(i, bytes)]
    clauses = [i for i in items if isinstance(i, ClauseDoneEvent)]
    assert audio and all(len(a) % 4 == 0 for a in audio)
    assert len(clauses) >= 2
    assert [c.clause for c in clauses] == list(range(len(clauses)))
    assert " ".join(c.text for c in clauses).split() == text.split()
    assert all(c.frames > 0 and c.audio_seconds > 0 and c.elapsed > 0 for c in clauses)
    metrics = stream.metrics
    assert metrics is not None
    assert metrics["clauses"] == len(clauses)
    assert metrics["frames"] == len(audio)
    assert metrics["bytes"] == sum(len(a) for a in audio)
    assert metrics["ttfa"] > 0 and metrics["server_ttfa"] > 0 and metrics["rtf"] > 0


async def test_resampling_is_continuous(server):
    """16 kHz output equals resampling the 24 kHz output offline: the stream's soxr state
    carries across frames (same seed, so the same model audio)."""
    text = "Resampling must not click at the frame edges."
    async with IntoneClient(server.url) as client:
        native, low = await asyncio.gather(
            client.synthesize(text, sample_rate=24000, format="pcm_f32le", options=SEED),
            client.synthesize(text, sample_rate=16000, format="pcm_f32le", options=SEED),
        )
    native = np.frombuffer(native, dtype="<f4")
    low = np.frombuffer(low, dtype="<f4")
    expected = soxr.resample(native, 24000, 16000, quality="HQ")
    assert abs(len(low) - len(expected)) <= 2
    n = min(len(low), len(expected))
    assert np.max(np.abs(low[:n] - expected[:n])) < 1e-3


async def test_concurrent_streams_on_one_connection_batch_together(server, engine):
    before = engine.metrics()["generate_batch_histogram"]
    async with IntoneClient(server.url) as client:
        rates = [8000, 16000, 24000, 48000]
        streams = [
            await client.stream(sample_rate=rate, format=fmt)
            for rate, fmt in zip(rates, ["pcm_s16le", "pcm_f32le"] * 2, strict=True)
        ]
        for stream in streams:
            await stream.push_text(LONG_TEXT[:600])
            await stream.end_input()

        async def collect(stream):
            return b"".join([pcm async for pcm in stream])

        results = await asyncio.gather(*(collect(s) for s in streams))
    for stream, pcm in zip(streams, results, strict=True):
        width = 2 if stream.format == "pcm_s16le" else 4
        seconds = len(pcm) / width / stream.sample_rate
        assert stream.metrics is not None
        assert seconds == pytest.approx(stream.metrics["audio_seconds"], abs=0.05)
    after = engine.metrics()["generate_batch_histogram"]
    batched = sum(after[k] - before[k] for k in after if int(k) >= 2)
    assert batched > 0, "concurrent streams never shared an AR step"


async def test_concurrent_connections(server, engine):
    pages = idle_pages(engine)

    async def one_connection(i: int) -> list[int]:
        async with IntoneClient(server.url) as client:
            results = await asyncio.gather(
                *(client.synthesize(f"Connection {i}, stream {j}. Hello.") for j in range(2))
            )
            return [len(r) for r in results]

    sizes = await asyncio.gather(*(one_connection(i) for i in range(3)))
    assert all(size > 0 for pair in sizes for size in pair)
    await wait_engine_idle(engine, pages)


async def test_client_cancel_mid_stream(server, engine):
    pages = idle_pages(engine)
    async with IntoneClient(server.url) as client:
        stream = await client.stream()
        await stream.push_text(LONG_TEXT)
        await stream.end_input()
        frames = 0
        async for _ in stream:
            frames += 1
            if frames == 3:
                await stream.cancel()
        assert frames == 3  # iteration ends at the cancel
        assert stream.cancelled and stream.done
        # Other streams on the same connection still work.
        assert await client.synthesize("Still here.")
    await wait_engine_idle(engine, pages)
    await wait_server_streams(server.url, 0)


async def test_cancel_raw_no_audio_after_cancelled_event(server, engine):
    """On the wire: after `cancelled`, no binary frame of that stream's channel."""
    pages = idle_pages(engine)
    async with connect(server.ws_url, compression=None) as ws:
        assert (await recv_event(ws))["type"] == "hello"
        await send(ws, type="start", stream="long", text=LONG_TEXT, end=True)
        started = await recv_event(ws)
        assert started["type"] == "started"
        channel = started["channel"]
        # Wait for audio to flow, then cancel while it does.
        while True:
            message = await ws.recv()
            if isinstance(message, bytes) and unpack_audio(message)[0] == channel:
                break
        await send(ws, type="cancel", stream="long")
        event, _ = await recv_until(ws, lambda e: e["type"] == "cancelled")
        assert event == {"type": "cancelled", "stream": "long", "reason": "client"}
        # A second stream's whole life after the cancel: nothing from the first may appear.
        await send(ws, type="start", stream="after", text="After the cancel.", end=True)
        done, seen = await recv_until(ws, lambda e: e["type"] == "done")
        assert done["stream"] == "after"
        assert not [m for m in seen if isinstance(m, tuple) and m[0] == channel]
        # Cancelling again (it raced with the end) is a silent no-op.
        await send(ws, type="cancel", stream="long")
        await send(ws, type="start", stream="probe", text="Probe.", end=True)
        event, seen = await recv_until(ws, lambda e: e["type"] == "done")
        assert not [m for m in seen if isinstance(m, dict) and m["type"] == "error"]
    await wait_engine_idle(engine, pages)


async def test_disconnect_mid_stream_releases_engine_state(server, engine):
    pages = idle_pages(engine)
    ws = await connect(server.ws_url, compression=None)
    await recv_event(ws)
    for sid in ("a", "b"):
        await send(ws, type="start", stream=sid, text=LONG_TEXT)  # input left open
    audio = 0
    while audio < 4:
        if isinstance(await ws.recv(), bytes):
            audio += 1
    assert engine.metrics()["active_requests"] > 0
    ws.transport.abort()  # no close handshake: the client just vanishes
    await wait_engine_idle(engine, pages)
    stats = await wait_server_streams(server.url, 0)
    assert stats["server"]["streams_finished"].get("websocket_disconnected", 0) >= 2


async def test_stream_errors_raise_from_client(server):
    async with IntoneClient(server.url) as client:
        with pytest.raises(IntoneError) as info:
            await client.stream(voice="nobody")
        assert info.value.code == "unknown_voice"
        with pytest.raises(IntoneError) as info:
            await client.synthesize("   ")
        assert info.value.code == "empty_text"
        stream = await client.stream()
        with pytest.raises(TypeError, match="str"):
            await stream.push_text(3)  # refused before it is sent, as the engine refuses it
        await stream.cancel()
        # The connection survived them all.
        assert await client.synthesize("Fine.")


async def test_client_sees_connection_loss(server):
    client = IntoneClient(server.url)
    await client.connect()
    stream = await client.stream()
    await stream.push_text(LONG_TEXT)
    await client._ws.close()  # simulate the connection dropping under an open stream
    with pytest.raises(IntoneConnectionError):
        async for _ in stream:
            pass
    with pytest.raises(IntoneConnectionError):
        await client.stream()
    await client.close()


async def test_events_are_json_with_stream_ids(server):
    async with connect(server.ws_url) as ws:
        hello = await recv_event(ws)
        assert hello["limits"]["max_streams"] == 4
        await send(ws, type="start", stream="x", text="Hi there.", end=True, sample_rate=8000)
        kinds = []
        while True:
            message = await ws.recv()
            if isinstance(message, bytes):
                channel, sequence, payload = unpack_audio(message)
                assert len(payload) % 2 == 0
                kinds.append("audio")
                continue
            event = json.loads(message)
            assert event["stream"] == "x"
            kinds.append(event["type"])
            if event["type"] == "done":
                break
    assert kinds[0] == "started" and kinds[-1] == "done"
    assert "audio" in kinds and "clause_done" in kinds


async def test_streams_without_text_do_not_block_others(server, engine):
    """A stream opened ahead of its text (as agents do at the start of a turn) must not hold
    up other requests."""
    pages = idle_pages(engine)
    async with IntoneClient(server.url) as client:
        waiting = [await client.stream() for _ in range(3)]
        pcm = await asyncio.wait_for(client.synthesize("Not blocked."), 10)
        assert pcm
        await waiting[0].push_text("Now I have text.")
        await waiting[0].end_input()
        assert b"".join([chunk async for chunk in waiting[0]])
        for stream in waiting[1:]:
            await stream.cancel()
    await wait_engine_idle(engine, pages)


async def test_the_example_client(server, tmp_path):
    """agents_examples/websocket_client.py, as a user runs it: text from stdin, word by word,
    into a WAV; a refused option is one line on stderr, not a traceback."""
    example = Path(__file__).parents[2] / "agents_examples" / "websocket_client.py"
    out = tmp_path / "out.wav"

    async def run(*args: str, stdin: bytes = b"") -> tuple[int, str, str]:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(example),
            "--url",
            server.url.replace("http", "ws"),
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(stdin), 60)
        return process.returncode, stdout.decode(), stderr.decode()

    code, stdout, stderr = await run(
        "--word-by-word", "--word-delay", "0", "--out", str(out), stdin=b"Hello there, friend."
    )
    assert code == 0, stderr
    assert "TTFA" in stdout and "wrote" in stdout
    samples, rate = soundfile.read(str(out))
    assert rate == 24000 and len(samples) > 0

    code, stdout, stderr = await run("--speed", "5", "--out", str(out), "Hello there.")
    assert code == 1 and stderr.strip() == "error: bad_options: speed must be in [0.5, 2], got 5"


@pytest.mark.parametrize("pacing", ["yield", "hold"])
async def test_a_one_shot_request_renders_past_the_lead_on_an_idle_server(tiny_checkpoint, pacing):
    """No playback reports, a client reading as fast as it can, on both endpoints: with the
    default pacing ("yield") an idle server makes the audio past `lead_s` too (counted as
    yielded, in the `done` metrics and the engine's), with "hold" it holds at `lead_s`."""
    import httpx

    text = "Hello there, this is the first part. And here is a second part of it. " * 2
    config = dict(lead_s=0.3, pacing=pacing)
    with running_server(tiny_checkpoint, engine_config=config) as (server, engine):
        async with IntoneClient(server.url) as client:
            stream = await client.stream(options=SEED, text=text, end=True)
            pcm = b"".join([chunk async for chunk in stream])
        assert len(pcm) > 0
        yielded = stream.metrics["yielded_seconds"]
        before = engine.metrics()["yielded_seconds"]
        body = {"model": "tts-1", "input": text, "voice": "default", "response_format": "pcm"}
        async with httpx.AsyncClient(timeout=60) as http:
            response = await http.post(f"{server.url}/v1/audio/speech", json=body)
        assert response.status_code == 200 and len(response.content) > 0
        over_http = engine.metrics()["yielded_seconds"] - before
    if pacing == "yield":
        assert yielded > 0.5 and over_http > 0.5, (yielded, over_http)
    else:
        assert yielded < 0.3 and over_http < 0.3, (yielded, over_http)
