"""The Pipecat service with the real framework, offline: run_test pipelines with speak frames, LLM
token turns, interruptions, settings updates, batching across pipelines and remote mode against
an in-process `intone serve`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from pipecat.frames.frames import (
    ErrorFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    MetricsFrame,
    OutputAudioRawFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
    TTSUpdateSettingsFrame,
)
from pipecat.metrics.metrics import TTFBMetricsData, TTSUsageMetricsData
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMAssistantAggregator
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TextAggregationMode
from pipecat.tests.utils import SleepFrame, run_test
from pipecat.transports.base_output import BaseOutputTransport
from pipecat.transports.base_transport import TransportParams
from pipecat.utils.errors import ErrorCategory

from intone.engine import Engine, EngineConfig, InvalidOptionError
from intone.provider import registry
from intone.provider.backends import engine_options
from intone.provider.pipecat import IntoneTTSService, IntoneTTSSettings
from intone.provider.server import create_app
from intone.provider.voices import bytes_voice_name

from support.engine import batched_steps, idle
from support.server import serving

FAST_FIELDS = {"eos_threshold": 1e9, "max_frames": 8}
FAST = IntoneTTSService.Settings(**FAST_FIELDS)
CLAUSE_SECONDS = 8 * 0.08  # 8 Mimi frames at 12.5 Hz
# A turn that keeps its batch slot for a while: a clause of up to 32 s, generated at playback
# pace. (A turn waiting for text holds no slot: only one generating does.)
LONG_FIELDS = {"eos_threshold": 1e9, "max_frames": 400}
METRICS = PipelineParams(enable_metrics=True, enable_usage_metrics=True)


def audio(frames: list[Frame]) -> list[TTSAudioRawFrame]:
    return [f for f in frames if isinstance(f, TTSAudioRawFrame)]


def seconds(frames: list[Frame]) -> float:
    return sum(len(f.audio) / 2 / f.sample_rate for f in audio(frames))


def tokens(text: str) -> list[LLMTextFrame]:
    words = text.split(" ")
    return [LLMTextFrame(w if i == 0 else " " + w) for i, w in enumerate(words)]


def metrics_of(frames: list[Frame], kind: type) -> list:
    return [d for f in frames if isinstance(f, MetricsFrame) for d in f.data if isinstance(d, kind)]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path):
    """The process's shared engine of the tiny checkpoint, pinned for the module."""
    engine = registry.prewarm(tiny_checkpoint)
    yield engine
    registry.shutdown()


@pytest.fixture
def pages_at_idle(engine: Engine) -> int:
    assert engine.is_idle()
    return engine.metrics()["kv_pages_in_use"]


@pytest.fixture(scope="module")
def server_url(engine: Engine):
    """`intone serve`'s app over the same engine, so the tests can watch it."""
    with serving(create_app(engine)) as url:
        yield url


def service(tiny_checkpoint: Path, **kwargs) -> IntoneTTSService:
    kwargs.setdefault("settings", FAST)
    return IntoneTTSService(model=tiny_checkpoint, **kwargs)


def test_settings_are_a_tts_settings_dataclass(engine: Engine, tiny_checkpoint: Path):
    tts = service(tiny_checkpoint)
    assert issubclass(IntoneTTSSettings, TTSSettings)
    assert tts._settings.eos_threshold == 1e9 and tts._settings.temperature is None
    assert tts.engine is engine  # loaded once: the process's shared engine
    assert tts._text_aggregation_mode == TextAggregationMode.TOKEN


