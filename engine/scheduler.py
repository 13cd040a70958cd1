"""AR-side scheduling: who holds a row, who waits for one, and the batch of every step.

A stream holds a row (an AR batch slot and a decoder row) only while it has text to speak. An
open stream with no text pending sits in `idle` and costs nothing but its saved decoder history;
text moves it to `waiting`, and admission gives it a row. When its clause ends and no text is
pending, or when it is not due (far enough ahead of playback, `Need`) while others wait for a
row, it gives the row back (`park`).

Each iteration:
1. running requests between clauses start their next clause if their KV pages can be reserved
   (unless pacing holds them); then waiting requests are admitted while rows and pages last, in
   priority order: a new request's first clause, then streams closest to an underrun (least
   audio ahead of playback), then the rest, first come first served among equals (a stream far
   ahead of its listener comes last: with pacing "hold" it is not admitted at all). A request
   that does not fit the pool blocks those behind it, so a big request cannot starve; a tenant at
   its row cap is passed over.
2. every started clause that still needs its prompt pass joins one packed prefill (and then,
   in the engine, that iteration's AR step: a clause's second latent comes a step sooner), up to
   `max_prefill_tokens` positions: new streams' first clauses and the next clauses of streams
   within `URGENT_S` of an underrun first, then the others, first come first served among
   equals; while a stream that plays is near an underrun, up to
   `max_prefill_rows_near_underrun` clauses, and those that what recent passes cost
   (`prompt_pass_cost`: a part per pass, per clause and per position, fitted to them) says end
   the pass `PREFILL_MARGIN_S` before that stream runs out (one clause at least), so that a
   burst of new streams is prefilled in parts with the playing streams' AR steps between them;
3. AR steps come in bursts: once a prefill pass runs or some generating row is due for a step
   (`Need.NOW`), every generating row that may step (not `Need.NONE`) joins each AR step, until
   none may; then no step runs until a row is due again. An AR step's cost is mostly per step,
   not per row (the 2M model on one core: 9 ms for one row, 20 ms for 64), so rows that came
   due one by one would each pay it. With pacing "yield", rows more than `lead_s` ahead of their
   listener (`Need.SPARE`) take no part in a burst or in a prefill pass another stream needs
   (only a bucketed step's padding rows): they step, and their next clauses are prefilled, in
   the iterations where no stream within `lead_s` is due, so one of those waits at most one
   such step.
4. an iteration with nothing else to run or admit prefills the drafts of streams whose first
   clause is still being written (`drafts`, `request.Draft`), each on pages of its own; a clause
   that starts takes over its draft's pages where the draft's tokens start it, and a clause short
   of pages takes other drafts' first. Where no stream holds a row, one stream's draft pass also
   prepares its text so far as a whole clause (`request.Ending`, on pages that share the draft's):
   a clause that is that one starts with its first latent, on the ending's pages.

The pacing policy (`PacingPolicy`, engine/pacing.py) is the scheduler's: it says, at the time
`schedule` is given, which streams are held, how far ahead each is, and how much each needs a step.

A clause that fails to start (its prompt embedding, its page copy) fails only its own request:
`schedule` hands it back in `Batch.failed` and goes on with the others.

The scheduler changes its queues only through its own methods (`add`, `ready`, `park`,
`finish`, `decoder_row_freed`); the engine calls all of them under its lock.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from intone.engine.block_manager import BlockManager, PageTable
from intone.engine.config import (
    JOINED_PREFILL_MARGIN_S,
    PREFILL_MARGIN_S,
    URGENT_S,
    EngineConfig,
)
from intone.engine.model_runner import ModelRunner
from intone.engine.options import ClauseProgress
from intone.engine.pacing import Need, PacingPolicy
from intone.engine.pass_cost import PromptPassCost
from intone.engine.request import Draft, Ending, Phase, Request
from intone.engine.voice_cache import VoiceCache, VoicePrefix

__all__ = ["Batch", "Need", "Scheduler", "VoicePrefix"]

logger = logging.getLogger(__name__)


@dataclass
class Batch:
    prefill: list[Request]
    generate: list[Request]
    failed: list[tuple[Request, Exception]] = field(default_factory=list)
    parked: list[Request] = field(default_factory=list)  # gave their row up this iteration
    # First clauses' drafts to prefill, each with the tokens its table has just grown by
    # (`Scheduler.drafts`), and the ending to prepare in the same pass: only in an iteration
    # with nothing else to run.
    drafts: list[DraftPass] = field(default_factory=list)
    endings: list[EndingPass] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefill or self.generate or self.failed or self.drafts or self.endings)


@dataclass
class DraftPass:
    request: Request
    tokens: list[int]  # the draft's tokens once this pass has written them
    kept: int  # how many of them, at the start, its table held already: the pass writes the rest


@dataclass
class EndingPass:
    request: Request
    ending: Ending  # on pages of its own, its table holding the draft's first `kept` tokens
    kept: int  # the pass writes the ending's other tokens and its first AR step


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        blocks: BlockManager,
        max_active: int,
        max_prefill_tokens: int,
        max_prefill_rows_near_underrun: int,
        pacing: PacingPolicy,
        max_rows_per_tenant: int | None = None,
        voices: VoiceCache | None = None,
    ):
        self.runner = runner
        self.pacing = pacing
        self.blocks = blocks
        self.max_active = max_active
        self.max_prefill_tokens = max_prefill_tokens
        self.max_rows_per_tenant = max_rows_per_tenant
        self.max_prefill_rows_near_underrun = max_prefill_rows_near_underrun
        self.idle: dict[str, Request] = {}  # open, no text pending, no row
        self.waiting: deque[Request] = deque()  # text pending, no row
        self.running: list[Request] = []  # holding a row
        # Requests that gave their row back (parked or finished) whose decoder row the decoder
        # thread has not freed yet: they still count against max_active, so a new request always
        # finds a free row.
        self.decoder_rows_to_free: set[str] = set()
        # Voice prompt pages: a stream's voice is resident from `Engine.stream` to `finish`.
        self.voices = voices if voices is not None else VoiceCache(blocks, runner, 0)
        self.bursting = False  # the last batch had an AR step: rows step on while they may
        # What recent prompt passes cost (the AR stage measures them).
        self.prompt_pass_cost = PromptPassCost()

    @classmethod
    def from_config(
        cls, config: EngineConfig, runner: ModelRunner, blocks: BlockManager, pacing: PacingPolicy
    ) -> Scheduler:
        """The engine's scheduler, its voices' pages within `config.voice_cache_mb`."""
        budget = config.voice_cache_mb
        voices = VoiceCache(
            blocks,
            runner,
            page_bytes=runner.pool.slot_bytes * blocks.page_size,
            budget_bytes=None if budget is None else int(budget * 2**20),
        )
        return cls(
            runner,
            blocks,
            config.max_active,
            config.max_prefill_tokens,
            config.max_prefill_rows_near_underrun,
            pacing,
            config.max_rows_per_tenant,
            voices,
        )

    @property
    def active(self) -> int:
        return len(self.running) + len(self.decoder_rows_to_free)

    # ---- queues

    @property
    def requests(self) -> list[Request]:
        """Every open request the scheduler holds, in any queue."""
        return [*self.running, *self.waiting, *self.idle.values()]

    def add(self, request: Request) -> None:
        """A new stream: idle until it has text."""
        self.idle[request.id] = request

    def ready(self, request: Request) -> None:
        """The request has text now: it waits for a row if it does not hold one."""
        if self.idle.pop(request.id, None) is not None:
            self.waiting.append(request)

    def park(self, request: Request) -> None:
        """Give the request's row back; its decoder row is freed after its audio
        (`decoder_row_freed`)."""
        self.running.remove(request)
        self.decoder_rows_to_free.add(request.id)
        request.phase = Phase.WAITING
        if request.pending:
            self.waiting.append(request)
        else:
            self.idle[request.id] = request

    def finish(self, request: Request) -> bool:
        """The request is over: drop it from scheduling, give back its pages, its tail and its
        hold on its voice.

        True if it held a row: its decoder row is then still to be freed (`decoder_row_freed`).
        """
        admitted = request in self.running
        if request in self.waiting:
            self.waiting.remove(request)
        self.idle.pop(request.id, None)
        if admitted:
            self.running.remove(request)
            self.decoder_rows_to_free.add(request.id)
        self.end_clause(request)
        self.release_draft(request.draft)
        request.draft = None
        request.tail = None
        if request.phase is not Phase.FINISHED:
            self.voices.unpin(request.voice)  # the stream's hold on its voice's pages
        request.phase = Phase.FINISHED
        return admitted

    def decoder_row_freed(self, request: Request) -> None:
        """The decoder thread freed the decoder row of a request that gave its row back."""
        self.decoder_rows_to_free.discard(request.id)

    # ---- pages

    def clause_pages(self, voice: str, prompt_length: int, max_frames: int) -> int:
        """Pages of its own one clause may need: past the voice's full, shared pages."""
        voice_length = self.voices[voice].length
        total = self.blocks.pages_for(voice_length + prompt_length + max_frames)
        return total - voice_length // self.blocks.page_size

    def clause_capacity(self) -> int:
        """Pages a clause can ever get: the pool less what voices in use hold (idle voices'
        pages are evicted when a clause needs them)."""
        return self.blocks.num_pages - self.voices.held_pages()

    def start_clause(self, request: Request) -> bool:
        """Move the request's next clause onto reserved pages, on top of its draft's where the
        draft's tokens start the clause; False if the pool is short.

        On an exception the clause is still pending and no page is held (its draft, only a head
        start, may be gone).
        """
        clause = request.pending[0]
        voice = self.voices[request.voice].table
        assert voice is not None, "a stream's voice stays resident while it is open"
        tail = request.tail.shape[0] if request.tail is not None else 0
        tokens = clause.plan.tokens
        final = voice.length + tail + len(tokens) + clause.plan.max_frames
        draft = request.draft
        ending = self._take_ending(draft, tokens) if request.tail is None else None
        if ending is not None:
            # Its prompt pass is done, on the ending's pages.
            drafted, prompt, table = len(tokens), None, ending.table
            self.release_draft(draft)
        else:
            # A draft's tokens that start the clause are in its table already; one is always
            # left for the prompt pass.
            drafted = 0
            if draft is not None and draft.table is not None and request.tail is None:
                drafted = min(common_prefix(draft.written, tokens), len(tokens) - 1)
            prompt = self.runner.prompt_embeddings(tokens[drafted:], request.tail)
            if drafted:
                assert draft is not None and draft.table is not None
                self.release_endings(draft)  # they share pages the clause writes again
                table = draft.table
                self.blocks.truncate(draft.table, voice.length + drafted)
            else:
                self.release_draft(draft)
                table = None
        request.draft = None
        table = self._clause_table(voice, final, table)
        if table is None:
            return False
        request.pending.popleft()
        request.metrics.draft_tokens += drafted
        request.metrics.first_step_prepared |= ending is not None
        request.clause = clause
        request.table = table
        request.prompt = prompt
        request.first_step = ending.first_step if ending is not None else None
        request.progress = ClauseProgress(clause.plan)
        request.latents = []
        request.phase = Phase.PREFILL
        return True

    def _take_ending(self, draft: Draft | None, tokens: list[int]) -> Ending | None:
        """The draft's prepared ending that is the clause of `tokens`, taken out of it, if
        there is one."""
        endings = draft.endings if draft is not None else []
        for ending in endings:
            if ending.tokens == tokens and ending.first_step is not None:
                endings.remove(ending)
                return ending
        return None

    def _clause_table(
        self, voice: PageTable, final: int, table: PageTable | None
    ) -> PageTable | None:
        """`table` (a draft's or an ending's), or a new one on `voice`, with pages promised up
        to `final`; where the pool is short, other streams' drafts (only a head start) and idle
        voices (loaded again when a stream needs them) give theirs up first. None if it still is (no
        page held then)."""
        for short_before in (False, True):
            if short_before:
                for other in self.requests:  # a stream waiting for a row keeps its draft too
                    self.release_draft(other.draft)
                held = voice.length // self.blocks.page_size
                if table is not None:
                    held = len(table.pages) + table.reserved
                self.voices.make_room(self.blocks.pages_for(final) - held)
            if table is None:
                shared = self._share(voice, final)
                if shared is not None:
                    return shared
            elif self.blocks.reserve(table, final):
                return table
        if table is not None:
            self.blocks.release(table)
        return None

    def _share(self, prefix: PageTable, final: int) -> PageTable | None:
        """A table starting with `prefix`'s positions (a voice's, or a draft's first ones: its
        full pages shared, a partial one copied) with pages promised up to `final`; None if the
        pool is short. On an exception no page is held."""
        table, partial_page = self.blocks.share(prefix)
        if not self.blocks.reserve(table, final, copy_partial=partial_page is not None):
            self.blocks.release(table)
            return None
        if partial_page is not None:
            try:
                self.runner.copy_page(
                    partial_page, table.pages[-1], prefix.length % self.blocks.page_size
                )
            except Exception:
                self.blocks.release(table)
                raise
        return table

    def release_draft(self, draft: Draft | None) -> None:
        if draft is not None and draft.table is not None:
            self.release_endings(draft)
            self.blocks.release(draft.table)
            draft.table = None
            draft.written = []

    def release_endings(
        self, draft: Draft, keep: Callable[[Ending], bool] = lambda _: False
    ) -> None:
        """Give back the pages of the draft's endings but those `keep` says (before pages they
        share with the draft are written again, or where they are no longer wanted)."""
        kept = []
        for ending in draft.endings:
            if keep(ending):
                kept.append(ending)
            elif ending.table is not None:
                self.blocks.release(ending.table)
        draft.endings = kept

    def drafts(self) -> tuple[list[DraftPass], list[EndingPass]]:
        """The passes that bring the drafts of streams with no row yet up to their tokens,
        each table truncated to what its tokens share with what it holds and grown by the
        rest, and, where no stream holds a row, one of a stream's endings (`ending_pass`). A
        draft or an ending the pool has no pages for waits (it is only a head start)."""
        passes = []
        endings: list[EndingPass] = []
        for request in self.idle.values():
            draft = request.draft
            if draft is None:
                continue
            if draft.tokens == draft.written:
                if not endings:
                    endings = self.ending_pass(request, len(draft.written))
                continue
            voice = self.voices[request.voice].table
            assert voice is not None, "a stream's voice stays resident while it is open"
            kept = common_prefix(draft.written, draft.tokens)
            # The endings that share pages this pass writes again go.
            self.release_endings(draft, lambda ending, kept=kept: ending.shared <= kept)
            if draft.table is None:
                try:
                    draft.table = self._share(voice, voice.length + len(draft.tokens))
                except Exception:
                    logger.exception("a draft of %s could not start", request.id)
                    request.draft = None
                    continue
                if draft.table is None:
                    continue
            elif not self.blocks.reserve(draft.table, voice.length + len(draft.tokens)):
                continue
            self.blocks.truncate(draft.table, voice.length + kept)
            draft.written = draft.written[:kept]
            if not endings:
                endings = self.ending_pass(request, kept)
            if kept < len(draft.tokens):
                self.blocks.extend(draft.table, len(draft.tokens) - kept)
                passes.append(DraftPass(request, list(draft.tokens), kept))
            else:
                draft.written = list(draft.tokens)
        return passes, endings

    def ending_pass(self, request: Request, written: int) -> list[EndingPass]:
        """The pass that prepares the first of `request`'s draft's clauses (`Draft.wholes`)
        not prepared (a list of one, or none), its endings of clauses no longer wanted given
        back: on a table that shares the draft table's first positions, as far as the draft's
        first `written` tokens start it (one token always left), grown by the rest and its
        first AR step. None while a stream holds a row: the pass would delay its steps."""
        draft = request.draft
        if self.running or draft is None or draft.table is None:
            return []
        self.release_endings(draft, lambda ending: ending.tokens in draft.wholes)
        prepared = [ending.tokens for ending in draft.endings]
        tokens = next((whole for whole in draft.wholes if whole not in prepared), None)
        if tokens is None:
            return []
        voice = self.voices[request.voice].table
        assert voice is not None, "a stream's voice stays resident while it is open"
        kept = min(common_prefix(draft.written[:written], tokens), len(tokens) - 1)
        prefix = PageTable(draft.table.pages, voice.length + kept)
        try:
            table = self._share(prefix, voice.length + len(tokens) + 1)
        except Exception:
            logger.exception("the ending of %s could not start", request.id)
            return []
        if table is None:
            return []
        self.blocks.extend(table, len(tokens) - kept + 1)
        ending = Ending(list(tokens), kept, table)
        draft.endings.append(ending)
        return [EndingPass(request, ending, kept)]

    def end_clause(self, request: Request) -> None:
        if request.table is not None:
            self.blocks.release(request.table)
        request.table = None
        request.prompt = None
        request.first_step = None
        request.clause = None
        request.progress = None

    # ---- batches

    def need(self, request: Request, t: float) -> Need:
        """How much `request` needs its next AR step at `t` (`PacingPolicy.need`)."""
        return self.pacing.need(request, t, request.phase is Phase.GENERATING)

    def schedule(self, t: float) -> Batch:
        """The next batch, with every stream's standing taken at `t`."""
        pacing = self.pacing
        failed: list[tuple[Request, Exception]] = []
        parked: list[Request] = []

        def try_start(request: Request) -> bool | None:
            """start_clause, with a failure pinned on the request (None)."""
            try:
                return self.start_clause(request)
            except Exception as e:
                logger.exception("starting a clause of %s failed", request.id)
                failed.append((request, e))
                return None

        short_of_pages = False
        for request in list(self.running):
            if request.phase is not Phase.IDLE:
                continue
            if not request.pending and not request.input_ended:
                self.park(request)  # nothing to say for now: the row is someone else's
                parked.append(request)
            elif request.pending and self.waiting and self.need(request, t) is not Need.NOW:
                # Not due while others wait for a row: let them have it.
                self.park(request)
                parked.append(request)
            elif request.pending and pacing.held(request, t):
                continue  # far ahead: its next clause starts once playback catches up
            elif request.pending and try_start(request) is False:
                short_of_pages = True
                break
        if not short_of_pages:
            rows = self._rows_by_tenant()
            # sorted() is stable: first come, first served among equals.
            for request in sorted(
                self.waiting, key=lambda r: (r.frames_generated > 0, pacing.lead(r, t))
            ):
                if self.active >= self.max_active:
                    break
                cap = self.max_rows_per_tenant
                if (
                    cap is not None
                    and request.tenant is not None
                    and rows.get(request.tenant, 0) >= cap
                ):
                    continue  # this tenant has its share; the others go first
                if request.frames_generated and pacing.held(request, t):
                    continue
                started = try_start(request)
                if started is None:
                    continue
                if not started:
                    break
                self.waiting.remove(request)
                self.running.append(request)
                rows[request.tenant] = rows.get(request.tenant, 0) + 1
        needs = [(r, self.need(r, t)) for r in self.running if r.phase is Phase.GENERATING]
        within = [r for r, n in needs if n in (Need.NOW, Need.SOON)]
        spare = [r for r, n in needs if n is Need.SPARE]
        # A burst goes on while rows within lead_s step in it (not for spare rows alone).
        bursting = self.bursting and bool(within)
        due = any(n is Need.NOW for _, n in needs)
        # Prompts of streams far ahead (spare) wait for an iteration nobody else needs.
        prompts = [r for r in self.running if r.phase is Phase.PREFILL]
        spare_prompts = [r for r in prompts if self.need(r, t) is Need.SPARE]
        prompts = [r for r in prompts if r not in spare_prompts]
        # A caller waiting for its first audio goes before a stream with URGENT_S of audio to
        # play (the sort is stable: first come, first served among equals).
        prompts.sort(key=lambda r: r.frames_generated > 0 and pacing.lead(r, t) >= URGENT_S)
        if not (prompts or due or bursting):
            prompts = spare_prompts
        prefill = self._prompt_pass(prompts, t) if prompts else []
        spare_pass = bool(prefill) and all(r in spare_prompts for r in prefill)
        if spare_pass or not (prefill or bursting or due):
            # No stream within lead_s needs this iteration: the spare rows step, and the rows
            # that may step ride along. Not a burst: a due row starts one without them.
            generate = [*within, *spare] if spare or prefill else []
            self.bursting = False
        else:
            generate = within + spare[: self._padding(len(within))]
            self.bursting = bool(within)
        # Nothing else to run or admit: first clauses' prompt passes may begin before their
        # text ends.
        drafts, endings = [], []
        if not (prefill or generate or self.waiting):
            drafts, endings = self.drafts()
        return Batch(prefill, generate, failed, parked, drafts, endings)

    def _prompt_pass(self, prompts: list[Request], t: float) -> list[Request]:
        """The clauses of this iteration's prompt pass, in the order of `prompts` (step 2 of the
        module doc): up to `max_prefill_tokens` positions; while a stream that plays is near an
        underrun, at most `max_prefill_rows_near_underrun` clauses, and no more than end the
        pass, by what recent passes cost, `PREFILL_MARGIN_S` before that stream runs out. One
        clause at least."""
        playing = (r for r in self.running if r.phase is Phase.GENERATING)
        least = min((self.pacing.lead(r, t) for r in playing), default=math.inf)
        prefill: list[Request] = []
        prompted = positions = 0
        for request in prompts:
            size = 0 if request.prompt is None else request.prompt.shape[0]  # 0: `first_step`
            if prefill and not self._pass_fits(
                len(prefill) + 1, prompted + (size > 0), positions + size, least
            ):
                break
            prefill.append(request)
            prompted += size > 0
            positions += size
        return prefill

    def _pass_fits(self, clauses: int, prompts: int, positions: int, least: float) -> bool:
        """Whether a prompt pass of `clauses` clauses (`prompts` of them with a prompt to run,
        the others prepared by an ending) and `positions` positions may run while the least-ahead
        stream that plays has `least` seconds of audio ahead: by what recent passes cost, it
        ends `PREFILL_MARGIN_S` before that stream runs out, or `JOINED_PREFILL_MARGIN_S` where
        it joins the AR step that stream waits for (`ModelRunner.joins`)."""
        if positions > self.max_prefill_tokens:
            return False
        if least >= URGENT_S:
            return True
        if clauses > self.max_prefill_rows_near_underrun:
            return False
        seconds = self.prompt_pass_cost.seconds(prompts, positions)
        margin = JOINED_PREFILL_MARGIN_S if self.runner.joins(prompts) else PREFILL_MARGIN_S
        return seconds is None or seconds <= least - margin

    def _padding(self, rows: int) -> int:
        """Rows a step of `rows` is padded with anyway (batch buckets): free for spare rows."""
        buckets = self.runner.batch_buckets
        if not buckets:
            return 0
        return next((b for b in buckets if b >= rows), rows) - rows

    def _rows_by_tenant(self) -> dict[str | None, int]:
        rows: dict[str | None, int] = {}
        for request in self.running:
            rows[request.tenant] = rows.get(request.tenant, 0) + 1
        return rows


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading items `a` and `b` share."""
    pairs = zip(a, b, strict=False)
    return next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))
