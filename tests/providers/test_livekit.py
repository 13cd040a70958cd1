"""The LiveKit plugin with the real framework, offline: AgentSessions with a fake LLM and an audio
output that plays in real time, several job-like threads sharing one engine, errors, load, and
remote mode against an in-process `intone serve`.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from livekit import rtc
from livekit.agents import (
    Agent,
    AgentSession,
    APIConnectionError,
    APIConnectOptions,
    APIStatusError,
    APITimeoutError,
    Plugin,
    llm,
    tts,
)
from livekit.agents.types import (
    DEFAULT_API_CONNECT_OPTIONS,
    USERDATA_TIMED_TRANSCRIPT,
    TimedString,
)
from livekit.agents.utils import aio
from livekit.agents.voice import io
from livekit.agents.voice.transcription import TranscriptSynchronizer
from livekit.plugins import intone
from livekit.plugins.intone.tts import Framer

from intone.engine import Engine, EngineConfig, InvalidOptionError
from intone.engine.audio import to_pcm16
from intone.provider import registry
from intone.provider.server import create_app
from intone.provider.voices import bytes_voice_name

from support.engine import batched_steps, idle
from support.server import serving

# Clauses of a fixed length (random weights never hit EOS at this threshold): short, known audio.
FAST = {"eos_threshold": 1e9, "max_frames": 8}
NO_RETRY = APIConnectOptions(max_retry=0, timeout=5.0)
FRAME_SECONDS = 0.08  # one Mimi frame at 12.5 Hz
# A turn that keeps its batch slot for a while: a clause of up to 32 s, generated at playback
# pace. (A turn waiting for text holds no slot: only one generating does.)
LONG = {"eos_threshold": 1e9, "max_frames": 400}


# ---- framework pieces: a fake LLM and a real-time audio sink


class FakeLLM(llm.LLM):
    """Streams a fixed reply token by token, `delay` seconds apart."""

    def __init__(self, reply: str, delay: float = 0.01):
        super().__init__()
        self.reply = reply
        self.delay = delay

    def chat(
        self,
        *,
        chat_ctx: llm.ChatContext,
        tools: list | None = None,
        conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS,
        **kwargs: object,
    ) -> FakeLLMStream:
        return FakeLLMStream(self, chat_ctx=chat_ctx, tools=tools or [], conn_options=conn_options)


class FakeLLMStream(llm.LLMStream):
    async def _run(self) -> None:
        fake: FakeLLM = self._llm  # type: ignore[assignment]
        for i, word in enumerate(fake.reply.split(" ")):
            await asyncio.sleep(fake.delay)
            delta = llm.ChoiceDelta(role="assistant", content=word if i == 0 else " " + word)
            self._event_ch.send_nowait(llm.ChatChunk(id="fake", delta=delta))


class RealtimeAudioOutput(io.AudioOutput):
    """Plays what it is given at wall-clock speed (like a room track) and records it."""

    def __init__(self) -> None:
        super().__init__(label="RealtimeTest", capabilities=io.AudioOutputCapabilities(pause=False))
        self.frames: list[rtc.AudioFrame] = []
        self.played: list[tuple[bool, float]] = []  # (interrupted, position) per segment
        self.cleared = 0
        self.first_frame_at: float | None = None
        self._segment = 0.0
        self._started_at: float | None = None
        self._interrupted: asyncio.Event | None = None
        self._playout: asyncio.Task | None = None

    @property
    def captured_seconds(self) -> float:
        return sum(f.duration for f in self.frames)

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        if self._started_at is None:
            self._started_at = time.monotonic()
            self.first_frame_at = self.first_frame_at or self._started_at
            self._interrupted = asyncio.Event()
            self.on_playback_started(created_at=time.time())
        self._segment += frame.duration
        self.frames.append(frame)

    def flush(self) -> None:
        super().flush()
        if self._started_at is not None and self._playout is None:
            self._playout = asyncio.create_task(self._play_out())

    def clear_buffer(self) -> None:
        self.cleared += 1
        if self._interrupted is not None:
            self._interrupted.set()
            if self._playout is None and self._started_at is not None:
                self._playout = asyncio.create_task(self._play_out())

    async def _play_out(self) -> None:
        assert self._started_at is not None and self._interrupted is not None
        remaining = self._started_at + self._segment - time.monotonic()
        try:
            await asyncio.wait_for(self._interrupted.wait(), max(0.0, remaining))
            interrupted = True
        except TimeoutError:
            interrupted = False
        position = min(self._segment, time.monotonic() - self._started_at)
        self.played.append((interrupted, position))
        self._segment, self._started_at, self._playout = 0.0, None, None
        self.on_playback_finished(playback_position=position, interrupted=interrupted)


async def start_session(tts: intone.TTS, reply: str = "Hi.", delay: float = 0.01):
    session = AgentSession(llm=FakeLLM(reply, delay), tts=tts)
    output = RealtimeAudioOutput()
    session.output.audio = output
    await session.start(agent=Agent(instructions="You are a test."))
    return session, output


async def wait_until(condition, timeout: float = 5.0, interval: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)


# ---- fixtures


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path):
    """The module's shared engine of the tiny checkpoint, pinned as a worker's prewarm pins it."""
    engine = intone.prewarm(str(tiny_checkpoint))
    yield engine
    registry.shutdown()


@pytest.fixture(scope="module")
def server_url(engine: Engine):
    """`intone serve`'s app over the module's engine (so the tests can watch the engine the
    server uses)."""
    with serving(create_app(engine)) as url:
        yield url


@pytest.fixture
def pages_at_idle(engine: Engine) -> int:
    assert engine.is_idle()
    return engine.metrics()["kv_pages_in_use"]  # the voice prefixes


# ---- tests


def test_plugin_is_registered_and_streams(tiny_checkpoint: Path):
    assert any(type(p).__name__ == "IntonePlugin" for p in Plugin.registered_plugins)
    tts = intone.TTS(model=tiny_checkpoint)
    assert tts.capabilities.streaming
    assert (tts.sample_rate, tts.num_channels) == (24000, 1)
    assert tts.provider == "intone"


def test_prewarm_outside_a_loop_loads_the_shared_engine(engine: Engine, tiny_checkpoint: Path):
    tts = intone.TTS(model=tiny_checkpoint)
    tts.prewarm()  # as in a worker's setup function: blocks until ready
    assert tts.engine is engine
    assert engine.metrics()["decode_batches"] > 0  # warmed up
    asyncio.run(tts.aclose())
    assert engine in registry.engines()  # pinned: closing the instance keeps it


async def test_say_and_run_speak_in_real_time(engine: Engine, tiny_checkpoint: Path):
    tts = intone.TTS(model=tiny_checkpoint, **FAST)
    metrics = []
    tts.on("metrics_collected", metrics.append)
    reply = "Sure thing, here is my answer. It has two sentences."
    session, output = await start_session(tts, reply)
    completed = engine.metrics()["requests_completed"]

    started = time.monotonic()
    await session.say("Hello there. This is intone speaking.")
    said = output.captured_seconds
    assert said > 0
    # Played at wall-clock speed: the handle completes once the audio has played out.
    assert time.monotonic() - started >= said * 0.9
    assert output.played[-1] == (False, pytest.approx(said, abs=0.05))

    result = session.run(user_input="What do you say?")
    await result
    assert output.captured_seconds > said
    assert engine.metrics()["requests_completed"] == completed + 2

    frame = output.frames[0]
    assert (frame.sample_rate, frame.num_channels) == (24000, 1)
    assert np.frombuffer(frame.data, dtype=np.int16).size == frame.samples_per_channel
    assert len(metrics) == 2 and all(m.ttfb > 0 and m.streamed for m in metrics)
    assert metrics[1].characters_count == len(reply)
    await session.aclose()
    await tts.aclose()


async def test_barge_in_stops_audio_and_frees_the_engine(
    engine: Engine, tiny_checkpoint: Path, pages_at_idle: int
):
    tts = intone.TTS(model=tiny_checkpoint, **FAST)
    # A slow LLM keeps the turn's engine request open while its first clauses play.
    reply = " ".join(["This reply goes on for quite a while, clause after clause."] * 6)
    session, output = await start_session(tts, reply, delay=0.04)
    cancelled = engine.metrics()["requests_cancelled"]

    handle = session.generate_reply(user_input="Talk to me.")
    await wait_until(lambda: output.first_frame_at is not None)
    await asyncio.sleep(0.3)
    # Mid-utterance: the turn's request is open (generating, or parked waiting for the LLM's
    # next clause, which holds no batch slot).
    assert engine.metrics()["streams_open"] == 1
    await session.interrupt()
    await handle
    assert handle.interrupted

    await wait_until(lambda: idle(engine, pages_at_idle), timeout=2.0)
    assert engine.metrics()["requests_cancelled"] == cancelled + 1
    assert output.cleared >= 1 and output.played[-1][0]  # playback stopped as interrupted
    heard = output.captured_seconds
    await asyncio.sleep(0.5)
    assert output.captured_seconds == heard  # no audio after the barge-in
    assert heard < 10 * FRAME_SECONDS * 8  # far less than the whole reply
    await session.aclose()
    await tts.aclose()


def test_thread_executor_jobs_share_one_engine_and_batch(engine: Engine, tiny_checkpoint: Path):
    """What JobExecutorType.THREAD does: each job on its own thread, event loop and session."""
    jobs = 3
    barrier = threading.Barrier(jobs)
    results: dict[int, dict] = {}
    before = batched_steps(engine)

    async def job(index: int) -> None:
        tts = intone.TTS(model=tiny_checkpoint, **FAST)
        session, output = await start_session(tts)
        await asyncio.to_thread(barrier.wait)  # all sessions speak at once
        await session.say(f"Session {index} says hello. It shares the engine with the others.")
        results[index] = {"engine": tts.engine, "seconds": output.captured_seconds}
        await session.aclose()
        await tts.aclose()

    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            asyncio.run(job(index))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert len(results) == jobs
    assert all(r["engine"] is engine for r in results.values())
    assert all(r["seconds"] > 0 for r in results.values())
    assert batched_steps(engine) > before  # the sessions' requests ran in the same AR steps
    assert engine.is_idle()


async def test_aclose_on_one_instance_leaves_the_others_working(tiny_checkpoint: Path, tmp_path):
    # A copy is another model key: an engine of its own, not pinned, so counting shows.
    model = shutil.copytree(tiny_checkpoint, tmp_path / "copy")
    first, second = intone.TTS(model=model, **FAST), intone.TTS(model=model, **FAST)
    await first.synthesize("One.").collect()
    await second.synthesize("Two.").collect()
    assert first.engine is second.engine
    assert registry.users(model) == 2

    await first.aclose()
    assert registry.users(model) == 1
    frame = await second.synthesize("Still here.").collect()
    assert frame.duration > 0
    with pytest.raises(APIConnectionError):
        await first.synthesize("Closed.", conn_options=NO_RETRY).collect()

    engine = second.engine
    await second.aclose()
    assert registry.users(model) == 0 and engine not in registry.engines()


async def test_load_fnc_reflects_engine_occupancy(engine: Engine, tiny_checkpoint: Path):
    assert intone.load_fnc() == 0.0
    tts = intone.TTS(model=tiny_checkpoint, **LONG)
    streams = [tts.stream() for _ in range(4)]
    for stream in streams:
        stream.push_text("An open turn that speaks a long clause, then waits for more text")
    await wait_until(lambda: intone.load_fnc() == 4 / engine.config.max_active)
    for stream in streams:
        await stream.aclose()
    await wait_until(lambda: intone.load_fnc() == 0.0)
    await tts.aclose()


async def test_load_is_full_when_every_slot_is_taken(tiny_checkpoint: Path, tmp_path):
    model = shutil.copytree(tiny_checkpoint, tmp_path / "two-slots")
    tts = intone.TTS(model=model, engine_config=EngineConfig(max_active=2), **LONG)
    streams = [tts.stream() for _ in range(3)]  # two generate, one waits for a slot
    for stream in streams:
        stream.push_text("A long clause that keeps its slot, then waiting for more text")
    await wait_until(lambda: tts.engine is not None and registry.occupancy(tts.engine) == 1.0)
    assert intone.load_fnc() == 1.0
    for stream in streams:
        await stream.aclose()
    await tts.aclose()
    # The engine frees the closed turns' slots on its own threads, a moment later.
    await wait_until(lambda: intone.load_fnc() == 0.0)


async def test_errors_map_to_api_errors(tiny_model):
    # "hold": the open turn's long clause keeps the one slot (it waits for its listener).
    config = EngineConfig(max_active=1, max_queued=1, pacing="hold")
    engine = Engine(tiny_model, config).start()
    try:
        tts = intone.TTS(engine=engine, **FAST)
        errors = []
        tts.on("error", errors.append)

        # A bad request: not retried, reported as unrecoverable.
        with pytest.raises(APIStatusError) as bad_voice:
            await intone.TTS(engine=engine, voice="nobody").synthesize("Hi.").collect()
        assert bad_voice.value.status_code == 400 and not bad_voice.value.retryable

        # The one batch slot taken by an open turn: the next request waits in the queue
        # and times out; the one after finds the queue full.
        holder = intone.TTS(engine=engine, **LONG).stream()
        holder.push_text("This open turn has a first clause, and then it waits")
        await wait_until(lambda: engine.metrics()["active_requests"] == 1)
        queued = tts.stream(conn_options=APIConnectOptions(max_retry=0, timeout=0.5))
        queued.push_text("Queued.")
        queued.end_input()
        with pytest.raises(APITimeoutError):
            async for _ in queued:
                pass
        assert errors and not errors[-1].recoverable
        await wait_until(lambda: engine.metrics()["queued_requests"] == 0)
        waiting = engine.stream()  # with text, it occupies the queue's one place
        waiting.push_text("Hello there.")
        waiting.flush()
        with pytest.raises(APIStatusError) as full:
            await tts.synthesize("Full.", conn_options=NO_RETRY).collect()
        assert full.value.status_code == 503 and full.value.retryable
        waiting.cancel()
        await holder.aclose()
        await queued.aclose()
    finally:
        engine.close()

    # A stopped engine.
    with pytest.raises(APIConnectionError):
        await intone.TTS(engine=engine).synthesize("Hi.", conn_options=NO_RETRY).collect()


async def test_timeout_spares_a_slow_llm(engine: Engine, tiny_checkpoint: Path):
    """The timeout guards the engine, not the LLM: a pause mid-clause before the input ends is
    the LLM's, so it does not fail the stream."""
    tts = intone.TTS(model=tiny_checkpoint, **FAST)
    stream = tts.stream(conn_options=APIConnectOptions(max_retry=0, timeout=0.3))
    stream.push_text("Well")
    await asyncio.sleep(0.8)  # more than the timeout, with no clause complete
    stream.push_text(", here is the rest of it.")
    stream.end_input()
    frames = [event.frame async for event in stream]
    assert sum(f.duration for f in frames) > 0
    await stream.aclose()
    await tts.aclose()


