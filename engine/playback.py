"""Where a stream's listener is: its playback position, from the consumer's reports or, until it
reports, a clock that starts at the first delivered sample and runs in real time while there is
audio to play (it waits at the end of the delivered audio, as a player does on an underrun).
Reading is not playing: a consumer that reads faster than real time and never reports is
estimated at that clock. Pacing (`pacing.py`) compares the audio generated with this position.

In the listener's seconds: with `speed` a model frame lasts `frame / speed` when heard.
"""

from __future__ import annotations

import threading


class Playback:
    """Where a stream's listener is. Written by the decoder thread (deliveries) and the caller
    (reports), read by the AR thread; a small lock keeps the three consistent."""

    def __init__(self, speed: float = 1.0) -> None:
        self._lock = threading.Lock()
        self.speed = speed
        self.delivered = 0.0  # listening seconds of audio handed to the stream
        self.last_delivery_at: float | None = None
        self._position = 0.0
        self._at: float | None = None  # when `_position` was last brought up to date
        self._reported = False

    def deliver(self, seconds: float, now: float) -> None:
        """`seconds` of model audio (before `speed`) reached the stream."""
        with self._lock:
            self._advance(now)
            if self._at is None:
                self._at = now  # the clock starts at the first delivered sample
            self.delivered += seconds / self.speed
            self.last_delivery_at = now

    def restart(self, now: float) -> None:
        """None of the audio delivered so far was heard before `now` (a guessed first clause's,
        held back until its text confirmed it: `Stream._settle`): the clock starts again here."""
        with self._lock:
            if self._at is not None and not self._reported:
                self._position, self._at = 0.0, now

    def report(self, seconds: float, now: float) -> None:
        """The consumer's own position: from now on the clock is what it reports."""
        with self._lock:
            self._reported = True
            self._position = seconds
            self._at = now

    def buffered(self, now: float) -> float:
        """Seconds of delivered audio the listener has not played yet: how far from an underrun."""
        with self._lock:
            self._advance(now)
            return self.delivered - self._position

    def position(self, now: float) -> float:
        with self._lock:
            self._advance(now)
            return self._position

    def _advance(self, now: float) -> None:
        if self._at is None or self._reported:
            return
        self._position = min(self._position + (now - self._at), self.delivered)
        self._at = now
