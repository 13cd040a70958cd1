"""A request as the engine sees it: a text stream cut into clauses, and its per-clause AR state.

Ownership: the caller's thread appends clauses and sets `input_ended`/`cancelled` under the
engine lock (the decoder thread sets `error` under it too); the AR thread owns everything under
"AR state"; the decoder thread owns `decoder_slot` and the delivery counters (the AR thread
writes them itself for a stream's first frames, before the decoder thread has seen the stream:
`DecoderWorker.decode_first_frames`).
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
from intone.engine.playback import Playback


class Phase(enum.Enum):
    WAITING = "waiting"  # holds no row: no text yet, or text waiting for admission
    IDLE = "idle"  # holds a row; no clause running (the next one has not started)
    PREFILL = "prefill"  # a clause holds pages and waits for its prompt pass
    GENERATING = "generating"
    FINISHED = "finished"


@dataclass
class Clause:
    index: int
    text: str
    plan: ClausePlan


@dataclass
class Ending:
    """A clause a first clause's draft may end as (`Draft.wholes`), prepared while the LLM's
    next tokens decide whether it ends there: the clause's whole prompt pass, so that a clause
    that is this one starts with its first latent."""

    tokens: list[int]  # the clause's prompt tokens
    # How many of them its table shares with the draft's (pages shared, a partial one copied):
    # a draft pass that writes again from before there would write its pages.
    shared: int
    table: PageTable | None = None  # the draft's positions (pages shared), then its own
    first_step: tuple[torch.Tensor, bool] | None = None  # its first latent and EOS flag


@dataclass
class Draft:
    """A stream's first clause while its text still comes: the prompt tokens of its text so
    far, prefilled while the caller waits for the clause to end, so that its prompt pass has
    only the rest to do; and, where the engine has nothing else to run, the clauses it may end
    as, prepared whole, in case it ends at one."""

    tokens: list[int]  # wanted (the caller's side, under the engine lock)
    # The clauses it may end as, as the text preparation ends a clause (with a mark: a wait's
    # cut there, a comma or a period after it are this clause), most likely first: its text
    # so far, which the next token most often ends; and, while its wait runs, the wait's cut,
    # a word shorter, where the wait runs out first (`Stream._draft`).
    wholes: list[list[int]]
    table: PageTable | None = None  # the voice's pages, then the tokens written (AR thread)
    written: list[int] = field(default_factory=list)  # the tokens whose K/V the table holds
    endings: list[Ending] = field(default_factory=list)  # of `wholes`, prepared (AR thread)


@dataclass
class RequestMetrics:
    submitted_at: float
    first_audio_at: float | None = None
    finished_at: float | None = None
    audio_samples: int = 0
    sample_rate: int = 24000
    clauses: int = 0
    # Audio generated while more than `lead_s` ahead of the listener: compute the stream took
    # because nobody nearer an underrun needed it (pacing "yield"; engine/pacing.py).
    yielded_seconds: float = 0.0
    # Prompt tokens of the first clause that its draft had prefilled before the clause was cut.
    draft_tokens: int = 0
    # The first clause started with its first latent, prepared from its draft (`Ending`).
    first_step_prepared: bool = False

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
            "yielded_seconds": self.yielded_seconds,
        }


@dataclass(eq=False)  # a request is itself: compared and hashed by identity
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
    # Cancelled because a fresh request took its place in its stream (`Engine.admit`): the
    # stream goes on, so this one counts as no request outcome of its own.
    replaced: bool = False
    last_text_at: float = field(default_factory=lambda: now())  # for the idle timeout
    tenant: str | None = None
    # Seconds of audio the stream's consumer has read (only the caller's loop writes it, so the
    # AR thread can compare it with the audio generated without a lock).
    read_seconds: float = 0.0
    playback: Playback = field(default_factory=Playback)
    # A failure pinned on this request by a stage that cannot end it itself (the decoder);
    # the AR thread ends the request with it.
    error: Exception | None = None
    # AR state.
    phase: Phase = Phase.WAITING
    clause: Clause | None = None
    table: PageTable | None = None
    prompt: torch.Tensor | None = None  # embeddings awaiting prefill
    # A clause's first latent and EOS flag, prepared before it started (`Ending`): its prompt
    # pass is done.
    first_step: tuple[torch.Tensor, bool] | None = None
    previous_latent: torch.Tensor | None = None
    latent_at: float | None = None  # when its last latent came, in this clause
    progress: ClauseProgress | None = None
    latents: list[torch.Tensor] = field(default_factory=list)
    tail: torch.Tensor | None = None
    draft: Draft | None = None  # the first clause's text so far, before it is cut
    frames_generated: int = 0  # latents kept, over every clause: the audio generated so far
    in_decoder: bool = False  # has put items on the decoder queue (it must see the end too)
    # Decoder state.
    decoder_slot: int | None = None
    decoder_saved: dict[str, torch.Tensor] | None = None  # its history while it holds no row
    frames_delivered: int = 0
    # Set by the engine when the request is made.
    options: GenerationOptions = field(default_factory=GenerationOptions)
    sink: Callable[[object], None] = lambda event: None

    @property
    def first_audio_decoding(self) -> bool:
        """Its first latents are with the decoder worker and no audio has come back yet."""
        return self.in_decoder and self.frames_delivered == 0 and self.frames_generated > 0


def now() -> float:
    return time.perf_counter()
