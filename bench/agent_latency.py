"""First LLM token -> first audio, as a voice agent's caller waits for it (issue 47).

A simulated LLM streams each reply at a fixed rate (20, 40 or 100 tokens/s), split the way chat
models split text: a word with its leading space, punctuation on its own. Each turn goes end to end
through one of the APIs an agent uses:

- livekit:         the LiveKit plugin in-process (`intone.TTS(model=...)`, `tts.stream()`);
- livekit-remote:  the LiveKit plugin against `intone serve` (`intone.TTS(base_url=...)`);
- pipecat:         the Pipecat service in-process, TOKEN aggregation, LLM frames in a pipeline;
- client:          `IntoneClient` against `intone serve`.

The server of the remote paths is `intone serve`'s app on a thread of this process, over the same
engine as the in-process paths (so every path shares one engine and one machine, and the remote
paths add the WebSocket hop and its serialisation, not a second engine).

Per turn: the time from the first token to the first audio (as the framework hands it over), the
first clause's length in words (LiveKit: the words of the first transcript; client: the first
`clause_done`), and whether its audio ran dry after it started: a listener playing from the first
audio in real time would have waited more than `DRY_SLACK_S` for the next audio (every such gap is
reported). `concurrency` callers run turns at once, each starting its next turn 0.2-1 s (the
user's answer) after its previous one ends. Generation settings are the plugins' defaults (the
model's EOS; the first-clause policy's unless `--first-clause-min-words` /
`--first-clause-max-wait-ms` are given).

    python bench/agent_latency.py --model /path/to/full --paths livekit,client \\
        --rates 40 --concurrency 1,8 --turns 20 --out bench/results/agent-latency
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from common import machine_info, percentile, round_floats

# A listener waiting longer than this for the next audio heard silence (timer jitter aside).
DRY_SLACK_S = 0.05
SAMPLE_RATE = 24_000

# Replies of the kinds agents say: greetings, one-word acknowledgements, confirmations with
# numbers and dates, questions, long first sentences. Written for this benchmark.
REPLIES = (
    "Hi there! Thanks for calling Riverside Dental, how can I help you today?",
    "Hmm, I don't see a reservation under that name. Could you spell your last name for me?",
    "Okay. Let me pull up your account.",
    "Got it. Your appointment is moved to Tuesday, March 3rd at 10:15 am.",
    "Sure, I can help with that.",
    "Yes.",
    "Your total comes to $142.50, and it will be charged to the card ending in 4821.",
    "I checked with our warehouse team this morning and the replacement part you ordered last week "
    "is now expected to ship on Friday.",
    "Alright, so just to confirm, that's two adults and one child for the 6:30 pm showing?",
    "No problem at all.",
    "Welcome back, Sarah! Would you like to reorder the same items as last time?",
    "Unfortunately the flight from Boston to Denver on November 30, 2026 is fully booked, but I "
    "can put you on the waitlist.",
    "Right, I understand. Is there anything else you'd like me to check?",
    "Great question! Our store at 221B Baker Street is open until 9 pm on weekdays.",
    "Absolutely. I've sent the confirmation to your email, it should arrive within five minutes.",
    "Let me see. The order number I have here is 7 4 3 9 1, does that match yours?",
    "Thanks for waiting. I found three available slots: 9 am, 11:30 am and 2 pm.",
    "Of course. What's the best phone number to reach you at?",
    "Understood, I'll cancel the subscription effective today and you won't be charged again.",
    "Wonderful, you're all set! Have a great rest of your day.",
    "Before we continue, I need to verify your identity, so could you tell me your date of birth?",
    "Oh, I'm sorry to hear that. When did you first notice the problem?",
)


def llm_tokens(text: str) -> list[str]:
    """A reply as a chat model streams it: a word with its leading space, punctuation alone."""
    return re.findall(r"\s*[\w']+|\s*[^\w\s]", text)


@dataclass
class TurnResult:
    path: str
    rate: float
    concurrency: int
    reply: int
    stall_s: float = 0.0  # the LLM's stall mid-reply
    first_token_at: float = 0.0
    first_audio_at: float | None = None
    arrivals: list[tuple[float, float]] = field(default_factory=list)  # (time, seconds of audio)
    first_clause: str | None = None
    error: str | None = None

    @property
    def latency_ms(self) -> float | None:
        if self.first_audio_at is None:
            return None
        return (self.first_audio_at - self.first_token_at) * 1000

    def dry_gaps(self) -> list[tuple[float, float, float]]:
        """Silences a real-time listener would hear after the first audio: (how long, how much
        audio had played before it, when it ended), in seconds."""
        gaps: list[tuple[float, float, float]] = []
        if not self.arrivals:
            return gaps
        start, played = self.arrivals[0][0], 0.0
        for at, seconds in self.arrivals:
            late = at - (start + played)
            if late > DRY_SLACK_S:
                gaps.append((late, played, at))
                start += late  # the listener waited, then played on
            played += seconds
        return gaps


# `--stall-s`: the LLM stops for that long after this share of a reply's tokens.
STALL_AT = 0.4


async def speak_llm(
    text: str, rate: float, push: Callable[[str], Awaitable[None] | None], result: TurnResult
) -> None:
    """Push the reply's tokens `1 / rate` apart, on a schedule (a slow push does not delay the
    next token's time), with a stall mid-reply if one is asked for."""
    tokens = llm_tokens(text)
    loop = asyncio.get_running_loop()
    start = loop.time()
    result.first_token_at = time.monotonic()
    stall_from = max(1, int(len(tokens) * STALL_AT))
    for i, token in enumerate(tokens):
        at = i / rate + (result.stall_s if i >= stall_from else 0.0)
        delay = start + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        pushed = push(token)
        if pushed is not None:
            await pushed


