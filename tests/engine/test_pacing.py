"""The pacing policy and the scheduler's use of it, on a fake clock: no threads, no model.

Streams are `Request`s placed in the scheduler's rows mid-clause; a "step" advances the rows the
scheduler chose by one frame, and the decoder is played by hand (frames delivered as the test
says). Times are the fake clock's seconds, passed to `schedule(t)`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from intone.engine.block_manager import BlockManager
from intone.engine.config import (
    AHEAD_OF_DECODER_CALLS,
    JOINED_PREFILL_MARGIN_S,
    PASS_COST_MEMORY,
    PREFILL_MARGIN_S,
    PacingMode,
)
from intone.engine.pacing import Need, PacingPolicy
from intone.engine.pass_cost import PromptPassCost
from intone.engine.playback import Playback
from intone.engine.request import Phase, Request, RequestMetrics
from intone.engine.scheduler import Scheduler

FRAME_S = 0.08
LEAD_S = 1.0


def policy(mode: PacingMode = "yield", max_unread_s: float | None = 10.0) -> PacingPolicy:
    return PacingPolicy(mode, LEAD_S, max_unread_s, FRAME_S, decode_frames=4)


def scheduler(
    pacing: PacingPolicy, buckets: tuple[int, ...] | None = None, joins: int = 0
) -> Scheduler:
    """`joins`: up to how many prompts a pass joins the AR step (`ModelRunner.joins`)."""
    # Rows mid-clause need no tensor work of the scheduler: only the buckets' padding.
    runner = SimpleNamespace(
        batch_buckets=sorted(buckets) if buckets else None,
        joins=lambda prompts: 0 < prompts <= joins,
    )
    return Scheduler(runner, BlockManager(64, 16), 8, 2048, 16, pacing)  # type: ignore[arg-type]


def stream(name: str, generated_s: float, played_from: float = 0.0) -> Request:
    """A generating stream with `generated_s` of audio generated, all of it decoded, delivered
    and read at time 0 (its listener's clock starts at `played_from`)."""
    frames = round(generated_s / FRAME_S)
    request = Request(
        id=name,
        voice="default",
        temperature=0.7,
        eos_threshold=0.0,
        noise_clamp=None,
        chain_frames=0,
        generator=torch.Generator(),
        metrics=RequestMetrics(submitted_at=0.0),
        playback=Playback(),
    )
    request.phase = Phase.GENERATING
    request.frames_generated = request.frames_delivered = frames
    request.read_seconds = frames * FRAME_S
    request.playback.deliver(frames * FRAME_S, played_from)
    return request


def step(requests: list[Request]) -> None:
    """One AR step of `requests`, and the decoder keeping up with it."""
    for request in requests:
        request.frames_generated += 1
        request.frames_delivered += 1
        request.read_seconds += FRAME_S
        request.playback.deliver(FRAME_S, 0.0)


def run(sched: Scheduler, rows: list[Request], t: float) -> list[Request]:
    sched.running = rows
    return sched.schedule(t).generate


def test_the_lead_is_generated_audio_less_the_listeners_clock() -> None:
    pacing = policy()
    request = stream("a", 3.2)
    # No report: a real-time clock from the first delivered sample, however fast it is read.
    assert pacing.lead(request, 0.5) == pytest.approx(2.7)
    assert pacing.ahead(request, 0.5) and not pacing.held(request, 0.5)
    request.playback.report(2.5, 0.5)  # a report replaces the clock: it stands until the next
    assert pacing.lead(request, 10.0) == pytest.approx(0.7)
    assert not pacing.ahead(request, 10.0)


def test_a_far_ahead_stream_steps_alone_and_not_while_one_within_lead_is_due() -> None:
    pacing = policy("yield")
    sched = scheduler(pacing)
    far = stream("far", 3.2)  # 3.2 s generated, listener at 0.1 s: far ahead
    t = 0.1
    assert pacing.need(far, t, generating=True) is Need.SPARE
    # Alone: nothing within lead_s needs the compute, so it steps, step after step.
    for _ in range(5):
        assert run(sched, [far], t) == [far]
        step([far])
    # A stream within lead_s that is due: the far one takes no step while it is.
    near = stream("near", 0.2)
    steps_of_far = 0
    while pacing.need(near, t, generating=True) is Need.NOW:
        batch = run(sched, [far, near], t)
        assert near in batch
        steps_of_far += far in batch
        step(batch)
    assert steps_of_far == 0
    # Once nothing within lead_s is due (the near stream's burst over), the far one steps again.
    for _ in range(50):
        batch = run(sched, [far, near], t)
        step(batch)
        if far in batch:
            break
        assert batch == [near]
    assert far in batch and pacing.need(near, t, generating=True) is not Need.NOW


def test_hold_takes_no_step_far_ahead_and_off_steps_in_every_burst() -> None:
    far, near = stream("far", 3.2), stream("near", 0.2)
    hold = scheduler(policy("hold"))
    assert run(hold, [far], 0.1) == []
    assert run(hold, [far, near], 0.1) == [near]
    off = scheduler(policy("off"))
    assert run(off, [far], 0.1) == [far]
    assert set(run(off, [far, near], 0.1)) == {far, near}


def test_a_far_ahead_stream_fills_a_bucketed_steps_padding_rows() -> None:
    """With batch buckets a step of one row runs as 4 anyway: the far stream takes a free row."""
    sched = scheduler(policy("yield"), buckets=(4, 8))
    far, near = stream("far", 3.2), stream("near", 0.2)
    assert set(run(sched, [far, near], 0.1)) == {far, near}


def test_unread_audio_holds_a_stream_in_every_mode() -> None:
    for mode in ("yield", "hold", "off"):
        pacing = policy(mode, max_unread_s=1.0)
        request = stream("a", 0.4)
        request.read_seconds = 0.0
        assert not pacing.held(request, 0.0)
        request.frames_generated += round(1.0 / FRAME_S)  # 1.4 s generated, none read
        assert pacing.held(request, 0.0) and pacing.need(request, 0.0, True) is Need.NONE, mode


def test_a_stream_far_ahead_of_its_decoder_takes_no_step() -> None:
    pacing = policy("yield")
    request = stream("a", 3.2)
    request.frames_generated += AHEAD_OF_DECODER_CALLS * pacing.decode_frames
    assert pacing.need(request, 0.1, generating=True) is Need.NONE


def test_a_far_ahead_streams_next_clause_waits_for_nobody_else_needing_the_pass() -> None:
    """Between clauses a far-ahead stream's prompt pass is not packed with a new stream's: it
    runs in an iteration where nothing else is prefilled or due."""
    pacing = policy("yield")
    far, new = stream("far", 3.2), stream("new", 0.0)
    far.phase = new.phase = Phase.PREFILL
    far.prompt = new.prompt = torch.zeros(10, 4)
    sched = scheduler(pacing)
    sched.running = [far, new]
    assert sched.schedule(0.1).prefill == [new]
    new.phase = Phase.GENERATING  # the new stream's pass ran: it is due (no audio yet)
    new.prompt = None
    assert sched.schedule(0.1).prefill == []
    new.frames_generated = new.frames_delivered = round(1.5 / FRAME_S)
    new.playback.deliver(1.5, 0.0)  # now past lead_s too: nothing else needs the pass
    batch = sched.schedule(0.1)
    assert batch.prefill == [far] and new in batch.generate


def prompted(name: str, positions: int) -> Request:
    """A stream holding a row whose clause waits for its prompt pass of `positions` positions."""
    request = stream(name, 0.0)
    request.phase = Phase.PREFILL
    request.prompt = torch.zeros(positions, 4)
    return request


def measured(per_pass: float, per_position: float) -> PromptPassCost:
    """A prompt-pass cost fitted to passes of one clause of 10 and 40 positions that took
    `per_pass` and `per_position` a position."""
    cost = PromptPassCost()
    for positions in (10, 40, 10, 40):
        cost.observe(1, positions, per_pass + per_position * positions)
    return cost


def test_a_prefill_pass_beside_a_stream_near_an_underrun_ends_before_that_stream_runs_dry() -> None:
    """While a stream that plays is near an underrun, a prefill pass takes the clauses that
    recent passes' cost says end `PREFILL_MARGIN_S` before that stream's audio runs out, one at
    least; with no stream near one, all that `max_prefill_tokens` allows."""
    sched = scheduler(policy("yield"))
    new = [prompted(f"new{i}", 40) for i in range(4)]
    sched.running = [stream("playing", 0.24), *new]  # 240 ms ahead of its listener
    assert sched.schedule(0.0).prefill == new, "no cost measured yet: the row cap alone"
    sched.prompt_pass_cost = measured(0.0, 0.001)  # 40 ms a clause; 240 - 100 ms affords three
    assert sched.schedule(0.0).prefill == new[:3]
    sched.prompt_pass_cost = measured(0.0, 0.01)  # 400 ms a clause: one, however late
    assert sched.schedule(0.0).prefill == new[:1]
    sched.running = [stream("ahead", 0.8), *new]  # nobody near an underrun
    assert sched.schedule(0.0).prefill == new


def test_a_pass_that_joins_the_ar_step_leaves_room_only_for_the_decode_call() -> None:
    """Beside a new stream's one frame (80 ms ahead), a pass that joins the AR step the stream
    waits for (`JOINED_PREFILL_MARGIN_S` before it runs out) takes the clauses that fit in
    the 40 ms left; one that the step follows (`PREFILL_MARGIN_S`), one clause, however short."""
    assert JOINED_PREFILL_MARGIN_S == 0.04 and PREFILL_MARGIN_S == 0.1
    new = [prompted(f"new{i}", 10) for i in range(4)]
    cost = measured(0.01, 0.001)  # 20 ms for a clause of 10 positions, 30 for two
    joined = scheduler(policy("yield"), joins=4)
    joined.running = [stream("started", FRAME_S), *new]
    joined.prompt_pass_cost = cost
    assert joined.schedule(0.0).prefill == new[:3]
    apart = scheduler(policy("yield"))
    apart.running = [stream("started", FRAME_S), *new]
    apart.prompt_pass_cost = cost
    assert apart.schedule(0.0).prefill == new[:1]


def test_a_new_streams_first_clause_goes_before_the_next_clause_of_a_stream_well_ahead() -> None:
    """Where a pass near an underrun takes one clause, a new stream's first clause goes before
    the next clause of a stream `URGENT_S` or more ahead of its listener, and after that of a
    stream closer to running dry; first come, first served among equals."""
    sched = scheduler(policy("yield"))
    sched.prompt_pass_cost = measured(0.0, 0.01)  # 100 ms a clause: one a pass
    playing = stream("playing", 0.16)
    ahead, near, new = stream("ahead", 0.8), stream("near", 0.3), prompted("new", 10)
    for request in (ahead, near):
        request.phase, request.prompt = Phase.PREFILL, torch.zeros(10, 4)
    sched.running = [playing, ahead, new]
    assert sched.schedule(0.0).prefill == [new]
    sched.running = [playing, near, new]
    assert sched.schedule(0.0).prefill == [near]
    sched.running = [playing, new, near]
    assert sched.schedule(0.0).prefill == [new]


def test_a_prompt_pass_costs_a_part_per_pass_per_clause_and_per_position() -> None:
    """A pass's seconds are fitted to the recent passes: per position alone while they all had
    the same size, then per pass and per position, and per clause too once their clauses
    differ (a small model's split passes: 5 ms a clause)."""
    cost = PromptPassCost()
    assert cost.seconds(1, 10) is None
    cost.observe(1, 10, 0.030)
    assert cost.seconds(1, 20) == pytest.approx(0.060)  # one size: 3 ms a position
    cost.observe(1, 40, 0.060)
    assert cost.seconds(1, 20) == pytest.approx(0.040)  # 20 ms a pass, 1 ms a position
    assert cost.seconds(3, 20) == pytest.approx(0.040), "the clauses never varied"
    for clauses, positions in ((4, 40), (8, 40), (8, 80)):
        cost.observe(clauses, positions, 0.002 + 0.005 * clauses + 0.0001 * positions)
    for _ in range(PASS_COST_MEMORY):  # only passes that vary in clauses and positions remain
        for clauses, positions in ((1, 10), (4, 40), (8, 40), (8, 80)):
            cost.observe(clauses, positions, 0.002 + 0.005 * clauses + 0.0001 * positions)
    assert cost.terms == pytest.approx([0.002, 0.005, 0.0001])
    assert cost.seconds(14, 182) == pytest.approx(0.002 + 0.070 + 0.0182)


def test_a_pass_near_an_underrun_packs_what_its_part_per_pass_allows() -> None:
    """18 ms a pass and 1 ms a position: four 10-position clauses end in 58 ms, within the 60
    ms that a stream 160 ms ahead leaves; seconds per position alone (2.8 ms at 10 positions)
    would have allowed two, and 18 ms a clause one."""
    sched = scheduler(policy("yield"))
    new = [prompted(f"new{i}", 10) for i in range(5)]
    sched.running = [stream("playing", 0.16), *new]
    sched.prompt_pass_cost = measured(0.018, 0.001)
    assert sched.schedule(0.0).prefill == new[:4]
