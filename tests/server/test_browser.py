"""The demo page in a real headless Chromium, driven over the DevTools protocol (CDP).

CDP is spoken directly with the `websockets` package: no browser download, no Node. Chromium
comes from the system (Debian: `apt-get install -y chromium`; or set INTONE_CHROMIUM). When
INTONE_REQUIRE_BROWSER=1 (CI) a missing browser fails the test instead of skipping it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import threading
import time
import wave
from dataclasses import fields
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount
from websockets.asyncio.client import connect

from intone.provider.server import ServerSettings, create_app

from support.server import (
    LISTENER_PACED,
    LONG_TEXT,
    TEST_SETTINGS,
    ServerThread,
    idle_pages,
    make_engine,
    running_server,
    wait_engine_idle,
)

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
            # A fake microphone (a beep) that needs no permission prompt: the voice recorder.
            "--use-fake-device-for-media-stream",
            "--use-fake-ui-for-media-stream",
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
                # The status line and the log's tail first: a CI report may cut a long message.
                seen = await self.evaluate(
                    session,
                    "[(document.getElementById('status') || {}).textContent,"
                    " ((document.getElementById('log') || {}).textContent || '').slice(-800),"
                    " JSON.stringify(window.intone).slice(0, 2000)]",
                )
                raise AssertionError(f"timed out waiting for {expression}; page {seen}")
            await asyncio.sleep(0.05)

    async def click(self, session: str, element_id: str, selector: str | None = None) -> None:
        """A real mouse click at the element's centre (by id, or by a CSS selector), once the
        element is what a click there hits and has stayed put for two reads: the page's layout
        moves as it loads (the generated-weights banner, the voice list), and a click computed
        before such a shift lands on whatever moved under it."""
        find = (
            f"document.querySelector({json.dumps(selector)})"
            if selector
            else f"document.getElementById('{element_id}')"
        )
        where = (
            f"(() => {{ const e = {find}; e.scrollIntoView({{block: 'center'}});"
            " const r = e.getBoundingClientRect(), x = r.x + r.width / 2, y = r.y + r.height / 2;"
            " return e.contains(document.elementFromPoint(x, y)) ? [x, y] : null; })()"
        )
        deadline = time.monotonic() + 15
        box = await self.evaluate(session, where)
        while True:
            await asyncio.sleep(0.05)
            settled, box = box, await self.evaluate(session, where)
            if box is not None and box == settled:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"{element_id or selector} never settled under a click: {box}")
        for kind in ("mousePressed", "mouseReleased"):
            await self.send(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": box[0], "y": box[1], "button": "left", "clickCount": 1},
                session,
            )


async def new_page(cdp: Cdp, width: int = 980) -> str:
    """A blank tab of `width` CSS pixels, its session id."""
    target = await cdp.send("Target.createTarget", {"url": "about:blank"})
    attached = await cdp.send(
        "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
    )
    page = attached["sessionId"]
    await cdp.send("Runtime.enable", session=page)
    await cdp.send("Page.enable", session=page)
    await cdp.send(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False},
        page,
    )
    return page


async def open_page(cdp: Cdp, url: str, width: int = 980) -> str:
    """The demo at `url` in a new tab, once it is connected and has its voices."""
    page = await new_page(cdp, width)
    await navigate(cdp, page, url)
    return page


async def navigate(cdp: Cdp, page: str, url: str) -> None:
    """`page` to the demo at `url`, once it is connected and has its voices."""
    await cdp.send("Page.navigate", {"url": url}, page)
    await cdp.wait_for(page, "window.intone && window.intone.connected")
    await cdp.wait_for(page, "window.intone.voicesLoaded >= 1")


async def test_demo_page_streams_audio_and_stops(chromium_path, tiny_checkpoint, tmp_path):
    with running_server(tiny_checkpoint, engine_config=LISTENER_PACED) as (server, engine):
        pages = idle_pages(engine)
        with launch(chromium_path, str(tmp_path / "profile")) as browser_url:
            async with connect(browser_url, max_size=2**26) as ws:
                cdp = Cdp(ws)
                page = await open_page(cdp, f"{server.url}/")

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
    with running_server(tiny_checkpoint, engine_config=LISTENER_PACED, api_keys=("page-key",)) as (
        server,
        engine,
    ):
        pages = idle_pages(engine)
        with launch(chromium_path, str(tmp_path / "profile")) as browser_url:
            async with connect(browser_url, max_size=2**26) as ws:
                cdp = Cdp(ws)
                page = await new_page(cdp)
                await cdp.send("Page.navigate", {"url": f"{server.url}/"}, page)
                await cdp.wait_for(
                    page,
                    "(document.getElementById('status') || {}).textContent === "
                    "'unauthorized: enter the API key'",
                )
                await navigate(cdp, page, f"{server.url}/?key=page-key")
                await cdp.wait_for(page, "window.intone.lastStats !== undefined")
                await cdp.click(page, "speak")
                await cdp.wait_for(page, "window.intone.framesReceived >= 3")
                await cdp.click(page, "stop")
                await cdp.wait_for(page, "window.intone.cancelledEvents === 1")
                assert cdp.exceptions == [], cdp.exceptions
                cdp.reader.cancel()
        await wait_engine_idle(engine, pages)


# ---- the demo's panels

# Where the panels' screenshots go: INTONE_DEMO_SCREENSHOTS=docs/images refreshes the docs'
# (tests/test_browser.py is how they are made); otherwise a temporary folder.
SCREENSHOTS_ENV = "INTONE_DEMO_SCREENSHOTS"
TURN_TEXT = (
    "One two three, four five six. Seven eight nine, ten eleven twelve. "
    "Thirteen fourteen, fifteen sixteen."
)


async def screenshot(cdp: Cdp, page: str, panel: str, folder: Path) -> Path:
    """A PNG of one panel (a `section` by id), as the docs show it."""
    box = await cdp.evaluate(
        page,
        f"(() => {{ const e = document.getElementById('{panel}'); e.scrollIntoView();"
        " const r = e.getBoundingClientRect();"
        " return [r.x + scrollX, r.y + scrollY, r.width, r.height]; })()",
    )
    shot = await cdp.send(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": box[0], "y": box[1], "width": box[2], "height": box[3], "scale": 1},
        },
        page,
    )
    data = base64.b64decode(shot["data"])
    assert data.startswith(b"\x89PNG") and len(data) > 1000
    path = folder / f"demo-{panel.removeprefix('panel-')}.png"
    path.write_bytes(data)
    return path


def screenshot_folder(tmp_path: Path) -> Path:
    folder = Path(os.environ.get(SCREENSHOTS_ENV) or tmp_path / "shots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# The waveform canvas: how many of its columns hold a trace pixel away from the centre line.
WAVE_COLUMNS_OFF_CENTRE = """(() => {
  const c = document.getElementById('wave'), g = c.getContext('2d');
  const d = g.getImageData(0, 0, c.width, c.height).data;
  let columns = 0;
  for (let x = 0; x < c.width; x++) {
    for (let y = 0; y < c.height; y++) {
      if (Math.abs(y - c.height / 2) < 4) continue;
      const i = (y * c.width + x) * 4;
      if (d[i + 2] > 150 && d[i + 1] > 100) { columns++; break; }  // the trace's light blue
    }
  }
  return columns;
})()"""


async def test_demo_page_follows_the_audio_and_the_turn(chromium_path, tiny_checkpoint, tmp_path):
    """An LLM-typed turn: the waveform moves while audio plays, the words light up in order,
    the turn's times and its timeline (text, clause cuts and ends, first audio, barge-in)."""
    shots = screenshot_folder(tmp_path)
    with running_server(tiny_checkpoint) as (server, engine):
        pages = idle_pages(engine)
        with launch(chromium_path, str(tmp_path / "profile")) as browser_url:
            async with connect(browser_url, max_size=2**26) as ws:
                cdp = Cdp(ws)
                page = await open_page(cdp, f"{server.url}/")
                # Silent before any audio: a flat line.
                assert await cdp.evaluate(page, WAVE_COLUMNS_OFF_CENTRE) == 0
                await cdp.evaluate(
                    page,
                    f"document.getElementById('text').value = {json.dumps(TURN_TEXT)};"
                    "document.getElementById('tokens').checked = true;"
                    "document.getElementById('token-rate').value = '40';",
                )
                await cdp.click(page, "speak")
                # While audio plays the analyser's trace leaves the centre line.
                await cdp.wait_for(page, "window.intone.wavePeak > 0.01")
                columns = await cdp.wait_for(
                    page, f"({WAVE_COLUMNS_OFF_CENTRE}) > 50 && {WAVE_COLUMNS_OFF_CENTRE}"
                )
                assert columns > 50
                await cdp.wait_for(page, "window.intone.highlights.length >= 4")
                await screenshot(cdp, page, "panel-audio", shots)
                await cdp.wait_for(page, "window.intone.doneEvents === 1", timeout=30)
                # The words light up one after another, in the order they are spoken.
                await cdp.wait_for(
                    page,
                    "(() => { const t = window.intone.turns[0];"
                    " return t.lit === t.words.length - 1; })()",
                    timeout=20,
                )
                turn = await cdp.evaluate(
                    page,
                    "(() => { const t = window.intone.turns[0]; return {"
                    " words: t.words.map((w) => w.word), sent: t.sent.length,"
                    " clauses: t.clauses.length, ttfa: t.ttfaMs, metrics: t.metrics,"
                    " highlights: window.intone.highlights.map((h) => h.index) }; })()",
                )
                assert " ".join(turn["words"]) == TURN_TEXT
                assert turn["highlights"] == sorted(set(turn["highlights"]))
                assert len(turn["highlights"]) >= len(turn["words"]) // 2
                assert turn["highlights"][-1] == len(turn["words"]) - 1
                # First token to first audio, measured here, next to the engine's TTFA.
                row = await cdp.evaluate(
                    page,
                    "[...document.querySelectorAll('#turn-rows tr:first-child td')]"
                    ".map((td) => td.textContent)",
                )
                assert row[2] == "LLM, 40 tok/s" and row[-1] == "done"
                assert float(row[3]) == pytest.approx(turn["ttfa"], abs=1)
                assert row[5] == f"{turn['metrics']['ttfa'] * 1000:.0f}"
                assert row[4] == f"{turn['metrics']['server_ttfa'] * 1000:.0f}"
                # The timeline: a tick per token sent, a cut and a bar per clause, first audio.
                marks = await cdp.evaluate(
                    page,
                    "Object.fromEntries(['tick', 'cut', 'gen', 'play', 'first', 'barge']"
                    ".map((c) => [c, document.querySelectorAll('#timeline .' + c).length]))",
                )
                assert turn["sent"] > 10 and marks["tick"] == turn["sent"]
                assert marks["cut"] == marks["gen"] == marks["play"] == turn["clauses"] >= 4
                assert marks["first"] == 1 and marks["barge"] == 0
                await screenshot(cdp, page, "panel-turns", shots)

                # A second turn, stopped while it plays: the barge-in is on its timeline.
                await cdp.evaluate(
                    page,
                    f"document.getElementById('text').value = {json.dumps(LONG_TEXT)};"
                    "document.getElementById('token-rate').value = '60';",
                )
                await cdp.click(page, "speak")
                await cdp.wait_for(page, "window.intone.turns.length === 2")
                await cdp.wait_for(page, "window.intone.turns[1].clauses.length >= 3")
                await cdp.click(page, "stop")
                await cdp.wait_for(page, "window.intone.cancelledEvents === 1")
                assert (
                    await cdp.evaluate(page, "document.querySelectorAll('#timeline .barge').length")
                    == 1
                )
                await screenshot(cdp, page, "panel-timeline", shots)
                assert cdp.exceptions == [], cdp.exceptions
                cdp.reader.cancel()
        await wait_engine_idle(engine, pages)