# ---- the paths


class LiveKitPath:
    def __init__(self, model: str | None, base_url: str | None, policy: dict):
        from livekit.plugins import intone

        where = {"base_url": base_url} if base_url else {"model": model}
        self.tts = intone.TTS(**where, **policy)

    async def turn(self, text: str, rate: float, result: TurnResult) -> None:
        from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT

        stream = self.tts.stream()

        async def feed() -> None:
            await speak_llm(text, rate, stream.push_text, result)
            stream.end_input()

        feeding = asyncio.create_task(feed())
        try:
            async for event in stream:
                now = time.monotonic()
                if result.first_audio_at is None:
                    result.first_audio_at = now
                result.arrivals.append((now, event.frame.duration))
                words = event.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT) or []
                if result.first_clause is None and words:
                    result.first_clause = "".join(str(w) for w in words).strip()
            await feeding
        finally:
            feeding.cancel()
            await stream.aclose()

    async def close(self) -> None:
        await self.tts.aclose()


class ClientPath:
    """Turns over as few connections as the server allows: a connection holds at most its
    hello's `limits.max_streams` streams, so callers beyond that open another (as agents in
    several processes would)."""

    def __init__(self, base_url: str, policy: dict):
        self.base_url = base_url
        self.policy = policy
        self.open_streams: dict = {}  # IntoneClient -> its streams now open

    async def _client(self):
        from intone.provider.client import IntoneClient

        for client, count in self.open_streams.items():
            if count < client.hello.limits.max_streams:
                return client
        client = IntoneClient(self.base_url)
        await client.connect()
        self.open_streams[client] = 0
        return client

    async def turn(self, text: str, rate: float, result: TurnResult) -> None:
        client = await self._client()
        self.open_streams[client] += 1
        try:
            await self._turn(client, text, rate, result)
        finally:
            self.open_streams[client] -= 1

    async def _turn(self, client, text: str, rate: float, result: TurnResult) -> None:
        from intone.provider import protocol

        stream = await client.stream(sample_rate=SAMPLE_RATE, options=dict(self.policy))

        async def feed() -> None:
            await speak_llm(text, rate, stream.push_text, result)
            await stream.end_input()

        feeding = asyncio.create_task(feed())
        try:
            async for item in stream.events():
                now = time.monotonic()
                if isinstance(item, bytes):
                    if result.first_audio_at is None:
                        result.first_audio_at = now
                    result.arrivals.append((now, len(item) / 2 / SAMPLE_RATE))
                elif isinstance(item, protocol.ClauseDoneEvent) and result.first_clause is None:
                    result.first_clause = item.text
            await feeding
        finally:
            feeding.cancel()

    async def close(self) -> None:
        for client in self.open_streams:
            await client.close()


