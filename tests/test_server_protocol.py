"""The wire format on its own: message parsing, the binary header, streaming encoders."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile
from hypothesis import given
from hypothesis import strategies as st

from intone.provider.server import protocol
from intone.provider.server.encoders import make_encoder, wav_header
from intone.provider.server.pcm import PcmEncoder
from intone.provider.server.protocol import ErrorCode, ProtocolError, parse_message


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
    message = parse_message(
        protocol.start_message(
            "a", voice="v", sample_rate=16000, format="pcm_f32le",
            options={"seed": 1, "temperature": 0.5}, text="Hi.", end=True,
        )
    )  # fmt: skip
    assert message == protocol.Start("a", "v", 16000, "pcm_f32le", {"seed": 1, "temperature": 0.5},
                                     "Hi.", True)  # fmt: skip


@pytest.mark.parametrize("kind", ["text", "flush", "end", "cancel"])
def test_parse_control_messages(kind):
    text = "hello" if kind == "text" else None
    message = parse_message(protocol.control_message(kind, "s", text))
    assert type(message).__name__.lower() == kind and message.stream == "s"


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
        ('{"type": "start", "stream": "s", "end": "yes"}', ErrorCode.BAD_MESSAGE, True),
    ],
)  # fmt: skip
def test_parse_errors(raw, code, final):
    with pytest.raises(ProtocolError) as info:
        parse_message(raw)
    assert info.value.code == code and info.value.final is final


def test_terminal_events():
    assert protocol.is_terminal({"type": "done"})
    assert protocol.is_terminal({"type": "cancelled"})
    assert protocol.is_terminal(protocol.error_event("x", "m", "s", final=True))
    assert not protocol.is_terminal(protocol.error_event("x", "m", "s", final=False))
    assert not protocol.is_terminal({"type": "clause_done"})


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
