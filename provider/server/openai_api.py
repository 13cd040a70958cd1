"""OpenAI-compatible `POST /v1/audio/speech`, streamed as the audio is generated.

Clients written for OpenAI's speech API (the `openai` package, LiveKit's and Pipecat's OpenAI
TTS plugins) work unchanged with `base_url=http://HOST:PORT/v1`. What the fields mean here:

* `model`: which served model speaks (`GET /v1/models` lists them), by name or alias (`english`,
  `fr`, `english_2m_2026-10`, ...). Missing, or one of OpenAI's names (tts-1, tts-1-hd,
  gpt-4o-mini-tts): the default model. A model or language it does not serve: 400
  `unknown_model`, naming the served ones (a server of one model takes names that mean no
  model intone knows, as OpenAI clients send their own ids). The served model's name comes back
  in the `x-intone-model` header.
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

The body must be `application/json` (a form or `text/plain` body, which a web page could send
cross-site without a preflight, is refused with 415). Every field is checked, and every header
value the response echoes is made safe, before the engine stream is created, so a refusal never
leaves a stream behind. A raw-audio response (pcm, wav, mp3) that the server cuts after its
headers (drain deadline, maximum lifetime, a failure) ends without the final chunk, so the
client sees an incomplete response rather than a short, complete-looking one; SSE responses end
with an `error` event instead.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from intone.engine import AudioChunk, EngineError, GenerationOptions, InvalidOptionError
from intone.engine import Stream as EngineStream
from intone.engine.audio import StreamResampler
from intone.engine.errors import UnknownModelError
from intone.engine.options import check_option
from intone.provider import protocol
from intone.provider.protocol import ErrorCode, ProtocolError, echo
from intone.provider.server.access import bearer
from intone.provider.server.encoders import CONTENT_TYPES, FORMATS, make_encoder
from intone.provider.server.limits import LimitError
from intone.provider.server.logs import bind
from intone.provider.server.runtime import EngineUnavailableError, Runtime
from intone.provider.server.voice_store import owner_for

logger = logging.getLogger(__name__)

STREAM_FORMATS = ("audio", "sse")
OPENAI_SAMPLE_RATE = 24_000
MAX_MODEL_CHARS = 128
# HTTP status of an engine refusal, by its protocol code; anything else is the request's fault.
_STATUS = {
    ErrorCode.SERVER_BUSY: 503,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.ENGINE_ERROR: 500,
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        param: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.retry_after = (
            retry_after if retry_after is not None else (1.0 if status == 503 else None)
        )

    def response(self, request_id: str) -> JSONResponse:
        return error_response(
            self.status, self.code, self.message, self.param, request_id, self.retry_after
        )


def error_response(
    status: int,
    code: str,
    message: str,
    param: str | None = None,
    request_id: str | None = None,
    retry_after: float | None = None,
) -> JSONResponse:
    """An error in OpenAI's shape; also used by the app for 401/403/429 outside this module."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    headers = {}
    if request_id is not None:
        headers["x-request-id"] = request_id
    if retry_after is not None:
        headers["retry-after"] = str(max(1, round(retry_after)))
    if status == 401:
        headers["www-authenticate"] = "Bearer"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": str(code)}},
        status_code=status,
        headers=headers,
    )


def header_value(value: str) -> str:
    """`value` as a safe header value: printable ASCII, anything else escaped."""
    return ascii(value)[1:-1] if not (value.isascii() and value.isprintable()) else value


class SpeechResponse:
    """One `POST /v1/audio/speech` response in flight, as the runtime's drain and watchdog see
    it: its engine stream, and why the server cut it short."""

    def __init__(self, request_id: str, engine_stream: EngineStream, runtime: Runtime, tenant: str):
        self.request_id = request_id
        self.engine_stream = engine_stream
        self.runtime = runtime
        self.tenant = tenant
        self.started_at = time.perf_counter()
        self.cut: str | None = None  # why the server ended it early: "shutdown", "timeout"
        self.released = False
        runtime.add_stream(self)

    def release(self, outcome: str) -> None:
        """Once, however the response ended (even if its body never started)."""
        if self.released:
            return
        self.released = True
        if outcome == "disconnected" and self.cut is not None:
            outcome = self.cut  # the server ended it (e.g. a slow client), not the client
        if outcome != "done":
            self.engine_stream.cancel()  # the client left (or it failed): free engine state
        self.runtime.remove_stream(self)
        self.runtime.limits.close_stream(self.tenant)
        self.runtime.metrics.stream_finished("openai", outcome)

    def shutdown(self) -> None:
        self.cut = self.cut or "shutdown"
        self.engine_stream.cancel()

    def expire(self) -> None:
        self.cut = self.cut or "timeout"
        self.engine_stream.cancel()


