"""Cost of spoken-form text per clause: `normalize_text` on the clauses an agent sends.

Each language runs over its table of clauses (CLAUSES: prices, times, dates, phone numbers, URLs,
markdown, and number-free ones), English also over the clauses of PROMPTS as the engine cuts
them, all warm (after one pass), one call at a time. The issue's budget is a p95 under 2 ms per
clause; this reports p50, p95 and max per language.

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

from common import PROMPTS, machine_info, round_floats  # noqa: E402

from intone.engine.text import normalize_text  # noqa: E402

# Clauses an agent sends, per language: prices, times, abbreviations, phone numbers, percentages,
# ordinals, dates, large numbers, units, URLs and e-mail, markdown, emoji, symbols and a
# number-free one (a sample of the spoken-form test's table, owned here).
CLAUSES: dict[str, list[str]] = {
    "en": [
        "It costs $12.50 today.",
        "A $1.5 million deal.",
        "Meet at 3:45 pm.",
        "Call at 9am.",
        "Mr. and Mrs. Jones.",
        "Call 555-0123.",
        "Growth was 25%.",
        "The 2nd and 3rd place.",
        "On 11/30/2026 we ship.",
        "In May 2026.",
        "There were 1,234,567 people.",
        "Visit https://example.com/docs today.",
        "**Bold** and _italic_ text.",
        "Great job 🎉👍!",
        "I ran 5 km in 30 min.",
        "221B Baker St. London",
        "Tom & Jerry.",
        "No digits here.",
    ],
    "fr": [
        "Ça coûte 12,50 €.",
        "Il est 15h30.",
        "À 20h.",
        "Des fruits, etc.",
        "Une hausse de 25 %.",
        "Le 2026-11-30.",
        "La 2e place.",
        "Il y a 1 234 567 habitants.",
        "Il a 42 ans.",
        "Ça pèse 1 kg.",
        "Voir https://exemple.fr/aide.",
        "- un élément",
        "De 10-20 personnes.",
        "n° 5",
    ],
    "de": [
        "Das kostet 12,50 €.",
        "Um 15:30 Uhr.",
        "Um 20:05.",
        "Obst, z.B. Äpfel.",
        "Rufen Sie +49 30 12345678 an.",
        "Am 3. Mai 2026.",
        "Das war 2026-11-30.",
        "Es gibt 1.234.567 Einwohner.",
        "Es sind -5 °C.",
        "Er lief 10 km in 45 min.",
        "Schreiben Sie an max@beispiel.de.",
        "# Titel",
        "Lies [die Doku](https://x.io).",
        "1 + 2 = 3",
    ],
    "es": [
        "Cuesta 12,50 €.",
        "A las 15:30.",
        "El Sr. García y la Sra. López.",
        "Frutas, etc.",
        "Un 25 % más.",
        "El 2026-11-30.",
        "En mayo de 2026.",
        "Tiene 42 años.",
        "Pesa 1 kg.",
        "Escriba a info@ejemplo.es.",
        "# Título",
        "Lea [la guía](https://x.io).",
        "1 + 2 = 3",
        "Es el 21º.",
    ],
    "it": [
        "Costa 12,50 €.",
        "Alle 15:30.",
        "Il Sig. Rossi e la Sig.ra Bianchi.",
        "Il Prof. Neri.",
        "Un aumento del 25 %.",
        "Il 2026-11-30.",
        "A maggio 2026.",
        "Ha 42 anni.",
        "Pesa 1 kg.",
        "Scriva a info@esempio.it.",
        "# Titolo",
        "Legga [la guida](https://x.io).",
        "1 + 2 = 3",
        "Il n. 5",
    ],
    "pt": [
        "Custa 12,50 €.",
        "Às 15:30.",
        "O Sr. Silva e a Sra. Costa.",
        "Frutas, p. ex. maçãs.",
        "Um aumento de 25 %.",
        "Em 2026-11-30.",
        "Em maio de 2026.",
        "Tem 42 anos.",
        "Pesa 1 kg.",
        "Escreva para info@exemplo.pt.",
        "# Título",
        "Leia [o guia](https://x.io).",
        "1 + 2 = 3",
        "A nº 5",
    ],
    "nl": [
        "Het kost 12,50 €.",
        "Om 15:30 uur.",
        "Om 20:05.",
        "Fruit, bijv. appels.",
        "Bel +31 20 123 4567.",
        "De 1e en de 2de.",
        "Op 3 mei 2026.",
        "Pi is 3,14.",
        "Hij liep 10 km in 45 min.",
        "Bezoek www.voorbeeld.nl.",
        "**Vet** en _cursief_.",
        "Top 🎉!",
        "Tom & Jerry.",
        "Een bestand van 2 GB.",
    ],
}


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
    for language, clauses in CLAUSES.items():
        clauses = list(clauses)
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
