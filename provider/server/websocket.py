"""The WebSocket endpoint: many TTS streams per connection, multiplexed by stream id.

One reader (client messages, applied to engine streams in order), one pump task per stream
(engine events -> audio frames and events) and one writer (the only task that sends, so a
stream's audio, its clause events and its final event leave in the order they were queued).
After a stream is cancelled the writer drops any of its audio still queued, so no audio for it
follows the `cancelled` event.
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

from intone.engine import AudioChunk, ClauseDone, Engine, EngineError, GenerationOptions
from intone.engine import Stream as EngineStream
from intone.provider.server import protocol
from intone.provider.server.logs import bind
from intone.provider.server.pcm import PcmEncoder
from intone.provider.server.protocol import CloseCode, ErrorCode, ProtocolError
from intone.provider.server.runtime import EngineUnavailableError, Runtime, model_name

logger = logging.getLogger(__name__)

_CLOSE = object()  # outbox item: close the socket after what is queued before it


class WsStream:
    """Server-side state of one stream on a connection."""

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
    ):
        self.connection = connection
        self.id = stream_id
        self.channel = channel
        self.engine_stream = engine_stream
        self.voice = voice
        self.sample_rate = sample_rate
        self.format = fmt
        self.model_rate = model_rate
        self.request_id = uuid.uuid4().hex[:16]
        self.encoder = PcmEncoder(model_rate, sample_rate, fmt)
        self.log = bind(connection.log, request_id=self.request_id, stream=stream_id)
        self.started_at = time.perf_counter()
        self.first_text_at: float | None = None
        self.first_audio_at: float | None = None
        self.sequence = 0
        self.bytes_sent = 0
        self.chars = 0
        self.clause_samples = 0
        self.played_seconds = 0.0  # from the client's `playback` messages
        self.input_ended = False
        self.cancelled = False  # no audio for it leaves the writer once set
        self.finished = False
        self.task: asyncio.Task | None = None

    def shutdown(self) -> None:
        """The drain's deadline passed: cancel with a final event."""
        self.connection.cancel_stream(self, reason="shutdown")


