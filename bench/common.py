"""Shared pieces of the benchmarks: the workload, the fast-path options, statistics, machine facts.

Everything every mode must agree on (texts, voice, seed, EOS off) is defined here once.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

SAMPLE_RATE = 24_000
# EOS off in every mode: random weights would stop at the first allowed frame, and with it off every
# mode generates the model's own length estimate for the text, so all modes make the same audio.
NO_EOS = 1e9
SEED = 1234
# Four prompt lengths (one clause each for intone's splitter, one chunk for the reference's), like
# the reference design's "four prompt-length variations". With EOS off the audio lengths are fixed
# by the token counts: about 4.4, 6.7, 8.0 and 12.0 s on the generated full-size checkpoint.
PROMPTS = (
    "Your table is booked.",
    "Your table is booked for tonight.",
    "I found two flights that leave tomorrow morning.",
    "The package should reach your door by Thursday afternoon.",
)
# A real-time stream may fall behind playback by this much before it counts as an underrun.
UNDERRUN_SLACK_S = 0.1


def fast_engine_options(device: str = "cpu") -> dict:
    """The EngineConfig fields of the engine's fastest path on `device`: the one place that says so.

    `batched-fast` and stages.py read this (tests/engine/test_fast_path.py states the same
    bfloat16 configuration for itself); it only names options this intone version has, so it is
    empty (batched-fast == batched) until the engine grows them.
    """
    from intone.engine import EngineConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    options: dict = {}
    if "dtype" in fields:
        options["dtype"] = "bfloat16"
    if "torch_threads" in fields and device == "cpu":
        # The engine's AR and decoder threads each run torch ops at once: with torch's default
        # (all cores each) they oversubscribe the cores, so half each
        # (bench/results/cpu-2core/README.md).
        options["torch_threads"] = max(1, (os.cpu_count() or 2) // 2)
    return options


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def underran(arrivals: list[tuple[float, int]], slack: float = UNDERRUN_SLACK_S) -> bool:
    """Whether playback started at the first chunk would ever run dry (by more than `slack`)."""
    return first_gap(arrivals, slack) is not None


def first_gap(
    arrivals: list[tuple[float, int]], slack: float = UNDERRUN_SLACK_S
) -> tuple[float, float] | None:
    """Where playback started at the first chunk first runs dry by more than `slack`: (seconds of
    audio played before it, seconds the next chunk came late); None if it never does.

    `arrivals`: (arrival time in s, samples in that chunk), in order. Playback of chunk k can start
    once everything before it has played: at t0 + (samples before k) / rate; it underruns when chunk
    k arrives later than that plus the slack.
    """
    if not arrivals:
        return None
    t0 = arrivals[0][0]
    played = 0
    for t, samples in arrivals:
        due = t0 + played / SAMPLE_RATE
        if t > due + slack:
            return played / SAMPLE_RATE, t - due
        played += samples
    return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
                return [f for f in wanted if f in flags]
    except OSError:
        pass
    return []


def machine_info(device: str = "cpu") -> dict:
    import torch

    info: dict = {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "loadavg_start": list(os.getloadavg()),
    }
    try:
        from importlib.metadata import version

        info["pocket_tts"] = version("pocket-tts")
    except Exception:
        info["pocket_tts"] = None
    try:
        root = Path(__file__).resolve().parent.parent
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        info["git_dirty"] = bool(dirty)
    except OSError:
        pass
    return info


def foreign_cpu_seconds() -> float | None:
    """Busy CPU seconds of the whole machine less those of this process and its children."""
    try:
        import psutil
    except ImportError:
        return None
    times = psutil.cpu_times()
    busy = sum(getattr(times, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq"))
    me = psutil.Process()
    ours = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            ours += t.user + t.system
        except psutil.Error:
            pass
    return busy - ours


def busy_cores() -> float:
    """Cores busy over the last minute (the 1-minute load average), for the 'machine load' note."""
    return os.getloadavg()[0]


def round_floats(obj, digits: int = 4):
    if isinstance(obj, float):
        return obj if math.isnan(obj) or math.isinf(obj) else round(obj, digits)
    if isinstance(obj, dict):
        return {k: round_floats(v, digits) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [round_floats(v, digits) for v in obj]
    return obj
