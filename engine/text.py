"""Text side of the engine: tokenizer, prompt preparation and splitting text into chunks.

Two splitters live here:

* `split_text` is the reference's one-shot chunking (`split_into_best_sentences`), kept
  byte-for-byte equal so a single request reproduces `pocket_tts` exactly.
* `ClauseSplitter` cuts text that arrives piecewise (an LLM's token stream) into clauses. Its
  boundaries depend only on the text and on explicit `flush()` calls, never on how the text was
  cut into `push()` calls, so streamed and one-shot input (`split_clauses`) give the same clauses.

Neither splitter is what makes a clause speakable: `prepare_text` (capitalisation, terminal
punctuation, ...) is applied to every chunk or clause just before it is tokenized for the model.
"""

from __future__ import annotations

import copy
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, Protocol

import sentencepiece
import tokenizers

from intone.engine.errors import InvalidTextError
from intone.engine.models.pocket.config import Config
from intone.engine.options import FIRST_CLAUSE_MIN_WORDS, ClausePlan, GenerationOptions

# Spoken-form text has its own module; it is part of the text API, under this name.
from intone.engine.spoken_form import WORDS_BEFORE_NUMBERS
from intone.engine.spoken_form import normalize_text as normalize_text

logger = logging.getLogger(__name__)

# The reference's MAX_TOKEN_PER_CHUNK: longer chunks make the model skip words.
MAX_TOKENS_PER_CHUNK = 50
# `TTSModel._estimate_max_gen_len`: speech runs at about 3 tokens a second, plus 2 s of slack.
_TOKENS_PER_SECOND = 3.0
_GEN_SECONDS_PADDING = 2.0
# `generate_audio_stream` adds this to the guess of `prepare_text_prompt`.
_EXTRA_FRAMES_AFTER_EOS = 2


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


class Codec(Encoder, Protocol):
    def decode(self, ids: list[int]) -> str: ...


class Tokenizer:
    """A SentencePiece `.model` or a HuggingFace `tokenizers` `.json` file, from a local path.

    The backend is picked like the reference's `build_tokenizer`: `kind` "tokenizers" or "json",
    or a `.json` suffix, selects `tokenizers`; "sentencepiece" otherwise. Both formats of the
    released vocabulary give the same ids.
    """

    def __init__(self, n_bins: int, path: str | Path, kind: str = "sentencepiece") -> None:
        path = Path(path)
        if kind not in ("sentencepiece", "tokenizers", "json"):
            raise ValueError(
                f"unknown tokenizer kind {kind!r}: expected 'sentencepiece', 'tokenizers' or 'json'"
            )
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        self.path = path
        self._sp: sentencepiece.SentencePieceProcessor | None = None
        self._hf: tokenizers.Tokenizer | None = None
        if kind in ("tokenizers", "json") or path.suffix == ".json":
            self.kind = "tokenizers"
            self._hf = tokenizers.Tokenizer.from_file(str(path))
            vocab_size = self._hf.get_vocab_size()
        else:
            self.kind = "sentencepiece"
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
            vocab_size = self._sp.vocab_size()
        if vocab_size != n_bins:
            # The lookup table has n_bins rows (+1 for padding): ids would index the wrong rows.
            raise ValueError(
                f"tokenizer {path} has vocab size {vocab_size}, but the model's lookup table "
                f"expects n_bins={n_bins}"
            )
        self.vocab_size = vocab_size
        logger.debug("loaded %s tokenizer %s (%d tokens)", self.kind, path, vocab_size)

    def encode(self, text: str) -> list[int]:
        if self._hf is not None:
            return self._hf.encode(text).ids
        assert self._sp is not None
        return self._sp.encode(text, out_type=int)

    def decode(self, ids: list[int]) -> str:
        if self._hf is not None:
            return self._hf.decode(list(ids))
        assert self._sp is not None
        return self._sp.decode(list(ids))

    def count(self, text: str) -> int:
        return len(self.encode(text))


@dataclass(frozen=True)
class TextOptions:
    """The text fields of the checkpoint config; defaults are the reference `Config`'s."""

    pad_with_spaces_for_short_inputs: bool = False
    remove_semicolons: bool = False
    append_terminal_punctuation: bool = True
    capitalize_first_letter: bool = True
    replace_characters: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: Any) -> TextOptions:
        """From `intone.engine.models.pocket.config.Config` (or anything with the same fields)."""
        return cls(
            pad_with_spaces_for_short_inputs=config.pad_with_spaces_for_short_inputs,
            remove_semicolons=config.remove_semicolons,
            append_terminal_punctuation=config.append_terminal_punctuation,
            capitalize_first_letter=config.capitalize_first_letter,
            replace_characters=dict(config.replace_characters or {}),
        )


