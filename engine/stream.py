"""A request as its caller holds it: text in, audio events out, on the caller's event loop.

Engine threads hand events over with `loop.call_soon_threadsafe`, so a stream works from any
asyncio loop, several loops at once included (LiveKit's thread executor gives every job its own).
A stream talks to its engine only through the engine's public request methods, the
`StreamHost` protocol (`plan`, `submit`, `cancel`, ...).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator
from typing import Protocol

import numpy as np

from intone.engine.config import PUSH_PIECE_CHARS, EngineConfig
from intone.engine.errors import (
    EmptyTextError,
    InvalidOptionError,
    StreamClosedError,
    TextTooLongError,
)
from intone.engine.events import AudioChunk, ClauseDone, WordTiming
from intone.engine.loading import LoadedModel
from intone.engine.options import ClausePlan
from intone.engine.request import Clause, Phase, Request, RequestMetrics, now
from intone.engine.text import ClauseSplitter, check_text
from intone.engine.word_timing import Timeline

__all__ = ["AudioChunk", "ClauseDone", "Stream", "StreamHost", "WordTiming"]


class StreamHost(Protocol):
    """What a stream asks of its engine (`Engine` is the one host)."""

    config: EngineConfig
    loaded: LoadedModel

    @property
    def sample_rate(self) -> int: ...

    def plan(self, request: Request, text: str) -> ClausePlan: ...

    def submit(self, request: Request, clauses: list[Clause], end: bool) -> None: ...

    def cancel(self, request: Request) -> None: ...

    def wake(self) -> None: ...

    def unread_seconds(self, request: Request) -> float: ...

    def held(self, request: Request, t: float) -> bool: ...


class Stream:
    """One request: text in (push, flush, end), audio out (async iteration)."""

    def __init__(self, engine: StreamHost, request: Request, splitter: ClauseSplitter):
        self._engine = engine
        self.request = request
        self._splitter = splitter
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self._closed = False
        self._ended = False
        self._chars = 0
        self._clauses = 0
        self._has_text = False
        # Speed and clause/word timing, applied as events reach the caller.
        self._timeline = Timeline.for_stream(engine.loaded, request.options)
        self._ready: deque[AudioChunk | ClauseDone] = deque()
        # The first clause's wait (`ClauseSplitter.deadline`) as a loop timer, so that the cut
        # comes even if no more text does.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_for: float | None = None  # the deadline it was set for
        self._done = 0  # clauses whose ClauseDone reached this loop
        self._dry_timer: asyncio.TimerHandle | None = None  # the deadline rule's next look
        self._reported_at: float | None = None  # when the last playback report came

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def metrics(self) -> RequestMetrics:
        return self.request.metrics

    def push_text(self, text: str) -> None:
        """Append text (e.g. LLM tokens as they arrive). Refused text changes nothing: the
        stream carries on."""
        self._check_open()
        check_text(text)
        self._check_length(len(text))
        self._chars += len(text)
        self._has_text |= bool(text.strip())
        self._submit(self._splitter.push(text))
        self._arm_timer()
        self._check_dry()

    async def push_long_text(self, text: str) -> None:
        """`push_text` for text that may be long (a document, not LLM tokens): the same
        clauses, planned a piece at a time with the event loop free in between.

        Planning costs 15-50 us a character (spoken form, clause cuts, tokens), so 20,000
        characters in one `push_text` hold the loop for 0.3-1 s, and every other stream served
        from that loop waits. The whole text is checked first, so refused text changes nothing;
        a cancel from another task meanwhile ends it with StreamClosedError."""
        self._check_open()
        check_text(text)
        self._check_length(len(text))
        for start in range(0, len(text), PUSH_PIECE_CHARS):
            if start:
                await asyncio.sleep(0)
            self.push_text(text[start : start + PUSH_PIECE_CHARS])

    def _check_length(self, chars: int) -> None:
        limit = self._engine.config.max_text_chars
        if self._chars + chars > limit:
            raise TextTooLongError(f"text over the limit of {limit} characters")

    def flush(self) -> None:
        """End the current clause here, whatever its length."""
        self._check_open()
        self._submit(self._splitter.flush())
        self._arm_timer()

    def end_input(self) -> None:
        self._check_open()
        if not self._has_text:
            raise EmptyTextError("no text was pushed: nothing to synthesise")
        self._submit(self._splitter.end(), end=True)
        self._disarm_timer()

    def cancel(self) -> None:
        """Stop now: no audio is delivered after this returns; engine state is released."""
        self._closed = True
        self._disarm_timer()
        self._engine.cancel(self.request)
        # Audio already handed over but not yet consumed is dropped too.
        while not self._events.empty():
            self._events.get_nowait()
        self._ready.clear()
        self._events.put_nowait(None)

    @property
    def unread_seconds(self) -> float:
        """Seconds of this stream's audio generated and not read yet (`EngineConfig.max_unread_s`
        bounds it)."""
        return self._engine.unread_seconds(self.request)

    def held(self) -> bool:
        """Whether this stream has text to speak that pacing keeps it from speaking now: it is
        `EngineConfig.lead_s` ahead of its playback, or has `max_unread_s` unread. It makes
        no audio until the listener moves on (with reports, until it reports again)."""
        request = self.request
        working = bool(request.pending) or request.phase in (Phase.PREFILL, Phase.GENERATING)
        return working and self._engine.held(request, now())

    def report_playback(self, seconds: float) -> None:
        """How many seconds of this stream's audio the listener has played.

        Generation then stays at most `EngineConfig.lead_s` ahead of it (without reports, of a
        real-time clock started at the first audio)."""
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise InvalidOptionError(f"playback must be a number of seconds, got {seconds!r}")
        if not math.isfinite(seconds) or seconds < 0:
            raise InvalidOptionError(f"playback must be finite and >= 0, got {seconds!r}")
        self._reported_at = now()
        self.request.playback.report(float(seconds), self._reported_at)
        self._engine.wake()
        self._check_dry()

    def _check_open(self) -> None:
        if self._closed or self.request.input_ended:
            raise StreamClosedError(f"stream {self.id} no longer takes input")

    def _arm_timer(self) -> None:
        deadline = self._splitter.deadline
        if deadline is None or deadline == self._timer_for:
            return  # no wait running, or its timer is set (or has fired)
        if self._timer is not None:
            self._timer.cancel()
        self._timer_for = deadline
        delay = max(0.0, deadline - self._splitter.clock())
        self._timer = self._loop.call_later(delay, self._on_timer)

    def _disarm_timer(self) -> None:
        """Stop both timers: no more text will be cut here."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._dry_timer is not None:
            self._dry_timer.cancel()
            self._dry_timer = None

    def _on_timer(self) -> None:
        """The first clause's wait ran out: cut it at its last word boundary."""
        self._timer = None
        if self._closed or self.request.input_ended:
            return
        try:
            self._submit(self._splitter.poll())
        except Exception as e:  # a clause that cannot be planned ends this stream, typed
            self._fail(e)

    def _check_dry(self) -> None:
        """The deadline rule: when the audio this stream has will run out before the clause
        being built is complete, cut it at the best boundary there is (`cut_now`) rather than
        let the listener hear silence: `EngineConfig.cut_before_dry_s` before it runs out. It
        applies once every clause given to the engine has been spoken (so audio is all the
        listener has left)."""
        if self._dry_timer is not None:
            self._dry_timer.cancel()
            self._dry_timer = None
        splitter = self._splitter
        margin = self._engine.config.cut_before_dry_s
        if (
            margin is None
            or self._closed
            or self.request.input_ended
            or self._clauses == 0
            or self._done < self._clauses
            or not splitter.holds_words
        ):
            return
        t = now()
        left = self.request.playback.buffered(t) - margin
        if self._reported_at is not None:
            # Pacing holds a reported position until the next report; the listener plays on.
            left -= t - self._reported_at
        if left > 0:
            self._dry_timer = self._loop.call_later(left, self._check_dry)
            return
        try:
            self._submit(splitter.cut_now())
        except Exception as e:  # a clause that cannot be planned ends this stream, typed
            self._fail(e)

    def _fail(self, error: Exception) -> None:
        self._disarm_timer()
        self._engine.cancel(self.request)
        self._deliver(error)

    def _submit(self, texts: list[str], end: bool = False) -> None:
        clauses = []
        for text in texts:
            plan = self._engine.plan(self.request, text)
            clauses.append(Clause(self._clauses, text, plan))
            self._clauses += 1
        self._engine.submit(self.request, clauses, end)

    def post(self, event: object) -> None:
        """Hand an event over from an engine thread: audio, a clause end, None (the end) or
        an exception (the end, failed)."""
        try:
            self._loop.call_soon_threadsafe(self._deliver, event)
        except RuntimeError:  # the consumer's loop is gone: nobody will read this stream
            self._engine.cancel(self.request)

    def _deliver(self, event: object) -> None:
        if not self._closed:
            if event is None or isinstance(event, Exception):
                self._closed = True
                self._disarm_timer()
            self._events.put_nowait(event)
            if isinstance(event, ClauseDone):
                self._done += 1
                self._check_dry()

    def __aiter__(self) -> AsyncIterator[AudioChunk | ClauseDone]:
        return self

    async def __anext__(self) -> AudioChunk | ClauseDone:
        while not self._ready:
            if self._ended:
                raise StopAsyncIteration
            event = await self._events.get()
            if event is None:
                self._ended = True
                if not self.request.cancelled:  # a cancelled stream delivers nothing more
                    tail = self._timeline.end()
                    if len(tail):
                        self._ready.append(AudioChunk(tail, self._timeline.last_clause))
            elif isinstance(event, Exception):
                self._ended = True
                raise event
            elif isinstance(event, AudioChunk):
                self.request.read_seconds += len(event.samples) / self._engine.sample_rate
                chunk = self._timeline.audio(event)
                if chunk is not None:
                    self._ready.append(chunk)
            elif isinstance(event, ClauseDone):
                self._ready.append(self._timeline.clause_done(event))
            else:
                self._ready.append(event)
        return self._ready.popleft()

    async def audio(self) -> AsyncIterator[np.ndarray]:
        async for event in self:
            if isinstance(event, AudioChunk):
                yield event.samples
