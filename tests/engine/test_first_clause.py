"""The first-clause policy (`first_clause_min_words`, `first_clause_max_wait_ms`) and bad input
streamed the way an LLM streams it: the splitter on an injected clock, then the engine's streams,
whose timer cuts the first clause even when no more text comes."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from intone.engine import AudioChunk, ClauseDone, Engine, EngineConfig, GenerationOptions, Stream
from intone.engine import stream as stream_module
from intone.engine.config import DRAFT_BEFORE_WAIT_ENDS_S
from intone.engine.errors import EngineClosedError, InvalidOptionError
from intone.engine.loading import LoadedModel, load_model
from intone.engine.request import Draft, Ending, Request
from intone.engine.text import ClauseSplitter, plan_clause, split_clauses

from support.checkpoints import checkpoint
from support.engine import voice_pages, wait_idle

NO_EOS = 1e9
TOKEN_S = 0.025  # an LLM at 40 tokens/s


def llm_tokens(text: str) -> list[str]:
    """Text split as chat models stream it: a word with its leading space, punctuation alone."""
    return re.findall(r"\s*[\w']+|\s*[^\w\s]|\s+", text)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def splitter(loaded: LoadedModel, clock: Clock, **policy) -> ClauseSplitter:
    policy.setdefault("first_clause_max_wait_ms", 100.0)
    return ClauseSplitter(loaded.tokenizer, clock=clock, **policy)


def stream_tokens(sp: ClauseSplitter, clock: Clock, tokens: list[str], step: float = TOKEN_S):
    """Push tokens `step` apart, polling the timer between them as a stream's timer would."""
    out: list[str] = []
    for token in tokens:
        out += sp.push(token)
        clock.now += step
        out += sp.poll()
    return out + sp.end()


def assert_words_kept(text: str, clauses: list[str]) -> None:
    """No word lost, duplicated or cut in two, in order."""
    assert " ".join(clauses).split() == text.split(), clauses


# ---- the policy, on an injected clock


def test_first_clause_ends_at_the_first_boundary_after_min_words(tiny_model: LoadedModel):
    text = "Hmm, I don't see a reservation under that name. Could you spell your last name?"
    clock = Clock()
    one = stream_tokens(
        splitter(tiny_model, clock, first_clause_min_words=1), clock, llm_tokens(text)
    )
    assert one[0] == "Hmm,"
    clock = Clock()
    three = splitter(tiny_model, clock, first_clause_min_words=3, first_clause_max_wait_ms=None)
    clauses = stream_tokens(three, clock, llm_tokens(text))
    assert clauses[0] == "Hmm, I don't see a reservation under that name."
    for split in (one, clauses):
        assert_words_kept(text, split)
    # Pushed at once, the same clauses as one-shot splitting.
    assert split_clauses(tiny_model.tokenizer, text, first_clause_min_words=3) == clauses


def test_first_clause_is_cut_at_its_last_word_boundary_when_the_wait_runs_out(
    tiny_model: LoadedModel,
):
    clock = Clock()
    sp = splitter(tiny_model, clock, first_clause_min_words=3, first_clause_max_wait_ms=100)
    assert sp.deadline is None  # the wait starts with the first text
    assert sp.push("   ") == [] and sp.deadline is None  # whitespace is not text
    assert sp.push(" I checked your acc") == []
    assert sp.deadline == pytest.approx(0.1)
    clock.now = 0.099
    assert sp.poll() == []
    clock.now = 0.1
    assert sp.poll() == ["I checked your"]  # "acc" may go on: never cut inside a word
    assert sp.deadline is None and sp.poll() == []
    assert sp.push("ount and booked the room for you.") == []
    assert sp.end() == ["account and booked the room for you."]


def test_a_wait_that_runs_out_before_the_first_word_ends_cuts_at_its_end(
    tiny_model: LoadedModel,
):
    clock = Clock()
    sp = splitter(tiny_model, clock, first_clause_min_words=2)
    assert sp.push("Supercalifragilistic") == []
    clock.now = 1.0
    assert sp.poll() == []  # no word boundary yet
    assert sp.push("expialidocious is a word") == ["Supercalifragilisticexpialidocious"]
    assert sp.end() == ["is a word"]


@pytest.mark.parametrize(
    "text, split_at, first",
    [
        ("On November 30, 2026 we open the new office downtown", "2026", "On"),
        ("On November 30, 2026 we open the new office downtown", "26 we", "On"),
        ("It costs $42.50 today for the whole family", ".50", "It costs"),
        ("Meet me at 3:45 pm near the fountain", " pm", "Meet me at"),
        ("Go to example.com/book now please", "/book", "Go to"),
        ("We live at 221B Baker Street in London", " Street", "We live at"),
    ],
)
def test_the_wait_never_cuts_inside_a_number_date_price_or_address(
    tiny_model: LoadedModel, text: str, split_at: str, first: str
):
    # The wait runs out with part of the span in the buffer: the cut falls before the span.
    k = text.index(split_at) + 1
    clock = Clock()
    sp = splitter(tiny_model, clock, first_clause_min_words=50)
    assert sp.push(text[:k]) == []
    clock.now = 1.0
    assert sp.poll() == [first]
    assert_words_kept(text, [first, *sp.push(text[k:]), *sp.end()])


# ---- bad input (issue 47, item 5)


TURN = (
    "Let me check that for you. Your table for 4 is booked at 7:30 pm on Friday, "
    "and the deposit of $42.50 was charged to the card ending in 1234."
)


