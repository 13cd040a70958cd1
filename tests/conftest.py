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
def full_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("full", tmp_path_factory.mktemp("full"), seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint: Path) -> LoadedModel:
    return load_model(tiny_checkpoint)


@pytest.fixture(scope="session")
def tiny_voice(tiny_model: LoadedModel, tiny_checkpoint: Path) -> Voice:
    return load_voice(tiny_model.model, "default", tiny_checkpoint / "voices" / "default.wav")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`ray` tests start a local Ray cluster: opt-in, with `-m ray` (or any -m naming it)."""
    if "ray" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="opt-in: run with -m ray")
    for item in items:
        if "ray" in item.keywords:
            item.add_marker(skip)
