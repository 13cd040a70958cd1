"""The decoder component: turns latents into audio, batching whatever is ready.

While the worker is busy, a new stream's first frames (`FIRST_FRAMES_ON_AR`, each as it comes
or, where this worker's calls are long, together) are decoded where their latents are computed, on
the AR thread, from a history of the stream's own outside the state pool (`decode_first_frames`):
first audio waits for no decode call in flight. Past capacity, at full size with 8 streams, such
a call took 100-350 ms, and first latents waited behind it. The worker sees such a stream only
after those frames. An idle worker decodes a new stream's latents itself, at once, split across
cores while the AR thread steps on.

Everything after those frames runs on the worker's own thread, at its own pace. The AR thread puts
four kinds of items on its queue, in each request's order: a latent, the end of a clause, a park
(the request gives its decoder row up until it has text again: its history is saved) and the end of
the request. Before every decode call the worker takes whatever has arrived on its queue. A call
decodes rows with the same number of latents, earliest deadline first: the stream with the least
audio buffered ahead of its listener (`Playback.buffered`) sets the call's frames (its leading
latents, up to `max_frames_per_call`), and the streams with at least that many latents waiting ride
along, least buffered first. When that stream is near an underrun (less than `URGENT_S` buffered),
only streams near one ride along, so its call stays short. Rows take fewer frames (one at least)
where the call would be expected to end after that stream runs dry (but no shorter than
`MIN_CALL_S`), or to take longer than `MAX_CALL_S`, by the worker's running measure of its seconds
per row-frame (`row_frame_s`): the stream's audio comes only at the end of the call, and a stream
that starts meanwhile has little to play. A stream whose first frames the AR thread decoded (see
below) counts too before its next latent comes: that latent may come while a call runs, and it must
be decoded before the first frames have played (without it, streams that had just started ran dry
at their third chunk: bench/results/cpu-2core-epyc-avx512-issue16-call-deadline/). With playback
pacing on (`paced`), when no stream is near an underrun, a call decodes at most `max_batch`
row-frames (rows x frames: about one full-batch frame's time), and while new streams' first
latents and frames are being computed
(`first_frames_due`, set by the AR stage around an iteration that prefills one) the worker starts no
such call at all: it waits, re-checking every `HOLD_RECHECK_S`, so that the AR thread finds a core
free instead of sharing it with a long call of audio nobody needs yet. So a stream that has only its
last latents left is never kept behind streams with bigger backlogs (with groups of equal backlogs
chosen by size, a stream's last frames waited 1-2 s behind the others' at full size, 8 streams), and
no row is held back to the smallest backlog of all. With pacing "yield" (`yield_after_s`), a stream
with more than that buffered ahead of its listener is decoded only with decoder time nobody else
needs: it rides along with no other stream, and its call (of at most `max_batch` row-frames, as
above) starts only when no other stream has latents waiting, so a stream that comes due meanwhile
waits at most that one call.

A decode call that fails is retried row by row on the same latents (a row's history advances only
when its call succeeds), so only the row that fails alone is pinned on its request (`on_failed`).
Any other error in the loop is the decoder stage's own: `on_fatal` fails the engine, so no stream
waits on a dead thread.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from intone.engine.config import COST_WEIGHT, HOLD_RECHECK_S, MAX_CALL_S, MIN_CALL_S, URGENT_S
from intone.engine.events import AudioChunk, ClauseDone
from intone.engine.generate import fade_in
from intone.engine.metrics import EngineMetrics
from intone.engine.model_runner import ModelRunner
from intone.engine.request import Request, now

logger = logging.getLogger(__name__)


@dataclass
class LatentItem:
    request: Request
    latent: torch.Tensor
    clause: int


@dataclass
class ClauseEndItem:
    request: Request
    event: ClauseDone


@dataclass
class ParkItem:
    request: Request


@dataclass
class FinishItem:
    request: Request
    cancelled: bool
    error: Exception | None = None


Item = LatentItem | ClauseEndItem | ParkItem | FinishItem


class DecoderWorker:
    def __init__(
        self,
        runner: ModelRunner,
        metrics: EngineMetrics,
        sample_rate: int,
        max_batch: int,
        max_frames_per_call: int,
        max_row_frames_per_call: int,
        on_row_freed: Callable[[Request], None],
        on_first_audio: Callable[[Request], None],
        on_finished: Callable[[Request, FinishItem], None],
        on_failed: Callable[[Request, Exception], None],
        on_fatal: Callable[[str, BaseException], None],
        paced: bool = False,
        yield_after_s: float | None = None,
    ):
        self.runner = runner
        # Decode calls run on a CUDA stream of their own (nothing on a CPU).
        self.stage = runner.io.stage()
        self.paced = paced
        self.yield_after_s = yield_after_s
        # Set by the AR thread while it computes new streams' first latents and frames.
        self.first_frames_due = False
        self.metrics = metrics
        self.sample_rate = sample_rate
        self.max_batch = max_batch
        self.max_frames_per_call = max_frames_per_call
        self.max_row_frames_per_call = max_row_frames_per_call
        self.on_row_freed = on_row_freed
        self.on_first_audio = on_first_audio
        self.on_finished = on_finished
        self.on_failed = on_failed
        self.on_fatal = on_fatal
        self.queue: queue.Queue[Item | None] = queue.Queue()
        # Per request, its items not handled yet, in order; and the requests it knows.
        self._pending: dict[str, deque[Item]] = {}
        self._requests: dict[str, Request] = {}
        # Streams whose first frames the AR thread decoded (`decode_first_frames`) and of which
        # no item has come here yet: their next latent may come while a call runs, so a call
        # ends before they run dry too. Written by the AR thread, read and emptied here.
        self._starting: dict[str, Request] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stop = False
        self._decoding = False  # a call of the worker's own is running
        # Wall seconds per decoded row-frame of the worker's recent calls, and per call; None
        # before any.
        self.row_frame_s: float | None = None
        self.call_s: float | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="intone-decoder", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self.queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def put(self, item: Item) -> None:
        self.queue.put(item)

    @property
    def idle(self) -> bool:
        """Nothing to decode and no call running: a latent put now is decoded at once. Read by
        the AR thread, the worker's only source of latents."""
        return not self._decoding and not self._pending and self.queue.empty()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        try:
            with self.stage.enter():
                self._serve()
        except BaseException as e:
            logger.exception("the decoder stage failed")
            self.on_fatal(f"decoder stage failed: {e!r}", e)
            return
        if not self._stopping:
            self.on_fatal("the decoder thread stopped", None)

    def _serve(self) -> None:
        timeout = None
        while not self._stop:
            with contextlib.suppress(queue.Empty):
                self._take(self.queue.get(timeout=timeout))
            timeout = HOLD_RECHECK_S if self._drain() else None
        for request in self._requests.values():
            self._release(request)
        self._pending.clear()
        self._requests.clear()
        self._starting.clear()

    def _take(self, item: Item | None) -> None:
        if item is None:
            self._stop = True
        else:
            self._starting.pop(item.request.id, None)
            self._pending.setdefault(item.request.id, deque()).append(item)
            self._requests[item.request.id] = item.request

    def _pull(self) -> None:
        """Everything that arrived since the last look, without waiting."""
        while True:
            try:
                self._take(self.queue.get_nowait())
            except queue.Empty:
                return

    def _drain(self) -> bool:
        """Decode until nothing is left to decode now; True if latents wait (held back)."""
        while self._pending:
            self._pull()
            self._run_control_items()
            rows = self._next_rows()
            if not rows:
                return bool(self._pending)
            self._decoding = True
            try:
                for row, audio in self._decode_with_retry(rows, self._decode):
                    self._deliver(row, audio)
            finally:
                self._decoding = False
        return False

    def _next_rows(self) -> list[list[LatentItem]]:
        """The rows of the next call, each with the same number of frames; earliest deadline
        first.

        The stream with the least audio buffered ahead of its listener sets the call's frames
        (its leading latents), and the streams with at least that many latents waiting ride
        along, least buffered first: if it is near an underrun, only those near one too, so its
        call stays short. Rows take fewer frames where the call would pass
        `max_row_frames_per_call`, or be expected to end after that stream (or a starting one,
        whose next latent may come meanwhile) runs dry or to take longer than `MAX_CALL_S`: no
        call keeps the others waiting long (a call cannot be interrupted for a stream that
        starts meanwhile). Paced and with nobody near one: calls
        of at most `max_batch` row-frames, and none while a first latent is due."""
        t = now()
        waiting = []  # (buffered, leading latents, items), least buffered first
        for items in self._pending.values():
            if count := self._leading_latents(items):
                waiting.append((items[0].request.playback.buffered(t), count, items))
        if not waiting:
            return []
        yielding = False
        if self.yield_after_s is not None:
            # Streams far ahead of their listener go only when nobody else waits.
            due = [row for row in waiting if row[0] <= self.yield_after_s]
            yielding = not due
            waiting = due or waiting
        waiting.sort(key=lambda row: row[0])
        head, frames, _ = waiting[0]
        row_frames = self.max_row_frames_per_call
        if self.paced and (head >= URGENT_S or yielding):
            if self.first_frames_due:
                return []
            row_frames = min(row_frames, self.max_batch)
        if self.row_frame_s:  # None before the first call
            # Expected to end before the least-buffered stream runs dry (its audio comes at the
            # end of the call, whatever rides along), or a starting one whose next latent may
            # come meanwhile, within `MIN_CALL_S` to `MAX_CALL_S`. Rows are never left out: part
            # of a call's cost is per call, so calls of fewer rows would raise the measure, and
            # shorter calls again (measured: throughput fell by up to a fifth).
            starting = [
                r.playback.buffered(t) for r in tuple(self._starting.values()) if not dropped(r)
            ]
            budget = max(min(head, *starting, MAX_CALL_S), MIN_CALL_S)
            row_frames = min(row_frames, int(budget / self.row_frame_s))
        frames = max(1, min(frames, row_frames // min(len(waiting), self.max_batch)))
        # A stream near an underrun takes along only others near one: its call stays short.
        rows = [
            items
            for buffered, count, items in waiting
            if count >= frames and (buffered < URGENT_S or head >= URGENT_S)
        ]
        return self._take_rows(frames, rows)

    def _take_rows(self, count: int, rows: list[deque[Item]]) -> list[list[LatentItem]]:
        """`count` leading latents of each of the first `max_batch` of `rows`."""
        return [[items.popleft() for _ in range(count)] for items in rows[: self.max_batch]]

    def _leading_latents(self, items: deque[Item]) -> int:
        count = 0
        for item in items:
            if not isinstance(item, LatentItem) or count == self.max_frames_per_call:
                break
            count += 1
        return count

    def decode_first_frames(self, rows: list[list[LatentItem]]) -> None:
        """Decode and deliver new streams' first latents now, each row a stream's next frames,
        on the caller's thread (the AR thread, right after it computed them, while the worker is
        busy), outside the pool: first audio waits for no decode call in flight (at full size
        with 8 streams past capacity, a call took 100-350 ms). Each row starts from a fresh
        history or the one its previous first frames left; the worker restores that into a slot
        with the stream's next latent. Rows of equal length share a call."""
        rows = [row for row in rows if not dropped(row[0].request)]
        for length in sorted({len(row) for row in rows}):
            same = [row for row in rows if len(row) == length]
            for row, audio in self._decode_with_retry(same, self._decode_outside_pool):
                self._deliver(row, audio)
                self._starting[row[0].request.id] = row[0].request

    def _decode_with_retry(
        self,
        rows: list[list[LatentItem]],
        decode: Callable[[list[list[LatentItem]]], np.ndarray],
    ) -> list[tuple[list[LatentItem], np.ndarray]]:
        """Decode `rows` together; if that fails, each alone, failing only rows that fail alone."""
        if not rows:
            return []
        try:
            return list(zip(rows, decode(rows), strict=True))
        except Exception as e:
            if len(rows) == 1:
                self._fail(rows[0], e)
                return []
            logger.warning(
                "a decode call of %d rows failed (%r); retrying row by row", len(rows), e
            )
        done = []
        for row in rows:
            try:
                done.append((row, decode([row])[0]))
            except Exception as e:
                self._fail(row, e)
        return done

    def _fail(self, row: list[LatentItem], error: Exception) -> None:
        request = row[0].request
        logger.error("decoding %s failed: %r", request.id, error, exc_info=error)
        self.on_failed(request, error)

    def _run_control_items(self) -> None:
        for request_id in list(self._pending):
            items = self._pending[request_id]
            request = self._requests[request_id]
            while items and (dropped(request) or not isinstance(items[0], LatentItem)):
                item = items.popleft()
                if isinstance(item, LatentItem):
                    continue  # cancelled or failed: its latents are not worth decoding
                if isinstance(item, ClauseEndItem):
                    if not dropped(request):
                        request.sink(item.event)
                elif isinstance(item, ParkItem):
                    if request.decoder_slot is not None:
                        request.decoder_saved = self.runner.decoder_states.save(
                            request.decoder_slot
                        )
                    self._release(request)
                    self.on_row_freed(request)
                else:
                    items.clear()
                    self._release(request)
                    del self._requests[request_id]
                    if item.error is None and not request.replaced:
                        self.metrics.finished(request.metrics, cancelled=item.cancelled)
                    self.on_finished(request, item)
            if not items:
                del self._pending[request_id]

    def _release(self, request: Request) -> None:
        if request.decoder_slot is not None:
            self.runner.decoder_states.release(request.decoder_slot)
            request.decoder_slot = None

    def _decode(self, rows: list[list[LatentItem]]) -> np.ndarray:
        """Audio [rows, frames * samples_per_frame] on the host."""
        states, io = self.runner.decoder_states, self.runner.io
        # The AR stream made these latents, and the histories of first frames it decoded: this
        # stream reads them after it, and their memory is not reused before it has.
        io.take_over(self.stage)
        for row in rows:
            request = row[0].request
            if request.decoder_slot is None:
                request.decoder_slot = states.acquire()
                if request.decoder_saved is not None:
                    for tensor in request.decoder_saved.values():
                        self.stage.keep(tensor)
                    states.restore(request.decoder_slot, request.decoder_saved)
                    request.decoder_saved = None
        slots = [row[0].request.decoder_slot for row in rows]
        started = time.perf_counter()
        latents = stack_latents(rows)
        for row in rows:
            for item in row:
                self.stage.keep(item.latent)
        audio = io.array(self.runner.decode(slots, latents))
        elapsed = time.perf_counter() - started
        self.metrics.step("decode", len(rows), elapsed)
        cost = elapsed / (latents.shape[0] * latents.shape[1])
        self.row_frame_s = running_mean(self.row_frame_s, cost)
        self.call_s = running_mean(self.call_s, elapsed)
        return audio

    def _decode_outside_pool(self, rows: list[list[LatentItem]]) -> np.ndarray:
        """`_decode` for streams whose history is their own (`Request.decoder_saved`), not a
        slot's: fresh before their first frame."""
        started = time.perf_counter()
        histories = [row[0].request.decoder_saved for row in rows]
        audio, histories = self.runner.decode_detached(stack_latents(rows), histories)
        self.metrics.step("decode", len(rows), time.perf_counter() - started)
        for row, history in zip(rows, histories, strict=True):
            row[0].request.decoder_saved = history
        return self.runner.io.array(audio)

    def _deliver(self, row: list[LatentItem], samples: np.ndarray) -> None:
        request = row[0].request
        frame_size = samples.shape[-1] // len(row)
        for index, item in enumerate(row):
            frame = samples[index * frame_size : (index + 1) * frame_size]
            delivered_at = now()
            first = request.frames_delivered == 0
            if first:
                frame = fade_in(frame, self.sample_rate)
                request.metrics.first_audio_at = delivered_at
            request.frames_delivered += 1
            request.metrics.audio_samples += frame.size
            seconds = frame.size / self.sample_rate
            request.playback.deliver(seconds, delivered_at)
            self.metrics.audio(seconds)
            if not dropped(request):
                request.sink(AudioChunk(frame, item.clause))
            if first:
                self.on_first_audio(request)


def running_mean(previous: float | None, value: float) -> float:
    """The worker's running measures: `COST_WEIGHT` for the newest value."""
    return value if previous is None else previous + COST_WEIGHT * (value - previous)


def stack_latents(rows: list[list[LatentItem]]) -> torch.Tensor:
    """[rows, frames, latent_dim]: rows of equal length."""
    return torch.stack([torch.stack([item.latent for item in row]) for row in rows])


def dropped(request: Request) -> bool:
    """Nothing more of this request is worth decoding or delivering."""
    return request.cancelled or request.error is not None
