"""intone TTS for Pipecat: the batched Pocket TTS engine, in-process or remote.

    from intone.provider.pipecat import IntoneTTSService

    tts = IntoneTTSService(settings=IntoneTTSService.Settings(voice="alba"))

See `IntoneTTSService` for the design and docs/providers.md for a quick start.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger
from pipecat.audio.utils import create_stream_resampler
from pipecat.frames.frames import (
    ErrorFrame,
    Frame,
    InterruptionFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSStoppedFrame,
)
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TextAggregationMode, TTSService
from pipecat.transcriptions.language import Language
from pipecat.utils.errors import ErrorCategory
from pipecat.utils.tracing.service_decorators import traced_tts
from pipecat.utils.types import NOT_GIVEN, NotGiven, is_given

from intone.engine import AudioChunk, ClauseDone, Engine, EngineConfig, LoadedModel, releases
from intone.engine.audio import to_pcm16
from intone.engine.errors import InvalidOptionError, Kind, UnknownModelError
from intone.engine.options import check_settings, option_names
from intone.provider import backends
from intone.provider.errors import error_kind, is_busy
from intone.provider.model_names import ModelSpec, pick_model, requested_name

# Generation settings a turn's stream takes from the service settings: GenerationOptions'
# fields, less flow_steps, which is fixed per engine.
GENERATION_FIELDS = tuple(name for name in option_names() if name != "flow_steps")

# Retries of a turn whose stream the engine or server refused as busy, before its first audio:
# waits of 0.05, 0.1, 0.2, 0.4 and 0.8 s (1.55 s in all), then a non-permanent error.
BUSY_RETRY_DELAYS_S = (0.05, 0.1, 0.2, 0.4, 0.8)

# The longest wait for a context's next audio item (first audio or any gap) before Pipecat ends
# the context. Pipecat's 3 s is too short for a loaded engine: a turn that arrives while every
# batch slot is taken waits in the admission queue, and in TOKEN mode a gap also spans the LLM's
# time to finish the next clause. 10 s leaves room for both without hiding a dead engine.
DEFAULT_STOP_FRAME_TIMEOUT_S = 10.0


def _given() -> Any:
    return field(default_factory=lambda: NOT_GIVEN)


@dataclass
class IntoneTTSSettings(TTSSettings):
    """Runtime-updatable settings: the voice and the generation options.

    `voice`: a voice of the checkpoint ("alba" for the released model), a voice file (WAV,
    FLAC, MP3, OGG or a voice-state .safetensors) or its bytes (encoded once; remote: uploaded
    once), or a voice id stored on the server (`POST /v1/voices`, `IntoneClient.add_voice`);
    None is the model's default voice. The generation fields are those
    of `intone.engine.GenerationOptions`; None keeps the model's defaults. Changes apply from the
    next turn; a turn's stream keeps the settings it started with.
    """

    temperature: float | None | NotGiven = _given()
    eos_threshold: float | None | NotGiven = _given()
    frames_after_eos: int | None | NotGiven = _given()
    max_frames: int | None | NotGiven = _given()
    noise_clamp: float | None | NotGiven = _given()
    seed: int | None | NotGiven = _given()
    chain_frames: int | None | NotGiven = _given()
    speed: float | None | NotGiven = _given()  # 0.5-2.0, pitch kept
    normalize: bool | None | NotGiven = _given()  # numbers, prices, dates... read as words
    # The first-clause policy: the first clause of a turn may end at the first boundary after
    # this many words (1-50), or at the last word boundary this long after the turn's first
    # text (0-10,000 ms); None keeps the engine's defaults (1 word, 100 ms).
    first_clause_min_words: int | None | NotGiven = _given()
    first_clause_max_wait_ms: float | None | NotGiven = _given()

    def generation(self) -> dict[str, Any]:
        values = {name: getattr(self, name) for name in GENERATION_FIELDS}
        return {k: v for k, v in values.items() if is_given(v) and v is not None}


@dataclass
class _Turn:
    """One audio context's engine stream and the task moving its audio into the context."""

    context_id: str
    speech: backends.Speech
    resampler: Any | None
    task: asyncio.Task | None = None
    has_text: bool = False
    input_ended: bool = False