def test_one_character_per_token(tiny_model: LoadedModel):
    clock = Clock()
    sp = splitter(tiny_model, clock, first_clause_min_words=50)
    clauses = stream_tokens(sp, clock, list(TURN), step=0.01)
    assert_words_kept(TURN, clauses)
    # The wait ran out once, 100 ms (ten characters) in: "Let me" was all it had.
    assert clauses[0] == "Let me"
    assert "$42.50" in " ".join(clauses) and "7:30 pm" in " ".join(clauses)


def test_whitespace_only_tokens(tiny_model: LoadedModel):
    clock = Clock()
    sp = splitter(tiny_model, clock)
    # Every word's leading space as whitespace-only tokens of its own, some doubled.
    tokens = [" ", "\n", "  "]
    for token in llm_tokens(TURN):
        if token[0].isspace():
            tokens += [" ", "\n\n", " "]
        tokens.append(token.strip())
    clauses = stream_tokens(sp, clock, tokens)
    assert_words_kept(TURN, clauses)
    assert all(c == c.strip() and c for c in clauses)
    # Whitespace alone never starts the wait, nor makes a clause.
    clock2 = Clock()
    idle = splitter(tiny_model, clock2)
    assert stream_tokens(idle, clock2, [" ", "\n", "\t "] * 20) == []
    assert idle.deadline is None


def test_a_2000_character_word(tiny_model: LoadedModel):
    word = "abcdefghij" * 200
    clock = Clock()
    sp = splitter(tiny_model, clock)
    tokens = [" Well", ",", " the", " code", " is", " "]
    tokens += [word[i : i + 7] for i in range(0, len(word), 7)] + [".", " Done", "."]
    clauses = stream_tokens(sp, clock, tokens)
    assert clauses[0] == "Well,"
    # The word alone is over max_tokens, so it is cut where it must be, and only there.
    joined = "".join(clauses[1:])
    assert joined.replace(" ", "") == "thecodeis" + word + ".Done."
    assert all(len(tiny_model.tokenizer.encode(c)) <= sp.max_tokens for c in clauses)


def test_a_number_split_across_tokens(tiny_model: LoadedModel):
    for text in ("42.50 is the total, sir.", "The total is 42.50 today."):
        tokens = llm_tokens(text)
        number = tokens.index("42") if "42" in tokens else tokens.index(" 42")
        tokens[number : number + 1] = [tokens[number][:-2], "4", "2"]
        tokens = [t for t in tokens if t]
        assert "".join(tokens) == text and {"4", "2", ".", "50"} <= set(tokens)
        tokens[tokens.index("50")] = "5"
        tokens.insert(tokens.index("5") + 1, "0")
        for step in (0.001, 0.03, 1.0):  # the wait runs out before, inside, after the number
            clock = Clock()
            clauses = stream_tokens(splitter(tiny_model, clock), clock, tokens, step)
            assert_words_kept(text, clauses)
            assert sum("42.50" in c for c in clauses) == 1, clauses


def test_a_turn_that_flushes_after_one_word(tiny_model: LoadedModel):
    clock = Clock()
    sp = splitter(tiny_model, clock, first_clause_min_words=3)
    assert sp.push(" Okay") == []
    assert sp.flush() == ["Okay"]
    assert sp.deadline is None  # the next first clause's wait starts with its text
    clock.now = 5.0
    assert sp.push(" so") == [] and sp.deadline == pytest.approx(5.1)
    clock.now = 5.2
    # After a flush, a first clause again: its wait ran out, so its first word end cuts it.
    assert sp.push(" the thing is") == ["so"]
    assert sp.end() == ["the thing is"]


def test_a_stall_of_10_s_cuts_once(tiny_model: LoadedModel):
    text = "I looked everywhere for your order and I found it in the back room. It ships today."
    tokens = llm_tokens(text)
    clock = Clock()
    sp = splitter(tiny_model, clock, first_clause_min_words=50)
    out: list[str] = []
    for i, token in enumerate(tokens):
        out += sp.push(token)
        clock.now += 10.0 if i == 3 else TOKEN_S  # the LLM stalls 10 s after 4 tokens
        out += sp.poll()
        if i == 3:
            assert out == ["I looked everywhere"]  # cut once, at the last word boundary
    out += sp.end()
    assert_words_kept(text, out)
    assert out[0] == "I looked everywhere"
    # The rest is the turn's later clauses, cut at sentence ends as any later clause is.
    assert out[1:] == ["for your order and I found it in the back room.", "It ships today."]


def test_the_policy_options_are_checked_like_every_other():
    GenerationOptions(first_clause_min_words=1, first_clause_max_wait_ms=0)
    GenerationOptions(first_clause_min_words=50, first_clause_max_wait_ms=10_000)
    for name, bad in (
        ("first_clause_min_words", 0),
        ("first_clause_min_words", 51),
        ("first_clause_min_words", 2.5),
        ("first_clause_min_words", None),
        ("first_clause_max_wait_ms", -1),
        ("first_clause_max_wait_ms", 10_001),
        ("first_clause_max_wait_ms", float("nan")),
        ("first_clause_max_wait_ms", "100"),
    ):
        with pytest.raises(InvalidOptionError, match=name):
            GenerationOptions(**{name: bad})


# ---- through the engine: the timer fires on its own


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> Iterator[Engine]:
    engine = Engine(load_model(tiny_checkpoint), EngineConfig(num_pages=512, lead_s=None)).start()
    yield engine
    engine.close()


