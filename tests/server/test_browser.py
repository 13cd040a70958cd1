"""The demo page in a real headless Chromium, driven over the DevTools protocol (CDP).

CDP is spoken directly with the `websockets` package: no browser download, no Node. Chromium
comes from the system (Debian: `apt-get install -y chromium`; or set INTONE_CHROMIUM). When
INTONE_REQUIRE_BROWSER=1 (CI) a missing browser fails the test instead of skipping it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import threading
import time
from typing import Any

import pytest
from websockets.asyncio.client import connect

from support.server import LONG_TEXT, idle_pages, running_server, wait_engine_idle

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    explicit = os.environ.get("INTONE_CHROMIUM")
    if explicit:
        return explicit
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


@pytest.fixture(scope="module")
def chromium_path() -> str:
    path = find_chromium()
    if path is None:
        message = "no Chromium found (apt-get install -y chromium, or set INTONE_CHROMIUM)"
        if os.environ.get("INTONE_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


@contextlib.contextmanager
def launch(chromium: str, profile: str):
    """Headless Chromium with remote debugging on a free port; yields the browser's CDP URL."""
    process = subprocess.Popen(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--autoplay-policy=no-user-gesture-required",
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    found: list[str] = []
    output: list[str] = []

    def scan() -> None:  # Chromium prints its DevTools URL on stderr
        assert process.stderr is not None
        for line in process.stderr:
            output.append(line)
            if line.startswith("DevTools listening on ") and not found:
                found.append(line.split(" on ", 1)[1].strip())

    threading.Thread(target=scan, daemon=True).start()
    try:
        deadline = time.monotonic() + 30
        while not found:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("Chromium did not start:\n" + "".join(output[-30:]))
            time.sleep(0.05)
        yield found[0]
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Cdp:
    """A minimal CDP client over one browser connection, with flattened page sessions."""

    def __init__(self, ws: Any):
        self.ws = ws
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future] = {}
        self.exceptions: list[str] = []
        self.console: list[str] = []
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for raw in self.ws:
            message = json.loads(raw)
            if "id" in message:
                future = self.pending.pop(message["id"], None)
                if future is not None and not future.done():
                    future.set_result(message)
            elif message.get("method") == "Runtime.exceptionThrown":
                details = message["params"]["exceptionDetails"]
                self.exceptions.append(json.dumps(details)[:500])
            elif message.get("method") == "Runtime.consoleAPICalled":
                args = message["params"].get("args", [])
                self.console.append(
                    " ".join(str(a.get("value", a.get("description"))) for a in args)
                )

    async def send(self, method: str, params: dict | None = None, session: str | None = None):
        message_id = next(self.ids)
        message: dict[str, Any] = {"id": message_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        future = asyncio.get_running_loop().create_future()
        self.pending[message_id] = future
        await self.ws.send(json.dumps(message))
        reply = await asyncio.wait_for(future, 20)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    async def evaluate(self, session: str, expression: str) -> Any:
        result = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            session,
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, session: str, expression: str, timeout: float = 15.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(session, expression)
            if value:
                return value
            if time.monotonic() > deadline:
                state = await self.evaluate(session, "JSON.stringify(window.intone)")
                raise AssertionError(f"timed out waiting for {expression}; state {state}")
            await asyncio.sleep(0.05)

    async def click(self, session: str, element_id: str) -> None:
        """A real mouse click at the element's centre."""
        box = await self.evaluate(
            session,
            f"(() => {{ const r = document.getElementById('{element_id}')"
            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()",
        )
        for kind in ("mousePressed", "mouseReleased"):
            await self.send(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": box[0], "y": box[1], "button": "left", "clickCount": 1},
                session,
            )


async def test_demo_page_streams_audio_and_stops(chromium_path, tiny_checkpoint, tmp_path):
    with running_server(tiny_checkpoint) as (server, engine):
        pages = idle_pages(engine)
        with launch(chromium_path, str(tmp_path / "profile")) as browser_url:
            async with connect(browser_url, max_size=2**26) as ws:
                cdp = Cdp(ws)
                target = await cdp.send("Target.createTarget", {"url": "about:blank"})
                attached = await cdp.send(
                    "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
                )
                page = attached["sessionId"]
                await cdp.send("Runtime.enable", session=page)
                await cdp.send("Page.enable", session=page)
                await cdp.send("Page.navigate", {"url": f"{server.url}/"}, page)
                await cdp.wait_for(page, "window.intone && window.intone.connected")

                # Random weights: the page must say so.
                await cdp.wait_for(page, "window.intone.weights === 'generated'")
                banner = await cdp.evaluate(
                    page,
                    "[getComputedStyle(document.getElementById('banner')).display, "
                    "document.getElementById('banner').textContent]",
                )
                assert banner[0] != "none" and "random weights" in banner[1]

                # Type the text and press Speak.
                await cdp.evaluate(
                    page,
                    "(() => { const t = document.getElementById('text'); t.value = '';"
                    " t.focus(); })()",
                )
                await cdp.send("Input.insertText", {"text": LONG_TEXT}, page)
                assert await cdp.evaluate(page, "document.getElementById('text').value") == (
                    LONG_TEXT
                )
                await cdp.click(page, "speak")
                await cdp.wait_for(page, "window.intone.framesReceived >= 5")
                ttfa = await cdp.evaluate(page, "document.getElementById('ttfa').textContent")
                assert float(ttfa) > 0
                # Live engine stats are polled and shown.
                await cdp.wait_for(page, "window.intone.lastStats !== undefined")
                active = await cdp.wait_for(
                    page,
                    "(() => { const t = document.getElementById('active').textContent;"
                    " return t !== '–' && t; })()",
                )
                assert int(active) >= 0
                assert "/" in await cdp.evaluate(
                    page, "document.getElementById('pages').textContent"
                )

                # Stop (barge-in): the server confirms and the audio stops.
                await cdp.click(page, "stop")
                await cdp.wait_for(page, "window.intone.cancelledEvents === 1")
                frames = await cdp.evaluate(page, "window.intone.framesReceived")
                await asyncio.sleep(0.5)
                state = await cdp.evaluate(page, "window.intone")
                assert state["framesReceived"] == frames, "audio kept coming after stop"
                assert state["framesAfterCancelled"] == 0
                assert state["streaming"] is False
                assert state["errors"] == []
                await wait_engine_idle(engine, pages)

                # Speak again on the same page: the connection is still good.
                await cdp.click(page, "speak")
                await cdp.wait_for(page, "window.intone.framesReceived >= 3")
                await cdp.click(page, "stop")
                await cdp.wait_for(page, "window.intone.cancelledEvents === 2")
                assert cdp.exceptions == [], cdp.exceptions
                cdp.reader.cancel()
        await wait_engine_idle(engine, pages)


async def test_demo_page_takes_the_api_key(chromium_path, tiny_checkpoint, tmp_path):
    """With keys set, the page without one is told so (close 4401); with `?key=` it connects
    (the key as a WebSocket subprotocol), polls the stats (Bearer) and speaks."""
    with running_server(tiny_checkpoint, api_keys=("page-key",)) as (server, engine):
        pages = idle_pages(engine)
        with launch(chromium_path, str(tmp_path / "profile")) as browser_url:
            async with connect(browser_url, max_size=2**26) as ws:
                cdp = Cdp(ws)
                target = await cdp.send("Target.createTarget", {"url": "about:blank"})
                attached = await cdp.send(
                    "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
                )
                page = attached["sessionId"]
                await cdp.send("Runtime.enable", session=page)
                await cdp.send("Page.enable", session=page)
                await cdp.send("Page.navigate", {"url": f"{server.url}/"}, page)
                await cdp.wait_for(
                    page,
                    "(document.getElementById('status') || {}).textContent === "
                    "'unauthorized: enter the API key'",
                )
                await cdp.send("Page.navigate", {"url": f"{server.url}/?key=page-key"}, page)
                await cdp.wait_for(page, "window.intone && window.intone.connected")
                await cdp.wait_for(page, "window.intone.lastStats !== undefined")
                await cdp.click(page, "speak")
                await cdp.wait_for(page, "window.intone.framesReceived >= 3")
                await cdp.click(page, "stop")
                await cdp.wait_for(page, "window.intone.cancelledEvents === 1")
                assert cdp.exceptions == [], cdp.exceptions
                cdp.reader.cancel()
        await wait_engine_idle(engine, pages)
