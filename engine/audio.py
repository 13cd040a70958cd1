"""Audio file I/O, resampling (whole signals and streams) and PCM encoding, in one place."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import numpy as np
import soundfile
import soxr


def read_audio(path: str | Path) -> tuple[np.ndarray, int]:
    """Mono float32 samples in [-1, 1] and the file's sample rate; any format soundfile reads."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"audio file not found: {path}")
    try:
        data, sample_rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError) as e:
        raise ValueError(f"cannot read audio file {path}: {e}") from e
    if data.shape[0] == 0:
        raise ValueError(f"audio file {path} is empty")
    return data.mean(axis=1), int(sample_rate)


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    if from_rate == to_rate:
        return samples
    return soxr.resample(samples, from_rate, to_rate, quality="HQ").astype(np.float32)


def end_on_pause(
    wav: np.ndarray,
    sample_rate: int,
    pause_sec: float = 0.08,
    fade_sec: float = 0.02,
    floor_db: float = 35.0,
) -> np.ndarray:
    """End a voice prompt [..., T] (float32, on the host) on exactly `pause_sec` of silence, as
    the reference does.

    A prompt that stops mid-word makes the model continue that word; one that ends on a long
    silence delays the onset. Cut the trailing silence (20 ms frames more than `floor_db` below
    the loudest), fade out the last `fade_sec`, append `pause_sec` of zeros.
    """
    frame = max(1, int(0.02 * sample_rate))
    n = wav.shape[-1] // frame
    if n == 0:
        return wav
    frames = wav[..., : n * frame].reshape(-1, n, frame)
    rms = np.sqrt(np.square(frames).mean(axis=(0, 2), dtype=np.float32))
    db = 20 * np.log10(rms + np.float32(1e-12))
    loud = np.flatnonzero(db > db.max() - floor_db)
    end = (int(loud[-1]) + 1) * frame
    wav = wav[..., :end].copy()
    fade = min(int(fade_sec * sample_rate), end)
    wav[..., end - fade :] *= np.linspace(1, 0, fade, dtype=wav.dtype)
    pause = np.zeros((*wav.shape[:-1], int(pause_sec * sample_rate)), dtype=wav.dtype)
    return np.concatenate([wav, pause], axis=-1)


def write_wav(
    path: str | Path | BinaryIO, samples: np.ndarray, sample_rate: int, float32: bool = False
) -> None:
    """A WAV file whatever `path` is named (a seekable binary file works too)."""
    subtype = "FLOAT" if float32 else "PCM_16"
    target = str(path) if isinstance(path, str | Path) else path
    samples = np.asarray(samples, dtype=np.float32)
    soundfile.write(target, samples, sample_rate, subtype=subtype, format="WAV")


def to_pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def pcm_bytes(samples: np.ndarray, fmt: str) -> bytes:
    """Float samples in [-1, 1] as little-endian PCM: "pcm_s16le" or "pcm_f32le"."""
    if fmt == "pcm_s16le":
        return to_pcm16(samples)
    if fmt == "pcm_f32le":
        return np.clip(samples, -1.0, 1.0).astype("<f4").tobytes()
    raise ValueError(f"unknown sample format {fmt!r}")


class StreamResampler:
    """Chunks at `in_rate` to chunks at `out_rate`, continuous across chunk boundaries.

    One per stream: soxr keeps the filter state between chunks, so resampling frame by frame
    gives the same signal as resampling the whole utterance (no clicks at frame edges).
    """

    def __init__(self, in_rate: int, out_rate: int):
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream = (
            None
            if in_rate == out_rate
            else soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality="HQ")
        )

    def process(self, samples: np.ndarray) -> np.ndarray:
        samples = np.ascontiguousarray(samples, dtype=np.float32)
        if self._stream is None:
            return samples
        return self._stream.resample_chunk(samples)

    def finish(self) -> np.ndarray:
        """The filter's tail, once the input has ended."""
        if self._stream is None:
            return np.zeros(0, dtype=np.float32)
        return self._stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)


class PcmEncoder:
    """Model frames to PCM bytes at the stream's rate and format."""

    def __init__(self, in_rate: int, out_rate: int, fmt: str):
        pcm_bytes(np.zeros(0, dtype=np.float32), fmt)  # rejects an unknown format now
        self.format = fmt
        self._resampler = StreamResampler(in_rate, out_rate)

    def encode(self, samples: np.ndarray) -> bytes:
        return pcm_bytes(self._resampler.process(samples), self.format)

    def finish(self) -> bytes:
        return pcm_bytes(self._resampler.finish(), self.format)
