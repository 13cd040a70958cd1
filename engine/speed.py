"""Speaking rate: streaming time-scale modification of a stream's decoded audio, pitch kept.

The model has no rate control, so `speed` is applied after decoding with WSOLA (waveform
similarity overlap-add, `audiotsm`): frames of the input are overlap-added at a different hop,
each shifted by up to `tolerance` samples to where it best continues the output, which keeps the
pitch and avoids phasing. One `TimeStretch` follows a stream from its first chunk to its end, so
the overlap-add runs across chunk and clause joins as if over one signal: no seams, no clicks.

It adds about one frame (1024 samples, 43 ms at 24 kHz) of delay, and the output length is the
input length / speed within about 1% (the analysis hop is a whole number of samples).
"""

from __future__ import annotations

import numpy as np
from audiotsm import wsola
from audiotsm.io.array import ArrayReader, ArrayWriter

MIN_SPEED = 0.5
MAX_SPEED = 2.0
_FRAME = 1024  # WSOLA frame: 43 ms at 24 kHz, audiotsm's default


class TimeStretch:
    """Time-scales one stream's audio, chunk by chunk: `feed` each chunk, `finish` at the end.

    At speed 1.0 it passes chunks through untouched (the same arrays, no delay).
    """

    def __init__(self, speed: float = 1.0) -> None:
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"speed must be in [{MIN_SPEED}, {MAX_SPEED}], got {speed}")
        self.speed = speed
        self._tsm = None if speed == 1.0 else wsola(1, speed=speed, frame_length=_FRAME)
        self.samples_in = 0
        self.samples_out = 0

    def feed(self, samples: np.ndarray) -> np.ndarray:
        """The output that `samples` (float32, mono) completes; may be empty."""
        self.samples_in += len(samples)
        if self._tsm is None:
            self.samples_out += len(samples)
            return samples
        return self._run(samples)

    def _run(self, samples: np.ndarray) -> np.ndarray:
        assert self._tsm is not None
        reader = ArrayReader(np.asarray(samples, dtype=np.float32)[None, :])
        writer = ArrayWriter(1)
        while not reader.empty:
            self._tsm.read_from(reader)
            finished = False
            while not finished:
                _, finished = self._tsm.write_to(writer)
        return self._take(writer)

    def finish(self) -> np.ndarray:
        """The output still held back (the last overlap); the stream's audio ends with it."""
        if self._tsm is None:
            return np.zeros(0, dtype=np.float32)
        # WSOLA only processes whole frames: a frame of silence pushes the last input through.
        expected = round(self.samples_in / self.speed)
        pushed = self._run(np.zeros(2 * _FRAME, dtype=np.float32))
        writer = ArrayWriter(1)
        finished = False
        while not finished:
            _, finished = self._tsm.flush_to(writer)
        out = np.concatenate([pushed, self._take(writer)])
        # What is past input/speed is the silence, not audio.
        if self.samples_out > expected:
            cut = min(len(out), self.samples_out - expected)
            out = out[: len(out) - cut]
            self.samples_out -= cut
        return out

    def _take(self, writer: ArrayWriter) -> np.ndarray:
        out = writer.data[0].astype(np.float32, copy=False)
        self.samples_out += len(out)
        return out

    def output_position(self, input_sample: int) -> int:
        """Where input sample `input_sample` lands in the output (WSOLA is linear on average)."""
        return round(input_sample / self.speed)
