"""Unmodified framework plugins for OpenAI's speech API, pointed at intone over loopback."""

from __future__ import annotations

import pytest

from support.server import running_server

TEXT = "Hello from intone. This is a framework test."


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with running_server(tiny_checkpoint) as (server, _):
        yield server


@pytest.mark.parametrize(
    "model, response_format",
    [
        ("gpt-4o-mini-tts", None),  # the plugin's defaults: SSE with mp3 deltas
        ("tts-1", "pcm"),  # plain audio streaming
        ("tts-1", "wav"),
    ],
)
async def test_livekit_openai_tts(server, model, response_format):
    from livekit.plugins import openai as lk_openai

    kwargs = {} if response_format is None else {"response_format": response_format}
    tts = lk_openai.TTS(
        base_url=f"{server.url}/v1", api_key="unused", model=model, voice="ash", **kwargs
    )
    frames = []
    try:
        # The plugin brings its own HTTP client: no livekit http_context needed.
        async with tts.synthesize(TEXT) as stream:
            async for event in stream:
                frames.append(event.frame)
    finally:
        await tts.aclose()
    assert frames
    assert all(f.sample_rate == 24000 and f.num_channels == 1 for f in frames)
    seconds = sum(f.samples_per_channel for f in frames) / 24000
    assert seconds > 0.5
    assert any(any(f.data) for f in frames)


async def test_pipecat_openai_tts_service(server):
    from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSSpeakFrame
    from pipecat.services.openai.tts import OpenAITTSService
    from pipecat.tests.utils import run_test

    service = OpenAITTSService(
        api_key="unused",
        base_url=f"{server.url}/v1",
        settings=OpenAITTSService.Settings(voice="nova"),
    )
    down, up = await run_test(service, frames_to_send=[TTSSpeakFrame(TEXT)])
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    assert not [f for f in list(down) + list(up) if isinstance(f, ErrorFrame)]
    assert audio
    assert all(f.sample_rate == 24000 and f.num_channels == 1 for f in audio)
    assert sum(len(f.audio) for f in audio) / 2 / 24000 > 0.5
