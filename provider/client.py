"""Async Python client for `intone serve`: many concurrent TTS streams over one WebSocket.

Usage::

    from intone.provider.client import IntoneClient, IntoneError

    async with IntoneClient("ws://127.0.0.1:8000") as client:   # http:// works too
        # A stream: push text as it arrives (an LLM's tokens), then end it.
        stream = await client.stream(voice="default", sample_rate=16000, format="pcm_s16le")
        await stream.push_text("Hello there. ")
        await stream.push_text("How can I help?")
        await stream.end_input()
        async for pcm in stream:        # bytes, mono PCM in stream.format at stream.sample_rate
            play(pcm)
        print(stream.metrics)           # the server's per-request metrics (ttfa, rtf, ...)

        # Barge-in: no audio is yielded after cancel(); it returns once the server confirms
        # that the stream is over (engine state released).
        await stream.cancel()

        # One-shot: all the audio of a text, as PCM bytes.
        pcm = await client.synthesize("One shot.", voice="default", sample_rate=24000)

API summary:

* `IntoneClient(url, *, api_key=None, open_timeout=10.0)`: `await connect()` / `await close()`
  or `async with`. `api_key` (default: the `INTONE_API_KEY` environment variable) is sent as
  `Authorization: Bearer`; a server that refuses it raises `IntoneError` with code
  "unauthorized" from `connect()`. `hello` is the server's greeting (`protocol.HelloEvent`:
  model, version, sample rate, voices, limits).
  `await stream(voice=None, sample_rate=None, format="pcm_s16le", options=None, text=None,
  end=False)` starts a stream and returns once the server has accepted it (raises `IntoneError`
  with `.code`, e.g. "unknown_voice", if not). `await synthesize(text, ...) -> bytes`.
  Any number of streams may run at once on one client (up to the server's per-connection limit);
  the client is meant to be used from one asyncio event loop.
* Voices (over HTTP, no connection needed): `await add_voice(path_or_bytes, name=None,
  model=None) -> {"id", "name", "model", "seconds"}` uploads a voice (audio, or a voice-state
  .safetensors); its id works as `voice` anywhere. `await list_voices()`,
  `await delete_voice(id)`.
* `ClientStream`: `await push_text(text)`, `await flush()`, `await end_input()`,
  `await cancel(wait=True)`, `await playback(seconds)` (how much audio has been played, for
  playback-paced generation); `async for pcm in stream` yields audio bytes and raises
  `IntoneError` if the stream fails; `events()` yields audio bytes and typed events
  (`protocol.ClauseDoneEvent`, non-final `protocol.ErrorEvent`). After the end: `metrics`
  (dict), `clauses` (the `ClauseDoneEvent`s), `cancelled`, `errors` (`ErrorEvent`s).
  `sample_rate`, `format`, `request_id`, `voice` are set from the server's `started` event.
* Errors: `IntoneError(code, message, stream)`; `IntoneConnectionError` when the connection
  drops (every open stream raises it).
* `reconnect=True` (what the LiveKit and Pipecat remote modes use): when the connection drops,
  or the server's drain cancels a stream, the client connects again and restarts every stream
  that has had no audio yet on the new connection, replaying its text (a turn is never
  repeated once it has been heard); streams that had audio end with `IntoneConnectionError`
  at once. Behind a load balancer (Ray Serve) the new connection lands on a live replica.
  `reconnects` counts the new connections, `response_headers` are the last handshake's.

The wire protocol is documented in docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from intone.engine.errors import Kind
from intone.provider import protocol
from intone.provider.protocol import DEFAULT_FORMAT, WS_PATH, unpack_audio

logger = logging.getLogger(__name__)

__all__ = ["ClientStream", "IntoneClient", "IntoneConnectionError", "IntoneError", "ws_url"]


class IntoneError(Exception):
    """The server refused a request or a stream failed; `code` is the protocol's error code."""

    def __init__(self, code: str, message: str, stream: str | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.kind = protocol.code_kind(code)
        self.message = message
        self.stream = stream


class IntoneConnectionError(IntoneError, ConnectionError):
    """The WebSocket closed while streams were open."""

    def __init__(self, message: str, stream: str | None = None):
        super().__init__("connection_closed", message, stream)
        self.kind = Kind.CONNECTION


class IntoneTimeoutError(IntoneError, TimeoutError):
    """The server did not answer in time (it is alive enough to hold the connection)."""

    def __init__(self, message: str, stream: str | None = None):
        super().__init__("timeout", message, stream)
        self.kind = Kind.CONNECTION


def ws_url(url: str) -> str:
    """The WebSocket URL of a server given as ws(s):// or http(s)://, with or without a path."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss"):
        raise ValueError(f"expected a ws://, wss://, http:// or https:// URL, got {url!r}")
    path = parts.path if parts.path not in ("", "/") else WS_PATH
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


def http_url(url: str, path: str) -> str:
    """The HTTP URL of `path` on the server whose WebSocket URL is `url` (a path prefix, as
    behind a proxy, is kept)."""
    parts = urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    prefix = parts.path.removesuffix(WS_PATH).rstrip("/")
    return urlunsplit((scheme, parts.netloc, prefix + path, "", ""))


_END = object()  # queue sentinel: the stream is over (see ClientStream._final)
RECONNECT_ATTEMPTS = 3
RETRY_CLOSE_WAIT = 5.0  # s a drain-cancelled stream waits for the close that lets it retry


class ClientStream:
    """One TTS stream on a client connection."""

    def __init__(self, client: IntoneClient, stream_id: str, format: str):
        self._client = client
        self.id = stream_id
        self.format = format
        self.channel: int | None = None
        self.request_id: str | None = None
        self.voice: str | None = None
        self.model: str | None = None  # the served model's name
        self.sample_rate: int | None = None
        self.metrics: dict[str, Any] | None = None
        self.clauses: list[protocol.ClauseDoneEvent] = []
        self.errors: list[protocol.ErrorEvent] = []
        self.cancelled = False
        # Timing for barge-in measurements (time.perf_counter()).
        self.cancel_sent_at: float | None = None
        self.last_audio_at: float | None = None
        self.frames_received = 0
        self.frames_after_cancel = 0  # audio the server sent after our cancel (dropped)
        self._queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._started: asyncio.Future = loop.create_future()
        self._final: asyncio.Future = loop.create_future()
        self._cancel_requested = False
        self._input_ended = False
        # Messages that start this stream again on a new connection (start, text, flush, end),
        # kept until its first audio: a turn is only retried before anyone has heard it.
        self._replay: list[protocol.Message] | None = []
        self._replayed = 0  # how many of them the current connection was sent by a replay
        self._retry_timer: asyncio.TimerHandle | None = None

    @property
    def retryable(self) -> bool:
        """No audio yet, not cancelled, not over: it may start again on a new connection."""
        return self._replay is not None and not self._cancel_requested and not self._final.done()

    # ---- input

    async def push_text(self, text: str) -> None:
        if not isinstance(text, str):
            # As the engine's Stream.push_text: the server would answer a non-final bad_message.
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        await self._send(protocol.Text(self.id, text))

    async def flush(self) -> None:
        """End the current clause here, whatever its length."""
        await self._send(protocol.Flush(self.id))

    async def end_input(self) -> None:
        """No more text: the stream ends when its audio has been sent."""
        self._input_ended = True
        await self._send(protocol.End(self.id))

    async def playback(self, seconds: float) -> None:
        """Tell the server how many seconds of this stream's audio have been played: it then
        keeps generation no more than its buffer ahead of the listener."""
        await self._send(protocol.Playback(self.id, seconds))

    async def cancel(self, wait: bool = True, timeout: float = 10.0) -> None:
        """Stop now: iteration ends at once; with `wait`, return when the server confirms."""
        if self._final.done():
            return
        if not self._cancel_requested:
            self._cancel_requested = True
            self.cancel_sent_at = time.perf_counter()
            self._drop_queued_audio()
            self._queue.put_nowait(_END)
            with contextlib.suppress(IntoneConnectionError):
                await self._send(protocol.Cancel(self.id))
        if wait:
            with contextlib.suppress(IntoneError):
                await asyncio.wait_for(asyncio.shield(self._final), timeout)

    async def _send(self, message: protocol.Message) -> None:
        if self._final.done() and not isinstance(message, protocol.Cancel):
            raise IntoneError("stream_closed", f"stream {self.id} is over", self.id)
        if isinstance(message, protocol.Cancel):
            await self._client._send(message)
            return
        index = None
        if self._replay is not None:
            index = len(self._replay)
            self._replay.append(message)
        await self._client._send(message, self, index)

    # ---- output

    @property
    def done(self) -> bool:
        return self._final.done()

    async def wait(self) -> protocol.DoneEvent | protocol.CancelledEvent:
        """The stream's last event (`done` or `cancelled`); raises IntoneError on `error`."""
        return await asyncio.shield(self._final)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._audio()

    async def _audio(self) -> AsyncIterator[bytes]:
        async for item in self.events():
            if isinstance(item, bytes):
                yield item

    async def events(
        self,
    ) -> AsyncIterator[bytes | protocol.ClauseDoneEvent | protocol.ErrorEvent]:
        """Audio (bytes) and events (`ClauseDoneEvent`, non-final `ErrorEvent`) in order."""
        while True:
            item = await self._queue.get()
            if item is _END:
                self._queue.put_nowait(_END)  # later iterations end too
                if self._final.done() and not self._cancel_requested:
                    self._final.result()  # raises the stream's error, if any
                return
            yield item

    # ---- called by the client's reader

    def _on_audio(self, payload: bytes) -> None:
        self._replay = None  # heard: never retried from here on
        self.last_audio_at = time.perf_counter()
        self.frames_received += 1
        if self._cancel_requested:
            self.frames_after_cancel += 1
        else:
            self._queue.put_nowait(payload)

    def _on_event(self, event: protocol.Event) -> None:
        if isinstance(event, protocol.StartedEvent):
            self.channel = event.channel
            self.request_id = event.request_id
            self.voice = event.voice
            self.model = event.model
            self.sample_rate = event.sample_rate
            self.format = event.format
            if not self._started.done():
                self._started.set_result(event)
        elif isinstance(event, protocol.ClauseDoneEvent):
            self.clauses.append(event)
            if not self._cancel_requested:
                self._queue.put_nowait(event)
        elif (
            isinstance(event, protocol.CancelledEvent)
            and event.reason == "shutdown"
            and self._retry_later()
        ):
            return
        elif protocol.is_terminal(event) or (
            isinstance(event, protocol.ErrorEvent)
            and event.cause == protocol.Start.TYPE
            and not self._started.done()
        ):
            self._finish(event)
        elif isinstance(event, protocol.ErrorEvent):
            self.errors.append(event)
            logger.warning("stream %s: %s: %s", self.id, event.code, event.message)
            if not self._cancel_requested:
                self._queue.put_nowait(event)

    def _retry_later(self) -> bool:
        """The server's drain cancelled this stream before its first audio: with `reconnect`,
        it starts again once the server closes the connection (right after a drain); if the
        close does not come, it ends as cancelled after all."""
        if not (self._client.reconnect and self.retryable):
            return False
        if self._retry_timer is None:
            event = protocol.CancelledEvent(self.id, "shutdown")
            self._retry_timer = asyncio.get_running_loop().call_later(
                RETRY_CLOSE_WAIT, self._finish, event
            )
        return True

    def _finish(self, event: protocol.Event) -> None:
        if self._retry_timer is not None:
            self._retry_timer.cancel()
            self._retry_timer = None
        if self._final.done():
            return
        if isinstance(event, protocol.DoneEvent):
            self.metrics = event.metrics
            self._final.set_result(event)
        elif isinstance(event, protocol.CancelledEvent):
            self.cancelled = True
            self._final.set_result(event)
        elif isinstance(event, protocol.ErrorEvent):
            error = IntoneError(event.code, event.message, self.id)
            self.errors.append(event)
            self._final.set_exception(error)
            self._final.exception()  # marks it retrieved: callers may never await it
            if not self._started.done():
                self._started.set_exception(error)
                self._started.exception()
        self._queue.put_nowait(_END)

    def _fail(self, error: IntoneError) -> None:
        if self._retry_timer is not None:
            self._retry_timer.cancel()
            self._retry_timer = None
        for future in (self._started, self._final):
            if not future.done():
                future.set_exception(error)
                future.exception()
        self._queue.put_nowait(_END)

    def _drop_queued_audio(self) -> None:
        kept = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if not isinstance(item, bytes):
                kept.append(item)
        for item in kept:
            self._queue.put_nowait(item)


class IntoneClient:
    """A connection to an intone server carrying any number of concurrent streams.

    `open_timeout`: how long opening the connection, and then each stream on it, may wait for
    the server's answer (`hello`, `started`); past it they raise IntoneTimeoutError.
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        open_timeout: float = 10.0,
        reconnect: bool = False,
        http_timeout: float = 120.0,
    ):
        self.url = ws_url(url)
        self.http_timeout = http_timeout  # voice uploads wait for their encoding
        self.api_key = api_key if api_key is not None else os.environ.get("INTONE_API_KEY")
        self.open_timeout = open_timeout
        self.reconnect = reconnect
        self.reconnects = 0
        self.hello: protocol.HelloEvent | None = None
        self.response_headers: dict[str, str] = {}
        self._closing = False
        self._reconnecting: asyncio.Future | None = None
        self.errors: list[protocol.ErrorEvent] = []  # connection-level error events
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task | None = None
        self._streams: dict[str, ClientStream] = {}
        self._channels: dict[int, ClientStream] = {}
        self._ids = itertools.count()
        self._closed_error: IntoneConnectionError | None = None

    async def __aenter__(self) -> IntoneClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        await self._open()
        self._reader = asyncio.create_task(self._read(), name="intone-client-reader")

    async def _open(self) -> None:
        # Audio barely compresses and deflate costs latency: no permessage-deflate.
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        ws = await connect(
            self.url,
            open_timeout=self.open_timeout,
            compression=None,
            max_size=2**24,
            additional_headers=headers,
        )
        try:
            raw = await asyncio.wait_for(ws.recv(), self.open_timeout)
            hello = protocol.parse_event(raw) if isinstance(raw, str) else None
        except ValueError:
            hello = None
        except TimeoutError:
            await ws.close()
            raise IntoneTimeoutError(
                f"no hello from the server in {self.open_timeout:g} s"
            ) from None
        except BaseException:
            await ws.close()
            raise
        if isinstance(hello, protocol.ErrorEvent):  # refused: bad key, origin, limits
            await ws.close()
            raise IntoneError(hello.code, hello.message)
        if not isinstance(hello, protocol.HelloEvent):
            await ws.close()
            raise IntoneError("bad_message", "the server did not start with a hello event")
        self._ws = ws
        self.hello = hello
        self.response_headers = dict(ws.response.headers) if ws.response is not None else {}

    async def close(self) -> None:
        self._closing = True
        if self._ws is not None:
            await self._ws.close()
        while self._reconnecting is not None:
            await asyncio.shield(self._reconnecting)
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._fail_all("the client was closed")

    @property
    def sample_rate(self) -> int | None:
        """The model's native sample rate."""
        return self.hello.sample_rate if self.hello else None

    @property
    def voices(self) -> list[str]:
        return list(self.hello.voices) if self.hello else []

    async def stream(
        self,
        voice: str | None = None,
        sample_rate: int | None = None,
        format: str = DEFAULT_FORMAT,
        options: dict[str, Any] | None = None,
        text: str | None = None,
        end: bool = False,
        stream_id: str | None = None,
        model: str | None = None,
    ) -> ClientStream:
        """Start a stream; returns once the server accepted it, raises IntoneError if not.

        `model`: one of the server's models (`hello.models`) by name or alias; None: its default.
        """
        stream_id = stream_id or f"s{next(self._ids)}"
        if stream_id in self._streams:
            raise ValueError(f"stream id {stream_id!r} is in use on this client")
        stream = ClientStream(self, stream_id, format)
        self._streams[stream_id] = stream
        try:
            start = protocol.Start(
                stream_id,
                voice=voice,
                sample_rate=sample_rate,
                format=format,
                options=dict(options or {}),
                text=text,
                end=end,
                model=model,
            )
            assert stream._replay is not None
            stream._replay.append(start)
            await self._send(start, stream, 0)
            try:
                await asyncio.wait_for(asyncio.shield(stream._started), self.open_timeout)
            except TimeoutError:
                # A hung server keeps the socket open: without this the caller waits forever.
                await stream.cancel(wait=False)  # in case it starts later: free it there
                raise IntoneTimeoutError(
                    f"the server did not accept stream {stream_id} in {self.open_timeout:g} s",
                    stream_id,
                ) from None
        except BaseException:
            self._forget(stream)
            raise
        return stream

    async def synthesize(
        self,
        text: str,
        voice: str | None = None,
        sample_rate: int | None = None,
        format: str = DEFAULT_FORMAT,
        options: dict[str, Any] | None = None,
        model: str | None = None,
    ) -> bytes:
        """All the audio of `text` as PCM bytes."""
        stream = await self.stream(
            voice, sample_rate, format, options, text=text, end=True, model=model
        )
        try:
            return b"".join([pcm async for pcm in stream])
        except BaseException:
            await stream.cancel(wait=False)
            raise

    # ---- voices (HTTP: `POST/GET/DELETE /v1/voices`; no connection needed)

    async def add_voice(
        self, source: str | Path | bytes, *, name: str | None = None, model: str | None = None
    ) -> dict[str, Any]:
        """Upload a voice: an audio file (WAV, FLAC, MP3, OGG) or a voice-state .safetensors,
        as a path or its bytes. Returns `{"id", "name", "model", "seconds"}` once the server has
        encoded and prefilled it; the id then works as `voice` anywhere. Raises IntoneError
        with the server's code (bad_audio, voice_too_short, too_many_voices, ...)."""
        if isinstance(source, bytes):
            data, filename = source, "voice"
        else:
            path = Path(source).expanduser()
            data, filename = await asyncio.to_thread(path.read_bytes), path.name
        fields = {k: v for k, v in (("name", name), ("model", model)) if v is not None}
        response = await self._http(
            "POST",
            "/v1/voices",
            files={"file": (filename, data, "application/octet-stream")},
            data=fields,
        )
        return response.json()

    async def list_voices(self) -> list[dict[str, Any]]:
        """The server's shared voices and this key's own: `{"id", "name", "model", "seconds",
        "shared"}` each."""
        return (await self._http("GET", "/v1/voices")).json()["voices"]

    async def delete_voice(self, voice_id: str) -> None:
        """Delete one of this key's voices; streams using it finish with it."""
        await self._http("DELETE", f"/v1/voices/{quote(voice_id, safe='')}")

    async def _http(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            async with httpx.AsyncClient(timeout=self.http_timeout) as http:
                response = await http.request(
                    method, http_url(self.url, path), headers=headers, **kwargs
                )
        except httpx.TimeoutException as e:
            raise IntoneTimeoutError(f"{method} {path}: no answer in time") from e
        except httpx.HTTPError as e:
            raise IntoneConnectionError(f"{method} {path}: {e}") from e
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
                code, message = str(error["code"]), str(error["message"])
            except (ValueError, KeyError, TypeError):
                code, message = "internal_error", f"HTTP {response.status_code}"
            raise IntoneError(code, message)
        return response

    # ---- internals

    async def _send(
        self,
        message: protocol.Message,
        stream: ClientStream | None = None,
        index: int | None = None,
    ) -> None:
        """Send; `index`: the message's place in the stream's replay, if recorded there."""
        while self._reconnecting is not None:
            await asyncio.shield(self._reconnecting)
            if stream is not None and index is not None and index < stream._replayed:
                return  # the replay sent it on the new connection
        if self._closed_error is not None or self._ws is None:
            raise self._closed_error or IntoneConnectionError("not connected")
        try:
            await self._ws.send(protocol.encode_message(message))
        except ConnectionClosed as e:
            if self.reconnect and index is not None and stream is not None and stream.retryable:
                return  # the reader sees the close and replays the stream on a new connection
            raise IntoneConnectionError(f"connection closed: {e}") from e

    async def _read(self) -> None:
        assert self._ws is not None
        reason = "the connection closed"
        try:
            async for message in self._ws:
                if isinstance(message, bytes):
                    self._on_binary(message)
                else:
                    self._on_text(message)
        except ConnectionClosed as e:
            reason = f"the connection closed: {e}"
            if e.rcvd is None:  # e.g. a Ray Serve replica died: its proxy drops the socket
                reason += " (the server went away without closing the connection)"
        except Exception:  # a bug here must not leave streams hanging
            logger.exception("client reader failed")
            reason = "the client's reader failed"
        except BaseException:  # cancelled, or the loop is going away: no reconnecting
            self._closing = True
            raise
        finally:
            self._connection_lost(reason)

    def _connection_lost(self, reason: str) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # the reader was collected with its (closed) loop
            loop = None
        if not self.reconnect or self._closing or loop is None:
            self._fail_all(reason)
            return
        retry = 0
        for stream in list(self._streams.values()):
            if stream.retryable:
                stream._replayed = 0
                retry += 1
            else:
                stream._fail(IntoneConnectionError(reason, stream.id))
                self._forget(stream)
        self._channels.clear()
        logger.warning("%s; reconnecting (%d stream(s) to restart)", reason, retry)
        self._reconnecting = loop.create_future()
        loop.create_task(self._reconnect(reason, self._reconnecting))

    async def _reconnect(self, reason: str, done: asyncio.Future) -> None:
        """A new connection, then every stream without audio started again from its replay
        (streams started meanwhile too: their start waits in their replay)."""
        try:
            error: BaseException | None = None
            for attempt in range(RECONNECT_ATTEMPTS):
                if self._closing:
                    break
                try:
                    await self._open()
                    error = None
                    break
                except Exception as e:  # refused, 503 from a full proxy queue, timeout
                    error = e
                    await asyncio.sleep(0.25 * 2**attempt)
            if error is not None or self._closing:
                self._fail_all(f"{reason}; reconnecting failed: {error or 'client closed'}")
                return
            self.reconnects += 1
            self._reader = asyncio.create_task(self._read(), name="intone-client-reader")
            assert self._ws is not None
            replayed: set[str] = set()
            while todo := [
                s for s in self._streams.values() if s.retryable and s.id not in replayed
            ]:
                for stream in todo:
                    replayed.add(stream.id)
                    messages = stream._replay or []
                    # Messages pushed while this runs join the list and go out here too.
                    while stream._replayed < len(messages):
                        await self._ws.send(protocol.encode_message(messages[stream._replayed]))
                        stream._replayed += 1
                    if stream._retry_timer is not None:
                        stream._retry_timer.cancel()
                        stream._retry_timer = None
                    logger.info("stream %s restarted on a new connection", stream.id)
            for stream in list(self._streams.values()):
                if stream._cancel_requested and stream.id not in replayed:
                    # Cancelled while the connection was down: nothing to tell the server.
                    stream._finish(protocol.CancelledEvent(stream.id, "client"))
                    self._forget(stream)
        except ConnectionClosed:
            pass  # the new connection's reader sees it and starts over
        finally:
            if self._reconnecting is done:
                self._reconnecting = None
            done.set_result(None)

    def _on_binary(self, frame: bytes) -> None:
        try:
            channel, _sequence, payload = unpack_audio(frame)
        except ValueError:
            logger.warning("dropping a malformed binary frame of %d bytes", len(frame))
            return
        stream = self._channels.get(channel)
        if stream is not None:
            stream._on_audio(bytes(payload))

    def _on_text(self, message: str) -> None:
        try:
            event = protocol.parse_event(message)
        except ValueError as e:
            logger.warning("dropping a malformed event (%s): %.200r", e, message)
            return
        stream = self._streams.get(getattr(event, "stream", None) or "")
        if stream is None:
            if isinstance(event, protocol.ErrorEvent):
                self.errors.append(event)
                logger.warning("server error: %s: %s", event.code, event.message)
            return
        if isinstance(event, protocol.StartedEvent):
            self._channels[event.channel] = stream
        stream._on_event(event)
        if stream.done:
            self._forget(stream)

    def _forget(self, stream: ClientStream) -> None:
        if self._streams.get(stream.id) is stream:
            del self._streams[stream.id]
        if stream.channel is not None:
            self._channels.pop(stream.channel, None)

    def _fail_all(self, reason: str) -> None:
        if self._closed_error is None:
            self._closed_error = IntoneConnectionError(reason)
        for stream in list(self._streams.values()):
            stream._fail(IntoneConnectionError(reason, stream.id))
            self._forget(stream)
