"""Shared fixtures: offline checkpoints made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from intone.engine.checkpoint import make_checkpoint
from intone.engine.loading import LoadedModel, load_model
from intone.engine.voices import Voice, load_voice


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small-model family's tiny variant (a second model beside `tiny_checkpoint`)."""
    return make_checkpoint("tiny-small", tmp_path_factory.mktemp("small") / "small", seed=0)


@pytest.fixture(scope="session")
def full_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("full", tmp_path_factory.mktemp("full"), seed=0)


@pytest.fixture(scope="session")
def family_checkpoints() -> dict[str, Path]:
    """One checkpoint per architecture family's preset, made on first use
    (`support.checkpoints.checkpoint`) and shared by the session."""
    return {}


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint: Path) -> LoadedModel:
    return load_model(tiny_checkpoint)


@pytest.fixture(scope="session")
def tiny_voice(tiny_model: LoadedModel, tiny_checkpoint: Path) -> Voice:
    return load_voice(tiny_model.model, "default", tiny_checkpoint / "voices" / "default.wav")


# Opt-in markers: tests too slow for the default run (and CI), and what -m turns each on.
OPT_IN = {
    "ray": ("ray",),  # a local Ray Serve cluster
    "releases": ("releases", "full"),  # every full-size release against the reference
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Opt-in tests are skipped unless -m names their marker (or one that includes them)."""
    expression = config.getoption("markexpr") or ""
    for marker, enabling in OPT_IN.items():
        if any(name in expression for name in enabling):
            continue
        skip = pytest.mark.skip(reason=f"opt-in: run with -m {enabling[-1]}")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