async def test_synthesize_and_resampling(engine: Engine, tiny_checkpoint: Path):
    tts = intone.TTS(model=tiny_checkpoint, **FAST)
    frame = await tts.synthesize("Hello there. A second clause.").collect()
    assert (frame.sample_rate, frame.num_channels) == (24000, 1)
    assert frame.duration == pytest.approx(2 * 8 * FRAME_SECONDS, abs=0.02)

    narrow = intone.TTS(model=tiny_checkpoint, sample_rate=16000, **FAST)
    frame = await narrow.synthesize("Hello there. A second clause.").collect()
    assert frame.sample_rate == 16000
    # The resampler's tail is too short for a frame of its own: the framer pads it with silence
    # to LiveKit's shortest frame (51 ms), rather than hold audio back all along.
    assert 2 * 8 * FRAME_SECONDS - 0.02 < frame.duration < 2 * 8 * FRAME_SECONDS + 0.051
    await tts.aclose()
    await narrow.aclose()


async def test_update_options_applies_to_new_streams(engine: Engine, tiny_checkpoint: Path):
    tts = intone.TTS(model=tiny_checkpoint, **FAST)
    before = tts.stream()
    wav = str(tiny_checkpoint / "voices" / "default.wav")
    tts.update_options(voice=wav, max_frames=4)
    after = tts.stream()
    assert before._opts.voice is None and before._opts.max_frames == 8
    assert after._opts.voice == wav and after._opts.max_frames == 4
    await before.aclose()
    await after.aclose()
    # A voice file the engine has not seen is added on first use.
    frame = await tts.synthesize("A new voice.").collect()
    assert wav in engine.voices
    assert frame.duration == pytest.approx(4 * FRAME_SECONDS, abs=0.02)
    await tts.aclose()


