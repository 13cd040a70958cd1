"""What a stream yields: audio frames and clause boundaries.

Their own module, so that the stream, the decoder worker and the engine all import them without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class AudioChunk:
    """One frame of audio, float32 at the model's rate."""

    samples: np.ndarray
    clause: int


@dataclass
class ClauseDone:
    clause: int
    text: str
    frames: int