class PipecatPath:
    def __init__(self, model: str, policy: dict):
        from loguru import logger

        self.model = model
        self.policy = policy
        logger.remove()  # Pipecat logs every pipeline's start and end at DEBUG
        logger.add(sys.stderr, level="WARNING")

    async def turn(self, text: str, rate: float, result: TurnResult) -> None:
        from pipecat.frames.frames import (
            LLMFullResponseEndFrame,
            LLMFullResponseStartFrame,
            LLMTextFrame,
            TTSAudioRawFrame,
        )
        from pipecat.pipeline.pipeline import Pipeline
        from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
        from pipecat.services.tts_service import TextAggregationMode
        from pipecat.tests.utils import SleepFrame, run_test

        from intone.provider.pipecat import IntoneTTSService

        class Tap(FrameProcessor):
            async def process_frame(self, frame, direction: FrameDirection) -> None:
                await super().process_frame(frame, direction)
                now = time.monotonic()
                if isinstance(frame, LLMTextFrame) and not result.first_token_at:
                    result.first_token_at = now
                if isinstance(frame, TTSAudioRawFrame):
                    if result.first_audio_at is None:
                        result.first_audio_at = now
                    result.arrivals.append((now, len(frame.audio) / 2 / frame.sample_rate))
                await self.push_frame(frame, direction)

        tts = IntoneTTSService(
            model=self.model,
            settings=IntoneTTSService.Settings(**self.policy),
            text_aggregation_mode=TextAggregationMode.TOKEN,
        )
        frames: list = [LLMFullResponseStartFrame()]
        tokens = llm_tokens(text)
        for i, token in enumerate(tokens):
            if result.stall_s and i == max(1, int(len(tokens) * STALL_AT)):
                frames.append(SleepFrame(sleep=result.stall_s))
            frames += [LLMTextFrame(token), SleepFrame(sleep=1 / rate)]
        frames.append(LLMFullResponseEndFrame())
        result.first_token_at = 0.0
        await run_test(Pipeline([Tap(), tts, Tap()]), frames_to_send=frames, start_timeout=30.0)

    async def close(self) -> None:
        pass


# ---- running


def serve(engine) -> tuple[str, Callable[[], None]]:
    """`intone serve`'s app on a free loopback port, on a thread of this process."""
    import uvicorn

    from intone.provider.server import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

    return f"ws://127.0.0.1:{port}", stop


async def run_level(
    path, name: str, rate: float, concurrency: int, turns: int, stall_s: float, seed: int
):
    rng = random.Random(seed)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(max(turns, concurrency)):
        queue.put_nowait(i % len(REPLIES))
    results: list[TurnResult] = []

    async def caller(k: int) -> None:
        await asyncio.sleep(rng.uniform(0, 1.0) if concurrency > 1 else 0)
        while not queue.empty():
            reply = queue.get_nowait()
            result = TurnResult(name, rate, concurrency, reply, stall_s)
            try:
                async with asyncio.timeout(120):
                    await path.turn(REPLIES[reply], rate, result)
            except Exception as e:
                result.error = f"{type(e).__name__}: {e}"
            results.append(result)
            await asyncio.sleep(rng.uniform(0.2, 1.0))

    await asyncio.gather(*(caller(k) for k in range(concurrency)))
    return results