async def test_bad_options_are_refused_where_they_are_set(engine: Engine, tiny_checkpoint: Path):
    """A bad setting raises at TTS() or update_options(), and leaves the options as they were,
    instead of failing every later turn."""
    with pytest.raises(InvalidOptionError, match="speed"):
        intone.TTS(model=tiny_checkpoint, speed=5)
    tts = intone.TTS(model=tiny_checkpoint, **FAST)
    # Each with a good max_frames=4 beside it: the update is refused whole.
    for name, bad in (
        ("speed", 5),
        ("seed", 10**400),
        ("temperature", "hot"),
        ("chain_frames", -1),
    ):
        with pytest.raises(InvalidOptionError, match=name):
            tts.update_options(max_frames=4, **{name: bad})
    frame = await tts.synthesize("Hello there.").collect()
    assert frame.duration == pytest.approx(8 * FRAME_SECONDS, abs=0.02)  # FAST's max_frames
    await tts.aclose()


@pytest.mark.parametrize("remote", [False, True])
async def test_first_clause_policy_is_an_option(
    engine: Engine, tiny_checkpoint: Path, server_url: str, remote: bool
):
    """`first_clause_min_words` decides how the turn is cut, in-process and remote (the
    server's `start.options`): every clause is 8 frames here, so the audio counts the clauses."""
    text = "Hmm, I do not see that booking here. Could you spell it?"
    where = {"base_url": server_url} if remote else {"model": tiny_checkpoint}
    tts = intone.TTS(**where, first_clause_min_words=1, first_clause_max_wait_ms=10_000, **FAST)
    clauses = {}
    for words in (1, 5):
        if words != 1:
            tts.update_options(first_clause_min_words=words)
        stream = tts.stream()
        for i, word in enumerate(text.split(" ")):
            stream.push_text(word if i == 0 else " " + word)
        stream.end_input()
        seconds = sum([event.frame.duration async for event in stream])
        clauses[words] = round(seconds / (8 * FRAME_SECONDS))
        await stream.aclose()
    assert clauses == {1: 3, 5: 2}  # "Hmm," | ... against "Hmm, I do not see that booking here."
    with pytest.raises(InvalidOptionError, match="first_clause_min_words"):
        tts.update_options(first_clause_min_words=0)
    with pytest.raises(InvalidOptionError, match="first_clause_max_wait_ms"):
        intone.TTS(**where, first_clause_max_wait_ms=10_001)
    await tts.aclose()