def options(**policy) -> GenerationOptions:
    return GenerationOptions(temperature=0.0, eos_threshold=NO_EOS, max_frames=6, seed=1, **policy)


async def next_done(events: list, it) -> ClauseDone:
    async with asyncio.timeout(30):
        async for event in it:
            events.append(event)
            if isinstance(event, ClauseDone):
                return event
    raise AssertionError("the stream ended without a clause")


async def test_the_wait_cuts_the_first_clause_with_no_more_text(engine: Engine):
    stream = engine.stream(None, options(first_clause_min_words=50, first_clause_max_wait_ms=50))
    events: list = []
    it = stream.__aiter__()
    stream.push_text(" I checked your acc")
    # No more text and no end: the stream's own timer cuts at the last word boundary.
    first = await next_done(events, it)
    assert first.text == "I checked your"
    stream.push_text("ount and it is fine.")
    stream.end_input()
    async with asyncio.timeout(30):
        events += [event async for event in it]
    done = [e for e in events if isinstance(e, ClauseDone)]
    assert [d.text for d in done] == ["I checked your", "account and it is fine."]
    words = [w for d in done for w in d.words]
    assert " ".join(w.word for w in words) == "I checked your account and it is fine."
    assert all(a.end <= b.start + 1e-9 for a, b in zip(words, words[1:], strict=False))
    assert any(isinstance(e, AudioChunk) for e in events)


@pytest.mark.parametrize("preset", ["tiny", "tiny-spanish"])
async def test_a_clause_with_nothing_to_say_is_not_spoken(
    preset: str,
    tiny_checkpoint: Path,
    family_checkpoints: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
):
    """A first clause cut at a comma leaves the closing quote of '"Sí,"' for the end: a clause of
    punctuation alone, which Spanish's text rules (they delete quotes) would even make empty.
    Such a clause is not spoken; the turn ends as usual, and a turn of nothing but punctuation
    ends with no audio."""
    path = (
        tiny_checkpoint
        if preset == "tiny"
        else checkpoint(family_checkpoints, preset, tmp_path_factory)
    )
    engine = Engine(load_model(path), EngineConfig(lead_s=None)).start()
    try:
        for text, spoken in (
            ('"Sí," dijo. "Vale."', ['"Sí,', '" dijo. "Vale."']),
            ('"Sí,"', ['"Sí,']),
            ('"Sí,"!? ', ['"Sí,']),
            ("...", []),
        ):
            stream = engine.stream(None, options())
            for token in llm_tokens(text):
                stream.push_text(token)
            stream.end_input()
            async with asyncio.timeout(30):
                events = [event async for event in stream]
            assert [e.text for e in events if isinstance(e, ClauseDone)] == spoken, text
            assert any(isinstance(e, AudioChunk) for e in events) == bool(spoken), text
    finally:
        engine.close()


async def test_a_stall_mid_turn_cuts_once_and_the_turn_goes_on(engine: Engine):
    """A short wait and a stall many times longer (the 10 s stall, scaled down)."""
    text = "So I looked into it and the order is on its way, it should arrive on Monday."
    tokens = llm_tokens(text)
    stream = engine.stream(None, options(first_clause_min_words=50, first_clause_max_wait_ms=30))
    for token in tokens[:4]:
        stream.push_text(token)
    await asyncio.sleep(0.4)
    for token in tokens[4:]:
        stream.push_text(token)
    stream.end_input()
    async with asyncio.timeout(60):
        events = [event async for event in stream]
    done = [e for e in events if isinstance(e, ClauseDone)]
    assert done[0].text == "So I looked"
    assert_words_kept(text, [d.text for d in done])
    words = [w for d in done for w in d.words]
    assert [w.word for w in words] == text.split()
    assert all(a.start <= a.end <= b.start + 1e-9 for a, b in zip(words, words[1:], strict=False))


# ---- seams (issue 47, item 4)


def assert_seamless(audio: np.ndarray, seams: list[int]) -> None:
    """No jump at a seam larger than the largest sample-to-sample step inside the clauses, and
    the spectral flux of every frame across a seam within the 99th percentile of the turn's."""
    steps = np.abs(np.diff(audio))
    inside = np.ones(len(steps), dtype=bool)
    inside[[s - 1 for s in seams]] = False
    largest = steps[inside].max()
    for seam in seams:
        assert steps[seam - 1] <= largest, (seam, steps[seam - 1], largest)
    win, hop = 960, 480  # 40 ms windows, 20 ms apart
    starts = np.arange(0, len(audio) - win, hop)
    spectra = np.abs(np.fft.rfft(audio[starts[:, None] + np.arange(win)] * np.hanning(win)))
    flux = np.sqrt((np.maximum(spectra[1:] - spectra[:-1], 0) ** 2).sum(axis=1))
    limit = np.percentile(flux, 99)
    for seam in seams:
        across = [i for i, start in enumerate(starts[1:]) if start < seam < start + win]
        assert across and flux[across].max() <= limit, (seam, flux[across].max(), limit)


