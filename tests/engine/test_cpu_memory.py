"""The engine keeps freed activations in glibc's heap (engine/cpu_memory.py)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

# Decode calls on the engine's own decoder, in a fresh process (malloc settings are
# process-wide): the minor page faults per call once warm.
DECODE_FAULTS = """
import resource, sys, torch
from intone.engine import Engine, EngineConfig
from intone.engine.loading import load_model
engine = Engine(load_model(sys.argv[1]), EngineConfig(keep_freed_memory=sys.argv[2] == "on"))
decoder = engine.runner.decoder
state = decoder.init_decoder_state(16)
latents = torch.randn(16, 4, 32)
for _ in range(5):
    decoder.decode(latents, state)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    decoder.decode(latents, state)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def faults_per_decode_call(checkpoint: Path, keep_freed_memory: bool) -> float:
    setting = "on" if keep_freed_memory else "off"
    run = subprocess.run(
        [sys.executable, "-c", DECODE_FAULTS, str(checkpoint), setting],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return float(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_decode_calls_stop_page_faulting(tiny_checkpoint: Path):
    """Without the setting glibc returns a call's activations to the OS and faults them in on
    the next call (~100 faults per call here); with it they are reused."""
    without = faults_per_decode_call(tiny_checkpoint, keep_freed_memory=False)
    with_setting = faults_per_decode_call(tiny_checkpoint, keep_freed_memory=True)
    assert without > 20
    assert with_setting < without / 5