async def test_a_refused_piece_of_text_is_dropped_and_the_turn_speaks_on(
    engine: Engine, tiny_checkpoint: Path, caplog: pytest.LogCaptureFixture
):
    """Half of a split UTF-16 pair from an LLM is dropped (as the server drops a `text` it
    refuses), not the whole turn."""
    tts = intone.TTS(model=tiny_checkpoint, **FAST)

    async def spoken(pieces: list[str]) -> float:
        stream = tts.stream()
        for piece in pieces:
            stream.push_text(piece)
        stream.end_input()
        seconds = sum([event.frame.duration async for event in stream])
        await stream.aclose()
        return seconds

    clean = await spoken(["Hello there, ", "my good friend. ", "How are you?"])
    assert clean > 0
    assert await spoken(["Hello there, ", "\ud83d", "my good friend. ", "How are you?"]) == clean
    assert "lone surrogate" in caplog.text
    await tts.aclose()


async def test_remote_mode_speaks_through_intone_serve(engine: Engine, server_url: str):
    tts = intone.TTS(base_url=server_url, **FAST)
    assert tts.engine is None
    session, output = await start_session(tts, "A remote reply. It comes over a WebSocket.")
    completed = engine.metrics()["requests_completed"]
    await session.say("Hello from the server.")
    said = output.captured_seconds
    assert said == pytest.approx(8 * FRAME_SECONDS, abs=0.05)  # one clause
    await session.run(user_input="And now?")
    assert output.captured_seconds > said
    assert engine.metrics()["requests_completed"] == completed + 2
    frame = output.frames[0]
    assert (frame.sample_rate, frame.num_channels) == (24000, 1)
    # The server's name for itself and its model, from its hello.
    assert tts.provider == "intone"
    assert tts.model != server_url and tts.model in engine.loaded.source  # the checkpoint's name
    # Word timing over the protocol: the words ride on the frames as TimedStrings.
    timed = [w for f in output.frames for w in f.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]
    assert [w.strip() for w in timed][:3] == ["Hello", "from", "the"]
    await session.aclose()
    await tts.aclose()