async def seam_turn(engine: Engine) -> tuple[np.ndarray, list[ClauseDone]]:
    """A turn cut by the policy both ways: a one-word first clause ("Hmm,"); then, after a
    flush, a first clause cut by its wait in mid-sentence; then later clauses."""
    stream = engine.stream(
        None, GenerationOptions(temperature=0.0, seed=4, max_frames=20, first_clause_max_wait_ms=20)
    )
    events: list = []
    it = stream.__aiter__()
    for token in llm_tokens("Hmm, I don't see a reservation under that name."):
        stream.push_text(token)
    stream.flush()
    await next_done(events, it)
    await next_done(events, it)
    stream.push_text(" Could you spell your")
    assert (await next_done(events, it)).text == "Could you spell"  # the wait's cut
    for token in llm_tokens(" last name for me, please? I will look again."):
        stream.push_text(token)
    stream.end_input()
    async with asyncio.timeout(60):
        events += [event async for event in it]
    audio = np.concatenate([e.samples for e in events if isinstance(e, AudioChunk)])
    return audio, [e for e in events if isinstance(e, ClauseDone)]


async def test_seams_of_a_turn_cut_by_the_policy_are_continuous(engine: Engine):
    audio, done = await seam_turn(engine)
    assert done[0].text == "Hmm,"
    assert len(done) >= 5
    seams = [d.start_sample for d in done[1:]]
    assert_seamless(audio, seams)
    # The check can fail: the same audio with 10 ms of silence at a seam, or with the rest of
    # the turn's waveform flipped there (a jump), is not seamless.
    for broken in (
        np.concatenate([audio[: seams[1]], np.zeros(240, np.float32), audio[seams[1] :]]),
        np.concatenate([audio[: seams[1]], -audio[seams[1] :]]),
    ):
        with pytest.raises(AssertionError):
            assert_seamless(broken, seams[:2])


async def test_seams_are_continuous_at_full_size(full_checkpoint: Path):
    """The same at the full-size architecture (random weights), temperature 0."""
    engine = Engine(load_model(full_checkpoint), EngineConfig(num_pages=512, lead_s=None)).start()
    try:
        audio, done = await seam_turn(engine)
    finally:
        engine.close()
    assert_seamless(audio, [d.start_sample for d in done[1:]])


# ---- the deadline rule (issue 47, item 3)


def test_cut_now_takes_the_best_boundary_there_is(tiny_model: LoadedModel):
    sp = ClauseSplitter(tiny_model.tokenizer, first_clause_min_words=1)
    assert sp.push("Sure. ") == ["Sure."]
    assert sp.cut_now() == []  # nothing held
    assert sp.push("Well, I think that we") == []  # "Well," is too short for a later clause
    assert sp.cut_now() == ["Well, I think that"]  # the comma keeps under half the words
    assert sp.push(" do, I am look") == []
    assert sp.cut_now() == ["we do,"]  # "I am" waits: the comma keeps half the words
    assert sp.push("ing at 3:45 p") == []
    assert sp.cut_now() == ["I am looking at"]  # never inside "3:45 pm"
    assert sp.end() == ["3:45 p"]


def played(events: list) -> float:
    return sum(len(e.samples) for e in events if isinstance(e, AudioChunk)) / 24000


async def test_the_deadline_rule_cuts_before_the_audio_runs_out(engine: Engine):
    """Every clause given is spoken and the next is not complete: it is cut once the audio left
    is within `cut_before_dry_s`, on its own timer or at a playback report, and not before."""
    margin = engine.config.cut_before_dry_s
    assert margin is not None
    stream = engine.stream(None, options(first_clause_min_words=1))
    stream.report_playback(0.0)  # the listener's position is what it reports
    events: list = []
    it = stream.__aiter__()
    for token in llm_tokens("Sure. I am looking"):
        stream.push_text(token)
    assert (await next_done(events, it)).text == "Sure."
    # 480 ms of audio, little played: the words wait (their timer is 100 ms away).
    assert stream.metrics.clauses == 1
    stream.report_playback(played(events) - margin - 0.1)
    assert stream.metrics.clauses == 1
    stream.report_playback(played(events) - margin + 0.01)  # now within the margin
    assert stream.metrics.clauses == 2
    assert (await next_done(events, it)).text == "I am"  # "looking" may go on
    # On its own timer this time: 100 ms before the margin.
    stream.push_text(" for the booking you made")
    stream.report_playback(played(events) - margin - 0.1)
    assert stream.metrics.clauses == 2
    assert (await next_done(events, it)).text == "looking for the booking you"
    stream.push_text(" yesterday.")
    stream.end_input()
    async with asyncio.timeout(30):
        events += [event async for event in it]
    done = [e for e in events if isinstance(e, ClauseDone)]
    assert_words_kept(
        "Sure. I am looking for the booking you made yesterday.", [d.text for d in done]
    )


# ---- drafts: the first clause's prompt pass begins before the clause is cut

# No timer cut while a test looks at a first clause's head start (a draft, a guess); and with
# ONE_CLAUSE, no cut at a mark either: the whole text is one clause.
WAIT = options(first_clause_max_wait_ms=10_000)
ONE_CLAUSE = options(first_clause_min_words=50, first_clause_max_wait_ms=10_000)


async def spoken(stream: Stream) -> np.ndarray:
    async with asyncio.timeout(30):
        return np.concatenate([e.samples async for e in stream if isinstance(e, AudioChunk)])


def test_the_splitter_drafts_the_first_clause_with_the_word_still_coming(
    tiny_model: LoadedModel,
):
    clock = Clock()
    sp = splitter(tiny_model, clock, first_clause_min_words=50)
    assert sp.draft is None
    sp.push(" ")
    assert sp.draft is None  # nothing to say yet
    sp.push("I checked your acc")
    assert sp.draft == " I checked your acc"  # the word still coming too
    sp.push(" ")
    assert sp.draft == " I checked your acc"
    clock.now += 0.1
    assert sp.poll() == ["I checked your acc"]
    assert sp.draft is None  # cut: only a first clause has a draft
    sp.push("ount and it is")
    assert sp.draft is None
    sp.flush()
    sp.push(" Then mo")
    assert sp.draft == " Then mo"  # after a flush the next clause is a first clause again