class LoopLoad:
    """How late this event loop runs its callbacks, and how much CPU its thread takes: a task
    that asks to wake every `PERIOD_S` records by how much it overslept. A gap in a turn's audio
    while the loop was that late is (at least partly) the loop's, not the engine's: the
    in-process paths deliver audio on it. The thread's CPU is what the framework and the callers
    take from the cores the engine shares."""

    PERIOD_S = 0.005

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (when it woke, how late)
        self.cpu_cores: float | None = None  # the loop thread's CPU seconds per second
        self._task: asyncio.Task | None = None
        self._started = (0.0, 0.0)

    async def _run(self) -> None:
        while True:
            asked = time.monotonic() + self.PERIOD_S
            await asyncio.sleep(self.PERIOD_S)
            woke = time.monotonic()
            self.samples.append((woke, woke - asked))

    def __enter__(self) -> LoopLoad:
        self._task = asyncio.get_running_loop().create_task(self._run())
        self._started = (time.thread_time(), time.monotonic())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        cpu, wall = self._started
        self.cpu_cores = (time.thread_time() - cpu) / (time.monotonic() - wall)

    def worst_between(self, start: float, end: float) -> float:
        """The longest lag that overlaps [start, end]."""
        return max(
            (lag for woke, lag in self.samples if woke >= start and woke - lag <= end), default=0.0
        )


