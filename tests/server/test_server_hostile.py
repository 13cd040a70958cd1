"""`intone serve` against hostile and careless clients: random WebSocket messages and HTTP
bodies (hypothesis), a client that never reads, idle streams hogging the engine, and 1000
connections at once. Every started stream gets exactly one final event, nothing is a 500 or an
`internal_error`, and the engine is back to rest afterwards."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import statistics
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from intone.provider.client import IntoneClient, IntoneError
from intone.provider.protocol import STREAM_OPTIONS
from intone.provider.server import ServerSettings, create_app

from support.server import (
    LONG_TEXT,
    ServerThread,
    idle_pages,
    make_engine,
    recv_event,
    running_server,
    send,
    wait_engine_idle,
    wait_server_streams,
)

BIG = "__5000_digits__"  # replaced by a 5000-digit integer literal (json.dumps cannot write one)
FAST = {"max_frames": 6}


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    with running_server(tiny_checkpoint, max_streams_per_connection=8) as (server, engine):
        yield server, engine


# Any Unicode, lone surrogates included.
junk_text = st.text(st.characters(exclude_categories=()), max_size=12)
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    junk_text,
    st.just(BIG),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
ids = st.sampled_from(["a", "b", "c", "d\n", "x" * 65])
kinds = st.sampled_from(["start", "text", "flush", "end", "cancel", "playback"])
ws_message = st.fixed_dictionaries(
    {"type": st.one_of(kinds, kinds, junk), "stream": st.one_of(ids, ids, junk)},
    optional={
        "text": st.one_of(st.sampled_from(["Hi there. ", "Yes.", "", " "]), junk),
        "voice": st.one_of(st.sampled_from(["alloy", "default", "nobody"]), junk),
        "sample_rate": st.one_of(st.sampled_from([8000, 16000, 7999]), junk),
        "format": st.one_of(st.sampled_from(["pcm_s16le", "pcm_f32le", "mp3"]), junk),
        "options": st.one_of(
            st.dictionaries(st.sampled_from([*STREAM_OPTIONS, "flow_steps", "x"]), junk),
            st.just(FAST),
            junk,
        ),
        "end": st.one_of(st.booleans(), junk),
        "seconds": junk,
    },
)
good_ids = st.sampled_from(["a", "b", "c"])
good_text = st.one_of(st.sampled_from(["Hi there. ", "Yes.", " "]), junk_text)
# Mostly well-formed streams, so that many streams start and then meet the hostile messages.
plausible = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("start"), "stream": good_ids, "options": st.just(FAST)},
        optional={
            "text": good_text,
            "end": st.booleans(),
            "voice": st.sampled_from(["alloy", "nobody"]),
            "sample_rate": st.sampled_from([16000, 8000, 48000]),
        },
    ),
    st.fixed_dictionaries({"type": st.just("text"), "stream": good_ids, "text": good_text}),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["end", "flush", "cancel"]), "stream": good_ids}
    ),
    st.fixed_dictionaries(
        {"type": st.just("playback"), "stream": good_ids, "seconds": st.floats(0, 5)}
    ),
)


def _encode(message: dict) -> str:
    return json.dumps(message).replace(f'"{BIG}"', "9" * 5000)


raw_frames = st.one_of(
    plausible.map(_encode),
    plausible.map(_encode),
    ws_message.map(_encode),
    st.sampled_from(["{", "[]", "null", '{"type": NaN}', "x" * 5000]),
    st.binary(max_size=16),
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(frames=st.lists(raw_frames, min_size=1, max_size=12))
def test_hostile_websocket_messages(served, frames):
    server, _ = served
    asyncio.run(_hostile_session(server.ws_url, frames))


async def _hostile_session(url: str, frames: list[Any]) -> None:
    async with connect(url) as ws:
        await recv_event(ws)
        for frame in frames:
            await ws.send(frame)
        # Cancel every stream a message may have started, then a sentinel whose error comes
        # after every event of the messages before it.
        for sid in ("a", "b", "c"):
            await send(ws, type="cancel", stream=sid)
        await send(ws, type="sentinel", stream="zz")
        events = []
        while True:
            event = await recv_event(ws, timeout=20)
            if event["type"] == "error" and event.get("stream") == "zz":
                break
            events.append(event)
    assert not [e for e in events if e.get("code") == "internal_error"], events
    started = [e["stream"] for e in events if e["type"] == "started"]
    assert len(started) == len(set(started))
    for sid in started:
        # After its `started`: a refused start of the same id before it had its own final.
        begin = next(
            i for i, e in enumerate(events) if e["type"] == "started" and e["stream"] == sid
        )
        finals = [
            e
            for e in events[begin:]
            if e.get("stream") == sid
            and (e["type"] in ("done", "cancelled") or (e["type"] == "error" and e["final"]))
        ]
        assert len(finals) == 1, (sid, events)


http_body = st.fixed_dictionaries(
    {},
    optional={
        "input": st.one_of(st.sampled_from(["Hi there.", "", " ", "x" * 21000]), junk),
        "model": st.one_of(st.sampled_from(["tts-1", "a\r\nx-evil: 1", "\u00e9"]), junk),
        "voice": st.one_of(st.sampled_from(["alloy", "nobody", {"id": "alloy"}]), junk),
        "response_format": st.one_of(st.sampled_from(["pcm", "wav", "opus"]), junk),
        "stream_format": st.one_of(st.sampled_from(["audio", "sse"]), junk),
        "speed": junk,
        "sample_rate": st.one_of(st.just(16000), junk),
    },
)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    body=st.one_of(
        http_body.map(lambda b: _encode(b).encode()),
        st.binary(max_size=40),
    )
)
def test_hostile_http_bodies(served, body):
    server, _ = served
    response = httpx.post(
        f"{server.url}/v1/audio/speech",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        error = response.json()["error"]
        assert error["code"] != "internal_error" and len(error["message"]) < 400


async def test_engine_at_rest_after_the_hostile_tests(served):
    server, engine = served
    await wait_server_streams(server.url, 0)
    await wait_engine_idle(engine, idle_pages(engine))


# ---- a client that never reads


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def _silent_websocket(port: int, message: str) -> asyncio.StreamWriter:
    """A WebSocket that sends `message` and then never reads (a tiny receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    key = base64.b64encode(os.urandom(16))
    writer.write(
        b"GET /v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: "
        + key
        + b"\r\n\r\n"
    )
    await reader.readuntil(b"\r\n\r\n")
    payload = message.encode()
    assert len(payload) < 65536
    # A masked text frame (mask 0: the payload goes as is).
    writer.write(b"\x81" + bytes([0x80 | 126]) + len(payload).to_bytes(2, "big") + bytes(4))
    writer.write(payload)
    await writer.drain()
    writer.transport.pause_reading()
    return writer


RSS_BOUND_MB = 100  # growth of the server process (this one) while the silent client hangs on


async def test_slow_reader_is_dropped_while_another_stays_real_time(tiny_checkpoint):
    settings_ = dict(max_buffered_audio=1.0, slow_client_timeout=2.0)
    with running_server(tiny_checkpoint, **settings_) as (server, engine):
        pages = idle_pages(engine)
        rss_before = _rss_mb()
        # EOS off and 48 kHz float: minutes of audio at 192 KB/s, more than the kernel's
        # socket buffers hold.
        start = {
            "type": "start",
            "stream": "s",
            "text": LONG_TEXT,
            "end": True,
            "sample_rate": 48000,
            "format": "pcm_f32le",
            "options": {"eos_threshold": 1e9, "max_frames": 100},
        }
        silent = await _silent_websocket(server.port, json.dumps(start))
        peak = rss_before

        async def sample() -> None:
            nonlocal peak
            while True:
                peak = max(peak, _rss_mb())
                await asyncio.sleep(0.1)

        sampler = asyncio.create_task(sample())
        try:
            async with IntoneClient(server.url) as client:
                stream = await client.stream(format="pcm_f32le", text=LONG_TEXT[:400], end=True)
                arrivals, played = [], 0.0
                async for pcm in stream:
                    arrivals.append((time.perf_counter(), played))
                    played += len(pcm) / 4 / stream.sample_rate
            # Real time: no frame comes later than the audio before it takes to play, after a
            # 1 s jitter buffer.
            first = arrivals[0][0]
            late = [(t - first) - p for t, p in arrivals if (t - first) - p > 1.0]
            assert not late, late[:5]
            # The silent client: dropped, its stream released, while it still holds its socket.
            stats = await wait_server_streams(server.url, 0, timeout=15)
            assert stats["server"]["errors"].get("slow_client", 0) >= 1, stats
            await wait_engine_idle(engine, pages, timeout=15)
            # Its connection goes too (once the close handshake gives up on it).
            runtime = server.app.state.intone
            deadline = time.monotonic() + 30
            while runtime.connections or runtime.limits.connections:
                assert time.monotonic() < deadline, (
                    runtime.connections,
                    runtime.limits.connections,
                )
                await asyncio.sleep(0.1)
        finally:
            sampler.cancel()
            silent.close()
        assert peak - rss_before < RSS_BOUND_MB, (rss_before, peak)


async def test_http_slow_reader_is_cut_and_its_socket_closed(tiny_checkpoint):
    # Unpaced (lead_s=None): the engine would otherwise make audio at playback speed, and the
    # socket buffers would take a minute to fill.
    engine = make_engine(tiny_checkpoint, lead_s=None)
    app = create_app(engine, settings=ServerSettings(slow_client_timeout=2.0))
    server = ServerThread(app).start()
    try:
        pages = idle_pages(engine)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
        reader, writer = await asyncio.open_connection(sock=sock)
        text = ((LONG_TEXT + " ") * 6)[:19_000]  # minutes of audio: more than socket buffers
        body = json.dumps({"input": text, "response_format": "pcm", "sample_rate": 48000})
        writer.write(
            b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body.encode()
        )
        await writer.drain()
        writer.transport.pause_reading()
        try:
            stats = await wait_server_streams(server.url, 1, timeout=10)
            stats = await wait_server_streams(server.url, 0, timeout=20)
            assert stats["server"]["errors"].get("slow_client", 0) >= 1, stats
            await wait_engine_idle(engine, pages)
            # The server's side of the socket goes too, though the client never read.
            deadline = time.monotonic() + 20
            while server.server.server_state.connections:
                assert time.monotonic() < deadline, server.server.server_state.connections
                await asyncio.sleep(0.1)
        finally:
            writer.close()
    finally:
        server.stop()
        engine.close()


# ---- idle streams


async def test_idle_streams_do_not_delay_another_clients_first_audio(tiny_checkpoint):
    with running_server(tiny_checkpoint, max_streams_per_connection=32) as (server, engine):
        pages = idle_pages(engine)

        async def first_audio() -> float:
            async with IntoneClient(server.url) as client:
                began = time.perf_counter()
                stream = await client.stream(text="Hello there, how are you?", end=True)
                async for _ in stream:
                    return time.perf_counter() - began
            raise AssertionError("no audio")

        baseline = statistics.median([await first_audio() for _ in range(5)])
        async with IntoneClient(server.url) as hog:
            idle = [await hog.stream() for _ in range(16)]  # open, and never a word
            hogged = statistics.median([await first_audio() for _ in range(5)])
            for stream in idle:
                await stream.cancel()
        await wait_engine_idle(engine, pages)
        # 2x, plus 50 ms for the noise of a shared machine (first audio is ~0.1 s here).
        assert hogged <= 2 * baseline + 0.05, (hogged, baseline)


# ---- many connections


async def test_a_thousand_connections_are_served_or_refused(tiny_checkpoint):
    with running_server(tiny_checkpoint, max_connections=200) as (server, engine):
        pages = idle_pages(engine)
        outcomes: list[str] = []

        async def one(i: int) -> None:
            try:
                async with connect(server.ws_url, open_timeout=60) as ws:
                    event = await recv_event(ws, timeout=60)
                    if event["type"] == "error":
                        assert event["code"] == "too_many_connections", event
                        with pytest.raises(ConnectionClosed):
                            await asyncio.wait_for(ws.recv(), 30)
                        outcomes.append("refused")
                        return
                    await send(ws, type="start", stream="s", text="Hi.", end=True, options=FAST)
                    while True:
                        event = await recv_event(ws, timeout=60)
                        if event["type"] == "done":
                            outcomes.append("served")
                            return
                        if event["type"] == "error":  # a limit of the caller or the engine
                            assert event["final"], event
                            assert event["code"] in ("rate_limited", "server_busy"), event
                            outcomes.append("refused")
                            return
            except (TimeoutError, OSError, ConnectionClosed) as e:
                outcomes.append(f"failed: {e!r}")

        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(1000))), 240)
        failed = [o for o in outcomes if o.startswith("failed")]
        assert not failed, failed[:5]
        assert len(outcomes) == 1000 and outcomes.count("served") >= 100, outcomes
        await wait_server_streams(server.url, 0)
        await wait_engine_idle(engine, pages)


