"""Uploaded voices on disk: one voice-state `.safetensors` per voice, who owns it, the quota.

A stored voice is the prefilled prompt (what `pocket-tts export-voice` writes, so the files
work with the reference too) plus header metadata: its display name, the served model it was
made for, its seconds of audio and its owner. The owner is a digest of the API key that
uploaded it (never the key, and stable when keys are reordered); without keys there is no owner
and every caller sees every upload. `--voice-store DIR` keeps them across restarts; without it
they live in a temporary directory removed at exit.

Engines register stored voices lazily (`Engine.add_voice(..., lazy=True)`): a restart reads
headers only, and a voice's pages are written when a stream first uses it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import safetensors

from intone.engine.voices import Voice, save_voice_state
from intone.provider.voice_input import STORED_VOICE_FORMAT

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"
ID_PREFIX = "voice_"


def owner_for(key: str | None) -> str | None:
    """Who owns what a caller uploads: a digest of its API key; None without keys."""
    if key is None:
        return None
    return hashlib.sha256(key.encode("utf-8", "replace")).hexdigest()[:32]


def is_voice_id(value: str) -> bool:
    body = value[len(ID_PREFIX) :]
    return (
        value.startswith(ID_PREFIX)
        and len(body) == 24
        and all(c in "0123456789abcdef" for c in body)
    )


@dataclass(frozen=True)
class StoredVoice:
    id: str
    name: str
    model: str  # the served model's name
    seconds: float
    owner: str | None
    path: Path

    def describe(self) -> dict:
        return {
            "id": self.id,
            "name": self.name,
            "model": self.model,
            "seconds": round(self.seconds, 2),
            "shared": False,
        }


class VoiceStore:
    def __init__(self, directory: str | Path | None = None):
        # Written by uploads' worker threads, read on the event loop: readers take a snapshot.
        self._lock = threading.Lock()
        self._voices: dict[str, StoredVoice] = {}
        self._pending: dict[str | None, int] = {}  # uploads in flight per owner (quota)
        self.temporary = directory is None
        self._directory: Path | None = None
        if directory is None:
            return  # a temporary directory, made by the first upload
        self._directory = Path(directory)
        try:
            self._directory.mkdir(parents=True, exist_ok=True)
            paths = sorted(self._directory.glob(f"*{SUFFIX}"))
            for path in self._directory.glob(f".*{SUFFIX}.tmp"):
                path.unlink(missing_ok=True)  # an upload cut short by a crash
        except OSError as e:
            raise ValueError(f"--voice-store {directory}: {e}") from e
        for path in paths:
            stored = self._read(path)
            if stored is not None:
                self._voices[stored.id] = stored

    @property
    def directory(self) -> Path:
        with self._lock:
            if self._directory is None:
                self._directory = Path(tempfile.mkdtemp(prefix="intone-voices-"))
            return self._directory

    def _read(self, path: Path) -> StoredVoice | None:
        try:
            with safetensors.safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            if meta.get("format") != STORED_VOICE_FORMAT or not is_voice_id(path.stem):
                raise ValueError("not a voice this store wrote")
            return StoredVoice(
                id=path.stem,
                name=meta["name"],
                model=meta["model"],
                seconds=float(meta["seconds"]),
                owner=meta.get("owner") or None,
                path=path,
            )
        except Exception as e:
            logger.warning("voice store: skipping %s: %s", path.name, e)
            return None

    # ---- who sees what

    @property
    def voices(self) -> dict[str, StoredVoice]:
        """id -> stored voice, a snapshot."""
        with self._lock:
            return dict(self._voices)

    def __contains__(self, voice_id: object) -> bool:
        with self._lock:
            return voice_id in self._voices

    def visible(self, voice_id: str, owner: str | None) -> StoredVoice | None:
        """The stored voice if `owner` may use it (its own, or any without keys)."""
        with self._lock:
            stored = self._voices.get(voice_id)
        if stored is None or stored.owner != owner:
            return None
        return stored

    def owned(self, owner: str | None) -> list[StoredVoice]:
        return [v for v in self.voices.values() if v.owner == owner]

    # ---- quota

    def reserve(self, owner: str | None, limit: int) -> bool:
        """Hold one of `owner`'s `limit` places for an upload in flight (0: no limit)."""
        held = len(self.owned(owner)) + self._pending.get(owner, 0)
        if limit and held >= limit:
            return False
        self._pending[owner] = self._pending.get(owner, 0) + 1
        return True

    def unreserve(self, owner: str | None) -> None:
        self._pending[owner] -= 1
        if not self._pending[owner]:
            del self._pending[owner]

    # ---- files

    def save(
        self, voice: Voice, name: str, model: str, seconds: float, owner: str | None
    ) -> StoredVoice:
        """Write the voice under a new id (atomically: a crash leaves no half file)."""
        voice_id = ID_PREFIX + secrets.token_hex(12)
        path = self.directory / f"{voice_id}{SUFFIX}"
        temporary = self.directory / f".{voice_id}{SUFFIX}.tmp"
        metadata = {
            "format": STORED_VOICE_FORMAT,
            "name": name,
            "model": model,
            "seconds": f"{seconds:.3f}",
        }
        if owner is not None:
            metadata["owner"] = owner
        try:
            save_voice_state(voice, temporary, metadata)
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        stored = StoredVoice(voice_id, name, model, seconds, owner, path)
        with self._lock:
            self._voices[voice_id] = stored
        return stored

    def delete(self, voice_id: str) -> None:
        with self._lock:
            stored = self._voices.pop(voice_id, None)
        if stored is not None:
            stored.path.unlink(missing_ok=True)

    def close(self) -> None:
        if self.temporary and self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
