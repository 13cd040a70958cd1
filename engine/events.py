"""What a stream yields: audio frames and clause boundaries.

Their own module, so that the stream, the decoder worker and the engine all import them without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class AudioChunk:
    """One frame of audio, float32 at the model's rate."""

    samples: np.ndarray
    clause: int


@dataclass(frozen=True)
class WordTiming:
    """One word as the caller wrote it, and when it is heard (seconds from the stream's start)."""

    word: str
    start: float
    end: float


@dataclass
class ClauseDone:
    """A clause's audio has all been delivered; where it lies in the stream's audio.

    `start_sample` and `sample_count` count the samples the caller received (at the stream's
    speed; exact at speed 1.0). `words` are the caller's own words of `text` with estimated
    times, in seconds from the stream's first sample (`word_timing.py` says how they are estimated).
    """

    clause: int
    text: str
    frames: int
    eos_frame: int | None = None  # the clause's frame where the model signalled end of speech
    start_sample: int = 0
    sample_count: int = 0  # not `samples`: that name is AudioChunk's array
    words: list[WordTiming] = field(default_factory=list)
