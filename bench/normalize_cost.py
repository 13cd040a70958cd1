"""Cost of spoken-form text per clause: `normalize_text` on the clauses an agent sends.

Each language runs over its table of test cases (tests/test_spoken_form.py: prices, times,
dates, phone numbers, URLs, markdown) plus number-free clauses, and the clauses of PROMPTS as the
engine cuts them, all warm (after one pass), one call at a time. The issue's budget is a p95
under 2 ms per clause; this reports p50, p95 and max per language.

    python bench/normalize_cost.py --repeats 20 --out results/normalize_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from common import PROMPTS, machine_info, round_floats  # noqa: E402
from test_spoken_form import CASES  # noqa: E402

from intone.engine.text import normalize_text  # noqa: E402


def measure(language: str, clauses: list[str], repeats: int) -> dict[str, float]:
    for clause in clauses:  # warm: num2words loads its language module on first use
        normalize_text(clause, language)
    times = []
    for _ in range(repeats):
        for clause in clauses:
            t0 = time.perf_counter()
            normalize_text(clause, language)
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {
        "clauses": len(clauses),
        "calls": len(times),
        "p50_ms": statistics.median(times),
        "p95_ms": times[int(0.95 * (len(times) - 1))],
        "max_ms": times[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = {"machine": machine_info(), "languages": {}}
    for language, cases in CASES.items():
        clauses = [text for text, _ in cases]
        if language == "en":
            clauses += list(PROMPTS)
        stats = measure(language, clauses, args.repeats)
        results["languages"][language] = stats
        print(
            f"{language}: p50 {stats['p50_ms']:.3f} ms  p95 {stats['p95_ms']:.3f} ms  "
            f"max {stats['max_ms']:.3f} ms over {stats['calls']} calls"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(round_floats(results), indent=2) + "\n")


if __name__ == "__main__":
    main()
