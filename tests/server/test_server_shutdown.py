"""Graceful shutdown of a real `intone serve` process: SIGTERM drains instead of cutting streams."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from intone.provider.protocol import unpack_audio

from support.server import LONG_TEXT, recv_event, send

DRAIN_TIMEOUT = 3.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def serve_process(tiny_checkpoint, tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 - read back after the process ends
    process = subprocess.Popen(
        [
            sys.executable, "-m", "intone.provider.cli", "serve",
            "--model", str(tiny_checkpoint),
            "--port", str(port),
            "--drain-timeout", str(DRAIN_TIMEOUT),
            "--log-json",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            log.seek(0)
            pytest.fail(f"intone serve did not come up:\n{log.read()}")
        time.sleep(0.1)
    try:
        yield process, port, log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


async def test_sigterm_drains_streams_then_exits_zero(serve_process):
    process, port, log = serve_process
    url = f"http://127.0.0.1:{port}"
    async with connect(f"ws://127.0.0.1:{port}/v1/stream") as ws, httpx.AsyncClient() as http:
        assert (await recv_event(ws))["type"] == "hello"
        # One stream that can finish within the drain, one whose input never ends.
        await send(ws, type="start", stream="finishing", text=LONG_TEXT[:170])
        await send(ws, type="start", stream="open", text="Input that never ends. ")
        channels = {}
        while len(channels) < 2:
            event = await recv_event(ws)
            assert event["type"] == "started"
            channels[event["channel"]] = event["stream"]
        # An HTTP stream too, long enough to outlive the drain (minutes of audio).
        very_long = ((LONG_TEXT + " ") * 6)[:19_000]
        sse_request = {"input": very_long, "voice": "alloy", "stream_format": "sse"}
        sse_lines: list[str] = []

        async def read_sse() -> None:
            async with http.stream("POST", f"{url}/v1/audio/speech", json=sse_request) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        sse_lines.append(line)

        raw_bytes: list[int] = []

        async def read_raw() -> str:
            """A raw-audio response cut by the drain ends without its final chunk."""
            raw_request = {**sse_request, "stream_format": "audio", "response_format": "pcm"}
            try:
                async with http.stream("POST", f"{url}/v1/audio/speech", json=raw_request) as r:
                    async for chunk in r.aiter_bytes():
                        raw_bytes.append(len(chunk))
            except httpx.RemoteProtocolError:
                return "cut"
            return "complete"

        sse_task = asyncio.create_task(read_sse())
        raw_task = asyncio.create_task(read_raw())
        while not sse_lines or not raw_bytes:  # audio flows on every stream before the signal
            await asyncio.sleep(0.01)
        audio_seen = set()
        while len(audio_seen) < 2:
            message = await ws.recv()
            if isinstance(message, bytes):
                audio_seen.add(channels[unpack_audio(message)[0]])

        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        await send(ws, type="end", stream="finishing")  # in-flight streams still take input
        await asyncio.sleep(0.3)

        # New streams are refused with an event; new connections are not accepted.
        await send(ws, type="start", stream="late", text="Too late.", end=True)
        with pytest.raises(httpx.ConnectError):
            await http.get(f"{url}/healthz")

        finals: dict[str, dict] = {}
        errors = []
        try:
            while True:
                message = await ws.recv()
                if isinstance(message, bytes):
                    continue
                event = json.loads(message)
                if event["type"] in ("done", "cancelled"):
                    finals[event["stream"]] = event
                elif event["type"] == "error":
                    errors.append(event)
        except ConnectionClosed:
            pass
        assert ws.close_code == 1001, (ws.close_code, ws.close_reason)
        await asyncio.wait_for(sse_task, 10)
        assert await asyncio.wait_for(raw_task, 10) == "cut"

    assert finals["finishing"]["type"] == "done"
    assert finals["open"] == {"type": "cancelled", "stream": "open", "reason": "shutdown"}
    assert [(e["stream"], e["code"], e["final"]) for e in errors] == [
        ("late", "shutting_down", True)
    ]
    assert time.monotonic() - signalled >= DRAIN_TIMEOUT - 0.5
    last = json.loads(sse_lines[-1][len("data: ") :])
    assert last["type"] == "error" and last["error"]["code"] == "shutting_down"

    assert process.wait(timeout=20) == 0
    log.seek(0)
    lines = [json.loads(line) for line in log if line.startswith("{")]
    messages = [line["message"] for line in lines]
    assert any("drain" in m for m in messages)
    assert any(m.startswith("engine released") for m in messages)
    cancelled = [line for line in lines if line["message"] == "stream cancelled"]
    assert cancelled and all(line.get("request_id") for line in cancelled)
