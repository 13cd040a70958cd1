"""The voice cache: many voices, a budget for a few of them in the KV pool, LRU eviction of idle
ones and loading again on demand, with every stream's audio equal to the single path."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from intone.engine import Engine, EngineConfig, UnknownVoiceError
from intone.engine.loading import LoadedModel, load_model
from intone.engine.voices import Voice, save_voice_state, voice_state_length

from support.voices import (
    BUDGET_VOICES,
    TEXT,
    TIMEOUT,
    VOICES,
    assert_same,
    options,
    single_path,
    variant,
)


@pytest.fixture(scope="module")
def stored(tiny_voice: Voice, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("stored-voices")
    files = {}
    for index in range(VOICES):
        voice = variant(tiny_voice, index)
        files[voice.name] = directory / f"{voice.name}.safetensors"
        save_voice_state(voice, files[voice.name])
    return files


async def speak(engine: Engine, voice: str, seed: int) -> np.ndarray:
    stream = engine.stream(voice, options(seed))
    stream.push_text(TEXT)
    stream.end_input()
    async with asyncio.timeout(TIMEOUT):
        chunks = [chunk async for chunk in stream.audio()]
    return np.concatenate(chunks)


async def wait_settled(engine: Engine) -> None:
    """No request left, and only resident voices' pages in use."""
    for _ in range(500):
        m = engine.metrics()
        settled = m["active_requests"] == 0 and m["kv_pages_in_use"] == m["voice_pages"]
        if settled and engine.blocks.reserved == 0:
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"engine not settled: {engine.metrics()}")


