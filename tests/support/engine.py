"""The engine suites' shared helpers: the single-request reference, requests run to an outcome,
checks against the reference, and waiting for the engine to come back to idle.

Random weights would stop at frame 6 on EOS, so EOS is off (`NO_EOS`) and clauses end at
`max_frames`, kept small.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass, field, replace

import numpy as np
import pytest
import torch

from intone.engine import AudioChunk, ClauseDone, Engine, EngineConfig, Stream
from intone.engine.generate import generate
from intone.engine.loading import LoadedModel
from intone.engine.options import GenerationOptions
from intone.engine.request import Request
from intone.engine.text import split_clauses
from intone.engine.voices import Voice

NO_EOS = 1e9
TIMEOUT = 20.0  # seconds for anything that should take well under one
IDLE_TIMEOUT = 5.0
MAX_REL_RMS = 1e-4
SECOND_VOICE = "second"
TEXTS = [
    "Hi there.",  # 1 clause
    "Hello world, this is a test.",  # 2 clauses
    "The quick brown fox jumps over the lazy dog. It was a sunny day, and everyone was happy.",
    "One more sentence here. Then another one comes along, with a comma.",  # 3 clauses
]


def options(
    seed: int,
    temperature: float = 0.0,
    chain_frames: int = 4,
    max_frames: int | None = 12,
    **kwargs,
) -> GenerationOptions:
    return GenerationOptions(
        temperature=temperature,
        eos_threshold=NO_EOS,
        max_frames=max_frames,
        seed=seed,
        chain_frames=chain_frames,
        **kwargs,
    )


def rel_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - want) ** 2)) / max(np.sqrt(np.mean(want**2)), 1e-12))


def assert_same_audio(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    assert got.shape == want.shape, f"{what}: {got.shape[0]} samples, single path {want.shape[0]}"
    error = rel_rms(got, want)
    assert error < MAX_REL_RMS, f"{what}: relative RMS error {error:.2e} against the single path"


def assert_audio_prefix(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    """Audio of a cancelled request: what arrived is the start of the single path's audio."""
    assert got.shape[0] <= want.shape[0], what
    if got.shape[0]:
        assert_same_audio(got, want[: got.shape[0]], what)


def engine_clauses(loaded: LoadedModel, text: str) -> list[str]:
    """The clauses a default engine stream makes of `text` pushed at once."""
    config = EngineConfig()
    return split_clauses(
        loaded.tokenizer,
        text,
        min_tokens=config.clause_min_tokens,
        first_clause_min_words=GenerationOptions().first_clause_min_words,
        max_tokens=config.clause_max_tokens,
    )


class Reference:
    """The single-request path, cached: audio of (text, voice, options)."""

    def __init__(self, loaded: LoadedModel, voices: dict[str, Voice]):
        self.loaded = loaded
        self.voices = voices
        self.config = EngineConfig()
        self._cache: dict[tuple, np.ndarray] = {}

    def clauses(self, text: str) -> list[str]:
        return engine_clauses(self.loaded, text)

    def audio(self, text: str, voice: str, opts: GenerationOptions) -> np.ndarray:
        key = (text, voice, astuple(opts))
        if key not in self._cache:
            frames = list(
                generate(self.loaded, self.voices[voice], self.clauses(text), replace(opts))
            )
            self._cache[key] = torch.cat(frames).numpy()
        return self._cache[key]


@dataclass
class Outcome:
    events: list = field(default_factory=list)
    cancelled: bool = False
    after_cancel: list = field(default_factory=list)  # events iterated after cancel() returned

    @property
    def chunks(self) -> list[AudioChunk]:
        return [e for e in self.events if isinstance(e, AudioChunk)]

    @property
    def audio(self) -> np.ndarray:
        chunks = [c.samples for c in self.chunks]
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)

    @property
    def clauses_done(self) -> list[ClauseDone]:
        return [e for e in self.events if isinstance(e, ClauseDone)]


async def drain(stream: Stream) -> list:
    async with asyncio.timeout(TIMEOUT):
        return [event async for event in stream]


async def cancel_and_drain(stream: Stream, outcome: Outcome) -> None:
    stream.cancel()
    outcome.cancelled = True
    outcome.after_cancel = await drain(stream)


