"""The WebSocket streaming protocol, as one typed module shared by the server and the client.

Client messages (`Start`, `Text`, `Flush`, `End`, `Cancel`, `Playback`) are parsed here, with
every field checked: type, length, lone surrogates and numbers too large to be meant. Server
events (`HelloEvent`, `StartedEvent`, `ClauseDoneEvent`, `DoneEvent`, `CancelledEvent`,
`ErrorEvent`) are dataclasses, serialised by `encode_event` and read back by `parse_event`, so
neither side builds or reads these dicts by hand. Error codes and WebSocket close codes live
here too, with what each code means to a caller that retries (`code_kind`). docs/protocol.md is
the reference; this module is its executable form.

Binary frames carry one chunk of PCM for one stream:

    bytes 0-3  channel   uint32 little-endian, assigned by the server in the `started` event
    bytes 4-7  sequence  uint32 little-endian, 0, 1, 2 ... within the stream
    bytes 8-   payload   PCM in the stream's sample format, mono

The header is 8 bytes so that the payload stays aligned for `Float32Array`/`np.frombuffer`.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from dataclasses import MISSING, asdict, dataclass, field, fields
from enum import IntEnum, StrEnum
from typing import Any, ClassVar

from intone.engine.errors import EngineError, InvalidOptionError, Kind, engine_errors
from intone.engine.options import check_option, option_names

PROTOCOL_VERSION = 1
WS_PATH = "/v1/stream"
# Offered by browsers as a WebSocket subprotocol (with the API key as a second one, see
# KEY_SUBPROTOCOL_PREFIX); the server selects it, as browsers require.
SUBPROTOCOL = "intone.v1"
KEY_SUBPROTOCOL_PREFIX = "intone.key."

AUDIO_HEADER = struct.Struct("<II")
HEADER_BYTES = AUDIO_HEADER.size

# Sample format name -> bytes per sample.
SAMPLE_FORMATS = {"pcm_s16le": 2, "pcm_f32le": 4}
DEFAULT_FORMAT = "pcm_s16le"
MIN_SAMPLE_RATE = 8_000
MAX_SAMPLE_RATE = 48_000
MAX_STREAM_ID_CHARS = 64
MAX_VOICE_CHARS = 128
# An integer of more digits is refused before Python converts it (a 5000-digit one would raise
# inside the JSON parser); 19 digits hold every int64, the widest option (`seed`).
MAX_INT_DIGITS = 19
# Error messages quote at most this much of a client's value, escaped: a 60 KB `type` must not
# come back 1000 times, nor a newline forge a log line.
MAX_ECHO_CHARS = 32

# Generation options a client may set per stream: every `GenerationOptions` field except those
# the server fixes for its engine (the flow head's step count is compiled into its batches).
ENGINE_FIXED_OPTIONS = frozenset({"flow_steps"})
STREAM_OPTIONS = tuple(name for name in option_names() if name not in ENGINE_FIXED_OPTIONS)


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
    UNKNOWN_MODEL = "unknown_model"  # `model` names none of the served models
    BAD_SAMPLE_RATE = "bad_sample_rate"
    BAD_FORMAT = "bad_format"
    BAD_OPTIONS = "bad_options"
    EMPTY_TEXT = "empty_text"
    TEXT_TOO_LONG = "text_too_long"
    BAD_TEXT = "bad_text"  # text the engine cannot take (a lone surrogate, a clause too long)
    SERVER_BUSY = "server_busy"
    SHUTTING_DOWN = "shutting_down"
    ENGINE_ERROR = "engine_error"
    INTERNAL_ERROR = "internal_error"
    # Access and limits (docs/server.md): each comes with a close code where it ends the
    # connection, and with `retry_after` where waiting helps.
    UNAUTHORIZED = "unauthorized"
    ORIGIN_NOT_ALLOWED = "origin_not_allowed"
    TOO_MANY_CONNECTIONS = "too_many_connections"
    RATE_LIMITED = "rate_limited"  # characters per minute or concurrent streams of a key/client
    IDLE_TIMEOUT = "idle_timeout"  # no message (connection) or no text (stream) for too long
    STREAM_TIMEOUT = "stream_timeout"  # the stream outlived the server's maximum lifetime
    SLOW_CLIENT = "slow_client"  # the client stopped reading its audio
    # Voice uploads (`POST /v1/voices`, docs/server.md "Voices").
    BAD_UPLOAD = "bad_upload"  # no file, an unsupported content type, a bad name
    BAD_AUDIO = "bad_audio"  # not audio, truncated, a lying header, NaN or infinite samples
    BAD_VOICE_STATE = "bad_voice_state"  # a .safetensors that is no voice state of this model
    VOICE_TOO_LARGE = "voice_too_large"  # over --max-voice-bytes
    VOICE_TOO_LONG = "voice_too_long"  # over --max-voice-seconds of audio
    VOICE_TOO_SHORT = "voice_too_short"  # under a second of audio
    VOICE_SILENT = "voice_silent"  # nothing but silence
    VOICE_CLONING_UNAVAILABLE = "voice_cloning_unavailable"  # the model has no voice encoder
    TOO_MANY_VOICES = "too_many_voices"  # the key has --max-voices-per-key stored voices
    VOICE_READ_ONLY = "voice_read_only"  # one of the server's own voices: it cannot be deleted


class CloseCode(IntEnum):
    """WebSocket close codes the server uses (4000-4999 are the application's)."""

    GOING_AWAY = 1001  # the server is shutting down: reconnect (elsewhere)
    INTERNAL_ERROR = 1011  # the engine could not be started
    UNAUTHORIZED = 4401
    ORIGIN_NOT_ALLOWED = 4403
    IDLE_TIMEOUT = 4408
    SLOW_CLIENT = 4409
    TOO_MANY_CONNECTIONS = 4429


# What each server-side code means to whoever retries; the engine's codes carry their own kind
# on their error types (`intone.engine.errors`), so each code has exactly one.
_SERVER_CODE_KINDS: dict[ErrorCode, Kind] = {
    ErrorCode.BAD_JSON: Kind.BAD_REQUEST,
    ErrorCode.BAD_MESSAGE: Kind.BAD_REQUEST,
    ErrorCode.UNKNOWN_TYPE: Kind.BAD_REQUEST,
    ErrorCode.BINARY_NOT_ACCEPTED: Kind.BAD_REQUEST,
    ErrorCode.MESSAGE_TOO_LARGE: Kind.BAD_INPUT,
    ErrorCode.TOO_MANY_STREAMS: Kind.BUSY,
    ErrorCode.UNKNOWN_STREAM: Kind.BAD_REQUEST,
    ErrorCode.STREAM_EXISTS: Kind.BAD_REQUEST,
    ErrorCode.BAD_SAMPLE_RATE: Kind.BAD_REQUEST,
    ErrorCode.BAD_FORMAT: Kind.BAD_REQUEST,
    ErrorCode.INTERNAL_ERROR: Kind.SERVER,
    ErrorCode.UNAUTHORIZED: Kind.AUTH,
    ErrorCode.ORIGIN_NOT_ALLOWED: Kind.AUTH,
    ErrorCode.TOO_MANY_CONNECTIONS: Kind.BUSY,
    ErrorCode.RATE_LIMITED: Kind.BUSY,
    ErrorCode.STREAM_TIMEOUT: Kind.BAD_INPUT,
    ErrorCode.SLOW_CLIENT: Kind.CONNECTION,
    ErrorCode.BAD_UPLOAD: Kind.BAD_REQUEST,
    ErrorCode.BAD_AUDIO: Kind.BAD_REQUEST,
    ErrorCode.BAD_VOICE_STATE: Kind.BAD_REQUEST,
    ErrorCode.VOICE_TOO_LARGE: Kind.BAD_REQUEST,
    ErrorCode.VOICE_TOO_LONG: Kind.BAD_REQUEST,
    ErrorCode.VOICE_TOO_SHORT: Kind.BAD_REQUEST,
    ErrorCode.VOICE_SILENT: Kind.BAD_REQUEST,
    ErrorCode.VOICE_CLONING_UNAVAILABLE: Kind.BAD_REQUEST,
    ErrorCode.TOO_MANY_VOICES: Kind.BAD_REQUEST,
    ErrorCode.VOICE_READ_ONLY: Kind.BAD_REQUEST,
}
CODE_KINDS: dict[str, Kind] = {
    **{error.code: error.kind for error in engine_errors()},
    **_SERVER_CODE_KINDS,
}


def code_kind(code: str) -> Kind:
    """What an error code means to whoever retries; UNKNOWN for a code this version lacks."""
    return CODE_KINDS.get(code, Kind.UNKNOWN)


def engine_error_code(error: BaseException) -> ErrorCode:
    """The protocol's code for an error the engine raised: its own, which is a wire code."""
    if isinstance(error, EngineError):
        return ErrorCode(error.code)
    if isinstance(error, ValueError):
        # An untyped refusal of the text: the input, not the server, is wrong.
        return ErrorCode.BAD_TEXT
    return ErrorCode.ENGINE_ERROR


def echo(value: object) -> str:
    """A client's value for an error message: a short, escaped prefix, or its JSON type."""
    if isinstance(value, str):
        shown = ascii(value[:MAX_ECHO_CHARS])
        return shown + ("..." if len(value) > MAX_ECHO_CHARS else "")
    if isinstance(value, _Oversized):
        return f"a {value.digits}-digit number"
    if value is None or isinstance(value, bool | int | float):
        return json.dumps(value)
    return {dict: "an object", list: "an array"}.get(type(value), type(value).__name__)


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
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.code = code
        self.message = message
        self.stream = stream
        self.final = final  # the stream is over (for a start: it never began)
        self.cause = cause  # the type of the message that caused it
        self.retry_after = retry_after

    def event(self) -> ErrorEvent:
        return ErrorEvent(
            self.code, self.message, self.stream, self.final, self.cause, self.retry_after
        )


# ---- client -> server messages


@dataclass
class Start:
    stream: str
    voice: str | None = None
    sample_rate: int | None = None  # None: the model's rate
    format: str = DEFAULT_FORMAT
    options: dict[str, Any] = field(default_factory=dict)  # names from STREAM_OPTIONS
    text: str | None = None  # optional first text, saves a message
    end: bool = False  # with `text`: a one-shot request
    model: str | None = None  # a served model's name or alias (hello's `models`); None: default

    TYPE: ClassVar[str] = "start"


@dataclass
class Text:
    stream: str
    text: str

    TYPE: ClassVar[str] = "text"


@dataclass
class Flush:
    stream: str

    TYPE: ClassVar[str] = "flush"


@dataclass
class End:
    stream: str

    TYPE: ClassVar[str] = "end"


@dataclass
class Cancel:
    stream: str

    TYPE: ClassVar[str] = "cancel"


@dataclass
class Playback:
    """How many seconds of the stream's audio the client has played so far: the server keeps
    generation at most its buffer ahead of this (playback-paced generation)."""

    stream: str
    seconds: float

    TYPE: ClassVar[str] = "playback"


Message = Start | Text | Flush | End | Cancel | Playback
MESSAGE_TYPES: dict[str, type[Message]] = {
    m.TYPE: m for m in (Start, Text, Flush, End, Cancel, Playback)
}


@dataclass
class _Oversized:
    """An integer literal too long to convert; refused by whichever field holds it."""

    digits: int


def _parse_int(literal: str) -> int | _Oversized:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS:
        return _Oversized(len(literal))
    return int(literal)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads(raw: str | bytes) -> Any:
    """JSON as the server accepts it: no NaN/Infinity, oversized integers kept unconverted."""
    return json.loads(raw, parse_int=_parse_int, parse_constant=_refuse_constant)


def has_surrogates(text: str) -> bool:
    """True if `text` holds a lone surrogate (from a `\\ud800` escape): not encodable."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_string(
    value: object,
    name: str,
    code: ErrorCode,
    *,
    max_chars: int,
    unicode_code: ErrorCode | None = None,
    printable: bool = False,
) -> str:
    """`value` as a valid string field, or a ProtocolError with `code` (`unicode_code` for a lone
    surrogate, if given). `printable`: control characters are refused too (identifiers)."""
    if not isinstance(value, str):
        raise ProtocolError(code, f"{name!r} must be a string, got {echo(value)}")
    if len(value) > max_chars:
        raise ProtocolError(code, f"{name!r} is over {max_chars} characters: {echo(value)}")
    if has_surrogates(value):
        raise ProtocolError(
            unicode_code or code,
            f"{name!r} holds a lone surrogate (invalid Unicode): {echo(value)}",
        )
    if printable and not value.isprintable():
        raise ProtocolError(code, f"{name!r} holds control characters: {echo(value)}")
    return value


def parse_message(raw: str) -> Message:
    """A client message from its JSON text; raises ProtocolError with the reason."""
    try:
        data = loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        # The parser's messages name a position, never the document's content.
        raise ProtocolError(ErrorCode.BAD_JSON, f"not valid JSON: {str(e)[:100]}") from None
    if not isinstance(data, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "a message must be a JSON object")
    kind = data.get("type")
    if not isinstance(kind, str) or kind not in MESSAGE_TYPES:
        error = ProtocolError(
            ErrorCode.UNKNOWN_TYPE,
            f"unknown message type {echo(kind)}; expected one of {sorted(MESSAGE_TYPES)}",
        )
        with contextlib.suppress(ProtocolError):  # name the stream if its id is valid
            error.stream = _stream_id(data)
        raise error
    try:
        stream = _stream_id(data)
    except ProtocolError as e:
        e.cause = kind
        raise
    try:
        if kind == Start.TYPE:
            return _parse_start(stream, data)
        if kind == Text.TYPE:
            # Its length is bounded by the message size and the stream's text limit.
            text = check_string(
                data.get("text"),
                "text",
                ErrorCode.BAD_MESSAGE,
                max_chars=len(raw),
                unicode_code=ErrorCode.BAD_TEXT,
            )
            return Text(stream, text)
        if kind == Playback.TYPE:
            seconds = data.get("seconds")
            if (
                isinstance(seconds, bool)
                or not isinstance(seconds, int | float)
                or not math.isfinite(seconds)
                or seconds < 0
            ):
                raise ProtocolError(
                    ErrorCode.BAD_MESSAGE,
                    f"'seconds' must be a number >= 0, got {echo(seconds)}",
                    stream,
                )
            return Playback(stream, float(seconds))
        return MESSAGE_TYPES[kind](stream)  # type: ignore[call-arg]
    except ProtocolError as e:
        e.stream, e.cause = stream, kind
        e.final = kind == Start.TYPE  # a refused start never began
        raise


def _stream_id(data: dict[str, Any]) -> str:
    stream = check_string(
        data.get("stream"),
        "stream",
        ErrorCode.BAD_MESSAGE,
        max_chars=MAX_STREAM_ID_CHARS,
        printable=True,
    )
    if not stream:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "'stream' must not be empty")
    return stream


def _parse_start(stream: str, data: dict[str, Any]) -> Start:
    voice = data.get("voice")
    if voice is not None:
        voice = check_string(
            voice, "voice", ErrorCode.UNKNOWN_VOICE, max_chars=MAX_VOICE_CHARS, printable=True
        )
    rate = data.get("sample_rate")
    if rate is not None and (
        isinstance(rate, bool)
        or not isinstance(rate, int)
        or not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE
    ):
        raise ProtocolError(
            ErrorCode.BAD_SAMPLE_RATE,
            f"'sample_rate' must be an integer from {MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE} Hz, "
            f"got {echo(rate)}",
        )
    fmt = data.get("format", DEFAULT_FORMAT)
    if not isinstance(fmt, str) or fmt not in SAMPLE_FORMATS:
        raise ProtocolError(
            ErrorCode.BAD_FORMAT,
            f"'format' must be one of {sorted(SAMPLE_FORMATS)}, got {echo(fmt)}",
        )
    options = data.get("options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise ProtocolError(
            ErrorCode.BAD_OPTIONS, f"'options' must be an object, got {echo(options)}"
        )
    for key, value in options.items():
        if key not in STREAM_OPTIONS:
            raise ProtocolError(
                ErrorCode.BAD_OPTIONS,
                f"unknown option {echo(key)}; known options: {list(STREAM_OPTIONS)}",
            )
        if isinstance(value, _Oversized):
            raise ProtocolError(ErrorCode.BAD_OPTIONS, f"option {key!r} is {echo(value)}")
        try:
            check_option(key, value)
        except InvalidOptionError as e:
            raise ProtocolError(ErrorCode.BAD_OPTIONS, str(e)) from None
    text = data.get("text")
    if text is not None:
        text = check_string(
            text, "text", ErrorCode.BAD_MESSAGE, max_chars=2**31, unicode_code=ErrorCode.BAD_TEXT
        )
    end = data.get("end", False)
    if not isinstance(end, bool):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"'end' must be a boolean, got {echo(end)}")
    model = data.get("model")
    if model is not None:
        model = check_string(
            model, "model", ErrorCode.UNKNOWN_MODEL, max_chars=MAX_VOICE_CHARS, printable=True
        )
    return Start(stream, voice, rate, fmt, dict(options), text, end, model or None)


def encode_message(message: Message) -> str:
    """A client message as JSON text (fields left at their defaults are omitted)."""
    data: dict[str, Any] = {"type": message.TYPE}
    for f in fields(message):
        value = getattr(message, f.name)
        if f.name == "stream" or value != _default(f):
            data[f.name] = value
    return json.dumps(data)


def _default(f: Any) -> Any:
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


# ---- server -> client events


@dataclass
class Limits:
    """What the server allows a connection; None: not announced (an older server) or off."""

    max_message_bytes: int
    max_streams: int  # per connection
    max_text_chars: int  # per stream
    sample_rate_min: int = MIN_SAMPLE_RATE
    sample_rate_max: int = MAX_SAMPLE_RATE
    max_streams_per_client: int | None = None  # per API key, or client address
    max_chars_per_minute: int | None = None  # per API key, or client address
    max_buffered_audio: float | None = None  # seconds held for a client per stream
    slow_client_timeout: float | None = None  # seconds a client may take no audio
    idle_timeout: float | None = None  # seconds without a message, no stream open
    max_stream_seconds: float | None = None  # a stream's lifetime


@dataclass
class HelloEvent:
    """The server's greeting, first on every connection."""

    connection: str
    model: str  # the checkpoint's name (no local paths)
    version: str  # the server's package version
    sample_rate: int  # the model's
    voices: list[str]
    default_voice: str | None
    weights: str  # "released", "generated" (random weights) or "custom"
    limits: Limits
    # Every served model: {"name", "aliases", "language", "voices", "default_voice"}; the first
    # is the default. A `start` picks one with `model`.
    models: list[dict[str, Any]] = field(default_factory=list)
    options: list[str] = field(default_factory=lambda: list(STREAM_OPTIONS))
    formats: list[str] = field(default_factory=lambda: sorted(SAMPLE_FORMATS))
    header_bytes: int = HEADER_BYTES
    protocol: int = PROTOCOL_VERSION

    TYPE: ClassVar[str] = "hello"


@dataclass
class StartedEvent:
    stream: str
    channel: int  # in the binary frames of this stream
    request_id: str  # for logs
    voice: str  # the registry voice used
    sample_rate: int
    format: str
    model: str | None = None  # the served model's name

    TYPE: ClassVar[str] = "started"


@dataclass
class WordTime:
    """One of the client's words and when it is heard, in seconds from the stream's first audio
    (estimated: see `intone.engine.word_timing`)."""

    word: str
    start: float
    end: float


@dataclass
class ClauseDoneEvent:
    stream: str
    clause: int  # index from 0
    text: str
    frames: int  # model frames of 80 ms
    audio_seconds: float  # this clause's audio
    elapsed: float  # seconds since `start`
    start: float = 0.0  # where this clause's audio starts, in seconds from the stream's first
    words: list[WordTime] = field(default_factory=list)  # the clause's words, as sent, timed

    TYPE: ClassVar[str] = "clause_done"


@dataclass
class DoneEvent:
    stream: str
    metrics: dict[str, Any]  # docs/protocol.md lists the keys

    TYPE: ClassVar[str] = "done"


@dataclass
class CancelledEvent:
    stream: str
    reason: str  # "client" (its cancel) or "shutdown" (the drain's deadline passed)

    TYPE: ClassVar[str] = "cancelled"


@dataclass
class ErrorEvent:
    code: str  # an ErrorCode value; a client keeps codes it does not know as strings
    message: str
    stream: str | None = None
    final: bool = False  # this stream is over (for a start: it never began)
    cause: str | None = None  # the type of the message that caused it
    retry_after: float | None = None  # seconds, for limits that waiting cures

    TYPE: ClassVar[str] = "error"


Event = HelloEvent | StartedEvent | ClauseDoneEvent | DoneEvent | CancelledEvent | ErrorEvent
EVENT_TYPES: dict[str, type[Event]] = {
    e.TYPE: e
    for e in (HelloEvent, StartedEvent, ClauseDoneEvent, DoneEvent, CancelledEvent, ErrorEvent)
}


def encode_event(event: Event) -> str:
    """An event as JSON text: `type` first, then its fields. ASCII, so a lone surrogate that
    reached a message can never break the send."""
    return json.dumps({"type": event.TYPE, **asdict(event)})


def parse_event(raw: str) -> Event:
    """A server event from its JSON text; fields this client does not know are ignored (a newer
    server may add some). Raises ValueError for anything else."""
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("an event must be a JSON object")
    name = data.get("type")
    kind = EVENT_TYPES.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(f"unknown event type {echo(data.get('type'))}")
    values = {f.name: data[f.name] for f in fields(kind) if f.name in data}
    if kind is HelloEvent:
        limits = values.get("limits")
        if not isinstance(limits, dict):
            raise ValueError("hello without limits")
        names = {f.name for f in fields(Limits)}
        values["limits"] = Limits(**{k: v for k, v in limits.items() if k in names})
    if kind is ClauseDoneEvent:
        words = values.get("words", [])
        if not isinstance(words, list) or not all(isinstance(w, dict) for w in words):
            raise ValueError("clause_done words must be a list of objects")
        try:
            values["words"] = [WordTime(w["word"], w["start"], w["end"]) for w in words]
        except KeyError as e:
            raise ValueError(f"clause_done word without {e}") from None
    try:
        return kind(**values)
    except TypeError as e:
        raise ValueError(f"malformed {kind.TYPE} event: {e}") from None


def is_terminal(event: Event) -> bool:
    """True for the last event a stream gets."""
    return isinstance(event, DoneEvent | CancelledEvent) or (
        isinstance(event, ErrorEvent) and event.final
    )


def pack_audio(channel: int, sequence: int, payload: bytes) -> bytes:
    return AUDIO_HEADER.pack(channel, sequence) + payload


def unpack_audio(frame: bytes) -> tuple[int, int, memoryview]:
    """(channel, sequence, payload) of a binary frame."""
    if len(frame) < HEADER_BYTES:
        raise ValueError(f"binary frame of {len(frame)} bytes is shorter than its header")
    channel, sequence = AUDIO_HEADER.unpack_from(frame)
    return channel, sequence, memoryview(frame)[HEADER_BYTES:]
