"""Where intone keeps files it makes for itself (fallback checkpoints, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$INTONE_CACHE_DIR, else $XDG_CACHE_HOME/intone, else ~/.cache/intone."""
    if os.environ.get("INTONE_CACHE_DIR"):
        return Path(os.environ["INTONE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "intone"
