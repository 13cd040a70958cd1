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
the engine lock, by whichever thread: the AR thread, the voices' registry (`add_voice`,
`stream()`) and the streams' host (a stream's clauses, `stream.StreamHost`). Tensor steps run
outside it.

The engine holds the lifecycle, the voices' names, the admission of streams and the callbacks
that end them; each part it joins is made from the config by the module that owns it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

import numpy as np
from prometheus_client import CollectorRegistry

from intone.engine import admission
from intone.engine import device as devices
from intone.engine.ar_worker import ARWorker, failed
from intone.engine.block_manager import BlockManager
from intone.engine.config import EngineConfig
from intone.engine.cpu_memory import huge_pages, keep_freed_memory
from intone.engine.decoder_worker import DecoderWorker, FinishItem
from intone.engine.errors import (
    EmptyTextError,
    EngineClosedError,
    EngineError,
    EngineFailedError,
    EngineFullError,
    InvalidOptionError,
)
from intone.engine.events import AudioChunk, ClauseDone
from intone.engine.loading import LoadedModel, load_model
from intone.engine.metrics import EngineMetrics
from intone.engine.model_runner import ModelRunner, kv_pages, new_ar_traces
from intone.engine.options import GenerationOptions
from intone.engine.pacing import PacingPolicy
from intone.engine.precision import resolve_precision, serving_model
from intone.engine.request import Request, now
from intone.engine.scheduler import Scheduler
from intone.engine.stream import Stream, StreamHost
from intone.engine.text import check_text
from intone.engine.thread_budget import set_torch_threads
from intone.engine.voice_cache import VoicePrefix
from intone.engine.voice_registry import VoiceRegistry
from intone.engine.voices import Voice

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


