"""Many voices from one: distinct variants of a voice, and the single path's audio of a short
turn in each, for the voice cache's tests in the engine and through the server."""

from __future__ import annotations

import numpy as np
import torch

from intone.engine.generate import generate
from intone.engine.loading import LoadedModel
from intone.engine.options import GenerationOptions
from intone.engine.voices import Voice

from support.engine import engine_clauses

VOICES = 100
BUDGET_VOICES = 10
TEXT = "Hi there."
TIMEOUT = 30.0


def options(seed: int) -> GenerationOptions:
    return GenerationOptions(eos_threshold=1e9, max_frames=4, seed=seed, chain_frames=0)


def variant(base: Voice, index: int) -> Voice:
    """A distinct voice: the base prompt cut short by 0-4 positions, its K/V scaled a little."""
    length = base.length - index % 5
    scale = 1.0 + 0.003 * index
    return Voice(
        f"v{index}", base.keys[:, :length] * scale, base.values[:, :length] * (2.0 - scale)
    )


def single_path(loaded: LoadedModel, voice: Voice, seed: int) -> np.ndarray:
    clauses = engine_clauses(loaded, TEXT)
    return torch.cat(list(generate(loaded, voice, clauses, options(seed)))).numpy()


def assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, what
    error = np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want**2))
    assert error < 1e-4, f"{what}: relative RMS error {error:.2e} against the single path"
