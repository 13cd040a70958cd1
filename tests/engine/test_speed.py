"""Speed: streaming WSOLA on a stream's audio keeps pitch, scales duration, and has no seams."""

from __future__ import annotations

import math

import numpy as np
import pytest

from intone.engine.errors import InvalidOptionError
from intone.engine.options import GenerationOptions
from intone.engine.speed import TimeStretch

RATE = 24_000
CHUNK = 1920  # one model frame
SECONDS = 6.0
SPEEDS = [0.5, 0.75, 1.25, 1.6, 2.0]


def tone(freq: float = 220.0, seconds: float = SECONDS) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    # A little vibrato-free harmonic content, like a voiced vowel.
    wave = 0.4 * np.sin(2 * np.pi * freq * t) + 0.1 * np.sin(2 * np.pi * 2 * freq * t)
    return wave.astype(np.float32)


def stream(
    stretch: TimeStretch, audio: np.ndarray, chunk: int = CHUNK
) -> tuple[np.ndarray, list[int]]:
    """The output of feeding `audio` chunk by chunk, and where each chunk's output starts."""
    parts, joins, n = [], [], 0
    for i in range(0, len(audio), chunk):
        out = stretch.feed(audio[i : i + chunk])
        joins.append(n)
        n += len(out)
        parts.append(out)
    parts.append(stretch.finish())
    joins.append(n)
    return np.concatenate(parts), joins


def pitch(audio: np.ndarray) -> float:
    """The strongest frequency of the middle of `audio`, interpolated between FFT bins."""
    mid = audio[len(audio) // 4 : 3 * len(audio) // 4]
    spectrum = np.abs(np.fft.rfft(mid * np.hanning(len(mid)), n=8 * len(mid)))
    k = int(np.argmax(spectrum))
    a, b, c = np.log(spectrum[k - 1 : k + 2])
    offset = 0.5 * (a - c) / (a - 2 * b + c)
    return (k + offset) * RATE / (8 * len(mid))


@pytest.mark.parametrize("speed", SPEEDS)
def test_duration_scales_by_one_over_speed(speed: float) -> None:
    audio = tone()
    out, _ = stream(TimeStretch(speed), audio)
    ratio = len(out) / len(audio)
    assert abs(ratio * speed - 1) < 0.03, f"speed {speed}: duration ratio {ratio:.4f}"


@pytest.mark.parametrize("speed", SPEEDS)
def test_pitch_is_kept(speed: float) -> None:
    audio = tone(220.0)
    out, _ = stream(TimeStretch(speed), audio)
    assert abs(pitch(audio) / 220.0 - 1) < 0.002  # the measure itself is sound
    assert abs(pitch(out) / 220.0 - 1) < 0.02, f"speed {speed}: pitch {pitch(out):.1f} Hz"


@pytest.mark.parametrize("speed", SPEEDS)
def test_no_seams_at_chunk_joins(speed: float) -> None:
    audio = tone()
    out, joins = stream(TimeStretch(speed), audio)
    # Chunking does not change the output: the state carries across joins.
    whole, _ = stream(TimeStretch(speed), audio, chunk=len(audio))
    np.testing.assert_allclose(out, whole, atol=1e-6)
    # And nowhere, joins included, does the waveform jump more than the tone itself moves.
    steps = np.abs(np.diff(out[CHUNK:-CHUNK]))
    largest_step = float(np.max(np.abs(np.diff(audio))))
    assert float(np.max(steps)) < 1.5 * largest_step
    for join in joins[1:-2]:
        if CHUNK < join < len(out) - CHUNK:
            assert abs(float(out[join] - out[join - 1])) < 1.5 * largest_step, join


def test_speed_one_passes_audio_through() -> None:
    audio = tone(seconds=0.5)
    stretch = TimeStretch(1.0)
    chunks = [audio[i : i + CHUNK] for i in range(0, len(audio), CHUNK)]
    assert all(stretch.feed(c) is c for c in chunks)
    assert len(stretch.finish()) == 0
    assert stretch.output_position(12345) == 12345


def test_speed_option_bounds() -> None:
    assert GenerationOptions().speed == 1.0
    for good in (0.5, 1, 2.0):
        assert GenerationOptions(speed=good).speed == good
    for bad in (0.49, 2.01, math.nan, math.inf, True, "fast", None):
        with pytest.raises(InvalidOptionError, match="speed"):
            GenerationOptions(speed=bad)
    with pytest.raises(ValueError, match="speed"):
        TimeStretch(3.0)
