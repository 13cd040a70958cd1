"""The wire format on its own: message parsing, the binary header, streaming encoders."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import soundfile
from hypothesis import given
from hypothesis import strategies as st

from intone.engine.audio import PcmEncoder
from intone.engine.options import option_names
from intone.provider import protocol
from intone.provider.protocol import ErrorCode, ProtocolError, parse_message
from intone.provider.server.encoders import make_encoder, wav_header


@given(
    channel=st.integers(0, 2**32 - 1),
    sequence=st.integers(0, 2**32 - 1),
    payload=st.binary(max_size=64),
)
def test_audio_header_round_trip(channel, sequence, payload):
    frame = protocol.pack_audio(channel, sequence, payload)
    assert len(frame) == protocol.HEADER_BYTES + len(payload)
    assert protocol.unpack_audio(frame) == (channel, sequence, payload)


def test_short_binary_frame():
    with pytest.raises(ValueError):
        protocol.unpack_audio(b"\x00" * 7)


def test_parse_start_with_everything():
    start = protocol.Start(
        "a", "v", 16000, "pcm_f32le", {"seed": 1, "temperature": 0.5}, "Hi.", True
    )
    assert parse_message(protocol.encode_message(start)) == start


@pytest.mark.parametrize(
    "message",
    [
        protocol.Text("s", "hello"),
        protocol.Flush("s"),
        protocol.End("s"),
        protocol.Cancel("s"),
        protocol.Playback("s", 1.5),
    ],
)
def test_parse_control_messages(message):
    assert parse_message(protocol.encode_message(message)) == message


def test_stream_options_are_the_engines():
    assert set(protocol.STREAM_OPTIONS) == set(option_names()) - {"flow_steps"}


@pytest.mark.parametrize(
    "raw, code, final",
    [
        ("{", ErrorCode.BAD_JSON, False),
        ('"x"', ErrorCode.BAD_MESSAGE, False),
        ('{"type": "start"}', ErrorCode.BAD_MESSAGE, False),
        ('{"type": "x", "stream": "s"}', ErrorCode.UNKNOWN_TYPE, False),
        ('{"type": "text", "stream": "s", "text": 3}', ErrorCode.BAD_MESSAGE, False),
        ('{"type": "start", "stream": "s", "sample_rate": 7000}', ErrorCode.BAD_SAMPLE_RATE, True),
        ('{"type": "start", "stream": "s", "format": "pcm"}', ErrorCode.BAD_FORMAT, True),
        ('{"type": "start", "stream": "s", "voice": []}', ErrorCode.UNKNOWN_VOICE, True),
        ('{"type": "start", "stream": "s", "options": []}', ErrorCode.BAD_OPTIONS, True),
        ('{"type": "start", "stream": "s", "options": {"seed": true}}', ErrorCode.BAD_OPTIONS,
         True),
        ('{"type": "start", "stream": "s", "options": {"first_clause_min_words": 0}}',
         ErrorCode.BAD_OPTIONS, True),
        ('{"type": "start", "stream": "s", "options": {"first_clause_max_wait_ms": 1e5}}',
         ErrorCode.BAD_OPTIONS, True),
        ('{"type": "start", "stream": "s", "end": "yes"}', ErrorCode.BAD_MESSAGE, True),
    ],
)  # fmt: skip
def test_parse_errors(raw, code, final):
    with pytest.raises(ProtocolError) as info:
        parse_message(raw)
    assert info.value.code == code and info.value.final is final


def test_terminal_events():
    assert protocol.is_terminal(protocol.DoneEvent("s", {}))
    assert protocol.is_terminal(protocol.CancelledEvent("s", "client"))
    assert protocol.is_terminal(protocol.ErrorEvent("x", "m", "s", final=True))
    assert not protocol.is_terminal(protocol.ErrorEvent("x", "m", "s", final=False))
    assert not protocol.is_terminal(protocol.ClauseDoneEvent("s", 0, "t", 1, 0.08, 0.1))


EVENTS = [
    protocol.HelloEvent(
        "c", "tiny", "0.1.0", 24000, ["a", "b"], "a", "generated", protocol.Limits(1, 2, 3)
    ),
    protocol.StartedEvent("s", 1, "r", "a", 16000, "pcm_s16le"),
    protocol.ClauseDoneEvent("s", 0, "Hi.", 5, 0.4, 0.2),
    protocol.DoneEvent("s", {"ttfa": 0.1}),
    protocol.CancelledEvent("s", "client"),
    protocol.ErrorEvent("rate_limited", "slow down", "s", True, "start", 2.0),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.TYPE)
def test_events_round_trip(event):
    assert protocol.parse_event(protocol.encode_event(event)) == event


def test_parse_event_ignores_unknown_fields_and_refuses_junk():
    event = protocol.parse_event('{"type": "cancelled", "stream": "s", "reason": "x", "new": 1}')
    assert event == protocol.CancelledEvent("s", "x")
    for raw in ("[]", '{"type": ["x"]}', '{"type": "nope"}', '{"type": "done"}'):
        with pytest.raises(ValueError):
            protocol.parse_event(raw)


@pytest.mark.parametrize(
    "raw, code, final",
    [
        # A 5000-digit integer is refused by the field that holds it, not by the JSON parser.
        ('{"type": "start", "stream": "s", "options": {"seed": %s}}' % ("9" * 5000),
         ErrorCode.BAD_OPTIONS, True),
        ('{"type": "start", "stream": "s", "sample_rate": %s}' % ("1" * 40),
         ErrorCode.BAD_SAMPLE_RATE, True),
        ('{"type": "start", "stream": "s", "options": {"temperature": NaN}}', ErrorCode.BAD_JSON,
         False),
        ('{"type": "start", "stream": "s", "options": {"temperature": 1e999}}',
         ErrorCode.BAD_OPTIONS, True),
        ('{"type": "start", "stream": "s", "options": {"flow_steps": 2}}', ErrorCode.BAD_OPTIONS,
         True),
        ('{"type": ["start"], "stream": "s"}', ErrorCode.UNKNOWN_TYPE, False),
        ('{"type": {"a": 1}, "stream": "s"}', ErrorCode.UNKNOWN_TYPE, False),
        ('{"type": "text", "stream": "s", "text": "a\\ud800b"}', ErrorCode.BAD_TEXT, False),
        ('{"type": "start", "stream": "s", "text": "\\udfff", "end": true}', ErrorCode.BAD_TEXT,
         True),
        ('{"type": "start", "stream": "s", "voice": "\\ud800"}', ErrorCode.UNKNOWN_VOICE, True),
        ('{"type": "text", "stream": "\\ud800", "text": "x"}', ErrorCode.BAD_MESSAGE, False),
        ('{"type": "text", "stream": "a\\nb", "text": "x"}', ErrorCode.BAD_MESSAGE, False),
        ('{"type": "text", "stream": "%s", "text": "x"}' % ("s" * 65), ErrorCode.BAD_MESSAGE,
         False),
        ('{"type": "start", "stream": "s", "voice": "%s"}' % ("v" * 129),
         ErrorCode.UNKNOWN_VOICE, True),
        ('{"type": "playback", "stream": "s", "seconds": -1}', ErrorCode.BAD_MESSAGE, False),
        ('{"type": "playback", "stream": "s", "seconds": "1"}', ErrorCode.BAD_MESSAGE, False),
    ],
)  # fmt: skip
def test_hostile_values_are_refused_with_their_codes(raw, code, final):
    with pytest.raises(ProtocolError) as info:
        parse_message(raw)
    assert info.value.code == code and info.value.final is final


@pytest.mark.parametrize("value", ["x" * 60_000, "line\nforged=1", ["list"], {"o": 1}])
def test_error_messages_echo_a_short_escaped_prefix(value):
    raw = json.dumps({"type": value, "stream": "s"})
    with pytest.raises(ProtocolError) as info:
        parse_message(raw)
    message = info.value.message
    assert len(message) < 200 and "\n" not in message and message.isprintable()


def test_pcm_encoder_formats_and_rates():
    frame = np.full(1920, 0.5, dtype=np.float32)
    assert len(PcmEncoder(24000, 24000, "pcm_s16le").encode(frame)) == 3840
    assert len(PcmEncoder(24000, 24000, "pcm_f32le").encode(frame)) == 7680
    encoder = PcmEncoder(24000, 8000, "pcm_s16le")
    total = sum(len(encoder.encode(frame)) for _ in range(10)) + len(encoder.finish())
    assert total == 10 * 640 * 2
    with pytest.raises(ValueError):
        PcmEncoder(24000, 24000, "mp3")


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_http_encoders_stream_decodable_audio(fmt):
    t = np.arange(24000) / 24000
    signal = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    encoder = make_encoder(fmt, 24000)
    chunks = [encoder.encode(signal[i : i + 1920]) for i in range(0, len(signal), 1920)]
    chunks.append(encoder.finish())
    assert sum(1 for c in chunks[:-1] if c) > 5, "nothing came out until the end"
    decoded, rate = soundfile.read(io.BytesIO(b"".join(chunks)), dtype="float32")
    assert rate == 24000
    assert abs(len(decoded) - len(signal)) < 3000  # mp3: encoder delay and padding


def test_wav_header_says_unknown_length():
    header = wav_header(24000)
    assert len(header) == 44 and header[4:8] == b"\xff\xff\xff\xff" and header[40:] == header[4:8]


@pytest.mark.parametrize(
    ("error", "code"),
    [
        ("InvalidTextError", ErrorCode.BAD_TEXT),
        ("TextTooLongError", ErrorCode.TEXT_TOO_LONG),
        ("EmptyTextError", ErrorCode.EMPTY_TEXT),
        ("InvalidOptionError", ErrorCode.BAD_OPTIONS),
        ("EngineFullError", ErrorCode.SERVER_BUSY),
        ("EngineFailedError", ErrorCode.ENGINE_ERROR),
    ],
)
def test_engine_errors_map_to_codes_by_type(error: str, code: ErrorCode) -> None:
    from intone.engine import errors

    assert protocol.engine_error_code(getattr(errors, error)("any message")) == code
