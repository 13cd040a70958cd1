"""Load generation and per-run metrics, shared by every mode.

A backend turns (text, seed) into an async iterator of chunk sizes (samples), yielded as the chunks
arrive. The drivers here time every chunk on the client's event loop, the same measuring point in
every mode: TTFA is submission to the first audio sample the client holds.

A paced client (`Client(paced=True)`) reads as a phone call plays: it takes the next chunk only
when less than `PACED_BUFFER_S` of the audio it holds is left to play, so audio the server makes
early waits on the server side. With `barge_in`, each request is interrupted at a random point of
its playback (uniform in the given range of seconds); the record keeps how much had been played
and, where the backend can tell (`backend.generated`), how much audio had been generated: the
difference is audio generated but never played.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from common import PROMPTS, SAMPLE_RATE, SEED, first_gap, percentile, underran

PACED_BUFFER_S = 0.2  # a paced client's playout buffer: it reads when less than this is left


class Backend(Protocol):
    # Samples at the end of every stream that are not generated audio (the reference server
    # appends 200 ms of silence); left out of the audio counts.
    trailing_padding: int

    def request(self, text: str, seed: int) -> AsyncIterator[int]: ...


@dataclass
class Client:
    """How a client consumes a stream."""

    paced: bool = False
    barge_in: tuple[float, float] | None = None  # interrupt between these seconds of playback


class Player:
    """A real-time player: plays what it holds, waits (an underrun) when it runs dry."""

    def __init__(self) -> None:
        self.held = 0.0
        self.position = 0.0
        self.at: float | None = None

    def add(self, seconds: float, now: float) -> None:
        self.advance(now)
        if self.at is None:
            self.at = now
        self.held += seconds

    def advance(self, now: float) -> float:
        if self.at is not None:
            self.position = min(self.position + now - self.at, self.held)
            self.at = now
        return self.position


@dataclass
class RequestSpec:
    index: int
    prompt: int
    text: str
    seed: int


@dataclass
class RequestRecord:
    spec: RequestSpec
    submitted: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    finished: float | None = None
    error: str | None = None
    interrupted: bool = False
    played_s: float | None = None  # at the barge-in
    generated_s: float | None = None  # at the barge-in, where the backend tells
    server_ttfa: float | None = None  # the server's own first-audio time, where it tells

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished is not None and bool(self.arrivals)


def make_specs(count: int, seed: int = SEED) -> list[RequestSpec]:
    """`count` requests cycling through the prompts (so each gets count / 4), seeds seed + i."""
    return [
        RequestSpec(i, i % len(PROMPTS), PROMPTS[i % len(PROMPTS)], seed + i) for i in range(count)
    ]


async def run_one(
    backend: Backend, spec: RequestSpec, client: Client | None = None
) -> RequestRecord:
    client = client or Client()
    record = RequestRecord(spec, time.perf_counter())
    player = Player()
    cut = None
    if client.barge_in is not None:
        cut = random.Random(spec.seed).uniform(*client.barge_in)
    try:
        chunks = backend.request(spec.text, spec.seed)
        async for samples in chunks:
            now = time.perf_counter()
            if samples:
                record.arrivals.append((now, samples))
                player.add(samples / SAMPLE_RATE, now)
            while client.paced or cut is not None:
                played = player.advance(time.perf_counter())
                if cut is not None and played >= cut:
                    record.interrupted, record.played_s = True, played
                    generated = getattr(backend, "generated", None)
                    if generated is not None:
                        record.generated_s = generated(spec.seed)
                    break
                left = player.held - played
                if not client.paced or left <= PACED_BUFFER_S:
                    break
                wait = left - PACED_BUFFER_S
                if cut is not None:
                    wait = min(wait, cut - played)
                await asyncio.sleep(max(wait, 0.001))
            if record.interrupted:
                await chunks.aclose()  # the backend cancels the stream
                break
        record.finished = time.perf_counter()
        server_ttfa = getattr(backend, "server_ttfa", None)
        if server_ttfa is not None and not record.interrupted:
            record.server_ttfa = server_ttfa(spec.seed)
    except Exception as e:  # a failed request is counted, not fatal
        record.error = f"{type(e).__name__}: {e}"
    return record


async def closed_loop(
    backend: Backend, specs: list[RequestSpec], concurrency: int, client: Client | None = None
) -> list[RequestRecord]:
    """`concurrency` clients, each sending its next request when the previous one finished."""
    todo = list(reversed(specs))
    records: list[RequestRecord] = []

    async def one_client() -> None:
        while todo:
            records.append(await run_one(backend, todo.pop(), client))

    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return records


async def open_loop(
    backend: Backend,
    specs: list[RequestSpec],
    rate: float,
    seed: int = SEED,
    client: Client | None = None,
) -> list[RequestRecord]:
    """Poisson arrivals at `rate` requests per second, whatever is still in flight."""
    rng = random.Random(seed)
    start = time.perf_counter()
    at = 0.0
    tasks = []
    for spec in specs:
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(run_one(backend, spec, client)))
        at += rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))


def underrun_examples(records: list[RequestRecord], start: float, most: int = 5) -> list[dict]:
    """The first `most` requests (by submission) whose playback ran dry: when each was submitted
    (seconds after the level's first request), how much audio had played, how late the next came."""
    examples = []
    for r in sorted(records, key=lambda r: r.submitted):
        gap = first_gap(r.arrivals)
        if gap is not None:
            played, late = gap
            examples.append(
                {"request": r.spec.index, "submitted_s": r.submitted - start,
                 "played_s": played, "late_s": late}
            )  # fmt: skip
        if len(examples) == most:
            break
    return examples


def summarize(records: list[RequestRecord], trailing_padding: int = 0) -> dict:
    """The per-run metrics of the issue, client-side, from the request records."""
    ok = [r for r in records if r.ok]
    ttfa, latency, rtf, audio, underruns = [], [], [], [], 0
    for r in ok:
        if r.interrupted:
            continue  # cut short on purpose: its latency and RTF say nothing
        samples = sum(n for _, n in r.arrivals) - trailing_padding
        seconds = samples / SAMPLE_RATE
        assert r.finished is not None
        ttfa.append(r.arrivals[0][0] - r.submitted)
        latency.append(r.finished - r.submitted)
        audio.append(seconds)
        rtf.append(latency[-1] / seconds if seconds > 0 else float("inf"))
        underruns += underran(r.arrivals)
    server_ttfa = [r.server_ttfa for r in ok if r.server_ttfa is not None]
    interrupted = [r for r in ok if r.interrupted]
    for r in interrupted:
        ttfa.append(r.arrivals[0][0] - r.submitted)
        underruns += underran(r.arrivals)
    wasted = [
        r.generated_s - r.played_s
        for r in interrupted
        if r.generated_s is not None and r.played_s is not None
    ]
    start = min((r.submitted for r in records), default=0.0)
    end = max((r.finished or r.submitted for r in records), default=0.0)
    wall = max(end - start, 1e-9)

    def ms(values: list[float], q: float) -> float | None:
        p = percentile(values, q)
        return None if p is None else p * 1000

    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "error_examples": sorted({r.error for r in records if r.error})[:3],
        "wall_s": wall,
        "audio_s": sum(audio),
        "audio_s_per_request_mean": sum(audio) / len(audio) if audio else None,
        "audio_throughput": sum(audio) / wall,
        "request_throughput": len(ok) / wall,
        "ttfa_ms_p50": ms(ttfa, 50),
        "ttfa_ms_p95": ms(ttfa, 95),
        "ttfa_ms_p99": ms(ttfa, 99),
        # The server's part of TTFA (first text in to first audio out), where the backend
        # reports it (`ws`, `ws-ray`): ttfa minus this is the transport's share. Only requests
        # that ran to the end carry it (a barge-in cancels a stream before its `done` event).
        "server_ttfa_ms_p50": ms(server_ttfa, 50),
        "server_ttfa_ms_p95": ms(server_ttfa, 95),
        "latency_ms_p50": ms(latency, 50),
        "latency_ms_p95": ms(latency, 95),
        "rtf_p50": percentile(rtf, 50),
        "rtf_p95": percentile(rtf, 95),
        "underruns": underruns,
        "underrun_rate": underruns / len(ok) if ok else None,
        # Which requests ran dry, and where: a first wave's, or any.
        "underrun_examples": underrun_examples(ok, start),
        "interrupted": len(interrupted),
        "wasted_audio_s_mean": sum(wasted) / len(wasted) if wasted else None,
        "wasted_audio_s_p95": percentile(wasted, 95),
        "requests_per_prompt": {
            str(p): sum(1 for r in records if r.spec.prompt == p) for p in range(len(PROMPTS))
        },
    }
