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

import copy
import itertools
import logging
import math
import os
import statistics
import threading
import time
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
from intone.engine.block_manager import BlockManager, PageTable
from intone.engine.cpu_memory import keep_freed_memory
from intone.engine.decoder_worker import (
    ClauseEndItem,
    DecoderWorker,
    FinishItem,
    LatentItem,
    ParkItem,
    running_mean,
)
from intone.engine.errors import (
    EmptyTextError,
    EngineClosedError,
    EngineError,
    EngineFailedError,
    EngineFullError,
    IdleTimeoutError,
    InvalidOptionError,
    TextTooLongError,
    UnknownVoiceError,
)
from intone.engine.events import AudioChunk, ClauseDone
from intone.engine.generate import make_generator
from intone.engine.loading import LoadedModel, load_model
from intone.engine.metrics import EngineMetrics
from intone.engine.model_runner import ModelRunner
from intone.engine.models.pocket.bf16 import bf16_linears
from intone.engine.models.pocket.gemm_decoder import TRACE_AFTER_CALLS
from intone.engine.models.pocket.int8 import int8_linears
from intone.engine.options import ClausePlan, GenerationOptions, plan_clause
from intone.engine.pacing import PACING_MODES, Need, PacingMode, PacingPolicy, Playback
from intone.engine.precision import configure_precision, resolve_precision
from intone.engine.scheduler import Scheduler
from intone.engine.sequence import Clause, Phase, Request, RequestMetrics, now
from intone.engine.stream import Stream
from intone.engine.text import ClauseSplitter, check_text
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

# How often the AR thread looks again while pacing holds a stream back: playback and reading
# move on without telling it.
PACING_POLL_S = 0.02
# While the decoder is busy, a new stream's first frames are decoded on the AR thread
# (`Engine._emit`), outside the pool, this many of them: the decoder worker takes the stream over
# after them. Playback starts with the first audio, and the worker's first frame of the stream
# must come before the first frames have played (plus the listener's slack). It comes after the
# latents, a row's AR steps apart, and `HANDOVER_CALLS` of the worker's calls: one in flight and
# one of its own. Where those are short (`Engine._first_audio_waits`; the 2M model, 64 streams on
# 2 cores), each first frame is decoded as soon as its latent comes, and first audio is one frame
# (80 ms). Where they are long (full size, 16 streams: latents ~70 ms apart, calls ~50 ms), the
# first audio waits for the second frame and holds both (160 ms): with one frame first, streams
# ran dry at the worker's first frame. That costs one AR step of first-audio latency, under load
# only: an idle decoder takes a new stream's latents at once.
FIRST_FRAMES_ON_AR = 2
HANDOVER_CALLS = 2
# Tries `stream()` makes to find its voice resident: it loads an evicted one between tries, and
# only a pool churned by other loads in that moment evicts it again.
VOICE_LOAD_TRIES = 3


def _same(voice: Voice) -> Voice:
    """A `Voice` handed to `add_voice` loads again as itself."""
    return voice


@dataclass(frozen=True)
class Health:
    """Whether the engine can serve: `reason` says why not (for /healthz and the logs)."""

    ok: bool
    reason: str | None = None


