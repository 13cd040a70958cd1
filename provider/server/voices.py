"""The server's voices: a directory of prompts, OpenAI voice-name aliases, uploaded voices.

Every voice ends up in the engine's registry (`engine.add_voice`), which prefills its prompt once
and shares the resulting KV pages between all requests using it. What a voice name means to any
engine, and how a checkpoint's voice is loaded on first use, is `intone.provider.voices`; what
only the server has (aliases, uploads, their owners) is here.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from intone.engine import Engine, UnknownVoiceError
from intone.provider.protocol import echo
from intone.provider.server.voice_store import VoiceStore
from intone.provider.voices import add_checkpoint_voice, known_voices

logger = logging.getLogger(__name__)

VOICE_SUFFIXES = (".wav", ".flac", ".mp3", ".safetensors")
# OpenAI's built-in voice names. Pipecat's OpenAITTSService refuses any other name, so these
# must resolve to something: by default each maps to one of the registry's voices.
OPENAI_VOICES = (
    "alloy", "ash", "ballad", "cedar", "coral", "echo", "fable",
    "marin", "nova", "onyx", "sage", "shimmer", "verse",
)  # fmt: skip


def voice_files(directory: str | Path) -> dict[str, Path]:
    """name -> file for every voice prompt in `directory`, named by stem."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"--voices {directory} is not a directory")
    files: dict[str, Path] = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.suffix.lower() in VOICE_SUFFIXES:
            if path.stem in files:
                raise ValueError(f"two voice files named {path.stem!r} in {directory}")
            files[path.stem] = path
    return files


def add_voice_dir(engine: Engine, directory: str | Path) -> list[str]:
    """Register every voice in `directory`; blocking (audio prompts are encoded and prefilled)."""
    names = []
    for name, path in voice_files(directory).items():
        try:
            engine.add_voice(name, path)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"voice {name!r} from {path}: {e}") from e
        logger.info("voice %r from %s", name, path)
        names.append(name)
    if not names:
        logger.warning("no voice files (%s) in %s", ", ".join(VOICE_SUFFIXES), directory)
    return names


class VoiceResolver:
    """Turns a requested voice (name, alias, OpenAI name or stored voice id) into a registry
    voice.

    Stored (uploaded) voices are registry voices too, named by their id, but only their owner
    may name them, and they are never listed, aliased or named in an error message: the
    server's own voices (`shared_names`) are."""

    def __init__(
        self,
        engine: Engine,
        aliases: dict[str, str] | None = None,
        store: VoiceStore | None = None,
        model: str = "",
    ):
        self.engine = engine
        self.aliases = dict(aliases or {})
        self.store = store  # uploaded voices (set by the runtime once the model is named)
        self.model = model  # the served model's name: a stored voice is for one model
        self._loading: dict[str, asyncio.Task] = {}

    def shared_names(self) -> list[str]:
        """The server's own voices: registry and checkpoint voices, not uploads."""
        return [name for name in known_voices(self.engine) if not self._stored(name)]

    def _stored(self, name: str) -> bool:
        return self.store is not None and name in self.store

    def server_voices(self) -> list[str]:
        """The registry's voices that are the server's own (not uploads)."""
        return [name for name in self.engine.voices if not self._stored(name)]

    def alias_table(self) -> dict[str, str]:
        """Every alias and the registry voice it stands for right now."""
        voices = self.ordered_voices()
        table = {}
        for index, name in enumerate(OPENAI_VOICES):
            if name not in voices:
                table[name] = voices[index % len(voices)] if voices else name
        for alias, target in self.aliases.items():
            table[alias] = target
        return table

    def ordered_voices(self) -> list[str]:
        """Registry voices, the default first, so that `alloy` (the first name) is the default."""
        voices = self.server_voices()
        default = self.engine.default_voice
        return ([default] if default in voices else []) + [v for v in voices if v != default]

    def known(self) -> list[str]:
        """Names a client may ask for: the server's own voices and aliases (and its own
        uploads, which are not listed here)."""
        return sorted(set(self.shared_names()) | set(self.alias_table()))

    async def resolve(self, requested: str | None, owner: str | None = None) -> str:
        """The registry voice for `requested` (None: the default); raises UnknownVoiceError.
        `owner`: the caller's owner id (`voice_store.owner_for`), for its uploaded voices.

        A voice that may not be in the KV pool (an upload registered from its header, or any
        voice with a voice budget: evicted while idle) has its pages written here, off the event
        loop, so that the stream() that follows finds them."""
        name = await self._resolve(requested, owner)
        if self._stored(name) or self.engine.config.voice_cache_mb is not None:
            await asyncio.to_thread(self.engine.prefill_voice, name)
        return name

    async def _resolve(self, requested: str | None, owner: str | None) -> str:
        if requested is None or requested == "":
            if self.engine.default_voice is None:
                raise UnknownVoiceError("this model has no default voice: name one")
            return self.engine.default_voice
        if self.store is not None and requested in self.store:
            stored = self.store.visible(requested, owner)
            if stored is None or stored.model != self.model:
                what = "another model's voice" if stored is not None else "unknown voice"
                raise UnknownVoiceError(
                    f"{what} {echo(requested)}; known voices: {self.known()}"
                    + (f" (it is for model {stored.model!r})" if stored is not None else "")
                )
            return requested
        if requested in self.engine.voices:
            return requested
        target = self.alias_table().get(requested)
        if target is not None and target in self.engine.voices:
            return target
        name = target or requested
        if name in self.engine.loaded.voices:
            await self._load_checkpoint_voice(name)
            return name
        raise UnknownVoiceError(f"unknown voice {echo(requested)}; known voices: {self.known()}")

    async def _load_checkpoint_voice(self, name: str) -> None:
        """A voice the checkpoint names but the engine has not loaded yet (e.g. the released
        model's predefined voices): load it once, on first use, off the event loop."""
        task = self._loading.get(name)
        if task is None:
            # One task per voice, so that a burst of requests holds one worker thread, not one
            # each.
            task = asyncio.ensure_future(asyncio.to_thread(add_checkpoint_voice, self.engine, name))
            self._loading[name] = task
        try:
            await asyncio.shield(task)
        except Exception as e:
            self._loading.pop(name, None)
            raise UnknownVoiceError(f"voice {name!r} could not be loaded: {e}") from e
