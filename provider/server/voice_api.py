"""`/v1/voices`: voices callers bring (upload, list, read, delete).

`POST /v1/voices` takes a multipart form (`file`, optional `name` and `model`) or a raw body
(`Content-Type` audio/wav, audio/flac, audio/mpeg, audio/ogg or application/octet-stream;
`name` and `model` as query parameters): WAV, FLAC, MP3 or OGG audio, or a voice-state
`.safetensors` as `pocket-tts export-voice` writes. It is checked (`voice_input.py`), encoded
once off the event loop, one upload at a time, stored
(`voice_store.py`) and prefilled into the model's engine; the answer (201) is
`{"id", "name", "model", "seconds"}`. The id then works wherever a voice name does.

Every refusal is a 4xx in the server's error shape with its own code, before anything is kept:
a refused upload leaves no file, no engine voice and no quota place behind.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from intone.engine import EngineError
from intone.engine.errors import UnknownModelError
from intone.provider import protocol
from intone.provider.errors import VoiceRefusedError
from intone.provider.protocol import ErrorCode, ProtocolError, echo
from intone.provider.server.access import bearer
from intone.provider.server.logs import bind
from intone.provider.server.openai_api import ApiError, read_body
from intone.provider.server.runtime import EngineUnavailableError, Runtime, ServedModel
from intone.provider.server.settings import ServerSettings
from intone.provider.server.voice_store import StoredVoice, owner_for
from intone.provider.voice_input import decode_voice

logger = logging.getLogger(__name__)

RAW_TYPES = (
    "audio/wav",
    "audio/x-wav",
    "audio/wave",
    "audio/flac",
    "audio/x-flac",
    "audio/mpeg",
    "audio/mp3",
    "audio/ogg",
    "application/octet-stream",
)
MULTIPART = "multipart/form-data"
MULTIPART_OVERHEAD = 64 * 1024  # a form's boundaries and small fields, besides the file
MAX_NAME_CHARS = 100


@dataclass
class Upload:
    data: bytes
    name: str
    model: str | None


class UploadRefused(ApiError):
    """A refused upload: always a 4xx with its code."""


def _refuse(code: ErrorCode, message: str, status: int = 400, param: str | None = None):
    return UploadRefused(status, code, message, param)


# ---- routes


async def create_voice(request: Request, runtime: Runtime) -> Response:
    request_id = "req_" + uuid.uuid4().hex[:24]
    log = bind(logger, request_id=request_id)
    try:
        owner = _owner(request, runtime)
        await _ready(runtime)
        upload = await _read_upload(request, runtime.settings)
        served = _select(runtime, upload.model)
        stored = await _store(runtime, served, upload, owner)
    except ApiError as e:
        runtime.metrics.error(str(e.code))
        runtime.log_client_error(log, f"voice upload refused: {e.message}", code=str(e.code))
        return e.response(request_id)
    log.info(
        "voice stored",
        extra={"voice": stored.id, "model": stored.model, "seconds": round(stored.seconds, 2)},
    )
    body = {k: v for k, v in stored.describe().items() if k != "shared"}
    return JSONResponse(body, status_code=201, headers={"x-request-id": request_id})


async def list_voices(request: Request, runtime: Runtime) -> Response:
    try:
        owner = _owner(request, runtime)
        await _ready(runtime)
    except ApiError as e:
        return e.response("req_" + uuid.uuid4().hex[:24])
    voices = [shared for served in runtime.ready_models for shared in _shared(served)]
    served_names = {served.name for served in runtime.ready_models}
    store = runtime.voice_store
    assert store is not None
    voices += [v.describe() for v in store.owned(owner) if v.model in served_names]
    return JSONResponse({"voices": voices}, headers={"cache-control": "no-cache"})


async def get_voice(request: Request, runtime: Runtime) -> Response:
    try:
        owner = _owner(request, runtime)
        await _ready(runtime)
        return JSONResponse(_find(runtime, request.path_params["voice_id"], owner))
    except ApiError as e:
        return e.response("req_" + uuid.uuid4().hex[:24])


async def delete_voice(request: Request, runtime: Runtime) -> Response:
    request_id = "req_" + uuid.uuid4().hex[:24]
    try:
        owner = _owner(request, runtime)
        await _ready(runtime)
        voice_id = request.path_params["voice_id"]
        store = runtime.voice_store
        assert store is not None
        stored = store.visible(voice_id, owner)
        if stored is None:
            found = _find(runtime, voice_id, owner)  # 404 unless it is a shared voice
            raise _refuse(
                ErrorCode.VOICE_READ_ONLY,
                f"{echo(found['id'])} is one of the server's own voices: it cannot be deleted",
                403,
            )
    except ApiError as e:
        return e.response(request_id)
    # Streams using it finish with it; new ones cannot name it; its pages go after them.
    for served in runtime.ready_models:
        if served.name == stored.model and served.engine is not None:
            served.engine.remove_voice(stored.id)
    store.delete(stored.id)
    bind(logger, request_id=request_id).info("voice deleted", extra={"voice": stored.id})
    return Response(status_code=204, headers={"x-request-id": request_id})


# ---- helpers


def _owner(request: Request, runtime: Runtime) -> str | None:
    """The caller's owner id (a digest of its key); 401 if the server needs a key."""
    access = runtime.access
    key = bearer(request.headers)
    if not access.keys_required:
        return None
    if access.key_label(key) is None:
        raise ApiError(
            401, ErrorCode.UNAUTHORIZED, "a valid API key is required: Authorization: Bearer KEY"
        )
    return owner_for(key)


async def _ready(runtime: Runtime) -> None:
    try:
        await runtime.ready()
    except EngineUnavailableError as e:
        raise ApiError(503, "engine_unavailable", str(e)) from None


