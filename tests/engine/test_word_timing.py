"""Clause positions and word times in a stream's audio, at speed 1 and time-scaled."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from intone.engine import AudioChunk, ClauseDone, Engine, EngineConfig, GenerationOptions
from intone.engine.loading import load_model
from intone.engine.word_timing import estimate_word_times

NO_EOS = 1e9
TEXT = "It costs $12.50 today, or so they said. Then we leave at 3:45 pm and that is all."


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> Iterator[Engine]:
    engine = Engine(load_model(tiny_checkpoint), EngineConfig(num_pages=512)).start()
    yield engine
    engine.close()


async def run(engine: Engine, text: str, **options) -> list[AudioChunk | ClauseDone]:
    opts = GenerationOptions(temperature=0.0, eos_threshold=NO_EOS, max_frames=10, seed=3)
    for name, value in options.items():
        setattr(opts, name, value)
    opts.validate()
    stream = engine.stream(None, opts)
    stream.push_text(text)
    stream.end_input()
    async with asyncio.timeout(60):
        return [event async for event in stream]


def done_events(events: list) -> list[ClauseDone]:
    return [e for e in events if isinstance(e, ClauseDone)]


def audio_samples(events: list) -> int:
    return sum(len(e.samples) for e in events if isinstance(e, AudioChunk))


async def test_clause_positions_are_exact_and_words_are_the_callers(engine: Engine) -> None:
    events = await run(engine, TEXT)
    starts: dict[int, int] = {}
    lengths: dict[int, int] = {}
    position = 0
    for event in events:
        if isinstance(event, AudioChunk):
            starts.setdefault(event.clause, position)
            lengths[event.clause] = lengths.get(event.clause, 0) + len(event.samples)
            position += len(event.samples)
    done = done_events(events)
    assert len(done) >= 2
    for event in done:
        assert event.start_sample == starts[event.clause]
        assert event.sample_count == lengths[event.clause]
    # Every word the caller sent, as sent ("$12.50" is one word), once, in order.
    assert [w.word for event in done for w in event.words] == TEXT.split()
    rate = engine.sample_rate
    for event in done:
        begin, end = event.start_sample / rate, (event.start_sample + event.sample_count) / rate
        times = [t for w in event.words for t in (w.start, w.end)]
        assert times == sorted(times)
        assert begin == pytest.approx(times[0]) and times[-1] <= end + 1e-9


async def test_speed_scales_audio_and_timing(engine: Engine) -> None:
    normal = await run(engine, TEXT)
    fast = await run(engine, TEXT, speed=2.0)
    assert audio_samples(fast) / audio_samples(normal) == pytest.approx(0.5, rel=0.03)
    # Positions and word times are in the time-scaled audio the caller gets.
    assert sum(e.sample_count for e in done_events(fast)) == pytest.approx(
        audio_samples(fast), rel=0.01
    )
    slow_words = [w for e in done_events(normal) for w in e.words]
    fast_words = [w for e in done_events(fast) for w in e.words]
    assert [w.word for w in fast_words] == [w.word for w in slow_words]
    for a, b in zip(slow_words, fast_words, strict=True):
        assert b.start == pytest.approx(a.start / 2, abs=0.01)
        assert b.end == pytest.approx(a.end / 2, abs=0.01)


def test_word_times_follow_spoken_length_and_punctuation() -> None:
    counts = {"It": 1, "costs": 2, "$12.50,": 8, "ok.": 1}
    words = estimate_word_times("It costs $12.50, ok.", 1.0, 2.4, counts.__getitem__)
    assert [w.word for w in words] == ["It", "costs", "$12.50,", "ok."]
    assert words[0].start == 1.0 and words[-1].end == pytest.approx(3.4)
    # 12 tokens and one comma pause (1 token): 2.4 s / 13 per token.
    unit = 2.4 / 13
    assert words[2].end - words[2].start == pytest.approx(8 * unit)
    assert words[3].start - words[2].end == pytest.approx(unit)  # the pause after the comma
    assert words[1].start == pytest.approx(words[0].end)  # no pause without punctuation
    assert estimate_word_times("", 0.0, 1.0, len) == []
