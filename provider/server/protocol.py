"""The WebSocket streaming protocol: message parsing, events and the binary audio header.

Shared by the server and `intone.provider.client`, so it imports nothing heavier than the
standard library (and the engine's standard-library-only options module). docs/protocol.md is
the reference; this module is its executable form.

Binary frames carry one chunk of PCM for one stream:

    bytes 0-3  channel   uint32 little-endian, assigned by the server in the `started` event
    bytes 4-7  sequence  uint32 little-endian, 0, 1, 2 ... within the stream
    bytes 8-   payload   PCM in the stream's sample format, mono

The header is 8 bytes so that the payload stays aligned for `Float32Array`/`np.frombuffer`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from intone.engine.options import option_names, option_type

PROTOCOL_VERSION = 1
WS_PATH = "/v1/stream"

AUDIO_HEADER = struct.Struct("<II")
HEADER_BYTES = AUDIO_HEADER.size

# Sample format name -> bytes per sample.
SAMPLE_FORMATS = {"pcm_s16le": 2, "pcm_f32le": 4}
DEFAULT_FORMAT = "pcm_s16le"
MIN_SAMPLE_RATE = 8_000
MAX_SAMPLE_RATE = 48_000
MAX_STREAM_ID_CHARS = 64

# Generation options a client may set per stream: GenerationOptions' fields, less flow_steps,
# which is fixed per engine.
OPTION_TYPES: dict[str, tuple[type, ...]] = {
    name: (int,) if option_type(name) is int else (int, float)
    for name in option_names()
    if name != "flow_steps"
}


class ErrorCode(StrEnum):
    BAD_JSON = "bad_json"
    BAD_MESSAGE = "bad_message"  # valid JSON, wrong shape: missing or mistyped fields
    UNKNOWN_TYPE = "unknown_type"
    BINARY_NOT_ACCEPTED = "binary_not_accepted"
    MESSAGE_TOO_LARGE = "message_too_large"
    TOO_MANY_STREAMS = "too_many_streams"
    UNKNOWN_STREAM = "unknown_stream"
    STREAM_EXISTS = "stream_exists"
    STREAM_CLOSED = "stream_closed"  # text/flush/end after end, or for a finished stream
    UNKNOWN_VOICE = "unknown_voice"
    BAD_SAMPLE_RATE = "bad_sample_rate"
    BAD_FORMAT = "bad_format"
    BAD_OPTIONS = "bad_options"
    EMPTY_TEXT = "empty_text"
    TEXT_TOO_LONG = "text_too_long"
    BAD_TEXT = "bad_text"  # the engine refused the text (e.g. a clause too long for the KV pool)
    SERVER_BUSY = "server_busy"
    SHUTTING_DOWN = "shutting_down"
    ENGINE_ERROR = "engine_error"
    INTERNAL_ERROR = "internal_error"


class ProtocolError(Exception):
    """A message the server refuses; becomes an `error` event."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        stream: str | None = None,
        *,
        final: bool = False,
        cause: str | None = None,
    ):
        super().__init__(message)
        self.code = code
        self.message = message
        self.stream = stream
        self.final = final  # the stream is over (for a start: it never began)
        self.cause = cause  # the type of the message that caused it


# ---- client -> server messages


@dataclass
class Start:
    stream: str
    voice: str | None = None
    sample_rate: int | None = None  # None: the model's rate
    format: str = DEFAULT_FORMAT
    options: dict[str, Any] = field(default_factory=dict)
    text: str | None = None  # optional first text, saves a message
    end: bool = False  # with `text`: a one-shot request


@dataclass
class Text:
    stream: str
    text: str


@dataclass
class Flush:
    stream: str


@dataclass
class End:
    stream: str


@dataclass
class Cancel:
    stream: str


Message = Start | Text | Flush | End | Cancel
MESSAGE_TYPES = {"start": Start, "text": Text, "flush": Flush, "end": End, "cancel": Cancel}


