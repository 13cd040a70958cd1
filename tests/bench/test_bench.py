"""Smoke test of the benchmark runner on the tiny checkpoint: it runs, and its output holds up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from intone.engine.kernels import native
from intone.engine.metrics import STAGES

ROOT = Path(__file__).resolve().parents[2]


def test_runner_smoke(tiny_checkpoint: Path, tmp_path: Path):
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "bench" / "run.py"), "--model", str(tiny_checkpoint)]
    cmd += ["--modes", "sequential,batched", "--concurrency", "1,2", "--requests", "2"]
    cmd += ["--warmup", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]

    results = json.loads((out / "results.json").read_text())
    assert {"cpu", "cores", "torch", "gpu"} <= set(results["machine"])
    runs = {(r["mode"], r["concurrency"]): r for r in results["runs"]}
    assert set(runs) == {("sequential", 1), ("sequential", 2), ("batched", 1), ("batched", 2)}
    for run in runs.values():
        assert run["requests"] == run["completed"] == 2 and run["errors"] == 0
        assert run["ttfa_ms_p50"] > 0 and run["latency_ms_p50"] >= run["ttfa_ms_p50"]
        assert run["audio_throughput"] > 0 and run["rtf_p50"] > 0
        assert 0 <= run["underrun_rate"] <= 1
        assert len(run["underrun_examples"]) == min(run["underruns"], 5)
        assert run["client_cpu_share"] >= 0
    # EOS is off: every mode generates the same audio for the same requests.
    audio = {round(r["audio_s"], 3) for r in runs.values()}
    assert len(audio) == 1
    batched = runs[("batched", 2)]["batch_mean"]
    assert set(batched) == set(STAGES)
    assert all(v >= 1 for v in batched.values())
    assert batched["generate"] > 1, "two concurrent requests never shared an AR step"
    assert set(results["capacity"]) == {"sequential", "batched"}
    assert results["acceptance"]["batched"]["vs sequential"]["ttfa_p50_c1"] > 0
    for name in ("results.md", "ttfa.png", "throughput.png"):
        assert (out / name).stat().st_size > 0
    assert "| batched | c=2 |" in (out / "results.md").read_text()


def test_ws_mode_reports_the_servers_share_of_ttfa(tiny_checkpoint: Path, tmp_path: Path):
    """`ws` runs carry the server's own TTFA (from each stream's `done` event) beside the
    client's, so that the transport's share (e.g. Ray's proxy in `ws-ray`) is measured, not
    guessed."""
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "bench" / "run.py"), "--model", str(tiny_checkpoint)]
    cmd += ["--modes", "ws", "--concurrency", "1", "--requests", "2", "--warmup", "1"]
    cmd += ["--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]

    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["completed"] == 2
    # Each request's server interval lies inside its client interval, so every quantile does.
    assert 0 < run["server_ttfa_ms_p50"] <= run["ttfa_ms_p50"]
    assert 0 < run["server_ttfa_ms_p95"] <= run["ttfa_ms_p95"]
    assert "TTFA in the server" in (out / "results.md").read_text()


def test_stages_smoke(tiny_checkpoint: Path, tmp_path: Path):
    """`bench/stages.py` times both stages on the engine's own runner, and compares the AR
    step's decode attention (dense contexts natively where a compiler works, in torch, a gather)
    on the same rows."""
    script = [sys.executable, str(ROOT / "bench" / "stages.py"), "--model", str(tiny_checkpoint)]
    stages, attention = tmp_path / "stages.json", tmp_path / "attention.json"
    for args, out in (
        (["--batches", "1,4", "--threads", "1", "--context", "20", "--repeats", "2"], stages),
        (["--attention", "--contexts", "10,30", "--repeats", "2"], attention),
    ):
        proc = subprocess.run(
            [*script, *args, "--out", str(out)], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(stages.read_text())["rows"]
    assert [(r["threads"], r["batch"]) for r in rows] == [(1, 1), (1, 4)]
    assert all(r["ar_ms"] > 0 and r["decode_ms"] > 0 for r in rows)
    compared = json.loads(attention.read_text())["attention"]
    variants = ("dense-torch", "gather")
    if native.cxx_compiler():
        variants = ("dense-native", *variants)
    assert {(r["attention"], r["context"]) for r in compared} == {
        (name, context) for name in variants for context in (10, 30)
    }
    assert all(0 < r["cpu_ms_min"] <= r["cpu_ms_median"] for r in compared)


def test_idle_request_smoke(tiny_checkpoint: Path, tmp_path: Path):
    """bench/idle_request.py: a server per pacing mode, the long request over both endpoints,
    and the server's own pacing figures in the output."""
    out = tmp_path / "idle.json"
    cmd = [sys.executable, str(ROOT / "bench" / "idle_request.py"), "--model", str(tiny_checkpoint)]
    cmd += ["--chars", "120", "--pacing", "yield", "--max-active", "4", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert run["pacing"] == "yield" and run["engine"]["max_active"] == 4
    for endpoint in ("websocket", "openai"):
        assert run[endpoint]["audio_s"] > 0 and run[endpoint]["x_real_time"] > 0, run
    assert "yield" in proc.stdout and "x real time" in proc.stdout


def test_agent_latency_smoke(tiny_checkpoint: Path, tmp_path: Path):
    """`bench/agent_latency.py` drives every path (LiveKit in-process and remote, Pipecat,
    IntoneClient) from a simulated LLM and reports first-token-to-first-audio per level."""
    out = tmp_path / "agent"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "agent_latency.py"),
        "--model",
        str(tiny_checkpoint),
    ]
    cmd += ["--paths", "livekit,livekit-remote,pipecat,client", "--rates", "100"]
    cmd += ["--concurrency", "1,2", "--turns", "2", "--first-clause-min-words", "2"]
    cmd += ["--label", "smoke", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results-smoke.json").read_text())
    assert results["policy"] == {"first_clause_min_words": 2}
    assert isinstance(results["max_active"], int) and results["max_active"] >= 1
    runs = {(r["path"], r["concurrency"]): r for r in results["runs"]}
    paths = ("livekit", "livekit-remote", "pipecat", "client")
    assert set(runs) == {(p, c) for p in paths for c in (1, 2)}
    for (path, _), run in runs.items():
        assert run["turns"] == 2 and run["errors"] == []
        assert 0 < run["p50_ms"] <= run["p95_ms"] < 10_000
        for turn in run["turn_results"]:
            assert turn["audio_s"] > 0
            if path != "pipecat":  # its frames carry no clause marks
                assert len(turn["first_clause"].split()) >= 2
    assert "| livekit | 100 | 1 | 2 |" in (out / "results-smoke.md").read_text()
