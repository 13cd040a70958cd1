"""Which engine voice a requested voice means: one home for the plugins and the server.

An engine prefills only its default voice at start. The other voices its checkpoint names (the
released models have 17) are registered on first use, once per engine however many callers ask
at the same time (`add_voice_once`). In process (`backends.EngineBackend`), a voice may also be
a voice file's path, an hf:// path or the file's bytes (`engine_voice`). The server's clients
name voices only, never a file on the host; its aliases and uploaded voices are the server's
own (`server/voices.py`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import weakref
from pathlib import Path

from intone.engine import Engine
from intone.engine.errors import UnknownVoiceError
from intone.provider.model_names import model_name
from intone.provider.voice_input import decode_voice

logger = logging.getLogger(__name__)

_lock = threading.Lock()
# One lock per engine: a voice is encoded and prefilled once, not by each caller that asks.
_engine_locks: weakref.WeakKeyDictionary[Engine, threading.Lock] = weakref.WeakKeyDictionary()


def known_voices(engine: Engine) -> list[str]:
    """The voices `engine` speaks by name: registered ones and those its checkpoint names."""
    return sorted(set(engine.voices) | set(engine.loaded.voices))


def bytes_voice_name(data: bytes) -> str:
    """The name of a voice given as a file's bytes: by content, so the same bytes are encoded
    once (in process) or uploaded once (to a server)."""
    return "bytes-" + hashlib.sha256(data).hexdigest()[:24]


def add_voice_once(engine: Engine, name: str, source: str) -> None:
    """Register voice `name` from `source` (a file, an hf:// path) unless the engine has it.
    Blocks while the voice loads; callers of the same engine wait for one load."""
    with _voice_lock(engine):
        if name not in engine.voices:
            logger.info("adding voice %r from %s", name, source)
            engine.add_voice(name, source)


def add_checkpoint_voice(engine: Engine, name: str) -> None:
    """Register a voice the engine's checkpoint names (KeyError if it names none). Blocking."""
    add_voice_once(engine, name, engine.loaded.voices[name])


def engine_voice(engine: Engine, voice: str | bytes | None) -> str | None:
    """The engine voice of a plugin's `voice`, registered on first use: a voice name (one the
    checkpoint names is loaded), a voice file's path or hf:// path, or a file's bytes (audio or
    a voice state, checked as the server checks an upload: `VoiceRefusedError` with its code).
    None is the engine's default voice. Blocks while a voice loads: call it off the event loop.
    """
    if isinstance(voice, bytes):
        return _bytes_voice(engine, voice)
    if voice is None or voice in engine.voices:
        return voice
    if voice in engine.loaded.voices:
        add_checkpoint_voice(engine, voice)
        return voice
    if Path(voice).expanduser().is_file():
        add_voice_once(engine, voice, str(Path(voice).expanduser()))
        return voice
    if voice.startswith("hf://"):
        add_voice_once(engine, voice, voice)
        return voice
    raise UnknownVoiceError(f"unknown voice {voice!r}; known voices: {known_voices(engine)}")


def _bytes_voice(engine: Engine, data: bytes) -> str:
    name = bytes_voice_name(data)
    with _voice_lock(engine):
        if name not in engine.voices:
            voice, seconds = decode_voice(engine.model, model_name(engine.loaded.source), data)
            logger.info("adding voice %r from %.1f s of audio given as bytes", name, seconds)
            engine.add_voice(name, voice)
    return name


def _voice_lock(engine: Engine) -> threading.Lock:
    with _lock:
        return _engine_locks.setdefault(engine, threading.Lock())