def _select(runtime: Runtime, model: str | None) -> ServedModel:
    try:
        return runtime.select(model)
    except UnknownModelError as e:
        raise ApiError(400, ErrorCode.UNKNOWN_MODEL, str(e), "model") from None


def _shared(served: ServedModel) -> list[dict[str, Any]]:
    assert served.voices is not None
    return [
        {"id": name, "name": name, "model": served.name, "seconds": None, "shared": True}
        for name in served.voices.shared_names()
    ]


def _find(runtime: Runtime, voice_id: str, owner: str | None) -> dict[str, Any]:
    """The caller's view of one voice: its own stored one, or a shared one; else 404 (another
    key's voice is not found either, so ids tell a stranger nothing)."""
    store = runtime.voice_store
    assert store is not None
    stored = store.visible(voice_id, owner)
    if stored is not None:
        return stored.describe()
    for served in runtime.ready_models:
        for shared in _shared(served):
            if shared["id"] == voice_id:
                return shared
    raise ApiError(404, ErrorCode.UNKNOWN_VOICE, f"no voice {echo(voice_id)}", "voice_id")


async def _read_upload(request: Request, settings: ServerSettings) -> Upload:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    limit = settings.max_voice_bytes
    if media == MULTIPART:
        body = await _body(request, limit + MULTIPART_OVERHEAD, settings)
        return await _parse_form(request, body, limit)
    if media in RAW_TYPES:
        data = await _body(request, limit, settings)
        query = request.query_params
        return Upload(data, _name(query.get("name"), "voice"), query.get("model"))
    raise _refuse(
        ErrorCode.BAD_UPLOAD,
        f"a voice is uploaded as {MULTIPART} (a `file` field) or as a raw body of type "
        f"{', '.join(RAW_TYPES[:1] + RAW_TYPES[3:4] + RAW_TYPES[5:6] + RAW_TYPES[7:])}; "
        f"got {echo(media)}",
        415,
    )


async def _body(request: Request, limit: int, settings: ServerSettings) -> bytes:
    try:
        return await read_body(request, limit, settings.body_timeout)
    except ApiError as e:
        if e.status != 413:
            raise
        raise _refuse(
            ErrorCode.VOICE_TOO_LARGE,
            f"a voice file may have at most {settings.max_voice_bytes} bytes",
            413,
        ) from None


async def _parse_form(request: Request, body: bytes, limit: int) -> Upload:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(request.scope, receive).form(
            max_files=1, max_fields=8, max_part_size=MULTIPART_OVERHEAD
        )
    except Exception as e:  # starlette's MultiPartException, or a malformed body
        raise _refuse(ErrorCode.BAD_UPLOAD, f"the multipart form cannot be read: {e}") from None
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise _refuse(ErrorCode.BAD_UPLOAD, "the form needs a `file` field holding the voice")
        data = await upload.read()
        if len(data) > limit:
            raise _refuse(
                ErrorCode.VOICE_TOO_LARGE, f"a voice file may have at most {limit} bytes", 413
            )
        stem = Path(upload.filename or "voice").stem or "voice"
        model = form.get("model")
        if model is not None and not isinstance(model, str):
            raise _refuse(ErrorCode.BAD_UPLOAD, "`model` must be a text field")
        return Upload(data, _name(form.get("name"), stem), model or None)
    finally:
        await form.close()


def _name(value: object, default: str) -> str:
    if value is None or value == "":
        value = default[:MAX_NAME_CHARS]
    try:
        name = protocol.check_string(
            value, "name", ErrorCode.BAD_UPLOAD, max_chars=MAX_NAME_CHARS, printable=True
        )
    except ProtocolError as e:
        raise _refuse(e.code, e.message, param="name") from None
    if not name.strip():
        raise _refuse(ErrorCode.BAD_UPLOAD, "`name` is blank", param="name")
    return name.strip()


async def _store(
    runtime: Runtime, served: ServedModel, upload: Upload, owner: str | None
) -> StoredVoice:
    store, settings = runtime.voice_store, runtime.settings
    assert store is not None and served.engine is not None
    if runtime.draining:
        raise ApiError(503, ErrorCode.SHUTTING_DOWN, "the server is shutting down")
    limit = settings.max_voices_per_key
    if not store.reserve(owner, limit):
        raise _refuse(
            ErrorCode.TOO_MANY_VOICES,
            f"{limit} voices are already stored for this key (without keys: on this server): "
            "delete one first",
            429,
        )
    try:
        # One encoding at a time: each takes the cores for a moment, and streams come first.
        async with runtime.voice_uploads:
            return await asyncio.to_thread(_encode_and_store, runtime, served, upload, owner)
    finally:
        store.unreserve(owner)


def _encode_and_store(
    runtime: Runtime, served: ServedModel, upload: Upload, owner: str | None
) -> StoredVoice:
    """Off the event loop: check and encode the upload, write it, prefill it. Whatever fails,
    nothing stays: no file, no engine voice."""
    engine, store = served.engine, runtime.voice_store
    assert engine is not None and store is not None
    try:
        voice, seconds = decode_voice(
            engine.model, served.name, upload.data, runtime.settings.max_voice_seconds
        )
    except VoiceRefusedError as e:
        raise UploadRefused(e.status, e.code, e.message) from None
    stored = store.save(voice, upload.name, served.name, seconds, owner)
    try:
        engine.add_voice(stored.id, stored.path)
    except EngineError as e:
        store.delete(stored.id)
        status = 503 if e.retryable else 500
        raise ApiError(status, protocol.engine_error_code(e), str(e)) from None
    except BaseException:
        store.delete(stored.id)
        raise
    return stored