_TERMINAL_PUNCTUATION = ".!?\u2026"
_WEAK_PUNCTUATION = ",;:-\u2013\u2014"
_CLOSERS = "\"'\u201d\u2019)]\u00bb"


def prepare_text(text: str, options: TextOptions | None = None) -> tuple[str, int]:
    """The reference's `prepare_text_prompt`: returns (prompt, default frames_after_eos).

    The second value is the EFFECTIVE default frames_after_eos: the reference's guess (3 for
    four words or fewer, else 1) plus the 2 that `generate_audio_stream` adds to it.
    Raises ValueError when the text is empty or only whitespace.
    """
    o = options or TextOptions()
    text = text.strip()
    if o.replace_characters:
        text = " ".join(text.translate(str.maketrans(o.replace_characters)).split())
        # Deleted quotes leave '"Hi?", she said' as 'Hi?, she said': keep the sentence mark only.
        text = re.sub(r"([.!?\u2026])\s*[,;:]", r"\1", text)
    if text == "":
        raise ValueError("Text prompt cannot be empty (it is empty or only whitespace)")
    text = text.replace("\n", " ").replace("\r", " ").replace("  ", " ")
    if o.remove_semicolons:
        text = text.replace(";", ",")
    frames_after_eos_guess = 3 if len(text.split()) <= 4 else 1
    if o.capitalize_first_letter and not text[0].isupper():
        text = text[0].upper() + text[1:]
    if o.append_terminal_punctuation:
        text = _ensure_terminal_punctuation(text)
    # The model does poorly on very few tokens; leading spaces add some.
    if o.pad_with_spaces_for_short_inputs and len(text.split()) < 5:
        text = " " * 8 + text
    return text, frames_after_eos_guess + _EXTRA_FRAMES_AFTER_EOS


def prompt_tokens(
    tokenizer: Codec, clause: str, options: TextOptions | None = None
) -> tuple[list[int], int]:
    """A clause's prompt tokens and default frames_after_eos, as the reference computes them.

    The reference prepares the text, then its chunker encodes and decodes it, and the chunk is
    prepared and encoded again. The round trip is not a no-op: a character outside the vocabulary
    comes back as the unknown piece's text (" ⁇ " for SentencePiece, "<unk>" for `tokenizers`),
    which encodes to other tokens and may change the word count, hence the frame budget and the
    frames_after_eos guess. Raises ValueError when the clause is empty or only whitespace.
    """
    text, _ = prepare_text(clause, options)
    # A clause of characters that decode to nothing keeps its prepared text rather than failing.
    text = tokenizer.decode(tokenizer.encode(text.strip())).strip() or text
    text, frames_after_eos = prepare_text(text, options)
    return tokenizer.encode(text), frames_after_eos


def _ensure_terminal_punctuation(text: str) -> str:
    """End with . ! ? or …, as the training sentences do (else the last word suffers)."""
    core = text.rstrip(_CLOSERS + " ")
    closers = text[len(core) :].strip()
    if not core or core[-1] in _TERMINAL_PUNCTUATION:
        return text
    if core[-1] in _WEAK_PUNCTUATION:
        return core.rstrip(_WEAK_PUNCTUATION + " ") + "." + closers
    return text + "."


def max_gen_len(token_count: int, frame_rate: float = 12.5) -> int:
    """Frames to allow for `token_count` text tokens (the reference's `_estimate_max_gen_len`)."""
    return math.ceil((token_count / _TOKENS_PER_SECOND + _GEN_SECONDS_PADDING) * frame_rate)


# --- one-shot chunking, identical to pocket_tts.models.text_chunking.split_into_best_sentences


def _is_decimal_period_boundary(ids: list[int], start: int, tokenizer: Codec) -> bool:
    prefix = tokenizer.decode(ids[:start])
    suffix = tokenizer.decode(ids[start:])
    return (
        len(prefix) >= 2
        and prefix[-1] == "."
        and prefix[-2].isdigit()
        and bool(suffix)
        and suffix[0].isdigit()
    )


