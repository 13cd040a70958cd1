"""Voice prompt pages in the KV pool: which voices hold pages, who uses them, what to evict.

Every voice a stream may name is registered with a way to make its prompt keys and values again
(`VoicePrefix.load`: a voice-state file read back, or a `Voice` kept in host memory: one the
caller handed over, or an audio prompt's, which would take seconds to encode again). A voice's
pages are resident while any open stream uses it (`users`), and while idle as long as the
resident voices fit the byte budget: past it, or when a clause or a voice finds the pool short,
the least recently used idle voices give their pages back (without a budget every voice stays).
The next stream on an evicted voice loads it again (`Engine.prefill_voice`), so a process can
hold thousands of voices with a few of them in the pool.

Its methods run under the engine lock, except `load` (a file read or an encoding), which runs
outside it; a voice's pages are written by the model runner (`ModelRunner.write_voice`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from intone.engine.block_manager import BlockManager, PageTable
from intone.engine.errors import EngineFailedError, EngineFullError, UnknownVoiceError
from intone.engine.model_runner import ModelRunner
from intone.engine.voices import Voice

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class VoicePrefix:
    """A registered voice: its prompt length, how to make it again, its pages when resident."""

    name: str
    length: int  # prompt positions
    load: Callable[[], Voice]
    table: PageTable | None = None  # None: not in the pool (never loaded, or evicted)
    users: int = 0  # open streams speaking with it: it is never evicted while any are
    last_used: int = 0  # a tick of the cache's clock, for least-recently-used eviction
    removed: bool = False  # no new stream may name it; dropped once its users are gone


class VoiceCache:
    """The scheduler's voices: a mapping of the names streams may ask for, with eviction."""

    def __init__(
        self,
        blocks: BlockManager,
        runner: ModelRunner,
        page_bytes: int,
        budget_bytes: int | None = None,
    ):
        self.blocks = blocks
        self.runner = runner
        self.page_bytes = page_bytes
        self.budget_bytes = budget_bytes
        self._entries: dict[str, VoicePrefix] = {}
        self._clock = itertools.count(1)
        self.loads = 0  # times a voice's pages were written (registered or loaded again)
        self.evictions = 0

    # ---- the names streams may ask for

    def __contains__(self, name: object) -> bool:
        entry = self._entries.get(name)  # type: ignore[call-overload]
        return entry is not None and not entry.removed

    def __getitem__(self, name: str) -> VoicePrefix:
        """The voice a stream speaks with, removed or not (its streams finish with it)."""
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return (name for name, entry in self._entries.items() if not entry.removed)

    def __len__(self) -> int:
        return sum(1 for entry in self._entries.values() if not entry.removed)

    def values(self) -> list[VoicePrefix]:
        """Every voice held, removed ones still in use too."""
        return list(self._entries.values())

    def get(self, name: str) -> VoicePrefix | None:
        """The voice a new stream may name (None if removed)."""
        return self._entries.get(name) if name in self else None

    def entry(self, name: str) -> VoicePrefix:
        """The voice a new stream may name; UnknownVoiceError if there is none."""
        entry = self.get(name)
        if entry is None:
            raise UnknownVoiceError(f"unknown voice {name!r}; known voices: {sorted(self)}")
        return entry

    def in_use(self, name: str) -> bool:
        """Whether a stream still speaks with `name`, removed or not."""
        entry = self._entries.get(name)
        return entry is not None and entry.users > 0

    # ---- registering and removing

    def set(self, entry: VoicePrefix) -> None:
        """Register (or replace) a voice. The streams using a replaced one speak their next
        clauses with the new one; its pages go back as their clauses end (shared pages are
        reference-counted)."""
        old = self._entries.get(entry.name)
        if old is not None:
            entry.users = old.users
            self._drop_pages(old)
        self._entries[entry.name] = entry
        self.touch(entry)
        if entry.table is not None:
            self.loads += 1
            self.fit()

    def remove(self, name: str) -> bool:
        """No new stream may use `name`; its pages go back once no stream does. False if it
        was not registered."""
        entry = self.get(name)
        if entry is None:
            return False
        entry.removed = True
        if entry.users == 0:
            self._drop(entry)
        return True

    # ---- streams

    def pin(self, entry: VoicePrefix) -> None:
        """A stream opens on the voice (resident, see `place`): its pages stay until `unpin`."""
        assert entry.table is not None, "pin a resident voice"
        entry.users += 1
        self.touch(entry)

    def unpin(self, name: str) -> None:
        entry = self._entries.get(name)
        if entry is None:
            return
        entry.users -= 1
        if entry.users > 0:
            return
        self.touch(entry)
        if entry.removed:
            self._drop(entry)
        else:
            self.fit()

    def touch(self, entry: VoicePrefix) -> None:
        entry.last_used = next(self._clock)

    # ---- pages

    def write(self, name: str, voice: Voice) -> PageTable:
        """New pages holding `voice`'s prompt (idle voices evicted for room)."""
        pages = self.blocks.pages_for(voice.length)
        if pages > self.blocks.pages_available:
            self.make_room(pages)
        try:
            table = self.blocks.allocate(voice.length)
        except MemoryError as e:
            raise EngineFullError(f"no room in the KV pool for voice {name!r}: {e}") from e
        try:
            self.runner.write_voice(table, voice)
        except Exception as e:
            self.blocks.release(table)
            raise EngineFailedError(f"registering voice {name!r} failed: {e!r}") from e
        return table

    @staticmethod
    def load(entry: VoicePrefix) -> Voice:
        """Outside the lock: the voice's prompt K/V again (a file read, or an encoding)."""
        try:
            return entry.load()
        except (ValueError, OSError) as e:
            raise UnknownVoiceError(f"voice {entry.name!r} could not be loaded: {e}") from e

    def place_loaded(self, entry: VoicePrefix, voice: Voice) -> None:
        """Write a loaded voice's pages, unless it was replaced, removed or loaded meanwhile; it
        stays while idle voices are evicted for the budget."""
        if self.get(entry.name) is not entry or entry.table is not None:
            return
        self.place(entry, self.write(entry.name, voice))
        self.fit(keep=entry)

    def place(self, entry: VoicePrefix, table: PageTable) -> None:
        """The voice's prompt was written into `table`'s pages."""
        assert entry.table is None
        entry.table = table
        self.loads += 1
        self.touch(entry)

    @property
    def resident(self) -> list[VoicePrefix]:
        return [entry for entry in self._entries.values() if entry.table is not None]

    @property
    def resident_pages(self) -> int:
        return sum(len(entry.table.pages) for entry in self.resident if entry.table)

    @property
    def evicts(self) -> bool:
        """Whether idle voices give their pages back (a budget is set)."""
        return self.budget_bytes is not None

    def held_pages(self) -> int:
        """Pages no eviction can free: those of voices in use (without a budget, of all)."""
        if not self.evicts:
            return self.resident_pages
        return sum(len(e.table.pages) for e in self.resident if e.table and e.users > 0)

    def fit(self, keep: VoicePrefix | None = None) -> None:
        """Evict idle voices, least recently used first, until the resident ones fit the
        budget (voices in use may go past it: a stream is never refused for the budget).
        `keep`: a voice just loaded for a stream that is about to use it."""
        if self.budget_bytes is None:
            return
        for entry in self._idle_by_age():
            if entry is keep:
                continue
            if self.resident_pages * self.page_bytes <= self.budget_bytes:
                return
            self._evict(entry)

    def make_room(self, pages: int) -> bool:
        """Evict idle voices, least recently used first, until `pages` are available (with a
        budget: without one every voice stays)."""
        if not self.evicts:
            return self.blocks.pages_available >= pages
        for entry in self._idle_by_age():
            if self.blocks.pages_available >= pages:
                return True
            self._evict(entry)
        return self.blocks.pages_available >= pages

    def _idle_by_age(self) -> list[VoicePrefix]:
        idle = [e for e in self._entries.values() if e.table is not None and e.users == 0]
        return sorted(idle, key=lambda e: e.last_used)

    def _evict(self, entry: VoicePrefix) -> None:
        logger.debug("voice %r: pages evicted (idle, least recently used)", entry.name)
        self._drop_pages(entry)
        self.evictions += 1

    def _drop_pages(self, entry: VoicePrefix) -> None:
        if entry.table is not None:
            self.blocks.release(entry.table)
            entry.table = None

    def _drop(self, entry: VoicePrefix) -> None:
        self._drop_pages(entry)
        if self._entries.get(entry.name) is entry:
            del self._entries[entry.name]