def test_the_splitter_says_where_its_wait_would_cut_the_first_clause(tiny_model: LoadedModel):
    clock = Clock()
    sp = splitter(tiny_model, clock, first_clause_min_words=50)
    sp.push(" Your total")
    assert sp.wait_cut == "Your"  # "total" may go on ("totally")
    sp.push(" comes to")
    assert sp.wait_cut == "Your total comes"
    sp.push(" $42.")
    assert sp.wait_cut == "Your total comes to"  # "$42." may go on ("$42.50")
    clock.now += 0.1
    assert sp.poll() == ["Your total comes to"]  # where it said
    assert sp.wait_cut is None  # cut: only a first clause waits


async def written(stream: Stream) -> None:
    """Until the stream's draft is in its pages."""
    async with asyncio.timeout(30):
        while (draft := stream.request.draft) is None or draft.written != draft.tokens:
            await asyncio.sleep(0.002)


async def drafts_written(stream: Stream) -> None:
    """Until the stream's draft, if it has one now, is in its pages."""
    async with asyncio.timeout(30):
        while (draft := stream.request.draft) is not None and draft.written != draft.tokens:
            await asyncio.sleep(0.002)


async def drafted_turn(engine: Engine, words: str, rest: str) -> tuple[np.ndarray, int, bool]:
    """`words` pushed a word at a time, each drafted before the next comes, then `rest`, which
    ends the first clause: the audio, how many of its tokens the draft had prefilled, and
    whether the clause's first step was prepared with them (`Ending`)."""
    stream = engine.stream(None, ONE_CLAUSE)
    for token in llm_tokens(words):
        stream.push_text(token)
        await drafts_written(stream)
    stream.push_text(rest)
    stream.end_input()
    audio = await spoken(stream)
    return audio, stream.metrics.draft_tokens, stream.metrics.first_step_prepared


async def said_at_once(
    engine: Engine, text: str, options: GenerationOptions = ONE_CLAUSE
) -> np.ndarray:
    stream = engine.stream(None, options)
    stream.push_text(text)
    stream.end_input()
    return await spoken(stream)


async def test_a_drafted_first_clause_says_what_it_would_have_said(make_engine):
    # float32 (make_engine's): a prompt pass split in two gives what one pass gives, to
    # rounding, where a word changed moves the audio by 100 times more.
    engine = make_engine(second_voice=False, lead_s=None)
    pages = engine.blocks.pages_in_use
    words, rest = " I checked with our", " warehouse team."
    drafted, reused, prepared = await drafted_turn(engine, words, rest)
    at_once = await said_at_once(engine, words + rest)
    assert drafted.shape == at_once.shape
    np.testing.assert_allclose(drafted, at_once, rtol=0, atol=1e-6)
    tokens = plan_clause(engine.loaded, (words + rest).strip(), options()).tokens
    # The clause's own pass wrote what the draft had not, on the draft's first tokens; or, where
    # the AR thread took the whole text's draft before the cut reached it (a race with the
    # event loop), its ending pass did, on the same tokens, and prepared the first step.
    assert 0 < reused <= len(tokens)
    assert (reused == len(tokens)) == prepared
    assert engine.blocks.pages_in_use == pages  # the draft's pages went back with the stream


async def test_a_drafted_word_that_goes_on_keeps_what_it_shares(make_engine):
    """The draft takes the word still coming ("twel"); when the next token finishes the word
    ("ve."), the draft grows on what it shares, and the clause says what it would have said."""
    engine = make_engine(second_voice=False, lead_s=None)
    pages = engine.blocks.pages_in_use
    stream = engine.stream(None, ONE_CLAUSE)
    stream.push_text(" Your total comes to twel")
    await written(stream)
    drafted = plan_clause(engine.loaded, "Your total comes to twel", ONE_CLAUSE).tokens[:-1]
    assert stream.request.draft is not None
    assert stream.request.draft.written == drafted  # the word still coming is prefilled
    stream.push_text("ve.")
    await written(stream)
    clause = plan_clause(engine.loaded, "Your total comes to twelve.", ONE_CLAUSE).tokens
    assert stream.request.draft.written == clause[:-1]  # grown by what the word added
    await ending_prepared(stream)  # and, as a whole clause, prepared on what it shares
    stream.end_input()
    audio = await spoken(stream)
    at_once = await said_at_once(engine, " Your total comes to twelve.")
    np.testing.assert_allclose(audio, at_once, rtol=0, atol=1e-6)
    # Every token, and the first step, came from the draft and its ending.
    assert stream.metrics.draft_tokens == len(clause)
    assert stream.metrics.first_step_prepared
    assert engine.blocks.pages_in_use == pages


