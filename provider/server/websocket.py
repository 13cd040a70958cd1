"""The WebSocket endpoint: many TTS streams per connection, multiplexed by stream id.

One reader (client messages, applied to engine streams in order), one pump task per stream
(engine events -> audio frames and events) and one writer (the only task that sends, so a
stream's audio, its clause events and its final event leave in the order they were queued).
After a stream is cancelled the writer drops any of its audio still queued, so no audio for it
follows the `cancelled` event.

Nothing waits on the client without a bound: a stream's pump stops taking audio from the engine
while `max_buffered_audio` seconds of it wait to be sent (or, with `playback` reports, while it
is that far ahead of the listener); a send that does not complete within `slow_client_timeout`
drops the connection (close 4409) and releases its streams; a stream paced by `playback`
reports that has waited that long on its listener with no new report ends with `slow_client`
(the engine gives it compute only nobody else needs past `lead_s` ahead of the last report,
and with pacing "hold" none, so it waits within the buffer); a
connection with no stream that sends nothing for `ws_idle_timeout` is closed (4408); a stream
older than `max_stream_seconds` ends with `stream_timeout`. The runtime's watchdog calls
`watch()` for the timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import deque
from typing import Any

from starlette.websockets import WebSocket, WebSocketState

from intone.engine import (
    AudioChunk,
    ClauseDone,
    Engine,
    EngineError,
    GenerationOptions,
    IdleTimeoutError,
)
from intone.engine import Stream as EngineStream
from intone.engine.audio import PcmEncoder
from intone.provider import protocol
from intone.provider.protocol import CloseCode, ErrorCode, ProtocolError
from intone.provider.server.access import websocket_key
from intone.provider.server.limits import LimitError
from intone.provider.server.logs import bind
from intone.provider.server.runtime import EngineUnavailableError, Runtime
from intone.provider.server.voice_store import owner_for

logger = logging.getLogger(__name__)

_CLOSE = object()  # outbox item: close the socket after what is queued before it
# Events (not audio) a connection may have waiting to be sent; past this the client is not
# reading them (e.g. it sends bad messages without reading the errors) and is dropped.
MAX_QUEUED_EVENTS = 1024


class WsStreamState:
    """The server's state of one protocol stream on a connection (`start` to its final event):
    its engine `Stream`, encoder, counters and the client's playback position."""

    def __init__(
        self,
        connection: Connection,
        stream_id: str,
        channel: int,
        engine_stream: EngineStream,
        voice: str,
        sample_rate: int,
        fmt: str,
        model_rate: int,
        max_text_chars: int,
    ):
        self.connection = connection
        self.id = stream_id
        self.channel = channel
        self.engine_stream = engine_stream
        self.voice = voice
        self.sample_rate = sample_rate
        self.format = fmt
        self.model_rate = model_rate
        self.max_text_chars = max_text_chars
        self.request_id = uuid.uuid4().hex[:16]
        self.encoder = PcmEncoder(model_rate, sample_rate, fmt)
        self.bytes_per_second = sample_rate * protocol.SAMPLE_FORMATS[fmt]
        self.log = bind(connection.log, request_id=self.request_id, stream=stream_id)
        self.started_at = time.perf_counter()
        self.first_text_at: float | None = None
        self.first_audio_at: float | None = None
        self.sequence = 0
        self.bytes_sent = 0
        self.chars = 0
        self.clause_samples = 0
        self.audio_seconds = 0.0  # handed to the writer so far
        self.queued_seconds = 0.0  # of that, still waiting in the outbox
        self.played_seconds: float | None = None  # from the client's `playback` messages
        self.reported_at: float | None = None  # when the last of them came
        self.held_since: float | None = None  # waiting on the listener since (see `watch`)
        self.room = asyncio.Event()  # set whenever the buffer may have room again
        self.input_ended = False
        self.cancelled = False  # no audio for it leaves the writer once set
        self.finished = False
        self.task: asyncio.Task | None = None

    def buffered(self) -> float:
        """Seconds of audio the client has not taken (or, with playback reports, not heard)."""
        unheard = self.unheard()
        return self.queued_seconds if unheard is None else max(self.queued_seconds, unheard)

    def unheard(self) -> float | None:
        """Seconds of audio sent past the listener's last reported position; None unreported."""
        if self.played_seconds is None:
            return None
        return self.audio_seconds - self.played_seconds

    def shutdown(self) -> None:
        """The drain's deadline passed: cancel with a final event."""
        self.connection.cancel_stream(self, reason="shutdown")

    def expire(self) -> None:
        self.connection.expire_stream(self)