async def test_speak_frame(engine: Engine, tiny_checkpoint: Path):
    down, up = await run_test(
        service(tiny_checkpoint),
        frames_to_send=[TTSSpeakFrame("Hello there. This is intone speaking.")],
        pipeline_params=METRICS,
    )
    kinds = [type(f) for f in down]
    started, stopped = kinds.index(TTSStartedFrame), kinds.index(TTSStoppedFrame)
    first_audio = kinds.index(TTSAudioRawFrame)
    last_audio = len(kinds) - 1 - kinds[::-1].index(TTSAudioRawFrame)
    assert started < first_audio and last_audio < stopped
    assert kinds.count(TTSStartedFrame) == kinds.count(TTSStoppedFrame) == 1
    assert {(f.sample_rate, f.num_channels) for f in audio(down)} == {(24000, 1)}
    assert seconds(down) == pytest.approx(2 * CLAUSE_SECONDS, abs=0.01)
    assert [d.value > 0 for d in metrics_of(down, TTFBMetricsData) if d.value] == [True]
    assert not [f for f in up if isinstance(f, ErrorFrame)]


async def test_llm_tokens_resampled_to_the_pipeline_rate(engine: Engine, tiny_checkpoint: Path):
    text = "Hello there, how are you doing today? I am a fake language model, streaming tokens."
    completed = engine.metrics()["requests_completed"]
    down, _ = await run_test(
        service(tiny_checkpoint),
        frames_to_send=[LLMFullResponseStartFrame(), *tokens(text), LLMFullResponseEndFrame()],
        pipeline_params=PipelineParams(
            audio_out_sample_rate=16000, enable_metrics=True, enable_usage_metrics=True
        ),
    )
    # One turn, one engine stream, one audio context.
    assert engine.metrics()["requests_completed"] == completed + 1
    kinds = [type(f) for f in down]
    assert kinds.count(TTSStartedFrame) == kinds.count(TTSStoppedFrame) == 1
    assert {f.sample_rate for f in audio(down)} == {16000}
    clauses = round(seconds(down) / CLAUSE_SECONDS)
    assert clauses >= 3 and seconds(down) == pytest.approx(clauses * CLAUSE_SECONDS, abs=0.02)
    assert [d.value for d in metrics_of(down, TTSUsageMetricsData)] == [len(text)]
    assert [d for d in metrics_of(down, TTFBMetricsData) if d.value]
    assert kinds.index(LLMFullResponseEndFrame) > kinds.index(TTSStoppedFrame)
    assert "".join(f.text for f in down if isinstance(f, TTSTextFrame)).replace(" ", "") == (
        text.replace(" ", "")
    )


async def test_interruption_stops_audio_and_frees_the_engine(
    engine: Engine, tiny_checkpoint: Path, pages_at_idle: int
):
    cancelled = engine.metrics()["requests_cancelled"]
    words = tokens(" ".join(["This reply goes on for quite a while, clause after clause."] * 4))
    # The turn never ends: its engine request is still open (waiting for text) when the
    # interruption comes, so only a cancel can free it.
    slow = [frame for word in words[:14] for frame in (word, SleepFrame(0.02))]
    down, _ = await run_test(
        service(tiny_checkpoint),
        frames_to_send=[
            LLMFullResponseStartFrame(),
            *slow,
            SleepFrame(0.3),
            InterruptionFrame(),
            SleepFrame(0.5),
            TTSSpeakFrame("After the interruption."),
        ],
    )
    cut = next(i for i, f in enumerate(down) if isinstance(f, InterruptionFrame))
    before, after = audio(down[:cut]), audio(down[cut:])
    assert before and after
    interrupted = before[0].context_id
    assert all(f.context_id != interrupted for f in after)  # nothing of it after the cut
    assert engine.metrics()["requests_cancelled"] == cancelled + 1
    assert idle(engine, pages_at_idle)
    # The next turn spoke in full.
    assert seconds(down[cut:]) == pytest.approx(CLAUSE_SECONDS, abs=0.01)


async def test_pipelines_share_the_engine_and_batch(engine: Engine, tiny_checkpoint: Path):
    before = batched_steps(engine)
    services = [service(tiny_checkpoint) for _ in range(3)]
    assert all(s.engine is engine for s in services)
    results = await asyncio.gather(
        *(
            run_test(s, frames_to_send=[TTSSpeakFrame(f"Pipeline {i} speaks. All at once.")])
            for i, s in enumerate(services)
        )
    )
    assert all(seconds(down) > 0 for down, _ in results)
    assert batched_steps(engine) > before


