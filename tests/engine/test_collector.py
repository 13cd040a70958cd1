"""`freeze_long_lived`: what is alive when a process's engine is ready leaves the cyclic garbage
collector's reach (a full collection no longer walks it), once per process; what is made later is
still collected. Each case in a fresh process: a freeze is for the process's life."""

from __future__ import annotations

import subprocess
import sys

FREEZE = """
import gc, weakref
from intone.engine.collector import freeze_long_lived

class Node:
    pass

old = Node()
old.me = old  # a cycle, alive
assert any(o is old for o in gc.get_objects())
freeze_long_lived()
assert not any(o is old for o in gc.get_objects()), "a long-lived object is still walked"
frozen = gc.get_freeze_count()
assert frozen > 0

new = Node()
new.me = new
gone = weakref.ref(new)
del new
freeze_long_lived()  # once per process: nothing more is frozen
assert gc.get_freeze_count() == frozen, "a second call froze again"
gc.collect()
assert gone() is None, "a cycle made after the freeze was not collected"
print("ok")
"""


def test_what_is_alive_once_ready_is_frozen_once_and_later_garbage_is_collected():
    run = subprocess.run([sys.executable, "-c", FREEZE], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"