@dataclass
class EngineConfig:
    device: str = "cpu"
    # Precision policy (engine/precision.py): "auto" is the fastest that holds the fast path's
    # tolerance against float32 on this device; "float32" runs everything in float32; "bfloat16"
    # the FlowLM transformer and flow head in bf16 (and on the CPU the Mimi decoder transformer in
    # int8).
    dtype: str = "auto"
    # Intra-op threads for torch (process-wide). None: the cores divided among the stages busy at
    # the moment (engine/thread_budget.py): half each while the AR and decoder stages both run
    # (one thread per stage on 2 cores: two oversubscribe them, bench/results/cpu-2core/), all
    # but one for a stage that starts alone (on 2 cores, one
    # thread each whatever the load). 0 leaves torch's setting.
    torch_threads: int | None = None
    # Pad AR batches to these sizes so steps repeat a few shapes (for CUDA graph capture);
    # None runs every batch at its own size, which is cheaper on a CPU.
    batch_buckets: tuple[int, ...] | None = None
    page_size: int = 16
    num_pages: int | None = None  # None: as many as kv_memory_mb holds
    kv_memory_mb: float = 256.0
    # Rows: requests generating at once (AR batch and decoder rows). "auto": as many as this
    # model keeps in real time on this machine, measured at start (engine/admission.py; a second
    # or two at full size on a CPU). `Engine.config` holds the number chosen.
    max_active: int | Literal["auto"] = "auto"
    max_queued: int = 256  # requests with text waiting for a row
    # Open streams. One with no text pending holds no row and no queue place, only this.
    max_streams: int = 1024
    # A stream with no text pushed and no audio pending or in flight for this long ends with
    # IdleTimeoutError; None disables it. The server sets its own (30 s by default).
    idle_timeout_s: float | None = 300.0
    # Playback pacing (engine/pacing.py): what a stream more than lead_s seconds of audio (as
    # heard, after `speed`) ahead of its playback may take. "yield": only the compute no stream
    # within lead_s needs (an idle engine renders as fast as it can); "hold": no AR steps until
    # playback catches up; "off": as fast as possible, like lead_s=None (offline rendering).
    pacing: PacingMode = "yield"
    lead_s: float | None = 2.0
    # A stream whose consumer has this many seconds of audio unread stops generating (it is
    # not dropped) until the consumer reads; None: unbounded.
    max_unread_s: float | None = 10.0
    # Rows one tenant (`Engine.stream(tenant=...)`) may hold; the others are served first.
    max_rows_per_tenant: int | None = None
    max_prefill_tokens: int = 2048  # positions per packed prefill pass
    # New streams per prefill pass while a stream that plays is near an underrun (under
    # `pacing.URGENT_S` ahead of its listener): a burst of them is prefilled in parts, with the
    # playing streams' AR steps and decode calls between the parts. In one pass, 64 streams
    # starting at once (2M model, 2 cores) held the playing ones 150-250 ms, with 160 ms of
    # audio each (bench/results/cpu-2core-epyc-avx512-burst-parts-ab/).
    max_prefill_rows_near_underrun: int = 16
    max_text_chars: int = 20_000  # per request
    max_frames: int | None = None  # per clause, on top of the model's own estimate
    flow_steps: int = 1
    max_decode_frames: int = 4  # latents per request per decode call, when several wait
    # Row-frames (rows x frames) per decode call, past which rows take fewer frames: a call is
    # not preemptible, and a stream that just started has only two frames (160 ms) to play
    # while it waits. 64 keeps a 2M-model call near 40 ms (64 x 4 took 150-300 ms); per
    # row-frame a call costs about the same from 64 up
    # (bench/results/cpu-2core-epyc-avx512-burst-parts-ab/).
    max_decode_row_frames: int = 64
    # Calls of one shape after which the CPU decoder replays it as a TorchScript trace, which
    # does not hold the GIL the AR thread needs (engine/models/pocket/traces.py); None: eager.
    decoder_trace_after: int | None = TRACE_AFTER_CALLS
    # On a CPU with glibc, keep freed activations in the heap instead of page-faulting them in
    # again on every call (engine/cpu_memory.py). Process-wide: False leaves malloc alone.
    keep_freed_memory: bool = True
    # On a CPU, an AR step attends through a C++ torch operator built for this machine at start
    # (engine/models/pocket/lane_ops.py): about half the time of torch's batched products at
    # 16 rows. The decoder's ELU, GELU and attention run as C++ torch operators built likewise
    # (engine/models/pocket/decoder_ops.py): ~11% of a full-size decode call. Where nothing
    # builds, or False, torch runs them; the two paths agree to ~1e-6.
    native_kernels: bool = True
    default_chain_frames: int = 4
    # The deadline rule (`Stream`): a stream that has spoken every clause it was given cuts the
    # words it holds at the best boundary there is this long before its listener would run out
    # of audio (about a new clause's time to first audio under load); None: never (offline
    # rendering, where nobody listens in real time).
    cut_before_dry_s: float | None = 0.3
    # Later clauses' minimum; the first clause's policy is per stream (`GenerationOptions`).
    clause_min_tokens: int = 6
    clause_max_tokens: int = 50
    # KV pool memory the voice prompts may hold while no stream uses them; past it the least
    # recently used idle voices give their pages back and are loaded again on their next stream
    # (engine/voice_cache.py). None: every registered voice stays in the pool.
    voice_cache_mb: float | None = None

    def validate(self) -> None:
        # cpu, or cuda[:N] with N a GPU this machine has.
        devices.device_io(self.device)
        resolve_precision(self.dtype, self.device)
        if self.max_active != "auto" and (
            isinstance(self.max_active, bool) or not isinstance(self.max_active, int)
        ):
            raise ValueError(
                f"EngineConfig.max_active must be auto or >= 1, not {self.max_active!r}"
            )
        positive = (
            "page_size",
            *(() if self.max_active == "auto" else ("max_active",)),
            "max_queued",
            "max_streams",
            "max_prefill_tokens",
            "max_prefill_rows_near_underrun",
            "flow_steps",
            "max_decode_frames",
            "max_decode_row_frames",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1")
        for name in ("max_rows_per_tenant", "decoder_trace_after"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1 or None")
        if self.cut_before_dry_s is not None and not 0 <= self.cut_before_dry_s < math.inf:
            raise ValueError("EngineConfig.cut_before_dry_s must be >= 0 and finite, or None")
        for name in ("idle_timeout_s", "lead_s", "max_unread_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"EngineConfig.{name} must be > 0 or None")
        if self.pacing not in PACING_MODES:
            raise ValueError(
                f"EngineConfig.pacing must be one of {', '.join(PACING_MODES)}, not {self.pacing!r}"
            )
        if self.torch_threads is not None and self.torch_threads < 0:
            raise ValueError("EngineConfig.torch_threads must be >= 0 (0: torch's own) or None")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError("EngineConfig.num_pages must be >= 1 or None")
        if self.voice_cache_mb is not None and not 0 <= self.voice_cache_mb < math.inf:
            raise ValueError(
                f"EngineConfig.voice_cache_mb must be >= 0 and finite or None, "
                f"got {self.voice_cache_mb}"
            )
        if not 0 < self.kv_memory_mb < math.inf:
            raise ValueError(
                f"EngineConfig.kv_memory_mb must be > 0 and finite, got {self.kv_memory_mb}"
            )


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
        self.model = loaded.model
        precision = resolve_precision(config.dtype, config.device)
        shared = loaded.model.flow_lm
        if loaded.model.device != self.device:
            # A copy made on the device, tensor by tensor: `.to` would move the caller's model in
            # place, and a copy on the host first would hold the weights twice there.
            transformer = {id(t) for t in shared.transformer.parameters()}
            transformer |= {id(t) for t in shared.transformer.buffers()}
            self.model = devices.module_on(
                loaded.model,
                self.device,
                lambda t: precision.flow_lm if id(t) in transformer else None,
            )
            shared = self.model.flow_lm
        # The loaded model may be shared with float32 users: change a copy. Parts that are
        # converted into new modules anyway are shared with it, not copied first.
        converted = [
            part
            for part, convert in (
                (shared.transformer, precision.flow_lm_int8),
                (shared.flow_net, precision.flow_head_bf16),
            )
            if convert
        ]
        if self.model is loaded.model and (converted or precision.flow_lm != torch.float32):
            self.model = copy.deepcopy(loaded.model, {id(part): part for part in converted})
            if not precision.flow_lm_int8:
                self.model.flow_lm.transformer.to(precision.flow_lm)
        if precision.flow_lm_int8:
            transformer = shared.transformer
            self.model.flow_lm.transformer = int8_linears(transformer) or transformer
        if precision.flow_head_bf16:
            # The engine's own copy (made on the device) is converted where it is.
            own = shared is not loaded.model.flow_lm
            self.model.flow_lm.flow_net = bf16_linears(shared.flow_net, in_place=own)
        configure_precision(self.device, precision.flow_lm == torch.float32)
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

        self._frame_seconds = self.model.samples_per_frame / self.sample_rate
        # What max_active="auto" measured and chose; None for a number given.
        self.admission: Admission | None = None
        if config.max_active == "auto":
            cores = (
                (budget.cores if budget else torch.get_num_threads())
                if self.device.type == "cpu"
                else 0
            )
            self.admission = admission.probe(
                partial(make_runner, rows=max(admission.PROBE_ROWS)),
                config.page_size,
                self._frame_seconds,
                cores,
            )
            self.config = config = replace(config, max_active=self.admission.max_active)
        self.runner = make_runner(self.blocks, config.max_active)
        self.pacing = PacingPolicy(
            config.pacing,
            config.lead_s,
            config.max_unread_s,
            self._frame_seconds,
            config.max_decode_frames,
        )
        # Each stage's device work on a stream of its own (on a GPU; nothing on a CPU).
        self._ar_stage = self.io.stage()
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
        self._ar_thread: threading.Thread | None = None
        self._rows_generating = 0
        # Seconds between a row's latents (a running measure of each pass's median); None
        # before any row had two.
        self._latent_interval_s: float | None = None
        self._streams_paced = 0
        self._metrics = EngineMetrics(
            {
                "streams_open": lambda: len(self._open),
                "rows_generating": lambda: self._rows_generating,
                "streams_paced": lambda: self._streams_paced,
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
            on_released=self._decoder_released,
            on_finished=self._decoder_finished,
            on_failed=self._decode_failed,
            on_fatal=self._fail,
            paced=self.pacing.paced,
            yield_after_s=self.pacing.yield_after_s,
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
        self._ar_thread = threading.Thread(target=self._ar_main, name="intone-ar", daemon=True)
        self._ar_thread.start()
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
        if self._ar_thread is not None:
            self._ar_thread.join(timeout=10)
            self._ar_thread = None
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
            ("AR", self._ar_thread is not None and self._ar_thread.is_alive()),
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
            table = self._write_voice(name, voice)
            self.scheduler.voices.set(VoicePrefix(name, voice.length, load, table))

    def _write_voice(self, name: str, voice: Voice) -> PageTable:
        """Under the lock: new pages holding `voice`'s prompt (idle voices evicted for room)."""
        voices = self.scheduler.voices
        pages = self.blocks.pages_for(voice.length)
        if pages > self.blocks.pages_available:
            voices.make_room(pages)
        try:
            table = self.blocks.allocate(voice.length)
        except MemoryError as e:
            raise EngineFullError(f"no room in the KV pool for voice {name!r}: {e}") from e
        try:
            self.runner.write_voice(table, voice)
            # Written on this thread's stream; the AR stage reads it on its own.
            self.io.synchronize()
        except Exception as e:
            self.blocks.release(table)
            raise EngineFailedError(f"registering voice {name!r} failed: {e!r}") from e
        return table

    def prefill_voice(self, name: str) -> None:
        """Make a registered voice's pages resident now (reading or encoding it again if it was
        evicted), so that `stream()` on it does not: a server calls this off its event loop.
        UnknownVoiceError if no such voice, or if it cannot be loaded any more."""
        with self._lock:
            entry = self._voice_entry(name)
            self.scheduler.voices.touch(entry)
            if entry.table is not None:
                return
        voice = self._load_voice(entry)
        with self._lock:
            self._place_voice(entry, voice)

    def _voice_entry(self, name: str) -> VoicePrefix:
        entry = self.scheduler.voices.get(name)
        if entry is None:
            raise UnknownVoiceError(
                f"unknown voice {name!r}; known voices: {sorted(self.scheduler.voices)}"
            )
        return entry

    def _load_voice(self, entry: VoicePrefix) -> Voice:
        """Outside the lock: the voice's prompt K/V again (a file read, or an encoding)."""
        try:
            return entry.load()
        except (ValueError, OSError) as e:
            raise UnknownVoiceError(f"voice {entry.name!r} could not be loaded: {e}") from e

    def _place_voice(self, entry: VoicePrefix, voice: Voice) -> None:
        """Under the lock: write a loaded voice's pages, unless it was replaced, removed or
        loaded meanwhile; it stays while idle voices are evicted for the budget."""
        if self.scheduler.voices.get(entry.name) is not entry or entry.table is not None:
            return
        table = self._write_voice(entry.name, voice)
        self.scheduler.voices.place(entry, table)
        self.scheduler.voices.fit(keep=entry)

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
                entry = self._voice_entry(request.voice)
                if entry.table is not None:
                    return self._open_stream(stream, request, entry, options)
            # Evicted (or registered lazily): read again here, outside the lock, and pinned in
            # the same locked section that writes its pages.
            loaded = self._load_voice(entry)
            with self._lock:
                self._check_serving()
                self._place_voice(entry, loaded)
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

    # ---- AR thread

    def _ar_main(self) -> None:
        try:
            with self._ar_stage.enter():
                self._ar_loop()
        except BaseException as e:
            logger.exception("the AR stage failed")
            self._fail(f"AR stage failed: {e!r}", e)
            return
        with self._lock:
            stopped_while_running = self._state == "running"
        if stopped_while_running:
            self._fail("the AR thread stopped", None)

    def _ar_loop(self) -> None:
        last = now()
        while True:
            with self._lock:
                while True:
                    if self._state != "running":
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
                    if batch.prefill or batch.generate:
                        break
                    self._rows_generating = 0
                    if not (batch.failed or batch.parked):
                        self._lock.wait(self._next_wake(t))
            self._step(batch.prefill, batch.generate)

    def _metrics_paced(self, held: int, elapsed: float) -> None:
        if self._streams_paced and elapsed > 0:
            self._metrics.paced(self._streams_paced * elapsed)
        self._streams_paced = held

    # ---- pacing and idle streams

    def unread_seconds(self, request: Request) -> float:
        """Seconds of the request's audio its consumer has not read (`PacingPolicy.unread`)."""
        return self.pacing.unread(request)

    def held(self, request: Request, t: float) -> bool:
        """Pacing holds the request: too much audio unread, or (pacing "hold") far ahead."""
        return self.pacing.held(request, t)

    def _leads(self) -> list[float]:
        t = now()
        return [self.pacing.lead(r, t) for r in list(self.scheduler.running)]

    def _idle_deadline(self, request: Request) -> float | None:
        """When an idle request times out: no text pending and no audio pending or in flight."""
        timeout = self.config.idle_timeout_s
        if (
            timeout is None
            or request.pending
            or request.phase is not Phase.WAITING
            or request.id not in self.scheduler.idle
            or request.id in self.scheduler.releasing
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
        if self._streams_paced or any(r.phase is Phase.GENERATING for r in self.scheduler.running):
            waits.append(PACING_POLL_S)
        return min(waits) if waits else None

    def _release_all(self) -> None:
        """Stopping: every request still scheduled ends with the shutdown error."""
        for request in self.scheduler.requests:
            self._finish(request, error=self._shutdown_error())

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
                self._metrics.idle_timeout()
                timeout = self.config.idle_timeout_s
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
        if self.scheduler.release(request) or request.in_decoder:
            self.decoder.put(FinishItem(request, cancelled, error))
        else:
            self._end(request, error, silent=cancelled)

    def _fail_rows(self, stage: str, rows: list[tuple[Request, Exception]]) -> None:
        if not rows:
            return
        with self._lock:
            for request, error in rows:
                logger.error("%s failed for %s: %r", stage, request.id, error, exc_info=error)
                self._finish(request, error=failed(stage, error))

    def _step(self, prefill: list[Request], generate: list[Request]) -> None:
        """One packed prefill pass, which also takes each prefilled clause's first AR step, then
        one AR step for the other rows and the prefilled ones; a failure is pinned on the rows
        that fail alone."""
        noise_of: dict[str, torch.Tensor] = {}
        prefill = self._prepare(prefill, noise_of)
        generate = self._prepare(generate, noise_of)

        def run(stage: str, what: str, call, batch: list[Request]) -> list:
            def step(rows: list[Request]) -> list[tuple[torch.Tensor, bool]]:
                latents, eos = call(rows, [noise_of[r.id] for r in rows])
                return list(zip(latents, self.io.values(eos), strict=True))

            started = time.perf_counter()
            done, failures = run_rows(step, batch)
            self._metrics.step(stage, len(batch), time.perf_counter() - started)
            self._fail_rows(what, failures)
            return done

        self._rows_generating = len(prefill) + len(generate)
        # The decoder keeps a core free while new streams' first frames are computed.
        self.decoder.first_frames_due = any(r.frames_generated == 0 for r in prefill)
        try:
            if prefill:
                first = run("prefill", "prefill", self.runner.prefill, prefill)
                for request, _ in first:
                    request.prompt = None
                    request.phase = Phase.GENERATING
                # Before the other rows' step, so they reach the decoder while that step runs.
                self._emit(first)
                # The prefilled rows join that step: a clause's second latent comes a step sooner
                # (a new stream's first frame plays for 80 ms only).
                with self._lock:
                    t = now()
                    joining = [
                        r
                        for r, _ in first
                        if r.phase is Phase.GENERATING
                        and self.scheduler.need(r, t) is not Need.NONE
                    ]
                generate += self._prepare(joining, noise_of)
            if generate:
                self._emit(run("generate", "AR step", self.runner.generate, generate))
        finally:
            self.decoder.first_frames_due = False

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
        with self._lock:
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
        self.io.hand_over(self._ar_stage)
        t = now()
        yielded = 0.0
        for request, (latent, is_eos) in done:
            assert request.progress is not None and request.clause is not None
            if request.progress.advance(is_eos):
                if self.pacing.ahead(request, t):
                    request.metrics.yielded_seconds += self._frame_seconds
                    yielded += self._frame_seconds
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
            self._metrics.yielded(yielded)
        if intervals:
            interval = statistics.median(intervals)
            self._latent_interval_s = running_mean(self._latent_interval_s, interval)
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
            self.io.hand_over(self._ar_stage)  # their histories go to the decoder too
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
        interval_s, call_s = self._latent_interval_s, self.decoder.call_s
        if interval_s is None or call_s is None:
            return False
        handover_s = FIRST_FRAMES_ON_AR * interval_s + HANDOVER_CALLS * call_s
        return handover_s > FIRST_FRAMES_ON_AR * self._frame_seconds

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
        with self._lock:
            for request in requests:
                if request.chain_frames and request.latents:
                    request.tail = torch.stack(request.latents[-request.chain_frames :])
                self.scheduler.end_clause(request)
                request.latents = []
                request.latent_at = None
                request.phase = Phase.IDLE

    # ---- callbacks from the decoder worker

    def _decoder_released(self, request: Request) -> None:
        """A parked request's decoder row is free (its history saved)."""
        with self._lock:
            self.scheduler.released(request)
            self._lock.notify_all()

    def _decoder_finished(self, request: Request, item: FinishItem) -> None:
        with self._lock:
            self.scheduler.released(request)
            self._lock.notify_all()
        error = item.error or request.error
        self._end(request, error, silent=item.cancelled and error is None)

    def _decode_failed(self, request: Request, error: Exception) -> None:
        with self._lock:
            if request.error is None:
                request.error = failed("decoding", error)
            self._lock.notify_all()


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
