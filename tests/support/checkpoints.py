"""Checkpoints of the architecture families, made on first use and shared by the session."""

from __future__ import annotations

from pathlib import Path

import pytest

from intone.engine.checkpoint import make_checkpoint


def checkpoint(cache: dict[str, Path], preset: str, tmp: pytest.TempPathFactory) -> Path:
    """`preset`'s checkpoint from `cache` (the `family_checkpoints` fixture), made if missing."""
    if preset not in cache:
        cache[preset] = make_checkpoint(preset, tmp.mktemp(preset), seed=0)
    return cache[preset]
