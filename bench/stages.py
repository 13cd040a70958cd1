"""Per-call cost of the engine's two stages by batch size: where the time goes.

Times the calls the engine makes, on the engine's own ModelRunner:
- AR step: `ModelRunner.generate_step` (backbone one position per row + flow head + EOS) for
  B rows with a context of --context positions each;
- decode: `ModelRunner.decode` (gather the rows' Mimi histories, decode one latent per row,
  scatter them back) for B rows.
and, for contrast, the same two stages run concurrently in two threads (the engine's AR and
decoder threads), which is what the engine does on the CPU.

    python bench/stages.py --model checkpoints/full [--batches 1,2,4,8,16] [--threads 1,2]
        [--dtype auto|float32|bfloat16]

`--attention` instead compares the AR step at 16 rows with its decode attention read from each
row's dense context by the native operator (the engine's on a CPU with a C++ compiler), the same
contexts read in torch, and gathered from the pool per layer (the model's own path, and the
engine's before `RowContexts`), interleaved on one thread, at each of `--contexts`.

`--decoders` instead compares the Mimi decoder implementations on one thread (the checkpoint's
`Mimi.decode`, the engine's `CpuDecoder` in float32 and with int8 transformer linears, and the
latter with its SEANet run on the whole batch at once instead of in groups of rows) at 16 rows x
1 frame, 8 and 16 rows x 4 frames: the variants run interleaved, and each reports the
minimum over `--repeats` calls of its thread CPU time and of its wall time, per row-frame (the
minimum and CPU time so that other load on a shared machine disturbs the comparison least).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import foreign_cpu_seconds, machine_info, round_floats  # noqa: E402


def _time(fn, repeats: int) -> float:
    fn()  # warm-up (new shapes)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def build(model_dir: str, device: str, max_rows: int, context: int, engine_options: dict):
    from intone.engine import Engine, EngineConfig
    from intone.engine.kernels.row_contexts import plan_row_context_step
    from intone.engine.loading import load_model
    from intone.engine.model_runner import GenerateInputs
    from intone.engine.models.pocket.kv_cache import SequenceStep

    # torch_threads=0: this script sets the thread count itself (no per-stage thread budget).
    # max_active: the decoder state pool holds a row for every batch size asked for.
    config = EngineConfig(
        device=device,
        **{"torch_threads": 0, "max_active": max(max_rows, 16), **engine_options},
    )
    engine = Engine(load_model(model_dir, device=device), config)
    engine.prepare_traces()  # as the server and the plugins' prewarm do: calls replay traces
    runner = engine.runner
    flow_lm = runner.flow_lm

    def ar_call(rows: int):
        per_row = context + 1
        steps = [SequenceStep(torch.arange(r * per_row, (r + 1) * per_row), 1) for r in range(rows)]
        # Seated once, as rows that stay in the batch are: each call rewrites the same position.
        order, positions, attention = plan_row_context_step(
            runner.row_contexts, steps, list(steps), native=runner.native_row_attention
        )
        previous = torch.randn(rows, flow_lm.latent_dim, device=device)
        noise = torch.randn(rows, flow_lm.latent_dim, device=device) * 0.5
        thresholds = torch.full((rows,), 1e9, device=device)
        order_t = torch.tensor(order, device=device)
        back = torch.argsort(order_t)
        inputs = GenerateInputs(
            previous, positions, attention, noise, thresholds, order_t, rows, back
        )

        def call():
            with torch.no_grad():
                runner.generate_step(inputs)
                if device != "cpu":
                    torch.cuda.synchronize()

        return call

    slots = [runner.decoder_states.acquire() for _ in range(max_rows)]

    def decode_call(rows: int, frames: int = 1):
        latents = torch.randn(rows, frames, flow_lm.latent_dim, device=device)

        def call():
            runner.decode(slots[:rows], latents)
            if device != "cpu":
                torch.cuda.synchronize()

        return call

    return engine, ar_call, decode_call


def decode_beside_ar(runner, ar, decode, row_frames: int, parts: int, repeats: int) -> dict:
    """Decode calls split into `parts` while another thread steps the AR stage without pause:
    what each stage gets done per second when both want the cores."""
    runner.decode_parts = parts
    stop, steps = threading.Event(), [0]

    def step_ar() -> None:
        while not stop.is_set():
            ar()
            steps[0] += 1

    decode()  # warm-up (new shapes)
    stepping = threading.Thread(target=step_ar)
    stepping.start()
    try:  # a failing decode must not leave the AR thread stepping forever
        time.sleep(0.1)
        steps_before, t, cpu = steps[0], time.perf_counter(), time.process_time()
        for _ in range(repeats):
            decode()
        wall = time.perf_counter() - t
        return {
            "decode_parts": parts,
            "decode_row_frames_per_s": repeats * row_frames / wall,
            "ar_steps_per_s": (steps[0] - steps_before) / wall,
            "cores_used": (time.process_time() - cpu) / wall,
        }
    finally:
        stop.set()
        stepping.join()


def profile(ar, decode, repeats: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for name, fn in (("AR step", ar), ("decode", decode)):
        fn()
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                fn()
        print(f"== {name}, {repeats} calls")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def compare_decoders(model_dir: str, repeats: int) -> list[dict]:
    """Per row-frame cost of each decoder implementation, one thread, interleaved calls; the
    one- and four-row calls show what a call costs apart from its row-frames."""
    from intone.engine.kernels.cpu_decoder import CpuDecoder
    from intone.engine.loading import load_model

    torch.set_num_threads(1)
    mimi = load_model(model_dir).model.mimi
    decoders = {
        "mimi": mimi,
        "cpu": CpuDecoder(mimi),
        "cpu-int8": CpuDecoder(mimi, int8=True),
        "cpu-int8-whole": CpuDecoder(mimi, int8=True, seanet_group_values=2**62),
    }
    rows = []
    for batch, frames in ((1, 1), (4, 1), (16, 1), (8, 4), (16, 4)):
        latents = torch.randn(batch, frames, mimi.quantizer.output_proj.in_channels)
        states = {name: d.init_decoder_state(batch) for name, d in decoders.items()}
        best = {name: [float("inf"), float("inf")] for name in decoders}
        with torch.no_grad():
            for name, decoder in decoders.items():
                decoder.decode(latents, states[name])  # warm-up
            for _ in range(repeats):
                for name, decoder in decoders.items():
                    cpu, wall = time.thread_time(), time.perf_counter()
                    decoder.decode(latents, states[name])
                    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
                    best[name] = [min(best[name][0], cpu), min(best[name][1], wall)]
        for name, (cpu, wall) in best.items():
            row = {
                "decoder": name,
                "batch": batch,
                "frames": frames,
                "cpu_ms_per_row_frame": cpu * 1000 / (batch * frames),
                "wall_ms_per_row_frame": wall * 1000 / (batch * frames),
            }
            rows.append(row)
            print(
                f"{name:15s} {batch:2d} rows x {frames} frames: "
                f"{row['cpu_ms_per_row_frame']:.2f} ms CPU, {row['wall_ms_per_row_frame']:.2f} ms "
                f"wall per row-frame (min of {repeats})",
                flush=True,
            )
    return rows


def compare_attention(model_dir: str, contexts: list[int], repeats: int) -> list[dict]:
    """The AR step at 16 rows with its decode attention read from each row's dense context (the
    engine's, `plan_row_context_step`), by the native operator where it builds and in torch,
    against a padded gather from the pool per layer (`plan_step`, still the single-request
    path's): one thread, the variants interleaved on the same runner and pool, the minimum and
    median thread CPU time over `repeats` calls each."""
    from intone.engine.kernels.row_contexts import plan_row_context_step
    from intone.engine.model_runner import GenerateInputs
    from intone.engine.models.pocket.kv_cache import SequenceStep, plan_step

    torch.set_num_threads(1)
    rows, results = 16, []
    engine, _, _ = build(model_dir, "cpu", rows, max(contexts), {})
    runner, latent_dim = engine.runner, engine.runner.flow_lm.latent_dim
    for context in contexts:
        per_row = context + 1
        steps = [SequenceStep(torch.arange(r * per_row, (r + 1) * per_row), 1) for r in range(rows)]
        variants, contexts = {}, runner.row_contexts
        if runner.native_row_attention:
            native = plan_row_context_step(contexts, steps, list(steps), native=True)
            variants["dense-native"] = native
        variants["dense-torch"] = plan_row_context_step(contexts, steps, list(steps))
        order, positions, _ = variants["dense-torch"]
        _, gather = plan_step(runner.pool, steps)
        fixed = (torch.randn(rows, latent_dim), torch.randn(rows, latent_dim) * 0.5)
        calls = {}
        attentions = {name: attention for name, (_, _, attention) in variants.items()}
        for name, attention in (*attentions.items(), ("gather", gather)):
            inputs = GenerateInputs(
                fixed[0], positions, attention, fixed[1], torch.full((rows,), 1e9),
                torch.tensor(order), rows, torch.argsort(torch.tensor(order)),
            )  # fmt: skip
            calls[name] = lambda inputs=inputs: runner.generate_step(inputs)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for call in calls.values():
            call()  # warm-up
        for _ in range(repeats):
            for name, call in calls.items():
                cpu = time.thread_time()
                call()
                times[name].append(time.thread_time() - cpu)
        for name, values in times.items():
            row = {
                "attention": name,
                "rows": rows,
                "context": context,
                "cpu_ms_min": min(values) * 1000,
                "cpu_ms_median": statistics.median(values) * 1000,
            }
            results.append(row)
            print(
                f"{name:12s} {rows} rows, context {context}: AR step {row['cpu_ms_min']:.1f} ms "
                f"min, {row['cpu_ms_median']:.1f} ms median CPU ({repeats} calls)",
                flush=True,
            )
    engine.close()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--threads", default="1,2", help="torch thread counts to try")
    parser.add_argument("--context", type=int, default=150, help="positions per row (AR step)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--fast", action="store_true", help="the batched-fast engine options")
    parser.add_argument("--dtype", default=None, help="EngineConfig.dtype (default: the engine's)")
    parser.add_argument(
        "--decoders", action="store_true", help="compare the decoder implementations only"
    )
    parser.add_argument(
        "--attention",
        action="store_true",
        help="compare the AR step's attention (dense natively, in torch, a gather) at --contexts",
    )
    parser.add_argument("--contexts", default="80,150,250", help="positions per row (--attention)")
    parser.add_argument(
        "--decode-parts",
        default=None,
        help="decode split into these part counts while the AR stage steps beside it (e.g. 1,2)",
    )
    parser.add_argument("--frames", type=int, default=4, help="frames per row (--decode-parts)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--profile", type=int, default=None, help="print torch.profiler op tables at this batch"
    )
    args = parser.parse_args(argv)
    if args.decoders:
        rows = compare_decoders(args.model, args.repeats)
        if args.out:
            result = {"machine": machine_info("cpu"), "decoders": rows}
            args.out.write_text(json.dumps(round_floats(result), indent=2) + "\n")
        return
    if args.attention:
        contexts = [int(c) for c in args.contexts.split(",")]
        rows = compare_attention(args.model, contexts, args.repeats)
        if args.out:
            result = {"machine": machine_info("cpu"), "attention": rows}
            args.out.write_text(json.dumps(round_floats(result), indent=2) + "\n")
        return
    batches = [int(b) for b in args.batches.split(",")]
    options = {}
    if args.fast:
        from common import fast_engine_options

        options = fast_engine_options(args.device)
    if args.dtype:
        options["dtype"] = args.dtype
    max_rows = max(batches + [args.profile or 0])
    engine, ar_call, decode_call = build(args.model, args.device, max_rows, args.context, options)
    if args.profile:
        profile(ar_call(args.profile), decode_call(args.profile), args.repeats)

    def close_and_save(rows: list[dict]) -> None:
        engine.close()
        if args.out:
            result = {"machine": machine_info(args.device), "options": options, "rows": rows}
            args.out.write_text(json.dumps(round_floats(result), indent=2) + "\n")

    if args.decode_parts:
        torch.set_num_threads(1)
        parts = [int(p) for p in args.decode_parts.split(",")]
        rows = [
            {"batch": b, "frames": args.frames}
            | decode_beside_ar(
                engine.runner,
                ar_call(b),
                decode_call(b, args.frames),
                b * args.frames,
                p,
                args.repeats,
            )
            for b in batches
            for p in parts
        ]
        for row in rows:
            print(
                f"batch {row['batch']:2d} x {args.frames} frames, {row['decode_parts']} part(s), "
                f"AR stepping beside: decode {row['decode_row_frames_per_s']:.0f} row-frames/s, "
                f"AR {row['ar_steps_per_s']:.1f} steps/s, {row['cores_used']:.2f} cores"
            )
        close_and_save(rows)
        return
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for b in batches:
            ar, dec = ar_call(b), decode_call(b)
            foreign0, t0 = foreign_cpu_seconds(), time.perf_counter()
            ar_s, dec_s = _time(ar, args.repeats), _time(dec, args.repeats)

            # Both stages at once in two threads, as the engine runs them.
            def loop(fn, n, out):
                t = time.perf_counter()
                for _ in range(n):
                    fn()
                out.append((time.perf_counter() - t) / n)

            ar_out, dec_out = [], []
            pair = [
                threading.Thread(target=loop, args=(ar, args.repeats, ar_out)),
                threading.Thread(target=loop, args=(dec, args.repeats, dec_out)),
            ]
            for t in pair:
                t.start()
            for t in pair:
                t.join()
            foreign1, wall = foreign_cpu_seconds(), time.perf_counter() - t0
            row = {
                "foreign_cpu_cores": None
                if foreign0 is None or foreign1 is None
                else max(0.0, foreign1 - foreign0) / wall,
                "threads": threads,
                "batch": b,
                "ar_ms": ar_s * 1000,
                "decode_ms": dec_s * 1000,
                "ar_ms_concurrent": ar_out[0] * 1000,
                "decode_ms_concurrent": dec_out[0] * 1000,
                # Frames per second if the stages overlapped perfectly / ran back to back.
                "frames_per_s_serial": b / (ar_s + dec_s),
                "frames_per_s_concurrent": b / max(ar_out[0], dec_out[0]),
            }
            rows.append(row)
            print(
                f"threads {threads} batch {b:2d}: AR {row['ar_ms']:6.1f} ms, decode "
                f"{row['decode_ms']:6.1f} ms | both at once: AR {row['ar_ms_concurrent']:6.1f}, "
                f"decode {row['decode_ms_concurrent']:6.1f} | frames/s serial "
                f"{row['frames_per_s_serial']:.1f}, concurrent {row['frames_per_s_concurrent']:.1f}"
                f" (real time needs 12.5 per stream); other processes "
                f"{row['foreign_cpu_cores'] or 0:.2f} cores",
                flush=True,
            )
    close_and_save(rows)


if __name__ == "__main__":
    main()