class Connection:
    def __init__(self, websocket: WebSocket, runtime: Runtime):
        self.websocket = websocket
        self.runtime = runtime
        self.settings = runtime.settings
        self.id = uuid.uuid4().hex[:8]
        self.log = bind(logger, connection=self.id)
        self.streams: dict[str, WsStream] = {}
        self._reserved: set[str] = set()  # ids whose start is being processed
        self._recent: deque[str] = deque(maxlen=self.settings.remembered_stream_ids)
        self._recent_set: set[str] = set()
        self._channels = itertools.count(1)
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._closed = asyncio.Event()
        self.engine: Engine | None = None

    # ---- lifecycle

    async def run(self) -> None:
        try:
            self.engine = await self.runtime.ready()
        except EngineUnavailableError as e:
            await self._refuse(
                protocol.ErrorEvent(ErrorCode.ENGINE_ERROR, str(e)),
                CloseCode.INTERNAL_ERROR,
                "engine unavailable",
            )
            return
        if self.runtime.draining:  # where the listener stays open (mounted, hosted): refuse
            await self._refuse(
                protocol.ErrorEvent(ErrorCode.SHUTTING_DOWN, "shutting down"),
                CloseCode.GOING_AWAY,
                "server shutting down",
            )
            return
        await self.websocket.accept()
        self.runtime.add_connection(self)
        self.log.info("connection opened", extra={"client": _client(self.websocket)})
        writer = asyncio.create_task(self._write(), name=f"intone-ws-writer-{self.id}")
        self._send_event(self._hello())
        try:
            await self._read()
        finally:
            self._closed.set()
            tasks = [s.task for s in self.streams.values() if s.task is not None]
            for stream in list(self.streams.values()):
                self._abandon(stream)
            self._outbox.put_nowait(None)
            with contextlib.suppress(asyncio.TimeoutError, Exception):
                await asyncio.wait_for(writer, 1.0)
            writer.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=1.0)
            self.runtime.remove_connection(self)
            self.log.info("connection closed")

    async def close(self, code: int, reason: str) -> None:
        """Close after everything queued so far has been sent (used by the drain)."""
        self._outbox.put_nowait((_CLOSE, (code, reason)))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._closed.wait(), 5.0)

    async def _refuse(self, event: protocol.ErrorEvent, code: int, reason: str) -> None:
        """Accept only to say why, then close: browsers see neither a handshake's status nor
        its body, but they do see this event and the close code."""
        await self.websocket.accept()
        await self.websocket.send_text(protocol.encode_event(event))
        await self.websocket.close(code, reason)

    def _hello(self) -> protocol.HelloEvent:
        engine = self.engine
        assert engine is not None and self.runtime.voices is not None
        return protocol.HelloEvent(
            connection=self.id,
            model=model_name(engine.loaded.source),
            version=self.runtime.version,
            sample_rate=engine.sample_rate,
            voices=self.runtime.voices.known(),
            default_voice=engine.default_voice,
            weights=engine.loaded.weights,
            limits=protocol.Limits(
                max_message_bytes=self.settings.max_message_bytes,
                max_streams=self.settings.max_streams_per_connection,
                max_text_chars=engine.config.max_text_chars,
            ),
        )

    # ---- reading

    async def _read(self) -> None:
        limit = self.settings.max_message_bytes
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
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
            if len(text) > limit or len(text.encode("utf-8")) > limit:
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
                self._push(stream, message.text)
            elif isinstance(message, protocol.Flush):
                self._flush(stream)
            elif isinstance(message, protocol.End):
                self._end(stream, "end")
            elif isinstance(message, protocol.Playback):
                stream.played_seconds = max(stream.played_seconds, message.seconds)

    def _active(self, message: protocol.Message) -> WsStream:
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
        engine = self.engine
        assert engine is not None and self.runtime.voices is not None
        self._reserved.add(sid)
        try:
            try:
                options = GenerationOptions(
                    **{
                        "chain_frames": engine.config.default_chain_frames,
                        "flow_steps": engine.config.flow_steps,
                        **message.options,
                    }
                )
                voice = await self.runtime.voices.resolve(message.voice)
                if self._closed.is_set():
                    return
                engine_stream = engine.stream(voice, options)
            except (EngineError, ValueError) as e:
                raise refuse(protocol.engine_error_code(e), str(e)) from None
        finally:
            self._reserved.discard(sid)
        stream = WsStream(
            self,
            sid,
            next(self._channels),
            engine_stream,
            voice,
            message.sample_rate or engine.sample_rate,
            message.format,
            engine.sample_rate,
        )
        self.streams[sid] = stream
        self.runtime.add_stream(stream)
        self._send_event(
            protocol.StartedEvent(
                sid, stream.channel, stream.request_id, voice, stream.sample_rate, stream.format
            )
        )
        stream.log.info(
            "stream started",
            extra={
                "voice": voice,
                "sample_rate": stream.sample_rate,
                "engine_request": engine_stream.id,
            },
        )
        stream.task = asyncio.create_task(self._pump(stream), name=f"intone-ws-{stream.request_id}")
        try:
            if message.text:
                self._push(stream, message.text, cause="start")
            if message.end:
                self._end(stream, "start")
        except ProtocolError as e:
            # The stream exists now: a start whose text is refused ends it, with its final
            # event (a one-shot start would otherwise wait forever for an `end`).
            self._fail(stream)
            e.final = True
            raise

    # ---- input

    def _push(self, stream: WsStream, text: str, cause: str = "text") -> None:
        def refuse(code: ErrorCode, detail: str) -> ProtocolError:
            return ProtocolError(code, detail, stream.id, cause=cause)

        if stream.input_ended:
            raise refuse(ErrorCode.STREAM_CLOSED, "input already ended: no more text")
        if text == "":
            raise refuse(ErrorCode.EMPTY_TEXT, "empty text")
        assert self.engine is not None
        limit = self.engine.config.max_text_chars
        if stream.chars + len(text) > limit:
            raise refuse(
                ErrorCode.TEXT_TOO_LONG,
                f"text over the limit of {limit} characters per stream; this text was dropped",
            )
        try:
            stream.engine_stream.push_text(text)
        except (EngineError, ValueError) as e:
            raise refuse(protocol.engine_error_code(e), str(e)) from None
        except RuntimeError as e:  # an untyped "no longer takes input"
            raise refuse(ErrorCode.STREAM_CLOSED, str(e)) from None
        stream.chars += len(text)
        if stream.first_text_at is None and text.strip():
            stream.first_text_at = time.perf_counter()

    def _flush(self, stream: WsStream) -> None:
        if stream.input_ended:
            raise ProtocolError(
                ErrorCode.STREAM_CLOSED, "input already ended", stream.id, cause="flush"
            )
        try:
            stream.engine_stream.flush()
        except (EngineError, ValueError) as e:
            code = protocol.engine_error_code(e)
            raise ProtocolError(code, str(e), stream.id, cause="flush") from None

    def _end(self, stream: WsStream, cause: str) -> None:
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

    async def _pump(self, stream: WsStream) -> None:
        """Engine events -> outbox, until the stream ends one way or another."""
        try:
            async for event in stream.engine_stream:
                if stream.finished:
                    break
                if isinstance(event, AudioChunk):
                    stream.clause_samples += len(event.samples)
                    self._send_audio(stream, stream.encoder.encode(event.samples))
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
            stream.log.error("stream failed: %s", e, exc_info=not isinstance(e, EngineError))
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

    def _send_audio(self, stream: WsStream, pcm: bytes) -> None:
        if not pcm or stream.cancelled:
            return
        if stream.first_audio_at is None:
            stream.first_audio_at = time.perf_counter()
            since = stream.first_text_at or stream.started_at
            self.runtime.metrics.first_audio("websocket", stream.first_audio_at - since)
        frame = protocol.pack_audio(stream.channel, stream.sequence, pcm)
        stream.sequence += 1
        stream.bytes_sent += len(pcm)
        self._outbox.put_nowait((stream, frame))

    def _clause_event(self, stream: WsStream, event: ClauseDone) -> protocol.ClauseDoneEvent:
        audio_seconds = stream.clause_samples / stream.model_rate
        stream.clause_samples = 0
        return protocol.ClauseDoneEvent(
            stream=stream.id,
            clause=event.clause,
            text=event.text,
            frames=event.frames,
            audio_seconds=round(audio_seconds, 4),
            elapsed=round(time.perf_counter() - stream.started_at, 4),
        )

    def _metrics(self, stream: WsStream) -> dict[str, Any]:
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

    def cancel_stream(self, stream: WsStream, reason: str) -> None:
        if stream.finished:
            return
        stream.cancelled = True
        stream.engine_stream.cancel()
        self._finish(stream, "cancelled" if reason == "client" else reason)
        self._send_event(protocol.CancelledEvent(stream.id, reason))
        stream.log.info("stream cancelled", extra={"reason": reason})

    def _abandon(self, stream: WsStream) -> None:
        """The client went away: release the engine state, nobody to tell."""
        if stream.finished:
            return
        stream.cancelled = True
        stream.engine_stream.cancel()
        self._finish(stream, "disconnected")
        stream.log.info("stream abandoned: client disconnected")

    def _fail(self, stream: WsStream) -> None:
        """The stream is over with an error (whose final event the caller sends)."""
        if stream.finished:
            return
        stream.cancelled = True
        stream.engine_stream.cancel()
        self._finish(stream, "error")

    def _finish(self, stream: WsStream, outcome: str) -> None:
        stream.finished = True
        self.streams.pop(stream.id, None)
        if len(self._recent) == self._recent.maxlen:
            self._recent_set.discard(self._recent[0])
        self._recent.append(stream.id)
        self._recent_set.add(stream.id)
        self.runtime.remove_stream(stream)
        self.runtime.metrics.stream_finished("websocket", outcome)

    def _send_event(self, event: protocol.Event) -> None:
        self._outbox.put_nowait((None, protocol.encode_event(event)))

    def _error(self, error: ProtocolError) -> None:
        if error.final and error.stream in self.streams:
            error.final = False  # an error about a message never ends another live stream
        self.runtime.metrics.error(str(error.code))
        self.log.info(
            "error event: %s",
            error.message,
            extra={"code": str(error.code), "stream": error.stream, "final": error.final},
        )
        self._send_event(error.event())

    async def _write(self) -> None:
        ws = self.websocket
        while True:
            item = await self._outbox.get()
            if item is None:
                return
            stream, data = item
            try:
                if stream is _CLOSE:
                    code, reason = data
                    if ws.application_state == WebSocketState.CONNECTED:
                        await ws.close(code, reason)
                    return
                if isinstance(data, bytes):
                    if stream is not None and stream.cancelled:
                        continue  # queued before the cancel: must not follow its event
                    await ws.send_bytes(data)
                else:
                    await ws.send_text(data)
            except Exception as e:  # the client went away; the reader sees the disconnect
                self.log.debug("send failed: %s", e)
                return


async def websocket_endpoint(websocket: WebSocket, runtime: Runtime) -> None:
    await Connection(websocket, runtime).run()


def _client(websocket: WebSocket) -> str:
    client = websocket.client
    return f"{client.host}:{client.port}" if client else "?"


def _rounded(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}