async def test_settings_update_applies_to_the_next_turn(engine: Engine, tiny_checkpoint: Path):
    down, _ = await run_test(
        service(tiny_checkpoint),
        frames_to_send=[
            TTSSpeakFrame("First turn."),
            TTSUpdateSettingsFrame(delta=IntoneTTSService.Settings(max_frames=4)),
            TTSSpeakFrame("Second turn."),
        ],
    )
    per_turn: dict[str, float] = {}
    for f in audio(down):
        per_turn[f.context_id] = per_turn.get(f.context_id, 0.0) + len(f.audio) / 2 / 24000
    assert list(per_turn.values()) == [
        pytest.approx(CLAUSE_SECONDS, abs=0.01),
        pytest.approx(CLAUSE_SECONDS / 2, abs=0.01),
    ]


async def test_bad_settings_are_refused_where_they_are_set(engine: Engine, tiny_checkpoint: Path):
    """A bad setting raises at construction; a bad update is refused whole with an error frame,
    and the next turn speaks with the settings it had."""
    with pytest.raises(InvalidOptionError, match="speed"):
        service(tiny_checkpoint, settings=IntoneTTSService.Settings(speed=5))
    down, up = await run_test(
        service(tiny_checkpoint),
        frames_to_send=[
            TTSUpdateSettingsFrame(delta=IntoneTTSService.Settings(max_frames=4, speed=5)),
            TTSSpeakFrame("First turn."),
        ],
    )
    errors = [f for f in up if isinstance(f, ErrorFrame) and "speed" in f.error]
    assert len(errors) == 1
    assert seconds(down) == pytest.approx(CLAUSE_SECONDS, abs=0.01)  # max_frames not applied


async def test_word_timestamps_are_estimated_per_clause(engine: Engine, tiny_checkpoint: Path):
    text = "Hello there, my friend. This is a test of word timing."
    down, _ = await run_test(
        service(tiny_checkpoint, word_timestamps=True),
        frames_to_send=[LLMFullResponseStartFrame(), *tokens(text), LLMFullResponseEndFrame()],
    )
    words = [f for f in down if isinstance(f, TTSTextFrame)]
    assert [w.text.strip() for w in words] == text.split(" ")
    assert all(a.pts <= b.pts for a, b in zip(words, words[1:], strict=False))
    span = (words[-1].pts - words[0].pts) / 1e9
    assert 0 < span < seconds(down)


async def test_unknown_voice_is_reported(engine: Engine, tiny_checkpoint: Path):
    tts = service(tiny_checkpoint, settings=IntoneTTSService.Settings(voice="nobody"))
    text = "Hello there, this turn cannot be spoken in that voice."
    down, up = await run_test(
        tts, frames_to_send=[LLMFullResponseStartFrame(), *tokens(text), LLMFullResponseEndFrame()]
    )
    errors = [f for f in up if isinstance(f, ErrorFrame) and "unknown voice" in f.error]
    assert len(errors) == 1  # once per turn, not once per token
    assert errors[0].category == ErrorCategory.INVALID_REQUEST
    kinds = [type(f) for f in down]
    assert not audio(down)
    assert kinds.count(TTSStartedFrame) == kinds.count(TTSStoppedFrame) == 1


@pytest.mark.parametrize("where", ["engine", "server"])
async def test_a_turn_whose_only_text_is_refused_ends(
    engine: Engine, tiny_checkpoint: Path, server_url: str, pages_at_idle: int, where: str
):
    """A lone surrogate (half a UTF-16 pair) drops its text; when that was all the turn had, the
    turn ends with an error and its TTSStoppedFrame instead of waiting for audio, and the next
    turn speaks."""
    # The wait below is shorter than the stop-frame timeout, which ended the turn before.
    kwargs = {"stop_frame_timeout_s": 60}
    if where == "engine":
        tts = service(tiny_checkpoint, **kwargs)
    else:
        tts = IntoneTTSService(base_url=server_url, **kwargs)
    down, up = await asyncio.wait_for(
        run_test(
            tts,
            frames_to_send=[TTSSpeakFrame("Hi \udcff."), SleepFrame(1), TTSSpeakFrame("Hello.")],
        ),
        30,
    )
    assert [f for f in up if isinstance(f, ErrorFrame) and "no text" in f.error]
    # The first turn stopped before the second started, not when the pipeline ended.
    kinds = [type(f) for f in down if isinstance(f, TTSStartedFrame | TTSStoppedFrame)]
    assert kinds == [TTSStartedFrame, TTSStoppedFrame] * 2
    assert len({f.context_id for f in audio(down)}) == 1  # the second turn spoke
    assert idle(engine, pages_at_idle)


