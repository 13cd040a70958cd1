"""intone TTS for LiveKit Agents: the batched Pocket TTS engine, in-process or remote.

In-process (the default), every `TTS` instance of a worker process takes a lease on one shared
engine per model (`intone.provider.registry`), so the sessions of all jobs in that process batch
together. That needs the jobs in one process: run the worker with
`job_executor_type=JobExecutorType.THREAD`. With the default process-per-job executor, each job
would load its own engine; run `intone serve` once and use `TTS(base_url=...)` instead.

`stream()` sends all of a turn's text into one engine stream as one segment, token by token; the
engine cuts it into clauses (a short first clause for a quick start: `first_clause_min_words`,
`first_clause_max_wait_ms`) and chains them, so there is no sentence tokenizer in front of it.

Languages: `TTS(language="fr")` speaks with that language's model (`french_24l`; one model per
language, `intone models`), `TTS(model=...)` with any model; `update_options(language=...)` or
`(model=...)` moves later turns to that model's engine (in-process, its shared engine is loaded on
first use; remote, the server's model of that name). A language without a model is refused with
an error naming the languages there are, never spoken in English.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from livekit import rtc
from livekit.agents import (
    APIConnectionError,
    APIConnectOptions,
    APIError,
    APIStatusError,
    APITimeoutError,
    LanguageCode,
    tts,
    utils,
)
from livekit.agents.telemetry import trace_types
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS, NOT_GIVEN, NotGivenOr, TimedString
from livekit.agents.utils import aio, is_given
from opentelemetry import trace

from intone.engine import (
    AudioChunk,
    ClauseDone,
    Engine,
    EngineClosedError,
    EngineConfig,
    LoadedModel,
    ModelUnavailableError,
)
from intone.engine.audio import StreamResampler, to_pcm16
from intone.engine.errors import Kind
from intone.engine.options import check_settings, option_names
from intone.provider import backends
from intone.provider.errors import error_kind
from intone.provider.model_names import pick_model, requested_name

from .log import logger
from .models import TTSModels, TTSVoices

_S = TypeVar("_S", "ChunkedStream", "SynthesizeStream")

# Pocket TTS's Mimi codec runs at 24 kHz; the audio is resampled if a model says otherwise.
SAMPLE_RATE = 24000
NUM_CHANNELS = 1


@dataclass
class _TTSOptions:
    """What a stream snapshots when it is created; `update_options` changes later streams."""

    voice: str | bytes | None
    model: str | Path | LoadedModel | None  # None: the default model
    temperature: float | None
    eos_threshold: float | None
    frames_after_eos: int | None
    max_frames: int | None
    noise_clamp: float | None
    seed: int | None
    chain_frames: int | None
    speed: float | None
    normalize: bool | None
    first_clause_min_words: int | None
    first_clause_max_wait_ms: float | None

    def __post_init__(self) -> None:
        # Here, so that TTS(speed=5) and update_options(speed=5) raise InvalidOptionError (a
        # ValueError) at once, rather than every later turn failing (replace() runs it too).
        check_settings(self.generation())

    def generation(self) -> dict[str, Any]:
        """The generation settings given, for the engine or the server."""
        # Not asdict(): it would deep-copy a LoadedModel.
        names = option_names()
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in values.items() if k in names and v is not None}


class TTS(tts.TTS):
    def __init__(
        self,
        *,
        model: TTSModels | str | Path | LoadedModel | None = None,
        language: str | None = None,
        voice: TTSVoices | str | bytes | None = None,
        base_url: str | None = None,
        engine: Engine | None = None,
        engine_config: EngineConfig | None = None,
        sample_rate: int = SAMPLE_RATE,
        temperature: float | None = None,
        eos_threshold: float | None = None,
        frames_after_eos: int | None = None,
        max_frames: int | None = None,
        noise_clamp: float | None = None,
        seed: int | None = None,
        chain_frames: int | None = None,
        speed: float | None = None,
        normalize: bool | None = None,
        first_clause_min_words: int | None = None,
        first_clause_max_wait_ms: float | None = None,
    ) -> None:
        """Create intone TTS.

        Args:
            model: a released model's name (`intone models`: "english", "french_24l",
                "english_2m_2026-10", ...), checkpoint directory, config .yaml, hf:// path or
                "kyutai/pocket-tts" (the default); a `LoadedModel` also works. Instances with the
                same model share one engine per process. Remote: one of the server's models.
            language: speak with this language's model ("fr", "fr-FR", "french"; a
                `LanguageCode`) when `model` is not given.
            voice: a voice of the checkpoint (e.g. "alba" for the released model), a voice file
                (WAV, FLAC, MP3, OGG or a voice-state .safetensors) or its bytes (encoded once;
                remote: uploaded once), a voice id stored on the server (`POST /v1/voices`,
                `IntoneClient.add_voice`); None means the model's default voice.
            base_url: an `intone serve` address (``ws://host:port``); speech is then made by that
                server and `model`/`engine_config` are the server's business.
            engine: an engine you built and own: used as is, never closed by this plugin.
            engine_config: settings for the shared engine if this instance is the one that
                creates it (batch slots, KV memory, device...).
            sample_rate: the output rate; audio is resampled if the model's differs.
            temperature, eos_threshold, frames_after_eos, max_frames, noise_clamp, seed,
                chain_frames: generation settings (`intone.engine.GenerationOptions`); None
                keeps the model's defaults.
            speed: speaking rate, 0.5 to 2.0 (pitch kept); None is 1.0.
            normalize: read numbers, prices, dates, times, URLs... as words (the engine's
                `normalize_text`); None is on. Markdown and emoji are left to LiveKit's own
                `tts_text_transforms`, which run before the text gets here.
            first_clause_min_words, first_clause_max_wait_ms: the first-clause policy: a
                turn's first clause may end at the first clause boundary after this many words
                (1-50; None: 1), or, with none by then, at the last word boundary this many
                milliseconds after the turn's first text (0-10,000; None: 100). Lower is earlier
                audio with less text for the first clause's prosody (docs/providers.md).

        Word timing: every clause's words reach LiveKit as `TimedString`s
        (`aligned_transcript=True`), with the engine's estimated times (token-weighted within
        each clause, see `intone.engine.word_timing`), so the transcript follows the audio and an
        interrupted turn keeps only the words that were heard.

        TTFB: LiveKit measures it from the first text sent to this TTS to the first audio frame
        (`ttfb` in `TTSMetrics`): it includes the wait for the first clause to be complete (the
        first-clause policy above, or a flush), the engine's admission queue and its first frame.
        """
        super().__init__(
            capabilities=tts.TTSCapabilities(streaming=True, aligned_transcript=True),
            sample_rate=sample_rate,
            num_channels=NUM_CHANNELS,
        )
        if engine is not None and (model is not None or language is not None):
            raise ValueError("an engine of yours speaks its own model: no model= or language=")
        self._own_engine = engine
        self._backends = backends.Backends(base_url=base_url, engine=engine, config=engine_config)
        self._opts = _TTSOptions(
            voice=voice,
            model=pick_model(model, _language(language)),
            temperature=temperature,
            eos_threshold=eos_threshold,
            frames_after_eos=frames_after_eos,
            max_frames=max_frames,
            noise_clamp=noise_clamp,
            seed=seed,
            chain_frames=chain_frames,
            speed=speed,
            normalize=normalize,
            first_clause_min_words=first_clause_min_words,
            first_clause_max_wait_ms=first_clause_max_wait_ms,
        )
        # Streams in flight, so that aclose() can close them (with their event loop: an
        # instance may serve several, one per job in the thread executor).
        self._streams: weakref.WeakKeyDictionary[
            tts.ChunkedStream | tts.SynthesizeStream, asyncio.AbstractEventLoop
        ] = weakref.WeakKeyDictionary()
        self._closed = False
        self._prewarm_task: asyncio.Task[None] | None = None

    @property
    def model(self) -> str:
        """The model new streams speak with."""
        model = self._opts.model
        remote = self._backends.remote
        if remote is not None and model is None:
            # The server's default model, from its hello; until the first connection, unknown.
            return remote.server_model or "unknown"
        if self._own_engine is not None:
            return self._own_engine.loaded.source
        return requested_name(model)

    @property
    def provider(self) -> str:
        return "intone"

    @property
    def engine(self) -> Engine | None:
        """The in-process engine of the current model (None before its first use, or remote)."""
        backend = self._backends.current(self._opts.model)
        return backend.shared_engine if backend is not None else None

    def update_options(
        self,
        *,
        voice: NotGivenOr[TTSVoices | str | bytes | None] = NOT_GIVEN,
        language: NotGivenOr[str | None] = NOT_GIVEN,
        model: NotGivenOr[TTSModels | str | Path | LoadedModel | None] = NOT_GIVEN,
        temperature: NotGivenOr[float | None] = NOT_GIVEN,
        eos_threshold: NotGivenOr[float | None] = NOT_GIVEN,
        frames_after_eos: NotGivenOr[int | None] = NOT_GIVEN,
        max_frames: NotGivenOr[int | None] = NOT_GIVEN,
        noise_clamp: NotGivenOr[float | None] = NOT_GIVEN,
        seed: NotGivenOr[int | None] = NOT_GIVEN,
        chain_frames: NotGivenOr[int | None] = NOT_GIVEN,
        speed: NotGivenOr[float | None] = NOT_GIVEN,
        normalize: NotGivenOr[bool | None] = NOT_GIVEN,
        first_clause_min_words: NotGivenOr[int | None] = NOT_GIVEN,
        first_clause_max_wait_ms: NotGivenOr[float | None] = NOT_GIVEN,
    ) -> None:
        """Change the options of streams created from now on (streams in flight keep theirs).

        `language` or `model` moves later turns to that model's engine; an unknown language
        raises UnknownModelError naming the known ones.
        """
        if (is_given(language) or is_given(model)) and self._own_engine is not None:
            raise ValueError("an engine of yours speaks its own model: no model= or language=")
        if is_given(model) and model is not None:
            self._opts = replace(self._opts, model=model)
        elif is_given(language) or is_given(model):
            lang = language if is_given(language) else None
            self._opts = replace(self._opts, model=pick_model(None, _language(lang)))
        given = {
            "voice": voice,
            "temperature": temperature,
            "eos_threshold": eos_threshold,
            "frames_after_eos": frames_after_eos,
            "max_frames": max_frames,
            "noise_clamp": noise_clamp,
            "seed": seed,
            "chain_frames": chain_frames,
            "speed": speed,
            "normalize": normalize,
            "first_clause_min_words": first_clause_min_words,
            "first_clause_max_wait_ms": first_clause_max_wait_ms,
        }
        self._opts = replace(self._opts, **{k: v for k, v in given.items() if is_given(v)})

    def synthesize(
        self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> ChunkedStream:
        return self._track(ChunkedStream(tts=self, input_text=text, conn_options=conn_options))

    def stream(
        self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> SynthesizeStream:
        return self._track(SynthesizeStream(tts=self, conn_options=conn_options))

    def _track(self, stream: _S) -> _S:
        with contextlib.suppress(RuntimeError):  # made outside a loop: nothing runs yet
            self._streams[stream] = asyncio.get_running_loop()
        return stream

    def prewarm(self) -> None:
        """Load, start and warm the engine (or connect to the server) before the first turn.

        Inside an event loop this runs in the background; outside one (a worker's setup
        function) it blocks until the engine is ready.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._backends.get_sync(self._opts.model)
            return
        # Don't replace a prewarm still in flight: aclose() cancels only the latest one.
        if self._prewarm_task is None or self._prewarm_task.done():
            self._prewarm_task = loop.create_task(self._prewarm())

    async def _prewarm(self) -> None:
        try:
            backend = await self._get_backend(self._opts.model)
            if isinstance(backend, backends.RemoteBackend):
                await backend.connect()  # this event loop's connection, ready for the first turn
        except Exception as e:  # the first stream reports it as an APIError
            logger.warning("intone prewarm failed: %s", e)

    async def aclose(self) -> None:
        """Close the streams in flight and release this instance's hold on the shared engines;
        other instances keep using them."""
        self._closed = True
        if self._prewarm_task is not None:
            await aio.cancel_and_wait(self._prewarm_task)
        current = asyncio.get_running_loop()
        closing = []
        for stream, loop in list(self._streams.items()):
            if loop is current:
                closing.append(stream.aclose())
            elif loop.is_running():
                closing.append(
                    asyncio.wrap_future(asyncio.run_coroutine_threadsafe(stream.aclose(), loop))
                )
        self._streams.clear()
        await asyncio.gather(*closing, return_exceptions=True)
        await self._backends.aclose()

    # ---- backend

    async def _get_backend(self, model: str | Path | LoadedModel | None) -> backends.SpeechBackend:
        if self._closed:
            raise APIConnectionError("intone TTS is closed", retryable=False)
        try:
            return await self._backends.get(model)
        except Exception as e:
            raise _api_error(e) from e