async def test_remote_barge_in_frees_the_server_engine(
    engine: Engine, server_url: str, pages_at_idle: int
):
    tts = intone.TTS(base_url=server_url, sample_rate=16000, **FAST)
    reply = " ".join(["This reply goes on for quite a while, clause after clause."] * 6)
    session, output = await start_session(tts, reply, delay=0.04)
    cancelled = engine.metrics()["requests_cancelled"]
    handle = session.generate_reply(user_input="Talk to me.")
    await wait_until(lambda: output.first_frame_at is not None)
    assert output.frames[0].sample_rate == 16000  # resampled by the server
    await asyncio.sleep(0.3)
    await session.interrupt()
    await handle
    assert handle.interrupted
    await wait_until(lambda: idle(engine, pages_at_idle), timeout=2.0)
    assert engine.metrics()["requests_cancelled"] == cancelled + 1
    heard = output.captured_seconds
    await asyncio.sleep(0.5)
    assert output.captured_seconds == heard
    await session.aclose()
    await tts.aclose()


async def test_remote_errors_map_to_api_errors(server_url: str):
    with pytest.raises(APIStatusError) as bad_voice:
        await intone.TTS(base_url=server_url, voice="nobody").synthesize("Hi.").collect()
    assert bad_voice.value.status_code == 400 and not bad_voice.value.retryable

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a port nothing listens on
    port = sock.getsockname()[1]
    sock.close()
    down = intone.TTS(base_url=f"ws://127.0.0.1:{port}")
    with pytest.raises(APIConnectionError):
        await down.synthesize("Hi.", conn_options=NO_RETRY).collect()


