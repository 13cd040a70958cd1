"""OpenAI-compatible `POST /v1/audio/speech`, streamed as the audio is generated.

Clients written for OpenAI's speech API (the `openai` package, LiveKit's and Pipecat's OpenAI
TTS plugins) work unchanged with `base_url=http://HOST:PORT/v1`. What the fields mean here:

* `model`: accepted and not checked. The server runs one checkpoint (see /healthz); the value is
  only logged and echoed in the `x-intone-model` header.
* `voice`: a registry voice name, an alias, one of OpenAI's names (mapped onto the registry, see
  voices.py), or `{"id": name}`. Missing: the default voice.
* `response_format`: pcm (24 kHz 16-bit mono, no header), wav (same, streamed with unknown
  length) or mp3 (the default, as OpenAI's). opus, aac and flac are refused with 400.
* `stream_format`: "audio" (default, the bytes of `response_format`) or "sse" (events
  `speech.audio.delta` with base64 `audio`, then `speech.audio.done` with `usage`).
* `speed`: 0.5-2.0 (the engine's range, within OpenAI's 0.25-4.0; outside it a 400 names the
  range), by time-scaling the audio with the pitch kept. `instructions` is accepted and ignored.
* `normalize` (an intone extension, default true): read numbers, prices, dates, times, URLs...
  as words (`normalize_text`); false sends the text to the model as written.
* `sample_rate` (an intone extension, 8000-48000): resample the output; default 24000.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from intone.engine import AudioChunk, EngineFullError, GenerationOptions, InvalidOptionError
from intone.engine import Stream as EngineStream
from intone.engine.options import check_option
from intone.provider.server import protocol
from intone.provider.server.encoders import CONTENT_TYPES, FORMATS, make_encoder
from intone.provider.server.logs import bind
from intone.provider.server.pcm import StreamResampler
from intone.provider.server.runtime import EngineUnavailableError, Runtime
from intone.provider.server.voices import UnknownVoiceError

logger = logging.getLogger(__name__)

STREAM_FORMATS = ("audio", "sse")
OPENAI_SAMPLE_RATE = 24_000


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param

    def response(self, request_id: str) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        headers = {"x-request-id": request_id}
        if self.status == 503:
            headers["retry-after"] = "1"
        return JSONResponse(
            {
                "error": {
                    "message": self.message,
                    "type": kind,
                    "param": self.param,
                    "code": self.code,
                }
            },
            status_code=self.status,
            headers=headers,
        )


class HttpStream:
    """An HTTP synthesis in flight, as the runtime's drain sees it."""

    def __init__(self, request_id: str, engine_stream: EngineStream):
        self.request_id = request_id
        self.engine_stream = engine_stream
        self.shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True
        self.engine_stream.cancel()


async def speech(request: Request, runtime: Runtime) -> Response:
    request_id = "req_" + uuid.uuid4().hex[:24]
    log = bind(logger, request_id=request_id)
    try:
        return await _speech(request, runtime, request_id, log)
    except ApiError as e:
        runtime.metrics.error(e.code)
        log.info("speech request refused: %s", e.message, extra={"code": e.code})
        return e.response(request_id)