# ---- playback-paced generation


async def test_playback_reports_pace_the_stream(tiny_checkpoint):
    settings_ = dict(max_buffered_audio=1.0, slow_client_timeout=1.5)
    with running_server(tiny_checkpoint, **settings_) as (server, engine):
        pages = idle_pages(engine)
        async with IntoneClient(server.url) as client:
            options = {"eos_threshold": 1e9, "max_frames": 100}  # minutes of audio
            stream = await client.stream(format="pcm_f32le", options=options)
            await stream.push_text(LONG_TEXT[:300])
            await stream.playback(0.0)  # nothing played yet: at most 1 s ahead
            received = 0.0

            async def take(seconds: float) -> None:
                nonlocal received
                with contextlib.suppress(asyncio.TimeoutError):
                    async with asyncio.timeout(seconds):
                        async for pcm in stream:
                            received += len(pcm) / 4 / stream.sample_rate

            await take(1.0)
            frame = 0.08
            assert 0 < received <= 1.0 + 2 * frame, received
            await stream.playback(2.0)
            await take(1.0)
            assert 2.0 < received <= 3.0 + 2 * frame, received
            # No further report: the server gives up on the stream after the slow-client
            # timeout, with a final error.
            with pytest.raises(IntoneError) as info:
                async for _ in stream:
                    pass
            assert info.value.code == "slow_client"
        await wait_engine_idle(engine, pages)


async def test_a_client_that_stops_reporting_playback_is_given_up_on(tiny_checkpoint):
    # The engine holds the stream lead_s ahead of the last report, far under
    # max_buffered_audio: the server's own buffer never fills, and the stream would be silent
    # until max_stream_seconds.
    with running_server(
        tiny_checkpoint, engine_config=dict(lead_s=0.5), slow_client_timeout=1.5
    ) as (server, engine):
        pages = idle_pages(engine)
        async with IntoneClient(server.url) as client:
            options = {"eos_threshold": 1e9, "max_frames": 100}
            stream = await client.stream(format="pcm_f32le", options=options)
            await stream.push_text(LONG_TEXT[:300])
            await stream.playback(0.2)  # one report, then none
            started = time.monotonic()
            with pytest.raises(IntoneError) as info:
                async with asyncio.timeout(30):
                    async for _ in stream:
                        pass
            assert info.value.code == "slow_client"
            assert time.monotonic() - started >= 1.5
        await wait_engine_idle(engine, pages)
