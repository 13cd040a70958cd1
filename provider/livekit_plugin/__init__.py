"""intone plugin for LiveKit Agents: streaming Pocket TTS from a batched engine.

    from livekit.plugins import intone

    session = AgentSession(tts=intone.TTS(voice="alba"), ...)

In-process, all sessions of a worker process share one engine per model, so their speech
batches: run the worker with `job_executor_type=JobExecutorType.THREAD` and
`load_fnc=intone.load_fnc`. With process-per-job workers, run `intone serve` and use
`intone.TTS(base_url="ws://host:port")`. See docs/providers.md.
"""

from typing import Any

from livekit.agents import Plugin

from intone.engine import Engine, EngineConfig
from intone.provider import registry

from .log import logger
from .models import TTSModels, TTSVoices
from .tts import TTS, ChunkedStream, SynthesizeStream
from .version import __version__


def load_fnc() -> float:
    """Worker load for LiveKit's dispatcher, 0..1: the occupancy of this process's engine.

    Requests generating or queued over the engine's batch slots (`EngineConfig.max_active`), so
    a worker whose engine is full (1.0) is sent no new jobs once past `load_threshold`. Use
    `AgentServer(load_fnc=intone.load_fnc)`; 0 while no engine is loaded.
    """
    return registry.load()


def prewarm(model: str | None = None, **engine_config: Any) -> Engine:
    """Load, start and warm the shared engine of `model` once for the worker process.

    For a worker's setup function, so the first job does not wait for the model. Keyword
    arguments are `intone.engine.EngineConfig` fields. The engine is kept for the life of the
    process; it is returned.
    """
    return registry.prewarm(model, config=EngineConfig(**engine_config) if engine_config else None)


__all__ = [
    "TTS",
    "ChunkedStream",
    "SynthesizeStream",
    "TTSModels",
    "TTSVoices",
    "load_fnc",
    "prewarm",
    "__version__",
]


class IntonePlugin(Plugin):
    def __init__(self) -> None:
        super().__init__(__name__, __version__, __package__, logger)

    def download_files(self) -> None:
        """`python agent.py download-files`: fetch the default model into the HF cache."""
        from intone.engine.loading import load_model

        load_model(None)


Plugin.register_plugin(IntonePlugin())