async def test_remote_mode(engine: Engine, server_url: str, pages_at_idle: int):
    tts = IntoneTTSService(base_url=server_url, settings=FAST)
    assert tts.engine is None
    completed = engine.metrics()["requests_completed"]
    text = "A remote turn, streamed token by token to the server. It speaks."
    down, up = await run_test(
        tts,
        frames_to_send=[
            TTSSpeakFrame("Hello from the server."),
            LLMFullResponseStartFrame(),
            *tokens(text),
            LLMFullResponseEndFrame(),
        ],
        pipeline_params=PipelineParams(audio_out_sample_rate=16000, enable_metrics=True),
    )
    assert not [f for f in up if isinstance(f, ErrorFrame)]
    # Word timestamps in remote mode too: the protocol's clause_done carries the times.
    words = [f.text.strip() for f in down if isinstance(f, TTSTextFrame)]
    assert words == f"Hello from the server. {text}".split()
    assert engine.metrics()["requests_completed"] == completed + 2
    assert {f.sample_rate for f in audio(down)} == {16000}
    kinds = [type(f) for f in down]
    assert kinds.count(TTSStartedFrame) == kinds.count(TTSStoppedFrame) == 2
    assert [d for d in metrics_of(down, TTFBMetricsData) if d.value]
    assert idle(engine, pages_at_idle)


async def test_example_bot_over_a_websocket(engine: Engine, tiny_checkpoint: Path, tmp_path):
    """agents_examples/pipecat_bot.py: the bot behind FastAPI's WebSocket, and its client."""
    import importlib.util
    import wave

    path = Path(__file__).parents[2] / "agents_examples" / "pipecat_bot.py"
    spec = importlib.util.spec_from_file_location("example_pipecat_bot", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    app = example.make_app(str(tiny_checkpoint), None, None, 16000)
    with serving(app) as url:
        completed = engine.metrics()["requests_completed"]
        out = tmp_path / "bot.wav"
        await example.say(f"{url}/ws", "Hello there! How can I help?", str(out), 16000, None)
        with wave.open(str(out)) as wav:
            assert wav.getframerate() == 16000 and wav.getnframes() > 0
        assert engine.metrics()["requests_completed"] == completed + 1

        # What the bot cannot speak comes back as an error, not as a wait with no end: a blank
        # reply (refused by the bot), and a reply the TTS refused (its ErrorFrame, forwarded).
        for text, error in (("   ", "nothing to say"), ("\udcff", "no text")):
            with pytest.raises(example.BotError, match=error):
                await example.say(f"{url}/ws", text, str(out), 16000, None, timeout=20)

        cancelled = engine.metrics()["requests_cancelled"]
        long = " ".join(["A long reply that the client interrupts, clause after clause."] * 8)
        await example.say(f"{url}/ws", long, str(out), 16000, 0.3)
        deadline = time.monotonic() + 5
        while engine.metrics()["requests_cancelled"] == cancelled:
            assert time.monotonic() < deadline, "the barge-in did not cancel the engine request"
            await asyncio.sleep(0.01)


# ---- word timing after a barge-in, with a transport that plays in real time


class RealtimeOutput(BaseOutputTransport):
    """An output transport whose device plays each chunk in real time and counts what played."""

    def __init__(self) -> None:
        super().__init__(
            TransportParams(
                audio_out_enabled=True, audio_out_sample_rate=24000, audio_out_end_silence_secs=0
            )
        )
        self.played = 0.0  # seconds of audio written
        self.heard = 0.0  # seconds played when the interruption came
        self._started_at: float | None = None

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        await self.set_transport_ready(frame)

    async def write_audio_frame(self, frame: OutputAudioRawFrame) -> bool:
        # A device's clock: it plays from the first chunk on, each chunk ending at the start plus
        # all the audio so far (no drift from late wake-ups of this loop).
        if self._started_at is None:
            self._started_at = time.monotonic()
        self.played += len(frame.audio) / 2 / frame.sample_rate
        await asyncio.sleep(self._started_at + self.played - time.monotonic())
        return True

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        if isinstance(frame, InterruptionFrame) and self._started_at is not None:
            # What the listener heard: the chunk under way was cut at this moment.
            self.heard = min(self.played, time.monotonic() - self._started_at)
        await super().process_frame(frame, direction)


class WordRecorder(FrameProcessor):
    """Passes every frame on, keeping the word frames the TTS sent (with their timestamps)."""

    def __init__(self) -> None:
        super().__init__()
        self.words: list[TTSTextFrame] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSTextFrame):
            self.words.append(frame)
        await self.push_frame(frame, direction)


