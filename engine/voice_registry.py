"""The engine's voices as its callers name them: registered from audio, a voice-state file or a
computed `Voice`, made resident again for a stream or a caller after an eviction, removed.

The pages are the voice cache's (`VoiceCache`, the scheduler's), changed under the engine lock
only. What takes long (a voice-state file read, audio encoded) runs outside it, before the locked
section that writes the voice's pages, so the AR thread never waits for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

from intone.engine.config import VOICE_LOAD_TRIES
from intone.engine.errors import EngineFullError
from intone.engine.models.pocket.model import PocketTTS
from intone.engine.voice_cache import VoiceCache, VoicePrefix
from intone.engine.voices import Voice, load_voice, voice_state_length

T = TypeVar("T")


def _same(voice: Voice) -> Voice:
    """A `Voice` handed to `add` loads again as itself."""
    return voice


class VoiceRegistry:
    """`Engine.add_voice`, `prefill_voice`, `remove_voice`, and the voice of `Engine.stream`."""

    def __init__(self, lock: threading.Condition, cache: VoiceCache, model: PocketTTS):
        self.lock = lock
        self.cache = cache
        self.model = model

    def names(self) -> list[str]:
        with self.lock:
            return sorted(self.cache)

    def add(self, name: str, source: str | Path | Voice, lazy: bool) -> None:
        """Register `name` (see `Engine.add_voice`): its pages written first, then swapped in."""
        if not isinstance(name, str) or not name:
            # "" could never be asked for: stream(voice="") means the default voice.
            raise ValueError(f"a voice name is a non-empty str, got {name!r}")
        if isinstance(source, Voice):
            voice: Voice | None = source
            load = partial(_same, source)
        else:
            voice = None
            load = partial(load_voice, self.model, name, source)
        if lazy:
            if voice is not None or Path(source).suffix != ".safetensors":  # type: ignore[arg-type]
                raise ValueError("lazy=True takes a voice-state .safetensors path")
            length = voice_state_length(self.model, Path(source))  # type: ignore[arg-type]
            with self.lock:
                if not self.cache.in_use(name):
                    self.cache.set(VoicePrefix(name, length, load))
                    return
            # A voice in use is replaced by one in the pool: its streams' next clauses need it.
        if voice is None:
            voice = load()
            if self.cache.evicts and Path(str(source)).suffix != ".safetensors":
                # Audio takes seconds to encode again (a voice state file, milliseconds to
                # read): an evicted one comes back from a copy in host memory instead.
                kept = Voice(voice.name, voice.keys.cpu(), voice.values.cpu())
                load = partial(_same, kept)
        with self.lock:
            table = self.cache.write(name, voice)
            self.cache.set(VoicePrefix(name, voice.length, load, table))

    def prefill(self, name: str) -> None:
        """Make `name`'s pages resident now (see `Engine.prefill_voice`)."""
        with self.lock:
            entry = self.cache.entry(name)
            self.cache.touch(entry)
            if entry.table is not None:
                return
        voice = self.cache.load(entry)
        with self.lock:
            self.cache.place_loaded(entry, voice)

    def remove(self, name: str) -> bool:
        with self.lock:
            return self.cache.remove(name)

    def with_resident(
        self, name: str, check: Callable[[], None], use: Callable[[VoicePrefix], T]
    ) -> T:
        """`use(voice)` under the lock, with `name`'s pages resident: an evicted (or lazily
        registered) voice is loaded here, outside the lock, and used in the same locked section
        that writes its pages. `check()` first, under the lock, each time (e.g. that the engine
        still serves). EngineFullError if the pool never keeps it long enough."""
        for _ in range(VOICE_LOAD_TRIES):
            with self.lock:
                check()
                entry = self.cache.entry(name)
                if entry.table is not None:
                    return use(entry)
            loaded = self.cache.load(entry)
            with self.lock:
                check()
                self.cache.place_loaded(entry, loaded)
                if self.cache.get(name) is entry and entry.table is not None:
                    return use(entry)
        raise EngineFullError(f"voice {name!r} could not be loaded into the KV pool")
