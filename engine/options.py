"""Generation options and the plan of a clause: one home for both, torch-free.

It imports nothing beyond the standard library (the protocol module and the client use it).
`GenerationOptions` validates itself when it is built (and when `dataclasses.replace` builds a
copy), so a bad value is refused at the API with `InvalidOptionError` and never reaches a batched
step. The server, the client and both plugins derive their option lists from its fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

from intone.engine.errors import InvalidOptionError

# EOS is ignored on the first frames, as in the reference: some voices' EOS logit crosses the
# threshold before speech starts.
MIN_FRAMES_BEFORE_EOS = 6

# Per field: (lowest, highest) accepted value, both inclusive unless named in _OPEN_LOW.
# The highs are far past any useful setting; they exist so that a typo or a hostile client
# cannot ask for a clause of a million frames or a tail longer than the KV pool.
_BOUNDS: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 10.0),
    "eos_threshold": (-1e9, 1e9),  # 1e9 turns EOS off (benchmarks, oracle tests)
    "frames_after_eos": (0, 250),  # 20 s at 12.5 frames/s
    "max_frames": (1, 2_000),  # 160 s per clause; a clause is at most ~50 tokens (~20 s)
    "flow_steps": (1, 64),
    "noise_clamp": (0.0, 100.0),
    "seed": (0, 2**63 - 1),
    "chain_frames": (0, 32),  # 2.6 s of the previous clause
    "speed": (0.5, 2.0),  # time-scale of the delivered audio; pitch is kept
    "first_clause_min_words": (1, 50),  # a clause is at most ~50 tokens
    "first_clause_max_wait_ms": (0.0, 10_000.0),
}
_OPEN_LOW = {"noise_clamp"}
_INTEGERS = {
    "frames_after_eos",
    "max_frames",
    "flow_steps",
    "seed",
    "chain_frames",
    "first_clause_min_words",
}
_BOOLEANS = {"normalize"}
_REQUIRED = {
    "flow_steps",
    "chain_frames",
    "speed",
    "normalize",
    "first_clause_min_words",
    "first_clause_max_wait_ms",
}

# The first-clause policy's defaults (docs/providers.md, "First audio"). Measured from the LLM's
# first token to the first audio (bench/agent_latency.py): a first clause may be one word
# ("Sure," "Hmm,") because it chains into the next one through the latent tail, and a first
# sentence with no early boundary is cut at a word boundary 100 ms after its first text. A
# longer first clause gives its prosody more text to go on, and the caller waits longer.
FIRST_CLAUSE_MIN_WORDS = 1
FIRST_CLAUSE_MAX_WAIT_MS = 100.0


@dataclass
class GenerationOptions:
    temperature: float | None = None  # None: the config's default_temperature
    eos_threshold: float | None = None  # None: the config's default_eos_threshold
    frames_after_eos: int | None = None  # None: the config's or the text-length guess
    max_frames: int | None = None  # per clause; None: the reference's estimate from the text
    flow_steps: int = 1
    noise_clamp: float | None = None
    seed: int | None = None  # None: a fresh random seed
    chain_frames: int = 4  # 0 turns clause chaining off
    # Read "$12.50" as "twelve dollars and fifty cents": `normalize_text` on every clause.
    normalize: bool = True
    speed: float = 1.0  # 0.5-2.0; the audio is time-scaled after decoding, pitch unchanged
    # The first clause of a turn (and the first after a flush) may end at the first clause
    # boundary after this many words (1-50)...
    first_clause_min_words: int = FIRST_CLAUSE_MIN_WORDS
    # ...or, with no boundary by then, at the last word boundary once this long (0-10,000 ms)
    # has passed since the turn's first text. Never inside a word, number, date, price or URL.
    first_clause_max_wait_ms: float = FIRST_CLAUSE_MAX_WAIT_MS

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise InvalidOptionError naming the first bad field."""
        for f in fields(self):
            check_option(f.name, getattr(self, f.name))


def option_names() -> list[str]:
    """The names of every generation option, for APIs that expose them."""
    return [f.name for f in fields(GenerationOptions)]


def check_settings(settings: Mapping[str, object]) -> None:
    """Refuse a bad value among generation options given by name, where None stands for the
    default (the plugins' settings), as `GenerationOptions` would: checked where they are set,
    not at every turn that would use them."""
    for name, value in settings.items():
        if value is not None:
            check_option(name, value)


def check_option(name: str, value: object) -> None:
    """Refuse a value of the wrong type, NaN, infinity or out of its field's range."""
    if value is None and name not in _REQUIRED:
        return
    if name in _BOOLEANS:
        if not isinstance(value, bool):
            raise InvalidOptionError(f"{name} must be true or false, got {type(value).__name__}")
        return
    low, high = _BOUNDS[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidOptionError(f"{name} must be a number, got {type(value).__name__}")
    if name in _INTEGERS and not isinstance(value, int):
        raise InvalidOptionError(f"{name} must be an integer, got {value!r}")
    # An int is finite, and may be too large for a float: compared as it is.
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidOptionError(f"{name} must be finite, got {value!r}")
    too_low = value <= low if name in _OPEN_LOW else value < low
    if too_low or value > high:
        bracket = "(" if name in _OPEN_LOW else "["
        shown = f"{bracket}{_shown(low)}, {_shown(high)}], got {_shown(value)}"
        raise InvalidOptionError(f"{name} must be in {shown}")


def _shown(value: float) -> str:
    """An integer as written (a huge one by its size), a float in short form."""
    if isinstance(value, float):
        return f"{value:g}"
    if abs(value) >= 10**20:
        return f"an integer of {value.bit_length()} bits"
    return str(value)


@dataclass
class ClausePlan:
    """Everything about a clause that is fixed before its first frame."""

    tokens: list[int]
    max_frames: int
    frames_after_eos: int


@dataclass
class ClauseProgress:
    """Where a clause's generation stands: frame count, EOS, and when to stop."""

    plan: ClausePlan
    step: int = 0
    eos_step: int | None = None
    ended: bool = False

    def advance(self, is_eos: bool) -> bool:
        """Account for one sampled latent; False when the clause ends here and it is dropped."""
        step = self.step
        self.step += 1
        if is_eos and self.eos_step is None and step >= MIN_FRAMES_BEFORE_EOS:
            self.eos_step = step
        if self.eos_step is not None and step >= self.eos_step + self.plan.frames_after_eos:
            self.ended = True
            return False
        if self.step >= self.plan.max_frames:
            self.ended = True
        return True