def parse_message(raw: str) -> Message:
    """A client message from its JSON text; raises ProtocolError with the reason."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ProtocolError(ErrorCode.BAD_JSON, f"not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "a message must be a JSON object")
    kind = data.get("type")
    stream = data.get("stream")
    stream_ref = stream if isinstance(stream, str) else None
    if kind not in MESSAGE_TYPES:
        raise ProtocolError(
            ErrorCode.UNKNOWN_TYPE,
            f"unknown message type {kind!r}; expected one of {sorted(MESSAGE_TYPES)}",
            stream_ref,
        )
    if not isinstance(stream, str) or not 1 <= len(stream) <= MAX_STREAM_ID_CHARS:
        raise ProtocolError(
            ErrorCode.BAD_MESSAGE,
            f"'stream' must be a string of 1 to {MAX_STREAM_ID_CHARS} characters",
            None,
            cause=kind,
        )
    if kind == "text":
        text = data.get("text")
        if not isinstance(text, str):
            raise ProtocolError(
                ErrorCode.BAD_MESSAGE, "'text' must be a string", stream, cause="text"
            )
        return Text(stream, text)
    if kind == "start":
        try:
            return _parse_start(stream, data)
        except ProtocolError as e:
            e.final, e.cause = True, "start"
            raise
    return MESSAGE_TYPES[kind](stream)


def _parse_start(stream: str, data: dict[str, Any]) -> Start:
    voice = data.get("voice")
    if voice is not None and not isinstance(voice, str):
        raise ProtocolError(ErrorCode.UNKNOWN_VOICE, "'voice' must be a string", stream)
    rate = data.get("sample_rate")
    if rate is not None and (
        isinstance(rate, bool)
        or not isinstance(rate, int)
        or not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE
    ):
        raise ProtocolError(
            ErrorCode.BAD_SAMPLE_RATE,
            f"'sample_rate' must be an integer from {MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE} Hz, "
            f"got {rate!r}",
            stream,
        )
    fmt = data.get("format", DEFAULT_FORMAT)
    if fmt not in SAMPLE_FORMATS:
        raise ProtocolError(
            ErrorCode.BAD_FORMAT,
            f"'format' must be one of {sorted(SAMPLE_FORMATS)}, got {fmt!r}",
            stream,
        )
    options = data.get("options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise ProtocolError(ErrorCode.BAD_OPTIONS, "'options' must be an object", stream)
    for key, value in options.items():
        types = OPTION_TYPES.get(key)
        if types is None:
            raise ProtocolError(
                ErrorCode.BAD_OPTIONS,
                f"unknown option {key!r}; known options: {sorted(OPTION_TYPES)}",
                stream,
            )
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            raise ProtocolError(ErrorCode.BAD_OPTIONS, f"option {key!r} has a bad type", stream)
    text = data.get("text")
    if text is not None and not isinstance(text, str):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "'text' must be a string", stream)
    end = data.get("end", False)
    if not isinstance(end, bool):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "'end' must be a boolean", stream)
    return Start(stream, voice, rate, fmt, options, text, end)


def start_message(
    stream: str,
    *,
    voice: str | None = None,
    sample_rate: int | None = None,
    format: str = DEFAULT_FORMAT,
    options: dict[str, Any] | None = None,
    text: str | None = None,
    end: bool = False,
) -> str:
    message: dict[str, Any] = {"type": "start", "stream": stream, "format": format}
    if voice is not None:
        message["voice"] = voice
    if sample_rate is not None:
        message["sample_rate"] = sample_rate
    if options:
        message["options"] = options
    if text is not None:
        message["text"] = text
    if end:
        message["end"] = True
    return json.dumps(message)


def control_message(kind: str, stream: str, text: str | None = None) -> str:
    """A `text`, `flush`, `end` or `cancel` message."""
    message: dict[str, Any] = {"type": kind, "stream": stream}
    if text is not None:
        message["text"] = text
    return json.dumps(message)


# ---- server -> client

TERMINAL_EVENTS = ("done", "cancelled")  # and `error` with "final": true


def is_terminal(event: dict[str, Any]) -> bool:
    """True for the last event a stream gets."""
    kind = event.get("type")
    return kind in TERMINAL_EVENTS or (kind == "error" and bool(event.get("final")))


def error_event(
    code: ErrorCode | str,
    message: str,
    stream: str | None = None,
    final: bool = False,
    cause: str | None = None,
) -> dict[str, Any]:
    return {
        "type": "error",
        "stream": stream,
        "code": str(code),
        "message": message,
        "final": final,
        "cause": cause,
    }


def pack_audio(channel: int, sequence: int, payload: bytes) -> bytes:
    return AUDIO_HEADER.pack(channel, sequence) + payload


def unpack_audio(frame: bytes) -> tuple[int, int, memoryview]:
    """(channel, sequence, payload) of a binary frame."""
    if len(frame) < HEADER_BYTES:
        raise ValueError(f"binary frame of {len(frame)} bytes is shorter than its header")
    channel, sequence = AUDIO_HEADER.unpack_from(frame)
    return channel, sequence, memoryview(frame)[HEADER_BYTES:]
