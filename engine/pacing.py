"""Playback-paced generation: how far a stream's audio runs ahead of the listener, and what a
stream that is far ahead may still take.

A stream's playback position is either what its consumer reports (`Stream.report_playback`), or,
until it reports, a clock that starts at the first delivered sample and runs in real time while
there is audio to play (it waits at the end of the delivered audio, as a player does on an
underrun). Reading is not playing: a consumer that reads faster than real time and never reports
(a file render, an OpenAI client saving an mp3) is estimated at that real-time clock, so it is
never "behind" and never goes before a listener that is; it is simply far ahead.

`PacingPolicy` (owned by the scheduler) compares the audio a stream has generated with that
position. Its `mode` (`EngineConfig.pacing`) says what a stream more than `lead_s` ahead may do:

- "yield" (the default): it takes only the compute no stream within `lead_s` needs. Its AR steps
  run when no such stream steps (a step's padding rows aside), its clauses' prompt passes when
  nothing else is prefilled or due, and the decoder decodes its latents only when no other
  stream's wait (`DecoderWorker`). So an idle machine renders as fast as it can, and under load
  the streams within `lead_s`, new requests first, go first at every step.
- "hold": it takes no AR steps until playback catches up.
- "off": no lead at all; only `max_unread_s` applies.

In every mode a stream whose consumer has more than `max_unread_s` unread takes no AR steps (it is
not dropped). Pacing never changes the audio: a stream simply takes its next step later, on its
own generator.

Everything here is in the listener's seconds: with `speed` (time-scaling after the decoder) a
model frame lasts `frame / speed` when heard, and that is what a report counts and what runs
out on an underrun.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from intone.engine.config import (
    AHEAD_OF_DECODER_CALLS,
    DUE_DECODER_CALLS,
    DUE_LEAD_SHARE,
    EngineConfig,
    PacingMode,
)
from intone.engine.request import Request


class Need(Enum):
    """How much a stream holding a row needs its next AR step (a clause end counts too)."""

    NONE = "none"  # held, or far enough ahead of the decoder: it takes no step
    SPARE = "spare"  # more than lead_s ahead, pacing "yield": only steps nobody else needs
    SOON = "soon"  # it may take one: it steps in a burst, but starts none
    NOW = "now"  # it is due: a burst starts


@dataclass
class PacingPolicy:
    """Where each stream stands against its listener, and so what it may take (module doc).

    Pure bookkeeping on a request's counters and its `Playback` at a time `t` the caller gives:
    no threads, no clock of its own."""

    mode: PacingMode
    lead_s: float | None
    max_unread_s: float | None
    frame_seconds: float  # one model frame (before `speed`)
    decode_frames: int  # latents per request per decode call (`EngineConfig.max_decode_frames`)

    @classmethod
    def from_config(cls, config: EngineConfig, frame_seconds: float) -> PacingPolicy:
        return cls(
            config.pacing,
            config.lead_s,
            config.max_unread_s,
            frame_seconds,
            config.max_decode_frames,
        )

    @property
    def paced(self) -> bool:
        """Whether the lead counts at all."""
        return self.mode != "off" and self.lead_s is not None

    @property
    def yield_after_s(self) -> float | None:
        """Seconds ahead past which a stream yields (pacing "yield"); None: none does."""
        return self.lead_s if self.paced and self.mode == "yield" else None

    def lead(self, request: Request, t: float) -> float:
        """Listening seconds of the request's audio generated ahead of its playback."""
        playback = request.playback
        return request.frames_generated * self.frame_seconds / playback.speed - playback.position(t)

    def unread(self, request: Request) -> float:
        """Seconds of the request's audio its consumer has not read: delivered and waiting, or
        still in the decoder (counting only delivered audio lets a decoder backlog overshoot)."""
        return request.frames_generated * self.frame_seconds - request.read_seconds

    def ahead(self, request: Request, t: float) -> bool:
        """More than `lead_s` ahead of its listener (whatever the mode, for the metrics)."""
        return self.lead_s is not None and self.lead(request, t) > self.lead_s

    def held(self, request: Request, t: float) -> bool:
        """Takes no AR step at all: too much audio unread, or (pacing "hold") far ahead."""
        limit = self.max_unread_s
        if limit is not None and self.unread(request) > limit:
            return True
        return self.paced and self.mode == "hold" and self.ahead(request, t)

    def need(self, request: Request, t: float, generating: bool) -> Need:
        """How much a stream holding a row needs its next AR step; `generating`: a clause of it
        has had its prompt pass (otherwise it is between clauses or waiting for that pass).

        None while held, or while it has `AHEAD_OF_DECODER_CALLS` decode calls' worth of latents
        not yet decoded (the decoder is the slower stage: steps taken further ahead only take its
        cores); spare while it is more than `lead_s` ahead with pacing "yield"; now once it is
        down to `DUE_DECODER_CALLS` of them and, paced, under `DUE_LEAD_SHARE` of `lead_s` ahead
        of playback; soon in between. A row that comes due starts a burst of steps
        (`Scheduler.schedule`) that every row that may step joins until it may not: steps are few
        and large, not one per row as each comes due. Between clauses only pacing counts (a
        stream not due then gives its row to a waiting one): the latents still to decode say how
        far the decoder lags, not how soon the listener needs the next clause."""
        if self.held(request, t):
            return Need.NONE
        spare = self.yield_after_s is not None and self.ahead(request, t)
        lead_s = self.lead_s
        paced_due = not self.paced or (
            lead_s is not None and self.lead(request, t) < DUE_LEAD_SHARE * lead_s
        )
        if generating:
            undecoded = request.frames_generated - request.frames_delivered
            if undecoded >= AHEAD_OF_DECODER_CALLS * self.decode_frames:
                return Need.NONE
            if spare:
                return Need.SPARE
            # A new stream's first frame, which plays for one frame only, decodes sooner with
            # no AR step beside it (full size, 2 cores: 12 ms alone, 17-21 ms beside one): its
            # next step joins a burst, but starts none until that audio is out.
            due = (
                undecoded < DUE_DECODER_CALLS * self.decode_frames
                and not request.first_audio_decoding
            )
            return Need.NOW if paced_due and due else Need.SOON
        if spare:
            return Need.SPARE
        return Need.NOW if paced_due else Need.SOON
