"""The engine's configuration: `EngineConfig` (what a deployment sets) and every tuning constant
the stages use (what the code fixes, each with its reason). `intone serve` and the plugins take
their defaults from here.

The measurements behind the constants are in the READMEs of `bench/results/` (named at each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from intone.engine import device as devices
from intone.engine.precision import resolve_precision

# ---- pacing (engine/pacing.py)

PacingMode = Literal["yield", "hold", "off"]
PACING_MODES: tuple[PacingMode, ...] = ("yield", "hold", "off")
# A stream with less audio than this ahead of its listener is near an underrun: the decoder
# decodes it first, and while one that plays is, a prefill pass takes fewer new streams
# (`EngineConfig.max_prefill_rows_near_underrun`).
URGENT_S = 0.5
# And that pass is sized to end before the least-ahead of them runs out, less this much for the
# AR step and decode call that must follow it, by what recent passes cost
# (`Scheduler.prompt_pass_cost`): at full size on a 2-core Zen 3, seven new streams' first
# clauses took one pass of ~250 ms while a stream that had just started held 160 ms of audio.
PREFILL_MARGIN_S = 0.1
# A pass that joins the AR step (`ModelRunner.prefill_and_generate`) brings the playing streams'
# next latents itself: only their decode call is left after it (10-25 ms a frame in a wave of
# new streams, either model, on the Xeon). With `PREFILL_MARGIN_S` there, a new stream's one
# frame (80 ms) left room for one clause a pass, and a wave's first clauses queued.
JOINED_PREFILL_MARGIN_S = 0.04
# A prompt pass joins the AR step (`ModelRunner.joins`) where that saves at least this much a
# pass, timed at warm-up (`ModelRunner.prepare_ar_traces`): a new clause's second latent then
# comes a step later, which only a saving for every playing stream's step pays for. On a Xeon
# core, a clause of 8 positions beside 16 rows: full size 25 against 36 ms apart, the 2M model 3.0
# against 3.9; in the agent bench at c=64 the 2M model's p95 was 216-316 ms joined against 189-318.
JOINT_MIN_SAVING_S = 0.005
# How many recent prompt passes that cost is fitted to (`pass_cost.PromptPassCost`): a second or
# two of them under load, so it follows the machine's speed.
PASS_COST_MEMORY = 32
# When a stream that holds a row takes AR steps (`PacingPolicy.need`): latents not yet decoded,
# in decode calls' worth (`EngineConfig.max_decode_frames` each), past which it takes none, and
# under which it is due; and the share of `lead_s` under which a paced stream is due. Bursts
# batch more rows per step and leave the decoder more CPU (bench/results/cpu-2core-ar-bursts/).
AHEAD_OF_DECODER_CALLS = 3
DUE_DECODER_CALLS = 2
DUE_LEAD_SHARE = 0.75

# ---- the AR stage (engine/ar_worker.py)

# How often the AR thread looks again while pacing holds a stream back: playback and reading
# move on without telling it.
PACING_POLL_S = 0.02
# While the decoder is busy, a new stream's first frames are decoded on the AR thread
# (`ARWorker._emit`), outside the pool, this many of them: the decoder worker takes the stream
# over after them. Its first frame of the stream comes after those latents, a row's AR steps
# apart, and `HANDOVER_CALLS` of its calls (one in flight, one of its own), and must come before
# the first frames have played. Where that is short (`ARWorker._first_audio_waits`), each first
# frame is decoded as its latent comes (first audio: one 80 ms frame); where it is long (full
# size, 16 streams), the first audio waits for the second frame and holds both: one AR step of
# first-audio latency under load only (bench/results/cpu-2core-first-frames-ab/).
FIRST_FRAMES_ON_AR = 2
HANDOVER_CALLS = 2

# ---- the decoder stage (engine/decoder_worker.py)

# While holding for a first latent, how often the worker looks again at the streams' buffers.
HOLD_RECHECK_S = 0.02
# The longest a decode call may be expected to take (from the worker's measured seconds per
# row-frame): a call cannot be interrupted, and a stream the AR thread hands over after its first
# `FIRST_FRAMES_ON_AR` frames has those 160 ms to play while the call in flight ends
# (bench/results/cpu-2core-epyc-avx512-issue16-call-deadline/).
MAX_CALL_S = 0.16
# Nor does it shrink below this long: a small model's calls cost most per call, not per
# row-frame, and cut to the least-buffered stream's few milliseconds they made less audio.
MIN_CALL_S = 0.05
# Weight of the newest call in the worker's running measures (seconds per row-frame, per call).
COST_WEIGHT = 0.2
# A decode batch is split across cores only into parts of at least this many rows: below it the
# per-row cost of a decode call climbs.
DECODE_SPLIT_ROWS = 4
# Calls of one kind (an AR step, a prompt pass of one sequence; a decode call on pool rows in place
# or gathered) after which the engine traces it (`EngineConfig.trace_after`), where
# `Engine.prepare_traces` has not: tracing costs what 20-40 eager calls do, so kinds called only
# now and then stay eager.
TRACE_AFTER_CALLS = 20
# A prompt pass of up to this many sequences runs as one sequence, each query masked to its own
# sequence's keys (`kv_cache.plan_one_sequence`), which the prompt pass's trace replays:
# eager, a packed pass runs every operator through Python, taking the GIL from the threads beside
# it. Its attention then scores every query against every sequence's keys; beyond four sequences
# that costs more than the trace saves (bench/results/cpu-2core-xeon-amx-2026-12-07/). A bigger
# pass runs eagerly, or as traced passes of up to this many where that was timed faster
# (`ModelRunner.split_prompt_passes`).
TRACED_PROMPT_SEQUENCES = 4

# ---- each AR row's context kept dense (engine/model_runner.py, `RowContexts`)

# Positions reserved per AR row: a 30 s voice prompt (375), a clause of 50 tokens and its frames
# fit with room to spare; a longer context grows the reservation. It holds at most
# ROW_CONTEXT_POOL_MULTIPLE times the KV pool's positions: the dense contexts copy what the pool
# holds, and a reservation past the machine's memory is refused even where pages are mapped
# lazily (and on a GPU it is all allocated): 512 full-size rows x 1,024 positions would be 26 GB.
ROW_CONTEXT_POSITIONS = 1024
ROW_CONTEXT_POOL_MULTIPLE = 4
# Positions of every row's context written at start (`RowContexts.fault_in`), so that the first
# burst of new streams does not wait while their contexts' memory is faulted in: most contexts (a
# voice, a clause and its frames) fit. Full size, 16 rows: 201 MB.
ROW_CONTEXT_FAULT_IN_POSITIONS = 256

# ---- admission: max_active="auto" (engine/admission.py)

# Batch sizes timed, the rows of the scratch runner. The largest keeps the probe within a second
# or two at full size on 2 cores; beyond it costs are extrapolated along the fitted line.
PROBE_ROWS = (1, 4, 8)
# Frames per row of a timed decode call (`EngineConfig.max_decode_frames`' default).
DECODE_FRAMES = 4
# Context each scratch row attends to: a voice prompt and a clause.
PROBE_CONTEXT = 160
REPEATS = 2  # timed calls per batch size (their median), after one untimed warm-up
PROBE_STEPS = (REPEATS + 1) * len(PROBE_ROWS)  # AR steps the first scratch row takes
# The share of real time the admitted streams may cost: where the full-size c=16 capacity run
# holds (bench/results/cpu-2core-issue52-pacing/).
HEADROOM = 0.7

# ---- requests and voices (engine/voice_registry.py, engine/stream.py)

# Tries `stream()` makes to find its voice resident: it loads an evicted one between tries, and
# only a pool churned by other loads in that moment evicts it again.
VOICE_LOAD_TRIES = 3
# Characters `push_long_text` plans between yields to the loop: 10-25 ms of planning.
PUSH_PIECE_CHARS = 500
# Text that comes this close to the end of its first clause's wait is not drafted
# (`Stream._draft`): the clauses the draft so far prepares are those the wait's cut or a mark
# gives, and a pass for it would hold up the cut (a prompt pass, full size on 2 cores: 15 ms).
DRAFT_BEFORE_WAIT_ENDS_S = 0.015
# How much longer a first clause's wait runs while the clause guessed from its text ("Let me
# see." before the whitespace that tells it from "see.com") waits for that whitespace
# (`Stream._guess`): the next token most often brings it, and the guess's audio is on its way,
# where the wait's cut, a word earlier ("Let me"), would part from the guess and start over.
GUESS_GRACE_S = 0.05


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
    # `URGENT_S` ahead of its listener): a burst of them is prefilled in parts, with the
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
    # Calls of one kind after which AR steps through the native attention, prompt passes of one
    # sequence and the CPU decoder's calls replay as TorchScript traces, which skip Python's
    # dispatch of every operator and do not hold the GIL the other stage needs
    # (engine/kernels/traces.py); None: eager.
    trace_after: int | None = TRACE_AFTER_CALLS
    # On a CPU with glibc, keep freed activations in the heap instead of page-faulting them in
    # again on every call (engine/cpu_memory.py). Process-wide: False leaves malloc alone.
    keep_freed_memory: bool = True
    # On a CPU, an AR step attends through a C++ torch operator built for this machine at start
    # (engine/kernels/row_attention.py): about half the time of torch's batched products at
    # 16 rows. The decoder's ELU, GELU and attention run as C++ torch operators built likewise
    # (engine/kernels/decoder_ops.py): ~11% of a full-size decode call. Where nothing
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
        for name in ("max_rows_per_tenant", "trace_after"):
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