def voices_route(url: str, key: str | None = None) -> int:
    """The status of `GET /v1/voices` on this build: 404 until the voices API is served."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{url}/v1/voices", headers=headers).status_code


async def test_demo_page_voice_picker(chromium_path, tiny_checkpoint, tmp_path):
    """The picker lists the served voices; upload, record and delete show only where the
    server has the voices API (a server without one answers 404 and the page hides them)."""
    with running_server(tiny_checkpoint) as (server, engine):
        has_api = voices_route(server.url) != 404
        health = httpx.get(f"{server.url}/healthz").json()
        with launch(chromium_path, str(tmp_path / "profile")) as browser_url:
            async with connect(browser_url, max_size=2**26) as ws:
                cdp = Cdp(ws)
                page = await open_page(cdp, f"{server.url}/")
                options = await cdp.evaluate(
                    page, "[...document.getElementById('voice').options].map((o) => o.value)"
                )
                assert set(health["voices"]) <= set(options)
                assert (
                    await cdp.evaluate(page, "document.getElementById('voice').value")
                    == (health["default_voice"])
                )
                # No build step, nothing from elsewhere: every resource is the server's own.
                origins = await cdp.evaluate(
                    page,
                    "performance.getEntriesByType('resource').map((r) => new URL(r.name).origin)",
                )
                assert set(origins) <= {server.url}
                managed = await cdp.evaluate(
                    page, "getComputedStyle(document.getElementById('voice-manage')).display"
                )
                assert (managed != "none") == has_api
                assert await cdp.evaluate(page, "window.intone.voicesApi") is has_api
                if not has_api:
                    # Without the API: the built-in voices, nothing to delete.
                    assert (
                        await cdp.evaluate(
                            page, "document.querySelectorAll('.voice-delete').length"
                        )
                        == 0
                    )
                    await screenshot(cdp, page, "panel-voices", screenshot_folder(tmp_path))
                assert cdp.exceptions == [], cdp.exceptions
                cdp.reader.cancel()


def reference_wav(path: Path, seconds: float = 3.0, rate: int = 24000) -> Path:
    """A voice sample: a gliding tone with some noise (not silence, well over 1 s)."""
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(0)
    signal = 0.3 * np.sin(2 * np.pi * (140 + 40 * t) * t) + 0.02 * rng.standard_normal(t.size)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((signal * 32767).astype("<i2").tobytes())
    return path


async def test_demo_page_uploads_records_and_deletes_voices(
    chromium_path, tiny_checkpoint, tmp_path
):
    """A file and a microphone recording uploaded from the page appear in the picker, a turn
    spoken with one uses it, and deleting it takes it out of the picker."""
    # Stored under a store folder where the server's settings name one (`--voice-store`).
    store = {f.name: tmp_path / "store" for f in fields(ServerSettings) if f.name == "voice_store"}
    with running_server(tiny_checkpoint, **store) as (server, engine):
        if voices_route(server.url) == 404:
            pytest.skip(
                "this build serves no /v1/voices (issue 50's voices API): nothing to upload"
            )
        pages = idle_pages(engine)
        sample = reference_wav(tmp_path / "brand.wav")
        with launch(chromium_path, str(tmp_path / "profile")) as browser_url:
            async with connect(browser_url, max_size=2**26) as ws:
                cdp = Cdp(ws)
                page = await open_page(cdp, f"{server.url}/")
                document = await cdp.send("DOM.getDocument", session=page)
                found = await cdp.send(
                    "DOM.querySelector",
                    {"nodeId": document["root"]["nodeId"], "selector": "#voice-file"},
                    page,
                )
                await cdp.send(
                    "DOM.setFileInputFiles",
                    {"files": [str(sample)], "nodeId": found["nodeId"]},
                    page,
                )
                await cdp.evaluate(page, "document.getElementById('voice-name').value = 'brand'")
                await cdp.click(page, "voice-upload")
                upload = await cdp.wait_for(page, "window.intone.lastUpload", timeout=60)
                assert upload["ok"], upload
                voice = upload["voice"]
                assert voice["name"] == "brand" and voice["seconds"] > 1
                listed = httpx.get(f"{server.url}/v1/voices").json()["voices"]
                assert voice["id"] in {v["id"] for v in listed}
                assert (
                    await cdp.evaluate(page, "document.getElementById('voice').value")
                    == (voice["id"])
                )
                # A turn in the uploaded voice.
                await cdp.click(page, "speak")
                await cdp.wait_for(page, "window.intone.doneEvents === 1", timeout=30)
                turn = await cdp.evaluate(page, "window.intone.turns[0]")
                assert turn["requestedVoice"] == voice["id"]
                assert turn["voice"] in (voice["id"], voice["name"])
                await screenshot(cdp, page, "panel-voices", screenshot_folder(tmp_path))

                # Recorded from the (fake) microphone: a beep, uploaded as WAV.
                await cdp.evaluate(page, "document.getElementById('voice-name').value = 'mic'")
                await cdp.click(page, "voice-record")
                await cdp.wait_for(page, "document.getElementById('recording').textContent")
                await asyncio.sleep(2.0)
                await cdp.click(page, "voice-record")
                await cdp.wait_for(
                    page, "window.intone.lastUpload.voice.name === 'mic'", timeout=60
                )

                # Delete the first: gone from the picker and the API.
                await cdp.click(page, "", selector=f".voice-delete[data-id={voice['id']!r}]")
                deleted = await cdp.wait_for(page, "window.intone.lastDelete")
                assert deleted["status"] == 204
                options = await cdp.evaluate(
                    page, "[...document.getElementById('voice').options].map((o) => o.value)"
                )
                assert voice["id"] not in options
                listed = httpx.get(f"{server.url}/v1/voices").json()["voices"]
                assert voice["id"] not in {v["id"] for v in listed}
                assert cdp.exceptions == [], cdp.exceptions
                cdp.reader.cancel()
        # The recorded voice is still stored: deleting it gives its pages back too.
        listed = httpx.get(f"{server.url}/v1/voices").json()["voices"]
        for stored in listed:
            if stored["name"] == "mic":
                assert httpx.delete(f"{server.url}/v1/voices/{stored['id']}").status_code == 204
        await wait_engine_idle(engine, pages)


# The load panel as shown, with the two /stats snapshots behind it; null until every figure
# has a value (a stream generating between the two polls).
LOAD_FIGURES = """(() => {
  const f = window.intone.loadFigures, text = (id) => document.getElementById(id).textContent;
  if (!f || f.margin === null || f.rowsPerStep === null || f.perStream === null) return null;
  return { previous: f.previous, current: f.current, seconds: f.seconds,
           shown: { aps: text('load-aps'), rows: text('load-rows'), margin: text('load-margin'),
                    perStream: text('load-rtf'), underruns: text('load-underruns'),
                    open: text('load-open') },
           underruns: window.intone.load.underruns, open: window.intone.load.open };
})()"""


def expected_load_figures(previous: dict, current: dict, seconds: float) -> dict[str, float | None]:
    """The load panel's figures from two /stats snapshots (None: shown as a dash)."""
    a, b = previous["engine"], current["engine"]
    steps = b["generate_batches"] - a["generate_batches"]
    rows = b["generate_batch_mean"] * b["generate_batches"]
    rows -= a["generate_batch_mean"] * a["generate_batches"]
    audio = max(0.0, b["audio_seconds"] - a["audio_seconds"]) / seconds
    return {
        "aps": audio,
        "rows": rows / steps if steps > 0 else None,
        "margin": b["stream_lead_seconds"].get("0"),
        "perStream": audio / b["streams_open"] if b["streams_open"] else None,
    }


