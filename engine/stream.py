"""A request as its caller holds it: text in, audio events out, on the caller's event loop; and
the engine's side of it, `StreamHost`.

Engine threads hand events over with `loop.call_soon_threadsafe`, so a stream works from any
asyncio loop, several loops at once included (LiveKit's thread executor gives every job its own).
A stream talks to its engine only through its `StreamHost`, which makes its request and, under
the engine lock, plans and queues its clauses, cancels it and says what pacing holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from functools import partial

import numpy as np

from intone.engine.config import (
    DRAFT_BEFORE_WAIT_ENDS_S,
    GUESS_GRACE_S,
    PUSH_PIECE_CHARS,
    EngineConfig,
)
from intone.engine.errors import (
    EmptyTextError,
    InvalidOptionError,
    StreamClosedError,
    TextTooLongError,
)
from intone.engine.events import AudioChunk, ClauseDone, WordTiming
from intone.engine.generate import make_generator
from intone.engine.loading import LoadedModel
from intone.engine.options import ClausePlan, GenerationOptions
from intone.engine.pacing import PacingPolicy
from intone.engine.playback import Playback
from intone.engine.request import Clause, Draft, Phase, Request, RequestMetrics, now
from intone.engine.scheduler import Scheduler
from intone.engine.text import ClauseSplitter, check_text, plan_clause
from intone.engine.word_timing import Timeline

__all__ = ["AudioChunk", "ClauseDone", "Stream", "StreamHost", "WordTiming"]

logger = logging.getLogger(__name__)


class StreamHost:
    """The engine's side of its streams (`Engine.stream_host`): a new stream's request, then,
    under the engine lock, its clauses planned against the KV pool and queued for the
    scheduler, its cancel, and what pacing says of it."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        lock: threading.Condition,
        scheduler: Scheduler,
        pacing: PacingPolicy,
        admit: Callable[[Request, Request | None], None],
    ):
        self.config = config
        self.loaded = loaded
        self.lock = lock
        self.scheduler = scheduler
        self.pacing = pacing
        # `Engine.admit`: a request into the engine, optionally in place of another.
        self.admit = admit
        self._ids = itertools.count()

    @property
    def sample_rate(self) -> int:
        return self.loaded.sample_rate

    def new_stream(
        self, voice: str, options: GenerationOptions | None, tenant: str | None
    ) -> Stream:
        """A stream on `voice`, not admitted yet (`Engine.stream` admits it). InvalidOptionError
        for a tenant that is not a str, or a flow-step count this engine does not run."""
        if tenant is not None and not isinstance(tenant, str):
            # The AR stage counts rows per tenant: an unhashable one would fail it, for all.
            raise InvalidOptionError(f"tenant must be a str or None, got {type(tenant).__name__}")
        if options is None:
            options = GenerationOptions(chain_frames=self.config.default_chain_frames)
        else:
            # A private copy, validated again: the caller's object may have been changed since
            # it was built, and must not change this stream later.
            options = replace(options)
        if options.flow_steps != self.config.flow_steps:
            raise InvalidOptionError(
                f"this engine runs {self.config.flow_steps} flow step(s); got {options.flow_steps}"
            )
        splitter = ClauseSplitter(
            self.loaded.tokenizer,
            min_tokens=self.config.clause_min_tokens,
            first_clause_min_words=options.first_clause_min_words,
            first_clause_max_wait_ms=options.first_clause_max_wait_ms,
            max_tokens=self.config.clause_max_tokens,
        )
        return Stream(self, self._request(voice, options, tenant), splitter)

    def _request(self, voice: str, options: GenerationOptions, tenant: str | None) -> Request:
        model_config = self.loaded.config
        return Request(
            id=f"req-{next(self._ids)}",
            voice=voice,
            temperature=(
                model_config.default_temperature
                if options.temperature is None
                else options.temperature
            ),
            eos_threshold=(
                model_config.default_eos_threshold
                if options.eos_threshold is None
                else options.eos_threshold
            ),
            noise_clamp=options.noise_clamp,
            chain_frames=options.chain_frames,
            generator=make_generator(options.seed),
            metrics=RequestMetrics(submitted_at=now(), sample_rate=self.sample_rate),
            options=options,
            playback=Playback(options.speed),
            tenant=tenant,
        )

    def reseat(self, stream: Stream) -> Request:
        """A fresh request for `stream`, admitted in place of its current one, which ends with
        no event (`Stream._settle`: its first clause was spoken on a guess the text then
        proved wrong). What admission raises (EngineClosedError, UnknownVoiceError, ...)."""
        old = stream.request
        fresh = self._request(old.voice, old.options, old.tenant)
        fresh.sink = partial(stream.post, fresh)
        self.admit(fresh, old)
        return fresh

    def plan(self, request: Request, text: str) -> ClausePlan:
        """The plan of one clause of `request`; TextTooLongError if it could never fit."""
        options = request.options
        if self.config.max_frames is not None:
            options = replace(
                options,
                max_frames=min(
                    options.max_frames or self.config.max_frames, self.config.max_frames
                ),
            )
        plan = plan_clause(self.loaded, text, options)
        with self.lock:
            pages = self.scheduler.clause_pages(
                request.voice, request.chain_frames + len(plan.tokens), plan.max_frames
            )
            capacity = self.scheduler.clause_capacity()
        if pages > capacity:
            raise TextTooLongError(
                f"a clause needs {pages} KV pages but only {capacity} of the pool's "
                f"{self.scheduler.blocks.num_pages} are not held by voices: raise num_pages or "
                "lower max_frames"
            )
        return plan

    def draft(self, request: Request, text: str, wait_cut: str | None) -> None:
        """The text of `request`'s first clause so far, before it is cut, and, while its wait
        runs, where the wait would cut it (`Stream._draft`): their prompt passes may begin now
        (`Draft`). Only a head start: text that cannot be planned has none (its clause says why
        when it is cut)."""
        try:
            plans = [self.plan(request, text)]
            if wait_cut is not None and wait_cut != text.strip():
                plans.append(self.plan(request, wait_cut))
        except ValueError:
            return
        # The last token is the mark the text preparation ends a clause with, where the rest
        # of this clause's words will go.
        tokens = plans[0].tokens[:-1]
        if not tokens:
            return
        wholes = [plan.tokens for plan in plans]
        with self.lock:
            if request.frames_generated or request.pending or request.phase is not Phase.WAITING:
                return  # the clause is cut (or the stream over): the draft is too late
            if request.draft is None:
                request.draft = Draft(tokens, wholes)
            else:
                request.draft.tokens, request.draft.wholes = tokens, wholes
            self.lock.notify_all()

    def submit(self, request: Request, clauses: list[Clause], end: bool) -> None:
        """Queue planned clauses of `request`; `end`: no more will come."""
        with self.lock:
            request.pending.extend(clauses)
            request.input_ended |= end
            request.last_text_at = now()
            if request.metrics.clauses == 0 and clauses:
                request.metrics.submitted_at = now()
            request.metrics.clauses += len(clauses)
            if request.pending:
                self.scheduler.ready(request)
            self.lock.notify_all()

    def cancel(self, request: Request) -> None:
        with self.lock:
            request.cancelled = True
            self.lock.notify_all()

    def wake(self) -> None:
        """Something pacing depends on changed (a playback report, audio read): look again."""
        with self.lock:
            self.lock.notify_all()

    def unread_seconds(self, request: Request) -> float:
        """Seconds of the request's audio its consumer has not read (`PacingPolicy.unread`)."""
        return self.pacing.unread(request)

    def held(self, request: Request, t: float) -> bool:
        """Pacing holds the request: too much audio unread, or (pacing "hold") far ahead."""
        return self.pacing.held(request, t)


