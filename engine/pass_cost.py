"""What a prompt pass costs, from the passes the AR stage ran: the scheduler sizes a pass beside a
stream near an underrun with it (`Scheduler.schedule`).

A pass costs a part per pass (reading the FlowLM's weights), a part per clause (its first latent's
flow head, its attention; a pass split into traced parts reads the weights again for every
`TRACED_PROMPT_SEQUENCES` clauses) and a part per prompt position. Measured on a Xeon core: at
full size one clause of 2 positions took 13.4 ms, of 12 18.0 ms, of 40 30.3 ms, three of 12 35.2
ms; the 2M model's split passes 7.9 ms for one clause of 25 positions, 36 ms for ten of 96, 69 ms
for fourteen of 182. Seconds per position alone, which the scheduler used before, make one
full-size clause of 12 positions look like 1.5 ms a position (two cost 36 ms, not 23) and ten
small 2M clauses like a quarter of what they cost.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from intone.engine.config import PASS_COST_MEMORY

# Terms of the cost (columns of the fit): per pass, per clause, per position. The fit is the one
# of these sets of terms, by least squares, with the least squared error among those the passes
# determine (a term they never varied, the clauses of passes of one clause each, is left out)
# and with no term below zero; per position alone always qualifies.
_TERMS = ((0, 1, 2), (0, 2), (1, 2), (2,))


@dataclass
class PromptPassCost:
    """Seconds of a prompt pass by its clauses and positions, fitted by least squares to the last
    `PASS_COST_MEMORY` passes `observe` was given."""

    passes: deque[tuple[int, int, float]] = field(
        default_factory=lambda: deque(maxlen=PASS_COST_MEMORY)
    )
    # Seconds per pass, per clause and per position; None before the first pass.
    terms: np.ndarray | None = None

    def observe(self, clauses: int, positions: int, seconds: float) -> None:
        self.passes.append((clauses, positions, seconds))
        self.terms = self._fit()

    def seconds(self, clauses: int, positions: int) -> float | None:
        """The expected seconds of a pass of `clauses` clauses and `positions` positions; None
        before any pass."""
        if self.terms is None:
            return None
        return float(self.terms @ np.array([1.0, clauses, positions]))

    def _fit(self) -> np.ndarray:
        data = np.array(self.passes, dtype=np.float64)
        inputs = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        seconds = data[:, 2]
        best: tuple[float, tuple[int, ...], np.ndarray] | None = None
        for columns in _TERMS:
            fitted, _, rank, _ = np.linalg.lstsq(inputs[:, columns], seconds, rcond=None)
            if rank < len(columns) or (fitted < 0).any():
                continue
            error = float(np.sum((inputs[:, columns] @ fitted - seconds) ** 2))
            if best is None or error < best[0]:
                best = (error, columns, fitted)
        assert best is not None, "per position alone always fits"
        terms = np.zeros(3)
        terms[list(best[1])] = best[2]
        return terms
