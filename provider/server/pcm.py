"""Model audio to a stream's PCM: streaming resampling (soxr) and sample formats."""

from __future__ import annotations

import numpy as np
import soxr

from intone.engine.audio import to_pcm16


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