async def test_hundred_voices_with_a_budget_for_ten(
    tiny_checkpoint: Path, tiny_model: LoadedModel, tiny_voice: Voice, stored: dict[str, Path]
) -> None:
    loaded = load_model(tiny_checkpoint)
    page_bytes = loaded.model.flow_lm.new_kv_pool(0, device="cpu").slot_bytes * 16
    pages = -(-tiny_voice.length // 16)  # the longest variant's pages (page_size 16)
    budget_mb = BUDGET_VOICES * pages * page_bytes / 2**20
    engine = Engine(
        loaded, EngineConfig(dtype="float32", num_pages=1024, voice_cache_mb=budget_mb)
    ).start()
    assert engine.scheduler.voices.page_bytes == page_bytes
    try:
        for name, path in stored.items():
            engine.add_voice(name, path, lazy=True)
        m = engine.metrics()
        assert m["voices_registered"] == VOICES + 1  # and the default voice
        assert m["voices_resident"] <= 1  # lazily registered: nothing read but headers

        # Every voice at once: voices in use stay resident past the budget.
        names = list(stored)
        seeds = {name: index for index, name in enumerate(names)}
        audio = await asyncio.gather(*(speak(engine, name, seeds[name]) for name in names))
        for name, got in zip(names, audio, strict=True):
            voice = variant(tiny_voice, seeds[name])
            assert_same(got, single_path(tiny_model, voice, seeds[name]), name)
        await wait_settled(engine)
        m = engine.metrics()
        assert m["voice_pages"] * page_bytes <= budget_mb * 2**20  # idle again: back in budget
        assert m["voices_resident"] <= 2 * BUDGET_VOICES  # the budget is bytes: short ones fit more
        assert m["voice_evictions"] >= VOICES - BUDGET_VOICES

        # One by one, oldest first: each was evicted and is loaded again for its stream.
        loads = m["voice_loads"]
        for name in names[:20]:
            got = await speak(engine, name, seeds[name] + 1000)
            voice = variant(tiny_voice, seeds[name])
            assert_same(got, single_path(tiny_model, voice, seeds[name] + 1000), f"{name} again")
        await wait_settled(engine)
        m = engine.metrics()
        assert m["voice_loads"] >= loads + 20
        assert m["voice_pages"] * page_bytes <= budget_mb * 2**20
        assert engine.health().ok
    finally:
        engine.close()


async def test_removing_a_voice_in_use_lets_its_streams_finish(
    tiny_checkpoint: Path, tiny_model: LoadedModel, tiny_voice: Voice, stored: dict[str, Path]
) -> None:
    engine = Engine(load_model(tiny_checkpoint), EngineConfig(dtype="float32")).start()
    try:
        engine.add_voice("v3", stored["v3"])
        floor = engine.metrics()["kv_pages_in_use"]
        stream = engine.stream("v3", options(7))
        assert engine.remove_voice("v3")
        assert "v3" not in engine.voices
        with pytest.raises(UnknownVoiceError):
            engine.stream("v3", options(7))
        stream.push_text(TEXT)
        stream.end_input()
        async with asyncio.timeout(TIMEOUT):
            got = np.concatenate([chunk async for chunk in stream.audio()])
        assert_same(got, single_path(tiny_model, variant(tiny_voice, 3), 7), "removed in use")
        await wait_settled(engine)
        # Its pages went back with its last stream.
        voice_pages = -(-variant(tiny_voice, 3).length // 16)
        assert engine.metrics()["kv_pages_in_use"] == floor - voice_pages
        assert not engine.remove_voice("v3")
        with pytest.raises(ValueError, match="default voice"):
            engine.remove_voice("default")
    finally:
        engine.close()


def test_voice_state_length_reads_the_header_only(
    tiny_model: LoadedModel, tiny_voice: Voice, stored: dict[str, Path], tmp_path: Path
) -> None:
    assert voice_state_length(tiny_model.model, stored["v4"]) == tiny_voice.length - 4
    (tmp_path / "junk.safetensors").write_bytes(b"not a voice")
    with pytest.raises(ValueError, match="cannot read"):
        voice_state_length(tiny_model.model, tmp_path / "junk.safetensors")


def test_voice_cache_budget_is_validated() -> None:
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="voice_cache_mb"):
            EngineConfig(voice_cache_mb=bad).validate()


async def test_idle_voices_make_room_when_the_pool_is_short(
    tiny_checkpoint: Path, tiny_model: LoadedModel, tiny_voice: Voice, stored: dict[str, Path]
) -> None:
    """A budget far above the pool: the pool runs short first, and idle voices give their pages
    to the next voice and to clauses."""
    engine = Engine(
        load_model(tiny_checkpoint),
        EngineConfig(dtype="float32", num_pages=16, voice_cache_mb=1024.0),
    ).start()
    try:
        names = list(stored)[:12]  # 2-3 pages each: the pool holds a few at a time
        for name in names:
            engine.add_voice(name, stored[name], lazy=True)
        for index, name in enumerate(names):
            got = await speak(engine, name, index)
            assert_same(got, single_path(tiny_model, variant(tiny_voice, index), index), name)
        await wait_settled(engine)
        m = engine.metrics()
        assert m["voice_evictions"] > 0 and m["voices_resident"] < len(names)
        assert engine.health().ok
    finally:
        engine.close()


async def test_a_voice_removed_in_use_and_added_again_lazily(
    tiny_checkpoint: Path, tiny_model: LoadedModel, tiny_voice: Voice, stored: dict[str, Path]
) -> None:
    """The streams of a removed voice speak their next clauses with a voice added again under
    its name: it is written into the pool at once, not lazily."""
    engine = Engine(load_model(tiny_checkpoint), EngineConfig(dtype="float32")).start()
    try:
        engine.add_voice("v", stored["v1"])
        stream = engine.stream("v", options(2))
        engine.remove_voice("v")
        engine.add_voice("v", stored["v1"], lazy=True)
        assert engine.scheduler.voices["v"].table is not None  # in use: resident
        stream.push_text(TEXT)
        stream.end_input()
        async with asyncio.timeout(TIMEOUT):
            got = np.concatenate([chunk async for chunk in stream.audio()])
        assert_same(got, single_path(tiny_model, variant(tiny_voice, 1), 2), "added again")
        await wait_settled(engine)
    finally:
        engine.close()


async def test_an_audio_voice_comes_back_without_encoding_again(
    tiny_checkpoint: Path, tiny_model: LoadedModel, tiny_voice: Voice, tmp_path: Path
) -> None:
    """Evicted, a voice registered from audio comes back from its prompt kept in host memory:
    its file may be gone, and nothing is encoded again."""
    wav = tmp_path / "me.wav"
    wav.write_bytes((tiny_checkpoint / "voices" / "default.wav").read_bytes())
    engine = Engine(
        load_model(tiny_checkpoint), EngineConfig(dtype="float32", voice_cache_mb=0.0)
    ).start()
    try:
        engine.add_voice("me", wav)
        wav.unlink()
        for seed in (1, 2):
            assert engine.scheduler.voices["me"].table is None  # evicted while idle
            got = await speak(engine, "me", seed)
            assert_same(got, single_path(tiny_model, tiny_voice, seed), f"seed {seed}")
            await wait_settled(engine)
    finally:
        engine.close()
