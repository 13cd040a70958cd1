"""Streaming encoders for the OpenAI-compatible API: pcm, wav and mp3 (libsndfile's LAME).

Each turns float32 chunks into bytes that can be sent as soon as they are produced, so the
HTTP response streams instead of waiting for the whole utterance.
"""

from __future__ import annotations

import io
import struct
from typing import Protocol

import numpy as np
import soundfile

from intone.engine.audio import to_pcm16

# OpenAI's names -> content types. OpenAI also lists opus, aac and flac; not offered here.
CONTENT_TYPES = {"mp3": "audio/mpeg", "wav": "audio/wav", "pcm": "audio/pcm"}
FORMATS = tuple(CONTENT_TYPES)


class Encoder(Protocol):
    content_type: str

    def encode(self, samples: np.ndarray) -> bytes: ...

    def finish(self) -> bytes: ...


class RawPcmEncoder:
    """Headerless 16-bit little-endian mono PCM (OpenAI's `pcm`)."""

    content_type = CONTENT_TYPES["pcm"]

    def encode(self, samples: np.ndarray) -> bytes:
        return to_pcm16(samples)

    def finish(self) -> bytes:
        return b""


class WavEncoder(RawPcmEncoder):
    """16-bit PCM WAV whose length is unknown when the header goes out.

    The RIFF and data sizes are 0xFFFFFFFF, as streaming servers (OpenAI's included) send them;
    decoders read the data chunk to the end of the stream.
    """

    content_type = CONTENT_TYPES["wav"]

    def __init__(self, sample_rate: int):
        self._header: bytes | None = wav_header(sample_rate)

    def encode(self, samples: np.ndarray) -> bytes:
        header, self._header = self._header or b"", None
        return header + to_pcm16(samples)

    def finish(self) -> bytes:
        header, self._header = self._header or b"", None
        return header  # an empty utterance is still a valid (empty) WAV


def wav_header(sample_rate: int, channels: int = 1, bits: int = 16) -> bytes:
    unknown = 0xFFFFFFFF
    block = channels * bits // 8
    return (
        b"RIFF"
        + struct.pack("<I", unknown)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, bits)
        + b"data"
        + struct.pack("<I", unknown)
    )


class _AppendOnlySink(io.RawIOBase):
    """A write-only file for libsndfile that hands out bytes as they are written.

    libsndfile seeks back at close to patch headers; bytes already sent cannot change, so
    writes behind the end are dropped. Its MP3 writer needs nothing patched to be decodable.
    """

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._end = 0
        self._position = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def write(self, data: bytes) -> int:  # type: ignore[override]
        if self._position == self._end:
            self._chunks.append(bytes(data))
            self._end += len(data)
        self._position += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._end}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def take(self) -> bytes:
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data


class Mp3Encoder:
    """MPEG layer III through libsndfile (LAME), constant bit rate, mono."""

    content_type = CONTENT_TYPES["mp3"]

    def __init__(self, sample_rate: int, compression_level: float = 0.5):
        self._sink = _AppendOnlySink()
        self._file = soundfile.SoundFile(
            self._sink,
            "w",
            samplerate=sample_rate,
            channels=1,
            format="MP3",
            subtype="MPEG_LAYER_III",
            bitrate_mode="CONSTANT",
            compression_level=compression_level,
        )

    def encode(self, samples: np.ndarray) -> bytes:
        if len(samples):
            self._file.write(np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0))
        return self._sink.take()

    def finish(self) -> bytes:
        if not self._file.closed:
            self._file.close()
        return self._sink.take()


def make_encoder(response_format: str, sample_rate: int) -> Encoder:
    if response_format == "pcm":
        return RawPcmEncoder()
    if response_format == "wav":
        return WavEncoder(sample_rate)
    if response_format == "mp3":
        return Mp3Encoder(sample_rate)
    raise ValueError(f"unsupported response_format {response_format!r}; supported: {FORMATS}")
