"""Bad input on the WebSocket: each gets an error event with a code, and the connection and its
other streams keep working."""

from __future__ import annotations

import asyncio

import pytest
from websockets.asyncio.client import connect

from intone.provider.client import IntoneClient

from support.server import recv_event, recv_until, running_server, send


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    with running_server(tiny_checkpoint) as (server, engine):
        yield server, engine


@pytest.fixture
async def ws(served):
    """A connection with one healthy stream "good" open (input not ended)."""
    server, _ = served
    async with connect(server.ws_url, compression=None) as ws:
        assert (await recv_event(ws))["type"] == "hello"
        await send(ws, type="start", stream="good")
        assert (await recv_event(ws))["type"] == "started"
        yield ws
        # The healthy stream still works after whatever the test sent.
        await send(ws, type="text", stream="good", text="Still fine after that.")
        await send(ws, type="end", stream="good")
        done, seen = await recv_until(ws, lambda e: e["type"] in ("done", "error"))
        assert done["type"] == "done" and done["stream"] == "good", (done, seen)
        assert any(isinstance(m, tuple) for m in seen), "the healthy stream sent no audio"


async def expect_error(ws, code: str, stream: str | None = None, final: bool | None = None):
    event = await recv_event(ws)
    assert event["type"] == "error", event
    assert event["code"] == code, event
    assert event["stream"] == stream, event
    if final is not None:
        assert event["final"] is final, event
    assert event["message"]
    return event


async def test_malformed_json(ws):
    await ws.send('{"type": "text", "stream": "good", "text": ')
    await expect_error(ws, "bad_json")
    await ws.send("[1, 2]")
    await expect_error(ws, "bad_message")


async def test_unknown_message_type(ws):
    await send(ws, type="speak", stream="good", text="hi")
    event = await expect_error(ws, "unknown_type", stream="good", final=False)
    assert "start" in event["message"]


async def test_missing_or_bad_stream_id(ws):
    await send(ws, type="text", text="no stream id")
    await expect_error(ws, "bad_message")
    await send(ws, type="text", stream="x" * 65, text="too long an id")
    await expect_error(ws, "bad_message")


async def test_text_before_start(ws):
    await send(ws, type="text", stream="nostart", text="hello")
    event = await expect_error(ws, "unknown_stream", stream="nostart", final=False)
    assert event["cause"] == "text"
    for kind in ("flush", "end"):
        await send(ws, type=kind, stream="nostart")
        await expect_error(ws, "unknown_stream", stream="nostart")


async def test_binary_message(ws):
    await ws.send(b"\x00\x01\x02\x03")
    await expect_error(ws, "binary_not_accepted")


async def test_message_over_size_limit(ws):
    await send(ws, type="text", stream="good", text="a" * 5000)  # limit 4096 in these tests
    await expect_error(ws, "message_too_large")
    # Multi-byte characters count as bytes, not characters.
    await send(ws, type="text", stream="good", text="é" * 2100)
    await expect_error(ws, "message_too_large")


async def test_too_many_streams_on_one_connection(ws):
    for sid in ("s1", "s2", "s3"):  # with "good": the limit of 4
        await send(ws, type="start", stream=sid)
        assert (await recv_event(ws))["type"] == "started"
    await send(ws, type="start", stream="s4")
    event = await expect_error(ws, "too_many_streams", stream="s4", final=True)
    assert event["cause"] == "start"
    # Ending one frees a slot.
    await send(ws, type="cancel", stream="s1")
    assert (await recv_event(ws))["type"] == "cancelled"
    await send(ws, type="start", stream="s5")
    assert (await recv_event(ws))["type"] == "started"
    for sid in ("s2", "s3", "s5"):
        await send(ws, type="cancel", stream=sid)
        assert (await recv_event(ws))["type"] == "cancelled"


async def test_unknown_voice(ws):
    await send(ws, type="start", stream="v", voice="nobody")
    event = await expect_error(ws, "unknown_voice", stream="v", final=True)
    assert "default" in event["message"]
    await send(ws, type="start", stream="v2", voice=42)
    await expect_error(ws, "unknown_voice", stream="v2", final=True)


@pytest.mark.parametrize("rate", [0, 7999, 48001, 96000, "16000", 16000.5, True, None])
async def test_invalid_sample_rate(ws, rate):
    if rate is None:  # null means "the model's rate": valid
        await send(ws, type="start", stream="r", sample_rate=rate)
        started = await recv_event(ws)
        assert started["sample_rate"] == 24000
        await send(ws, type="cancel", stream="r")
        assert (await recv_event(ws))["type"] == "cancelled"
        return
    await send(ws, type="start", stream="r", sample_rate=rate)
    await expect_error(ws, "bad_sample_rate", stream="r", final=True)