async def test_example_agent_speaks_offline(
    engine: Engine, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
):
    """agents_examples/livekit_agent.py: its server settings, and its session without OpenAI."""
    monkeypatch.setenv("INTONE_MODEL", str(tiny_checkpoint))
    monkeypatch.delenv("INTONE_URL", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    example = load_example("livekit_agent")
    assert example.server.load_fnc is intone.load_fnc
    assert example.server.setup_fnc is example.prewarm

    session = example.make_session()
    assert session.tts.engine is None or session.tts.engine is engine
    output = RealtimeAudioOutput()
    session.output.audio = output
    await session.start(agent=example.Assistant())  # greets on enter
    await wait_until(lambda: output.played, timeout=20)
    greeted = output.captured_seconds
    assert greeted > 0 and session.tts.engine is engine
    await session.run(user_input="Testing one two.")
    assert output.captured_seconds > greeted
    await session.aclose()
    await session.tts.aclose()


def load_example(name: str):
    import importlib.util

    path = Path(__file__).parents[2] / "agents_examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- word timing through LiveKit's transcript synchronizer


class RecordingTextOutput(io.TextOutput):
    """The transcription sink at the end of the chain (a room's transcription track)."""

    def __init__(self) -> None:
        super().__init__(label="RecordingText", next_in_chain=None)
        self.text = ""

    async def capture_text(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


class TimedAudioOutput(RealtimeAudioOutput):
    """Also records the timed words that ride on the frames (what the plugin sent)."""

    def __init__(self) -> None:
        super().__init__()
        self.timed: list[TimedString] = []

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        self.timed.extend(frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, []))
        await super().capture_frame(frame)


async def test_barge_in_history_holds_the_words_heard(engine: Engine, tiny_checkpoint: Path):
    """As a room with transcription runs it: a TranscriptSynchronizer in the output chain and
    `use_tts_aligned_transcript=True`. After a barge-in the assistant message holds the words
    begun before the played position and none after, from the plugin's word times (LiveKit's
    syllable-rate estimate, which it uses without them, runs ahead of the audio here)."""
    assert intone.TTS(model=tiny_checkpoint).capabilities.aligned_transcript
    # Clauses of 3.2 s for about a dozen words: a speaking rate like speech's, so that every
    # word lasts long enough to tell whether it had begun.
    tts = intone.TTS(model=tiny_checkpoint, eos_threshold=1e9, max_frames=40)
    reply = " ".join(
        ["Here is a long answer with quite a few words in it, spoken clause by clause."] * 4
    )
    session = AgentSession(
        llm=FakeLLM(reply, delay=0.005), tts=tts, use_tts_aligned_transcript=True
    )
    audio = TimedAudioOutput()
    text = RecordingTextOutput()
    sync = TranscriptSynchronizer(next_in_chain_audio=audio, next_in_chain_text=text)
    session.output.audio = sync.audio_output
    session.output.transcription = sync.text_output
    await session.start(agent=Agent(instructions="You are a test."))

    handle = session.generate_reply(user_input="Talk to me.")
    await wait_until(lambda: audio.first_frame_at is not None)
    # A clause's words are timed when the engine has generated the clause, at most `lead_s`
    # ahead of playback, so its first words can reach the synchronizer after they began: right
    # after such a batch the synchronizer is still catching up. Interrupt where the words being
    # played came at least `grace_s` ago, and a known word starts `margin_s` or more later; and
    # past the second clause, whose long words ("clause" lasts over a second) put LiveKit's
    # syllable-rate estimate ahead of the audio.
    grace_s, margin_s, after_s = 0.5, 0.3, 6.4
    arrivals: list[float] = []  # when each timed word reached the output, in playback seconds

    def words_settled() -> bool:
        played = time.monotonic() - audio.first_frame_at
        arrivals.extend([played] * (len(audio.timed) - len(arrivals)))
        playing = [
            a
            for w, a in zip(audio.timed, arrivals, strict=True)
            if w.start_time <= played + margin_s
        ]
        known = max((w.start_time for w in audio.timed), default=0.0)
        settled = bool(playing) and max(playing) <= played - grace_s
        return played > after_s and settled and known >= played + margin_s

    await wait_until(words_settled, timeout=30.0)
    await session.interrupt()
    await handle
    assert handle.interrupted
    await wait_until(lambda: audio.played)
    interrupted, position = audio.played[-1]
    assert interrupted

    messages = [m for m in session.history.items if getattr(m, "role", None) == "assistant"]
    said = messages[-1].text_content.split()
    timed = [(w.strip(), w.start_time, w.end_time) for w in audio.timed if w.strip()]
    assert [w for w, _, _ in timed] == reply.split()[: len(timed)]  # the agent's own words
    started = [w for w, start, _ in timed if start < position]
    assert 3 < len(started) < len(reply.split())  # the barge-in cut the reply
    # No word that had not begun, and every word that had ended a moment before the barge-in
    # (LiveKit's synchronizer commits a word around its end, so the word in progress, or one
    # that ended just before, may be missing).
    commit_lag_s = 0.3
    heard = [w for w, _, end in timed if end <= position - commit_lag_s]
    assert said == started[: len(said)] and len(said) >= len(heard), (
        f"{said=} {started=} {position=}"
    )
    await session.aclose()
    await tts.aclose()


# What LiveKit's AudioEmitter logs (at DEBUG) when it sends the 10 ms it holds back because the
# audio ran out before its estimated playout did: the one non-final frame under 50 ms it makes
# for any plugin, whenever generation falls behind (an LLM stall, a loaded machine).
DELAYED_FLUSH = "flush audio emitter due to slow audio generation"
EMITTER_TAIL_S = 0.01


def delayed_flushes(caplog: pytest.LogCaptureFixture) -> int:
    return sum(record.getMessage() == DELAYED_FLUSH for record in caplog.records)


def assert_livekit_frames(events: list[tts.SynthesizedAudio], flushes: int = 0) -> None:
    """LiveKit's own check (tests/test_tts.py in livekit/agents, `_do_stream`): one request id,
    per segment only the last frame final, non-final frames strictly 50-250 ms, the final one
    non-empty and under 250 ms; except the emitter's own 10 ms tails, one per delayed flush it
    logged (`DELAYED_FLUSH`)."""
    assert events and events[0].request_id
    assert all(e.request_id == events[0].request_id for e in events)
    assert all(e.segment_id for e in events)
    by_segment: dict[str, list[tts.SynthesizedAudio]] = {}
    for event in events:
        by_segment.setdefault(event.segment_id, []).append(event)
    for segment in by_segment.values():
        *non_final, final = segment
        assert final.is_final and not any(e.is_final for e in non_final)
        assert 0 < final.frame.duration < 0.25
        durations = [e.frame.duration for e in non_final]
        tails = [d for d in durations if d == pytest.approx(EMITTER_TAIL_S)]
        flushes -= len(tails)
        assert flushes >= 0, f"{len(tails)} 10 ms frames without a delayed flush"
        ours = [d for d in durations if d != pytest.approx(EMITTER_TAIL_S)]
        assert all(0.05 < d < 0.25 for d in ours), " ".join(f"{d:.3f}" for d in durations)


@pytest.mark.parametrize("remote", [False, True])
@pytest.mark.parametrize("sample_rate", [24000, 16000])
async def test_streamed_segment_frames_are_50_to_250_ms(
    engine: Engine,
    tiny_checkpoint: Path,
    server_url: str,
    sample_rate: int,
    remote: bool,
    caplog: pytest.LogCaptureFixture,
):
    """As LiveKit's plugin test streams: LLM tokens at 30/s, a flush after each of two segments,
    then end_input (the framework keeps one segment per stream: the flush ends its input). Where
    the audio ran out meanwhile (a clause's text comes after its audio would have played, on a
    loaded machine), LiveKit's emitter itself sends a 10 ms frame: that alone is allowed."""
    caplog.set_level(logging.DEBUG, logger="livekit.agents")
    where = {"base_url": server_url} if remote else {"model": tiny_checkpoint}
    tts_v = intone.TTS(**where, sample_rate=sample_rate, **FAST)
    segments = [
        "Hello there, this is a test of frame sizes. Another sentence follows.",
        "And a second segment, flushed too.",
    ]
    async with tts_v.stream(conn_options=NO_RETRY) as stream:

        async def push() -> None:
            for text in segments:
                for i, word in enumerate(text.split(" ")):
                    stream.push_text(word if i == 0 else " " + word)
                    await asyncio.sleep(1 / 30)
                stream.flush()
            stream.end_input()

        pushing = asyncio.create_task(push())
        events = [event async for event in stream]
        await pushing
    assert len(events) > 3
    assert_livekit_frames(events, delayed_flushes(caplog))
    assert {e.frame.sample_rate for e in events} == {sample_rate}
    await tts_v.aclose()


async def test_an_llm_stall_adds_only_livekits_own_10_ms_frame(
    engine: Engine, tiny_checkpoint: Path, caplog: pytest.LogCaptureFixture
):
    """The LLM stalls mid-reply for longer than the audio made so far (at most 1.28 s here):
    LiveKit's emitter sends the 10 ms it held back when the audio runs out (its delayed flush),
    and every frame of the plugin's own stays 50-250 ms."""
    caplog.set_level(logging.DEBUG, logger="livekit.agents")
    tts_v = intone.TTS(model=tiny_checkpoint, **FAST)
    async with tts_v.stream(conn_options=NO_RETRY) as stream:

        async def push() -> None:
            for words in ("Hello there, this is a test.", " And then it goes on."):
                for word in words.split(" "):
                    stream.push_text(word + " ")
                    await asyncio.sleep(1 / 30)
                await asyncio.sleep(2.5)
            stream.end_input()

        pushing = asyncio.create_task(push())
        events = [event async for event in stream]
        await pushing
    assert delayed_flushes(caplog) >= 1
    assert_livekit_frames(events, delayed_flushes(caplog))
    await tts_v.aclose()


@pytest.mark.parametrize("sample_rate", [24000, 16000, 8000, 44100])
async def test_framer_keeps_every_non_final_frame_within_50_to_250_ms(sample_rate: int):
    """The plugin's framer through LiveKit's real AudioEmitter, for engine deliveries of every
    size (one Mimi frame to several, odd resampled lengths) and every length of the last one."""
    rng = np.random.default_rng(sample_rate)
    frame = sample_rate * 80 // 1000  # one Mimi frame at this rate
    shortest = sample_rate * 61 // 1000 + 1  # the first frame, the emitter's 10 ms included
    for case in range(60):
        sizes = [int(n) for n in rng.integers(1, 5, size=int(rng.integers(2, 12))) * frame]
        sizes = [max(1, n + int(rng.integers(-40, 40))) for n in sizes] if case % 2 else sizes
        tail = int(rng.integers(0, frame))
        rx = aio.Chan[tts.SynthesizedAudio]()
        emitter = tts.AudioEmitter(label="intone-test", dst_ch=rx)
        emitter.initialize(
            request_id="r",
            sample_rate=sample_rate,
            num_channels=1,
            mime_type="audio/pcm",
            stream=True,
        )
        emitter.start_segment(segment_id="s")
        framer = Framer(sample_rate)
        audio = rng.uniform(0.1, 0.5, size=sum(sizes) + tail).astype(np.float32)
        at = 0
        for n in sizes:
            for f in framer.push(audio[at : at + n]):
                emitter.push_frame(f)
            at += n
        for f in framer.finish(audio[at:]):
            emitter.push_frame(f)
        emitter.end_segment()
        emitter.end_input()
        await emitter.join()
        rx.close()
        events = [e async for e in rx]
        assert_livekit_frames(events)
        # Every sample comes out in order, followed by at most a shortest frame of silence.
        out = np.concatenate([np.frombuffer(e.frame.data, dtype=np.int16) for e in events])
        assert out[: len(audio)].tobytes() == to_pcm16(audio)
        assert len(out) - len(audio) < shortest
        assert not out[len(audio) :].any()


@pytest.mark.parametrize("sample_rate", [24000, 16000, 48000])
def test_framer_sends_the_first_mimi_frame_as_it_comes(sample_rate: int):
    """Nothing is held back: one Mimi frame of audio is a frame to send, and so is every one
    after it; time to first audio is not paid for frame sizes."""
    framer = Framer(sample_rate)
    frame = sample_rate * 80 // 1000
    for _ in range(3):
        (sent,) = framer.push(np.full(frame, 0.1, dtype=np.float32))
        assert sent.samples_per_channel == frame


async def test_aclose_closes_streams_in_flight(
    engine: Engine, tiny_checkpoint: Path, pages_at_idle: int
):
    tts = intone.TTS(model=tiny_checkpoint, **FAST)
    stream = tts.stream()
    stream.push_text("This turn is still open, and its engine request with it, ")
    await wait_until(lambda: engine.metrics()["active_requests"] == 1)
    await asyncio.wait_for(tts.aclose(), timeout=5)
    # The engine request was cancelled with the stream: nothing holds the slot or its pages.
    await wait_until(lambda: idle(engine, pages_at_idle), timeout=2.0)


async def test_a_voice_given_as_bytes_in_process_and_remote(
    engine: Engine, tiny_checkpoint: Path, server_url: str
):
    """The bytes of a voice file: registered once in process (by content), uploaded once to a
    server (its id then names it there, and in process over the server's engine)."""
    data = (tiny_checkpoint / "voices" / "default.wav").read_bytes()
    name = bytes_voice_name(data)
    local = intone.TTS(model=tiny_checkpoint, voice=data, **FAST)
    for _ in range(2):
        frame = await local.synthesize("A voice from bytes.").collect()
        assert frame.duration == pytest.approx(8 * FRAME_SECONDS, abs=0.02)
    assert name in engine.voices
    await local.aclose()

    before = set(engine.voices)
    remote = intone.TTS(base_url=server_url, voice=data, **FAST)
    for _ in range(2):
        frame = await remote.synthesize("A voice from bytes.").collect()
        assert frame.duration == pytest.approx(8 * FRAME_SECONDS, abs=0.02)
    uploaded = set(engine.voices) - before
    assert len(uploaded) == 1 and next(iter(uploaded)).startswith("voice_")  # once
    await remote.aclose()

    # A voice stored through the server is a voice of its engine: in process too, by its id.
    stored = intone.TTS(model=tiny_checkpoint, voice=next(iter(uploaded)), **FAST)
    frame = await stored.synthesize("A stored voice.").collect()
    assert frame.duration == pytest.approx(8 * FRAME_SECONDS, abs=0.02)
    await stored.aclose()

    refused = intone.TTS(model=tiny_checkpoint, voice=b"not a voice at all" * 10, **FAST)
    with pytest.raises(APIStatusError) as error:
        await refused.synthesize("Never spoken.").collect()
    assert error.value.status_code == 400 and not error.value.retryable  # bad_audio
    await refused.aclose()