async def test_barge_in_context_holds_the_words_played(engine: Engine, tiny_checkpoint: Path):
    """The assistant aggregator after the transport gets the words as the transport releases
    them by their timestamps: after an interruption it holds the words played (within one
    word), not the whole text the LLM sent."""
    context = LLMContext()
    recorder = WordRecorder()
    output = RealtimeOutput()
    reply = " ".join(["Here is a long answer with quite a few words in it, clause by clause."] * 3)
    # At half speed the audio lasts twice as long as it takes to make, so the device never runs
    # dry on a busy machine: Pipecat releases words by the clock, which an underrun would outrun.
    tts = service(tiny_checkpoint, settings=IntoneTTSService.Settings(speed=0.5, **FAST_FIELDS))
    await run_test(
        Pipeline([tts, recorder, output, LLMAssistantAggregator(context)]),
        frames_to_send=[
            LLMFullResponseStartFrame(),
            *tokens(reply),
            LLMFullResponseEndFrame(),
            SleepFrame(1.6),
            InterruptionFrame(),
            SleepFrame(0.3),
        ],
    )
    words = reply.split()
    timed = recorder.words
    assert [f.text.strip() for f in timed] == words[: len(timed)]
    starts = [(f.pts - timed[0].pts) / 1e9 for f in timed]
    heard = sum(1 for start in starts if start < output.heard)
    assert 3 < heard < len(words), f"heard {output.heard:.2f} s"  # interrupted mid-reply
    messages = [m for m in context.get_messages() if m.get("role") == "assistant"]
    assert messages, "no assistant message after the interruption"
    said = str(messages[-1]["content"]).split()
    assert said == words[: len(said)]  # the LLM's words, in order, from the start
    assert abs(len(said) - heard) <= 1, f"{said=}: {heard} words began in {output.heard:.2f} s"