def _language(language: str | None) -> str | None:
    """A LiveKit language (any BCP-47 form or name) as its base code, e.g. "fr"."""
    return None if language is None else LanguageCode(language).language


class ChunkedStream(tts.ChunkedStream):
    """`synthesize()`: the whole text as one engine request, audio streamed as it is made."""

    def __init__(self, *, tts: TTS, input_text: str, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, input_text=input_text, conn_options=conn_options)
        self._tts: TTS = tts
        self._opts = replace(tts._opts)

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output_emitter.initialize(
            request_id=utils.shortuuid(),
            sample_rate=self._tts.sample_rate,
            num_channels=NUM_CHANNELS,
            mime_type="audio/pcm",
        )
        if not self.input_text.strip():
            return
        speech = await _open_speech(self._tts, self._opts)
        _note_request_id(speech.request_id)
        finished = False
        try:
            progress = _Progress()
            await speech.push_text(self.input_text)
            await speech.end_input()
            progress.input_ended = True
            await _pump(
                speech,
                output_emitter,
                StreamResampler(speech.sample_rate, self._tts.sample_rate),
                self._conn_options.timeout,
                progress,
            )
            finished = True
            output_emitter.flush()
        except APIError:
            raise
        except Exception as e:
            raise _api_error(e) from e
        finally:
            if not finished:  # failed or cancelled: free the engine's slot and KV pages now
                speech.cancel()


