"""An engine kept for the life of the process (the plugins' `prewarm`, the server once ready)
is out of the cyclic garbage collector's reach (`intone.engine.collector`), so that no full
collection walks it while streams wait. Each in a fresh process: the freeze is process-wide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PREWARM = """
import gc, sys
from intone.provider import registry
engine = registry.prewarm(sys.argv[1])
assert not any(o is engine for o in gc.get_objects()), "the pinned engine is still walked"
assert not any(o is engine.runner for o in gc.get_objects())
registry.shutdown()
print("ok")
"""

SERVER = """
import gc, sys
from starlette.testclient import TestClient
from intone.provider.server.app import create_app
from intone.provider.server.settings import ServerSettings
app = create_app(model=sys.argv[1], settings=ServerSettings())
with TestClient(app) as client:
    assert client.get("/healthz").json()["status"] == "ok"
    engine = app.state.intone.engine
    assert not any(o is engine for o in gc.get_objects()), "the served engine is still walked"
print("ok")
"""


def run(script: str, checkpoint: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", script, str(checkpoint)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "ok"


def test_a_prewarmed_engine_is_out_of_the_collectors_reach(tiny_checkpoint: Path):
    run(PREWARM, tiny_checkpoint)


def test_a_served_engine_is_out_of_the_collectors_reach_once_ready(tiny_checkpoint: Path):
    run(SERVER, tiny_checkpoint)