async def run_request(
    engine: Engine,
    text: str,
    voice: str | None,
    opts: GenerationOptions | None,
    *,
    delay: float = 0.0,
    cancel_after: int | None = None,
) -> Outcome:
    """Submit after `delay`; cancel after `cancel_after` chunks (0: before any audio)."""
    await asyncio.sleep(delay)
    stream = engine.stream(voice, opts)
    stream.push_text(text)
    stream.end_input()
    outcome = Outcome()
    if cancel_after == 0:
        await cancel_and_drain(stream, outcome)
        return outcome
    async with asyncio.timeout(TIMEOUT):
        async for event in stream:
            outcome.events.append(event)
            if cancel_after is not None and len(outcome.chunks) >= cancel_after:
                break
    if cancel_after is not None and len(outcome.chunks) >= cancel_after:
        await cancel_and_drain(stream, outcome)
    return outcome


def idle_problems(engine: Engine, voice_pages: int) -> dict:
    m = engine.metrics()
    wanted = {
        "kv_pages_in_use": voice_pages,
        "active_requests": 0,
        "queued_requests": 0,
        "decoder_states_in_use": 0,
    }
    problems = {k: m[k] for k, v in wanted.items() if m[k] != v}
    if engine.blocks.reserved:
        problems["reserved_pages"] = engine.blocks.reserved
    return problems


async def wait_idle(engine: Engine, voice_pages: int) -> None:
    deadline = time.monotonic() + IDLE_TIMEOUT
    while problems := idle_problems(engine, voice_pages):
        if time.monotonic() > deadline:
            pytest.fail(f"engine not idle after {IDLE_TIMEOUT}s: {problems}")
        await asyncio.sleep(0.01)


def wait_idle_sync(engine: Engine, voice_pages: int) -> None:
    deadline = time.monotonic() + IDLE_TIMEOUT
    while problems := idle_problems(engine, voice_pages):
        if time.monotonic() > deadline:
            pytest.fail(f"engine not idle after {IDLE_TIMEOUT}s: {problems}")
        time.sleep(0.01)


def voice_pages(engine: Engine) -> int:
    """Pages the registered voices hold: the engine's floor when idle."""
    return sum(
        engine.blocks.pages_for(prefix.table.length) for prefix in engine.scheduler.voices.values()
    )


def on_prompt_passes(
    engine: Engine,
    before: Callable[[list[Request]], None],
    after: Callable[[list[Request], torch.Tensor], None] | None = None,
) -> None:
    """Call `before(requests)` ahead of every prompt pass, alone (`ModelRunner.prefill`) or in
    one pass with an AR step (`prefill_and_generate`), with the requests whose clauses it
    prefills; and `after(requests, latents)` with their first latents, once it has run."""
    runner = engine.runner
    prefill, joint = runner.prefill, runner.prefill_and_generate

    def alone(requests, noise):
        before(requests)
        latents, eos = prefill(requests, noise)
        if after is not None:
            after(requests, latents)
        return latents, eos

    def joined(requests, noise, generate, generate_noise):
        before(requests)
        latents, eos = joint(requests, noise, generate, generate_noise)
        if after is not None:
            after(requests, latents[: len(requests)])
        return latents, eos

    runner.prefill, runner.prefill_and_generate = alone, joined


def slow_decoder(engine: Engine, seconds: float) -> None:
    """Make every decode step take longer, like a busy accelerator: the AR stage runs ahead."""
    decode = engine.runner.decode

    def slow(slots, latents):
        time.sleep(seconds)
        return decode(slots, latents)

    engine.runner.decode = slow


def check_outcome(
    outcome: Outcome, reference: Reference, text: str, voice: str, opts: GenerationOptions, what
) -> None:
    want = reference.audio(text, voice, opts)
    if outcome.cancelled:
        assert outcome.after_cancel == [], f"{what}: events after cancel(): {outcome.after_cancel}"
        assert_audio_prefix(outcome.audio, want, what)
    else:
        assert_same_audio(outcome.audio, want, what)
        done = outcome.clauses_done
        assert [d.clause for d in done] == list(range(len(reference.clauses(text)))), what
        assert [d.text for d in done] == reference.clauses(text), what


def idle(engine: Engine, pages_at_idle: int) -> bool:
    """No stream open (a turn parked waiting for text holds no batch slot, and a cancelled one
    counts until its stream ends), nothing active or queued, only the voices' pages held."""
    m = engine.metrics()
    return (
        m["streams_open"] == 0
        and m["active_requests"] == 0
        and m["queued_requests"] == 0
        and m["kv_pages_in_use"] == pages_at_idle
    )


def batched_steps(engine: Engine) -> int:
    """AR steps that ran more than one request."""
    histogram = engine.metrics()["generate_batch_histogram"]
    return sum(count for size, count in histogram.items() if int(size) > 1)
