"""The benchmark runner: serving approaches side by side over a concurrency sweep.

    python bench/run.py --model checkpoints/full --out results/bench \
        [--modes sequential,interleaved,batched,batched-fast,reference,ws,ws-ray] \
        [--concurrency 1,2,4,8,16] [--requests N] [--arrival-rate R] [--device cpu]

Each mode runs in a fresh worker process (this script with --worker), one level after another:
for every concurrency level a closed loop of that many clients over the four prompts, EOS off,
a fixed seed per request, the same voice WAV. In-process modes are driven by asyncio tasks in the
engine's own process; network modes (reference, ws) start their server as a subprocess and the
worker process is the client (one keep-alive connection per client slot, reused).

Request counts: the reference design's 16 per prompt (64 per level) for the engine modes where
that fits the time budget (min(64, max(16, 8 * c))); slow modes are capped at --slow-requests
(default 16, 4 per prompt); sequential throughput does not depend on concurrency, so it gets
--slow-requests at c=1 and max(4, c) requests above. --requests N overrides all of these.
Every run records the counts it used.

Paced clients (--paced-client): each client reads its stream at playback speed, as a phone call
does (it takes the next chunk when less than 200 ms of what it holds is left to play), and with
--barge-in LO,HI interrupts each turn at a random point between LO and HI seconds of playback;
runs then also report audio generated but never played per interrupted turn (engine modes). Pacing
off vs on is `batched` (EngineConfig.lead_s=None, as every engine mode runs by default here) vs
`batched-paced` (the engine's default lead_s=2.0): for example

    python bench/run.py --model checkpoints/full --out results/paced --paced-client \
        --barge-in 1,6 --modes batched,batched-paced --concurrency 2,4,8 --arrival-rate 0.5

Output in --out: results.json, results.md, ttfa.png, throughput.png, and logs/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    NO_EOS,
    PROMPTS,
    SEED,
    fast_engine_options,
    foreign_cpu_seconds,
    machine_info,
    round_floats,
)

from intone.engine.metrics import STAGES  # noqa: E402

MODES = ("sequential", "interleaved", "batched", "batched-fast", "reference", "ws", "ws-ray")
# Also runnable (--modes): the engine with its playback pacing on (EngineConfig.lead_s=2.0), and
# the engine in float32 throughout (EngineConfig.dtype="float32", the default's fallback).
EXTRA_MODES = ("batched-paced", "batched-float32")
NETWORK_MODES = ("reference", "ws", "ws-ray")
SLOW_MODES = ("sequential", "interleaved", "reference")
FULL_REQUESTS = 16 * len(PROMPTS)
# A stricter capacity besides the issue's: also first audio within this at p95 (queueing shows
# in TTFA, not in RTF or underruns).
CAPACITY_TTFA_MS = 500  # the reference design: 16 requests per prompt


def split_mode(mode: str) -> tuple[str, int | None]:
    """'batched@t1' -> ('batched', 1): a mode run with that many torch threads."""
    base, _, threads = mode.partition("@t")
    return base, int(threads) if threads else None


def requests_for(mode: str, concurrency: int, args: argparse.Namespace) -> int:
    mode = split_mode(mode)[0]
    if args.requests:
        return args.requests
    # At least two rounds of the closed loop: a single round (n = c) is a burst whose first
    # requests never queue, which hides the steady-state wait.
    if mode == "sequential":
        return args.slow_requests if concurrency == 1 else max(4, 2 * concurrency)
    if mode in SLOW_MODES:
        return max(args.slow_requests, 2 * concurrency)
    return min(FULL_REQUESTS, max(16, 8 * concurrency))


def plan_levels(mode: str, args: argparse.Namespace) -> list[dict]:
    base = split_mode(mode)[0]
    levels = [
        {"load": "closed", "concurrency": c, "requests": requests_for(mode, c, args)}
        for c in args.concurrency
    ]
    if args.arrival_rate:
        count = args.requests or (args.slow_requests if base in SLOW_MODES else 32)
        levels.append({"load": "poisson", "arrival_rate": args.arrival_rate, "requests": count})
    return levels


# ---- worker: one mode, all its levels, in this process


async def run_worker(spec: dict) -> list[dict]:
    import resource

    import loadgen
    from backends import make_backend

    workdir = Path(spec["workdir"])
    base, threads = split_mode(spec["mode"])
    engine_options = dict(spec["fast_options"]) if base == "batched-fast" else {}
    if base == "batched-float32":
        engine_options["dtype"] = "float32"
    if spec.get("max_active"):
        engine_options["max_active"] = spec["max_active"]
    if spec.get("pacing"):
        engine_options["pacing"] = spec["pacing"]
    for name in ("max_decode_row_frames", "max_prefill_rows_near_underrun", "kv_memory_mb"):
        if spec.get(name):
            engine_options[name] = spec[name]
    if base != "batched-paced":
        # Generation as fast as the machine goes, as these modes have always measured (with
        # pacing "hold" the engine's lead would hold a fast reader's stream to real time).
        engine_options["lead_s"] = None
    client = loadgen.Client(
        paced=spec.get("paced_client", False),
        barge_in=tuple(spec["barge_in"]) if spec.get("barge_in") else None,
    )
    if threads:
        import torch

        torch.set_num_threads(threads)
        if base.startswith("batched"):
            engine_options["torch_threads"] = threads
    backend = make_backend(
        base, spec["model"], spec["voice"], spec["device"], workdir, engine_options
    )
    t = time.perf_counter()
    await backend.start()
    startup = time.perf_counter() - t
    log(f"{spec['mode']}: started in {startup:.1f} s")
    max_c = max((lvl.get("concurrency", 1) for lvl in spec["levels"]), default=1)
    # Warm-up, not measured: one request alone, then a small concurrent burst.
    warm = loadgen.make_specs(spec["warmup"], seed=SEED + 10_000)
    for burst in ([warm[0]], warm[1:]):
        if burst:
            await loadgen.closed_loop(backend, burst, min(len(burst), max_c))
    runs = []
    for level in spec["levels"]:
        specs = loadgen.make_specs(level["requests"], seed=SEED)
        backend.reset_stage_metrics()
        load0 = os.getloadavg()[0]
        started_at = time.strftime("%Y-%m-%dT%H:%M:%S")
        foreign0 = foreign_cpu_seconds()
        cpu0, thread0 = time.process_time(), time.thread_time()
        server0 = backend.server_cpu_seconds()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        if level["load"] == "closed":
            records = await loadgen.closed_loop(backend, specs, level["concurrency"], client)
        else:
            records = await loadgen.open_loop(backend, specs, level["arrival_rate"], client=client)
        wall = time.perf_counter() - t0
        foreign1 = foreign_cpu_seconds()
        cpu, thread = time.process_time() - cpu0, time.thread_time() - thread0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        server1 = backend.server_cpu_seconds()
        run = {"mode": spec["mode"], **level, "started_at": started_at}
        run["client"] = "paced" if client.paced else "fast"
        run["barge_in"] = list(client.barge_in) if client.barge_in else None
        run["commit"] = spec.get("commit")
        run.update(loadgen.summarize(records, backend.trailing_padding))
        network = base in NETWORK_MODES
        # The client's own CPU: the whole client process for network modes; for in-process
        # modes the event-loop thread (the engine's threads are the server side).
        client_cpu = cpu if network else thread
        run["client_cpu_s"] = client_cpu
        run["client_cpu_share"] = client_cpu / wall  # of one core
        run["client_cpu_scope"] = "client process" if network else "event-loop thread"
        run["process_cpu_share"] = cpu / wall
        run["context_switches_involuntary"] = ru1.ru_nivcsw - ru0.ru_nivcsw
        if server0 is not None and server1 is not None:
            run["server_cpu_share"] = (server1 - server0) / wall
        stages = backend.stage_metrics()
        if stages:
            run["batch_mean"] = {stage: stages.get(f"{stage}_batch_mean") for stage in STAGES}
            run["batches"] = {stage: stages.get(f"{stage}_batches") for stage in STAGES}
        if foreign0 is not None and foreign1 is not None:
            # CPU used by processes outside this benchmark (other users), in cores: the noise.
            run["foreign_cpu_cores"] = max(0.0, foreign1 - foreign0) / wall
        run["loadavg_1m_before"] = load0
        run["loadavg_1m_after"] = os.getloadavg()[0]
        runs.append(run)
        log(
            f"{spec['mode']} {level['load']} c={level.get('concurrency', '-')} "
            f"n={level['requests']}: TTFA p50 {fmt(run['ttfa_ms_p50'])} ms, "
            f"{run['audio_throughput']:.2f} audio-s/s, RTF p95 {fmt(run['rtf_p95'], 3)}, "
            f"underruns {run['underruns']}/{run['completed']}, errors {run['errors']}, "
            f"wasted {fmt(run['wasted_audio_s_mean'], 2)} s/turn, "
            f"batch {run.get('batch_mean')}, client CPU {run['client_cpu_share']:.0%}, "
            f"wall {wall:.1f} s"
        )
    info = backend.info()
    await backend.stop()
    for run in runs:
        run["backend"] = info
        run["startup_s"] = startup
    return runs


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- orchestrator


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (e.g. intone make-checkpoint)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="closed-loop levels ('' none)")
    parser.add_argument("--requests", type=int, default=None, help="requests per level, all modes")
    parser.add_argument("--slow-requests", type=int, default=16, help="cap for slow modes")
    parser.add_argument("--arrival-rate", type=float, default=None, help="Poisson requests/s")
    parser.add_argument("--device", default="cpu", help="for in-process modes and ws")
    parser.add_argument("--voice", default=None, help="voice WAV (default: the checkpoint's)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up requests per mode")
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    parser.add_argument(
        "--merge-from",
        type=Path,
        default=None,
        help="a results dir whose runs to keep, replaced by this sweep's runs of the same mode "
        "and level (re-measure what another user's load disturbed)",
    )
    parser.add_argument(
        "--paced-client",
        action="store_true",
        help="clients read at playback speed (a phone call), not as fast as audio arrives",
    )
    parser.add_argument(
        "--barge-in",
        default=None,
        metavar="LO,HI",
        help="interrupt each turn at a random point between LO and HI seconds of playback",
    )
    parser.add_argument(
        "--max-active",
        type=lambda v: v if v == "auto" else int(v),
        default=None,
        help="EngineConfig.max_active (N or auto) of the engine modes, in process and `intone"
        " serve` (default: the engine's, auto: measured at start); a capacity sweep needs at"
        " least its concurrency",
    )
    parser.add_argument(
        "--pacing",
        choices=("yield", "hold", "off"),
        default=None,
        help="EngineConfig.pacing of the engine modes, in process and `intone serve` (default: the"
        " engine's, yield); it matters where lead_s is on: batched-paced and ws",
    )
    parser.add_argument(
        "--max-decode-row-frames",
        type=int,
        default=None,
        help="EngineConfig.max_decode_row_frames of the in-process engine modes (default: the"
        " engine's, 64); a large value lets every decode call take all that waits",
    )
    parser.add_argument(
        "--max-prefill-rows-near-underrun",
        type=int,
        default=None,
        help="EngineConfig.max_prefill_rows_near_underrun of the in-process engine modes (default:"
        " the engine's, 16); --max-active's value lets a burst of new streams in one pass",
    )
    parser.add_argument(
        "--kv-memory-mb",
        type=float,
        default=None,
        help="EngineConfig.kv_memory_mb of the in-process engine modes (default: the engine's,"
        " 256: ~36 full-size streams of 150 positions); a GPU sweep at c=256 needs ~4096",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a worker's spec JSON
    args = parser.parse_args(argv)
    if args.worker:
        return args
    if not args.model:
        parser.error("--model is required")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in args.modes:
        base, threads = split_mode(mode)
        if base not in MODES + EXTRA_MODES:
            known = ",".join(MODES + EXTRA_MODES)
            parser.error(f"unknown mode {mode!r}; expected some of {known}")
        if threads is not None and (base in NETWORK_MODES or threads < 1):
            parser.error(f"{mode}: @tN (torch threads) is for in-process modes, N >= 1")
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if args.barge_in:
        try:
            low, high = (float(x) for x in args.barge_in.split(","))
        except ValueError:
            parser.error("--barge-in takes LO,HI in seconds")
        if not 0 <= low <= high:
            parser.error("--barge-in needs 0 <= LO <= HI")
        args.barge_in = [low, high]
    if not args.concurrency and not args.arrival_rate:
        parser.error("nothing to run: give --concurrency levels or --arrival-rate")
    return args


def run_mode(mode: str, args: argparse.Namespace, fast: dict) -> tuple[list[dict], str | None]:
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    workdir = logs / mode
    workdir.mkdir(exist_ok=True)
    spec = {
        "mode": mode,
        "model": str(Path(args.model).resolve()),
        "voice": str(Path(args.voice).resolve()),
        "device": "cpu" if split_mode(mode)[0] == "reference" else args.device,
        "levels": plan_levels(mode, args),
        "warmup": args.warmup,
        "fast_options": fast,
        "workdir": str(workdir.resolve()),
        "commit": args.commit,
        "out": str((workdir / "runs.json").resolve()),
        "paced_client": args.paced_client,
        "barge_in": args.barge_in,
        "max_active": args.max_active,
        "pacing": args.pacing,
        "max_decode_row_frames": args.max_decode_row_frames,
        "max_prefill_rows_near_underrun": args.max_prefill_rows_near_underrun,
        "kv_memory_mb": args.kv_memory_mb,
    }
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    log(f"{mode}: levels {[(lvl.get('concurrency'), lvl['requests']) for lvl in spec['levels']]}")
    with open(workdir / "worker.log", "w") as worker_log:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(spec_path)],
            stdout=worker_log,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        assert proc.stderr is not None
        tail: list[str] = []
        for line in proc.stderr:  # progress lines, passed through
            worker_log.write(line)
            tail = (tail + [line])[-20:]
            if line.startswith("["):
                sys.stderr.write(line)
        proc.wait()
    if proc.returncode != 0:
        return [], f"{mode}: worker failed (exit {proc.returncode}): {''.join(tail)[-1500:]}"
    return json.loads(Path(spec["out"]).read_text()), None


def _key(run: dict) -> tuple:
    return (run["mode"], run["load"], run.get("concurrency"), run.get("arrival_rate"))


def _merge(kept: list[dict], new: list[dict]) -> list[dict]:
    replaced = {_key(r) for r in new}
    return [r for r in kept if _key(r) not in replaced] + new


def capacity(runs: list[dict], ttfa_p95_ms: float | None = None) -> dict[str, int]:
    """Per mode: the largest closed-loop concurrency with p95 RTF < 1 and no underruns (and,
    with `ttfa_p95_ms`, TTFA p95 under that)."""
    result: dict[str, int] = {}
    for run in runs:
        if run["load"] != "closed":
            continue
        mode = run["mode"]
        result.setdefault(mode, 0)
        ok = (
            run["errors"] == 0
            and run["rtf_p95"] is not None
            and run["rtf_p95"] < 1
            and run["underruns"] == 0
            and (ttfa_p95_ms is None or run["ttfa_ms_p95"] < ttfa_p95_ms)
        )
        if ok:
            result[mode] = max(result[mode], run["concurrency"])
    return result


def acceptance(runs: list[dict]) -> dict:
    """The engine's targets, per engine mode: audio throughput at c=8 over the sequential path's
    (>= 3x) and TTFA p50 at c=1 over the sequential path's (<= 1.1x). Against `sequential` as
    shipped and, when it ran, against every `sequential@tN` variant too."""

    def find(mode: str, c: int) -> dict | None:
        return next(
            (
                r
                for r in runs
                if r["mode"] == mode and r["load"] == "closed" and r["concurrency"] == c
            ),
            None,
        )

    modes = list(dict.fromkeys(r["mode"] for r in runs))
    baselines = [m for m in modes if split_mode(m)[0] == "sequential" and find(m, 1)]
    engines = [
        m
        for m in modes
        if split_mode(m)[0]
        in ("batched", "batched-fast", "batched-paced", "batched-float32", "ws", "ws-ray")
    ]
    out: dict = {
        "targets": {"throughput_c8_vs_sequential": ">= 3", "ttfa_p50_c1_vs_sequential": "<= 1.1"},
        "baselines": {},
    }
    for baseline in baselines:
        seq = find(baseline, 1)
        assert seq is not None
        out["baselines"][baseline] = {
            "audio_throughput": seq["audio_throughput"],
            "ttfa_ms_p50": seq["ttfa_ms_p50"],
        }
        for mode in engines:
            c8, c1 = find(mode, 8), find(mode, 1)
            entry: dict = {}
            if c8:
                entry["throughput_c8"] = c8["audio_throughput"] / seq["audio_throughput"]
                entry["batch_mean_c8"] = c8.get("batch_mean")
            if c1:
                entry["ttfa_p50_c1"] = c1["ttfa_ms_p50"] / seq["ttfa_ms_p50"]
            if entry:
                out.setdefault(mode, {})[f"vs {baseline}"] = entry
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        runs = asyncio.run(run_worker(spec))
        Path(spec["out"]).write_text(json.dumps(runs))
        return

    from report import write_report

    args.voice = args.voice or str(Path(args.model, "voices", "default.wav"))
    args.out.mkdir(parents=True, exist_ok=True)
    fast = fast_engine_options(args.device)
    machine = machine_info(args.device)
    args.commit = machine.get("git_commit", "") + ("+dirty" if machine.get("git_dirty") else "")
    kept: list[dict] = []
    if args.merge_from:
        previous = json.loads((args.merge_from / "results.json").read_text())
        kept = previous["runs"]
    notes = [
        f"EOS disabled in every mode (eos_threshold={NO_EOS:g}); each prompt always gives the "
        "same number of frames.",
        "TTFA, latency and underruns are measured by the client, per chunk, on its event loop.",
        "Capacity: the largest tested concurrency whose closed-loop run had p95 RTF < 1 "
        "(RTF = end-to-end latency / audio duration, queueing included), no underruns (100 ms "
        "slack) and no errors; 0 when none did. It ignores TTFA: a queue that delays first "
        f"audio by seconds can still pass, so capacity_ttfa_p95_under_{CAPACITY_TTFA_MS}ms also "
        f"requires TTFA p95 < {CAPACITY_TTFA_MS} ms.",
        "foreign_cpu_cores per run: CPU used during the run by processes outside the benchmark "
        "(other users of the machine), in cores.",
        "interleaved: one AR thread round-robins the single-request path's latent generators "
        "(one prefill or AR step for one request per model call) and one decoder thread decodes "
        "their frames one request per call: the engine's pipeline without batching.",
    ]
    if "batched-fast" in args.modes:
        notes.append(
            f"batched-fast EngineConfig options: {fast}"
            if fast
            else "batched-fast: this engine has no faster option yet (no EngineConfig.dtype): "
            "it ran with the same config as batched."
        )
    if "reference" in args.modes:
        notes.append(
            "reference: `pocket-tts serve` (one generation thread and one decoder thread per "
            "request, torch at 1 thread) on the same checkpoint and voice WAV, EOS off through a "
            "config copy; it has no device option and always runs on the CPU"
            + (" (in-process modes ran on the GPU)." if args.device != "cpu" else ".")
            + " TTFA counts from the first PCM byte after the WAV header; its 200 ms of "
            "trailing silence is not counted as audio."
        )
    all_runs: list[dict] = []
    started = time.time()
    for mode in args.modes:
        t = time.perf_counter()
        runs, error = run_mode(mode, args, fast)
        if error:
            log(error)
            notes.append(error)
        all_runs.extend(runs)
        merged = _merge(kept, all_runs)
        log(f"{mode}: done in {time.perf_counter() - t:.0f} s")
        results = {
            "machine": {**machine, "loadavg_end": list(os.getloadavg())},
            "config": {
                "model": str(args.model),
                "voice": args.voice,
                "device": args.device,
                "modes": args.modes,
                "concurrency": args.concurrency,
                "arrival_rate": args.arrival_rate,
                "requests_override": args.requests,
                "slow_requests": args.slow_requests,
                "warmup": args.warmup,
                "prompts": list(PROMPTS),
                "seed": SEED,
                "eos_threshold": NO_EOS,
                "fast_options": fast,
                "sweep_seconds": time.time() - started,
            },
            "runs": merged,
            "capacity": capacity(merged),
            f"capacity_ttfa_p95_under_{CAPACITY_TTFA_MS}ms": capacity(merged, CAPACITY_TTFA_MS),
            "acceptance": acceptance(merged),
            "notes": notes,
        }
        # Written after every mode, so a long sweep that dies keeps what it measured.
        results = round_floats(results)
        (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        write_report(results, args.out)
    if kept:
        notes.append(
            f"Merged: {len(all_runs)} runs measured in this sweep replaced or joined "
            f"{len(kept)} kept from {args.merge_from}; every run carries its started_at, commit "
            "and foreign_cpu_cores."
        )
    for run in merged:
        if run.get("client_cpu_share", 0) > 0.5 and split_mode(run["mode"])[0] in NETWORK_MODES:
            notes.append(
                f"{run['mode']} c={run.get('concurrency')}: the client process used "
                f"{run['client_cpu_share']:.0%} of a core: it competes with the server."
            )
    results["notes"] = notes
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    write_report(results, args.out)
    log(f"wrote {args.out}/results.json, results.md and plots in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