async def test_a_first_clause_drafted_a_character_at_a_time_says_what_it_would_have_said(
    make_engine,
):
    """Every character a token: the drafts take partial words, numbers, times, prices, an e-mail
    and a URL ("$42.", "jane.doe@ex", "https://ex"), each planned or skipped, never a failed
    push; the clause says what it says at once."""
    engine = make_engine(second_voice=False, lead_s=None)
    pages = engine.blocks.pages_in_use
    text = " Table for 4 at 7:30 pm, $42.50 paid; mail jane.doe@example.com or see https://ex.io/a?b=1."
    stream = engine.stream(None, ONE_CLAUSE)
    for character in text:
        stream.push_text(character)
        await drafts_written(stream)
    stream.end_input()
    audio = await spoken(stream)
    np.testing.assert_allclose(audio, await said_at_once(engine, text), rtol=0, atol=1e-6)
    assert stream.metrics.draft_tokens > 0
    assert engine.blocks.pages_in_use == pages


async def test_a_draft_the_clause_parts_from_keeps_only_what_they_share(make_engine):
    engine = make_engine(second_voice=False, lead_s=None)
    pages = engine.blocks.pages_in_use
    stream = engine.stream(None, ONE_CLAUSE)
    engine.stream_host.draft(stream.request, "Your total goes up", "Your total goes up")
    await written(stream)
    stream.push_text(" Your total comes to twelve.")
    stream.end_input()
    audio = await spoken(stream)
    at_once = await said_at_once(engine, " Your total comes to twelve.")
    np.testing.assert_allclose(audio, at_once, rtol=0, atol=1e-6)
    assert stream.metrics.draft_tokens > 0
    assert engine.blocks.pages_in_use == pages


async def test_a_stream_cancelled_while_its_first_clause_is_drafted_leaves_no_pages(
    engine: Engine,
):
    pages = engine.blocks.pages_in_use
    stream = engine.stream(None, ONE_CLAUSE)
    stream.push_text(" I checked your account and")
    await written(stream)
    assert engine.blocks.pages_in_use > pages  # the draft holds pages of its own
    stream.cancel()
    async with asyncio.timeout(30):
        while engine.blocks.pages_in_use != pages:
            await asyncio.sleep(0.01)


async def test_a_clause_short_of_pages_takes_them_from_other_streams_drafts(make_engine):
    """A pool with pages for one clause: a draft of another stream holds some, and the clause
    still starts (a draft is only a head start); the drafted stream then speaks too."""
    sizing = make_engine(second_voice=False)
    voice = sizing.default_voice
    text = " Your table for four is ready by the window, and the menu is on its way."
    tokens = plan_clause(sizing.loaded, text, ONE_CLAUSE).tokens
    clause = sizing.scheduler.clause_pages(voice, len(tokens), ONE_CLAUSE.max_frames)
    pages = sizing.blocks.pages_for(sizing.scheduler.voices[voice].length) + clause
    engine = make_engine(second_voice=False, num_pages=pages)
    drafted = engine.stream(None, ONE_CLAUSE)
    drafted.push_text(" I checked your account and")
    await written(drafted)
    assert engine.blocks.pages_available < clause  # the draft holds pages the clause needs
    other = engine.stream(None, ONE_CLAUSE)
    other.push_text(text)
    other.end_input()
    async with asyncio.timeout(30):
        assert [e async for e in other if isinstance(e, AudioChunk)]
    drafted.push_text(" it is fine.")
    drafted.end_input()
    async with asyncio.timeout(30):
        assert [e async for e in drafted if isinstance(e, AudioChunk)]
    await wait_idle(engine, voice_pages(engine))


# ---- a first clause guessed at its period, heard once the next token confirms it


def test_the_splitter_says_which_first_clause_a_space_would_end(tiny_model: LoadedModel):
    clock = Clock()
    sp = splitter(tiny_model, clock)
    sp.push("Okay")
    assert sp.likely_clause is None  # a word may go on
    sp.push(".")
    assert sp.likely_clause == "Okay."
    assert sp.push(" Let") == ["Okay."]
    assert sp.likely_clause is None  # only the first clause is guessed
    for text in ("Dr.", "No.", "Wait"):  # an abbreviation, before a number, a word
        sp = splitter(tiny_model, Clock())
        sp.push(text)
        assert sp.likely_clause is None, text


@pytest.mark.parametrize(
    "text",
    [
        "Okay. Let me pull up your account.",
        "Got it. Your appointment is at 10:15 am.",
        "Visit google.com today, or call.",
        'She said "Fine." and left.',
        "Here's the thing: it is late.",
    ],
)
def test_a_guessed_first_clause_is_the_one_a_space_ends(tiny_model: LoadedModel, text: str):
    """Whatever follows, the guess is the first clause the splitter gives out whenever the
    next character is whitespace, and only then."""
    tokens = llm_tokens(text)
    for n in range(1, len(tokens)):
        sp = splitter(tiny_model, Clock(), first_clause_max_wait_ms=None)
        out = [clause for token in tokens[:n] for clause in sp.push(token)]
        guess = sp.likely_clause
        if out or guess is None:
            continue
        rest = "".join(tokens[n:])
        assert (sp.push(rest)[:1] == [guess]) == rest[:1].isspace(), (tokens[:n], rest)


def test_an_extended_wait_lets_the_text_end_the_first_clause_later(tiny_model: LoadedModel):
    clock = Clock()
    sp = splitter(tiny_model, clock)
    assert sp.push(" Let me see.") == []
    sp.extend_wait(0.05)
    clock.now += 0.12
    assert sp.poll() == []  # the wait runs on
    assert sp.push(" The") == ["Let me see."]  # the whitespace ends it at its period
    sp.flush()
    sp.push(" Let me see.")
    clock.now += 0.12
    assert sp.poll() == ["Let me"]  # a flush ended the extension: its wait ran out


