"""AR-side scheduling: admission in FIFO order, and the batch of every step rebuilt from scratch.

Each iteration:
1. admitted requests whose next clause is ready (text complete, previous clause's audio delivered)
   start it if its KV pages can be reserved; then waiting requests are admitted, oldest first,
   while batch slots and pages last. A request that does not fit blocks those behind it, so
   admission stays FIFO and a big request cannot starve; one with no text yet is skipped.
2. every started clause that still needs its prompt pass joins one packed prefill;
3. every generating request joins one AR step.

A clause that fails to start (its prompt embedding, its page copy) fails only its own request:
`schedule` hands it back in `Batch.failed` and goes on with the others.

The scheduler changes its queues only through its own methods (`add`, `set_voice`, `release`,
`released`); the engine calls all of them under its lock.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from intone.engine.block_manager import BlockManager, PageTable
from intone.engine.errors import EngineFullError
from intone.engine.model_runner import ModelRunner
from intone.engine.options import ClauseProgress
from intone.engine.sequence import Phase, Request

logger = logging.getLogger(__name__)


@dataclass
class VoicePrefix:
    name: str
    table: PageTable


@dataclass
class Batch:
    prefill: list[Request]
    generate: list[Request]
    failed: list[tuple[Request, Exception]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefill or self.generate or self.failed)


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        blocks: BlockManager,
        max_active: int,
        max_prefill_tokens: int,
        max_queued: int,
    ):
        self.runner = runner
        self.blocks = blocks
        self.max_active = max_active
        self.max_prefill_tokens = max_prefill_tokens
        self.max_queued = max_queued
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished requests whose decoder row the decoder thread has not freed yet: they still
        # count against max_active, so a new request always finds a free row.
        self.releasing: set[str] = set()
        self.voices: dict[str, VoicePrefix] = {}

    @property
    def active(self) -> int:
        return len(self.running) + len(self.releasing)

    # ---- queues

    def add(self, request: Request) -> None:
        if len(self.waiting) >= self.max_queued:
            raise EngineFullError(f"{self.max_queued} requests already queued")
        self.waiting.append(request)

    def set_voice(self, name: str, table: PageTable) -> PageTable | None:
        """Register (or replace) a voice's prompt pages; returns the replaced voice's table."""
        old = self.voices.get(name)
        self.voices[name] = VoicePrefix(name, table)
        return None if old is None else old.table

    def release(self, request: Request) -> bool:
        """Drop the request from scheduling and give back its pages and tail.

        True if it was admitted: its decoder row is then still to be freed (`released`).
        """
        admitted = request in self.running
        if request in self.waiting:
            self.waiting.remove(request)
        if admitted:
            self.running.remove(request)
            self.releasing.add(request.id)
        self.end_clause(request)
        request.tail = None
        request.phase = Phase.FINISHED
        return admitted

    def released(self, request: Request) -> None:
        """The decoder freed the request's row."""
        self.releasing.discard(request.id)

    # ---- pages

    def clause_pages(self, voice: str, prompt_length: int, max_frames: int) -> int:
        """Pages of its own one clause may need: past the voice's full, shared pages."""
        voice_length = self.voices[voice].table.length
        total = self.blocks.pages_for(voice_length + prompt_length + max_frames)
        return total - voice_length // self.blocks.page_size

    def clause_capacity(self) -> int:
        """Pages a clause can ever get: the pool less what registered voices hold."""
        return self.blocks.num_pages - sum(len(v.table.pages) for v in self.voices.values())

    def start_clause(self, request: Request) -> bool:
        """Move the request's next clause onto reserved pages; False if the pool is short.

        On an exception nothing changed: the clause is still pending and no page is held.
        """
        clause = request.pending[0]
        voice = self.voices[request.voice].table
        tail = request.tail.shape[0] if request.tail is not None else 0
        final = voice.length + tail + len(clause.plan.tokens) + clause.plan.max_frames
        prompt = self.runner.prompt_embeddings(clause.plan.tokens, request.tail)
        table, partial_page = self.blocks.share(voice)
        if not self.blocks.reserve(table, final, copy_partial=partial_page is not None):
            self.blocks.release(table)
            return False
        try:
            if partial_page is not None:
                self.runner.copy_page(
                    partial_page, table.pages[-1], voice.length % self.blocks.page_size
                )
        except Exception:
            self.blocks.release(table)
            raise
        request.pending.popleft()
        request.clause = clause
        request.table = table
        request.prompt = prompt
        request.progress = ClauseProgress(clause.plan)
        request.latents = []
        request.phase = Phase.PREFILL
        return True

    def end_clause(self, request: Request) -> None:
        if request.table is not None:
            self.blocks.release(request.table)
        request.table = None
        request.prompt = None
        request.clause = None
        request.progress = None

    # ---- batches

    def schedule(self) -> Batch:
        failed: list[tuple[Request, Exception]] = []

        def try_start(request: Request) -> bool | None:
            """start_clause, with a failure pinned on the request (None)."""
            try:
                return self.start_clause(request)
            except Exception as e:
                logger.exception("starting a clause of %s failed", request.id)
                failed.append((request, e))
                return None

        for request in self.running:
            if request.phase is Phase.IDLE and request.pending and try_start(request) is False:
                break
        else:
            for request in list(self.waiting):
                if self.active >= self.max_active:
                    break
                if not request.pending:
                    continue  # no text yet: not ready, and must not hold up those behind it
                started = try_start(request)
                if started is None:
                    continue
                if not started:
                    break
                self.waiting.remove(request)
                self.running.append(request)
        prefill, tokens = [], 0
        for request in self.running:
            if request.phase is Phase.PREFILL:
                assert request.prompt is not None
                if prefill and tokens + request.prompt.shape[0] > self.max_prefill_tokens:
                    break
                prefill.append(request)
                tokens += request.prompt.shape[0]
        generate = [r for r in self.running if r.phase is Phase.GENERATING]
        return Batch(prefill, generate, failed)
