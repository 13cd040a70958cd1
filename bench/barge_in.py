"""Barge-in latency over the WebSocket protocol.

For each trial: start a long stream, wait until audio flows, send `cancel`, then measure

* ack:      cancel sent -> `cancelled` event received
* last:     cancel sent -> last audio byte of that stream received (0 if none followed)
* frames:   audio frames of that stream received after the cancel was sent
* state:    cancel sent -> the engine freed the stream's state (polling GET /stats: decoder rows
            back to the background load; with no background load, KV pages back to idle too)
* active:   cancel sent -> the stream no longer counts in `active_requests` (its admission slot)

Optionally with N background streams generating at the same time (--background N).

    python bench/barge_in.py --model DIR            # starts `intone serve` on a free port
    python bench/barge_in.py --url http://HOST:PORT # an already running server
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
from websockets.asyncio.client import ClientConnection, connect

from intone.provider.protocol import unpack_audio

LONG_TEXT = " ".join(
    f"This is sentence number {i} of a long answer that the user is about to interrupt."
    for i in range(60)
)


@contextlib.contextmanager
def serve(model: str) -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "intone.provider.cli", "serve", "--model", model]
    process = subprocess.Popen(
        command + ["--port", str(port), "--drain-timeout", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("intone serve did not start")
            time.sleep(0.1)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


async def engine_stats(http: httpx.AsyncClient, url: str) -> dict:
    return (await http.get(f"{url}/stats")).json()["engine"]


async def wait_released(
    http: httpx.AsyncClient, url: str, background: int, idle: dict | None, sent: float
) -> tuple[float, float]:
    """(state, slot): seconds from `sent` until the stream's decoder row (and, with no
    background load, its KV pages) was free, and until it stopped counting as active."""
    state = slot = None
    while state is None or slot is None:
        stats = await engine_stats(http, url)
        elapsed = time.perf_counter() - sent
        free = stats["decoder_states_in_use"] <= background
        if idle is not None:
            free = free and stats["kv_pages_in_use"] == idle["kv_pages_in_use"]
        if state is None and free:
            state = elapsed
        if slot is None and stats["active_requests"] <= background:
            slot = elapsed
        await asyncio.sleep(0.001)
    return state, slot


async def trial(
    ws: ClientConnection,
    http: httpx.AsyncClient,
    url: str,
    name: str,
    frames_before: int,
    background: int,
    idle: dict | None,
) -> dict:
    await ws.send(json.dumps({"type": "start", "stream": name, "text": LONG_TEXT, "end": True}))
    channel = None
    frames = 0
    while frames < frames_before:
        message = await ws.recv()
        if isinstance(message, str):
            event = json.loads(message)
            if event.get("stream") == name and event["type"] == "started":
                channel = event["channel"]
            elif event.get("stream") == name and event["type"] == "error":
                raise RuntimeError(event)
        elif unpack_audio(message)[0] == channel:
            frames += 1
    await ws.send(json.dumps({"type": "cancel", "stream": name}))
    sent = time.perf_counter()
    released = asyncio.create_task(wait_released(http, url, background, idle, sent))
    last = 0.0
    after = 0
    while True:
        message = await ws.recv()
        if isinstance(message, bytes):
            if unpack_audio(message)[0] == channel:
                last = time.perf_counter() - sent
                after += 1
            continue
        event = json.loads(message)
        if event.get("stream") == name and event["type"] == "cancelled":
            ack = time.perf_counter() - sent
            break
    state, slot = await released
    return {"ack": ack, "last": last, "frames": after, "state": state, "slot": slot}


async def keep_busy(url: str, count: int, stop: asyncio.Event) -> None:
    """`count` streams generating all the time, each restarted when it ends."""
    ws_url = url.replace("http", "ws", 1) + "/v1/stream"
    async with connect(ws_url, compression=None) as ws:
        await ws.recv()
        ids = iter(range(10**9))
        live = set()

        def start() -> str:
            name = f"bg{next(ids)}"
            live.add(name)
            return json.dumps({"type": "start", "stream": name, "text": LONG_TEXT, "end": True})

        for _ in range(count):
            await ws.send(start())
        while not stop.is_set():
            try:
                message = await asyncio.wait_for(ws.recv(), 0.1)
            except TimeoutError:
                continue
            if isinstance(message, str):
                event = json.loads(message)
                if event["type"] in ("done", "cancelled", "error") and event["stream"] in live:
                    live.discard(event["stream"])
                    await ws.send(start())


def summary(values: list[float], scale: float = 1000.0) -> str:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return (
        f"p50 {statistics.median(ordered) * scale:7.2f}  p95 {p95 * scale:7.2f}  "
        f"max {ordered[-1] * scale:7.2f}"
    )


async def run(url: str, trials: int, background: int, frames_before: int) -> dict:
    async with httpx.AsyncClient() as http:
        stats = await engine_stats(http, url)
        idle = {"kv_pages_in_use": stats["kv_pages_in_use"]} if background == 0 else None
        stop = asyncio.Event()
        busy = asyncio.create_task(keep_busy(url, background, stop)) if background else None
        if background:
            while (await engine_stats(http, url))["active_requests"] < background:
                await asyncio.sleep(0.05)
        results = []
        ws_url = url.replace("http", "ws", 1) + "/v1/stream"
        async with connect(ws_url, compression=None) as ws:
            await ws.recv()
            for i in range(trials):
                results.append(await trial(ws, http, url, f"t{i}", frames_before, background, idle))
        stop.set()
        if busy is not None:
            await busy
    return {
        "trials": trials,
        "background_streams": background,
        "ack_ms": [r["ack"] * 1000 for r in results],
        "last_audio_ms": [r["last"] * 1000 for r in results],
        "frames_after_cancel": [r["frames"] for r in results],
        "state_released_ms": [r["state"] * 1000 for r in results],
        "slot_released_ms": [r["slot"] * 1000 for r in results],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running intone server, http://HOST:PORT")
    where.add_argument("--model", help="checkpoint to start `intone serve` with")
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--background", type=int, nargs="+", default=[0, 4])
    parser.add_argument("--frames-before-cancel", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print raw results as JSON")
    args = parser.parse_args()

    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(serve(args.model))
        reports = [
            asyncio.run(run(url, args.trials, background, args.frames_before_cancel))
            for background in args.background
        ]
    if args.json:
        print(json.dumps(reports, indent=2))
        return
    for report in reports:
        print(f"\nbarge-in, {report['trials']} trials, {report['background_streams']} background")
        print(f"  cancel -> cancelled event   (ms) {summary(report['ack_ms'], 1)}")
        print(f"  cancel -> last audio byte   (ms) {summary(report['last_audio_ms'], 1)}")
        print(f"  cancel -> state released    (ms) {summary(report['state_released_ms'], 1)}")
        print(f"  cancel -> not active        (ms) {summary(report['slot_released_ms'], 1)}")
        frames = report["frames_after_cancel"]
        mean = statistics.mean(frames)
        print(f"  audio frames after cancel        mean {mean:.2f}  max {max(frames)}")


if __name__ == "__main__":
    main()