async def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_busy_engine_is_retried_before_the_first_audio(tiny_model):
    """A full engine is retried with backoff while the turn has no audio: when room comes the
    turn speaks; when it never does, the error is RATE_LIMIT, which Pipecat does not treat as
    permanent."""
    # "hold": the open turn's long clause keeps the one slot (it waits for its listener).
    config = EngineConfig(max_active=1, max_queued=1, pacing="hold")
    engine = Engine(tiny_model, config).start()
    try:
        holder = engine.stream(None, engine_options(engine, LONG_FIELDS))
        holder.push_text("This open turn takes the one batch slot, and then it waits")
        await wait_for(lambda: engine.metrics()["active_requests"] == 1)
        waiting = engine.stream()  # with text, it takes the queue's one place
        waiting.push_text("Hello there.")
        waiting.flush()

        async def make_room() -> None:
            await asyncio.sleep(0.3)
            waiting.cancel()
            holder.cancel()

        room = asyncio.create_task(make_room())
        down, up = await run_test(
            IntoneTTSService(engine=engine, settings=FAST),
            frames_to_send=[TTSSpeakFrame("Spoken once there is room.")],
        )
        await room
        assert not [f for f in up if isinstance(f, ErrorFrame)]
        assert seconds(down) == pytest.approx(CLAUSE_SECONDS, abs=0.01)

        await wait_for(lambda: engine.metrics()["active_requests"] == 0)
        full = [engine.stream(None, engine_options(engine, LONG_FIELDS))]
        # One long first clause: a stream's next clause queues again, behind the others' first.
        full[0].push_text("A long clause that keeps the slot for good, then waiting for more text")
        await wait_for(lambda: engine.metrics()["active_requests"] == 1)
        full.append(engine.stream())  # and the queue
        full[1].push_text("Hello there.")
        full[1].flush()
        down, up = await run_test(
            IntoneTTSService(engine=engine, settings=FAST),
            frames_to_send=[TTSSpeakFrame("No room at all."), SleepFrame(2.0)],
        )
        errors = [f for f in up if isinstance(f, ErrorFrame)]
        # Ours, then Pipecat's own report of a context that ended without audio.
        assert errors and errors[0].category == ErrorCategory.RATE_LIMIT, [e.error for e in errors]
        assert not errors[0].category.is_permanent
        assert not audio(down)
        for stream in full:
            stream.cancel()
    finally:
        engine.close()


@pytest.mark.parametrize("where", ["engine", "server"])
async def test_a_voice_given_as_bytes(
    engine: Engine, tiny_checkpoint: Path, server_url: str, where: str
):
    """The bytes of a voice file: registered once in process, uploaded once to a server."""
    data = (tiny_checkpoint / "voices" / "default.wav").read_bytes()
    settings = IntoneTTSService.Settings(**FAST_FIELDS, voice=data)
    if where == "engine":
        tts = service(tiny_checkpoint, settings=settings)
    else:
        tts = IntoneTTSService(base_url=server_url, settings=settings)
    before = set(engine.voices)
    down, up = await run_test(
        tts, frames_to_send=[TTSSpeakFrame("Hello there."), TTSSpeakFrame("Once more.")]
    )
    assert not [f for f in up if isinstance(f, ErrorFrame)]
    assert seconds(down) == pytest.approx(2 * CLAUSE_SECONDS, abs=0.01)
    added = set(engine.voices) - before
    if where == "engine":
        assert bytes_voice_name(data) in engine.voices
        assert len(added) <= 1  # once (an earlier test may have registered it already)
    else:
        assert len(added) == 1 and next(iter(added)).startswith("voice_")  # uploaded once


@pytest.mark.parametrize("remote", [False, True])
async def test_first_clause_policy_is_a_setting(
    engine: Engine, tiny_checkpoint: Path, server_url: str, remote: bool
):
    """`first_clause_min_words` decides how the turn is cut, in-process and through the server:
    every clause is 8 frames here, so the audio counts the clauses."""
    text = "Hmm, I do not see that booking here. Could you spell it?"
    where = {"base_url": server_url} if remote else {"model": tiny_checkpoint}
    clauses = {}
    for words in (1, 5):
        settings = IntoneTTSService.Settings(
            **FAST_FIELDS, first_clause_min_words=words, first_clause_max_wait_ms=10_000
        )
        down, _ = await run_test(
            IntoneTTSService(**where, settings=settings),
            frames_to_send=[LLMFullResponseStartFrame(), *tokens(text), LLMFullResponseEndFrame()],
        )
        clauses[words] = round(seconds(down) / CLAUSE_SECONDS)
    assert clauses == {1: 3, 5: 2}  # "Hmm," | ... against "Hmm, I do not see that booking here."
    with pytest.raises(InvalidOptionError, match="first_clause_min_words"):
        service(tiny_checkpoint, settings=IntoneTTSService.Settings(first_clause_min_words=0))
    with pytest.raises(InvalidOptionError, match="first_clause_max_wait_ms"):
        service(tiny_checkpoint, settings=IntoneTTSService.Settings(first_clause_max_wait_ms=-5))
