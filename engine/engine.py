"""The batched streaming engine: an AR thread and a decoder worker joined by a queue.

The AR thread admits requests, prefills their clauses in packed passes and advances every
generating request one latent per step; each latent goes to the decoder worker
(`decoder_worker.py`), which batches whatever is ready and hands the audio to the request's
`Stream` on the caller's own event loop.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import threading
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from intone.engine.block_manager import BlockManager
from intone.engine.decoder_worker import ClauseEndItem, DecoderWorker, FinishItem, LatentItem
from intone.engine.errors import EngineError, EngineFullError
from intone.engine.generate import make_generator
from intone.engine.loading import LoadedModel, load_model
from intone.engine.metrics import EngineMetrics
from intone.engine.model_runner import ModelRunner
from intone.engine.options import ClausePlan, GenerationOptions, plan_clause
from intone.engine.precision import resolve_precision
from intone.engine.scheduler import Scheduler, VoicePrefix
from intone.engine.sequence import Clause, Phase, Request, RequestMetrics, now
from intone.engine.stream import AudioChunk, ClauseDone, Stream
from intone.engine.text import ClauseSplitter
from intone.engine.thread_budget import ThreadBudget
from intone.engine.voices import Voice, load_voice

__all__ = [
    "AudioChunk",
    "ClauseDone",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineFullError",
    "Stream",
]

logger = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    device: str = "cpu"
    # Precision policy (engine/precision.py): "auto" is the fastest that holds the fast path's
    # tolerance against float32 on this device; "float32" runs everything in float32; "bfloat16"
    # the FlowLM in bf16 (and on the CPU the Mimi decoder transformer in int8).
    dtype: str = "auto"
    # Intra-op threads for torch (process-wide). None: the cores divided among the stages busy at
    # the moment (engine/thread_budget.py): half each while the AR and decoder stages both run
    # (measured on 2 cores: 9.4 audio-s/s at 8 streams with one thread each against 6.6 with
    # two; docs/benchmarks.md), all of them for a stage running alone. 0 leaves torch's setting.
    torch_threads: int | None = None
    # Pad AR batches to these sizes so steps repeat a few shapes (for CUDA graph capture);
    # None runs every batch at its own size, which is cheaper on a CPU.
    batch_buckets: tuple[int, ...] | None = None
    page_size: int = 16
    num_pages: int | None = None  # None: as many as kv_memory_mb holds
    kv_memory_mb: float = 256.0
    max_active: int = 16  # requests generating at once (AR batch and decoder rows)
    max_queued: int = 256  # requests waiting for admission
    max_prefill_tokens: int = 2048  # positions per packed prefill pass
    max_text_chars: int = 20_000  # per request
    max_frames: int | None = None  # per clause, on top of the model's own estimate
    flow_steps: int = 1
    max_decode_frames: int = 4  # latents per request per decode call, when several wait
    default_chain_frames: int = 4
    clause_min_tokens: int = 6
    clause_first_min_tokens: int = 4
    clause_max_tokens: int = 50

    def validate(self) -> None:
        resolve_precision(self.dtype, self.device)
        positive = ("page_size", "max_active", "max_queued", "max_prefill_tokens", "flow_steps")
        for name in positive + ("max_decode_frames",):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1")


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        config.validate()
        self.loaded = loaded
        self.device = torch.device(config.device)
        threads = config.torch_threads
        budget = None
        if threads is None:
            budget = ThreadBudget(os.cpu_count() or 2)
            threads = budget.threads_for(2)
        if threads:
            torch.set_num_threads(threads)
        self.model = loaded.model
        precision = resolve_precision(config.dtype, config.device)
        if precision.flow_lm != torch.float32:
            # The loaded model may be shared with float32 users: cast a copy.
            self.model = copy.deepcopy(loaded.model)
            self.model.flow_lm.transformer.to(precision.flow_lm)
        self.model.to(self.device)
        flow_lm = self.model.flow_lm
        slot_bytes = flow_lm.new_kv_pool(0, device="cpu").slot_bytes
        num_pages = config.num_pages or max(
            1, int(config.kv_memory_mb * 2**20 // (slot_bytes * config.page_size))
        )
        self.blocks = BlockManager(num_pages, config.page_size)
        self.runner = ModelRunner(
            self.model,
            self.blocks,
            config.max_active,
            config.flow_steps,
            self.device,
            config.batch_buckets,
            decoder_int8=precision.decoder_int8,
            thread_budget=budget,
        )
        self.scheduler = Scheduler(
            self.runner, self.blocks, config.max_active, config.max_prefill_tokens
        )
        self._lock = threading.Condition()
        self._delivered: deque[Request] = deque()
        self._ids = itertools.count()
        self._running = False
        self._ar_thread: threading.Thread | None = None
        self._metrics = EngineMetrics(
            {
                "kv_pages_in_use": lambda: self.blocks.pages_in_use,
                "kv_pages_free": lambda: len(self.blocks.free_pages),
                "kv_pages_total": lambda: self.blocks.num_pages,
                "active_requests": lambda: self.scheduler.active,
                "queued_requests": lambda: len(self.scheduler.waiting),
                "decoder_states_in_use": lambda: self.runner.decoder_states.in_use,
                "decoder_queue_depth": lambda: self.decoder.queue.qsize(),
            }
        )
        self.decoder = DecoderWorker(
            self.runner,
            self._metrics,
            self.sample_rate,
            max_batch=config.max_active,
            max_frames_per_call=config.max_decode_frames,
            on_clause_delivered=self._clause_delivered,
            on_released=self._decoder_released,
        )
        for name, source in loaded.voices.items():
            if name == loaded.default_voice:
                self.add_voice(name, source)
        self.default_voice = loaded.default_voice

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
        if self._running:
            return self
        self._running = True
        self._ar_thread = threading.Thread(target=self._ar_loop, name="intone-ar", daemon=True)
        self._ar_thread.start()
        self.decoder.start()
        return self

    def close(self) -> None:
        """Stop the threads; streams still open end with an EngineError."""
        with self._lock:
            open_requests = list(self.scheduler.waiting) + list(self.scheduler.running)
            for request in open_requests:
                request.cancelled = True
            self._running = False
            self._lock.notify_all()
        if self._ar_thread is not None:
            self._ar_thread.join(timeout=10)
            self._ar_thread = None
        self.decoder.stop()
        for request in open_requests:
            request.sink(EngineError("the engine was closed"))

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- voices

    @property
    def voices(self) -> list[str]:
        return sorted(self.scheduler.voices)

    def add_voice(self, name: str, source: str | Path | Voice) -> None:
        """Register a voice from audio, a voice-state file or a computed Voice; prefilled once."""
        voice = source if isinstance(source, Voice) else load_voice(self.model, name, source)
        with self._lock:
            old = self.scheduler.voices.pop(name, None)
            self.scheduler.voices[name] = VoicePrefix(name, self.runner.add_voice(voice))
            if old is not None:
                self.blocks.release(old.table)  # requests using it hold their own references

    # ---- requests

    def stream(self, voice: str | None = None, options: GenerationOptions | None = None) -> Stream:
        """A new text stream. Raises at once on bad options, an unknown voice or a full queue."""
        options = options or GenerationOptions(chain_frames=self.config.default_chain_frames)
        options.validate()
        if options.flow_steps != self.config.flow_steps:
            raise ValueError(
                f"this engine runs {self.config.flow_steps} flow step(s); got {options.flow_steps}"
            )
        voice = voice or self.default_voice
        if voice is None or voice not in self.scheduler.voices:
            raise ValueError(f"unknown voice {voice!r}; known voices: {self.voices}")
        if not self._running:
            raise RuntimeError("the engine is not running: call start()")
        model_config = self.loaded.config
        request = Request(
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
        )
        request.options = options
        splitter = ClauseSplitter(
            self.loaded.tokenizer,
            min_tokens=self.config.clause_min_tokens,
            first_min_tokens=self.config.clause_first_min_tokens,
            max_tokens=self.config.clause_max_tokens,
        )
        stream = Stream(self, request, splitter)
        request.sink = stream._post
        with self._lock:
            if len(self.scheduler.waiting) >= self.config.max_queued:
                raise EngineFullError(f"{self.config.max_queued} requests already queued")
            self.scheduler.waiting.append(request)
        return stream

    async def synthesize(
        self, text: str, voice: str | None = None, options: GenerationOptions | None = None
    ) -> np.ndarray:
        """The whole audio of `text`, float32 at the model's rate."""
        if not text.strip():
            raise ValueError("text is empty")
        stream = self.stream(voice, options)
        try:
            stream.push_text(text)
            stream.end_input()
            chunks = [chunk async for chunk in stream.audio()]
        except BaseException:
            stream.cancel()
            raise
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)

    def _plan(self, request: Request, text: str) -> ClausePlan:
        options = replace(request.options)
        if self.config.max_frames is not None:
            options.max_frames = min(
                options.max_frames or self.config.max_frames, self.config.max_frames
            )
        plan = plan_clause(self.loaded, text, options)
        pages = self.scheduler.clause_pages(
            request.voice, request.chain_frames + len(plan.tokens), plan.max_frames
        )
        capacity = self.scheduler.clause_capacity()
        if pages > capacity:
            raise ValueError(
                f"a clause needs {pages} KV pages but only {capacity} of the pool's "
                f"{self.blocks.num_pages} are not held by voices: raise num_pages or lower "
                "max_frames"
            )
        return plan

    def _submit(self, request: Request, clauses: list[Clause], end: bool) -> None:
        with self._lock:
            request.pending.extend(clauses)
            request.input_ended |= end
            if request.metrics.clauses == 0 and clauses:
                request.metrics.submitted_at = now()
            request.metrics.clauses += len(clauses)
            self._lock.notify_all()

    def _cancel(self, request: Request) -> None:
        with self._lock:
            request.cancelled = True
            self._lock.notify_all()

    # ---- metrics

    def metrics(self) -> dict:
        return self._metrics.snapshot()

    def prometheus(self) -> bytes:
        return self._metrics.prometheus()

    def is_idle(self) -> bool:
        m = self.metrics()
        return m["active_requests"] == 0 and m["queued_requests"] == 0

    # ---- AR thread

    def _ar_loop(self) -> None:
        while True:
            with self._lock:
                batch = None
                while self._running:
                    self._handle_deliveries()
                    self._retire_requests()
                    batch = self.scheduler.schedule()
                    if batch.prefill or batch.generate:
                        break
                    self._lock.wait()
                if not self._running:
                    self._retire_requests()
                    return
            try:
                self._run_batch(batch.prefill, batch.generate)
            except Exception as e:  # a failed step fails its requests, not the engine
                logger.exception("AR step failed")
                with self._lock:
                    for request in batch.prefill + batch.generate:
                        self._finish(request, cancelled=False, error=EngineError(str(e)))

    def _handle_deliveries(self) -> None:
        """Clauses whose audio the decoder delivered: save the tail and free the pages."""
        while self._delivered:
            request = self._delivered.popleft()
            if request.phase is Phase.DRAINING:
                if request.chain_frames and request.latents:
                    request.tail = torch.stack(request.latents[-request.chain_frames :])
                self.scheduler.end_clause(request)
                request.phase = Phase.IDLE

    def _retire_requests(self) -> None:
        for request in list(self.scheduler.waiting) + list(self.scheduler.running):
            if request.cancelled:
                self._finish(request, cancelled=True)
            elif (
                request.input_ended
                and not request.pending
                and request.phase in (Phase.IDLE, Phase.WAITING)
            ):
                self._finish(request, cancelled=False)

    def _finish(self, request: Request, cancelled: bool, error: Exception | None = None) -> None:
        admitted = request in self.scheduler.running
        self.scheduler.finish(request)
        if admitted:
            self.scheduler.releasing.add(request.id)
            self.decoder.put(FinishItem(request, cancelled, error))
        elif not cancelled:
            request.sink(error)
        if error is None:
            request.metrics.finished_at = now()

    def _run_batch(self, prefill: list[Request], generate: list[Request]) -> None:
        if prefill:
            self.runner.prefill(prefill)
            self._metrics.batch("prefill", len(prefill))
            nan = torch.full((self.model.flow_lm.latent_dim,), float("nan"), device=self.device)
            for request in prefill:
                request.prompt = None
                request.previous_latent = nan
                request.phase = Phase.GENERATING
            generate = generate + prefill
        if not generate:
            return
        latents, eos_logits = self.runner.generate(generate)
        self._metrics.batch("generate", len(generate))
        eos = (eos_logits > torch.tensor([r.eos_threshold for r in generate])).tolist()
        for request, latent, is_eos in zip(generate, latents, eos, strict=True):
            assert request.progress is not None
            keep = request.progress.advance(is_eos)
            if keep:
                request.previous_latent = latent
                request.latents.append(latent)
                self.decoder.put(LatentItem(request, latent, request.clause.index))
            if request.progress.ended:
                request.phase = Phase.DRAINING
                clause = request.clause
                eos = request.progress.eos_step
                done = ClauseDone(clause.index, clause.text, len(request.latents), eos)
                self.decoder.put(ClauseEndItem(request, done))

    # ---- callbacks from the decoder worker

    def _clause_delivered(self, request: Request) -> None:
        with self._lock:
            self._delivered.append(request)
            self._lock.notify_all()

    def _decoder_released(self, request: Request) -> None:
        with self._lock:
            self.scheduler.releasing.discard(request.id)
            self._lock.notify_all()