class _Truncated(Exception):
    """The body generator's way of saying: end this response without its final chunk."""


async def speech(request: Request, runtime: Runtime) -> Response:
    request_id = "req_" + uuid.uuid4().hex[:24]
    log = bind(logger, request_id=request_id)
    try:
        runtime.limits.open_connection()
    except LimitError as e:
        runtime.metrics.error(str(e.code))
        runtime.log_client_error(log, f"speech request refused: {e.message}", code=str(e.code))
        return error_response(429, e.code, e.message, None, request_id, e.retry_after)
    try:
        response = await _speech(request, runtime, request_id, log)
    except ApiError as e:
        runtime.limits.close_connection()
        runtime.metrics.error(e.code)
        runtime.log_client_error(log, f"speech request refused: {e.message}", code=e.code)
        return e.response(request_id)
    except BaseException:
        runtime.limits.close_connection()
        raise
    return response  # its body releases the connection slot when it ends


async def models(request: Request, runtime: Runtime) -> Response:
    """`GET /v1/models`, as OpenAI lists models, with intone's details on each: its aliases
    (what `model` may also say), language, voices and default voice. The first is the default.
    Needs a key when the server has keys, as the speech endpoint does."""
    try:
        _key_label(request, runtime)
    except ApiError as e:
        return e.response("req_" + uuid.uuid4().hex[:24])
    try:
        await runtime.ready()
    except EngineUnavailableError as e:
        return JSONResponse(
            {"error": {"message": str(e), "type": "engine_unavailable"}}, status_code=503
        )
    data = [
        {"id": served.name, "object": "model", "created": 0, "owned_by": "intone"}
        | served.describe()
        for served in runtime.models
    ]
    return JSONResponse({"object": "list", "data": data})