@pytest.mark.parametrize("grace_s, first", [(10.0, "Let me see."), (0.0, "Let me")])
async def test_a_guess_pending_as_the_wait_ends_gives_its_text_the_grace(
    make_engine, monkeypatch, grace_s: float, first: str
):
    """ "Let me see." is guessed; the wait runs out before the whitespace after it comes. With
    `GUESS_GRACE_S` to spare, the whitespace confirms the guess (its audio was on its way);
    with none, the wait cuts a word earlier and the guess goes unheard."""
    monkeypatch.setattr(stream_module, "GUESS_GRACE_S", grace_s)
    engine = make_engine(second_voice=False, lead_s=None)
    pages = voice_pages(engine)
    stream = engine.stream(None, options(first_clause_max_wait_ms=50))
    guessed = stream.request
    for token in llm_tokens("Let me see."):
        stream.push_text(token)
    await asyncio.sleep(0.2)
    stream.push_text(" The end.")
    stream.end_input()
    async with asyncio.timeout(30):
        said = [e.text async for e in stream if isinstance(e, ClauseDone)]
    assert said[0] == first
    assert (stream.request is guessed) == (first == "Let me see.")
    await wait_idle(engine, pages)


async def heard_after_guess(engine: Engine, before: str, after: str) -> tuple[Stream, Request]:
    """A stream given `before` as LLM tokens, its guessed first clause's audio made (and not
    heard) before `after` comes; and the request that guessed."""
    stream = engine.stream(None, WAIT)
    guessed = stream.request
    for token in llm_tokens(before):
        stream.push_text(token)
    async with asyncio.timeout(30):
        while guessed.frames_delivered == 0:
            await asyncio.sleep(0.002)
    with pytest.raises(TimeoutError):  # made, and held back
        async with asyncio.timeout(0.2):
            await anext(stream)
    stream.push_text(after)
    stream.end_input()
    return stream, guessed


async def test_a_first_clause_guessed_at_its_period_says_what_it_would_have_said(make_engine):
    engine = make_engine(second_voice=False, lead_s=None)
    pages = voice_pages(engine)
    text = "Okay. Let me pull up your account."
    stream, guessed = await heard_after_guess(engine, "Okay.", text.removeprefix("Okay."))
    audio = await spoken(stream)
    np.testing.assert_allclose(audio, await said_at_once(engine, text, WAIT), rtol=0, atol=1e-6)
    assert stream.request is guessed  # confirmed: the guess was the clause
    await wait_idle(engine, pages)


async def test_a_guess_the_text_parts_from_is_never_heard(make_engine):
    """ "google." was "google.com": the guessed clause's audio goes unheard and the stream
    speaks the text as if no guess was made, in an engine with no other stream to spare."""
    engine = make_engine(second_voice=False, lead_s=None, max_streams=1)
    pages = voice_pages(engine)
    text = "Visit google.com today, or call."
    stream, guessed = await heard_after_guess(
        engine, "Visit google.", text.removeprefix("Visit google.")
    )
    audio = await spoken(stream)
    assert stream.request is not guessed and guessed.cancelled
    np.testing.assert_allclose(audio, await said_at_once(engine, text, WAIT), rtol=0, atol=1e-6)
    assert engine.metrics()["streams_open"] == 0
    await wait_idle(engine, pages)
    # Two streams spoken, nothing cancelled: the replaced request is no outcome of its own.
    assert engine.metrics()["requests_completed"] == 2
    assert engine.metrics()["requests_cancelled"] == 0


async def test_a_stream_cancelled_on_a_guess_leaves_nothing(engine: Engine):
    pages = voice_pages(engine)
    stream = engine.stream(None, WAIT)
    stream.push_text("Okay")
    stream.push_text(".")
    assert stream.request.metrics.clauses == 1  # queued before its end is certain
    stream.cancel()
    async with asyncio.timeout(30):
        assert [event async for event in stream] == []
    await wait_idle(engine, pages)


async def test_a_guess_that_cannot_be_replaced_ends_its_stream(make_engine):
    engine = make_engine(second_voice=False)
    stream = engine.stream(None, WAIT)
    stream.push_text("Visit google")
    stream.push_text(".")
    engine.close()
    with pytest.raises(EngineClosedError):
        stream.push_text("com")
    with pytest.raises(EngineClosedError):
        async with asyncio.timeout(30):
            async for _ in stream:
                pass


async def test_a_confirmed_guess_keeps_the_clauses_in_order(make_engine):
    """The guess's clause end, let out when the text confirms it, may set off the deadline rule
    (here always: a margin longer than any clause); the clauses the same text completed are
    queued first, so the words are spoken in order."""
    engine = make_engine(second_voice=False, lead_s=None, cut_before_dry_s=30.0)
    stream = engine.stream(None, WAIT)
    guessed = stream.request
    stream.push_text("Yes")
    stream.push_text(".")
    async with asyncio.timeout(30):
        while guessed.frames_delivered < WAIT.max_frames:  # the guess's clause is all made
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.1)  # and its end handed over
    stream.push_text(" Sure thing, we can do that. And then")
    stream.push_text(" some more words.")
    stream.end_input()
    async with asyncio.timeout(30):
        said = [e.text async for e in stream if isinstance(e, ClauseDone)]
    assert said[:2] == ["Yes.", "Sure thing, we can do that."]
    assert_words_kept("Yes. Sure thing, we can do that. And then some more words.", said)


# ---- a first clause's text so far prepared as a whole clause, in case it ends there


