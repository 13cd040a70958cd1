"""A request as the engine sees it: a text stream cut into clauses, and its per-clause AR state.

Ownership: the caller's thread appends clauses and sets `input_ended`/`cancelled` under the
engine lock (the decoder thread sets `error` under it too); the AR thread owns everything under
"AR state"; the decoder thread owns `decoder_slot` and the delivery counters.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from intone.engine.block_manager import PageTable
from intone.engine.options import ClausePlan, ClauseProgress, GenerationOptions


class Phase(enum.Enum):
    WAITING = "waiting"  # not admitted yet
    IDLE = "idle"  # admitted; no clause running (waiting for text)
    PREFILL = "prefill"  # a clause holds pages and waits for its prompt pass
    GENERATING = "generating"
    DRAINING = "draining"  # the clause's last latent went to the decoder; awaiting delivery
    FINISHED = "finished"


@dataclass
class Clause:
    index: int
    text: str
    plan: ClausePlan


@dataclass
class RequestMetrics:
    submitted_at: float
    first_audio_at: float | None = None
    finished_at: float | None = None
    audio_samples: int = 0
    sample_rate: int = 24000
    clauses: int = 0

    @property
    def ttfa(self) -> float | None:
        return None if self.first_audio_at is None else self.first_audio_at - self.submitted_at

    @property
    def latency(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    @property
    def audio_seconds(self) -> float:
        return self.audio_samples / self.sample_rate

    @property
    def rtf(self) -> float | None:
        if self.latency is None or not self.audio_samples:
            return None
        return self.latency / self.audio_seconds

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "ttfa": self.ttfa,
            "latency": self.latency,
            "rtf": self.rtf,
            "audio_seconds": self.audio_seconds,
            "clauses": self.clauses,
        }


@dataclass
class Request:
    id: str
    voice: str
    temperature: float
    eos_threshold: float
    noise_clamp: float | None
    chain_frames: int
    generator: torch.Generator
    metrics: RequestMetrics
    # Caller side, under the engine lock.
    pending: deque[Clause] = field(default_factory=deque)
    input_ended: bool = False
    cancelled: bool = False
    # A failure pinned on this request by a stage that cannot end it itself (the decoder);
    # the AR thread ends the request with it.
    error: Exception | None = None
    # AR state.
    phase: Phase = Phase.WAITING
    clause: Clause | None = None
    table: PageTable | None = None
    prompt: torch.Tensor | None = None  # embeddings awaiting prefill
    previous_latent: torch.Tensor | None = None
    progress: ClauseProgress | None = None
    latents: list[torch.Tensor] = field(default_factory=list)
    tail: torch.Tensor | None = None
    # Decoder state.
    decoder_slot: int | None = None
    frames_delivered: int = 0
    # Set by the engine when the request is made.
    options: GenerationOptions = field(default_factory=GenerationOptions)
    sink: Callable[[object], None] = lambda event: None


def now() -> float:
    return time.perf_counter()
