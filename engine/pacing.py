"""Playback-paced generation: how far a stream's audio runs ahead of the listener.

A stream's playback position is either what its consumer reports (`Stream.report_playback`), or,
until it reports, a clock that starts at the first delivered sample and runs in real time while
there is audio to play (it waits at the end of the delivered audio, as a player does on an
underrun). The AR stage compares the audio a stream has generated with that position: a stream
more than `lead_s` ahead takes no AR steps until playback catches up, so its row's compute goes
to streams that are behind and to new requests. Pacing never changes the audio: a held stream
simply takes its next step later, on its own generator.

Everything here is in the listener's seconds: with `speed` (time-scaling after the decoder) a
model frame lasts `frame / speed` when heard, and that is what a report counts and what runs
out on an underrun.
"""

from __future__ import annotations

import threading

# A stream with less audio than this ahead of its listener is near an underrun: the decoder
# decodes it first, and while one that plays is, a prefill pass takes fewer new streams
# (`EngineConfig.max_prefill_rows_near_underrun`).
URGENT_S = 0.5


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