def summarise(results: list[TurnResult], loop: LoopLoad) -> dict:
    ok = [r for r in results if r.error is None and r.latency_ms is not None]
    latencies = [r.latency_ms for r in ok]
    words = [len(r.first_clause.split()) for r in ok if r.first_clause]
    dry = []
    for r in ok:
        if gaps := r.dry_gaps():
            dry.append(
                {
                    "reply": r.reply,
                    "gaps_ms": [round(g * 1000) for g, _, _ in gaps],
                    "after_audio_s": [round(played, 2) for _, played, _ in gaps],
                    # The event loop's worst lag during each gap (LoopLoad).
                    "loop_lag_ms": [
                        round(loop.worst_between(at - g, at) * 1000) for g, _, at in gaps
                    ],
                }
            )
    lags = [lag for _, lag in loop.samples]
    return {
        "turns": len(results),
        "errors": [r.error for r in results if r.error],
        "p50_ms": percentile(latencies, 50),
        "p95_ms": percentile(latencies, 95),
        "max_ms": max(latencies) if latencies else None,
        "first_clause_words_p50": percentile(words, 50),
        "first_clause_words_max": max(words) if words else None,
        "dry_turns": dry,
        "loop_lag_ms_p99": percentile([1000 * x for x in lags], 99),
        "loop_lag_ms_max": 1000 * max(lags) if lags else None,
        "loop_thread_cpu_cores": loop.cpu_cores,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory or model name")
    parser.add_argument("--paths", default="livekit,livekit-remote,pipecat,client")
    parser.add_argument("--rates", default="20,40,100", help="LLM tokens/s")
    parser.add_argument("--concurrency", default="1,8,16")
    parser.add_argument("--turns", type=int, default=20, help="turns per level (at least c)")
    parser.add_argument("--stall-s", type=float, default=0.0, help="an LLM stall mid-reply")
    parser.add_argument("--first-clause-min-words", type=int, default=None)
    parser.add_argument("--first-clause-max-wait-ms", type=float, default=None)
    parser.add_argument("--label", default="", help="a name for this run in the results")
    parser.add_argument("--out", type=Path, default=Path("bench/results/agent-latency"))
    return parser.parse_args(argv)


async def amain(args: argparse.Namespace) -> dict:
    from intone.provider import registry

    policy = {}
    if args.first_clause_min_words is not None:
        policy["first_clause_min_words"] = args.first_clause_min_words
    if args.first_clause_max_wait_ms is not None:
        policy["first_clause_max_wait_ms"] = args.first_clause_max_wait_ms
    # The process's shared engine, loaded and warmed once: every path speaks through it.
    engine = await asyncio.to_thread(registry.prewarm, args.model)
    print(f"engine rows (max_active): {engine.config.max_active}", flush=True)
    url, stop_server = serve(engine)
    runs = []
    try:
        for name in args.paths.split(","):
            if name == "livekit":
                path = LiveKitPath(args.model, None, policy)
            elif name == "livekit-remote":
                path = LiveKitPath(None, url, policy)
            elif name == "pipecat":
                path = PipecatPath(args.model, policy)
            elif name == "client":
                path = ClientPath(url, policy)
            else:
                raise SystemExit(f"unknown path {name!r}")
            try:
                warm = TurnResult(name, 40.0, 1, 0)
                await path.turn(REPLIES[0], 100.0, warm)  # connections, traces, first calls
                for rate in [float(r) for r in args.rates.split(",")]:
                    for c in [int(c) for c in args.concurrency.split(",")]:
                        with LoopLoad() as loop:
                            results = await run_level(
                                path, name, rate, c, args.turns, args.stall_s, seed=c
                            )
                        summary = summarise(results, loop)
                        print(
                            f"{name} {rate:g} tok/s c={c}: p50 {summary['p50_ms']:.0f} ms "
                            f"p95 {summary['p95_ms']:.0f} ms, dry {len(summary['dry_turns'])}, "
                            f"errors {len(summary['errors'])}, event loop lag p99 "
                            f"{summary['loop_lag_ms_p99']:.0f} ms, "
                            f"max {summary['loop_lag_ms_max']:.0f} ms, its thread "
                            f"{summary['loop_thread_cpu_cores']:.2f} cores",
                            flush=True,
                        )
                        runs.append(
                            {
                                "path": name,
                                "rate": rate,
                                "concurrency": c,
                                **summary,
                                "turn_results": [
                                    {
                                        "reply": r.reply,
                                        "latency_ms": r.latency_ms,
                                        "first_clause": r.first_clause,
                                        "audio_s": sum(s for _, s in r.arrivals),
                                        "error": r.error,
                                    }
                                    for r in results
                                ],
                            }
                        )
            finally:
                await path.close()
    finally:
        stop_server()
        registry.shutdown()
    return {
        "label": args.label,
        "policy": policy,
        "stall_s": args.stall_s,
        # The rows the engine admits (`max_active="auto"` measures them at start): past them a
        # turn waits for a row.
        "max_active": engine.config.max_active,
        "runs": runs,
    }


def write_markdown(results: dict, path: Path) -> None:
    lines = [
        f"# First LLM token -> first audio {results['label']}".rstrip(),
        "",
        f"Model {results['model']}, policy {results['policy'] or 'defaults'}, "
        f"LLM stall {results['stall_s']:g} s mid-reply; engine rows (max_active) "
        f"{results['max_active']}; "
        f"machine: {results['machine']['cpu']}, {results['machine']['cores']} cores, "
        f"load average at start {results['machine']['loadavg_start']}.",
        "",
        "| path | LLM tok/s | c | turns | p50 ms | p95 ms | first clause words p50 (max) "
        "| turns that ran dry |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in results["runs"]:
        dry = run["dry_turns"]
        gaps = [g for d in dry for g in d["gaps_ms"]]
        shown_dry = (
            f"{len(dry)} (replies {sorted({d['reply'] for d in dry})}, longest gap {max(gaps)} ms)"
            if dry
            else "none"
        )
        words = run["first_clause_words_p50"]
        shown = "-" if words is None else f"{words:g} ({run['first_clause_words_max']})"
        p50, p95 = run["p50_ms"], run["p95_ms"]
        head = f"| {run['path']} | {run['rate']:g} | {run['concurrency']} | {run['turns']} "
        if p50 is None:
            lines.append(head + f"| - | - | - | errors: {run['errors'][:1]} |")
        else:
            lines.append(head + f"| {p50:.0f} | {p95:.0f} | {shown} | {shown_dry} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    results = asyncio.run(amain(args))
    results["model"] = args.model
    results["machine"] = machine
    results = round_floats(results)
    stem = f"results{'-' + args.label if args.label else ''}"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results, args.out / f"{stem}.md")


if __name__ == "__main__":
    main()