class Stream:
    """One request: text in (push, flush, end), audio out (async iteration)."""

    def __init__(self, host: StreamHost, request: Request, splitter: ClauseSplitter):
        self._host = host
        self.request = request
        request.sink = partial(self.post, request)
        self._splitter = splitter
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self._closed = False
        self._ended = False
        self._chars = 0
        self._clauses = 0
        self._has_text = False
        # The first clause's text so far and its wait's cut, last given as its draft.
        self._drafted: tuple[str, str | None] | None = None
        # The first clause, queued before the text confirmed where it ends (`_guess`), and
        # its events, held back until the text does.
        self._guessed: str | None = None
        self._held: list[AudioChunk | ClauseDone] = []
        # Speed and clause/word timing, applied as events reach the caller.
        self._timeline = Timeline.for_stream(host.loaded, request.options)
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
        """Append text (e.g. LLM tokens as they arrive). Text refused as it comes (bad text,
        over the length limit) changes nothing: the stream carries on. A clause it completes
        that can never fit the KV pool ends the stream (`_submit`)."""
        self._check_open()
        check_text(text)
        self._check_length(len(text))
        self._chars += len(text)
        self._has_text |= bool(text.strip())
        self._submit(self._splitter.push(text))
        self._draft()
        self._guess()
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

    def _draft(self) -> None:
        """Give the engine the first clause's text so far, before the clause is cut, and
        where its wait would cut it: its prompt pass begins while the caller waits for the
        clause's end, and the clauses it may end as are prepared (`Draft`). The next token
        most often ends the word still coming, or the clause with a mark; where the wait runs
        out first, it cuts the clause a word shorter ("Your total comes" of "Your total comes
        to"), and at 40 tokens/s a 100 ms wait and the fifth token come together."""
        text = self._splitter.draft
        if self._clauses or text is None:
            return
        deadline = self._splitter.deadline
        if (
            deadline is not None
            and self._drafted is not None
            and deadline - self._splitter.clock() < DRAFT_BEFORE_WAIT_ENDS_S
        ):
            return  # the cut comes before a pass could help it (`DRAFT_BEFORE_WAIT_ENDS_S`)
        drafted = (text, self._splitter.wait_cut if deadline is not None else None)
        if drafted == self._drafted:
            return
        self._drafted = drafted
        self._host.draft(self.request, *drafted)

    def _guess(self) -> None:
        """Queue the first clause as soon as one more space would end it ("Okay." before the
        " Let" that follows): an LLM's next token most often starts with one, and the caller
        would wait that token for audio that can already be on its way. Its events are held
        until the text confirms the clause (`_settle`), and the clause's wait gives that text
        `GUESS_GRACE_S` more to come."""
        if self._clauses or self._closed:
            return
        text = self._splitter.likely_clause
        if text is None:
            return
        self._guessed = text
        self._splitter.extend_wait(GUESS_GRACE_S)
        self._queue([text])

    def _settle(self, texts: list[str]) -> list[str]:
        """The clauses the splitter gave out, less the guessed first clause if they confirm it
        (`_submit` then lets its held events out). If the text parted from the guess ("Okay."
        was "Okay.com"), the guess's request goes, unheard, and a fresh one takes its place."""
        guessed = self._guessed
        if texts and texts[0] == guessed:
            self._guessed = None
            # The listener hears the guess from now on: its clock and first audio start here.
            t = now()
            self.request.playback.restart(t)
            if self.request.metrics.first_audio_at is not None:
                self.request.metrics.first_audio_at = t
            return texts[1:]
        if not texts and self._splitter.likely_clause == guessed:
            return texts  # not decided yet
        self._guessed = None
        self._held.clear()
        self._splitter.extend_wait(0.0)
        replaced = self.request.id
        try:
            self.request = self._host.reseat(self)
        except Exception as e:
            self._fail(e)
            raise
        logger.debug(
            "the text parted from the first clause %r guessed by %s: %s speaks it instead",
            guessed,
            replaced,
            self.request.id,
        )
        self._clauses = 0
        self._drafted = None
        return texts

    def _check_length(self, chars: int) -> None:
        limit = self._host.config.max_text_chars
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
        self._host.cancel(self.request)
        # Audio already handed over but not yet consumed is dropped too.
        while not self._events.empty():
            self._events.get_nowait()
        self._ready.clear()
        self._held.clear()
        self._events.put_nowait(None)

    @property
    def unread_seconds(self) -> float:
        """Seconds of this stream's audio generated and not read yet (`EngineConfig.max_unread_s`
        bounds it)."""
        return self._host.unread_seconds(self.request)

    def held(self) -> bool:
        """Whether this stream has text to speak that pacing keeps it from speaking now: it is
        `EngineConfig.lead_s` ahead of its playback, or has `max_unread_s` unread. It makes
        no audio until the listener moves on (with reports, until it reports again)."""
        request = self.request
        working = bool(request.pending) or request.phase in (Phase.PREFILL, Phase.GENERATING)
        return working and self._host.held(request, now())

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
        self._host.wake()
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
        with contextlib.suppress(Exception):  # a failed clause has ended the stream
            self._submit(self._splitter.poll())

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
        margin = self._host.config.cut_before_dry_s
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
        with contextlib.suppress(Exception):  # a failed clause has ended the stream
            self._submit(splitter.cut_now())

    def _fail(self, error: Exception) -> None:
        self._disarm_timer()
        self._host.cancel(self.request)
        self._deliver(self.request, error)

    def _submit(self, texts: list[str], end: bool = False) -> None:
        """Plan and queue the clauses the splitter gave out (the guessed first clause settled
        first)."""
        if self._guessed is not None:
            texts = self._settle(texts)
        self._queue(texts, end)
        if self._guessed is None and self._held:
            # After the clauses that follow it are queued: a held clause end may make the
            # deadline rule cut the text after them (`_check_dry`).
            held, self._held = self._held, []
            for event in held:
                self._deliver(self.request, event)

    def _queue(self, texts: list[str], end: bool = False) -> None:
        """Plan and queue clauses. Their text has left the splitter, so a clause that cannot be
        planned (TextTooLongError) ends this stream with the error, then raises it to the
        caller, rather than let the stream go on without its words."""
        clauses = []
        try:
            for text in texts:
                clauses.append(Clause(self._clauses, text, self._host.plan(self.request, text)))
                self._clauses += 1
        except Exception as e:
            self._fail(e)
            raise
        self._host.submit(self.request, clauses, end)

    def post(self, request: Request, event: object) -> None:
        """Hand an event of `request` over from an engine thread: audio, a clause end, None
        (the end) or an exception (the end, failed)."""
        try:
            self._loop.call_soon_threadsafe(self._deliver, request, event)
        except RuntimeError:  # the consumer's loop is gone: nobody will read this stream
            self._host.cancel(request)

    def _deliver(self, request: Request, event: object) -> None:
        if request is not self.request:
            return  # a guess the text parted from (`_settle`): nobody hears it
        if self._guessed is not None and isinstance(event, AudioChunk | ClauseDone):
            self._held.append(event)
            return
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
                self.request.read_seconds += len(event.samples) / self._host.sample_rate
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