def _boundary_indices(
    ids: list[int], boundary_ids: list[int], tokenizer: Codec | None = None
) -> list[int]:
    """Segment starts: the first non-boundary token after a run of boundary tokens.

    With a tokenizer, a start right after a decimal period ("3.5") is skipped.
    """
    boundary_set = set(boundary_ids)
    indices = [0]
    previous_was_boundary = False
    for idx, token in enumerate(ids):
        if token in boundary_set:
            previous_was_boundary = True
            continue
        if previous_was_boundary and not (
            tokenizer is not None and _is_decimal_period_boundary(ids, idx, tokenizer)
        ):
            indices.append(idx)
        previous_was_boundary = False
    indices.append(len(ids))
    return indices


def _segments(ids: list[int], bounds: list[int], tokenizer: Codec) -> list[tuple[int, str]]:
    return [(end - start, tokenizer.decode(ids[start:end])) for start, end in pairwise(bounds)]


def split_text(
    tokenizer: Codec,
    text: str,
    options: TextOptions | None = None,
    max_tokens: int = MAX_TOKENS_PER_CHUNK,
) -> list[str]:
    """The reference's `split_into_best_sentences`: the chunks a long text is generated in.

    Sentences (split on . ! ... ? tokens, not inside decimals) are greedily packed into chunks
    of at most `max_tokens` tokens; a longer sentence is first split on , ; : tokens. Chunks are
    returned unprepared: pass each through `prepare_text`, as the reference does.
    """
    text, _ = prepare_text(text, options)
    ids = tokenizer.encode(text.strip())
    # The first token of each probe is the word-start marker, not punctuation.
    _, *sentence_end_ids = tokenizer.encode(".!...?")
    sentences = _segments(ids, _boundary_indices(ids, sentence_end_ids, tokenizer), tokenizer)

    # Oversized sentences are sub-split on commas, semicolons and colons so no words are skipped.
    _, *fallback_ids = tokenizer.encode(",;:")
    segments: list[tuple[int, str]] = []
    for n_tokens, sentence in sentences:
        if n_tokens > max_tokens:
            sub_ids = tokenizer.encode(sentence.strip())
            subs = _segments(sub_ids, _boundary_indices(sub_ids, fallback_ids), tokenizer)
            if len(subs) > 1:
                segments.extend(subs)
                continue
        segments.append((n_tokens, sentence))

    chunks: list[str] = []
    current, current_tokens = "", 0
    for n_tokens, segment in segments:
        if current == "":
            current, current_tokens = segment, n_tokens
        elif current_tokens + n_tokens > max_tokens:
            chunks.append(current.strip())
            current, current_tokens = segment, n_tokens
        else:
            current += " " + segment
            current_tokens += n_tokens
    if current != "":
        chunks.append(current.strip())

    for chunk in chunks:
        n_tokens = len(tokenizer.encode(chunk.strip()))
        if n_tokens > max_tokens:
            logger.warning(
                "Chunk has %d tokens (max %d), generation may skip words: '%.50s...'",
                n_tokens,
                max_tokens,
                chunk,
            )
    return chunks


# --- streaming clause splitting

