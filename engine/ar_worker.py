"""The AR stage: a thread that admits requests, prefills their clauses in packed passes and
advances every generating request one latent per step, handing each latent to the decoder
worker (`decoder_worker.py`, its mirror) in each request's order.

Faults stay local. A batched step that fails is retried row by row on what it already consumed
(the pages it extended, the noise it drew), so only the request that fails alone ends, with an
`EngineFailedError`; an error in the loop itself is fatal to the engine (`on_fatal`).

Scheduling state (the scheduler's queues and voices, the block manager) is only touched under
the engine's lock, which the worker shares; tensor steps run outside it.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable

import torch

from intone.engine.block_manager import BlockManager
from intone.engine.config import (
    FIRST_FRAMES_ON_AR,
    HANDOVER_CALLS,
    PACING_POLL_S,
    TRACED_PROMPT_SEQUENCES,
)
from intone.engine.decoder_worker import (
    ClauseEndItem,
    DecoderWorker,
    FinishItem,
    LatentItem,
    ParkItem,
    running_mean,
)
from intone.engine.device import DeviceIO
from intone.engine.errors import EngineError, EngineFailedError, IdleTimeoutError
from intone.engine.events import ClauseDone
from intone.engine.metrics import EngineMetrics
from intone.engine.model_runner import ModelRunner
from intone.engine.pacing import Need, PacingPolicy
from intone.engine.request import Phase, Request, now
from intone.engine.scheduler import DraftPass, EndingPass, Scheduler

logger = logging.getLogger(__name__)


class ARWorker:
    """The AR stage and its thread. The engine owns the lifecycle and each stream's final
    event: `serving()` says whether to go on, `on_end` gives a request's stream its final
    event, `on_fatal` fails the engine, `shutdown_error()` is what requests end with when it
    stops."""

    def __init__(
        self,
        lock: threading.Condition,
        scheduler: Scheduler,
        blocks: BlockManager,
        runner: ModelRunner,
        decoder: DecoderWorker,
        pacing: PacingPolicy,
        metrics: EngineMetrics,
        io: DeviceIO,
        *,
        frame_seconds: float,
        idle_timeout_s: float | None,
        serving: Callable[[], bool],
        on_end: Callable[[Request, Exception | None, bool], None],
        on_fatal: Callable[[str, BaseException | None], None],
        shutdown_error: Callable[[], EngineError],
    ):
        self.lock = lock
        self.scheduler = scheduler
        self.blocks = blocks
        self.runner = runner
        self.decoder = decoder
        self.pacing = pacing
        self.metrics = metrics
        self.io = io
        self.frame_seconds = frame_seconds
        self.idle_timeout_s = idle_timeout_s
        self.serving = serving
        self.on_end = on_end
        self.on_fatal = on_fatal
        self.shutdown_error = shutdown_error
        # Each stage's device work on a stream of its own (on a GPU; nothing on a CPU).
        self.device_stage = io.stage()
        self.rows_generating = 0  # rows in the step running now
        self.streams_paced = 0  # streams pacing holds at the last look
        # Seconds between a row's latents (a running measure of each pass's median); None
        # before any row had two.
        self.latent_interval_s: float | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="intone-ar", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _main(self) -> None:
        try:
            with self.device_stage.enter():
                self._loop()
        except BaseException as e:
            logger.exception("the AR stage failed")
            self.on_fatal(f"AR stage failed: {e!r}", e)
            return
        with self.lock:
            stopped_while_running = self.serving()
        if stopped_while_running:
            self.on_fatal("the AR thread stopped", None)

    def _loop(self) -> None:
        last = now()
        while True:
            with self.lock:
                while True:
                    if not self.serving():
                        self._release_all()
                        return
                    t = now()
                    self._retire_requests(t)
                    # Held streams, with a row or parked for pacing: while there are any, the
                    # thread polls (playback moves on without telling it).
                    held = sum(
                        self.pacing.held(r, t)
                        for r in [*self.scheduler.running, *self.scheduler.waiting]
                        if r.frames_generated
                    )
                    self._metrics_paced(held, t - last)
                    last = t
                    batch = self.scheduler.schedule(t)
                    for request in batch.parked:
                        self.decoder.put(ParkItem(request))
                    for request, error in batch.failed:
                        self._finish(request, error=failed("starting a clause", error))
                    if batch.prefill or batch.generate or batch.drafts or batch.endings:
                        break
                    self.rows_generating = 0
                    if not (batch.failed or batch.parked):
                        self.lock.wait(self._next_wake(t))
            if batch.drafts or batch.endings:
                self._prefill_drafts(batch.drafts, batch.endings)
            else:
                self._step(batch.prefill, batch.generate)

    def _metrics_paced(self, held: int, elapsed: float) -> None:
        if self.streams_paced and elapsed > 0:
            self.metrics.paced(self.streams_paced * elapsed)
        self.streams_paced = held

    def _idle_deadline(self, request: Request) -> float | None:
        """When an idle request times out: no text pending and no audio pending or in flight."""
        timeout = self.idle_timeout_s
        if (
            timeout is None
            or request.pending
            or request.phase is not Phase.WAITING
            or request.id not in self.scheduler.idle
            or request.id in self.scheduler.decoder_rows_to_free
        ):
            return None
        return max(request.last_text_at, request.playback.last_delivery_at or 0.0) + timeout

    def _next_wake(self, t: float) -> float | None:
        """How long the AR thread may sleep: until a held stream may go on (polled, since
        playback and reading move on their own) or an idle stream times out."""
        deadlines = [
            d for r in self.scheduler.idle.values() if (d := self._idle_deadline(r)) is not None
        ]
        waits = [max(d - t, 0.0) for d in deadlines]
        # Rows that wait for their turn (`PacingPolicy.need`): playback, reading and decoding
        # move on their own, so the thread polls.
        if self.streams_paced or any(r.phase is Phase.GENERATING for r in self.scheduler.running):
            waits.append(PACING_POLL_S)
        return min(waits) if waits else None

    def _release_all(self) -> None:
        """Stopping: every request still scheduled ends with the shutdown error."""
        for request in self.scheduler.requests:
            self._finish(request, error=self.shutdown_error())

    def _retire_requests(self, t: float) -> None:
        for request in self.scheduler.requests:
            if request.error is not None:
                self._finish(request, error=request.error)
            elif request.cancelled:
                self._finish(request, cancelled=True)
            elif (
                request.input_ended
                and not request.pending
                and request.phase in (Phase.IDLE, Phase.WAITING)
            ):
                self._finish(request)
            elif (deadline := self._idle_deadline(request)) is not None and t >= deadline:
                self.metrics.idle_timeout()
                timeout = self.idle_timeout_s
                self._finish(
                    request,
                    error=IdleTimeoutError(
                        f"no text and no audio for {timeout:g} s (the engine's idle timeout)"
                    ),
                )

    def _finish(
        self, request: Request, cancelled: bool = False, error: EngineError | None = None
    ) -> None:
        """Under the lock: drop the request from scheduling; its stream ends after its audio."""
        if error is None and not cancelled:
            request.metrics.finished_at = now()
        # A request the decoder has seen ends there, after the audio it still has queued.
        if self.scheduler.finish(request) or request.in_decoder:
            self.decoder.put(FinishItem(request, cancelled, error))
        else:
            self.on_end(request, error, cancelled)

    def _fail_rows(self, stage: str, rows: list[tuple[Request, Exception]]) -> None:
        if not rows:
            return
        with self.lock:
            for request, error in rows:
                logger.error("%s failed for %s: %r", stage, request.id, error, exc_info=error)
                self._finish(request, error=failed(stage, error))

    def _step(self, prefill: list[Request], generate: list[Request]) -> None:
        """One packed prefill pass, which also takes each prefilled clause's first AR step, and
        one AR step for the other rows: as one pass where the runner `joins` them (the weights
        read once; a split pass's other parts after it, their rows joining a step of their
        own), else the pass, then a step that the prefilled rows join too (a clause's second
        latent comes a step sooner). A failure is pinned on the rows that fail alone. A clause
        whose first step an ending prepared joins as a prefilled one."""
        noise_of: dict[str, torch.Tensor] = {}
        ready = [r for r in prefill if r.first_step is not None]
        prefill = self._prepare([r for r in prefill if r.first_step is None], noise_of)
        prepared = self._prepared_first_steps(ready)
        generate = self._prepare(generate, noise_of)

        def run(stage: str, what: str, call, batch: list[Request]) -> tuple[list, float]:
            """The rows done, and the pass's seconds."""

            def step(rows: list[Request]) -> list[tuple[torch.Tensor, bool]]:
                latents, eos = call(rows, [noise_of[r.id] for r in rows])
                return list(zip(latents, self.io.values(eos), strict=True))

            started = time.perf_counter()
            done, failures = run_rows(step, batch)
            seconds = time.perf_counter() - started
            self.metrics.step(stage, len(batch), seconds)
            self._fail_rows(what, failures)
            return done, seconds

        self.rows_generating = len(prepared) + len(prefill) + len(generate)
        # The decoder keeps a core free while new streams' first frames are computed.
        starting = [*(r for r, _ in prepared), *prefill]
        self.decoder.first_frames_due = any(r.frames_generated == 0 for r in starting)
        try:
            if prepared:
                generate += self._started(prepared, generate, noise_of)
            if prefill and generate and self.runner.joins(len(prefill)):
                # A split pass's first part: its other parts run after the step's latents are out.
                joint = self._joint_pass(prefill[:TRACED_PROMPT_SEQUENCES], generate, noise_of)
                if joint is not None:
                    first, stepped = joint
                    self._start_generating(first)
                    self._emit([*first, *stepped])
                    prefill, generate = prefill[TRACED_PROMPT_SEQUENCES:], []
            if prefill:
                first, seconds = run("prefill", "prefill", self.runner.prefill, prefill)
                self._observe_pass(prefill, seconds)
                if first:
                    generate += self._started(first, generate, noise_of)
            if generate:
                done, _ = run("generate", "AR step", self.runner.generate, generate)
                self._emit(done)
        finally:
            self.decoder.first_frames_due = False

    def _start_generating(self, first: list[tuple[Request, tuple[torch.Tensor, bool]]]) -> None:
        for request, _ in first:
            request.prompt = None
            request.phase = Phase.GENERATING

    def _started(
        self,
        first: list[tuple[Request, tuple[torch.Tensor, bool]]],
        generate: list[Request],
        noise_of: dict[str, torch.Tensor],
    ) -> list[Request]:
        """Clauses with their first latents, before the other rows' step (so that those reach the
        decoder while it runs): emitted, and those that join that step, prepared for it. A
        clause's second latent comes a step sooner (a new stream's first frame plays for 80 ms
        only); a stream whose first frame the decoder worker has starts no step for that
        (`PacingPolicy.need`)."""
        self._start_generating(first)
        self._emit(first)
        with self.lock:
            t = now()
            joining = [
                r
                for r, _ in first
                if r.phase is Phase.GENERATING
                and self.scheduler.need(r, t) is not Need.NONE
                and (generate or not r.first_audio_decoding)
            ]
        return self._prepare(joining, noise_of)

    def _joint_pass(
        self, prefill: list[Request], generate: list[Request], noise_of: dict[str, torch.Tensor]
    ) -> tuple[list, list] | None:
        """The prompt pass of `prefill` and the AR step of `generate` as one pass
        (`ModelRunner.prefill_and_generate`): the clauses' first latents and the rows' next, each
        with its EOS flag. None if it fails: the pass and the step then run apart, each retried
        row by row, on the same pages and noise."""
        started = time.perf_counter()
        try:
            latents, eos = self.runner.prefill_and_generate(
                prefill,
                [noise_of[r.id] for r in prefill],
                generate,
                [noise_of[r.id] for r in generate],
            )
            done = list(zip(latents, self.io.values(eos), strict=True))
        except Exception as e:
            logger.warning("a joint pass failed (%r); its prompt pass and AR step run apart", e)
            return None
        seconds = time.perf_counter() - started
        # Each stage's rows waited the whole pass.
        self.metrics.step("prefill", len(prefill), seconds)
        self.metrics.step("generate", len(generate), seconds)
        # The step that comes with it is what the streams near an underrun wait for anyway.
        self._observe_pass(prefill, seconds)
        first = list(zip(prefill, done[: len(prefill)], strict=True))
        return first, list(zip(generate, done[len(prefill) :], strict=True))

    def _observe_pass(self, prefill: list[Request], seconds: float) -> None:
        """What a prompt pass over `prefill` cost, before it cleared their prompts, for the
        scheduler (`Scheduler.prompt_pass_cost`)."""
        positions = sum(r.prompt.shape[0] for r in prefill if r.prompt is not None)
        if positions:
            self.scheduler.prompt_pass_cost.observe(len(prefill), positions, seconds)

    def _prefill_drafts(self, drafts: list[DraftPass], endings: list[EndingPass]) -> None:
        """Prefill first clauses' drafts and prepare endings, in one pass (the AR stage has
        nothing else to run). A pass that fails only loses its head start: its drafts are
        dropped, and their clauses' own prompt passes do it all."""
        tables = []
        for item in drafts:
            assert item.request.draft is not None and item.request.draft.table is not None
            tables.append((item.request.draft.table, item.tokens[item.kept :]))
        first_steps: list[tuple[torch.Tensor, bool]] = []
        try:
            if endings:
                latents, eos = self.runner.prefill_endings(
                    tables,
                    [(e.ending.table, e.ending.tokens[e.kept :], e.request) for e in endings],
                )
                first_steps = list(zip(latents, self.io.values(eos), strict=True))
            else:
                self.runner.prefill_drafts(tables)
        except Exception:
            logger.exception("a draft pass failed; its clauses start from their text")
            with self.lock:
                for item in [*drafts, *endings]:
                    self.scheduler.release_draft(item.request.draft)
                    item.request.draft = None
            return
        with self.lock:
            for item in drafts:
                assert item.request.draft is not None
                item.request.draft.written = item.tokens
            for ending, first_step in zip(endings, first_steps, strict=True):
                ending.ending.first_step = first_step

    def _prepared_first_steps(
        self, requests: list[Request]
    ) -> list[tuple[Request, tuple[torch.Tensor, bool]]]:
        """The first latents and EOS flags of clauses whose prompt pass an ending did
        (`request.Ending`), each request's generator moved past the noise that pass took
        (`ModelRunner.peek_noise`), as its own prompt pass would have moved it."""
        done, failures = [], []
        for request in requests:
            first_step, request.first_step = request.first_step, None
            assert first_step is not None
            try:
                self.runner.draw_noise(request)
            except Exception as e:
                failures.append((request, e))
                continue
            done.append((request, first_step))
        self._fail_rows("drawing noise", failures)
        return done

    def _prepare(self, requests: list[Request], noise_of: dict[str, torch.Tensor]) -> list[Request]:
        """Draw each row's noise for its next pass (into `noise_of`) and extend its pages by the
        positions that pass writes; the rows that are ready (a failure is pinned on its row)."""
        ready, failures = [], []
        for request in requests:
            try:
                noise_of[request.id] = self.runner.draw_noise(request)
                ready.append(request)
            except Exception as e:
                failures.append((request, e))
        self._fail_rows("drawing noise", failures)
        with self.lock:
            for request in ready:
                assert request.table is not None
                # A prompt pass writes the prompt and the first latent; an AR step one latent.
                positions = 1 if request.prompt is None else request.prompt.shape[0] + 1
                self.blocks.extend(request.table, positions)
        return ready

    def _emit(self, done: list[tuple[Request, tuple[torch.Tensor, bool]]]) -> None:
        """Hand a pass's latents and clause ends to the decoder, in each request's order. While
        the decoder is busy, a new stream's first `FIRST_FRAMES_ON_AR` latents are decoded here
        (`DecoderWorker.decode_first_frames`), each as it comes or, where the worker's calls are
        long (`_first_audio_waits`), together; meanwhile they wait on the request
        (`Request.latents`, all it has generated). The decoder sees such a stream only after
        them. An idle decoder takes a new stream's latents at once."""
        ended, starting, intervals = [], [], []
        decoder_idle = self.decoder.idle
        # The decoder's stream reads these latents after the AR stream made them.
        self.io.hand_over(self.device_stage)
        t = now()
        yielded = 0.0
        for request, (latent, is_eos) in done:
            assert request.progress is not None and request.clause is not None
            if request.progress.advance(is_eos):
                if self.pacing.ahead(request, t):
                    request.metrics.yielded_seconds += self.frame_seconds
                    yielded += self.frame_seconds
                if request.latent_at is not None:
                    intervals.append(t - request.latent_at)
                request.latent_at = t
                request.previous_latent = latent
                request.latents.append(latent)
                request.frames_generated += 1
                if request.in_decoder:
                    self.decoder.put(LatentItem(request, latent, request.clause.index))
                else:
                    starting.append(request)
            if request.progress.ended:
                ended.append(request)
        if yielded:
            self.metrics.yielded(yielded)
        if intervals:
            interval = statistics.median(intervals)
            self.latent_interval_s = running_mean(self.latent_interval_s, interval)
        first = []
        waits = bool(starting) and self._first_audio_waits()
        for request in starting:
            if decoder_idle or request.progress.ended:
                self._hand_over(request)
            elif len(request.latents) >= FIRST_FRAMES_ON_AR or not waits:
                first.append(self._undecoded_latents(request))
                request.in_decoder = len(request.latents) >= FIRST_FRAMES_ON_AR
        if first:
            self.decoder.decode_first_frames(first)
            self.io.hand_over(self.device_stage)  # their histories go to the decoder too
        for request in ended:
            assert request.clause is not None and request.progress is not None
            self._hand_over(request)
            clause, eos = request.clause, request.progress.eos_step
            done_event = ClauseDone(clause.index, clause.text, len(request.latents), eos)
            self.decoder.put(ClauseEndItem(request, done_event))
        if ended:
            self._end_clauses(ended)

    def _first_audio_waits(self) -> bool:
        """Whether a new stream's first audio waits for its second frame. Its first frames each
        decoded as they come, the decoder worker's first frame of the stream would come about
        `FIRST_FRAMES_ON_AR` latent intervals and `HANDOVER_CALLS` of the worker's calls after its
        first audio; it waits where that outlasts those first frames' audio."""
        interval_s, call_s = self.latent_interval_s, self.decoder.call_s
        if interval_s is None or call_s is None:
            return False
        handover_s = FIRST_FRAMES_ON_AR * interval_s + HANDOVER_CALLS * call_s
        return handover_s > FIRST_FRAMES_ON_AR * self.frame_seconds

    def _undecoded_latents(self, request: Request) -> list[LatentItem]:
        """A stream's latents that no decoder has seen yet, before the decoder thread has seen
        the stream: all of its first clause (a clause's end hands them over) past the frames
        the AR thread decoded (`Request.frames_delivered`)."""
        assert request.clause is not None
        latents = request.latents[request.frames_delivered :]
        return [LatentItem(request, latent, request.clause.index) for latent in latents]

    def _hand_over(self, request: Request) -> None:
        """The decoder takes the stream from here on, with its latents not decoded yet."""
        if not request.in_decoder:
            request.in_decoder = True
            for item in self._undecoded_latents(request):
                self.decoder.put(item)

    def _end_clauses(self, requests: list[Request]) -> None:
        """Clauses the AR stage finished: the chaining tail is known now, so the pages go back
        and the next clause may start at once; the decoder keeps each stream's audio in order."""
        with self.lock:
            for request in requests:
                if request.chain_frames and request.latents:
                    request.tail = torch.stack(request.latents[-request.chain_frames :])
                self.scheduler.end_clause(request)
                request.latents = []
                request.latent_at = None
                request.phase = Phase.IDLE


def failed(stage: str, cause: Exception) -> EngineFailedError:
    """The error a request ends with when `stage` failed for it alone."""
    error = EngineFailedError(f"{stage} failed for this request: {cause!r}")
    error.__cause__ = cause
    return error


def run_rows(step, rows: list[Request]) -> tuple[list, list[tuple[Request, Exception]]]:
    """Run `step` on `rows` as one batch; if it fails, on each row alone.

    `step(batch)` returns one result per row, and must be repeatable on the same rows (the
    engine extends pages and draws noise before, once). Returns (request, result) pairs of the
    rows that ran, and the rows that failed alone with their errors.
    """

    def pairs(batch: list[Request]) -> list:
        return list(zip(batch, step(batch), strict=True))

    try:
        return pairs(rows), []
    except Exception as e:
        if len(rows) == 1:
            return [], [(rows[0], e)]
        logger.warning("a batched step of %d rows failed (%r); retrying row by row", len(rows), e)
    done, failures = [], []
    for request in rows:
        try:
            done += pairs([request])
        except Exception as e:
            failures.append((request, e))
    return done, failures