async def _speech(request: Request, runtime: Runtime, request_id: str, log: Any) -> Response:
    try:
        engine = await runtime.ready()
    except EngineUnavailableError as e:
        raise ApiError(503, "engine_unavailable", str(e)) from None
    if runtime.draining:
        raise ApiError(503, protocol.ErrorCode.SHUTTING_DOWN, "the server is shutting down")
    body = await _read_json(request, runtime.settings.max_request_bytes)

    text = body.get("input")
    if not isinstance(text, str):
        raise ApiError(400, "bad_message", "'input' must be a string", "input")
    if not text.strip():
        raise ApiError(400, protocol.ErrorCode.EMPTY_TEXT, "'input' is empty", "input")
    if len(text) > engine.config.max_text_chars:
        raise ApiError(
            400,
            protocol.ErrorCode.TEXT_TOO_LONG,
            f"'input' is over the limit of {engine.config.max_text_chars} characters",
            "input",
        )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "bad_message", "'model' must be a string", "model")
    fmt = body.get("response_format") or "mp3"
    if fmt not in FORMATS:
        raise ApiError(
            400,
            protocol.ErrorCode.BAD_FORMAT,
            f"response_format {fmt!r} is not supported; supported: {', '.join(FORMATS)}",
            "response_format",
        )
    stream_format = body.get("stream_format") or "audio"
    if stream_format not in STREAM_FORMATS:
        raise ApiError(
            400,
            protocol.ErrorCode.BAD_FORMAT,
            f"stream_format must be one of {STREAM_FORMATS}",
            "stream_format",
        )
    given = {name: body[name] for name in ("speed", "normalize") if body.get(name) is not None}
    for name, value in given.items():
        try:
            check_option(name, value)
        except InvalidOptionError as e:
            raise ApiError(400, protocol.ErrorCode.BAD_OPTIONS, str(e), name) from None
    options = GenerationOptions(
        chain_frames=engine.config.default_chain_frames,
        flow_steps=engine.config.flow_steps,
        **given,
    )
    rate = body.get("sample_rate", OPENAI_SAMPLE_RATE)
    if (
        isinstance(rate, bool)
        or not isinstance(rate, int)
        or not protocol.MIN_SAMPLE_RATE <= rate <= protocol.MAX_SAMPLE_RATE
    ):
        raise ApiError(
            400,
            protocol.ErrorCode.BAD_SAMPLE_RATE,
            f"'sample_rate' must be an integer from {protocol.MIN_SAMPLE_RATE} to "
            f"{protocol.MAX_SAMPLE_RATE}",
            "sample_rate",
        )
    requested = body.get("voice")
    if isinstance(requested, dict):
        requested = requested.get("id") or 0  # an object needs its id
    if requested is not None and not isinstance(requested, str):
        raise ApiError(
            400, protocol.ErrorCode.UNKNOWN_VOICE, "'voice' must be a name or {id}", "voice"
        )
    assert runtime.voices is not None
    try:
        voice = await runtime.voices.resolve(requested)
    except UnknownVoiceError as e:
        raise ApiError(400, protocol.ErrorCode.UNKNOWN_VOICE, str(e), "voice") from None

    tokens = engine.loaded.tokenizer.count(text)
    try:
        engine_stream = engine.stream(voice, options)
    except EngineFullError as e:
        raise ApiError(503, protocol.ErrorCode.SERVER_BUSY, str(e)) from None
    try:
        engine_stream.push_text(text)
        engine_stream.end_input()
    except ValueError as e:
        engine_stream.cancel()
        raise ApiError(400, protocol.ErrorCode.BAD_TEXT, str(e), "input") from None

    handle = HttpStream(request_id, engine_stream)
    runtime.add_stream(handle)
    log = log.bind(voice=voice, format=fmt, stream_format=stream_format, model=model)
    log.info("speech request", extra={"chars": len(text), "engine_request": engine_stream.id})
    sse = stream_format == "sse"
    body_iter = _generate(runtime, handle, engine.sample_rate, rate, fmt, sse, tokens, log)
    return _ClosingStreamingResponse(
        body_iter,
        media_type="text/event-stream" if sse else CONTENT_TYPES[fmt],
        headers={
            "x-request-id": request_id,
            "x-intone-model": model or "",
            "x-intone-voice": voice,
            "cache-control": "no-cache",
        },
    )


async def _generate(
    runtime: Runtime,
    handle: HttpStream,
    model_rate: int,
    rate: int,
    fmt: str,
    sse: bool,
    input_tokens: int,
    log: Any,
) -> AsyncIterator[bytes]:
    """The response body; cancels the engine stream if the client goes away."""
    resampler = StreamResampler(model_rate, rate)
    encoder = make_encoder(fmt, rate)
    frames = 0
    started = time.perf_counter()
    first_audio: float | None = None
    outcome = "disconnected"

    def wrap(data: bytes) -> bytes:
        if not sse:
            return data
        event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")}
        return _sse(event)

    try:
        async for event in handle.engine_stream:
            if isinstance(event, AudioChunk):
                frames += 1
                data = encoder.encode(resampler.process(event.samples))
                if data:
                    if first_audio is None:
                        first_audio = time.perf_counter() - started
                        runtime.metrics.first_audio("openai", first_audio)
                    yield wrap(data)
        if handle.shut_down:
            outcome = "shutdown"
            if sse:
                yield _sse(_sse_error(protocol.ErrorCode.SHUTTING_DOWN, "the server shut down"))
            return
        tail = encoder.encode(resampler.finish()) + encoder.finish()
        if tail:
            yield wrap(tail)
        if sse:
            usage = {
                "input_tokens": input_tokens,
                "output_tokens": frames,
                "total_tokens": input_tokens + frames,
            }
            yield _sse({"type": "speech.audio.done", "usage": usage})
        outcome = "done"
        metrics = handle.engine_stream.metrics.as_dict()
        log.info("speech done", extra={k: v for k, v in metrics.items() if v is not None})
    except Exception as e:
        outcome = "error"
        log.error("speech failed: %s", e)
        runtime.metrics.error(protocol.ErrorCode.ENGINE_ERROR)
        if sse:
            yield _sse(_sse_error(protocol.ErrorCode.ENGINE_ERROR, f"generation failed: {e}"))
            return
        raise  # a raw audio body can only signal failure by breaking the response
    finally:
        if outcome != "done":
            handle.engine_stream.cancel()  # the client left (or failed): release engine state
        runtime.remove_stream(handle)
        runtime.metrics.stream_finished("openai", outcome)
        if outcome == "disconnected":
            log.info("speech client disconnected")


class _ClosingStreamingResponse(StreamingResponse):
    """Closes the body generator however the response ends, so its `finally` (which releases
    the engine stream) runs now, not whenever the abandoned generator is collected."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def _sse_error(code: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"code": str(code), "message": message}}


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(
            413, protocol.ErrorCode.MESSAGE_TOO_LARGE, f"request body over {limit} bytes"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(
                413, protocol.ErrorCode.MESSAGE_TOO_LARGE, f"request body over {limit} bytes"
            )
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ApiError(400, protocol.ErrorCode.BAD_JSON, f"body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, protocol.ErrorCode.BAD_MESSAGE, "body must be a JSON object")
    return body
