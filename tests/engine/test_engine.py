"""The batched engine against the single-request path, on the tiny checkpoint.

The single-request path (`generate` over `split_clauses`) is the definition of what a request must
sound like. Every request that completes in the engine, whatever else runs beside it, must equal
it; cancelled requests must stop at once; and after any mix the engine must be back to idle: only
the voice pages in use, no active request, no decoder state held.

Random weights would stop at frame 6 on EOS, so EOS is off (`NO_EOS`) and clauses end at
`max_frames`, kept small.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from intone.engine import (
    AudioChunk,
    ClauseDone,
    EmptyTextError,
    EngineClosedError,
    EngineFullError,
    InvalidOptionError,
    InvalidTextError,
    StreamClosedError,
    TextTooLongError,
    UnknownVoiceError,
)
from intone.engine.config import PUSH_PIECE_CHARS, ROW_CONTEXT_FAULT_IN_POSITIONS
from intone.engine.generate import fade_in, generate_latents
from intone.engine.loading import LoadedModel
from intone.engine.options import GenerationOptions
from intone.engine.text import plan_clause
from intone.engine.voices import Voice

from support.engine import (
    SECOND_VOICE,
    TEXTS,
    TIMEOUT,
    Outcome,
    Reference,
    assert_audio_prefix,
    assert_same_audio,
    cancel_and_drain,
    check_outcome,
    drain,
    on_prompt_passes,
    options,
    run_request,
    slow_decoder,
    voice_pages,
    wait_idle,
    wait_idle_sync,
)

# One clause of 44 tokens: the model's own frame estimate for it is 209 frames.
LONG_CLAUSE = (
    "The quick brown fox jumps over the lazy dog while the small cat sleeps by the warm fire "
    "in the old house near the river"
)


# ---- equivalence


# (text, voice, arrival delay in s, cancel after this many chunks or None)
MIXED_PLAN = [
    (0, "default", 0.0, None),
    (1, SECOND_VOICE, 0.0, None),
    (2, "default", 0.02, None),
    (3, SECOND_VOICE, 0.01, 3),
    (1, "default", 0.05, None),
    (2, SECOND_VOICE, 0.03, None),
    (0, SECOND_VOICE, 0.08, None),
    (3, "default", 0.0, 8),
    (3, "default", 0.04, None),
]


@pytest.mark.parametrize(
    ("temperature", "chain_frames", "batch_buckets", "traced", "joined"),
    [
        (0.0, 4, None, False, False),
        (0.0, 0, None, False, False),
        (0.3, 4, None, False, False),
        (0.3, 0, None, False, False),
        (0.3, 4, (2, 4, 8, 16), False, False),  # AR batches padded to fixed sizes
        # Every AR step and decode call replays a trace made on scratch rows before serving.
        (0.3, 4, None, True, False),
        # Prompt passes in one pass with the AR step (`ModelRunner.join_passes`), traced.
        (0.3, 4, None, True, True),
    ],
)
async def test_concurrent_requests_equal_the_single_path(
    make_engine,
    reference: Reference,
    temperature: float,
    chain_frames: int,
    batch_buckets: tuple[int, ...] | None,
    traced: bool,
    joined: bool,
) -> None:
    engine = make_engine(batch_buckets=batch_buckets, trace_after=1 if traced else None)
    if traced:
        engine.prepare_traces()
        ar_traces = engine.runner.ar_traces
        assert ar_traces is not None and len(ar_traces) == 3
    engine.runner.join_passes = joined
    joint_passes = []
    joint = engine.runner.prefill_and_generate

    def counted(*args):
        joint_passes.append(len(args[0]))
        return joint(*args)

    engine.runner.prefill_and_generate = counted
    floor = voice_pages(engine)
    assert engine.metrics()["kv_pages_in_use"] == floor
    jobs = [
        (TEXTS[t], voice, options(100 + i, temperature, chain_frames), delay, cancel)
        for i, (t, voice, delay, cancel) in enumerate(MIXED_PLAN)
    ]
    outcomes = await asyncio.gather(
        *[
            run_request(engine, text, voice, opts, delay=delay, cancel_after=cancel)
            for text, voice, opts, delay, cancel in jobs
        ]
    )
    for i, ((text, voice, opts, _, cancel), outcome) in enumerate(zip(jobs, outcomes, strict=True)):
        assert outcome.cancelled == (cancel is not None), f"request {i}"
        check_outcome(outcome, reference, text, voice, opts, f"request {i}")
    # The requests really ran side by side.
    m = engine.metrics()
    assert m["generate_batch_mean"] > 1.5 and m["decode_batch_mean"] > 1.2, m
    assert bool(joint_passes) == joined, joint_passes
    await wait_idle(engine, floor)
    m = engine.metrics()
    assert m["requests_completed"] == 7 and m["requests_cancelled"] == 2


request_plans = st.tuples(
    st.integers(0, len(TEXTS) - 1),  # text
    st.sampled_from(["default", SECOND_VOICE]),
    st.integers(0, 4).map(lambda n: n / 100),  # arrival delay
    st.one_of(st.none(), st.just(0), st.integers(1, 14)),  # cancel: never, before audio, after k
    st.sampled_from([0.0, 0.3]),  # temperature
)


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plans=st.lists(request_plans, min_size=3, max_size=5), chain_frames=st.sampled_from([0, 4]))
def test_property_arrivals_and_cancels(
    make_engine, reference: Reference, plans: list, chain_frames: int
) -> None:
    engine = make_engine(max_active=4)
    floor = voice_pages(engine)
    jobs = [
        (TEXTS[t], voice, options(7 * i + 1, temp, chain_frames, max_frames=8), delay, cancel)
        for i, (t, voice, delay, cancel, temp) in enumerate(plans)
    ]

    async def scenario() -> list[Outcome]:
        outcomes = await asyncio.gather(
            *[
                run_request(engine, text, voice, opts, delay=delay, cancel_after=cancel)
                for text, voice, opts, delay, cancel in jobs
            ]
        )
        await wait_idle(engine, floor)
        return outcomes

    outcomes = asyncio.run(scenario())
    for i, ((text, voice, opts, _, cancel), outcome) in enumerate(zip(jobs, outcomes, strict=True)):
        if cancel == 0:
            assert outcome.cancelled and outcome.events == [] and outcome.after_cancel == []
        check_outcome(outcome, reference, text, voice, opts, f"request {i} of {plans}")
    engine.close()


# ---- voices and pages


@pytest.mark.parametrize("page_size", [7, 20])  # the last voice page holds 1 or 16 positions
async def test_voice_prefix_pages_are_shared(
    make_engine, reference: Reference, voices: dict[str, Voice], page_size: int
) -> None:
    engine = make_engine(page_size=page_size)
    voice = engine.scheduler.voices["default"].table
    assert voice.length == voices["default"].length
    assert voice.length % page_size != 0, "the test needs a partly filled last voice page"
    floor = voice_pages(engine)
    assert engine.metrics()["kv_pages_in_use"] == floor
    full_pages = voice.pages[: voice.length // page_size]
    partial_page = voice.pages[-1]
    voice_slots = engine.blocks.slots(voice)
    voice_kv = [t.clone() for t in engine.runner.pool.read(voice_slots)]
    slow_decoder(engine, 0.004)  # keeps both clauses holding their pages for a while

    # Every clause, when its prompt pass starts, must see the voice's exact K/V at positions
    # 0..voice.length-1 of its own table: the shared pages and its private copy of the last one.
    prefixes_checked: list[bool] = []

    def check_prefixes(requests) -> None:
        for request in requests:
            if request.voice == "default":
                slots = engine.blocks.slots(request.table, 0, voice.length)
                got = engine.runner.pool.read(slots)
                prefixes_checked.append(
                    all(torch.equal(g, w) for g, w in zip(got, voice_kv, strict=True))
                )

    on_prompt_passes(engine, check_prefixes)

    seen = {"full": 0, "partial": 0}
    stop = asyncio.Event()

    async def watch() -> None:
        while not stop.is_set():
            seen["full"] = max(seen["full"], min(engine.blocks.ref_counts[p] for p in full_pages))
            seen["partial"] = max(seen["partial"], engine.blocks.ref_counts[partial_page])
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch())
    jobs = [
        (TEXTS[2], options(1, 0.0, max_frames=15)),
        (TEXTS[1], options(2, 0.3, max_frames=15)),
    ]
    outcomes = await asyncio.gather(
        *[run_request(engine, text, "default", opts) for text, opts in jobs]
    )
    stop.set()
    await watcher
    assert seen["full"] >= 3, "two running requests should reference the voice's full pages"
    assert seen["partial"] == 1, "the partial voice page must be copied, never shared"
    assert len(prefixes_checked) == 5 and all(prefixes_checked), prefixes_checked
    for i, ((text, opts), outcome) in enumerate(zip(jobs, outcomes, strict=True)):
        check_outcome(outcome, reference, text, "default", opts, f"request {i}")
    await wait_idle(engine, floor)
    assert all(engine.blocks.ref_counts[p] == 1 for p in voice.pages)
    for got, want in zip(engine.runner.pool.read(voice_slots), voice_kv, strict=True):
        assert torch.equal(got, want), "the voice's pages were written to"

    # A later request (sharing the same pages again) still equals the single path.
    later = options(3, 0.3, max_frames=15)
    outcome = await run_request(engine, TEXTS[3], "default", later)
    check_outcome(outcome, reference, TEXTS[3], "default", later, "later request")
    assert len(prefixes_checked) == 8 and all(prefixes_checked), prefixes_checked
    await wait_idle(engine, floor)


async def test_replacing_a_voice_keeps_pages_balanced(
    make_engine, reference: Reference, second_voice_wav: Path
) -> None:
    engine = make_engine()
    floor = voice_pages(engine)
    engine.add_voice(SECOND_VOICE, second_voice_wav)  # same name again: old pages released
    assert engine.metrics()["kv_pages_in_use"] == floor
    assert engine.voices == ["default", SECOND_VOICE]
    opts = options(4, 0.3)
    outcome = await run_request(engine, TEXTS[1], SECOND_VOICE, opts)
    check_outcome(outcome, reference, TEXTS[1], SECOND_VOICE, opts, "second voice")
    await wait_idle(engine, floor)


# ---- streaming and clauses


async def test_streaming_text_word_by_word(make_engine, reference: Reference) -> None:
    engine = make_engine()
    floor = voice_pages(engine)
    first = "Hello there, my good friend."
    rest = "It is a fine day today, and we will all go out. See you soon."
    text = f"{first} {rest}"
    clauses = reference.clauses(text)
    assert len(clauses) >= 3 and first.startswith(clauses[0]), clauses
    opts = options(5, 0.3, max_frames=10)

    stream = engine.stream(SECOND_VOICE, opts)
    outcome = Outcome()
    first_audio = asyncio.Event()

    async def consume() -> None:
        async for event in stream:
            outcome.events.append(event)
            if isinstance(event, AudioChunk):
                first_audio.set()

    consumer = asyncio.create_task(consume())
    for word in first.split():
        stream.push_text(word + " ")
        await asyncio.sleep(0.005)
    # The first clause is complete: its audio must come without end_input.
    try:
        await asyncio.wait_for(first_audio.wait(), 5.0)
    except TimeoutError:
        consumer.cancel()
        pytest.fail("no audio before end_input although the first clause was complete")
    for word in rest.split():
        stream.push_text(word + " ")
        await asyncio.sleep(0.005)
    stream.end_input()
    await asyncio.wait_for(consumer, TIMEOUT)

    # Clause by clause: chunks of clause i, then ClauseDone(i), then clause i + 1.
    current, frames = 0, 0
    for event in outcome.events:
        if isinstance(event, AudioChunk):
            assert event.clause == current
            frames += 1
        else:
            assert isinstance(event, ClauseDone)
            assert event.clause == current and event.text == clauses[current]
            assert event.frames == frames
            current, frames = current + 1, 0
    assert current == len(clauses) and frames == 0
    check_outcome(outcome, reference, text, SECOND_VOICE, opts, "streamed")
    await wait_idle(engine, floor)


async def test_long_text_is_planned_with_the_loop_free(make_engine, reference: Reference) -> None:
    """push_long_text gives the clauses of one push_text, and other tasks run while it plans."""
    engine = make_engine(max_text_chars=2000)
    text = " ".join(TEXTS * 9)  # 1,700 characters: four pieces
    assert len(text) > 3 * PUSH_PIECE_CHARS
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    stream = engine.stream(None, options(7, max_frames=1))
    before = ticks
    await stream.push_long_text(text)
    during = ticks - before
    ticker.cancel()
    stream.end_input()
    done = [e.text for e in await drain(stream) if isinstance(e, ClauseDone)]
    assert done == reference.clauses(text)
    assert during >= 3

    # Refused as a whole, before any piece: the stream carries on untouched.
    stream = engine.stream(None, options(7, max_frames=1))
    with pytest.raises(InvalidTextError):
        await stream.push_long_text(text[:1500] + "\udcff")
    with pytest.raises(TextTooLongError):
        await stream.push_long_text(text + text)
    assert stream.metrics.clauses == 0
    await stream.push_long_text("Hi there.")
    stream.end_input()
    assert [e.text for e in await drain(stream) if isinstance(e, ClauseDone)] == ["Hi there."]

    # Cancelled by another task between pieces: the push ends with StreamClosedError.
    stream = engine.stream(None, options(7, max_frames=1))
    canceller = asyncio.get_running_loop().call_soon(stream.cancel)
    with pytest.raises(StreamClosedError):
        await stream.push_long_text(text)
    canceller.cancel()
    assert await drain(stream) == []


async def test_flush_ends_a_clause_early(make_engine, reference: Reference) -> None:
    engine = make_engine()
    opts = options(6, 0.0, max_frames=6)
    stream = engine.stream(None, opts)
    stream.push_text("Hello world")  # no boundary yet
    stream.flush()
    first = await asyncio.wait_for(stream.__anext__(), TIMEOUT)
    assert isinstance(first, AudioChunk) and first.clause == 0
    stream.push_text("and the rest of it.")
    stream.end_input()
    events = [first, *await drain(stream)]
    done = [e for e in events if isinstance(e, ClauseDone)]
    assert [d.text for d in done] == ["Hello world", "and the rest of it."]


async def test_clause_boundaries_are_seamless(
    make_engine, reference: Reference, tiny_model: LoadedModel, voices: dict[str, Voice]
) -> None:
    """The decoder history runs on across clauses: no reset, no click at the boundary."""
    engine = make_engine()
    text = TEXTS[2]
    opts = options(11, 0.3, max_frames=10)
    outcome = await run_request(engine, text, "default", opts)
    check_outcome(outcome, reference, text, "default", opts, "multi-clause")
    got = outcome.audio

    # The same latents decoded in one Mimi pass, as if there were no clauses at all.
    clauses = reference.clauses(text)
    assert len(clauses) == 3
    model = tiny_model.model
    latents = torch.stack(
        [latent for _, latent in generate_latents(tiny_model, voices["default"], clauses, opts)]
    )
    with torch.no_grad():
        state = model.mimi.init_decoder_state(1)
        whole = model.mimi.decode(model.flow_lm.denormalize(latents)[None], state)[0, 0]
    spf = model.samples_per_frame
    whole[:spf] = fade_in(whole[:spf], model.sample_rate)
    assert_same_audio(got, whole.numpy(), "against one decode pass")

    jumps = np.abs(np.diff(got))
    ends = np.cumsum([d.frames for d in outcome.clauses_done])[:-1] * spf
    assert len(ends) == 2
    for end in ends:
        around = np.concatenate([jumps[end - 1 - spf : end - 1], jumps[end : end + spf]])
        assert jumps[end - 1] <= around.max(), f"click at sample {end}"


# ---- capacity


def clause_pages_needed(
    loaded: LoadedModel, reference: Reference, text: str, voice: Voice, opts, page_size: int
) -> int:
    """New pages (beyond the voice's shared full pages) the largest clause of `text` reserves."""
    longest = max(
        len(plan_clause(loaded, clause, opts).tokens) for clause in reference.clauses(text)
    )
    positions = voice.length + opts.chain_frames + longest + opts.max_frames
    return -(-positions // page_size) - voice.length // page_size


async def test_exhausted_pool_queues_and_completes_everything(
    make_engine, reference: Reference, tiny_model: LoadedModel, voices: dict[str, Voice]
) -> None:
    page_size = 16
    text = TEXTS[1]
    opts = [options(20 + i, (0.0, 0.3)[i % 2], max_frames=12) for i in range(7)]
    need = clause_pages_needed(tiny_model, reference, text, voices["default"], opts[0], page_size)
    floor = -(-voices["default"].length // page_size)
    num_pages = floor + 2 * need + need // 2  # room for two clauses at once, not three
    engine = make_engine(second_voice=False, num_pages=num_pages, max_active=4)
    assert voice_pages(engine) == floor
    outcomes = await asyncio.gather(*[run_request(engine, text, "default", o) for o in opts])
    for i, (o, outcome) in enumerate(zip(opts, outcomes, strict=True)):
        check_outcome(outcome, reference, text, "default", o, f"request {i}")
    m = engine.metrics()
    histogram = m["generate_batch_histogram"]
    assert histogram["2"] > 0, histogram
    assert sum(n for size, n in histogram.items() if int(size) > 2) == 0, histogram
    assert m["requests_completed"] == len(opts)
    await wait_idle(engine, floor)


async def test_clause_that_can_never_fit_is_refused_at_push(
    make_engine, reference: Reference
) -> None:
    engine = make_engine(num_pages=12)
    floor = voice_pages(engine)
    opts = options(1, max_frames=500)
    stream = engine.stream(None, opts)
    with pytest.raises(TextTooLongError, match="pages"):
        stream.push_text(LONG_CLAUSE)
        stream.end_input()
    # The clause's text has left the splitter: the stream ends with the error rather than go
    # on without those words.
    with pytest.raises(TextTooLongError, match="pages"):
        await asyncio.wait_for(drain(stream), TIMEOUT)
    with pytest.raises(StreamClosedError):
        stream.push_text("More words.")
    with pytest.raises(TextTooLongError, match="pages"):
        await asyncio.wait_for(engine.synthesize(LONG_CLAUSE, options=opts), TIMEOUT)
    await wait_idle(engine, floor)
    small = options(2, max_frames=6)
    outcome = await run_request(engine, TEXTS[0], None, small)
    check_outcome(outcome, reference, TEXTS[0], "default", small, "after the refusal")


@pytest.mark.parametrize("second_voice", [False, True], ids=["one_voice", "two_voices"])
async def test_every_accepted_clause_eventually_fits(
    make_engine, reference: Reference, second_voice: bool
) -> None:
    """The largest clause the push-time check accepts must run, whatever other voices hold."""
    engine = make_engine(second_voice=second_voice, num_pages=10, page_size=16)
    floor = voice_pages(engine)
    text = LONG_CLAUSE
    accepted = None
    for max_frames in range(10 * 16, 0, -1):
        stream = engine.stream(None, options(3, chain_frames=0, max_frames=max_frames))
        try:
            stream.push_text(text)
            stream.end_input()
        except TextTooLongError:
            stream.cancel()
            continue
        accepted = (stream, max_frames)
        break
    assert accepted is not None
    stream, max_frames = accepted
    try:
        events = await asyncio.wait_for(drain(stream), 5.0)
    except TimeoutError:
        pytest.fail(
            f"a clause with max_frames={max_frames} passed the push-time page check but never "
            f"started: {engine.metrics()['kv_pages_free']} pages free, voices hold {floor}"
        )
    assert sum(isinstance(e, AudioChunk) for e in events) == max_frames
    await wait_idle(engine, floor)


async def test_queue_limit_raises_engine_full(make_engine, reference: Reference) -> None:
    engine = make_engine(max_active=1, max_queued=2)
    floor = voice_pages(engine)
    slow_decoder(engine, 0.005)
    running = engine.stream(None, options(1, max_frames=30))
    running.push_text(TEXTS[0])
    running.end_input()
    await asyncio.wait_for(running.__anext__(), TIMEOUT)  # admitted and generating
    queued = []
    for i in range(2):
        stream = engine.stream(None, options(2 + i, max_frames=5))
        stream.push_text(TEXTS[0])
        stream.end_input()
        queued.append(stream)
    assert engine.metrics()["queued_requests"] == 2
    with pytest.raises(EngineFullError):
        engine.stream(None, options(9))
    # The refused request left nothing behind; the queued ones all complete.
    for i, stream in enumerate(queued):
        events = await drain(stream)
        audio = np.concatenate([e.samples for e in events if isinstance(e, AudioChunk)])
        assert_same_audio(audio, reference.audio(TEXTS[0], "default", options(2 + i, max_frames=5)))
    await drain(running)
    await wait_idle(engine, floor)


# ---- bad input


GAUGES = (
    "kv_pages_in_use",
    "active_requests",
    "queued_requests",
    "decoder_states_in_use",
    "requests_completed",
    "requests_cancelled",
)


async def test_bad_input_raises_at_submit_and_leaves_the_engine_alone(
    make_engine, reference: Reference
) -> None:
    engine = make_engine(max_text_chars=200)
    floor = voice_pages(engine)
    before = {k: engine.metrics()[k] for k in GAUGES}

    async def unchanged() -> None:
        await wait_idle(engine, floor)
        assert {k: engine.metrics()[k] for k in GAUGES} == before

    for text in ["", "   \n\t "]:
        with pytest.raises(EmptyTextError):
            await engine.synthesize(text)
        await unchanged()
    with pytest.raises(TextTooLongError, match="limit"):
        await engine.synthesize("word " * 50)
    await unchanged()
    with pytest.raises(UnknownVoiceError, match="unknown voice"):
        engine.stream("nobody")
    with pytest.raises(UnknownVoiceError, match="unknown voice"):
        await engine.synthesize(TEXTS[0], voice="nobody")
    for bad in [{"temperature": -0.1}, {"chain_frames": -1}, {"max_frames": 0}]:
        with pytest.raises(InvalidOptionError):
            GenerationOptions(**bad)
    with pytest.raises(InvalidOptionError):  # valid options, but not what this engine runs
        engine.stream(None, GenerationOptions(flow_steps=2))
    with pytest.raises(InvalidOptionError):
        await engine.synthesize(TEXTS[0], options=GenerationOptions(flow_steps=2))
    await unchanged()

    stream = engine.stream()
    with pytest.raises(EmptyTextError):
        stream.end_input()
    stream.push_text("  ")
    with pytest.raises(EmptyTextError):
        stream.end_input()
    stream.cancel()
    await unchanged()

    stream = engine.stream()
    with pytest.raises(TextTooLongError, match="limit"):
        stream.push_text("x" * 201)
    stream.cancel()
    await unchanged()

    # Text the tokenizer could not encode is refused as it comes in, and changes nothing.
    stream = engine.stream()
    for bad in ["a\ud800b", "\udcff"]:  # a split UTF-16 pair; undecodable bytes in argv
        with pytest.raises(InvalidTextError, match="surrogate"):
            stream.push_text(bad)
    for bad in [b"bytes", 3, None]:
        with pytest.raises(TypeError, match="str"):
            stream.push_text(bad)
    with pytest.raises(InvalidTextError):
        await engine.synthesize("\ud83d")
    stream.push_text("Hello there.")
    stream.end_input()
    assert [chunk async for chunk in stream.audio()]
    await wait_idle(engine, floor)

    opts = options(8, 0.3)
    outcome = await run_request(engine, TEXTS[1], None, opts)
    check_outcome(outcome, reference, TEXTS[1], "default", opts, "after bad input")


async def test_stream_without_text_does_not_block_others(make_engine, reference: Reference) -> None:
    """An open stream still waiting for its first text must not hold up ready requests."""
    engine = make_engine()
    floor = voice_pages(engine)
    idle_stream = engine.stream()  # e.g. opened when the LLM starts, text not there yet
    opts = options(9, max_frames=6)
    try:
        audio = await asyncio.wait_for(engine.synthesize(TEXTS[0], options=opts), 5.0)
    except TimeoutError:
        pytest.fail("a request was blocked behind a stream that has no text yet")
    finally:
        idle_stream.cancel()
    assert_same_audio(audio, reference.audio(TEXTS[0], "default", opts))
    await wait_idle(engine, floor)


# ---- several event loops


def test_several_event_loops_share_one_engine(
    make_engine, reference: Reference, tiny_checkpoint: Path
) -> None:
    engine = make_engine(max_frames=10)
    floor = voice_pages(engine)
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def job(index: int) -> None:
        async def main() -> list:
            jobs = [
                (
                    TEXTS[(index + k) % len(TEXTS)],
                    ("default", SECOND_VOICE)[k % 2],
                    40 + 3 * index + k,
                )
                for k in range(3)
            ]
            outs = await asyncio.gather(
                *[
                    run_request(
                        engine, text, voice, options(seed, 0.3, max_frames=None), delay=0.01 * k
                    )
                    for k, (text, voice, seed) in enumerate(jobs)
                ]
            )
            return list(zip(jobs, outs, strict=True))

        try:
            results[index] = asyncio.run(main())
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a loop's requests never finished"
    assert not errors, errors
    for index in range(3):
        for (text, voice, seed), outcome in results[index]:
            # EngineConfig.max_frames caps every clause like options.max_frames would.
            opts = options(seed, 0.3, max_frames=10)
            check_outcome(outcome, reference, text, voice, opts, f"loop {index} seed {seed}")
    wait_idle_sync(engine, floor)


def test_a_consumer_whose_loop_closed_does_not_break_the_engine(
    make_engine, reference: Reference
) -> None:
    """A job that stops reading and exits (its loop closes) without cancel() hurts nobody else."""
    engine = make_engine()
    slow_decoder(engine, 0.003)

    async def abandon() -> None:
        stream = engine.stream(None, options(1, max_frames=30))
        stream.push_text(TEXTS[2])
        stream.end_input()
        await asyncio.wait_for(stream.__anext__(), TIMEOUT)

    asyncio.run(abandon())  # returns with the request still generating; its loop is closed

    async def other() -> np.ndarray:
        return await asyncio.wait_for(engine.synthesize(TEXTS[1], options=options(2)), 5.0)

    audio = asyncio.run(other())
    assert_same_audio(audio, reference.audio(TEXTS[1], "default", options(2)))


# ---- cancel


@pytest.mark.parametrize(
    "stage", ["queued", "prefill", "generating", "decoding", "unread", "finished_unread"]
)
async def test_cancel_at_any_point(make_engine, reference: Reference, stage: str) -> None:
    engine = make_engine(max_active=1 if stage == "queued" else 4)
    floor = voice_pages(engine)
    blocker = None
    if stage == "queued":
        slow_decoder(engine, 0.003)
        blocker_opts = options(1, max_frames=25)
        blocker = engine.stream(None, blocker_opts)
        blocker.push_text(TEXTS[0])
        blocker.end_input()
        first = await asyncio.wait_for(blocker.__anext__(), TIMEOUT)
    if stage == "decoding":
        slow_decoder(engine, 0.01)  # the AR stage finishes long before the decoder

    opts = options(2, 0.3, max_frames=25)
    stream = engine.stream(None, opts)
    stream.push_text(TEXTS[3])
    stream.end_input()
    outcome = Outcome()
    if stage == "queued":
        assert engine.metrics()["queued_requests"] == 1
        assert stream.request.phase.value == "waiting"
    elif stage in ("generating", "decoding"):
        outcome.events.append(await asyncio.wait_for(stream.__anext__(), TIMEOUT))
    elif stage == "unread":
        outcome.events.append(await asyncio.wait_for(stream.__anext__(), TIMEOUT))
        await asyncio.sleep(0.05)  # chunks pile up unread in the stream
    elif stage == "finished_unread":
        await wait_idle(engine, floor)  # the engine is done; all of it waits unread
    await cancel_and_drain(stream, outcome)
    assert outcome.after_cancel == [], f"{len(outcome.after_cancel)} events after cancel()"
    assert_audio_prefix(outcome.audio, reference.audio(TEXTS[3], "default", opts), stage)

    if blocker is not None:
        rest = await drain(blocker)
        audio = np.concatenate(
            [first.samples] + [e.samples for e in rest if isinstance(e, AudioChunk)]
        )
        assert_same_audio(audio, reference.audio(TEXTS[0], "default", blocker_opts), "blocker")
    await wait_idle(engine, floor)
    after = options(3, 0.3)
    outcome = await run_request(engine, TEXTS[1], None, after)
    check_outcome(outcome, reference, TEXTS[1], "default", after, f"after cancel in {stage}")
    await wait_idle(engine, floor)


async def test_cancel_while_decoding_does_not_starve_other_requests(
    make_engine, reference: Reference
) -> None:
    """A cancelled request's frames still in the decoder must not cost a later request its turn.

    max_active=2: A sits between clauses (admitted, holding its decoder history), B is cancelled
    while the slow decoder still holds many of its frames, C is admitted in B's place.
    """
    engine = make_engine(max_active=2)
    floor = voice_pages(engine)
    slow_decoder(engine, 0.02)
    a = engine.stream(None, options(1, max_frames=3))
    a.push_text(TEXTS[0])
    a.flush()
    async with asyncio.timeout(TIMEOUT):
        async for event in a:
            if isinstance(event, ClauseDone):
                break
    b = engine.stream(None, options(2, max_frames=40))
    b.push_text(TEXTS[1])
    b.end_input()
    c_opts = options(3, 0.3, max_frames=5)
    c = engine.stream(None, c_opts)
    c.push_text(TEXTS[0])
    c.end_input()
    await asyncio.wait_for(b.__anext__(), TIMEOUT)
    await asyncio.sleep(0.05)
    b.cancel()
    events = await drain(c)
    audio = np.concatenate([e.samples for e in events if isinstance(e, AudioChunk)])
    assert_same_audio(audio, reference.audio(TEXTS[0], "default", c_opts), "C")
    a.cancel()
    await wait_idle(engine, floor)


async def test_close_ends_open_streams(make_engine) -> None:
    engine = make_engine(max_active=1)
    running = engine.stream(None, options(1, max_frames=200))
    running.push_text(TEXTS[0])
    running.end_input()
    await asyncio.wait_for(running.__anext__(), TIMEOUT)
    queued = engine.stream(None, options(2))
    queued.push_text(TEXTS[0])
    queued.end_input()
    engine.close()
    for name, stream in (("running", running), ("queued", queued)):
        with pytest.raises(EngineClosedError):
            try:
                async with asyncio.timeout(3.0):
                    async for _ in stream:
                        pass
            except TimeoutError:
                pytest.fail(f"the {name} stream never ended after close()")


async def test_a_finished_stream_stays_finished(make_engine) -> None:
    """Iterating a stream that ended (or was cancelled) again ends at once, as iterators must."""
    engine = make_engine()
    stream = engine.stream(None, options(1, max_frames=3))
    stream.push_text(TEXTS[0])
    stream.end_input()
    assert len(await drain(stream)) == 4  # 3 chunks and the ClauseDone
    cancelled = engine.stream(None, options(2))
    cancelled.push_text(TEXTS[0])
    cancelled.cancel()
    assert await drain(cancelled) == []
    for name, finished in (("finished", stream), ("cancelled", cancelled)):
        try:
            assert await asyncio.wait_for(drain(finished), 1.0) == []
        except TimeoutError:
            pytest.fail(f"iterating a {name} stream again blocks forever")
    stream.cancel()  # a no-op now
    with pytest.raises(StreamClosedError):
        stream.push_text("more")


# ---- metrics


async def test_metrics_and_prometheus(make_engine) -> None:
    engine = make_engine()
    floor = voice_pages(engine)
    m = engine.metrics()
    for key in (
        "kv_pages_in_use",
        "kv_pages_total",
        "kv_row_contexts_bytes",
        "active_requests",
        "decoder_states_in_use",
        "prefill_batch_mean",
        "generate_batch_mean",
        "decode_batch_mean",
    ):
        assert key in m, key
    assert m["kv_pages_total"] == 512 and m["kv_pages_in_use"] == floor
    await asyncio.gather(
        *[run_request(engine, TEXTS[i % 4], None, options(i, max_frames=5)) for i in range(4)]
    )
    await wait_idle(engine, floor)
    m = engine.metrics()
    for stage in ("prefill", "generate", "decode"):
        assert m[f"{stage}_batches"] > 0, m
    # Four requests of five frames each started together: the AR steps were shared.
    assert m["generate_batch_mean"] > 1.0, m
    assert m["generate_batches"] < 4 * 5, m
    assert m["requests_completed"] == 4
    # The AR rows' dense contexts: reserved for every row, memory counted as far as written:
    # every row's up to ROW_CONTEXT_FAULT_IN_POSITIONS at start, and past that as far as the rows'
    # contexts reached (in runs of 64 positions), every layer's keys and values.
    contexts = engine.runner.row_contexts
    assert contexts.keys.shape[1] == engine.config.max_active
    assert contexts.capacity >= max(contexts.lengths)
    layers, _, heads, _, dim = contexts.keys.shape
    written = sum(contexts.clean)
    faulted_in = min(ROW_CONTEXT_FAULT_IN_POSITIONS, contexts.capacity)
    assert min(contexts.clean) == faulted_in and max(contexts.lengths) <= max(contexts.clean)
    assert written <= engine.config.max_active * faulted_in + 4 * 64
    element = contexts.keys.element_size()
    assert m["kv_row_contexts_bytes"] == 2 * layers * heads * dim * element * written

    families = {f.name: f for f in text_string_to_metric_families(engine.prometheus().decode())}
    assert "intone_kv_pages_in_use" in families
    (sample,) = families["intone_kv_pages_in_use"].samples
    assert sample.value == floor
    assert "intone_kv_pages_total" in families and "intone_active_requests" in families
