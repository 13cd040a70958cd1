"""The engine suites' fixtures: a second voice, the cached single-request reference, and engines
on their own copy of the tiny model (closed at teardown)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import soundfile

from intone.engine import Engine, EngineConfig
from intone.engine.loading import LoadedModel, load_model
from intone.engine.voices import Voice, load_voice

from support.engine import SECOND_VOICE, Reference


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
        # A number, not "auto": these engines skip the start-up measurement (test_admission.py).
        config.setdefault("max_active", 16)
        engine = Engine(load_model(tiny_checkpoint), EngineConfig(**config)).start()
        engines.append(engine)
        if second_voice:
            engine.add_voice(SECOND_VOICE, second_voice_wav)
        return engine

    yield make
    for engine in engines:
        engine.close()
