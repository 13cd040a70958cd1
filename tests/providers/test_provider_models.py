"""LiveKit and Pipecat with several models: `language=` and `model=`, switching between turns,
in-process (one shared engine per model) and remote (the server's models), clear refusals."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from livekit.agents import APIConnectOptions, APIStatusError
from livekit.plugins import intone
from livekit.plugins.intone.models import TTSModels
from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSSpeakFrame
from pipecat.tests.utils import run_test
from pipecat.transcriptions.language import Language

from intone.engine import UnknownModelError, releases
from intone.provider import registry
from intone.provider.pipecat import IntoneTTSService
from intone.provider.server import create_app

from support.server import make_engine, serving

FAST = dict(eos_threshold=1e9, max_frames=6)
NO_RETRY = APIConnectOptions(max_retry=0)


@pytest.fixture(scope="module")
def two_model_server(tiny_checkpoint: Path, small_checkpoint: Path):
    engines = [make_engine(tiny_checkpoint), make_engine(small_checkpoint)]
    try:
        with serving(create_app(engines)) as url:
            yield url, engines
    finally:
        for engine in engines:
            engine.close()


def test_language_picks_the_language_model() -> None:
    assert releases.model_for_language("fr") == "french_24l"  # as Pipecat maps French
    assert releases.model_for_language("fr-CA") == "french_24l"
    assert releases.model_for_language("pt_BR") == "portuguese"
    assert releases.model_for_language("german") == "german"
    with pytest.raises(UnknownModelError) as e:
        releases.model_for_language("ja")
    assert "fr (french_24l)" in str(e.value)
    # LiveKit's own language forms, without loading anything.
    assert intone.TTS(language="fr-FR").model == "french_24l"
    assert intone.TTS(language="spanish").model == "spanish"
    assert intone.TTS(language="fr", model="english_2m_2026-10").model == "english_2m_2026-10"
    with pytest.raises(UnknownModelError):
        intone.TTS(language="ja")
    tts = intone.TTS()
    tts.update_options(language="de-DE")
    assert tts.model == "german"
    with pytest.raises(UnknownModelError):
        tts.update_options(language="ja")
    assert tts.model == "german"  # unchanged by the refused update
    # Pipecat's Language enum.
    assert IntoneTTSService.language_to_service_language(None, Language.FR) == "french_24l"  # type: ignore[arg-type]
    assert IntoneTTSService.language_to_service_language(None, Language.JA) is None  # type: ignore[arg-type]
    assert set(typing.get_args(TTSModels)) == {"kyutai/pocket-tts", *releases.release_names()}


async def test_livekit_model_change_moves_later_turns_in_process(
    tiny_checkpoint: Path, small_checkpoint: Path
) -> None:
    tts = intone.TTS(model=tiny_checkpoint, **FAST)
    try:
        first = await tts.synthesize("The first model speaks.").collect()
        first_engine = tts.engine
        tts.update_options(model=small_checkpoint)
        assert tts.engine is None  # not loaded until a turn needs it
        second = await tts.synthesize("The second model speaks.").collect()
        second_engine = tts.engine
        assert first_engine is not None and second_engine is not None
        assert first_engine is not second_engine
        assert second_engine.loaded.source == str(small_checkpoint / "config.yaml")
        assert first.duration > 0 and second.duration > 0
        assert registry.users(small_checkpoint) == 1
    finally:
        await tts.aclose()
    assert registry.users(small_checkpoint) == 0 and registry.users(tiny_checkpoint) == 0


async def test_livekit_remote_model_and_unserved_language(
    two_model_server, small_checkpoint: Path
) -> None:
    url, engines = two_model_server
    before = engines[1].metrics()["requests_completed"]
    tts = intone.TTS(base_url=url, model=small_checkpoint.name, **FAST)
    frame = await tts.synthesize("Picked by name.").collect()
    assert frame.duration > 0
    assert engines[1].metrics()["requests_completed"] == before + 1
    tts.update_options(language="fr")
    with pytest.raises(APIStatusError) as e:
        await tts.synthesize("Bonjour.", conn_options=NO_RETRY).collect()
    assert e.value.status_code == 400 and not e.value.retryable
    assert "unknown_model" in str(e.value) and small_checkpoint.name in str(e.value)
    await tts.aclose()


async def test_pipecat_model_and_language_remote(two_model_server, small_checkpoint: Path) -> None:
    url, engines = two_model_server
    before = engines[1].metrics()["requests_completed"]
    tts = IntoneTTSService(
        base_url=url,
        model=small_checkpoint.name,
        settings=IntoneTTSService.Settings(**FAST),
    )
    down, _ = await run_test(tts, frames_to_send=[TTSSpeakFrame("Picked by name.")])
    assert any(isinstance(f, TTSAudioRawFrame) for f in down)
    assert engines[1].metrics()["requests_completed"] == before + 1

    french = IntoneTTSService(base_url=url, language=Language.FR)
    assert french._settings.language == "french_24l"
    down, up = await run_test(french, frames_to_send=[TTSSpeakFrame("Bonjour.")])
    errors = [f for f in up if isinstance(f, ErrorFrame)]
    assert errors and "unknown_model" in errors[0].error
    assert not any(isinstance(f, TTSAudioRawFrame) for f in down)
