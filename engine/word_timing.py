"""Where each clause and word of a stream lies in the audio its caller receives.

A `Timeline` sits where a stream hands events to its caller. It counts the decoded samples of
every clause (so a clause's first sample and length are exact), time-scales the audio by the
stream's `speed` (`speed.TimeStretch`), and when a clause ends fills its `ClauseDone` with that
position and with estimated times for the clause's words.

Word times are estimates: the model does not align text to audio. A clause's speech runs from its
first sample to the frame where the model signalled end of speech (EOS; the frames after it are
the tail the engine keeps). That span is shared among the caller's ORIGINAL words in proportion to
the model tokens of each word's spoken form (`normalize_text` of the word, so "$12.50" weighs as
"twelve dollars and fifty cents" but stays one word with one time, as the frameworks match timed
words against the text they sent), with a pause after punctuation worth one token (, ; :) or two
(. ! ?). Token counts follow speaking time better than characters do ("through" is one token and
seven letters). All times are in seconds from the stream's first sample, after `speed`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from intone.engine.events import AudioChunk, ClauseDone, WordTiming
from intone.engine.speed import TimeStretch
from intone.engine.spoken_form import normalize_text

if TYPE_CHECKING:
    from intone.engine.loading import LoadedModel
    from intone.engine.options import GenerationOptions

_CLAUSE_PAUSE = ",;:\u2013\u2014"
_SENTENCE_PAUSE = ".!?\u2026"
_CLOSERS = "\"')]}\u201d\u2019\u00bb"


def word_weights(words: list[str], count: Callable[[str], int]) -> list[tuple[float, float]]:
    """(speech weight, pause weight after it) of each word."""
    weights = []
    for word in words:
        core = word.rstrip(_CLOSERS)
        pause = 2.0 if core[-1:] in _SENTENCE_PAUSE else 1.0 if core[-1:] in _CLAUSE_PAUSE else 0.0
        weights.append((float(max(1, count(word))), pause))
    return weights


def estimate_word_times(
    text: str, start: float, duration: float, count: Callable[[str], int]
) -> list[WordTiming]:
    """Spread `duration` seconds of speech from `start` over the words of `text` by weight."""
    words = text.split()
    if not words or duration <= 0:
        return [WordTiming(w, start, start) for w in words]
    weights = word_weights(words, count)
    # The last word's pause is after the speech: it is not part of `duration`.
    total = sum(s + p for s, p in weights) - weights[-1][1]
    per_unit = duration / total
    out, t = [], start
    for word, (speech, pause) in zip(words, weights, strict=True):
        end = t + speech * per_unit
        out.append(WordTiming(word, t, end))
        t = end + pause * per_unit
    return out


class Timeline:
    """One stream's clause and word positions in its delivered audio, and its `speed`."""

    def __init__(
        self,
        sample_rate: int,
        frame_size: int,
        speed: float,
        count_tokens: Callable[[str], int],
    ) -> None:
        self.sample_rate = sample_rate
        self.frame_size = frame_size
        self.stretch = TimeStretch(speed)
        self._count_tokens = count_tokens
        self._decoded = 0  # samples decoded so far, before time-scaling
        self._clause_starts: dict[int, int] = {}  # clause -> its first decoded sample
        self.last_clause = 0  # the clause of the latest chunk, which the end belongs to

    @classmethod
    def for_stream(cls, loaded: LoadedModel, options: GenerationOptions) -> Timeline:
        tokenizer, language = loaded.tokenizer, loaded.language
        if options.normalize:

            def count(word: str) -> int:
                return len(tokenizer.encode(normalize_text(word, language) or word))
        else:

            def count(word: str) -> int:
                return len(tokenizer.encode(word))

        frame_size = round(loaded.sample_rate / loaded.config.mimi.frame_rate)
        return cls(loaded.sample_rate, frame_size, options.speed, count)

    def audio(self, chunk: AudioChunk) -> AudioChunk | None:
        """The chunk as the caller gets it (time-scaled), or None while the stretch holds it."""
        self._clause_starts.setdefault(chunk.clause, self._decoded)
        self._decoded += len(chunk.samples)
        self.last_clause = chunk.clause
        samples = self.stretch.feed(chunk.samples)
        return dataclasses.replace(chunk, samples=samples) if len(samples) else None

    def clause_done(self, event: ClauseDone) -> ClauseDone:
        """The event with the clause's position and word times in the delivered audio."""
        first = self._clause_starts.pop(event.clause, self._decoded)
        length = self._decoded - first
        speech = length
        if event.eos_frame is not None:
            speech = min(length, (event.eos_frame + 1) * self.frame_size)
        start = self.stretch.output_position(first)
        count = self.stretch.output_position(first + length) - start
        words = estimate_word_times(
            event.text,
            start / self.sample_rate,
            self.stretch.output_position(speech) / self.sample_rate,
            self._count_tokens,
        )
        return dataclasses.replace(event, start_sample=start, sample_count=count, words=words)

    def end(self) -> np.ndarray:
        """The last of the audio, held back by the time-stretch, at the end of the stream."""
        return self.stretch.finish()