async def ending_prepared(stream: Stream) -> None:
    """Until the stream's draft is written and prepared as the clause it most likely ends as."""
    async with asyncio.timeout(30):
        while True:
            draft = stream.request.draft
            if draft and draft.written == draft.tokens and prepared(draft, draft.wholes[0]):
                return
            await asyncio.sleep(0.002)


def prepared(draft: Draft, tokens: list[int]) -> Ending | None:
    """The draft's ending that prepared the clause of `tokens`, if one has."""
    return next((e for e in draft.endings if e.tokens == tokens and e.first_step), None)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
async def test_a_first_clause_that_ends_where_its_draft_was_prepared_says_what_it_would_say(
    make_engine, temperature: float
):
    """The draft " Hi", " there" prepared as the clause "Hi there." (the text preparation
    ends a clause with a period: a comma, a period or the wait's cut there are that clause), then
    ",": the clause starts with the first latent its ending prepared, on the ending's pages, and
    says what it says at once (its noise too: the ending drew what the clause's own pass would
    have drawn)."""
    engine = make_engine(second_voice=False, lead_s=None)
    pages = engine.blocks.pages_in_use
    policy = replace(options(first_clause_max_wait_ms=10_000), temperature=temperature)
    stream = engine.stream(None, policy)
    for token in (" Hi", " there"):
        stream.push_text(token)
        await ending_prepared(stream)
    stream.push_text(",")
    stream.end_input()
    audio = await spoken(stream)
    assert stream.metrics.first_step_prepared
    np.testing.assert_allclose(
        audio, await said_at_once(engine, " Hi there,", policy), rtol=0, atol=1e-6
    )
    await wait_idle(engine, pages)


async def test_a_first_clause_is_prepared_both_where_its_next_token_and_its_wait_may_end_it(
    make_engine,
):
    """ " Your", prepared as the clause "Your"; then " total": the draft is prepared as "Your
    total" (the next token most often ends the word), and "Your", where the wait cuts it if
    it runs out first, stays prepared. The wait runs out: the clause "Your" starts with the
    first latent prepared before " total" came, and says what it says at once."""
    engine = make_engine(second_voice=False, lead_s=None)
    pages = engine.blocks.pages_in_use
    policy = options(first_clause_min_words=50, first_clause_max_wait_ms=1000)
    stream = engine.stream(None, policy)
    stream.push_text(" Your")
    await ending_prepared(stream)
    draft = stream.request.draft
    assert draft is not None
    your = plan_clause(engine.loaded, "Your", policy).tokens
    ending = prepared(draft, your)
    assert ending is not None
    stream.push_text(" total")
    assert draft.wholes == [plan_clause(engine.loaded, "Your total", policy).tokens, your]
    await ending_prepared(stream)
    assert prepared(draft, your) is ending  # kept, not prepared again
    events: list = []
    first = await next_done(events, stream)  # the wait's cut
    assert first.text == "Your"
    assert stream.metrics.first_step_prepared
    stream.end_input()
    await spoken(stream)
    first_audio = np.concatenate([e.samples for e in events if isinstance(e, AudioChunk)])
    np.testing.assert_allclose(
        first_audio, await said_at_once(engine, " Your", policy), rtol=0, atol=1e-6
    )
    await wait_idle(engine, pages)


async def test_text_that_comes_as_the_wait_ends_is_not_drafted(make_engine):
    """A pass for it would hold up the wait's cut, which what is drafted already prepares."""
    engine = make_engine(second_voice=False, lead_s=None)
    pages = engine.blocks.pages_in_use
    wait_ms = 1000 * DRAFT_BEFORE_WAIT_ENDS_S / 2
    policy = options(first_clause_min_words=50, first_clause_max_wait_ms=wait_ms)
    stream = engine.stream(None, policy)
    stream.push_text(" Your")
    stream.push_text(" total")
    draft = stream.request.draft
    assert draft is not None
    assert draft.wholes == [plan_clause(engine.loaded, "Your", policy).tokens]
    first = await next_done([], stream)
    assert first.text == "Your"
    stream.end_input()
    await spoken(stream)
    await wait_idle(engine, pages)


async def test_a_first_clause_that_ends_otherwise_than_prepared_says_what_it_would_say(
    make_engine,
):
    """The draft " Hi there" prepared as "Hi there.", then "!" (another clause): the prepared
    ending is not used, the clause says what it says at once, and the ending's pages go back."""
    engine = make_engine(second_voice=False, lead_s=None)
    pages = engine.blocks.pages_in_use
    policy = options(first_clause_max_wait_ms=10_000)
    stream = engine.stream(None, policy)
    stream.push_text(" Hi there")
    await ending_prepared(stream)
    stream.push_text("!")
    stream.end_input()
    audio = await spoken(stream)
    assert not stream.metrics.first_step_prepared
    at_once = await said_at_once(engine, " Hi there!", policy)
    np.testing.assert_allclose(audio, at_once, rtol=0, atol=1e-6)
    await wait_idle(engine, pages)


async def test_a_stream_cancelled_with_its_ending_prepared_leaves_no_pages(make_engine):
    engine = make_engine(second_voice=False, lead_s=None)
    pages = engine.blocks.pages_in_use
    stream = engine.stream(None, options(first_clause_max_wait_ms=10_000))
    stream.push_text(" Hi there")
    await ending_prepared(stream)
    assert stream.request.draft is not None and stream.request.draft.endings
    stream.cancel()
    await wait_idle(engine, pages)