_SENTENCE_END = ".!?\u2026"
_CLAUSE_PUNCTUATION = ",;:\u2014\u2013"
_OPENERS = "\"'([{\u201c\u2018\u00ab\u00a1\u00bf"
# Punctuation that ends a first clause as soon as it follows a word of letters: there it cannot
# be inside a number, a URL or an abbreviation, as a period or colon can ("example.com", "Dr.").
_EARLY_CUT = ",;!?\u2026"
# Sentence marks that run together ("Really?!"): the rest of a run after an early cut.
_MARK_RUN = "!?\u2026"
# A period after these does not end a sentence. Dotted initialisms ("e.g.", "U.S.", "J.") are
# recognised by shape instead.
_ABBREVIATIONS = frozenset(
    {"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "approx", "cf", "fig"}
)
# Upper bound on tokens per character (a byte-fallback character is up to 4 byte tokens), so
# that short words skip the per-character token count.
_MAX_TOKENS_PER_CHAR = 4


_HOUSE_NUMBER = re.compile(r"\d{1,5}[A-Za-z]?")


def _last_word(buf: str, end: int) -> str:
    return buf[:end].rsplit(None, 1)[-1]


def _needs_next_char(buf: str, end: int) -> bool:
    """Whether the cut at the whitespace at `end` depends on the character after it."""
    return _last_word(buf, end).lower() in WORDS_BEFORE_NUMBERS


def _inside_number(buf: str, end: int) -> bool:
    """Whether the whitespace at `end` is inside a number, time, date, price or address.

    "3:45 pm", "November 30, 2026", "$ 12", "555 0123", "221B Baker Street", "5 km": a word with
    digits is never cut from the word after it, nor a month, currency or "No." from its number,
    nor a house number's street name from its next word.
    """
    words = buf[:end].rsplit(None, 2)[-2:]
    word = words[-1]
    core = word.rstrip(",;:")
    if core and core[-1].isalnum() and any(c.isdigit() for c in core):
        return True
    if len(words) == 2 and _HOUSE_NUMBER.fullmatch(words[0]) and word[:1].isupper():
        return True  # "221B Baker | Street"
    nxt = buf[end + 1 : end + 2]
    return nxt.isdigit() and word.lower() in WORDS_BEFORE_NUMBERS


def has_word(text: str) -> bool:
    """Whether `text` has anything to say: a letter or a digit. Punctuation, quotes or emoji
    alone have none (and the languages whose text rules delete quotes would prepare a lone
    quote to empty text)."""
    return any(c.isalnum() for c in text)


def _words(text: str) -> int:
    return sum(1 for word in text.split() if has_word(word))


def _is_abbreviation(core: str) -> bool:
    """Whether the period ending `core` closes an abbreviation rather than a sentence."""
    stem = core.split()[-1].lstrip(_OPENERS)[:-1].lower()
    if stem in _ABBREVIATIONS:
        return True
    parts = stem.split(".")
    return all(len(p) == 1 and p.isalpha() for p in parts)


class ClauseSplitter:
    """Cuts streamed text into clauses for synthesis.

    `push(text)` returns the clauses completed by `text`, `flush()` forces out whatever is
    buffered (an explicit boundary), `end()` returns the remainder at the end of input. The clauses
    depend only on the concatenated text and the positions of flushes, never on how the text was
    cut into pushes: every decision at a character looks only at the text up to that character
    (one character of lookahead at most), and is deferred until that text has arrived. The two
    exceptions depend on time and are asked for: the first clause's wait (below) and `cut_now()`.

    A clause ends at whitespace that follows sentence punctuation (. ! ? …, optionally followed by
    closing quotes/brackets), except after abbreviations ("Mr.", "e.g.", "etc.") and initials;
    a period without whitespace after it ("3.5", "a.b") never ends one. It also ends at whitespace
    after , ; : – — or a lone "-" (and right after an attached em dash, "this—that"). Such a
    boundary is taken only once the clause has `min_tokens` tokens (`comma_min_tokens` at clause
    punctuation); shorter pieces are merged with what follows, since the model does poorly on
    very short inputs. No clause exceeds `max_tokens`: a clause that would is cut at its last
    whitespace (inside a single word longer than that, at the last character that fits). No cut
    falls inside a number, time, date, price or address ("3:45 pm", "November 30, 2026", "221B
    Baker Street": `_inside_number`), unless one such span alone is over `max_tokens`. Clauses
    are stripped, and have a word: what a flush or the end leaves without one (the closing quote
    of '"Yes,"' after a first clause cut at its comma) is dropped, not spoken.

    The first clause (after construction or a flush) is the one the listener waits for, and the
    next clause chains onto it, so it may be short: it ends at the first boundary after
    `first_clause_min_words` words, and a comma, semicolon, "!", "?" or "\u2026" right after a
    word of letters ends it at once ("Hmm," "Sure!"), without the whitespace after it (what
    follows it, a closing quote say, goes with the next clause; more marks, the "!" of
    "Really?!", with none). If none comes within `first_clause_max_wait_ms` of its first text
    (by `clock`, in seconds; `extend_wait` lets it run longer), it ends at its last word
    boundary then (`poll()`, which a caller runs at `deadline`; `push` also checks), or, with no
    complete word yet, at the next word end. None: no wait limit.
    """

    def __init__(
        self,
        tokenizer: Encoder,
        *,
        min_tokens: int = 6,
        first_clause_min_words: int = FIRST_CLAUSE_MIN_WORDS,
        first_clause_max_wait_ms: float | None = None,
        comma_min_tokens: int | None = None,
        max_tokens: int = MAX_TOKENS_PER_CHUNK,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        comma_min_tokens = min_tokens if comma_min_tokens is None else comma_min_tokens
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        for name, value in (
            ("min_tokens", min_tokens),
            ("comma_min_tokens", comma_min_tokens),
        ):
            if not 1 <= value <= max_tokens:
                raise ValueError(f"{name} must be in [1, max_tokens={max_tokens}], got {value}")
        if first_clause_min_words < 1:
            raise ValueError(f"first_clause_min_words must be >= 1, got {first_clause_min_words}")
        if first_clause_max_wait_ms is not None and not first_clause_max_wait_ms >= 0:
            raise ValueError(
                f"first_clause_max_wait_ms must be >= 0 or None, got {first_clause_max_wait_ms}"
            )
        self._tokenizer = tokenizer
        self.min_tokens = min_tokens
        self.first_clause_min_words = first_clause_min_words
        self.first_clause_max_wait_ms = first_clause_max_wait_ms
        self.comma_min_tokens = comma_min_tokens
        self.max_tokens = max_tokens
        self.clock = clock
        self._buf = ""  # the clause being built (it starts at index 0), plus unscanned text
        self._pos = 0  # next index of _buf to decide on
        self._word_end: int | None = None  # last whitespace after a word in the clause
        self._soft_end: int | None = None  # last punctuation boundary in the clause, any length
        self._counts: dict[int, int] = {}  # token count of _buf[:j], per j, for this clause
        self._first = True
        self._first_text_at: float | None = None  # when the first clause's first text came
        # Seconds the first clause's wait runs past `first_clause_max_wait_ms` (`extend_wait`).
        self._wait_extended = 0.0
        self._mark_run = False  # an early cut at a sentence mark: more marks may follow

    @property
    def deadline(self) -> float | None:
        """When (by `clock`) the first clause's wait runs out; None if no wait is running."""
        if not self._first or self._first_text_at is None or self.first_clause_max_wait_ms is None:
            return None
        return self._first_text_at + self.first_clause_max_wait_ms / 1000 + self._wait_extended

    def extend_wait(self, seconds: float) -> None:
        """Let the first clause's wait run `seconds` past `first_clause_max_wait_ms` (for a
        caller that has started the clause the next whitespace would end: `Stream._guess`)."""
        self._wait_extended = seconds

    @property
    def holds_words(self) -> bool:
        """Whether complete words wait in the buffer for their clause to end."""
        return self._word_end is not None and has_word(self._buf[: self._word_end])

    @property
    def wait_cut(self) -> str | None:
        """The first clause the wait would cut if it ran out now, at its last word boundary
        (`poll`): the text so far less the word still coming. None for the clauses after the
        first, or with no complete word yet."""
        if not self._first or not self.holds_words:
            return None
        assert self._word_end is not None
        return self._buf[: self._word_end].strip()

    @property
    def draft(self) -> str | None:
        """The first clause's text so far, while it waits for its end, the word still coming
        included: the text it will most likely start with (None once it is cut, and for the
        clauses after it). An LLM's token most often ends its word ("Hi", " there", then "!"),
        so the clause that "!" ends has only "!" left to prefill; a word that goes on ("twel",
        "ve") costs the draft only its tokens that no longer start the clause."""
        if not self._first or not has_word(self._buf):
            return None
        return self._buf.rstrip()

    @property
    def likely_clause(self) -> str | None:
        """The first clause that whitespace arriving next would complete ("Okay." waiting to
        learn that it is not "Okay.com"): an LLM's next token most often starts with it. None
        for the clauses after the first, or if a space would complete no clause here."""
        if not self._first or not self._buf or self._buf[-1].isspace():
            return None
        probe = copy.copy(self)
        probe._counts = dict(self._counts)
        probe._first_text_at = None  # the text's own boundaries, not the wait's
        probe._buf += " "
        out = probe._scan(final=False)
        return out[0] if len(out) == 1 and not has_word(probe._buf) else None

    def push(self, text: str) -> list[str]:
        """Append text; return the clauses it completes."""
        out = self.poll()
        if self._first and self._first_text_at is None and text.strip():
            self._first_text_at = self.clock()
        self._buf += text
        return out + self._scan(final=False)

    def poll(self) -> list[str]:
        """The first clause, cut at its last word boundary, if its wait has run out."""
        if not self._timed_out() or not self.holds_words:
            return []
        assert self._word_end is not None
        out: list[str] = []
        self._emit(self._word_end, out)
        return out + self._scan(final=False)

    def cut_now(self) -> list[str]:
        """Cut at the best boundary there is, whatever the clause's length (for a caller whose
        audio is about to run out before the clause would end): its last clause punctuation if
        that keeps at least half its complete words, else its last word boundary. Never inside
        a word or a number."""
        end = self._word_end
        if end is None or not has_word(self._buf[:end]):
            return []
        soft = self._soft_end
        if soft is not None and 2 * _words(self._buf[:soft]) >= _words(self._buf[:end]):
            end = soft
        out: list[str] = []
        self._emit(end, out)
        return out + self._scan(final=False)

    def flush(self) -> list[str]:
        """Force out everything buffered, as clauses (cut only if over `max_tokens`).

        The next clause counts as a first clause again: after a flush the listener is likely
        waiting on it.
        """
        out = self._scan(final=True)
        self._first = True
        self._first_text_at = None
        self._wait_extended = 0.0
        return out

    def end(self) -> list[str]:
        """End of input: return the remainder. The splitter can then be reused for a new text."""
        return self.flush()

    def _timed_out(self) -> bool:
        deadline = self.deadline
        return deadline is not None and self.clock() >= deadline

    def _scan(self, final: bool) -> list[str]:
        out: list[str] = []
        while True:
            buf, i = self._buf, self._pos
            if i == len(buf):
                if final:
                    # The end of input ends the last word: it may overflow like any other.
                    over = self._overflow_cut(i) if buf and not buf[-1].isspace() else None
                    if over is not None:
                        self._emit(over, out)
                        continue
                    self._emit(len(buf), out)
                return out
            ch = buf[i]
            if self._mark_run:
                if ch in _MARK_RUN:
                    self._pos = i + 1
                    continue
                self._mark_run = False
                if i:  # the run after "Really?" goes with no clause: "!" alone says nothing
                    self._emit(i, out)
                    continue
            cut: int | None = None
            if ch.isspace():
                if i > 0 and not buf[i - 1].isspace():  # the end of a word
                    if i + 1 == len(buf) and not final and _needs_next_char(buf, i):
                        return out  # whether a digit follows decides; wait for it
                    cut = self._overflow_cut(i)
                    inside = _inside_number(buf, i)
                    if cut is None and not inside:
                        if self._is_boundary(i):
                            cut = i
                        elif self._timed_out() and has_word(buf[:i]):
                            cut = i  # the first clause's wait ran out before its first word end
                    if cut is None and not inside:
                        self._word_end = i
            elif self._word_end is None and self._word_overflows(i + 1):
                cut = i
            elif self._ends_right_after(i):
                cut = i + 1
            if cut is None:
                self._pos = i + 1
            else:
                self._emit(cut, out)
                self._mark_run = cut == i + 1 and ch in _MARK_RUN

    def _ends_right_after(self, i: int) -> bool:
        """Whether the clause ends right after the character at `i`, with no whitespace: an
        attached em dash ("this\u2014that"), or in a first clause a comma, semicolon, "!", "?"
        or "\u2026" closing a word of letters. There it cannot be inside a number ("1,000"), a
        URL or an abbreviation, so the first clause need not wait for the whitespace after it
        (an LLM's next token, 25 ms at 40 tokens/s)."""
        ch = self._buf[i]
        if ch == "\u2014":
            return self._long_enough(i + 1, sentence=False)
        if not (self._first and ch in _EARLY_CUT and i and not self._buf[i - 1].isspace()):
            return False
        word = _last_word(self._buf, i).lstrip(_OPENERS)
        return (
            word.replace("'", "").isalpha()
            and not _inside_number(self._buf, i + 1)
            and self._long_enough(i + 1, sentence=ch in _SENTENCE_END)
        )

    def _emit(self, end: int, out: list[str]) -> None:
        clause = self._buf[:end].strip()
        if has_word(clause):  # punctuation alone has nothing to say
            out.append(clause)
            self._first = False
        # The rest is rescanned as a new clause (after an overflow cut it holds the last word).
        self._mark_run = False
        self._buf = self._buf[end:]
        self._pos = 0
        self._word_end = None
        self._soft_end = None
        self._counts.clear()

    def _count(self, end: int) -> int:
        n = self._counts.get(end)
        if n is None:
            n = self._counts[end] = len(self._tokenizer.encode(self._buf[:end].strip()))
        return n

    def _threshold(self, sentence: bool) -> int:
        return self.min_tokens if sentence else self.comma_min_tokens

    def _overflow_cut(self, end: int) -> int | None:
        """Where to cut if the clause up to the word ending at `end` is over `max_tokens`."""
        if self._word_end is not None and self._count(end) > self.max_tokens:
            return self._word_end
        return None

    def _word_overflows(self, end: int) -> bool:
        """Whether the clause, a single word so far, is over `max_tokens` at `end`."""
        word = self._buf[:end].lstrip()
        if len(word) < 2 or len(word) * _MAX_TOKENS_PER_CHAR + 1 <= self.max_tokens:
            return False  # a single character is never cut off on its own
        return self._count(end) > self.max_tokens

    def _is_boundary(self, end: int) -> bool:
        """Whether the word ending at `end` ends the clause (the whitespace at `end` arrived).

        A boundary too short to be taken is remembered for `cut_now`."""
        core = self._buf[:end].rstrip(_CLOSERS)
        if not core:
            return False
        last = core[-1]
        if last in _SENTENCE_END:
            if last == "." and _is_abbreviation(core):
                return False
            sentence = True
        elif last in _CLAUSE_PUNCTUATION or (last == "-" and len(core) > 1 and core[-2].isspace()):
            sentence = False
        else:
            return False
        if self._long_enough(end, sentence):
            return True
        if has_word(self._buf[:end]):
            self._soft_end = end
        return False

    def _long_enough(self, end: int, sentence: bool) -> bool:
        """Whether the clause up to `end` may end there: it has words, and enough of them
        (`first_clause_min_words` in a first clause) or enough tokens (in the others)."""
        text = self._buf[:end]
        if not has_word(text):
            return False  # punctuation alone goes with the next clause
        if self._first:
            enough = _words(text) >= self.first_clause_min_words
        else:
            enough = self._threshold(sentence) <= self._count(end)
        return enough and self._count(end) <= self.max_tokens


def check_text(text: str) -> None:
    """Refuse what the tokenizer could not encode: not a str (TypeError), or a lone surrogate
    (InvalidTextError; a split UTF-16 pair, or undecodable bytes in argv). Caught where the
    text comes in, not by the tokenizer when its clause ends, which would fail the stream."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidTextError(
            f"text holds a lone surrogate at {e.start}: {ascii(text[:32])}"
        ) from None


def split_clauses(
    tokenizer: Encoder,
    text: str,
    *,
    min_tokens: int = 6,
    first_clause_min_words: int = FIRST_CLAUSE_MIN_WORDS,
    comma_min_tokens: int | None = None,
    max_tokens: int = MAX_TOKENS_PER_CHUNK,
) -> list[str]:
    """The clauses `ClauseSplitter` makes of `text` pushed at once then ended (a stream whose
    text all arrives within its first clause's wait makes the same)."""
    check_text(text)
    splitter = ClauseSplitter(
        tokenizer,
        min_tokens=min_tokens,
        first_clause_min_words=first_clause_min_words,
        comma_min_tokens=comma_min_tokens,
        max_tokens=max_tokens,
    )
    return splitter.push(text) + splitter.end()


class SpeakingModel(Protocol):
    """What planning a clause reads of a loaded model (`loading.LoadedModel`)."""

    tokenizer: Tokenizer
    config: Config
    text_options: TextOptions
    language: str


def plan_clause(loaded: SpeakingModel, clause: str, options: GenerationOptions) -> ClausePlan:
    """A clause as the engine speaks it: its prompt tokens (spoken form first) and frame budget."""
    # Spoken form first: "$1,234.56" is a dozen words, and the frame budget follows the tokens.
    if options.normalize:
        clause = normalize_text(clause, loaded.language) or clause
    tokens, frames_after_eos_guess = prompt_tokens(loaded.tokenizer, clause, loaded.text_options)
    frames = max_gen_len(len(tokens), loaded.config.mimi.frame_rate)
    if options.max_frames is not None:
        frames = min(frames, options.max_frames)
    if options.frames_after_eos is not None:
        after_eos = options.frames_after_eos
    elif loaded.config.model_recommended_frames_after_eos is not None:
        after_eos = loaded.config.model_recommended_frames_after_eos
    else:
        after_eos = frames_after_eos_guess
    return ClausePlan(tokens, frames, after_eos)
