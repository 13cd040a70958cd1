"""The batched streaming engine: an AR thread and a decoder worker joined by a queue.

The AR thread admits requests, prefills their clauses in packed passes and advances every
generating request one latent per step; each latent goes to the decoder worker
(`decoder_worker.py`), which batches whatever is ready and hands the audio to the request's
`Stream` on the caller's own event loop.

Faults stay local. A batched step that fails is retried row by row on what it already consumed
(the pages it extended, the noise it drew), so only the request that fails alone ends, with an
`EngineFailedError`. An error that cannot be pinned on a request, in either stage's loop, fails
the engine: every open stream ends at once with an `EngineFailedError`, `health()` says why, and
new streams are refused.

Page bookkeeping (`BlockManager`, the scheduler's queues and voices) is only ever touched under
the engine lock, by whichever thread: the AR thread, `add_voice` and `stream()`. Tensor steps
run outside it.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from intone.engine import admission
from intone.engine import device as devices
from intone.engine.admission import Admission
from intone.engine.ar_worker import ARWorker, failed
from intone.engine.block_manager import BlockManager, PageTable
from intone.engine.config import PROBE_ROWS, VOICE_LOAD_TRIES, EngineConfig
from intone.engine.cpu_memory import keep_freed_memory
from intone.engine.decoder_worker import (
    DecoderWorker,
    FinishItem,
)
from intone.engine.errors import (
    EmptyTextError,
    EngineClosedError,
    EngineError,
    EngineFailedError,
    EngineFullError,
    InvalidOptionError,
    TextTooLongError,
)
from intone.engine.events import AudioChunk, ClauseDone
from intone.engine.generate import make_generator
from intone.engine.loading import LoadedModel, load_model
from intone.engine.metrics import EngineMetrics
from intone.engine.model_runner import ModelRunner
from intone.engine.options import ClausePlan, GenerationOptions
from intone.engine.pacing import PacingPolicy
from intone.engine.playback import Playback
from intone.engine.precision import resolve_precision, serving_model
from intone.engine.request import Clause, Request, RequestMetrics, now
from intone.engine.scheduler import Scheduler
from intone.engine.stream import Stream
from intone.engine.text import ClauseSplitter, check_text, plan_clause
from intone.engine.thread_budget import ThreadBudget
from intone.engine.voice_cache import VoiceCache, VoicePrefix
from intone.engine.voices import Voice, load_voice, voice_state_length

__all__ = [
    "AudioChunk",
    "ClauseDone",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineFullError",
    "Health",
    "Stream",
]

logger = logging.getLogger(__name__)

State = Literal["new", "running", "closing", "closed", "failed"]


def _same(voice: Voice) -> Voice:
    """A `Voice` handed to `add_voice` loads again as itself."""
    return voice


@dataclass(frozen=True)
class Health:
    """Whether the engine can serve: `reason` says why not (for /healthz and the logs)."""

    ok: bool
    reason: str | None = None


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        config.validate()
        self.loaded = loaded
        self.io = devices.device_io(config.device)
        self.device = self.io.device
        if config.keep_freed_memory and self.device.type == "cpu":
            keep_freed_memory()
        threads = config.torch_threads
        budget = None
        if threads is None:
            budget = ThreadBudget(os.cpu_count() or 2)
            threads = budget.threads_for(2)
        if threads:
            torch.set_num_threads(threads)
        precision = resolve_precision(config.dtype, config.device)
        self.model = serving_model(loaded.model, self.device, precision)
        flow_lm = self.model.flow_lm
        slot_bytes = flow_lm.new_kv_pool(0, device="cpu").slot_bytes
        num_pages = config.num_pages or max(
            1, int(config.kv_memory_mb * 2**20 // (slot_bytes * config.page_size))
        )
        self.blocks = BlockManager(num_pages, config.page_size)

        def make_runner(blocks: BlockManager, rows: int) -> ModelRunner:
            return ModelRunner(
                self.model,
                blocks,
                rows,
                config.flow_steps,
                self.device,
                config.batch_buckets,
                decoder_int8=precision.decoder_int8,
                decoder_trace_after=config.decoder_trace_after,
                thread_budget=budget,
                # With the thread budget, a decode batch runs one part per core, each on one
                # thread (intra-op threads stall on a core that is shared).
                decode_parts=budget.cores if budget and self.device.type == "cpu" else 1,
                native_kernels=config.native_kernels,
                io=self.io,
            )

        frame_seconds = self.model.samples_per_frame / self.sample_rate
        # What max_active="auto" measured and chose; None for a number given.
        self.admission: Admission | None = None
        if config.max_active == "auto":
            cores = (
                (budget.cores if budget else torch.get_num_threads())
                if self.device.type == "cpu"
                else 0
            )
            self.admission = admission.probe(
                partial(make_runner, rows=max(PROBE_ROWS)),
                config.page_size,
                frame_seconds,
                cores,
            )
            self.config = config = replace(config, max_active=self.admission.max_active)
        self.runner = make_runner(self.blocks, config.max_active)
        self.pacing = PacingPolicy(
            config.pacing,
            config.lead_s,
            config.max_unread_s,
            frame_seconds,
            config.max_decode_frames,
        )
        self.scheduler = Scheduler(
            self.runner,
            self.blocks,
            config.max_active,
            config.max_prefill_tokens,
            config.max_prefill_rows_near_underrun,
            self.pacing,
            config.max_rows_per_tenant,
            voices=VoiceCache(
                self.blocks,
                self._write_voice_pages,
                page_bytes=slot_bytes * config.page_size,
                budget_bytes=(
                    None if config.voice_cache_mb is None else int(config.voice_cache_mb * 2**20)
                ),
            ),
        )
        # Guards the scheduler, the block manager, `_open` and the lifecycle state.
        self._lock = threading.Condition()
        self._ids = itertools.count()
        self._state: State = "new"
        self._failure: str | None = None
        # Requests whose stream has not had its final event yet, whatever stage holds them.
        self._open: dict[str, Request] = {}
        self._metrics = EngineMetrics(
            {
                "streams_open": lambda: len(self._open),
                "rows_generating": lambda: self.ar.rows_generating,
                "streams_paced": lambda: self.ar.streams_paced,
                "kv_pages_in_use": lambda: self.blocks.pages_in_use,
                "kv_pages_free": lambda: len(self.blocks.free_pages),
                "kv_pages_total": lambda: self.blocks.num_pages,
                "kv_lanes_bytes": lambda: self.runner.lanes.nbytes,
                "voices_registered": lambda: len(self.scheduler.voices),
                "voices_resident": lambda: len(self.scheduler.voices.resident),
                "voice_pages": lambda: self.scheduler.voices.resident_pages,
                "voice_loads": lambda: self.scheduler.voices.loads,
                "voice_evictions": lambda: self.scheduler.voices.evictions,
                "active_requests": lambda: self.scheduler.active,
                "queued_requests": lambda: len(self.scheduler.waiting),
                "decoder_states_in_use": lambda: self.runner.decoder_states.in_use,
                "decoder_queue_depth": lambda: self.decoder.queue.qsize(),
            },
            leads=self._leads,
        )
        self.decoder = DecoderWorker(
            self.runner,
            self._metrics,
            self.sample_rate,
            max_batch=config.max_active,
            max_frames_per_call=config.max_decode_frames,
            max_row_frames_per_call=config.max_decode_row_frames,
            on_row_freed=self._decoder_row_freed,
            on_finished=self._decoder_finished,
            on_failed=self._decode_failed,
            on_fatal=self._fail,
            paced=self.pacing.paced,
            yield_after_s=self.pacing.yield_after_s,
        )
        self.ar = ARWorker(
            self._lock,
            self.scheduler,
            self.blocks,
            self.runner,
            self.decoder,
            self.pacing,
            self._metrics,
            self.io,
            frame_seconds=frame_seconds,
            idle_timeout_s=config.idle_timeout_s,
            serving=lambda: self._state == "running",
            on_end=self._end,
            on_fatal=self._fail,
            shutdown_error=self._shutdown_error,
        )
        for name, source in loaded.voices.items():
            if name == loaded.default_voice:
                self.add_voice(name, source)
        self.default_voice = loaded.default_voice
        # The stages' streams start after the setup work on this thread's stream.
        self.io.synchronize()

    @classmethod
    def from_model(
        cls, model: str | Path | None = None, config: EngineConfig | None = None
    ) -> Engine:
        return cls(load_model(model), config)

    @property
    def sample_rate(self) -> int:
        return self.loaded.sample_rate

    # ---- lifecycle

    def start(self) -> Engine:
        with self._lock:
            if self._state == "running":
                return self
            if self._state != "new":
                raise EngineClosedError(f"the engine is {self._state}; make a new one")
            self._state = "running"
        self.ar.start()
        self.decoder.start()
        return self

    def prepare_decoder(self) -> None:
        """Make the decoder's traces now (0.3-1.2 s on 2 cores), so that no served decode call
        stalls while one is made. The server calls it at startup and the plugins' prewarm with
        their warm-up; an engine that skips it makes them as it serves (`decoder_trace_after`)."""
        self.runner.prepare_decoder()

    def close(self) -> None:
        """Stop the threads. Every stream still open ends with EngineClosedError (or the
        engine's failure); `stream()` raises EngineClosedError from the moment this starts."""
        with self._lock:
            if self._state in ("closing", "closed"):
                return
            if self._state != "failed":
                self._state = "closing"
            self._lock.notify_all()
        self.ar.join(timeout=10)
        self.decoder.stop()
        self.runner.close()
        with self._lock:
            open_requests = list(self._open.values())
            if self._state == "closing":
                self._state = "closed"
        for request in open_requests:
            self._end(request, self._shutdown_error())

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def health(self) -> Health:
        """ok while the engine serves; otherwise the reason (failure, dead thread, closed)."""
        with self._lock:
            state, failure = self._state, self._failure
        if failure is not None:
            return Health(False, failure)
        if state == "new":
            return Health(False, "the engine is not started")
        if state != "running":
            return Health(False, f"the engine is {state}")
        for name, alive in (
            ("AR", self.ar.alive),
            ("decoder", self.decoder.alive),
        ):
            if not alive:
                reason = f"the {name} thread is dead"
                self._fail(reason, None)
                return Health(False, reason)
        return Health(True)

    def _fail(self, reason: str, cause: BaseException | None) -> None:
        """An error no request can be blamed for: end every open stream now, refuse new ones."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = reason
            self._state = "failed"
            open_requests = list(self._open.values())
            self._lock.notify_all()
        logger.error("the engine failed: %s; ending %d open streams", reason, len(open_requests))
        for request in open_requests:
            self._end(request, self._shutdown_error(cause))

    def _shutdown_error(self, cause: BaseException | None = None) -> EngineError:
        if self._failure is not None:
            error: EngineError = EngineFailedError(f"the engine failed: {self._failure}")
            error.__cause__ = cause
            return error
        return EngineClosedError("the engine was closed")

    def _end(self, request: Request, event: Exception | None, silent: bool = False) -> None:
        """Give the request's stream its final event, exactly once, from any thread."""
        with self._lock:
            if self._open.pop(request.id, None) is None:
                return
        if not silent:
            request.sink(event)

    # ---- voices

    @property
    def voices(self) -> list[str]:
        with self._lock:
            return sorted(self.scheduler.voices)

    def add_voice(self, name: str, source: str | Path | Voice, *, lazy: bool = False) -> None:
        """Register a voice from audio, a voice-state file or a computed Voice; prefilled once.

        Replacing a voice is transactional: the new voice's pages are allocated and written
        first, and only then swapped in; if that fails the old voice is intact and nothing
        leaks. A pool too full for the voice raises EngineFullError.

        `lazy` (a voice-state `.safetensors` path only): register it without reading more than
        its header; its pages are written when a stream first uses it. With
        `EngineConfig.voice_cache_mb`, an idle voice may be evicted and is then loaded again:
        a voice-state file is read back, a `Voice` is kept as it is, and a voice from audio
        keeps its prompt in host memory (encoding it again would take seconds).
        """
        if not isinstance(name, str) or not name:
            # "" could never be asked for: stream(voice="") means the default voice.
            raise ValueError(f"a voice name is a non-empty str, got {name!r}")
        if isinstance(source, Voice):
            voice: Voice | None = source
            load = partial(_same, source)
        else:
            voice = None
            load = partial(load_voice, self.model, name, source)
        if lazy:
            if voice is not None or Path(source).suffix != ".safetensors":  # type: ignore[arg-type]
                raise ValueError("lazy=True takes a voice-state .safetensors path")
            length = voice_state_length(self.model, Path(source))  # type: ignore[arg-type]
            with self._lock:
                if not self.scheduler.voices.in_use(name):
                    self.scheduler.voices.set(VoicePrefix(name, length, load))
                    return
            # A voice in use is replaced by one in the pool: its streams' next clauses need it.
        if voice is None:
            voice = load()
            if self.scheduler.voices.evicts and Path(str(source)).suffix != ".safetensors":
                # Audio takes seconds to encode again (a voice state file, milliseconds to
                # read): an evicted one comes back from a copy in host memory instead.
                kept = Voice(voice.name, voice.keys.cpu(), voice.values.cpu())
                load = partial(_same, kept)
        with self._lock:
            table = self.scheduler.voices.write(name, voice)
            self.scheduler.voices.set(VoicePrefix(name, voice.length, load, table))

    def _write_voice_pages(self, table: PageTable, voice: Voice) -> None:
        self.runner.write_voice(table, voice)
        # Written on this thread's stream; the AR stage reads it on its own.
        self.io.synchronize()

    def prefill_voice(self, name: str) -> None:
        """Make a registered voice's pages resident now (reading or encoding it again if it was
        evicted), so that `stream()` on it does not: a server calls this off its event loop.
        UnknownVoiceError if no such voice, or if it cannot be loaded any more."""
        with self._lock:
            entry = self.scheduler.voices.entry(name)
            self.scheduler.voices.touch(entry)
            if entry.table is not None:
                return
        voice = self.scheduler.voices.load(entry)
        with self._lock:
            self.scheduler.voices.place_loaded(entry, voice)

    def remove_voice(self, name: str) -> bool:
        """Unregister a voice: no new stream may use it; the streams using it finish with it,
        and its pages go back after them. False if no such voice. The default voice stays."""
        if name == self.default_voice:
            raise ValueError(f"{name!r} is the default voice: it cannot be removed")
        with self._lock:
            return self.scheduler.voices.remove(name)

    # ---- requests

    def stream(
        self,
        voice: str | None = None,
        options: GenerationOptions | None = None,
        tenant: str | None = None,
    ) -> Stream:
        """A new text stream. Raises at once: InvalidOptionError, UnknownVoiceError,
        EngineFullError (retryable), EngineClosedError, EngineFailedError.

        `tenant`: who the stream is for (a caller, an API key); with
        `EngineConfig.max_rows_per_tenant`, one tenant's streams hold at most that many rows
        while others wait."""
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
        model_config = self.loaded.config
        request = Request(
            id=f"req-{next(self._ids)}",
            voice=voice or self.default_voice or "",
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
        splitter = ClauseSplitter(
            self.loaded.tokenizer,
            min_tokens=self.config.clause_min_tokens,
            first_clause_min_words=options.first_clause_min_words,
            first_clause_max_wait_ms=options.first_clause_max_wait_ms,
            max_tokens=self.config.clause_max_tokens,
        )
        stream = Stream(self, request, splitter)
        request.sink = stream.post
        for _ in range(VOICE_LOAD_TRIES):
            with self._lock:
                self._check_serving()
                entry = self.scheduler.voices.entry(request.voice)
                if entry.table is not None:
                    return self._open_stream(stream, request, entry, options)
            # Evicted (or registered lazily): read again here, outside the lock, and pinned in
            # the same locked section that writes its pages.
            loaded = self.scheduler.voices.load(entry)
            with self._lock:
                self._check_serving()
                self.scheduler.voices.place_loaded(entry, loaded)
                if self.scheduler.voices.get(request.voice) is entry and entry.table is not None:
                    return self._open_stream(stream, request, entry, options)
        raise EngineFullError(f"voice {request.voice!r} could not be loaded into the KV pool")

    def _open_stream(
        self, stream: Stream, request: Request, voice: VoicePrefix, options: GenerationOptions
    ) -> Stream:
        """Under the lock, with the stream's voice resident: check capacity and admit it."""
        voices = self.scheduler.voices
        voices.pin(voice)  # first, so that the capacity below counts its pages as held
        try:
            # The smallest clause (one token, one frame) must fit beside the chaining tail.
            pages = self.scheduler.clause_pages(request.voice, options.chain_frames + 1, 1)
            if pages > self.scheduler.clause_capacity():
                raise InvalidOptionError(
                    f"chain_frames={options.chain_frames} does not fit in this engine's KV pool"
                )
            if len(self._open) >= self.config.max_streams:
                raise EngineFullError(f"{self.config.max_streams} streams already open")
            if len(self.scheduler.waiting) >= self.config.max_queued:
                raise EngineFullError(f"{self.config.max_queued} requests already queued")
        except BaseException:
            voices.unpin(request.voice)
            raise
        self.scheduler.add(request)
        self._open[request.id] = request
        return stream

    def _check_serving(self) -> None:
        if self._state == "running":
            return
        if self._state == "failed":
            raise EngineFailedError(f"the engine failed: {self._failure}")
        if self._state == "new":
            raise EngineClosedError("the engine is not running: call start()")
        raise EngineClosedError(f"the engine is {self._state}")

    async def synthesize(
        self, text: str, voice: str | None = None, options: GenerationOptions | None = None
    ) -> np.ndarray:
        """The whole audio of `text`, float32 at the model's rate."""
        check_text(text)
        if not text.strip():
            raise EmptyTextError("text is empty")
        stream = self.stream(voice, options)
        try:
            stream.push_text(text)
            stream.end_input()
            chunks = [chunk async for chunk in stream.audio()]
        except BaseException:
            stream.cancel()
            raise
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)

    # ---- what a Stream asks of its engine

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
        with self._lock:
            pages = self.scheduler.clause_pages(
                request.voice, request.chain_frames + len(plan.tokens), plan.max_frames
            )
            capacity = self.scheduler.clause_capacity()
        if pages > capacity:
            raise TextTooLongError(
                f"a clause needs {pages} KV pages but only {capacity} of the pool's "
                f"{self.blocks.num_pages} are not held by voices: raise num_pages or lower "
                "max_frames"
            )
        return plan

    def submit(self, request: Request, clauses: list[Clause], end: bool) -> None:
        """Queue planned clauses of `request`; `end`: no more will come."""
        with self._lock:
            request.pending.extend(clauses)
            request.input_ended |= end
            request.last_text_at = now()
            if request.metrics.clauses == 0 and clauses:
                request.metrics.submitted_at = now()
            request.metrics.clauses += len(clauses)
            if request.pending:
                self.scheduler.ready(request)
            self._lock.notify_all()

    def cancel(self, request: Request) -> None:
        with self._lock:
            request.cancelled = True
            self._lock.notify_all()

    def wake(self) -> None:
        """Something pacing depends on changed (a playback report, audio read): look again."""
        with self._lock:
            self._lock.notify_all()

    # ---- metrics

    def metrics(self) -> dict:
        result = self._metrics.snapshot()
        result["max_active"] = self.config.max_active
        # What max_active="auto" measured and chose (engine/admission.py); None for a number.
        result["admission"] = None if self.admission is None else self.admission.as_dict()
        return result

    def prometheus(self) -> bytes:
        return self._metrics.prometheus()

    @property
    def prometheus_registry(self) -> CollectorRegistry:
        """The registry behind `prometheus()`, for a server that exposes several engines."""
        return self._metrics.registry

    def reset_rates(self) -> None:
        """Restart the batch means, step times and throughputs (e.g. after a warm-up)."""
        self._metrics.reset_rates()

    def is_idle(self) -> bool:
        m = self.metrics()
        return m["active_requests"] == 0 and m["queued_requests"] == 0

    # ---- pacing, as a Stream and the metrics see it

    def unread_seconds(self, request: Request) -> float:
        """Seconds of the request's audio its consumer has not read (`PacingPolicy.unread`)."""
        return self.pacing.unread(request)

    def held(self, request: Request, t: float) -> bool:
        """Pacing holds the request: too much audio unread, or (pacing "hold") far ahead."""
        return self.pacing.held(request, t)

    def _leads(self) -> list[float]:
        t = now()
        return [self.pacing.lead(r, t) for r in list(self.scheduler.running)]

    # ---- callbacks from the decoder worker

    def _decoder_row_freed(self, request: Request) -> None:
        """A parked request's decoder row is free (its history saved)."""
        with self._lock:
            self.scheduler.decoder_row_freed(request)
            self._lock.notify_all()

    def _decoder_finished(self, request: Request, item: FinishItem) -> None:
        with self._lock:
            self.scheduler.decoder_row_freed(request)
            self._lock.notify_all()
        error = item.error or request.error
        self._end(request, error, silent=item.cancelled and error is None)

    def _decode_failed(self, request: Request, error: Exception) -> None:
        with self._lock:
            if request.error is None:
                request.error = failed("decoding", error)
            self._lock.notify_all()
