"""Load generation and per-run metrics, shared by every mode.

A backend turns (text, seed) into an async iterator of chunk sizes (samples), yielded as the chunks
arrive. The drivers here time every chunk on the client's event loop, the same measuring point in
every mode: TTFA is submission to the first audio sample the client holds.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from common import PROMPTS, SAMPLE_RATE, SEED, percentile, underran


class Backend(Protocol):
    # Samples at the end of every stream that are not generated audio (the reference server
    # appends 200 ms of silence); left out of the audio counts.
    trailing_padding: int

    def request(self, text: str, seed: int) -> AsyncIterator[int]: ...


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

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished is not None and bool(self.arrivals)


def make_specs(count: int, seed: int = SEED) -> list[RequestSpec]:
    """`count` requests cycling through the prompts (so each gets count / 4), seeds seed + i."""
    return [
        RequestSpec(i, i % len(PROMPTS), PROMPTS[i % len(PROMPTS)], seed + i) for i in range(count)
    ]


async def run_one(backend: Backend, spec: RequestSpec) -> RequestRecord:
    record = RequestRecord(spec, time.perf_counter())
    try:
        async for samples in backend.request(spec.text, spec.seed):
            if samples:
                record.arrivals.append((time.perf_counter(), samples))
        record.finished = time.perf_counter()
    except Exception as e:  # a failed request is counted, not fatal
        record.error = f"{type(e).__name__}: {e}"
    return record


async def closed_loop(
    backend: Backend, specs: list[RequestSpec], concurrency: int
) -> list[RequestRecord]:
    """`concurrency` clients, each sending its next request when the previous one finished."""
    todo = list(reversed(specs))
    records: list[RequestRecord] = []

    async def client() -> None:
        while todo:
            records.append(await run_one(backend, todo.pop()))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return records


async def open_loop(
    backend: Backend, specs: list[RequestSpec], rate: float, seed: int = SEED
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
        tasks.append(asyncio.create_task(run_one(backend, spec)))
        at += rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))


def summarize(records: list[RequestRecord], trailing_padding: int = 0) -> dict:
    """The per-run metrics of the issue, client-side, from the request records."""
    ok = [r for r in records if r.ok]
    ttfa, latency, rtf, audio, underruns = [], [], [], [], 0
    for r in ok:
        samples = sum(n for _, n in r.arrivals) - trailing_padding
        seconds = samples / SAMPLE_RATE
        assert r.finished is not None
        ttfa.append(r.arrivals[0][0] - r.submitted)
        latency.append(r.finished - r.submitted)
        audio.append(seconds)
        rtf.append(latency[-1] / seconds if seconds > 0 else float("inf"))
        underruns += underran(r.arrivals)
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
        "latency_ms_p50": ms(latency, 50),
        "latency_ms_p95": ms(latency, 95),
        "rtf_p50": percentile(rtf, 50),
        "rtf_p95": percentile(rtf, 95),
        "underruns": underruns,
        "underrun_rate": underruns / len(ok) if ok else None,
        "requests_per_prompt": {
            str(p): sum(1 for r in records if r.spec.prompt == p) for p in range(len(PROMPTS))
        },
    }
