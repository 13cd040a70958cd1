"""results.md and the plots from a results.json; `python bench/report.py DIR` rewrites them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from intone.engine.metrics import STAGES

MODE_ORDER = (
    "sequential",
    "interleaved",
    "batched",
    "batched-fast",
    "batched-float32",
    "batched-paced",
    "reference",
    "ws",
    "ws-ray",
)


def _f(value, digits: int = 0, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def _batch(run: dict) -> str:
    means = run.get("batch_mean")
    if not means:
        return "-"
    return " / ".join(_f(means.get(s), 2) for s in STAGES)


def _mode_key(mode: str) -> tuple[int, str]:
    base = mode.partition("@")[0]
    return (MODE_ORDER.index(base) if base in MODE_ORDER else 99, mode)


def _sorted(runs: list[dict]) -> list[dict]:
    def key(run: dict):
        return (run["load"] != "closed", _mode_key(run["mode"]), run.get("concurrency") or 0)

    return sorted(runs, key=key)


def table(results: dict) -> str:
    lines = [
        "| mode | load | requests | TTFA p50 / p95 / p99 ms | latency p50 / p95 s | RTF p50 / p95 "
        f"| audio-s/s | req/s | underruns | batch {' / '.join(STAGES)} | client CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in _sorted(results["runs"]):
        load = (
            f"c={run['concurrency']}"
            if run["load"] == "closed"
            else f"Poisson {run['arrival_rate']:g}/s"
        )
        errors = f" ({run['errors']} failed)" if run["errors"] else ""
        lines.append(
            f"| {run['mode']} | {load} | {run['requests']}{errors} "
            f"| {_f(run['ttfa_ms_p50'])} / {_f(run['ttfa_ms_p95'])} / {_f(run['ttfa_ms_p99'])} "
            f"| {_f(run['latency_ms_p50'], 2, 1e-3)} / {_f(run['latency_ms_p95'], 2, 1e-3)} "
            f"| {_f(run['rtf_p50'], 3)} / {_f(run['rtf_p95'], 3)} "
            f"| {_f(run['audio_throughput'], 2)} | {_f(run['request_throughput'], 3)} "
            f"| {run['underruns']}/{run['completed']} | {_batch(run)} "
            f"| {_f(run.get('client_cpu_share'), 0, 100)}% |"
        )
    return "\n".join(lines)


def markdown(results: dict) -> str:
    m = results["machine"]
    c = results["config"]
    out = [
        "# intone benchmark results",
        "",
        f"Machine: {m.get('cpu')} ({m.get('cores')} cores; {', '.join(m.get('cpu_flags') or [])})"
        f", torch {m.get('torch')} ({m.get('torch_threads')} threads), "
        f"GPU: {m.get('gpu') or 'none'}"
        f", device for in-process modes: {c.get('device')}. pocket-tts {m.get('pocket_tts')}. "
        f"Load average (1 min) at start {_f(m['loadavg_start'][0], 2)}, at end "
        f"{_f(m.get('loadavg_end', [None])[0], 2)}. Commit {m.get('git_commit')}"
        f"{' (dirty tree)' if m.get('git_dirty') else ''}.",
        "",
        f"Model: {c['model']}; voice {Path(c['voice']).name}; EOS off; seed {c['seed']}; "
        f"prompts: " + "; ".join(f'"{p}"' for p in c["prompts"]) + ".",
        f"Sweep time: {_f(c.get('sweep_seconds'), 0)} s.",
        "",
        table(results),
        "",
        "Real-time capacity (largest concurrency with p95 RTF < 1 and no underruns): "
        + ", ".join(f"{k}: {v}" for k, v in results["capacity"].items())
        + ".",
        "",
    ]
    for key, value in results.items():
        if key.startswith("capacity_ttfa"):
            limit = key.rsplit("_", 1)[-1]
            out += [
                f"The same with TTFA p95 under {limit} too: "
                + ", ".join(f"{k}: {v}" for k, v in value.items())
                + ".",
                "",
            ]
    foreign = [r["foreign_cpu_cores"] for r in results["runs"] if "foreign_cpu_cores" in r]
    if foreign:
        out += [
            f"CPU used by other processes during the runs: mean {sum(foreign) / len(foreign):.2f}"
            f" cores, max {max(foreign):.2f} cores (of {m.get('cores')}).",
            "",
        ]
    served = [r for r in _sorted(results["runs"]) if r.get("server_ttfa_ms_p50") is not None]
    if served:
        out += [
            "TTFA in the server (first text in to first audio out, from the `done` event of "
            "each stream that ran to the end) against the client's, p50 / p95 ms; without "
            "barge-ins the difference is the transport's: "
            + "; ".join(
                f"{r['mode']} c={r.get('concurrency') or '-'}: "
                f"{_f(r['server_ttfa_ms_p50'])} / {_f(r['server_ttfa_ms_p95'])} against "
                f"{_f(r['ttfa_ms_p50'])} / {_f(r['ttfa_ms_p95'])}"
                for r in served
            )
            + ".",
            "",
        ]
    acc = results.get("acceptance") or {}
    engines = [m for m in acc if m not in ("targets", "baselines")]
    if engines:
        out += [
            "Engine targets: audio throughput at c=8 >= 3x the sequential path's, TTFA p50 at "
            "c=1 <= 1.1x the sequential path's (sequential at c=1: "
            + "; ".join(
                f"{b} {_f(v['audio_throughput'], 2)} audio-s/s, TTFA p50 {_f(v['ttfa_ms_p50'])} ms"
                for b, v in acc["baselines"].items()
            )
            + ").",
            "",
            "| mode | baseline | throughput c=8 / sequential | TTFA p50 c=1 / sequential "
            f"| mean batch at c=8 ({' / '.join(STAGES)}) |",
            "|---|---|---|---|---|",
        ]
        for mode in engines:
            for baseline, entry in acc[mode].items():
                batch = entry.get("batch_mean_c8") or {}
                means = " / ".join(_f(batch.get(s), 2) for s in STAGES)
                out.append(
                    f"| {mode} | {baseline.removeprefix('vs ')} "
                    f"| {_f(entry.get('throughput_c8'), 2)}x | {_f(entry.get('ttfa_p50_c1'), 2)}x "
                    f"| {means} |"
                )
        out.append("")
    out += ["Notes:", ""] + [f"- {note}" for note in results.get("notes", [])]
    return "\n".join(out) + "\n"


def plots(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    closed = [r for r in results["runs"] if r["load"] == "closed"]
    modes = sorted({r["mode"] for r in closed}, key=_mode_key)
    written = []
    for name, key, ylabel, log_y in (
        ("ttfa.png", "ttfa_ms_p50", "TTFA p50 (ms)", True),
        ("throughput.png", "audio_throughput", "audio seconds per wall second", False),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for mode in modes:
            runs = sorted((r for r in closed if r["mode"] == mode), key=lambda r: r["concurrency"])
            xs = [r["concurrency"] for r in runs if r.get(key) is not None]
            ys = [r[key] for r in runs if r.get(key) is not None]
            (line,) = ax.plot(xs, ys, marker="o", label=mode)
            if key == "ttfa_ms_p50":
                p95 = [r["ttfa_ms_p95"] for r in runs if r.get(key) is not None]
                ax.plot(xs, p95, linestyle=":", color=line.get_color(), alpha=0.6)
        ax.set_xscale("log", base=2)
        levels = sorted({r["concurrency"] for r in closed})
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        if log_y:
            ax.set_yscale("log")
        if key == "audio_throughput":
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xlabel("concurrent streams (closed loop)")
        ax.set_ylabel(ylabel + (" (dotted: p95)" if key == "ttfa_ms_p50" else ""))
        m = results["machine"]
        ax.set_title(
            f"{m.get('cpu', '')[:40]} ({m.get('cores')} cores), {results['config']['device']}"
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write_report(results: dict, out_dir: Path) -> None:
    (out_dir / "results.md").write_text(markdown(results))
    if not any(r["load"] == "closed" for r in results["runs"]):
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the GPU device kit leaves it out (bench/device_kit.sh)
        print("matplotlib is not installed: results.md without plots", file=sys.stderr)
        return
    plots(results, out_dir)


if __name__ == "__main__":
    directory = Path(sys.argv[1])
    write_report(json.loads((directory / "results.json").read_text()), directory)