class Connection:
    def __init__(self, websocket: WebSocket, runtime: Runtime):
        self.websocket = websocket
        self.runtime = runtime
        self.settings = runtime.settings
        self.id = uuid.uuid4().hex[:8]
        self.log = bind(logger, connection=self.id)
        self.streams: dict[str, WsStreamState] = {}
        self.tenant = _client_host(websocket)
        self.owner: str | None = None  # whose uploaded voices it may use (none without keys)
        self._reserved: set[str] = set()  # ids whose start is being processed
        self._recent: deque[str] = deque(maxlen=self.settings.remembered_stream_ids)
        self._recent_set: set[str] = set()
        self._channels = itertools.count(1)
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._queued_events = 0
        self._closed = asyncio.Event()
        self._closing = False  # a timeout is closing it: no more watching
        self._writer: asyncio.Task | None = None
        self._close_task: asyncio.Future | None = None  # held: a task nobody holds may vanish
        self._sending_since: float | None = None  # when the send in progress began
        self.last_message_at = time.perf_counter()
        offered = websocket.headers.get("sec-websocket-protocol", "")
        offered_names = {name.strip() for name in offered.split(",")}
        # A browser that offers subprotocols needs one selected, or it drops the connection.
        self.subprotocol = protocol.SUBPROTOCOL if protocol.SUBPROTOCOL in offered_names else None
        self.engine: Engine | None = None

    # ---- lifecycle

    async def run(self) -> None:
        runtime, headers = self.runtime, self.websocket.headers
        access = runtime.access
        if not access.host_allowed(headers) or not access.origin_allowed(headers):
            runtime.log_client_error(self.log, "connection refused: origin or host not allowed")
            await self._refuse(
                ErrorCode.ORIGIN_NOT_ALLOWED,
                "this origin (or host name) may not use the server: see --allowed-origins",
                CloseCode.ORIGIN_NOT_ALLOWED,
            )
            return
        key = websocket_key(headers, self.websocket.scope["query_string"])
        label = access.key_label(key)
        if access.keys_required and label is None:
            runtime.log_client_error(self.log, "connection refused: no valid API key")
            await self._refuse(
                ErrorCode.UNAUTHORIZED,
                "a valid API key is required: Authorization: Bearer KEY, the subprotocol "
                f"{protocol.KEY_SUBPROTOCOL_PREFIX}KEY, or ?api_key=KEY",
                CloseCode.UNAUTHORIZED,
            )
            return
        if label is not None:
            self.tenant = label
            self.owner = owner_for(key)  # its uploaded voices
            self.log = bind(self.log, key=label)
        try:
            runtime.limits.open_connection()
        except LimitError as e:
            runtime.log_client_error(self.log, "connection refused: too many connections")
            await self._refuse(e.code, e.message, CloseCode.TOO_MANY_CONNECTIONS, e.retry_after)
            return
        try:
            await self._serve()
        finally:
            runtime.limits.close_connection()

    async def _serve(self) -> None:
        try:
            self.engine = await self.runtime.ready()
        except EngineUnavailableError as e:
            await self._refuse(ErrorCode.ENGINE_ERROR, str(e), CloseCode.INTERNAL_ERROR)
            return
        if self.runtime.draining:  # where the listener stays open (mounted, hosted): refuse
            await self._refuse(ErrorCode.SHUTTING_DOWN, "shutting down", CloseCode.GOING_AWAY)
            return
        await self.websocket.accept(subprotocol=self.subprotocol)
        self.runtime.add_connection(self)
        self.log.info("connection opened", extra={"client": _client(self.websocket)})
        self._writer = asyncio.create_task(self._write(), name=f"intone-ws-writer-{self.id}")
        self._send_event(self._hello())
        try:
            await self._read()
        finally:
            self._closed.set()
            tasks = [s.task for s in self.streams.values() if s.task is not None]
            for stream in list(self.streams.values()):
                self._abandon(stream, "client disconnected")
            self._outbox.put_nowait(None)
            # wait(), not wait_for(): the writer may have been cancelled (a slow client), and
            # its CancelledError must not cut this cleanup short.
            await asyncio.wait({self._writer}, timeout=1.0)
            self._writer.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=1.0)
            self.runtime.remove_connection(self)
            self.log.info("connection closed")

    async def close(self, code: int, reason: str) -> None:
        """Close after everything queued so far has been sent (used by the drain)."""
        self._outbox.put_nowait((_CLOSE, (code, reason), 0.0))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._closed.wait(), 5.0)

    async def _refuse(
        self, code: ErrorCode, message: str, close: int, retry_after: float | None = None
    ) -> None:
        """Accept only to say why, then close: browsers see neither a handshake's status nor
        its body, but they do see this event and the close code."""
        self.runtime.metrics.error(str(code))
        await self.websocket.accept(subprotocol=self.subprotocol)
        event = protocol.ErrorEvent(code, message, retry_after=retry_after)
        await self.websocket.send_text(protocol.encode_event(event))
        await self.websocket.close(close, str(code))

    def watch(self, now: float) -> None:
        """Called by the runtime's watchdog: drop a client that stopped reading, end a stream
        whose listener stopped reporting playback, close a connection idle for too long."""
        if self._closing:
            return
        sending = self._sending_since
        timeout = self.settings.slow_client_timeout
        for stream in list(self.streams.values()):
            self._watch_playback(stream, now)
        if sending is not None and now - sending > timeout:
            self._drop_slow_client(f"no audio taken for {timeout:g} s")
        elif not self.streams and now - self.last_message_at > self.settings.ws_idle_timeout:
            self._closing = True
            self.log.info("closing an idle connection")
            self._error(
                ProtocolError(
                    ErrorCode.IDLE_TIMEOUT,
                    f"no message for {self.settings.ws_idle_timeout:g} s and no stream open",
                )
            )
            self._outbox.put_nowait((_CLOSE, (CloseCode.IDLE_TIMEOUT, "idle_timeout"), 0.0))

    def _watch_playback(self, stream: WsStreamState, now: float) -> None:
        """A stream paced by `playback` reports makes no audio while it is far ahead of the
        last one (the pump holds it `max_buffered_audio` ahead; with pacing "hold" the engine
        `lead_s` ahead):
        after `slow_client_timeout` held with no new report it ends with `slow_client`."""
        reported_at, ahead = stream.reported_at, stream.unheard()
        if reported_at is None or ahead is None:
            return  # unpaced, or paced by the engine's own clock: it moves on by itself
        if not (stream.engine_stream.held() or ahead > self.settings.max_buffered_audio):
            stream.held_since = None
            return
        if stream.held_since is None:
            stream.held_since = now
        timeout = self.settings.slow_client_timeout
        if now - max(stream.held_since, reported_at) <= timeout:
            return
        self._fail(stream)
        self._error(
            ProtocolError(
                ErrorCode.SLOW_CLIENT,
                f"no playback report for {timeout:g} s while {ahead:.1f} s ahead of the last",
                stream.id,
                final=True,
            )
        )

    def _drop_slow_client(self, why: str) -> None:
        """The client is not reading: release its streams now, then close (the close frame
        may wait behind unread data; websockets gives up and aborts after its close timeout)."""
        self._closing = True
        self.runtime.metrics.error(str(ErrorCode.SLOW_CLIENT))
        self.log.warning("dropping a slow client: %s", why, extra={"streams": len(self.streams)})
        for stream in list(self.streams.values()):
            self._abandon(stream, "slow client")
        if self._writer is not None:
            self._writer.cancel()
        self._close_task = asyncio.ensure_future(
            self._close_now(CloseCode.SLOW_CLIENT, "slow_client")
        )

    async def _close_now(self, code: int, reason: str) -> None:
        with contextlib.suppress(Exception):
            if self.websocket.application_state == WebSocketState.CONNECTED:
                await self.websocket.close(code, reason)

    def _hello(self) -> protocol.HelloEvent:
        engine = self.engine
        assert engine is not None and self.runtime.voices is not None
        return protocol.HelloEvent(
            connection=self.id,
            model=self.runtime.models[0].name,
            version=self.runtime.version,
            sample_rate=engine.sample_rate,
            voices=self.runtime.voices.known(),
            models=[served.describe() for served in self.runtime.models],
            default_voice=engine.default_voice,
            weights=engine.loaded.weights,
            limits=protocol.Limits(
                max_message_bytes=self.settings.max_message_bytes,
                max_streams=self.settings.max_streams_per_connection,
                max_text_chars=engine.config.max_text_chars,
                max_streams_per_client=self.settings.max_streams_per_client or None,
                max_chars_per_minute=self.settings.max_chars_per_minute or None,
                max_buffered_audio=self.settings.max_buffered_audio,
                slow_client_timeout=self.settings.slow_client_timeout,
                idle_timeout=self.settings.ws_idle_timeout,
                max_stream_seconds=self.settings.max_stream_seconds,
            ),
        )

    # ---- reading

    async def _read(self) -> None:
        limit = self.settings.max_message_bytes
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            self.last_message_at = time.perf_counter()
            text = message.get("text")
            if text is None:
                self._error(
                    ProtocolError(
                        ErrorCode.BINARY_NOT_ACCEPTED,
                        "binary messages are not accepted: send JSON text messages",
                    )
                )
                continue
            # Checked before parsing: a huge message must not cost a JSON parse.
            if len(text) > limit or len(text.encode("utf-8", "surrogatepass")) > limit:
                self._error(
                    ProtocolError(
                        ErrorCode.MESSAGE_TOO_LARGE,
                        f"message over the limit of {limit} bytes: send long text in several "
                        "`text` messages",
                    )
                )
                continue
            try:
                await self._handle(protocol.parse_message(text))
            except ProtocolError as e:
                self._error(e)
            except Exception:
                self.log.exception("failed to handle a message")
                self._error(ProtocolError(ErrorCode.INTERNAL_ERROR, "internal error"))

    async def _handle(self, message: protocol.Message) -> None:
        if isinstance(message, protocol.Start):
            await self._start(message)
        elif isinstance(message, protocol.Cancel):
            stream = self.streams.get(message.stream)
            if stream is not None:  # cancelling a finished stream is a no-op: they race
                self.cancel_stream(stream, reason="client")
        else:
            stream = self._active(message)
            if isinstance(message, protocol.Text):
                await self._push(stream, message.text)
            elif isinstance(message, protocol.Flush):
                self._flush(stream)
            elif isinstance(message, protocol.End):
                self._end(stream, "end")
            elif isinstance(message, protocol.Playback):
                stream.played_seconds = max(stream.played_seconds or 0.0, message.seconds)
                stream.reported_at = time.perf_counter()
                # The engine paces the stream's generation by the same position.
                stream.engine_stream.report_playback(stream.played_seconds)
                stream.room.set()

    def _active(self, message: protocol.Message) -> WsStreamState:
        kind = message.TYPE
        stream = self.streams.get(message.stream)
        if stream is not None:
            return stream
        if message.stream in self._recent_set:
            raise ProtocolError(
                ErrorCode.STREAM_CLOSED,
                f"stream {protocol.echo(message.stream)} is over",
                message.stream,
                cause=kind,
            )
        raise ProtocolError(
            ErrorCode.UNKNOWN_STREAM,
            f"no stream {protocol.echo(message.stream)} on this connection: send `start` first",
            message.stream,
            cause=kind,
        )

    # ---- starting

    async def _start(self, message: protocol.Start) -> None:
        sid = message.stream

        def refuse(code: ErrorCode, text: str, final: bool = True) -> ProtocolError:
            return ProtocolError(code, text, sid, final=final, cause="start")

        if sid in self.streams or sid in self._reserved or sid in self._recent_set:
            # Not final: the stream that owns the id (if still running) carries on.
            raise refuse(
                ErrorCode.STREAM_EXISTS,
                f"stream id {protocol.echo(sid)} was already used on this connection",
                final=False,
            )
        if self.runtime.draining:
            raise refuse(ErrorCode.SHUTTING_DOWN, "the server is shutting down: reconnect")
        if len(self.streams) + len(self._reserved) >= self.settings.max_streams_per_connection:
            raise refuse(
                ErrorCode.TOO_MANY_STREAMS,
                f"{self.settings.max_streams_per_connection} streams already open on this "
                "connection: end one or open another connection",
            )
        if message.end and not (message.text or "").strip():
            raise refuse(ErrorCode.EMPTY_TEXT, "a one-shot start (end: true) needs text")
        limits = self.runtime.limits
        try:
            limits.open_stream(self.tenant)
        except LimitError as e:
            error = refuse(e.code, e.message)
            error.retry_after = e.retry_after
            raise error from None
        self._reserved.add(sid)
        try:
            try:
                served = self.runtime.select(message.model)
                engine = served.engine
                assert engine is not None and served.voices is not None
                options = GenerationOptions(
                    **{
                        "chain_frames": engine.config.default_chain_frames,
                        "flow_steps": engine.config.flow_steps,
                        **message.options,
                    }
                )
                voice = await served.voices.resolve(message.voice, self.owner)
                if self._closed.is_set():
                    raise refuse(ErrorCode.STREAM_CLOSED, "the connection closed")
                # The caller is the engine's tenant: its fair share of rows is per caller.
                engine_stream = engine.stream(voice, options, tenant=self.tenant)
            except (EngineError, ValueError) as e:
                raise refuse(protocol.engine_error_code(e), str(e)) from None
        except BaseException:
            limits.close_stream(self.tenant)
            raise
        finally:
            self._reserved.discard(sid)
        stream = WsStreamState(
            self,
            sid,
            next(self._channels),
            engine_stream,
            voice,
            message.sample_rate or engine.sample_rate,
            message.format,
            engine.sample_rate,
            engine.config.max_text_chars,
        )
        self.streams[sid] = stream
        self.runtime.add_stream(stream)
        self._send_event(
            protocol.StartedEvent(
                sid,
                stream.channel,
                stream.request_id,
                voice,
                stream.sample_rate,
                stream.format,
                served.name,
            )
        )
        stream.log.info(
            "stream started",
            extra={
                "voice": voice,
                "model": served.name,
                "sample_rate": stream.sample_rate,
                "engine_request": engine_stream.id,
            },
        )
        stream.task = asyncio.create_task(self._pump(stream), name=f"intone-ws-{stream.request_id}")
        try:
            if message.text:
                await self._push(stream, message.text, cause="start")
            if message.end:
                self._end(stream, "start")
        except ProtocolError as e:
            # The stream exists now: a start whose text is refused ends it, with its final
            # event (a one-shot start would otherwise wait forever for an `end`).
            self._fail(stream)
            e.final = True
            raise

    # ---- input

    async def _push(self, stream: WsStreamState, text: str, cause: str = "text") -> None:
        def refuse(code: ErrorCode, detail: str) -> ProtocolError:
            return ProtocolError(code, detail, stream.id, cause=cause)

        if stream.input_ended:
            raise refuse(ErrorCode.STREAM_CLOSED, "input already ended: no more text")
        if text == "":
            raise refuse(ErrorCode.EMPTY_TEXT, "empty text")
        limit = stream.max_text_chars
        if stream.chars + len(text) > limit:
            raise refuse(
                ErrorCode.TEXT_TOO_LONG,
                f"text over the limit of {limit} characters per stream; this text was dropped",
            )
        try:
            self.runtime.limits.take_chars(self.tenant, len(text))
        except LimitError as e:
            error = refuse(e.code, e.message)
            error.retry_after = e.retry_after
            raise error from None
        try:
            await stream.engine_stream.push_long_text(text)
        except (EngineError, ValueError) as e:
            raise refuse(protocol.engine_error_code(e), str(e)) from None
        except RuntimeError as e:  # an untyped "no longer takes input"
            raise refuse(ErrorCode.STREAM_CLOSED, str(e)) from None
        stream.chars += len(text)
        if stream.first_text_at is None and text.strip():
            stream.first_text_at = time.perf_counter()

    def _flush(self, stream: WsStreamState) -> None:
        if stream.input_ended:
            raise ProtocolError(
                ErrorCode.STREAM_CLOSED, "input already ended", stream.id, cause="flush"
            )
        try:
            stream.engine_stream.flush()
        except (EngineError, ValueError) as e:
            code = protocol.engine_error_code(e)
            raise ProtocolError(code, str(e), stream.id, cause="flush") from None

    def _end(self, stream: WsStreamState, cause: str) -> None:
        if stream.input_ended:
            raise ProtocolError(
                ErrorCode.STREAM_CLOSED, "input already ended", stream.id, cause=cause
            )
        if stream.first_text_at is None:
            # Checked here, not left to the engine: nothing to say means no stream.
            self._fail(stream)
            raise ProtocolError(
                ErrorCode.EMPTY_TEXT,
                "no text to speak was sent",
                stream.id,
                final=True,
                cause=cause,
            )
        try:
            stream.engine_stream.end_input()
        except (EngineError, ValueError) as e:
            self._fail(stream)
            code = protocol.engine_error_code(e)
            raise ProtocolError(code, str(e), stream.id, final=True, cause=cause) from None
        stream.input_ended = True

    # ---- output

    async def _pump(self, stream: WsStreamState) -> None:
        """Engine events -> outbox, until the stream ends one way or another."""
        try:
            async for event in stream.engine_stream:
                if stream.finished:
                    break
                if isinstance(event, AudioChunk):
                    stream.clause_samples += len(event.samples)
                    self._send_audio(stream, stream.encoder.encode(event.samples))
                    await self._wait_for_room(stream)
                elif isinstance(event, ClauseDone):
                    self._send_event(self._clause_event(stream, event))
            if stream.finished:
                return
            self._send_audio(stream, stream.encoder.finish())
            metrics = self._metrics(stream)
            self._finish(stream, "done")
            self._send_event(protocol.DoneEvent(stream.id, metrics))
            stream.log.info("stream done", extra=_rounded(metrics))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # EngineError, or a bug: either way this stream is over
            if stream.finished:
                return
            # An idle timeout is the client's doing (it sent no text), not the server's fault.
            level = logging.INFO if isinstance(e, IdleTimeoutError) else logging.ERROR
            stream.log.log(level, "stream ended: %s", e, exc_info=not isinstance(e, EngineError))
            self._fail(stream)
            code = protocol.engine_error_code(e) if isinstance(e, EngineError) else None
            self._error(
                ProtocolError(
                    code or ErrorCode.ENGINE_ERROR,
                    f"generation failed: {e}",
                    stream.id,
                    final=True,
                )
            )

    async def _wait_for_room(self, stream: WsStreamState) -> None:
        """Hold the pump while the client has `max_buffered_audio` seconds not yet taken (or
        heard). Both ways of waiting forever are the watchdog's business: a writer stuck on
        the socket drops the connection, a listener that stops reporting ends the stream."""
        while not stream.finished and stream.buffered() > self.settings.max_buffered_audio:
            stream.room.clear()
            await stream.room.wait()

    def _send_audio(self, stream: WsStreamState, pcm: bytes) -> None:
        if not pcm or stream.cancelled:
            return
        if stream.first_audio_at is None:
            stream.first_audio_at = time.perf_counter()
            since = stream.first_text_at or stream.started_at
            self.runtime.metrics.first_audio("websocket", stream.first_audio_at - since)
        frame = protocol.pack_audio(stream.channel, stream.sequence, pcm)
        seconds = len(pcm) / stream.bytes_per_second
        stream.sequence += 1
        stream.bytes_sent += len(pcm)
        stream.audio_seconds += seconds
        stream.queued_seconds += seconds
        self._outbox.put_nowait((stream, frame, seconds))

    def _clause_event(self, stream: WsStreamState, event: ClauseDone) -> protocol.ClauseDoneEvent:
        audio_seconds = stream.clause_samples / stream.model_rate
        stream.clause_samples = 0
        return protocol.ClauseDoneEvent(
            stream=stream.id,
            clause=event.clause,
            text=event.text,
            frames=event.frames,
            audio_seconds=round(audio_seconds, 4),
            elapsed=round(time.perf_counter() - stream.started_at, 4),
            start=round(event.start_sample / stream.model_rate, 4),
            words=[
                protocol.WordTime(w.word, round(w.start, 4), round(w.end, 4)) for w in event.words
            ],
        )

    def _metrics(self, stream: WsStreamState) -> dict[str, Any]:
        metrics: dict[str, Any] = dict(stream.engine_stream.metrics.as_dict())
        since = stream.first_text_at or stream.started_at
        metrics.update(
            server_ttfa=None if stream.first_audio_at is None else stream.first_audio_at - since,
            wall_seconds=time.perf_counter() - stream.started_at,
            frames=stream.sequence,
            bytes=stream.bytes_sent,
            sample_rate=stream.sample_rate,
            format=stream.format,
        )
        return metrics

    # ---- ending

    def cancel_stream(self, stream: WsStreamState, reason: str) -> None:
        if stream.finished:
            return
        stream.cancelled = True
        stream.engine_stream.cancel()
        self._finish(stream, "cancelled" if reason == "client" else reason)
        self._send_event(protocol.CancelledEvent(stream.id, reason))
        stream.log.info("stream cancelled", extra={"reason": reason})

    def expire_stream(self, stream: WsStreamState) -> None:
        if stream.finished:
            return
        limit = self.settings.max_stream_seconds
        self._fail(stream, "timeout")
        self._error(
            ProtocolError(
                ErrorCode.STREAM_TIMEOUT,
                f"the stream outlived the server's limit of {limit:g} s",
                stream.id,
                final=True,
            )
        )

    def _abandon(self, stream: WsStreamState, why: str) -> None:
        """Nobody to tell (gone, or not reading): release the engine state."""
        if stream.finished:
            return
        stream.cancelled = True
        stream.engine_stream.cancel()
        self._finish(stream, "disconnected")
        stream.log.info("stream abandoned: %s", why)

    def _fail(self, stream: WsStreamState, outcome: str = "error") -> None:
        """The stream is over with an error (whose final event the caller sends)."""
        if stream.finished:
            return
        stream.cancelled = True
        stream.engine_stream.cancel()
        self._finish(stream, outcome)

    def _finish(self, stream: WsStreamState, outcome: str) -> None:
        stream.finished = True
        stream.room.set()  # a pump waiting for room sees the end
        self.streams.pop(stream.id, None)
        if len(self._recent) == self._recent.maxlen:
            self._recent_set.discard(self._recent[0])
        self._recent.append(stream.id)
        self._recent_set.add(stream.id)
        self.runtime.remove_stream(stream)
        self.runtime.limits.close_stream(self.tenant)
        self.runtime.metrics.stream_finished("websocket", outcome)

    # ---- writing

    def _send_event(self, event: protocol.Event) -> None:
        self._queued_events += 1
        if self._queued_events > MAX_QUEUED_EVENTS and not self._closing:
            self._drop_slow_client(f"{MAX_QUEUED_EVENTS} events not taken")
            return
        self._outbox.put_nowait((None, protocol.encode_event(event), 0.0))

    def _error(self, error: ProtocolError) -> None:
        if error.final and error.stream in self.streams:
            error.final = False  # an error about a message never ends another live stream
        self.runtime.metrics.error(str(error.code))
        self.runtime.log_client_error(
            self.log,
            f"error event: {error.message}",
            code=str(error.code),
            stream=error.stream,
            final=error.final,
        )
        self._send_event(error.event())

    async def _write(self) -> None:
        ws = self.websocket
        while True:
            item = await self._outbox.get()
            if item is None:
                return
            stream, data, seconds = item
            try:
                if stream is _CLOSE:
                    code, reason = data
                    if ws.application_state == WebSocketState.CONNECTED:
                        await ws.close(code, reason)
                    return
                if isinstance(data, bytes):
                    if stream.cancelled:
                        continue  # queued before the cancel: must not follow its event
                    self._sending_since = time.perf_counter()
                    await ws.send_bytes(data)
                else:
                    self._queued_events -= 1
                    self._sending_since = time.perf_counter()
                    await ws.send_text(data)
                self._sending_since = None
            except Exception as e:  # the client went away; the reader sees the disconnect
                self.log.debug("send failed: %s", e)
                return
            finally:
                if isinstance(stream, WsStreamState):
                    stream.queued_seconds -= seconds
                    stream.room.set()


async def websocket_endpoint(websocket: WebSocket, runtime: Runtime) -> None:
    await Connection(websocket, runtime).run()


def _client(websocket: WebSocket) -> str:
    client = websocket.client
    return f"{client.host}:{client.port}" if client else "?"


def _client_host(websocket: WebSocket) -> str:
    client = websocket.client
    return client.host if client else "?"


def _rounded(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}