class IntoneTTSService(TTSService):
    """Pocket TTS from intone's batched engine, handed text as it arrives.

    Hand-off: `run_tts` pushes each piece of text into the turn's engine stream and returns at
    once; a task per turn appends the audio to the turn's audio context as the engine makes it,
    and ends the context with a `TTSStoppedFrame` when the engine is done. One turn is one engine
    stream (one audio context), so its clauses run in order and are chained (each clause is
    conditioned on the end of the previous one, which keeps the voice and prosody continuous).
    Throughput comes from batching across sessions: every service of the process that uses the
    same model shares one engine (`intone.provider.registry`), so concurrent pipelines' requests
    run in the same engine steps.

    Text aggregation: TOKEN by default. The engine cuts the stream into clauses itself, with a
    short first clause so audio starts early (settings `first_clause_min_words`,
    `first_clause_max_wait_ms`), and a clause is submitted the moment it is complete. SENTENCE
    mode would put Pipecat's sentence aggregator in front of that: the first audio would wait for
    a whole first sentence, and each sentence for the token that confirms its end, which is
    latency and nothing else since the engine re-cuts the text anyway (docs/providers.md, "First
    audio"). SENTENCE still works, and clauses still chain across its sentences.

    End of input: `flush_audio` (end of the LLM turn, or after a `TTSSpeakFrame`) ends the
    stream's input, so the engine finishes the last clause. Interruption: the turn's engine
    stream is cancelled (`on_audio_context_interrupted`), which frees its batch slot and KV pages
    at once; no audio of it reaches the pipeline afterwards.

    Audio is 16-bit PCM at the pipeline's output rate, resampled from the model's 24 kHz when it
    differs. TTFB (text to first audio of a context) and usage metrics are reported.

    Word timestamps (on by default): the engine reports each clause's exact place in the audio
    and estimated times for its words (the clause's speech shared out by the model tokens of
    each word's spoken form, `intone.engine.word_timing`), for the words as the LLM sent them, so
    the context aggregator keeps only the words that were played when a turn is interrupted.
    Remote mode gets the same times over the protocol. `word_timestamps=False` pushes the text
    frames without times instead.

    Errors are categorised by the engine's and server's error codes, the same in-process and
    remote (`intone.provider.errors`): a refused text is APPLICATION (this turn only), a bad
    voice or option INVALID_REQUEST, a busy engine or server RATE_LIMIT, after up to
    `BUSY_RETRY_DELAYS_S` of retries before the turn's first audio.

    Loading: the shared engine loads in `start()`, off the event loop (`registry.prewarm(model)`
    before the pipeline starts loads it ahead; an engine already loaded is used at once).

    Remote mode: `base_url="ws://host:port"` sends the text to an `intone serve` process (its
    engine batches the requests of every client) through `intone.provider.client`.

    Languages: `language=Language.FR` speaks with that language's model (`french_24l`, as
    Pipecat's Pocket TTS service maps it; one model per language, `intone models`), `model=` with
    any model. A `language` or `model` settings update moves later turns to that model's engine
    (in-process, its shared engine is loaded on first use); a language without a model fails
    those turns with an error naming the languages there are, rather than speaking English.
    """

    Settings = IntoneTTSSettings
    _settings: IntoneTTSSettings

    def __init__(
        self,
        *,
        model: str | Path | LoadedModel | None = None,
        language: Language | str | None = None,
        base_url: str | None = None,
        engine: Engine | None = None,
        engine_config: EngineConfig | None = None,
        settings: IntoneTTSSettings | None = None,
        text_aggregation_mode: TextAggregationMode | None = TextAggregationMode.TOKEN,
        stop_frame_timeout_s: float = DEFAULT_STOP_FRAME_TIMEOUT_S,
        word_timestamps: bool = True,
        **kwargs: Any,
    ):
        """Create the service; in-process, the shared engine loads in `start()` (once per
        process), unless it is already running.

        Args:
            model: a released model's name (`intone models`), checkpoint directory, config
                .yaml, hf:// path or "kyutai/pocket-tts" (the default); a `LoadedModel` also
                works. In remote mode, one of the server's models.
            language: speak with this language's model (when `model` is not given).
            base_url: an `intone serve` address; speech is then made by that server.
            engine: an engine you built and own: used as is, never closed by the service.
            engine_config: settings for the shared engine if this service creates it.
            settings: voice and generation settings (`IntoneTTSService.Settings`).
            text_aggregation_mode: TOKEN (default, see the class docstring) or SENTENCE.
            stop_frame_timeout_s: the longest wait for a context's next audio item.
            word_timestamps: push word-timed text frames (on by default).
            **kwargs: passed to `TTSService` (e.g. `sample_rate`).
        """
        if engine is not None and (model is not None or language is not None):
            raise ValueError("an engine of yours speaks its own model: no model= or language=")
        # The model new turns speak with, or why there is none (an unknown language).
        self._model: ModelSpec | UnknownModelError = pick_model(
            model, None if language is None else str(language)
        )
        default_settings = self.Settings(
            model=engine.loaded.source if engine is not None else requested_name(self._model),
            voice=None,
            language=language,
            **{name: None for name in GENERATION_FIELDS},
        )
        if settings is not None:
            default_settings.apply_update(settings)
        # A bad value fails here (InvalidOptionError, a ValueError), not every turn later.
        check_settings(default_settings.generation())
        super().__init__(
            text_aggregation_mode=text_aggregation_mode,
            push_text_frames=not word_timestamps,
            push_start_frame=True,
            push_stop_frames=True,
            stop_frame_timeout_s=stop_frame_timeout_s,
            settings=default_settings,
            **kwargs,
        )
        self._word_timestamps = word_timestamps
        self._turns: dict[str, _Turn] = {}
        self._failed: set[str] = set()  # contexts whose stream could not be opened or fed
        if model is None and engine is None and language is None:
            # A language in `settings` picks the model as `language=` does.
            chosen = self._settings.language
            if is_given(chosen) and chosen is not None:
                self._model = _language_model(str(chosen))
                self._settings.model = str(self._model)
        # In-process, the registry loads each model once per process and every service of the
        # same model shares its engine; a load blocks, so it waits for `start()` (or, after a
        # model change, the first turn of the new model), unless the engine already runs.
        self._backends = backends.Backends(base_url=base_url, engine=engine, config=engine_config)
        self._backends.adopt_loaded(self._model)

    @property
    def engine(self) -> Engine | None:
        """The in-process engine of the current model (None in remote mode, and before it
        loads)."""
        if isinstance(self._model, UnknownModelError):
            return None
        backend = self._backends.current(self._model)
        return backend.shared_engine if backend is not None else None

    def language_to_service_language(self, language: Language) -> str | None:
        """The model of `language` (what `settings.language` then holds); None if there is
        none, which `_update_settings` reports."""
        try:
            return releases.model_for_language(str(language))
        except UnknownModelError:
            return None

    def can_generate_metrics(self) -> bool:
        return True

    @property
    def supports_processing_metrics(self) -> bool:
        # run_tts only hands the text over; TTFB carries the latency.
        return False

    async def _update_settings(self, delta: TTSSettings) -> dict[str, Any]:
        given = {name: getattr(delta, name, NOT_GIVEN) for name in GENERATION_FIELDS}
        try:
            check_settings({name: value for name, value in given.items() if is_given(value)})
        except InvalidOptionError as e:
            # The update is refused whole; turns keep the settings they had.
            await self.push_error(error_msg=f"settings not changed: {e}", exception=e)
            return {}
        changed = await super()._update_settings(delta)
        # Voice, generation settings and the model are read when a turn's stream opens.
        if "model" in changed and self._settings.model is not None:
            self._model = str(self._settings.model)
        elif "language" in changed and self._settings.language is not None:
            try:
                self._model = _language_model(str(self._settings.language))
            except UnknownModelError as e:
                self._model = e
                await self.push_error(error_msg=str(e), exception=e)
        return changed

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        remote = self._backends.remote
        if remote is None and not isinstance(self._model, UnknownModelError):
            # Off the event loop: other pipelines of the process keep running while it loads.
            await self._backends.get(self._model)
        if remote is not None:
            # Connect now rather than on the first turn's text; a failure is reported then.
            try:
                await remote.connect()
            except Exception as e:
                logger.warning(f"{self}: cannot reach {remote.base_url} yet: {e}")
                await self._call_event_handler("on_connection_error", str(e))
            else:
                await self._call_event_handler("on_connected")

    async def cleanup(self) -> None:
        await super().cleanup()
        for turn in list(self._turns.values()):
            await self._drop_turn(turn)
        # Gives this service's hold on the shared engines back; other holders keep them.
        await self._backends.aclose()
        if self._backends.remote is not None:
            await self._call_event_handler("on_disconnected")

    # ---- text in

    @traced_tts
    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        if context_id in self._failed:
            yield None  # reported once; the rest of the turn's text is dropped
            return
        turn = self._turns.get(context_id)
        try:
            if turn is None:
                turn = await self._open_turn(context_id)
            if turn.input_ended:
                # The context's input was already ended; Pipecat opens a new context per turn,
                # so this is a stray piece of text.
                logger.warning(f"{self}: text after the end of context {context_id} dropped")
            else:
                await turn.speech.push_text(text)
                turn.has_text |= bool(text.strip())
            # In TOKEN mode the base reports usage once per turn; in SENTENCE mode, here.
            await self.start_tts_usage_metrics(text)
        except Exception as e:
            # One error per turn, not per token: the context stays open, silent, until the
            # turn's end (flush_audio) closes it.
            self._failed.add(context_id)
            if turn is not None:
                await self._drop_turn(turn)
            yield self._error_frame(e, f"intone could not take the text: {e}")
            return
        # The audio arrives through the turn's task.
        yield None

    async def flush_audio(self, context_id: str | None = None) -> None:
        """The turn's text is complete: let the engine finish its last clause."""
        context_id = context_id or self.get_active_audio_context_id()
        if context_id in self._failed:
            self._failed.discard(context_id)
            if self.audio_context_available(context_id):
                await self.append_to_audio_context(
                    context_id, TTSStoppedFrame(context_id=context_id)
                )
                await self.remove_audio_context(context_id)
            return
        turn = self._turns.get(context_id) if context_id else None
        if turn is None or turn.input_ended:
            return
        turn.input_ended = True
        if turn.has_text:
            try:
                await turn.speech.end_input()
            except Exception as e:
                # Refused (every piece of its text was, EmptyTextError) or already ended: the
                # turn is over now, not when the stop-frame timeout gives up on its audio.
                turn.speech.cancel()
                await self.push_error_frame(self._error_frame(e, f"intone ended the turn: {e}"))
        else:
            turn.speech.cancel()  # whitespace only: nothing to say

    async def _open_turn(self, context_id: str) -> _Turn:
        if isinstance(self._model, UnknownModelError):
            raise self._model
        # Before the turn's first audio a busy engine or server is worth waiting for.
        for delay in (*BUSY_RETRY_DELAYS_S, None):
            try:
                # A remote server resamples to the rate asked for; the engine yields its own.
                speech = await self._backends.open_stream(
                    self._model, self._settings.voice, self._settings.generation(), self.sample_rate
                )
                break
            except Exception as e:
                if delay is None or not is_busy(e):
                    raise
                logger.debug(f"{self}: busy, retrying context {context_id} in {delay} s: {e}")
                await asyncio.sleep(delay)
        resampler = None
        if speech.sample_rate != self.sample_rate:
            # One resampler per turn: its filter history belongs to one audio stream, and
            # Pipecat's default forgets it after 0.2 s of quiet, which a busy engine can exceed.
            resampler = create_stream_resampler(clear_after_secs=None)
        turn = _Turn(context_id, speech, resampler)
        self._turns[context_id] = turn
        turn.task = self.create_task(self._pump(turn), name=f"intone-turn-{context_id}")
        return turn

    # ---- audio out

    async def _pump(self, turn: _Turn) -> None:
        context_id = turn.context_id
        source_rate = turn.speech.sample_rate
        try:
            async for event in turn.speech:
                if isinstance(event, AudioChunk):
                    pcm = to_pcm16(event.samples)
                    if turn.resampler is not None:
                        pcm = await turn.resampler.resample(pcm, source_rate, self.sample_rate)
                    await self._append_audio(turn, pcm)
                elif isinstance(event, ClauseDone) and self._word_timestamps and event.words:
                    # Seconds from the turn's first audio, which is where Pipecat starts them.
                    await self.add_word_timestamps(
                        [(w.word, w.start) for w in event.words], turn.context_id
                    )
            if turn.resampler is not None:
                await self._append_audio(turn, await turn.resampler.flush())
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await self.push_error_frame(self._error_frame(e, f"intone synthesis failed: {e}"))
        finally:
            if self._turns.get(context_id) is turn:
                del self._turns[context_id]
        if self.audio_context_available(context_id):
            await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
            await self.remove_audio_context(context_id)

    async def _append_audio(self, turn: _Turn, pcm: bytes) -> None:
        if not pcm:
            return
        await self.append_to_audio_context(
            turn.context_id,
            TTSAudioRawFrame(pcm, self.sample_rate, 1, context_id=turn.context_id),
        )

    # ---- interruption and clean-up

    async def on_audio_context_interrupted(self, context_id: str) -> None:
        self._failed.discard(context_id)
        turn = self._turns.get(context_id)
        if turn is not None:
            await self._drop_turn(turn)
        await super().on_audio_context_interrupted(context_id)

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, InterruptionFrame):
            # A turn whose context is already gone (ended by the timeout while its engine
            # stream still runs) gets no hook call; its audio has nowhere to go: stop it too.
            for turn in list(self._turns.values()):
                if not self.audio_context_available(turn.context_id):
                    await self._drop_turn(turn)

    async def _drop_turn(self, turn: _Turn) -> None:
        """Stop a turn now: cancel its engine stream (frees the slot and KV pages) and task."""
        if self._turns.get(turn.context_id) is turn:
            del self._turns[turn.context_id]
        turn.speech.cancel()
        if turn.task is not None and not turn.task.done():
            await self.cancel_task(turn.task)

    def _error_frame(self, e: Exception, message: str) -> ErrorFrame:
        frame = ErrorFrame(error=message, exception=e)
        frame.category = _error_category(e)
        return frame


# By the failure's kind, the same in-process and remote. Only INVALID_REQUEST (and the
# credentials) are permanent for Pipecat: a refused text, a busy engine or a dropped
# connection must not switch the service off for the rest of the call.
_CATEGORIES = {
    Kind.BAD_REQUEST: ErrorCategory.INVALID_REQUEST,
    Kind.BAD_INPUT: ErrorCategory.APPLICATION,
    Kind.BUSY: ErrorCategory.RATE_LIMIT,
    Kind.CONNECTION: ErrorCategory.CONNECTIVITY,
    Kind.SERVER: ErrorCategory.SERVER,
    Kind.AUTH: ErrorCategory.AUTHENTICATION,
    Kind.UNKNOWN: ErrorCategory.UNKNOWN,
}


def _language_model(language: str) -> str:
    """The model of a settings language: known languages arrive as their model's name
    (`language_to_service_language`), others as given (UnknownModelError names the known)."""
    if releases.release_name(language) is not None:
        return language
    return releases.model_for_language(language)


def _error_category(e: Exception) -> ErrorCategory:
    return _CATEGORIES[error_kind(e)]