@dataclass(frozen=True)
class Health:
    """Whether the engine can serve: `reason` says why not (for /healthz and the logs)."""

    ok: bool
    reason: str | None = None


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        config = config or EngineConfig()
        config.validate()
        self.loaded = loaded
        self.io = devices.device_io(config.device)
        self.device = self.io.device
        if self.device.type == "cpu":
            if config.keep_freed_memory:
                keep_freed_memory()
            logger.info("huge pages for torch's large allocations: %s", huge_pages())
        budget = set_torch_threads(config.torch_threads)
        precision = resolve_precision(config.dtype, config.device)
        self.model = serving_model(loaded.model, self.device, precision, config.native_kernels)
        self.blocks = BlockManager(kv_pages(self.model, config), config.page_size)
        make_runner = partial(
            ModelRunner.from_config,
            self.model,
            config,
            precision,
            self.io,
            budget,
            ar_traces=new_ar_traces(config),
        )
        frame_seconds = self.model.samples_per_frame / self.sample_rate
        # With max_active="auto", what was measured to choose it (None for a number given).
        self.config, self.admission = admission.resolve(
            config, make_runner, frame_seconds, budget, self.device
        )
        config = self.config
        self.runner = make_runner(self.blocks, config.max_active)
        self.pacing = PacingPolicy.from_config(config, frame_seconds)
        self.scheduler = Scheduler.from_config(config, self.runner, self.blocks, self.pacing)
        # Guards the scheduler, the block manager, `_open` and the lifecycle state.
        self._lock = threading.Condition()
        self._state: State = "new"
        self._failure: str | None = None
        # Requests whose stream has not had its final event yet, whatever stage holds them.
        self._open: dict[str, Request] = {}
        self._metrics = EngineMetrics(self._gauges(), leads=self._leads)
        self.decoder = DecoderWorker(
            self.runner,
            self._metrics,
            self.sample_rate,
            max_batch=config.max_active,
            max_frames_per_call=config.max_decode_frames,
            max_row_frames_per_call=config.max_decode_row_frames,
            on_row_freed=self._decoder_row_freed,
            on_first_audio=self._first_audio,
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
        self.stream_host = StreamHost(
            config, loaded, self._lock, self.scheduler, self.pacing, self.admit
        )
        self.voice_registry = VoiceRegistry(self._lock, self.scheduler.voices, self.model)
        self.default_voice = loaded.default_voice
        if self.default_voice in loaded.voices:
            self.add_voice(self.default_voice, loaded.voices[self.default_voice])
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

    def prepare_traces(self) -> None:
        """Make the AR stage's traces (its step, a prompt pass) and the decoder's now (0.7-1.3 s
        on a 2-core Zen 3), so that no served call stalls while one is made. The server calls it at
        startup and the plugins' prewarm with their warm-up; an engine that skips it makes them
        as it serves (`EngineConfig.trace_after`)."""
        self.runner.prepare_ar_traces()
        self.runner.prepare_decoder_traces()

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
        return self.voice_registry.names()

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
        self.voice_registry.add(name, source, lazy)

    def prefill_voice(self, name: str) -> None:
        """Make a registered voice's pages resident now (reading or encoding it again if it was
        evicted), so that `stream()` on it does not: a server calls this off its event loop.
        UnknownVoiceError if no such voice, or if it cannot be loaded any more."""
        self.voice_registry.prefill(name)

    def remove_voice(self, name: str) -> bool:
        """Unregister a voice: no new stream may use it; the streams using it finish with it,
        and its pages go back after them. False if no such voice. The default voice stays."""
        if name == self.default_voice:
            raise ValueError(f"{name!r} is the default voice: it cannot be removed")
        return self.voice_registry.remove(name)

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
        stream = self.stream_host.new_stream(voice or self.default_voice or "", options, tenant)
        self.admit(stream.request)
        return stream

    def admit(self, request: Request, replacing: Request | None = None) -> None:
        """Open `request` (a stream's, `StreamHost`), with its voice made resident; or in place
        of `replacing`, which then ends with no event (`StreamHost.reseat`). Raises what
        `stream` says; a request that takes another's place is not held to the stream and
        queue limits (it frees its place as it takes it)."""
        self.voice_registry.with_resident(
            request.voice, self._check_serving, partial(self._open_request, request, replacing)
        )

    def _open_request(
        self, request: Request, replacing: Request | None, voice: VoicePrefix
    ) -> None:
        """Under the lock, with the request's voice resident: check capacity and admit it."""
        options = request.options
        voices = self.scheduler.voices
        voices.pin(voice)  # first, so that the capacity below counts its pages as held
        try:
            # The smallest clause (one token, one frame) must fit beside the chaining tail.
            pages = self.scheduler.clause_pages(request.voice, options.chain_frames + 1, 1)
            if pages > self.scheduler.clause_capacity():
                raise InvalidOptionError(
                    f"chain_frames={options.chain_frames} does not fit in this engine's KV pool"
                )
            if replacing is None and len(self._open) >= self.config.max_streams:
                raise EngineFullError(f"{self.config.max_streams} streams already open")
            if replacing is None and len(self.scheduler.waiting) >= self.config.max_queued:
                raise EngineFullError(f"{self.config.max_queued} requests already queued")
        except BaseException:
            voices.unpin(request.voice)
            raise
        if replacing is not None:
            # Out of `_open` first, so that its end (below, on the AR thread) says nothing.
            self._open.pop(replacing.id, None)
            replacing.cancelled = replacing.replaced = True
            self._lock.notify_all()
        self.scheduler.add(request)
        self._open[request.id] = request

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

    def _gauges(self) -> dict[str, Callable[[], float]]:
        """What each gauge of the metrics reads, when a snapshot or a scrape asks."""
        voices = self.scheduler.voices
        return {
            "streams_open": lambda: len(self._open),
            "rows_generating": lambda: self.ar.rows_generating,
            "streams_paced": lambda: self.ar.streams_paced,
            "kv_pages_in_use": lambda: self.blocks.pages_in_use,
            "kv_pages_free": lambda: len(self.blocks.free_pages),
            "kv_pages_total": lambda: self.blocks.num_pages,
            "kv_row_contexts_bytes": lambda: self.runner.row_contexts.nbytes,
            "voices_registered": lambda: len(voices),
            "voices_resident": lambda: len(voices.resident),
            "voice_pages": lambda: voices.resident_pages,
            "voice_loads": lambda: voices.loads,
            "voice_evictions": lambda: voices.evictions,
            "active_requests": lambda: self.scheduler.active,
            "queued_requests": lambda: len(self.scheduler.waiting),
            "decoder_states_in_use": lambda: self.runner.decoder_states.in_use,
            "decoder_queue_depth": lambda: self.decoder.queue.qsize(),
        }

    def _leads(self) -> list[float]:
        t = now()
        return [self.pacing.lead(r, t) for r in list(self.scheduler.running)]

    # ---- callbacks from the decoder worker

    def _decoder_row_freed(self, request: Request) -> None:
        """A parked request's decoder row is free (its history saved)."""
        with self._lock:
            self.scheduler.decoder_row_freed(request)
            self._lock.notify_all()

    def _first_audio(self, request: Request) -> None:
        """A stream's first audio is out: its next AR step may start one (`PacingPolicy.need`)."""
        with self._lock:
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
