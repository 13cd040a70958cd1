"""`EngineConfig.max_active="auto"`: the start-up measurement and the choice it makes.

The choice is checked on given stage costs (no timing asserted); the measurement itself runs once,
on the tiny model, for what it reports, never for how fast it is.
"""

from __future__ import annotations

import pytest

from intone.engine import Engine, EngineConfig
from intone.engine.admission import AUTO_MAX, StageCost, choose
from intone.engine.config import HEADROOM, PROBE_ROWS

FRAME_S = 0.08


def cost(per_call: float, per_row: float) -> StageCost:
    return StageCost({}, per_call, per_row)


def test_the_choice_is_the_most_rows_within_the_headroom() -> None:
    generate, decode = cost(0.010, 0.001), cost(0.0, 0.020)  # per frame: 10 ms + 6 ms a row
    rows = choose(generate, decode, FRAME_S, cores=2)
    budget = HEADROOM * FRAME_S * 2
    frame_cost = lambda n: generate.at(n) + decode.at(n) / 4  # noqa: E731
    assert frame_cost(rows) <= budget < frame_cost(rows + 1)
    # One core: half of it; a GPU counts wall seconds of both stages.
    assert choose(generate, decode, FRAME_S, cores=1) < rows
    assert choose(generate, decode, FRAME_S, cores=0) == choose(generate, decode, FRAME_S, 1)


def test_the_choice_never_lets_the_ar_step_alone_outlast_a_frame() -> None:
    generate, decode = cost(0.0, 0.005), cost(0.0, 0.0001)  # the AR step is the limit
    rows = choose(generate, decode, FRAME_S, cores=8)
    assert generate.at(rows) <= HEADROOM * FRAME_S < generate.at(rows + 1)


def test_the_choice_stays_within_its_bounds() -> None:
    assert choose(cost(1.0, 1.0), cost(1.0, 1.0), FRAME_S, cores=2) == 1
    assert choose(cost(0.0, 1e-9), cost(0.0, 1e-9), FRAME_S, cores=2) == AUTO_MAX


def test_a_fit_is_a_line_through_the_measured_points() -> None:
    fitted = StageCost.fit({1: 0.012, 4: 0.018, 8: 0.026})
    assert fitted.per_call == pytest.approx(0.010, abs=1e-3)
    assert fitted.per_row == pytest.approx(0.002, abs=2e-4)
    # A flat or falling measure still costs something per row.
    assert StageCost.fit({1: 0.02, 8: 0.01}).per_row > 0


def test_auto_measures_this_model_here_and_reports_it(tiny_model) -> None:
    engine = Engine(tiny_model, EngineConfig(max_active="auto"))
    try:
        chosen = engine.config.max_active
        assert isinstance(chosen, int) and 1 <= chosen <= AUTO_MAX
        assert engine.scheduler.max_active == engine.decoder.max_batch == chosen
        m = engine.metrics()
        assert m["max_active"] == chosen
        admission = m["admission"]
        assert admission["max_active"] == chosen and admission["measured_in_s"] > 0
        for stage in ("generate", "decode"):
            assert set(admission[stage]["seconds"]) == set(PROBE_ROWS)
            assert all(s > 0 for s in admission[stage]["seconds"].values())
    finally:
        engine.close()
    # A number is taken as it is: nothing measured.
    engine = Engine(tiny_model, EngineConfig(max_active=3))
    try:
        assert engine.config.max_active == 3 and engine.metrics()["admission"] is None
    finally:
        engine.close()


@pytest.mark.parametrize("bad", [0, "many", 2.5, True])
def test_a_bad_max_active_is_refused(tiny_model, bad) -> None:
    with pytest.raises(ValueError, match="EngineConfig.max_active"):
        Engine(tiny_model, EngineConfig(max_active=bad))
