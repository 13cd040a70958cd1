"""Access and limits of `intone serve`: API keys, origins and hosts, CORS, per-caller limits,
header/body/idle/lifetime timeouts, truncated raw audio, and what reaches the log."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import openai
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from intone.provider.client import IntoneClient, IntoneError
from intone.provider.protocol import SUBPROTOCOL, CloseCode
from intone.provider.server import ServerSettings, create_app
from intone.provider.server.access import Access, websocket_key
from intone.provider.server.limits import LimitError, Limits
from intone.provider.server.logs import ClientErrorLog, ClientMistakeFilter, KeyValueFormatter

from support.server import (
    LISTENER_PACED,
    LONG_TEXT,
    ServerThread,
    idle_pages,
    make_engine,
    recv_event,
    recv_until,
    running_server,
    send,
    wait_engine_idle,
)

KEYS = ("alpha-key-1", "beta-key-2")
SPEECH = {"input": "Hi there.", "voice": "alloy", "response_format": "pcm"}
JSON = {"content-type": "application/json"}


async def refused(ws, code: str, close: int) -> dict:
    """The one event a refused connection gets, then its close code."""
    event = await recv_event(ws)
    assert event["type"] == "error" and event["code"] == code, event
    with pytest.raises(ConnectionClosed) as info:
        await asyncio.wait_for(ws.recv(), 5)
    assert info.value.rcvd is not None and info.value.rcvd.code == close
    return event


# ---- keys


@pytest.fixture(scope="module")
def keyed(tiny_checkpoint):
    with running_server(tiny_checkpoint, api_keys=KEYS) as (server, engine):
        yield server, engine


async def test_http_needs_a_key_but_healthz_does_not(keyed):
    server, _ = keyed
    url = f"{server.url}/v1/audio/speech"
    async with httpx.AsyncClient() as http:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEYS[0]}):
            response = await http.post(url, json=SPEECH, headers=headers)
            assert response.status_code == 401, headers
            assert response.json()["error"]["code"] == "unauthorized"
            assert response.headers["www-authenticate"] == "Bearer"
        response = await http.post(url, json=SPEECH, headers={"authorization": f"Bearer {KEYS[1]}"})
        assert response.status_code == 200 and response.content
        health = await http.get(f"{server.url}/healthz")
        assert health.status_code == 200 and "source" not in health.json()
        for path in ("/stats", "/metrics", "/v1/models"):
            assert (await http.get(f"{server.url}{path}")).status_code == 401
            ok = await http.get(
                f"{server.url}{path}", headers={"authorization": f"Bearer {KEYS[0]}"}
            )
            assert ok.status_code == 200
    # The OpenAI SDK sends its api_key as a Bearer token.
    oai = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEYS[0])
    speech = await oai.audio.speech.create(
        model="m", voice="alloy", input="Hi.", response_format="pcm"
    )
    assert speech.content
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="nope").audio.speech.create(
            model="m", voice="alloy", input="Hi.", response_format="pcm"
        )


async def test_websocket_key_by_header_subprotocol_or_query(keyed):
    server, _ = keyed
    async with connect(server.ws_url) as ws:
        await refused(ws, "unauthorized", CloseCode.UNAUTHORIZED)
    async with connect(server.ws_url, additional_headers={"authorization": "Bearer x"}) as ws:
        await refused(ws, "unauthorized", CloseCode.UNAUTHORIZED)
    ways = [
        dict(additional_headers={"authorization": f"Bearer {KEYS[0]}"}),
        dict(subprotocols=[SUBPROTOCOL, f"intone.key.{KEYS[1]}"]),
        dict(uri=f"{server.ws_url}?api_key={KEYS[0]}"),
    ]
    for way in ways:
        uri = way.pop("uri", server.ws_url)
        async with connect(uri, **way) as ws:
            assert (await recv_event(ws))["type"] == "hello", way
            if "subprotocols" in way:
                assert ws.subprotocol == SUBPROTOCOL  # browsers need one selected
    async with IntoneClient(server.url, api_key=KEYS[1]) as client:
        assert await client.synthesize("Hi there.", options={"max_frames": 4})
    with pytest.raises(IntoneError) as info:
        await IntoneClient(server.url, api_key="wrong").connect()
    assert info.value.code == "unauthorized"


def test_key_comparison_labels_and_extraction():
    access = Access(KEYS)
    assert access.key_label(KEYS[1]) == "key2" and access.key_label("beta-key-") is None
    assert access.key_label("\udcff") is None  # undecodable junk never raises
    assert websocket_key({"sec-websocket-protocol": "intone.v1, intone.key.k"}, b"") == "k"
    assert websocket_key({}, b"x=1&api_key=q") == "q"
    assert websocket_key({"authorization": "Bearer h"}, b"api_key=q") == "h"


# ---- origins, hosts, CORS


@pytest.fixture(scope="module")
def guarded(tiny_checkpoint):
    settings = dict(
        allowed_origins=("https://app.example",), allowed_hosts=("localhost", "127.0.0.1")
    )
    with running_server(tiny_checkpoint, **settings) as (server, engine):
        yield server, engine


async def test_websocket_origins_and_hosts(guarded):
    server, _ = guarded
    async with connect(server.ws_url, origin="https://evil.example") as ws:
        await refused(ws, "origin_not_allowed", CloseCode.ORIGIN_NOT_ALLOWED)
    for origin in ("https://app.example", f"http://127.0.0.1:{server.port}", None):
        async with connect(server.ws_url, origin=origin) as ws:
            assert (await recv_event(ws))["type"] == "hello", origin
    # DNS rebinding: a public name that resolves to 127.0.0.1.
    rebound = f"ws://rebind.example:{server.port}/v1/stream"
    async with connect(rebound, host="127.0.0.1", port=server.port) as ws:
        await refused(ws, "origin_not_allowed", CloseCode.ORIGIN_NOT_ALLOWED)


async def test_http_origins_hosts_and_cors(guarded):
    server, _ = guarded
    url = f"{server.url}/v1/audio/speech"
    async with httpx.AsyncClient() as http:
        response = await http.post(url, json=SPEECH, headers={"origin": "https://evil.example"})
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "origin_not_allowed"
        response = await http.post(url, json=SPEECH, headers={"origin": "https://app.example"})
        assert response.status_code == 200 and response.content
        assert response.headers["access-control-allow-origin"] == "https://app.example"
        preflight = await http.options(
            url,
            headers={
                "origin": "https://app.example",
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 204
        assert "authorization" in preflight.headers["access-control-allow-headers"]
        response = await http.get(f"{server.url}/healthz", headers={"host": "rebind.example"})
        assert response.status_code == 403
        assert (await http.post(url, json=SPEECH)).status_code == 200  # no Origin: not a browser


# ---- limits


async def test_streams_and_characters_per_caller(tiny_checkpoint):
    limits = dict(max_streams_per_client=2, max_chars_per_minute=60)
    with running_server(tiny_checkpoint, **limits) as (server, engine):
        pages = idle_pages(engine)
        async with connect(server.ws_url) as ws, connect(server.ws_url) as other:
            await recv_event(ws)
            await recv_event(other)
            await send(ws, type="start", stream="a")
            await send(other, type="start", stream="b")  # same client address: same caller
            assert (await recv_event(ws))["type"] == "started"
            assert (await recv_event(other))["type"] == "started"
            await send(ws, type="start", stream="c")
            event = await recv_event(ws)
            assert (event["code"], event["final"], event["stream"]) == ("rate_limited", True, "c")
            assert event["retry_after"] > 0
            await send(ws, type="text", stream="a", text="x" * 50)
            await send(ws, type="text", stream="a", text="y" * 20)  # 70 > 60 per minute
            event = await recv_event(ws)
            assert (event["code"], event["final"]) == ("rate_limited", False)
            assert event["retry_after"] > 0
            async with httpx.AsyncClient() as http:
                response = await http.post(f"{server.url}/v1/audio/speech", json=SPEECH)
            assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1
            await send(ws, type="cancel", stream="a")
            await send(other, type="cancel", stream="b")
            await recv_until(ws, lambda e: e["type"] == "cancelled")
            await recv_until(other, lambda e: e["type"] == "cancelled")
        await wait_engine_idle(engine, pages)


async def test_connection_limit(tiny_checkpoint):
    with running_server(tiny_checkpoint, max_connections=2) as (server, _):
        async with connect(server.ws_url) as a, connect(server.ws_url) as b:
            await recv_event(a)
            await recv_event(b)
            async with connect(server.ws_url) as c:
                event = await refused(c, "too_many_connections", CloseCode.TOO_MANY_CONNECTIONS)
                assert event["retry_after"] > 0
            async with httpx.AsyncClient() as http:
                response = await http.post(f"{server.url}/v1/audio/speech", json=SPEECH)
                assert response.status_code == 429 and "retry-after" in response.headers
        async with connect(server.ws_url) as d:  # the slots came back
            assert (await recv_event(d))["type"] == "hello"


# ---- timeouts


async def test_slow_headers_and_bodies_are_cut(tiny_checkpoint):
    with running_server(tiny_checkpoint, header_timeout=0.5, body_timeout=0.5) as (server, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
        await writer.drain()
        started = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
        assert time.monotonic() - started < 4
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(
            b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"input":'
        )
        await writer.drain()
        response = await asyncio.wait_for(reader.read(4096), 5)
        assert response.startswith(b"HTTP/1.1 408"), response[:100]
        writer.close()


async def test_idle_connections_close(tiny_checkpoint):
    with running_server(tiny_checkpoint, ws_idle_timeout=0.6) as (server, _):
        async with connect(server.ws_url) as ws:
            await recv_event(ws)
            await refused(ws, "idle_timeout", CloseCode.IDLE_TIMEOUT)


async def test_stream_lifetime_ends_streams_and_cuts_raw_audio(tiny_checkpoint):
    # Paced to a real-time listener ("hold"): the 29 s of LONG_TEXT's audio take about that
    # long, where the watchdog (a round every 0.5 s) cuts within ~1 s. Unpaced, the tiny
    # engine renders it in ~1.1 s, and a round that came late let the request finish.
    with running_server(tiny_checkpoint, engine_config=LISTENER_PACED, max_stream_seconds=0.5) as (
        server,
        engine,
    ):
        pages = idle_pages(engine)
        async with connect(server.ws_url) as ws:
            await recv_event(ws)
            await send(ws, type="start", stream="s", text=LONG_TEXT)  # input never ends
            event, _ = await recv_until(ws, lambda e: e.get("final") or e["type"] == "done")
            assert (event["code"], event["stream"]) == ("stream_timeout", "s")
        request = {**SPEECH, "input": LONG_TEXT}
        async with httpx.AsyncClient(timeout=30) as http:
            with pytest.raises(httpx.RemoteProtocolError):  # no final chunk: visibly cut
                async with http.stream("POST", f"{server.url}/v1/audio/speech", json=request) as r:
                    assert r.status_code == 200
                    async for _ in r.aiter_bytes():
                        pass
            sse = {**request, "stream_format": "sse"}
            response = await http.post(f"{server.url}/v1/audio/speech", json=sse)
            last = json.loads(response.text.strip().split("\n\n")[-1].removeprefix("data: "))
            assert last["type"] == "error" and last["error"]["code"] == "stream_timeout"
        await wait_engine_idle(engine, pages)


# ---- what reaches responses and logs


async def test_header_values_are_refused_or_escaped_before_any_stream(tiny_checkpoint):
    with running_server(tiny_checkpoint) as (server, engine):
        pages = idle_pages(engine)
        url = f"{server.url}/v1/audio/speech"
        async with httpx.AsyncClient() as http:
            for model in ("a\r\nx-forged: 1", "\u0085", "x" * 200):
                response = await http.post(url, json={**SPEECH, "model": model})
                assert response.status_code == 400, model
            response = await http.post(url, json={**SPEECH, "model": "modèle-\u4e2d"})
            assert response.status_code == 200
            # A one-model server speaks any model name an OpenAI client sends with its model,
            # and the header names the model that served (never the client's raw value).
            assert response.headers["x-intone-model"] == server.app.state.intone.models[0].name
            body = '{"input": "a\\ud800b", "voice": "alloy"}'
            response = await http.post(url, content=body, headers=JSON)
            assert response.status_code == 400 and response.json()["error"]["code"] == "bad_text"
        await wait_engine_idle(engine, pages)
        assert engine.metrics()["active_requests"] == 0


def test_log_lines_escape_control_characters():
    record = logging.LogRecord("x", logging.INFO, "", 0, "error event: %s", ("a\nb\x1b[2J",), None)
    record.stream = "s\r\nforged=1"
    line = KeyValueFormatter().format(record)
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert "a\\nb" in line and "s\\r\\nforged=1" in line


def test_uvicorn_lines_about_client_mistakes_are_rate_limited():
    mistakes = ClientMistakeFilter(ClientErrorLog(per_second=1.0, burst=2))

    def access(status: int) -> logging.LogRecord:
        args = ("1.2.3.4:5", "GET", "/x", "1.1", status)
        line = '%s "%s %s HTTP/%s" %d'
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, line, args, None)

    assert all(mistakes.filter(access(200)) for _ in range(10))  # not mistakes: all kept
    kept = [mistakes.filter(access(400)) for _ in range(10)]
    assert kept == [True, True] + [False] * 8


def test_client_error_log_is_rate_limited():
    budget = ClientErrorLog(per_second=1.0, burst=3)
    allowed = [budget.allow() for _ in range(100)]
    assert allowed[:3] == [0, 0, 0] and all(a is None for a in allowed[3:])
    assert budget.suppressed == 97


def test_limits_bucket_streams_and_pruning(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("intone.provider.server.limits.time.monotonic", lambda: now[0])
    limits = Limits(ServerSettings(max_chars_per_minute=600, max_streams_per_client=1))
    limits.take_chars("k", 600)  # the whole minute at once
    with pytest.raises(LimitError) as info:
        limits.take_chars("k", 100)
    assert info.value.retry_after == pytest.approx(10.0)  # 10 characters a second
    now[0] += 10
    limits.take_chars("k", 100)
    with pytest.raises(LimitError) as info:
        limits.take_chars("other", 601)  # no wait would make it fit
    assert info.value.retry_after is None
    limits.open_stream("k")
    with pytest.raises(LimitError):
        limits.open_stream("k")
    limits.open_stream("other")  # callers are counted apart
    limits.close_stream("k")
    limits.close_stream("other")
    now[0] += 60  # buckets full again, nothing open: forgotten
    limits.prune()
    assert limits.tenants() == 0


async def test_fair_share_per_api_key(tiny_checkpoint):
    """One key's long streams hold at most --max-rows-per-tenant rows: another key's stream
    starts and finishes while they all still generate."""
    engine = make_engine(tiny_checkpoint, max_active=2, max_rows_per_tenant=1)
    app = create_app(engine, settings=ServerSettings(api_keys=KEYS))
    server = ServerThread(app).start()
    try:
        pages = idle_pages(engine)
        # EOS off: each clause runs to its frame budget (~70 frames for these). Forty clauses,
        # since the tiny model renders six in about a second (traced steps): a hog must outlast
        # the checks below.
        hog_options = {"eos_threshold": 1e9, "max_frames": 200}
        hog_text = " ".join(f"Clause number {i} is long." for i in range(40))
        async with (
            IntoneClient(server.url, api_key=KEYS[0]) as hog,
            IntoneClient(server.url, api_key=KEYS[1]) as other,
        ):
            hogs = [
                await hog.stream(text=hog_text, end=True, options=hog_options) for _ in range(3)
            ]
            # Three streams want rows, two are free, but one key may hold one.
            active = []
            for _ in range(20):
                active.append(engine.metrics()["active_requests"])
                await asyncio.sleep(0.05)
            assert max(active) == 1, active
            pcm = await asyncio.wait_for(other.synthesize("Hi.", options={"max_frames": 4}), 30)
            assert pcm
            assert not any(stream.done for stream in hogs)  # all three still generating
            for stream in hogs:
                await stream.cancel()
        await wait_engine_idle(engine, pages)
    finally:
        server.stop()
        engine.close()
