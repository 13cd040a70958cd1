"""Shared fixtures: offline checkpoints made once per session."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import soundfile

from intone.engine import Engine, EngineConfig
from intone.engine.checkpoint import make_checkpoint
from intone.engine.loading import LoadedModel, load_model
from intone.engine.voices import Voice, load_voice

from support.engine import SECOND_VOICE, Reference


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
def tiny_model(tiny_checkpoint: Path) -> LoadedModel:
    return load_model(tiny_checkpoint)


@pytest.fixture(scope="session")
def tiny_voice(tiny_model: LoadedModel, tiny_checkpoint: Path) -> Voice:
    return load_voice(tiny_model.model, "default", tiny_checkpoint / "voices" / "default.wav")


# ---- the engine suites' fixtures (test_engine*.py)


@pytest.fixture(scope="module")
def second_voice_wav(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default voice played 25% faster (so higher and shorter): a different prompt length."""
    samples, rate = soundfile.read(str(tiny_checkpoint / "voices" / "default.wav"), dtype="float32")
    path = tmp_path_factory.mktemp("voices") / "second.wav"
    soundfile.write(str(path), samples, int(rate * 1.25))
    return path


@pytest.fixture(scope="module")
def voices(tiny_model: LoadedModel, tiny_voice: Voice, second_voice_wav: Path) -> dict[str, Voice]:
    second = load_voice(tiny_model.model, SECOND_VOICE, second_voice_wav)
    assert second.length != tiny_voice.length
    return {"default": tiny_voice, SECOND_VOICE: second}


@pytest.fixture(scope="module")
def reference(tiny_model: LoadedModel, voices: dict[str, Voice]) -> Reference:
    return Reference(tiny_model, voices)


@pytest.fixture
def make_engine(tiny_checkpoint: Path, second_voice_wav: Path) -> Iterator[Callable[..., Engine]]:
    """Engines on their own copy of the tiny model, with a second voice; closed at teardown."""
    engines: list[Engine] = []

    def make(second_voice: bool = True, **config) -> Engine:
        config.setdefault("num_pages", 512)
        # These tests hold the engine to the single path at 1e-4: float32, since the CPU default's
        # int8 linears are held to the fast path's tolerance instead (test_fast_path.py).
        config.setdefault("dtype", "float32")
        engine = Engine(load_model(tiny_checkpoint), EngineConfig(**config)).start()
        engines.append(engine)
        if second_voice:
            engine.add_voice(SECOND_VOICE, second_voice_wav)
        return engine

    yield make
    for engine in engines:
        engine.close()


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