async def test_bad_format_and_options(ws):
    await send(ws, type="start", stream="f", format="mp3")
    await expect_error(ws, "bad_format", stream="f", final=True)
    await send(ws, type="start", stream="o", options={"nonsense": 1})
    await expect_error(ws, "bad_options", stream="o", final=True)
    await send(ws, type="start", stream="o2", options={"temperature": 99.0})
    await expect_error(ws, "bad_options", stream="o2", final=True)
    await send(ws, type="start", stream="o3", options={"seed": "x"})
    await expect_error(ws, "bad_options", stream="o3", final=True)


async def test_reused_stream_id(ws):
    # The id of a live stream: refused, and the live stream is not affected.
    await send(ws, type="start", stream="good")
    event = await expect_error(ws, "stream_exists", stream="good", final=False)
    assert event["cause"] == "start"
    # The id of a finished stream: refused too (late messages must not reach a new stream).
    await send(ws, type="start", stream="once", text="Short.", end=True)
    await recv_until(ws, lambda e: e["type"] == "done")
    await send(ws, type="start", stream="once", text="Again.", end=True)
    await expect_error(ws, "stream_exists", stream="once", final=False)
    await send(ws, type="text", stream="once", text="late")
    await expect_error(ws, "stream_closed", stream="once", final=False)


async def test_empty_text(ws):
    await send(ws, type="text", stream="good", text="")
    await expect_error(ws, "empty_text", stream="good", final=False)
    # A one-shot start without text.
    await send(ws, type="start", stream="e1", end=True)
    await expect_error(ws, "empty_text", stream="e1", final=True)
    await send(ws, type="start", stream="e2", text="   ", end=True)
    await expect_error(ws, "empty_text", stream="e2", final=True)
    # Ending a stream that only ever got whitespace: over, with an error.
    await send(ws, type="start", stream="e3")
    assert (await recv_event(ws))["type"] == "started"
    await send(ws, type="text", stream="e3", text="  ")
    await send(ws, type="end", stream="e3")
    await expect_error(ws, "empty_text", stream="e3", final=True)


async def test_input_after_end(ws):
    await send(ws, type="start", stream="ended", text=" ".join(["Some words here."] * 20))
    assert (await recv_event(ws))["type"] == "started"
    await send(ws, type="end", stream="ended")
    await send(ws, type="text", stream="ended", text="more")
    event, _ = await recv_until(ws, lambda e: e["type"] == "error")
    assert event["code"] in ("stream_closed",) and event["stream"] == "ended"
    # The engine paces generation to playback speed: the rest takes its audio's duration.
    await recv_until(ws, lambda e: e["type"] == "done" and e["stream"] == "ended", timeout=60)


async def test_text_over_the_per_stream_limit(ws, served):
    _, engine = served
    limit = engine.config.max_text_chars
    await send(ws, type="start", stream="big")
    assert (await recv_event(ws))["type"] == "started"
    chunk = "word " * 800  # 4000 bytes, under the message limit
    for _ in range(limit // len(chunk)):
        await send(ws, type="text", stream="big", text=chunk)
    await send(ws, type="text", stream="big", text=chunk)
    event, _ = await recv_until(ws, lambda e: e["type"] == "error")
    assert event["code"] == "text_too_long" and event["final"] is False
    await send(ws, type="cancel", stream="big")
    await recv_until(ws, lambda e: e["type"] == "cancelled")


async def test_errors_do_not_disturb_other_connections(served):
    server, _ = served
    async with IntoneClient(server.url) as bystander, connect(server.ws_url) as bad:
        await recv_event(bad)
        stream = await bystander.stream()
        await stream.push_text("A bystander speaks while another connection misbehaves.")
        for raw in ("{", "[]", '{"type": "nope", "stream": "z"}'):
            await bad.send(raw)
        await bad.send(b"binary")
        await stream.end_input()
        audio = b"".join([pcm async for pcm in stream])
        assert audio and stream.metrics is not None
        codes = [(await recv_event(bad))["code"] for _ in range(4)]
        assert codes == ["bad_json", "bad_message", "unknown_type", "binary_not_accepted"]
        await asyncio.sleep(0)