class SynthesizeStream(tts.SynthesizeStream):
    """`stream()`: one segment, one engine stream; text goes in as it arrives."""

    def __init__(self, *, tts: TTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._tts: TTS = tts
        self._opts = replace(tts._opts)

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        request_id = utils.shortuuid()
        output_emitter.initialize(
            request_id=request_id,
            sample_rate=self._tts.sample_rate,
            num_channels=NUM_CHANNELS,
            mime_type="audio/pcm",
            stream=True,
        )
        # The engine request opens with the first text, not with the stream: the agent opens
        # its TTS stream before the LLM's first token, and an open request holds a batch slot.
        first = await self._next_text()
        if first is None:
            return
        speech = await _open_speech(self._tts, self._opts)
        finished = False
        progress = _Progress()
        feed_task: asyncio.Task[None] | None = None
        try:
            # The engine's (or server's) request id names the segment: it goes on the trace.
            output_emitter.start_segment(segment_id=speech.request_id or request_id)
            self._mark_started()
            await speech.push_text(first)
            feed_task = asyncio.create_task(
                self._feed(speech, progress, has_text=bool(first.strip())),
                name="intone.SynthesizeStream._feed",
            )
            await _pump(
                speech,
                output_emitter,
                StreamResampler(speech.sample_rate, self._tts.sample_rate),
                self._conn_options.timeout,
                progress,
            )
            if progress.feed_error is not None:
                raise progress.feed_error
            finished = True
            output_emitter.end_segment()
        except APIError:
            raise
        except Exception as e:
            raise _api_error(e) from e
        finally:
            if not finished:
                # Failed, or a barge-in (the agent closes the stream, cancelling this task):
                # free the engine's slot and KV pages now.
                speech.cancel()
            if feed_task is not None:
                await aio.cancel_and_wait(feed_task)

    async def _next_text(self) -> str | None:
        """The first text pushed; None if the input ends without any."""
        async for data in self._input_ch:
            if isinstance(data, str):
                return data
        return None

    async def _feed(self, speech: backends.Speech, progress: _Progress, has_text: bool) -> None:
        try:
            async for data in self._input_ch:
                if isinstance(data, self._FlushSentinel):
                    if has_text:
                        # One segment per stream: the framework drops text pushed after a
                        # flush, so the flush is the end of this request's input.
                        break
                    continue
                await speech.push_text(data)
                has_text |= bool(data.strip())
            if has_text:
                await speech.end_input()
                progress.input_ended = True
            else:
                speech.cancel()  # whitespace only: nothing to say
        except Exception as e:
            # Reported by _run once the stream has stopped.
            progress.feed_error = e
            speech.cancel()


@dataclass
class _Progress:
    input_ended: bool = False
    clauses_done: int = 0
    feed_error: Exception | None = None

    def owes_audio(self, speech: backends.Speech) -> bool:
        """Whether the engine has text it has not finished speaking (what the timeout guards).

        Before the input ends, only clauses already submitted count: the LLM may be slow to
        send the rest of a clause, and that is not the engine's fault.
        """
        if self.input_ended:
            return True
        return speech.submitted_clauses > self.clauses_done


async def _open_speech(tts: TTS, opts: _TTSOptions) -> backends.Speech:
    """A stream of the model `opts` names, on that model's backend."""
    if tts._closed:
        raise APIConnectionError("intone TTS is closed", retryable=False)
    try:
        return await tts._backends.open_stream(
            opts.model, opts.voice, opts.generation(), tts.sample_rate
        )
    except APIError:
        raise
    except Exception as e:
        raise _api_error(e) from e


async def _pump(
    speech: backends.Speech,
    output_emitter: tts.AudioEmitter,
    resampler: StreamResampler,
    timeout: float,
    progress: _Progress,
) -> None:
    """Move the engine's audio to the emitter as int16 PCM until the request ends."""
    framer = Framer(resampler.out_rate)
    events = speech.__aiter__()
    # The wait for the next event outlives a timeout that turns out to be harmless: cancelling
    # it would close a remote stream's async generator.
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(events.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=timeout)
            if not done:
                if progress.owes_audio(speech):
                    raise APITimeoutError(f"intone produced no audio for {timeout:.1f} s")
                continue
            finished, pending = pending, None
            try:
                event = finished.result()
            except StopAsyncIteration:
                break
            if isinstance(event, AudioChunk):
                for frame in framer.push(resampler.process(event.samples)):
                    output_emitter.push_frame(frame)
            elif isinstance(event, ClauseDone):
                progress.clauses_done += 1
                # The clause's words, as the agent sent them, with their times in the segment:
                # they ride on the next audio frame to the transcript synchronizer.
                output_emitter.push_timed_transcript(
                    [
                        TimedString(f"{w.word} ", start_time=w.start, end_time=w.end)
                        for w in event.words
                    ]
                )
    finally:
        if pending is not None:
            pending.cancel()
    for frame in framer.finish(resampler.finish()):
        output_emitter.push_frame(frame)


class Framer:
    """Engine audio into frames for the emitter such that every non-final frame LiveKit sends is
    longer than 50 ms and shorter than 250 ms, strictly (LiveKit's own plugin tests hold them to
    that), with no audio held back: the first frame goes out with the engine's first delivery.

    The emitter holds back the last 10 ms of what it is given (to mark the segment's last audio
    final) and sends the rest: a frame pushed after another goes out at its own length, the first
    one 10 ms shorter. So whatever has arrived is pushed as soon as it is 51 ms or more (61 ms for
    the first frame; one Mimi frame is 80 ms), split in equal parts under 200 ms. Only a delivery
    shorter than that (the time-scaler's or the resampler's odd sizes) waits for the next one. At
    the end, a remainder too short for a frame of its own is padded with silence to the shortest
    frame: at most 61 ms after the segment's trailing silence, where holding 51 ms back all
    along would have delayed every segment's first audio by a Mimi frame.
    """

    MAX_FRAME_S = 0.2
    MIN_FRAME_S = 0.05  # exclusive

    def __init__(self, sample_rate: int) -> None:
        self.sample_rate = sample_rate
        self._tail = sample_rate * 10 // 1000  # the emitter's `_TAIL_SAMPLES`
        self._min = round(self.MIN_FRAME_S * sample_rate) + 1
        self._max = round(self.MAX_FRAME_S * sample_rate)
        self._buffer = np.zeros(0, dtype=np.float32)
        self._pushed = False

    @property
    def _shortest(self) -> int:
        return self._min if self._pushed else self._min + self._tail

    def push(self, samples: np.ndarray) -> list[rtc.AudioFrame]:
        self._buffer = np.concatenate([self._buffer, samples])
        if len(self._buffer) < self._shortest:
            return []
        return self._drain()

    def finish(self, tail: np.ndarray) -> list[rtc.AudioFrame]:
        self._buffer = np.concatenate([self._buffer, tail])
        if not len(self._buffer):
            return []
        short = self._shortest - len(self._buffer)
        if short > 0:
            self._buffer = np.concatenate([self._buffer, np.zeros(short, dtype=np.float32)])
        return self._drain()

    def _drain(self) -> list[rtc.AudioFrame]:
        """All of the buffer as equal frames under `MAX_FRAME_S` (each over 100 ms when there are
        two or more, so never too short)."""
        parts = -(-len(self._buffer) // self._max)
        frames = [self._frame(part) for part in np.array_split(self._buffer, parts)]
        self._buffer = np.zeros(0, dtype=np.float32)
        self._pushed = True
        return frames

    def _frame(self, samples: np.ndarray) -> rtc.AudioFrame:
        return rtc.AudioFrame(
            data=to_pcm16(samples),
            sample_rate=self.sample_rate,
            num_channels=NUM_CHANNELS,
            samples_per_channel=len(samples),
        )


def _note_request_id(request_id: str) -> None:
    """Put the engine's request id on the current TTS span, as `start_segment` does."""
    span = trace.get_current_span()
    if request_id and span.is_recording():
        span.set_attribute(trace_types.ATTR_PROVIDER_REQUEST_IDS, [request_id])


def _api_error(e: BaseException) -> APIError:
    """The LiveKit error for an engine or server failure, by its kind (the same in-process and
    remote, `intone.provider.errors`): decides retry and error reporting."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ModelUnavailableError):
        return APIConnectionError(f"intone model unavailable: {e}", retryable=False)
    if isinstance(e, EngineClosedError):
        return APIConnectionError(f"intone engine closed: {e}", retryable=False)
    kind = error_kind(e)
    if kind is Kind.BUSY:
        # Full for now: another attempt (or another worker) may have room.
        return APIStatusError(f"intone is busy: {e}", status_code=503, retryable=True)
    if kind in (Kind.BAD_REQUEST, Kind.BAD_INPUT):
        # Bad voice, options or text: the same request would fail again.
        return APIStatusError(str(e), status_code=400, retryable=False)
    if kind is Kind.AUTH:
        return APIStatusError(str(e), status_code=401, retryable=False)
    if kind is Kind.SERVER:
        return APIStatusError(f"intone engine error: {e}", status_code=500, retryable=True)
    if isinstance(e, TimeoutError):
        return APITimeoutError(f"intone: {e}")
    return APIConnectionError(f"intone: {type(e).__name__}: {e}", retryable=True)