async def _speech(request: Request, runtime: Runtime, request_id: str, log: Any) -> Response:
    label = _key_label(request, runtime)
    tenant = label or (request.client.host if request.client else "?")
    try:
        engine = await runtime.ready()
    except EngineUnavailableError as e:
        raise ApiError(503, "engine_unavailable", str(e)) from None
    if runtime.draining:
        raise ApiError(503, ErrorCode.SHUTTING_DOWN, "the server is shutting down")
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise ApiError(
            415, ErrorCode.BAD_MESSAGE, "the body must be JSON (content-type: application/json)"
        )
    body = await _read_json(request, runtime.settings)
    request_ = _parse(body)
    try:
        served = runtime.select(request_.model)
    except UnknownModelError as e:
        raise ApiError(400, ErrorCode.UNKNOWN_MODEL, str(e), "model") from None
    engine = served.engine
    assert engine is not None and served.voices is not None
    if len(request_.text) > engine.config.max_text_chars:
        raise ApiError(
            400,
            ErrorCode.TEXT_TOO_LONG,
            f"'input' is over the limit of {engine.config.max_text_chars} characters",
            "input",
        )
    try:
        owner = owner_for(bearer(request.headers)) if label is not None else None
        voice = await served.voices.resolve(request_.voice, owner)
    except EngineError as e:
        raise ApiError(400, protocol.engine_error_code(e), str(e), "voice") from None

    try:
        runtime.limits.open_stream(tenant)
    except LimitError as e:
        raise ApiError(429, e.code, e.message, None, e.retry_after) from None
    try:
        runtime.limits.take_chars(tenant, len(request_.text))
    except LimitError as e:
        runtime.limits.close_stream(tenant)
        raise ApiError(429, e.code, e.message, "input", e.retry_after) from None
    tokens = engine.loaded.tokenizer.count(request_.text)
    headers = {
        "x-request-id": request_id,
        "x-intone-model": header_value(served.name),
        "x-intone-voice": header_value(voice),
        "cache-control": "no-cache",
    }
    try:
        options = GenerationOptions(
            chain_frames=engine.config.default_chain_frames,
            flow_steps=engine.config.flow_steps,
            **request_.options,
        )
        engine_stream = engine.stream(voice, options, tenant=tenant)
        try:
            await engine_stream.push_long_text(request_.text)
            engine_stream.end_input()
        except BaseException:
            engine_stream.cancel()
            raise
    except (EngineError, ValueError) as e:
        runtime.limits.close_stream(tenant)
        code = protocol.engine_error_code(e)
        raise ApiError(_STATUS.get(code, 400), code, str(e), "input") from None
    except BaseException:
        runtime.limits.close_stream(tenant)
        raise

    handle = SpeechResponse(request_id, engine_stream, runtime, tenant)
    log = log.bind(voice=voice, format=request_.format, stream_format=request_.stream_format)
    if label is not None:
        log = log.bind(key=label)
    log.info(
        "speech request",
        extra={
            "chars": len(request_.text),
            "engine_request": engine_stream.id,
            "model": served.name,
        },
    )
    sse = request_.stream_format == "sse"
    body_iter = _generate(runtime, handle, engine.sample_rate, request_, sse, tokens, log)
    return _GuardedStreamingResponse(
        body_iter,
        handle,
        media_type="text/event-stream" if sse else CONTENT_TYPES[request_.format],
        headers=headers,
    )


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request's body: ApiError 413 past `limit` bytes (declared or sent), 408 if it does
    not arrive within `timeout` seconds."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, ErrorCode.MESSAGE_TOO_LARGE, f"request body over {limit} bytes")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, ErrorCode.MESSAGE_TOO_LARGE, f"request body over {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise ApiError(
            408, "body_timeout", f"the body did not arrive within {timeout:g} s"
        ) from None


def _key_label(request: Request, runtime: Runtime) -> str | None:
    """The label of the request's key; ApiError 401 if the server needs one and it has none."""
    access = runtime.access
    label = access.key_label(bearer(request.headers))
    if access.keys_required and label is None:
        raise ApiError(
            401, ErrorCode.UNAUTHORIZED, "a valid API key is required: Authorization: Bearer KEY"
        )
    return label


class _Request:
    def __init__(self, text: str, model: str | None, voice: str | None, fmt: str,
                 stream_format: str, sample_rate: int, options: dict[str, Any]):  # fmt: skip
        self.text, self.model, self.voice = text, model, voice
        self.format, self.stream_format, self.sample_rate = fmt, stream_format, sample_rate
        self.options = options  # GenerationOptions fields the request set: speed, normalize


def _parse(body: dict[str, Any]) -> _Request:
    """Every field checked before anything is created."""

    def string(name: str, code: ErrorCode, max_len: int, unicode_code: ErrorCode | None = None):
        value = body.get(name)
        if value is None:
            return None
        try:
            return protocol.check_string(
                value, name, code, max_chars=max_len, unicode_code=unicode_code
            )
        except ProtocolError as e:
            raise ApiError(400, e.code, e.message, name) from None

    text = string("input", ErrorCode.BAD_MESSAGE, 2**31, ErrorCode.BAD_TEXT)
    if text is None:
        raise ApiError(400, ErrorCode.BAD_MESSAGE, "'input' must be a string", "input")
    if not text.strip():
        raise ApiError(400, ErrorCode.EMPTY_TEXT, "'input' is empty", "input")
    model = string("model", ErrorCode.BAD_MESSAGE, MAX_MODEL_CHARS)
    if model is not None and not model.isprintable():
        raise ApiError(400, ErrorCode.BAD_MESSAGE, "'model' holds control characters", "model")
    fmt = body.get("response_format") or "mp3"
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ApiError(
            400,
            ErrorCode.BAD_FORMAT,
            f"response_format {echo(fmt)} is not supported; supported: {', '.join(FORMATS)}",
            "response_format",
        )
    stream_format = body.get("stream_format") or "audio"
    if not isinstance(stream_format, str) or stream_format not in STREAM_FORMATS:
        raise ApiError(
            400,
            ErrorCode.BAD_FORMAT,
            f"stream_format must be one of {STREAM_FORMATS}",
            "stream_format",
        )
    options = {name: body[name] for name in ("speed", "normalize") if body.get(name) is not None}
    for name, value in options.items():
        try:
            check_option(name, value)
        except InvalidOptionError as e:
            raise ApiError(400, ErrorCode.BAD_OPTIONS, str(e), name) from None
    rate = body.get("sample_rate", OPENAI_SAMPLE_RATE)
    if (
        isinstance(rate, bool)
        or not isinstance(rate, int)
        or not protocol.MIN_SAMPLE_RATE <= rate <= protocol.MAX_SAMPLE_RATE
    ):
        raise ApiError(
            400,
            ErrorCode.BAD_SAMPLE_RATE,
            f"'sample_rate' must be an integer from {protocol.MIN_SAMPLE_RATE} to "
            f"{protocol.MAX_SAMPLE_RATE}, got {echo(rate)}",
            "sample_rate",
        )
    voice = body.get("voice")
    if isinstance(voice, dict):
        voice = voice.get("id") or 0  # an object needs its id
    if voice is not None:
        try:
            voice = protocol.check_string(
                voice,
                "voice",
                ErrorCode.UNKNOWN_VOICE,
                max_chars=protocol.MAX_VOICE_CHARS,
                printable=True,
            )
        except ProtocolError as e:
            raise ApiError(400, e.code, e.message, "voice") from None
    return _Request(text, model, voice or None, fmt, stream_format, rate, options)


async def _generate(
    runtime: Runtime,
    handle: SpeechResponse,
    model_rate: int,
    request: _Request,
    sse: bool,
    input_tokens: int,
    log: Any,
) -> AsyncIterator[bytes]:
    """The response body; cancels the engine stream if the client goes away."""
    resampler = StreamResampler(model_rate, request.sample_rate)
    encoder = make_encoder(request.format, request.sample_rate)
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
        if handle.cut is not None:
            outcome = handle.cut
            code = ErrorCode.SHUTTING_DOWN if handle.cut == "shutdown" else ErrorCode.STREAM_TIMEOUT
            log.info("speech cut by the server", extra={"reason": handle.cut})
            if sse:
                yield _sse(_sse_error(code, f"the server ended the stream ({handle.cut})"))
                return
            raise _Truncated(handle.cut)
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
    except _Truncated:
        raise
    except Exception as e:
        outcome = "error"
        log.error("speech failed: %s", e, exc_info=not isinstance(e, EngineError))
        runtime.metrics.error(ErrorCode.ENGINE_ERROR)
        if sse:
            yield _sse(_sse_error(ErrorCode.ENGINE_ERROR, f"generation failed: {e}"))
            return
        raise _Truncated("error") from e  # raw audio can only say so by breaking the response
    finally:
        handle.release(outcome)
        if outcome == "disconnected":
            log.info("speech client disconnected")


class _GuardedStreamingResponse(StreamingResponse):
    """A streaming response that (1) closes its body generator however it ends, so the engine
    stream is released now, not when the abandoned generator is collected; (2) drops a client
    that takes nothing for `slow_client_timeout` seconds; (3) on `_Truncated`, returns without
    the final chunk: the server then closes the connection and the client sees a cut response;
    (4) releases the request's connection slot."""

    def __init__(self, content: Any, handle: SpeechResponse, **kwargs: Any):
        super().__init__(content, **kwargs)
        self.handle = handle

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        runtime = self.handle.runtime
        timeout = runtime.settings.slow_client_timeout

        async def guarded_send(message: Any) -> None:
            try:
                await asyncio.wait_for(send(message), timeout)
            except TimeoutError:
                self.handle.cut = self.handle.cut or "slow_client"
                runtime.metrics.error(str(ErrorCode.SLOW_CLIENT))
                logger.warning("dropping a slow HTTP client: no audio taken for %g s", timeout)
                raise _Truncated("slow client") from None

        try:
            await super().__call__(scope, receive, guarded_send)
        except _Truncated:
            pass  # the final chunk was never sent: uvicorn closes the connection
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self.handle.release("disconnected")  # if the body never started
            runtime.limits.close_connection()


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def _sse_error(code: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"code": str(code), "message": message}}


async def _read_json(request: Request, settings: Any) -> dict[str, Any]:
    raw = await read_body(request, settings.max_request_bytes, settings.body_timeout)
    try:
        body = protocol.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError too
        raise ApiError(400, ErrorCode.BAD_JSON, f"body is not valid JSON: {str(e)[:100]}") from None
    if not isinstance(body, dict):
        raise ApiError(400, ErrorCode.BAD_MESSAGE, "body must be a JSON object")
    return body
