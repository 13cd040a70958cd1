"""The engine keeps freed activations in glibc's heap and asks torch for huge pages
(engine/cpu_memory.py)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from intone.engine.cpu_memory import HUGE_PAGES_ENV, KERNEL_HUGE_PAGES

# In a fresh process (malloc settings are process-wide), an engine made with or without the
# setting, then what a decode call does to the heap: many blocks of MBs alive at once (16 x 8 MB),
# then all freed; the minor page faults per call once warm. (The decoder's own calls are no longer
# the workload: since its narrow convolutions keep their activations in per-row buffers, how many
# of its blocks glibc maps again varied from 0 to 2,800 a call between processes.)
CALL_FAULTS = """
import resource, sys, torch
from intone.engine import Engine, EngineConfig
from intone.engine.loading import load_model
engine = Engine(load_model(sys.argv[1]), EngineConfig(keep_freed_memory=sys.argv[2] == "on"))
def call():
    activations = [torch.ones(2 << 20) for _ in range(16)]
    return sum(float(a[-1]) for a in activations)
for _ in range(3):
    call()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    call()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def faults_per_call(checkpoint: Path, keep_freed_memory: bool) -> float:
    setting = "on" if keep_freed_memory else "off"
    run = subprocess.run(
        [sys.executable, "-c", CALL_FAULTS, str(checkpoint), setting],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return float(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_activations_stop_page_faulting(tiny_checkpoint: Path):
    """Without the setting glibc returns the freed blocks to the OS whenever the heap's top is
    free, and they fault in again on the next call: ~32,000 faults a call here in 4 KB pages, in
    most processes (where another allocation sits above them, the top stays), so the process
    that faults most of three is compared. With it they are reused."""
    without = max(faults_per_call(tiny_checkpoint, keep_freed_memory=False) for _ in range(3))
    with_setting = max(faults_per_call(tiny_checkpoint, keep_freed_memory=True) for _ in range(2))
    assert without > 20
    assert with_setting < without / 5


# A fresh process (torch reads its setting once): `first` runs before the engine is imported;
# then 64 MB in one torch allocation, and how much of the process is in huge pages.
HUGE_PAGES = """
import os, sys
{first}
import intone.engine
import torch
from intone.engine.cpu_memory import HUGE_PAGES_ENV, huge_pages
ones = torch.ones(16 << 20)
huge = [l.split()[1] for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")]
print(os.environ.get(HUGE_PAGES_ENV), "|", huge_pages(), "|", huge[0])
"""


def huge_pages_in_a_process(first: str = "", setting: str | None = None) -> tuple[str, str, int]:
    env = {k: v for k, v in os.environ.items() if k != HUGE_PAGES_ENV}
    if setting is not None:
        env[HUGE_PAGES_ENV] = setting
    run = subprocess.run(
        [sys.executable, "-c", HUGE_PAGES.format(first=first)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=env,
    )
    variable, status, huge_kb = run.stdout.strip().splitlines()[-1].split(" | ")
    return variable, status, int(huge_kb)


def kernel_huge_pages() -> bool:
    try:
        return "[never]" not in KERNEL_HUGE_PAGES.read_text()
    except OSError:
        return False


@pytest.mark.skipif(not kernel_huge_pages(), reason="the kernel has no transparent huge pages")
def test_importing_the_engine_puts_torchs_large_allocations_in_huge_pages():
    variable, status, huge_kb = huge_pages_in_a_process()
    assert variable == "1" and status == "on"
    assert huge_kb >= 32 << 10  # most of the 64 MB


def test_torch_imported_first_keeps_its_pages_and_the_log_says_why():
    variable, status, _ = huge_pages_in_a_process(first="import torch")
    assert variable == "None"  # too late to matter, so not set
    assert status.startswith("off (torch was imported before intone.engine")


def test_the_environment_keeps_small_pages():
    variable, status, _ = huge_pages_in_a_process(setting="0")
    assert variable == "0" and status == f"off ({HUGE_PAGES_ENV}=0)"