def shown_as(text: str, value: float | None) -> bool:
    """The page shows `value` to two decimals (toFixed rounds ties up, Python to even)."""
    if value is None:
        return text == "–"
    return abs(float(text) - value) <= 0.005 + 1e-9


async def test_demo_page_load_panel_behind_a_prefix(chromium_path, tiny_checkpoint, tmp_path):
    """Mounted at /tts with API keys: the load panel opens N paced streams over the page's own
    connections and its figures are the ones /stats reports; closing them leaves nothing."""
    engine = make_engine(tiny_checkpoint, lead_s=1.0)
    tts = create_app(engine, settings=ServerSettings(**{**TEST_SETTINGS, "api_keys": ("k",)}))
    outer = Starlette(routes=[Mount("/tts", app=tts)])
    server = ServerThread(outer).start()
    stats_url, auth = f"{server.url}/tts/stats", {"authorization": "Bearer k"}
    try:
        pages = idle_pages(engine)
        with launch(chromium_path, str(tmp_path / "profile")) as browser_url:
            async with connect(browser_url, max_size=2**26) as ws:
                cdp = Cdp(ws)
                page = await open_page(cdp, f"{server.url}/tts/?key=k")
                assert await cdp.evaluate(page, "window.intone.weights") == "generated"
                await cdp.evaluate(page, "document.getElementById('load-n').value = '6'")
                await cdp.click(page, "load-start")
                # Six streams on two connections (at most 4 a connection here), generating.
                await cdp.wait_for(page, "window.intone.load.open === 6")
                await cdp.wait_for(
                    page,
                    "(() => { const f = window.intone.loadFigures; return f &&"
                    " f.current.engine.streams_open >= 3 && f.audioPerS > 0 &&"
                    " f.rowsPerStep !== null; })()",
                    timeout=20,
                )
                await asyncio.sleep(2.5)  # a few polls in, for the chart
                seen = await cdp.wait_for(page, LOAD_FIGURES)
                expected = expected_load_figures(seen["previous"], seen["current"], seen["seconds"])
                for name, value in expected.items():
                    assert shown_as(seen["shown"][name], value), (name, seen["shown"], expected)
                assert seen["shown"]["underruns"] == str(seen["underruns"])
                assert seen["shown"]["open"] == str(seen["open"]) == "6"
                # The snapshots the page shows are the server's: its counters only grow after.
                now = httpx.get(stats_url, headers=auth).json()
                for key in ("audio_seconds", "generate_batches", "requests_completed"):
                    assert now["engine"][key] >= seen["current"]["engine"][key]
                assert seen["current"]["engine"]["audio_seconds"] > 0
                assert (
                    now["engine"]["kv_pages_total"] == seen["current"]["engine"]["kv_pages_total"]
                )
                assert seen["current"]["server"]["connections"] >= 3  # the page's own three
                await screenshot(cdp, page, "panel-load", screenshot_folder(tmp_path))

                await cdp.click(page, "load-stop")
                await cdp.wait_for(page, "window.intone.load.open === 0")
                await wait_engine_idle(engine, pages)
                # Once idle, the page's latest snapshot and /stats agree on what finished.
                final = httpx.get(stats_url, headers=auth).json()["engine"]
                finished = final["requests_completed"] + final["requests_cancelled"]
                await cdp.wait_for(
                    page,
                    "(() => { const e = window.intone.lastStats.engine;"
                    f" return e.requests_completed + e.requests_cancelled === {finished}"
                    " && e.active_requests === 0; })()",
                )
                assert cdp.exceptions == [], cdp.exceptions
                cdp.reader.cancel()
        await wait_engine_idle(engine, pages)
    finally:
        server.stop()
        engine.close()
