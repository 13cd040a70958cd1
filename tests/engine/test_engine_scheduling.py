"""Scheduling: idle streams hold nothing, generation paced by playback, no stall at clause ends.

On the tiny checkpoint, EOS off; every test bounded in time. Timings here only compare a request
with itself on the same engine (TTFA with idle streams open against TTFA alone), never against a
fixed speed.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from intone.engine import (
    AudioChunk,
    ClauseDone,
    EngineFullError,
    IdleTimeoutError,
    InvalidOptionError,
    Stream,
    ar_worker,
    decoder_worker,
)
from intone.engine import scheduler as scheduler_module
from intone.engine.config import DUE_LEAD_SHARE, FIRST_FRAMES_ON_AR
from intone.engine.decoder_worker import DecoderWorker, LatentItem
from intone.engine.metrics import EngineMetrics
from intone.engine.request import Request

from support.engine import (
    TEXTS,
    TIMEOUT,
    Outcome,
    Reference,
    assert_same_audio,
    check_outcome,
    drain,
    on_prompt_passes,
    options,
    run_request,
    slow_decoder,
    voice_pages,
    wait_idle,
)


async def say_and_wait(engine, seed: int):
    """A stream that says one clause, flushes, and waits for more (an agent's LLM)."""
    stream = engine.stream(None, options(seed, max_frames=4))
    stream.push_text(TEXTS[0])
    stream.flush()
    async with asyncio.timeout(TIMEOUT):
        async for event in stream:
            if isinstance(event, ClauseDone):
                break
    return stream


async def ttfa(engine, seed: int) -> float:
    stream = engine.stream(None, options(seed, max_frames=4))
    started = time.perf_counter()
    stream.push_text(TEXTS[0])
    stream.end_input()
    first = await asyncio.wait_for(stream.__anext__(), TIMEOUT)
    elapsed = time.perf_counter() - started
    assert isinstance(first, AudioChunk)
    await drain(stream)
    return elapsed


async def test_idle_streams_hold_nothing_and_delay_nobody(make_engine) -> None:
    engine = make_engine(max_active=16)
    floor = voice_pages(engine)
    alone = statistics.median([await ttfa(engine, 100 + i) for i in range(3)])
    idle = [await say_and_wait(engine, i) for i in range(16)]
    # 16 open streams, all quiet: no row, no decoder row, no queue place, no pages.
    await wait_idle(engine, floor)
    m = engine.metrics()
    assert m["streams_open"] == 16 and m["rows_generating"] == 0, m
    crowded = statistics.median([await ttfa(engine, 200 + i) for i in range(3)])
    # Small absolute slack: these are tens of milliseconds on a shared machine.
    assert crowded <= 2 * alone + 0.05, (
        f"TTFA {crowded:.3f} s with 16 idle streams, {alone:.3f} alone"
    )
    # The idle streams are still usable, and continue seamlessly.
    stream = idle[3]
    stream.push_text(TEXTS[1])
    stream.end_input()
    assert any(isinstance(e, AudioChunk) for e in await drain(stream))
    for other in idle:
        other.cancel()
    await wait_idle(engine, floor)


async def test_a_stream_resumed_after_parking_equals_the_single_path(
    make_engine, reference: Reference
) -> None:
    """Parking (decoder row given up between clauses, history saved) never changes the audio."""
    engine = make_engine()
    floor = voice_pages(engine)
    opts = options(7, 0.3, max_frames=6)
    clauses = reference.clauses(TEXTS[3])
    stream = engine.stream(None, opts)
    outcome = Outcome()
    for index, clause in enumerate(clauses):
        stream.push_text(clause + " ")
        stream.flush()
        async with asyncio.timeout(TIMEOUT):
            async for event in stream:
                outcome.events.append(event)
                if isinstance(event, ClauseDone):
                    break
        await wait_idle(engine, floor)  # parked: no row, no decoder row
        if index < len(clauses) - 1:
            await asyncio.sleep(0.05)
    stream.end_input()
    outcome.events += await drain(stream)
    check_outcome(outcome, reference, TEXTS[3], "default", opts, "parked between clauses")


async def test_bare_starts_do_not_fill_the_queue(make_engine, reference: Reference) -> None:
    engine = make_engine(max_queued=4, max_streams=40)
    floor = voice_pages(engine)
    bare = [engine.stream() for _ in range(39)]
    assert engine.metrics()["queued_requests"] == 0
    opts = options(3, max_frames=5)
    outcome = await asyncio.wait_for(run_request(engine, TEXTS[0], None, opts), TIMEOUT)
    check_outcome(outcome, reference, TEXTS[0], "default", opts, "beside 39 bare streams")
    engine.stream()  # the 40th
    with pytest.raises(EngineFullError, match="streams"):
        engine.stream()
    for stream in bare:
        stream.cancel()
    await wait_idle(engine, floor)


async def test_idle_timeout_fires_and_releases_everything(make_engine) -> None:
    engine = make_engine(idle_timeout_s=0.3)
    floor = voice_pages(engine)
    bare = engine.stream()
    spoke = await say_and_wait(engine, 1)
    busy = engine.stream(None, options(2, max_frames=30))  # stays busy: never times out
    busy.push_text(TEXTS[2])
    started = time.monotonic()
    for stream in (bare, spoke):
        with pytest.raises(IdleTimeoutError):
            await asyncio.wait_for(drain(stream), 5.0)
    assert time.monotonic() - started >= 0.25
    busy.end_input()
    events = await drain(busy)
    assert sum(isinstance(e, AudioChunk) for e in events) > 0
    await wait_idle(engine, floor)
    m = engine.metrics()
    assert m["idle_timeouts"] == 2 and m["streams_open"] == 0, m


async def test_unread_audio_is_bounded_and_resumes(make_engine, reference: Reference) -> None:
    """A consumer that stops reading: the stream stops generating (it is not dropped), the audio
    buffered for it stays bounded in seconds, and it completes once the consumer reads."""
    engine = make_engine(lead_s=None, max_unread_s=0.5)
    floor = voice_pages(engine)
    opts = options(5, 0.3, max_frames=60)  # 3 clauses of up to 4.8 s each
    stream = engine.stream(None, opts)
    stream.push_text(TEXTS[2])
    stream.end_input()
    first = await asyncio.wait_for(stream.__anext__(), TIMEOUT)
    seen = []
    for _ in range(20):  # 1 s of not reading
        await asyncio.sleep(0.05)
        seen.append(stream.unread_seconds)
    frame_s = 1920 / 24000
    # The bound counts audio still in the decoder too, so it overshoots by at most the one
    # frame of the AR step that crossed it.
    assert max(seen) <= 0.5 + frame_s + 1e-9, seen
    assert not stream.request.cancelled and engine.metrics()["streams_open"] == 1
    generated = stream.request.frames_generated
    await asyncio.sleep(0.2)
    assert stream.request.frames_generated == generated, "still generating while unread"
    outcome = Outcome([first, *await drain(stream)])
    check_outcome(outcome, reference, TEXTS[2], "default", opts, "after the pause")
    await wait_idle(engine, floor)


async def test_pacing_never_changes_the_audio(make_engine, reference: Reference) -> None:
    engine = make_engine(lead_s=0.3, pacing="hold")
    floor = voice_pages(engine)
    jobs = [(TEXTS[i % 4], ("default", "second")[i % 2], options(40 + i, 0.3)) for i in range(4)]
    outcomes = await asyncio.gather(*[run_request(engine, *job) for job in jobs])
    for i, ((text, voice, opts), outcome) in enumerate(zip(jobs, outcomes, strict=True)):
        check_outcome(outcome, reference, text, voice, opts, f"paced request {i}")
    m = engine.metrics()
    assert m["pacing_paused_seconds"] > 0, "pacing never held a stream back"
    await wait_idle(engine, floor)


async def settled_frames(stream: Stream) -> int:
    """The stream's generated frames once they stop growing (pacing holds it)."""
    before = -1
    while (frames := stream.request.frames_generated) != before:
        before = frames
        await asyncio.sleep(0.15)
    return frames


async def test_playback_reports_pace_generation(make_engine) -> None:
    engine = make_engine(lead_s=0.4, pacing="hold")
    stream = engine.stream(None, options(6, max_frames=60))
    stream.report_playback(0.0)
    stream.push_text(TEXTS[2])
    frame_s = 1920 / 24000
    ahead = await asyncio.wait_for(settled_frames(stream), TIMEOUT) * frame_s
    assert ahead <= 0.4 + 2 * frame_s, ahead
    stream.report_playback(1.5)
    later = await asyncio.wait_for(settled_frames(stream), TIMEOUT) * frame_s
    assert 1.5 < later <= 1.9 + 2 * frame_s, later
    for bad in (-1.0, float("nan"), float("inf"), "1"):
        with pytest.raises(InvalidOptionError):
            stream.report_playback(bad)
    stream.cancel()


@pytest.mark.parametrize("speed", [2.0, 0.5])
async def test_pacing_counts_in_the_listeners_seconds(make_engine, speed: float) -> None:
    """With `speed`, a model frame lasts 80 ms / speed for the listener: the lead and the
    reported playback are the listener's seconds, so generation holds at `lead_s` of what will
    be heard, whatever the tempo. (A stream steps again once it is under `DUE_LEAD_SHARE` of
    the lead, so it may rest anywhere between that and the lead.)"""
    lead_s = 0.4
    low = DUE_LEAD_SHARE * lead_s
    engine = make_engine(lead_s=lead_s, pacing="hold")
    stream = engine.stream(None, options(6, max_frames=60, speed=speed))
    stream.report_playback(0.0)
    stream.push_text(TEXTS[2])
    heard_frame_s = 1920 / 24000 / speed
    heard_ahead = await asyncio.wait_for(settled_frames(stream), TIMEOUT) * heard_frame_s
    assert low <= heard_ahead <= lead_s + 2 * heard_frame_s, heard_ahead
    stream.report_playback(1.0)
    later = await asyncio.wait_for(settled_frames(stream), TIMEOUT) * heard_frame_s
    assert 1.0 + low <= later <= 1.0 + lead_s + 2 * heard_frame_s, later
    stream.cancel()


async def test_next_clause_starts_before_the_previous_audio_is_delivered(make_engine) -> None:
    engine = make_engine(lead_s=None)
    slow_decoder(engine, 0.03)  # the decoder lags the AR stage by many frames
    prefills: list[float] = []
    on_prompt_passes(engine, lambda requests: prefills.append(time.perf_counter()))
    stream = engine.stream(None, options(8, max_frames=10))
    stream.push_text(TEXTS[1])  # two clauses
    stream.end_input()
    delivered: list[float] = []
    async with asyncio.timeout(TIMEOUT):
        async for event in stream:
            if isinstance(event, ClauseDone):
                delivered.append(time.perf_counter())
    assert len(prefills) == 2 and len(delivered) == 2
    assert prefills[1] < delivered[0], "clause 2 waited for clause 1's audio"


async def test_a_new_streams_first_frames_wait_for_no_decode_call(
    make_engine, reference: Reference
) -> None:
    """A new stream's first frames are decoded where their latents were computed, outside the
    pool: they arrive while a long decode call of the other streams' backlog is still in
    flight, and the stream's audio is unchanged (its history carries on in a decoder slot)."""
    engine = make_engine(lead_s=None, max_decode_frames=4)
    in_flight = threading.Event()
    calls_done = 0
    decode = engine.runner.decode

    def slow(slots, latents):
        nonlocal calls_done
        in_flight.set()
        time.sleep(0.5)
        try:
            return decode(slots, latents)
        finally:
            calls_done += 1
            in_flight.clear()

    engine.runner.decode = slow
    busy = [engine.stream(None, options(10 + i, max_frames=80)) for i in range(4)]
    for stream in busy:
        stream.push_text(TEXTS[2])
        stream.end_input()
    for stream in busy:
        await asyncio.wait_for(stream.__anext__(), TIMEOUT)
    async with asyncio.timeout(TIMEOUT):
        while not in_flight.is_set():
            await asyncio.sleep(0.005)
    opts = options(20, 0.3, max_frames=12)
    new = engine.stream(None, opts)
    done_at_push = calls_done
    new.push_text(TEXTS[0])
    new.end_input()
    first = [await asyncio.wait_for(new.__anext__(), TIMEOUT) for _ in range(2)]
    assert all(isinstance(event, AudioChunk) for event in first), first
    assert calls_done == done_at_push, "the first frames waited for the decode call in flight"
    outcome = Outcome([*first, *await drain(new)])
    check_outcome(outcome, reference, TEXTS[0], "default", opts, "first frame outside the pool")
    for stream in busy:
        stream.cancel()


@pytest.mark.parametrize("calls_outlast_a_frame", [True, False])
async def test_a_new_streams_first_audio_is_decoded_where_its_latents_come(
    make_engine, reference: Reference, monkeypatch: pytest.MonkeyPatch, calls_outlast_a_frame: bool
) -> None:
    """While the decoder is busy, a new stream's first `FIRST_FRAMES_ON_AR` latents are decoded
    on the AR thread, right after the step that computes them: its first audio waits for no
    decode call in flight. Where `HANDOVER_CALLS` of the worker's calls outlast a frame (the
    decoder worker may first end a call in flight, then take one of its own for the stream's
    next frame), they are decoded together, from a fresh history, so that the first audio has
    160 ms to play; otherwise each as it comes, the first from a fresh history, the second from
    the one the first left. The prefilled row joins the prefill iteration's AR step (this
    engine runs its passes apart from the step: `ModelRunner.join_passes` is off). The audio is
    unchanged."""
    monkeypatch.setattr(ar_worker, "HANDOVER_CALLS", 1000 if calls_outlast_a_frame else 0)
    engine = make_engine(lead_s=None)
    slow_decoder(engine, 0.05)  # busy with the other stream's backlog
    events: list[str] = []
    runner = engine.runner
    generate, decode_detached = runner.generate, runner.decode_detached
    busy = engine.stream(None, options(70, max_frames=80))
    opts = options(71, max_frames=6)
    new = engine.stream(None, opts)  # text comes later

    def recorded_generate(requests, noise):
        result = generate(requests, noise)
        events.append("generate" + (" with new" if new.request in requests else ""))
        return result

    def recorded_decode_detached(latents, histories):
        result = decode_detached(latents, histories)
        fresh = all(history is None for history in histories)
        events.append(f"{latents.shape[0]}x{latents.shape[1]} frames" + (" fresh" * fresh))
        return result

    on_prompt_passes(engine, lambda requests: None, lambda *_: events.append("prefill"))
    runner.generate = recorded_generate
    runner.decode_detached = recorded_decode_detached
    busy.push_text(TEXTS[2])
    busy.end_input()
    await asyncio.wait_for(busy.__anext__(), TIMEOUT)
    async with asyncio.timeout(TIMEOUT):  # until the decoder has a backlog to work through
        while busy.request.frames_generated - busy.request.frames_delivered < 4:
            await asyncio.sleep(0.005)
    events.clear()
    new.push_text(TEXTS[0])
    new.end_input()
    outcome = Outcome(await asyncio.wait_for(drain(new), TIMEOUT))
    busy.cancel()
    start = events.index("prefill")
    # The busy stream was generating, so the new stream's prefill shared an iteration with an
    # AR step, which the new stream joined.
    if calls_outlast_a_frame:
        want = ["prefill", "generate with new", f"1x{FIRST_FRAMES_ON_AR} frames fresh"]
    else:
        want = ["prefill", "1x1 frames fresh", "generate with new", "1x1 frames"]
    assert events[start : start + len(want)] == want, events[start:]
    decoded = [event for event in events[start:] if "frames" in event]
    assert len(decoded) == len(want) - 2, events[start:]
    check_outcome(outcome, reference, TEXTS[0], "default", opts, "first audio on the AR thread")


async def test_a_stream_alone_takes_no_ar_step_beside_its_first_frame(
    make_engine, reference: Reference
) -> None:
    """On an idle engine the decoder thread decodes a new stream's first frame at once, and no
    AR step runs beside it (it would share the machine: 12 ms alone, 17-21 ms beside one at
    full size on 2 cores); the stream's next step waits for that audio, then comes at once.
    The audio is unchanged."""
    engine = make_engine(lead_s=None)
    events: list[str] = []
    runner = engine.runner
    generate, decode, decode_detached = runner.generate, runner.decode, runner.decode_detached

    def recorded(name, call):
        def run(*args):
            events.append(f"{name} starts")
            result = call(*args)
            events.append(f"{name} ends")
            return result

        return run

    runner.generate = recorded("generate", generate)
    runner.decode = recorded("decode", decode)
    runner.decode_detached = recorded("decode", decode_detached)
    opts = options(72, max_frames=6)
    stream = engine.stream(None, opts)
    stream.push_text(TEXTS[0])
    stream.end_input()
    outcome = Outcome(await asyncio.wait_for(drain(stream), TIMEOUT))
    first = events.index("decode starts")
    assert "generate starts" not in events[:first], events
    assert events[first : first + 3] == ["decode starts", "decode ends", "generate starts"], events
    check_outcome(outcome, reference, TEXTS[0], "default", opts, "alone")


async def test_a_new_stream_that_ends_before_its_first_audio_is_whole_is_decoded(
    make_engine, reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the first audio waits for `FIRST_FRAMES_ON_AR` latents, a clause that ends before
    hands the ones it has to the busy decoder, before its end: none is lost or kept waiting. A
    stream cancelled while its first latents wait ends, and its pages go back."""
    assert FIRST_FRAMES_ON_AR > 1
    monkeypatch.setattr(ar_worker, "HANDOVER_CALLS", 1000)  # the first audio waits
    engine = make_engine(lead_s=None)
    slow_decoder(engine, 0.05)
    floor = voice_pages(engine)
    # Its backlog keeps the decoder busy throughout (80 frames: at least 20 calls of 50 ms).
    busy = engine.stream(None, options(72, max_frames=80))
    busy.push_text(TEXTS[2])
    busy.end_input()
    await asyncio.wait_for(busy.__anext__(), TIMEOUT)
    opts = options(73, max_frames=1)
    short = engine.stream(None, opts)
    short.push_text(TEXTS[0])
    short.end_input()
    outcome = Outcome(await asyncio.wait_for(drain(short), TIMEOUT))
    assert len(outcome.audio) == engine.model.samples_per_frame, len(outcome.audio)
    check_outcome(outcome, reference, TEXTS[0], "default", opts, "a one-frame clause")
    cancelled = engine.stream(None, options(74, max_frames=80))
    # Its first AR step after the prefill waits until it is cancelled: its first latent waits.
    generate, gate = engine.runner.generate, threading.Event()

    def gated(requests, noise):
        if cancelled.request in requests:
            gate.wait(TIMEOUT)
        return generate(requests, noise)

    engine.runner.generate = gated
    cancelled.push_text(TEXTS[0])
    cancelled.end_input()
    async with asyncio.timeout(TIMEOUT):
        while cancelled.request.frames_generated == 0:
            await asyncio.sleep(0.001)
    assert cancelled.request.frames_delivered == 0 and not cancelled.request.in_decoder
    cancelled.cancel()
    gate.set()
    await asyncio.wait_for(drain(cancelled), TIMEOUT)
    busy.cancel()
    await asyncio.wait_for(drain(busy), TIMEOUT)
    await wait_idle(engine, floor)


@pytest.fixture
def fixed_call_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder worker's estimate of seconds per row-frame stays where a test sets it (see
    `recording_worker`): a cold first call on a loaded CI machine (tens of milliseconds for one
    row-frame) must not change how many frames the next call takes."""
    monkeypatch.setattr(decoder_worker, "COST_WEIGHT", 0.0)


def recording_worker(
    engine, paced: bool = False, max_row_frames: int = 64, yield_after_s: float | None = None
) -> tuple[DecoderWorker, list[tuple[list[int], int]]]:
    """A decoder worker of its own on the engine's runner (nothing else feeds it), and the
    (slots, frames per row) of every decode call it makes. Its calls are estimated at 1 ms per
    row-frame: with `fixed_call_cost`, only the streams' buffers size its calls."""
    calls: list[tuple[list[int], int]] = []
    decode = engine.runner.decode

    def recorded(slots, latents):
        calls.append((list(slots), latents.shape[1]))
        return decode(slots, latents)

    engine.runner.decode = recorded
    ignore = lambda *args: None  # noqa: E731
    worker = DecoderWorker(
        engine.runner, EngineMetrics({}), engine.sample_rate, max_batch=16,
        max_frames_per_call=4, max_row_frames_per_call=max_row_frames, on_row_freed=ignore,
        on_first_audio=ignore,
        on_finished=ignore, on_failed=ignore, on_fatal=ignore, paced=paced,
        yield_after_s=yield_after_s,
    )  # fmt: skip
    worker.row_frame_s = 0.001
    return worker, calls


async def decode_backlogs(
    worker: DecoderWorker, made: list, backlogs: list[tuple[Request, int]], calls: int
) -> None:
    """Queue `backlog` latents of each request, then run the worker until it has made `calls`
    decode calls (recorded in `made`, from `recording_worker`) or the test's timeout."""
    latent = torch.zeros(worker.runner.flow_lm.latent_dim)
    for request, backlog in backlogs:
        for _ in range(backlog):
            worker.put(LatentItem(request, latent, 0))
    worker.start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while len(made) < calls and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    finally:
        worker.stop()


@pytest.mark.usefixtures("fixed_call_cost")
@pytest.mark.parametrize("ahead_s", [2.0, 0.3])
async def test_a_stream_near_an_underrun_is_decoded_before_streams_ahead(
    make_engine, ahead_s: float
) -> None:
    """A stream with almost no audio buffered (just started, or about to finish with its last
    latents) goes into the next decode call, before a bigger backlog of streams further ahead
    of their listeners: alone when they are seconds ahead (a short call), with them when they
    are near an underrun too (past capacity: large calls)."""
    engine = make_engine()
    worker, calls = recording_worker(engine)
    streams = [engine.stream(None, options(50 + i)) for i in range(5)]
    *ahead, behind = [stream.request for stream in streams]
    t = time.perf_counter()
    for request, buffered in [*[(r, ahead_s) for r in ahead], (behind, 0.05)]:
        request.frames_delivered = 1  # past its first frame (decoded outside the worker)
        request.playback.deliver(buffered, t)
    await decode_backlogs(worker, calls, [*[(r, 4) for r in ahead], (behind, 1)], calls=2)
    # The stream behind (the only one with one latent) sets the first call's frames; the
    # others ride along if they are near an underrun too.
    shapes = [(len(slots), frames) for slots, frames in calls[:2]]
    if ahead_s > 0.5:
        assert shapes == [(1, 1), (len(ahead), 4)]
    else:
        assert shapes == [(5, 1), (len(ahead), 3)]
    for stream in streams:
        stream.cancel()


@pytest.mark.usefixtures("fixed_call_cost")
async def test_a_decode_call_takes_at_most_its_row_frames(make_engine) -> None:
    """Many streams with a backlog are decoded a frame each per call, not four: a call cannot
    be interrupted, and a stream that starts meanwhile has two frames to play while it lasts."""
    engine = make_engine()
    worker, calls = recording_worker(engine, max_row_frames=16)
    streams = [engine.stream(None, options(60 + i)) for i in range(12)]
    t = time.perf_counter()
    for stream in streams:
        stream.request.frames_delivered = 1
        stream.request.playback.deliver(1.0, t)
    await decode_backlogs(worker, calls, [(s.request, 4) for s in streams], calls=2)
    shapes = [(len(slots), frames) for slots, frames in calls[:2]]
    assert shapes == [(12, 1), (12, 1)]  # 12 x 4 row-frames in one call without the cap
    for stream in streams:
        stream.cancel()


# 0.125 s: three frames a row (12-15 row-frames of 8 ms) for the first 29 ms that the worker
# takes to plan its call, where 0.1 s left 4 ms before a loaded machine made it two.
@pytest.mark.parametrize(("head_s", "shape"), [(0.05, (4, 1)), (0.125, (4, 3)), (2.0, (4, 4))])
async def test_a_decode_call_ends_before_the_least_buffered_stream_runs_dry(
    make_engine, head_s: float, shape: tuple[int, int]
) -> None:
    """Rows take fewer frames where the call would last longer than the least-buffered stream's
    audio, or longer than `MAX_CALL_S` (0.16 s), by the worker's measured seconds per
    row-frame: at 8 ms, 0.05 s buffered leaves one frame per row, 0.125 s three; seconds
    buffered leave four (0.16 s). Its audio comes only at the end of the call."""
    engine = make_engine()
    worker, calls = recording_worker(engine)
    worker.row_frame_s = 0.008  # as if its calls had measured that
    streams = [engine.stream(None, options(70 + i)) for i in range(4)]
    t = time.perf_counter()
    for i, stream in enumerate(streams):
        stream.request.frames_delivered = 1
        stream.request.playback.deliver(head_s + 0.02 * i, t)
    await decode_backlogs(worker, calls, [(s.request, 4) for s in streams], calls=1)
    assert (len(calls[0][0]), calls[0][1]) == shape
    assert worker.row_frame_s != 0.008  # measured from its own calls since
    for stream in streams:
        stream.cancel()


@pytest.mark.usefixtures("fixed_call_cost")
@pytest.mark.parametrize("starting", [True, False])
async def test_a_decode_call_ends_before_a_starting_stream_runs_dry(
    make_engine, starting: bool
) -> None:
    """A stream whose first frame the AR thread decoded (`decode_first_frames`: the decoder was
    busy) has no latent waiting yet, but its next one may come while a call runs, and that
    frame's audio has to come before its first runs out: the call is sized to end by then too.
    At 8 ms per row-frame, its 80 ms leave 4 rows 2 frames each instead of 4 (1 if the worker
    starts its call 30 ms later: its audio only shrinks)."""
    engine = make_engine()
    worker, calls = recording_worker(engine)
    worker.row_frame_s = 0.008
    streams = [engine.stream(None, options(80 + i)) for i in range(5)]
    *ahead, new = [stream.request for stream in streams]
    t = time.perf_counter()
    for request in ahead:
        request.frames_delivered = 1
        request.playback.deliver(2.0, t)
    if starting:
        latent = torch.zeros(worker.runner.flow_lm.latent_dim)
        worker.decode_first_frames([[LatentItem(new, latent, 0)]])
        assert new.frames_delivered == 1
    await decode_backlogs(worker, calls, [(r, 4) for r in ahead], calls=1)
    rows, frames = len(calls[0][0]), calls[0][1]
    assert rows == 4 and (frames in (1, 2) if starting else frames == 4), calls[0]
    for stream in streams:
        stream.cancel()


async def test_a_tenant_holds_at_most_its_rows(make_engine, reference: Reference) -> None:
    engine = make_engine(max_active=4, max_rows_per_tenant=2, lead_s=None)
    floor = voice_pages(engine)
    most: dict[str, int] = {}
    stop = asyncio.Event()

    async def watch() -> None:
        while not stop.is_set():
            for tenant in ("a", "b"):
                rows = sum(r.tenant == tenant for r in list(engine.scheduler.running))
                most[tenant] = max(most.get(tenant, 0), rows)
            await asyncio.sleep(0.002)

    watcher = asyncio.create_task(watch())
    streams = [engine.stream(None, options(30 + i, max_frames=12), tenant="a") for i in range(4)]
    streams.append(engine.stream(None, options(40, max_frames=12), tenant="b"))
    for stream in streams:
        stream.push_text(TEXTS[1])
        stream.end_input()
    outcomes = await asyncio.gather(*[drain(s) for s in streams])
    stop.set()
    await watcher
    assert most["a"] == 2 and most["b"] == 1, most
    for i, events in enumerate(outcomes):
        audio = np.concatenate([e.samples for e in events if isinstance(e, AudioChunk)])
        opts = options(30 + i if i < 4 else 40, max_frames=12)
        assert_same_audio(audio, reference.audio(TEXTS[1], "default", opts), f"stream {i}")
    await wait_idle(engine, floor)


async def test_scheduling_metrics(make_engine) -> None:
    engine = make_engine(lead_s=0.2, pacing="hold")
    await asyncio.gather(
        *[run_request(engine, TEXTS[2], None, options(i, max_frames=8)) for i in range(2)]
    )
    m = engine.metrics()
    for key in ("streams_open", "rows_generating", "streams_paced", "idle_timeouts"):
        assert key in m, key
    assert m["generate_seconds_mean"] > 0 and m["decode_seconds_mean"] > 0, m
    assert m["pacing_paused_seconds"] > 0, m
    families = {f.name: f for f in text_string_to_metric_families(engine.prometheus().decode())}
    steps = {s.labels.get("stage") for s in families["intone_step_seconds"].samples}
    assert {"prefill", "generate", "decode"} <= steps
    assert "intone_stream_lead_seconds" in families
    assert "intone_pacing_paused_seconds" in families and "intone_idle_timeouts" in families


async def test_an_in_process_turn_outlives_the_idle_timeout(make_engine) -> None:
    """The plugins' speech stream: when the engine stream times out mid-turn (a slow tool
    call), the turn's later text opens a fresh engine stream instead of failing the turn."""
    from intone.provider.backends import EngineSpeech

    engine = make_engine(idle_timeout_s=0.3)
    floor = voice_pages(engine)
    opts = options(9, max_frames=4)
    speech = EngineSpeech(
        engine.stream(None, opts), engine.sample_rate, reopen=lambda: engine.stream(None, opts)
    )
    events: list = []

    async def consume() -> None:
        async for event in speech:
            events.append(event)

    consumer = asyncio.create_task(consume())
    await speech.push_text("Hello there.")
    speech.stream.flush()
    async with asyncio.timeout(TIMEOUT):
        while not any(isinstance(e, ClauseDone) for e in events):
            await asyncio.sleep(0.01)
    first = speech.stream
    async with asyncio.timeout(TIMEOUT):
        while engine.metrics()["idle_timeouts"] == 0:  # the tool call takes a while
            await asyncio.sleep(0.02)
    await speech.push_text("And here is the rest of it.")
    await speech.end_input()
    await asyncio.wait_for(consumer, TIMEOUT)
    assert speech.stream is not first
    assert sum(isinstance(e, ClauseDone) for e in events) == 2, events
    assert speech.submitted_clauses == 2
    await wait_idle(engine, floor)


async def test_a_stream_ahead_gives_its_row_to_a_waiting_one_and_resumes(
    make_engine, reference: Reference
) -> None:
    """One row: a stream far ahead of playback parks at its clause end so a waiting request can
    start; it resumes once playback catches up, and neither's audio changes."""
    engine = make_engine(max_active=1, lead_s=0.3, pacing="hold")
    floor = voice_pages(engine)
    ahead_opts, other_opts = options(50, 0.3, max_frames=10), options(51, 0.3, max_frames=4)
    ahead = engine.stream(None, ahead_opts)
    ahead.push_text(TEXTS[2])  # three clauses of 0.8 s
    ahead.end_input()
    first = await asyncio.wait_for(ahead.__anext__(), TIMEOUT)
    other = engine.stream(None, other_opts)
    other.push_text(TEXTS[0])
    other.end_input()
    other_events = await asyncio.wait_for(drain(other), TIMEOUT)
    # The other request finished while the first still had clauses to say.
    assert (
        ahead.request.pending or ahead.request.clause is not None or not ahead.request.input_ended
    )
    outcome = Outcome([first, *await asyncio.wait_for(drain(ahead), TIMEOUT)])
    check_outcome(outcome, reference, TEXTS[2], "default", ahead_opts, "paced and parked")
    check_outcome(Outcome(other_events), reference, TEXTS[0], "default", other_opts, "the other")
    await wait_idle(engine, floor)


@pytest.mark.usefixtures("fixed_call_cost")
async def test_streams_far_ahead_are_decoded_only_when_nobody_else_waits(make_engine) -> None:
    """Pacing "yield": a stream more than lead_s ahead of its listener rides along with no stream
    within it, even one with plenty buffered, and is decoded once no such stream has latents
    waiting: in calls of at most `max_batch` row-frames (one such call is the most it delays a
    stream that comes due)."""
    engine = make_engine()
    worker, calls = recording_worker(engine, paced=True, yield_after_s=1.0)
    streams = [engine.stream(None, options(60 + i)) for i in range(3)]
    far_a, far_b, within = [stream.request for stream in streams]
    t = time.perf_counter()
    for request, buffered in ((far_a, 3.0), (far_b, 3.0), (within, 0.8)):
        request.frames_delivered = 1
        request.playback.deliver(buffered, t)
    backlogs = [(far_a, 4), (far_b, 4), (within, 4)]
    await decode_backlogs(worker, calls, backlogs, calls=2)
    # Slots are handed out in the order streams reach the worker's calls.
    assert [(len(slots), frames) for slots, frames in calls[:2]] == [(1, 4), (2, 4)], calls
    for stream in streams:
        stream.cancel()


async def test_yield_renders_past_the_lead_when_nobody_else_needs_the_compute(
    make_engine, reference: Reference
) -> None:
    """A consumer that reads as fast as it can and never reports playback, alone on the engine:
    with pacing "yield" it is never held at lead_s (the audio made past it is counted as
    yielded, per stream and in total), with "hold" it is; the audio is the same either way."""
    opts = options(15, 0.3, max_frames=15)  # 3 clauses of 1.2 s
    outcomes = {}
    for mode in ("yield", "hold"):
        engine = make_engine(lead_s=0.3, pacing=mode)
        stream = engine.stream(None, opts)
        stream.push_text(TEXTS[2])
        stream.end_input()
        outcomes[mode] = Outcome(await asyncio.wait_for(drain(stream), TIMEOUT))
        check_outcome(outcomes[mode], reference, TEXTS[2], "default", opts, mode)
        yielded = stream.metrics.yielded_seconds
        m = engine.metrics()
        assert m["yielded_seconds"] == pytest.approx(yielded)
        if mode == "yield":
            assert yielded > 1.0 and m["pacing_paused_seconds"] == 0, (yielded, m)
            families = text_string_to_metric_families(engine.prometheus().decode())
            total = {f.name: f for f in families}["intone_yielded_seconds"].samples[0].value
            assert total == pytest.approx(yielded)
        else:
            assert yielded < 0.5 and m["pacing_paused_seconds"] > 0, (yielded, m)


@pytest.mark.usefixtures("fixed_call_cost")
async def test_paced_decoder_keeps_itself_free_for_a_first_latent(make_engine) -> None:
    """With pacing on and every stream seconds ahead of its listener, the decoder starts no
    call while a stream's first latent and frame are being computed (on the AR thread), and
    then decodes that stream's next latent at once; calls of streams ahead are kept to
    `max_batch` row-frames. A stream that comes near an underrun during the hold is decoded all
    the same: the hold never starves anybody."""
    engine = make_engine()
    worker, calls = recording_worker(engine, paced=True)
    streams = [engine.stream(None, options(70 + i)) for i in range(8)]
    *ahead, new = [stream.request for stream in streams]
    t = time.perf_counter()
    for request in ahead:
        request.frames_delivered = 1
        request.playback.deliver(2.0, t)  # near an underrun (URGENT_S) in 1.5 s, after the hold
    new.frames_delivered = 1  # its first frame, decoded by the AR thread
    new.playback.deliver(0.08, t)
    worker.first_frames_due = True
    latent = torch.zeros(worker.runner.flow_lm.latent_dim)
    for request in ahead:
        for _ in range(4):
            worker.put(LatentItem(request, latent, 0))
    worker.start()
    try:
        await asyncio.sleep(0.2)
        assert calls == []  # held: nobody needs audio yet
        worker.put(LatentItem(new, latent, 0))
        worker.first_frames_due = False
        async with asyncio.timeout(TIMEOUT):
            while len(calls) < 2:
                await asyncio.sleep(0.005)
        assert calls[0] == ([new.decoder_slot], 1)
        # 7 streams ahead, 16 row-frames a call: 2 frames each.
        assert calls[1][1] == 2 and len(calls[1][0]) == len(ahead), calls
        worker.first_frames_due = True  # due for good: the streams ahead still get their audio
        async with asyncio.timeout(TIMEOUT):
            while sum(len(slots) * frames for slots, frames in calls[1:]) < 4 * len(ahead):
                await asyncio.sleep(0.005)
    finally:
        worker.stop()
        for stream in streams:
            stream.cancel()


async def test_rows_ahead_of_the_decoder_take_no_steps(make_engine, reference: Reference) -> None:
    """When the decoder is the slower stage, a row stops stepping with a few decode calls'
    latents not yet decoded (its steps would only take the decoder's cores), and its audio is
    unchanged."""
    engine = make_engine(lead_s=None)
    slow_decoder(engine, 0.05)
    ahead: list[int] = []
    generate = engine.runner.generate

    def recorded(requests, noise):
        ahead.extend(r.frames_generated - r.frames_delivered for r in requests)
        return generate(requests, noise)

    engine.runner.generate = recorded
    opts = options(12, 0.3, max_frames=40)
    outcome = await run_request(engine, TEXTS[0], "default", opts)
    check_outcome(outcome, reference, TEXTS[0], "default", opts, "a row ahead of the decoder")
    call = engine.config.max_decode_frames
    assert max(ahead) < 3 * call, f"a row stepped {max(ahead)} latents ahead of the decoder"


async def test_a_row_that_may_step_waits_for_one_that_must(make_engine) -> None:
    """AR steps come in bursts: a paced row a little under its lead takes no step of its own,
    and rides along when another row is due (here a new stream's)."""
    engine = make_engine(lead_s=0.8, pacing="hold")
    frame_s = 1920 / 24000
    paced = engine.stream(None, options(13, max_frames=60))
    paced.report_playback(0.0)
    paced.push_text(TEXTS[2])

    async def settle() -> int:
        """Frames generated once they stop growing."""
        before = -1
        while (frames := paced.request.frames_generated) != before:
            before = frames
            await asyncio.sleep(0.15)
        return frames

    held = await asyncio.wait_for(settle(), TIMEOUT)
    assert held * frame_s > 0.8
    # 0.7 s ahead now: under lead_s, so it may step, but not under 3/4 of it, so it is not due.
    paced.report_playback(held * frame_s - 0.7)
    await asyncio.sleep(0.4)
    assert paced.request.frames_generated == held, "a row that was not due stepped alone"
    new = engine.stream(None, options(14, max_frames=20))
    new.push_text(TEXTS[0])
    new.end_input()
    await asyncio.wait_for(drain(new), TIMEOUT)
    assert paced.request.frames_generated > held, "the row did not ride along with a due one"
    paced.cancel()


@pytest.mark.parametrize("parts_of", [2, 16])
async def test_a_burst_of_new_streams_is_prefilled_in_parts_beside_a_stream_near_an_underrun(
    make_engine, reference: Reference, parts_of: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a stream that plays is near an underrun (here held 0.3 s ahead of its listener, under
    URGENT_S), a burst of new streams is prefilled at most `max_prefill_rows_near_underrun` at a
    time, so the playing stream's next steps come between the parts. The burst's audio is the
    single path's. (The passes' time budget, test_pacing.py, is lifted: this is the row cap.)"""
    monkeypatch.setattr(scheduler_module, "PREFILL_MARGIN_S", -60.0)
    monkeypatch.setattr(scheduler_module, "JOINED_PREFILL_MARGIN_S", -60.0)
    engine = make_engine(lead_s=0.3, max_prefill_rows_near_underrun=parts_of, pacing="hold")
    passes: list[int] = []

    def slow_prefill(requests) -> None:
        passes.append(len(requests))
        time.sleep(0.1)  # the burst gathers while a pass runs

    on_prompt_passes(engine, slow_prefill)
    held = engine.stream(None, options(20, max_frames=80))
    held.report_playback(0.0)
    held.push_text(TEXTS[2])
    await asyncio.wait_for(settled_frames(held), TIMEOUT)
    passes.clear()
    opts = [options(21 + i, max_frames=4) for i in range(6)]
    outcomes = await asyncio.gather(*(run_request(engine, TEXTS[0], "default", o) for o in opts))
    for outcome, o in zip(outcomes, opts, strict=True):
        check_outcome(outcome, reference, TEXTS[0], "default", o, "a stream of the burst")
    assert sum(passes) == 6, passes
    assert max(passes) == 2 if parts_of == 2 else max(passes) > 2, passes
    held.cancel()
