"""The tensor work of the two engine stages, on batches the schedulers formed.

Each stage has two halves. `*_inputs` builds a step's inputs on the host from the requests' page
tables and moves them to the device (for an AR step it also keeps each row's context dense,
`RowContexts`, copying in what its dense copy lacks); `*_step` is device math only: every tensor it
takes lives on the model's device, it creates none on the host and reads nothing back. The host
reads (EOS flags, audio) happen after a step, in the engine. That keeps each step free of
data-dependent Python and of host-device mixing, the precondition for replaying it as a CUDA
graph; a CPU test runs the steps on the `meta` device to hold that line.

The runner never changes page bookkeeping: the engine extends a request's page table (under its
lock) before asking for a step, so a failed step can be retried on the same pages.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from intone.engine.block_manager import BlockManager, PageTable
from intone.engine.config import (
    DECODE_SPLIT_ROWS,
    JOINT_MIN_SAVING_S,
    ROW_CONTEXT_FAULT_IN_POSITIONS,
    ROW_CONTEXT_POOL_MULTIPLE,
    ROW_CONTEXT_POSITIONS,
    TRACED_PROMPT_SEQUENCES,
    EngineConfig,
)
from intone.engine.decoder_states import DecoderStatePool
from intone.engine.device import DeviceIO
from intone.engine.kernels import row_attention, traces
from intone.engine.kernels.cpu_decoder import CpuDecoder, make_decoder
from intone.engine.kernels.row_contexts import (
    CONTEXT_RUN,
    JointAttention,
    NativeRowAttention,
    RowContexts,
    plan_row_context_step,
)
from intone.engine.models.pocket.conv import State
from intone.engine.models.pocket.flow_head import draw_noise
from intone.engine.models.pocket.kv_cache import (
    KVPool,
    PagedSequence,
    SequenceAttention,
    SequenceStep,
    SlotAttention,
    plan_one_sequence,
    plan_step,
)
from intone.engine.models.pocket.model import PocketTTS
from intone.engine.models.pocket.transformer import KVCache
from intone.engine.precision import Precision
from intone.engine.request import Request
from intone.engine.thread_budget import ThreadBudget
from intone.engine.voices import Voice

logger = logging.getLogger(__name__)


@dataclass
class PrefillInputs:
    prompts: torch.Tensor  # [N, D]: each request's prompt, then its first AR step's BOS input
    positions: torch.Tensor
    attention: SlotAttention | SequenceAttention  # the latter: `plan_one_sequence`
    last: torch.Tensor  # [B]: each sequence's last row, its first AR step
    noise: torch.Tensor  # [B, latent_dim]
    eos_thresholds: torch.Tensor  # [B]


@dataclass
class GenerateInputs:
    """An AR step's inputs, rows in context order (row i: `order[i]` of the requests, or
    padding)."""

    previous: torch.Tensor  # [B', latent_dim], B' = rows padded to the batch bucket
    positions: torch.Tensor
    # The engine's NativeRowAttention or RowContextAttention; bench/stages.py --attention: a gather
    attention: KVCache
    noise: torch.Tensor  # [B', latent_dim]
    eos_thresholds: torch.Tensor  # [B']
    order: torch.Tensor  # [B']
    rows: int
    back: torch.Tensor  # [rows]: the requests' order from context order (`order`'s inverse)


class ModelRunner:
    def __init__(
        self,
        model: PocketTTS,
        blocks: BlockManager,
        decoder_slots: int,
        flow_steps: int,
        device: torch.device,
        batch_buckets: tuple[int, ...] | None = None,
        decoder_int8: bool = False,
        decoder_convs_bf16: bool = False,
        trace_after: int | None = None,
        thread_budget: ThreadBudget | None = None,
        decode_parts: int = 1,
        native_kernels: bool = True,
        io: DeviceIO | None = None,
        ar_traces: traces.TraceCache | None = None,
        half_row_contexts: bool = False,
    ):
        """`trace_after`: the CPU decoder's (`EngineConfig.trace_after`); `ar_traces`: where
        AR steps through the native attention and prompt passes of one sequence are traced
        (`new_ar_traces`), which runners of one model and engine may share;
        `half_row_contexts`: the AR rows' dense contexts in float16 where the native attention
        reads them (`Precision.half_row_contexts`)."""
        self.model = model
        # Host-side inputs reach the device through it (pinned and asynchronous on a GPU).
        self.io = io or DeviceIO(device)
        self.flow_lm = model.flow_lm
        self.blocks = blocks
        self.flow_steps = flow_steps
        # The flow head's time conditioning per integration step: the same for every row.
        self.flow_schedule = self.flow_lm.flow_net.schedule(flow_steps, device)
        self.device = device
        self.batch_buckets = sorted(batch_buckets) if batch_buckets else None
        # One page past the pool's end is scratch space for the padding rows of a bucket.
        self.pool = self.flow_lm.new_kv_pool(
            (blocks.num_pages + 1) * blocks.page_size, device=device
        )
        # The native decode attention reads contexts in host memory, from a float32 pool;
        # elsewhere torch attends.
        host_contexts = device.type == "cpu" and self.pool.keys.dtype == torch.float32
        self.native_row_attention = native_kernels and host_contexts and row_attention.load()
        self.ar_traces = ar_traces if self.native_row_attention else None
        # Every row a step can have (bucket padding included), reserved now: see RowContexts.
        rows = max([decoder_slots, *(self.batch_buckets or [])])
        fits = ROW_CONTEXT_POOL_MULTIPLE * self.pool.num_slots // rows // CONTEXT_RUN * CONTEXT_RUN
        capacity = max(CONTEXT_RUN, min(ROW_CONTEXT_POSITIONS, fits))
        half = half_row_contexts and self.native_row_attention
        self.row_contexts = RowContexts(
            self.pool, rows, capacity, torch.float16 if half else self.pool.keys.dtype
        )
        self.row_contexts.fault_in(ROW_CONTEXT_FAULT_IN_POSITIONS)
        # Whether a prompt pass of more than `TRACED_PROMPT_SEQUENCES` sequences runs as traced
        # parts of that many (`prefill`): timed on this model by `prepare_ar_traces`.
        self.split_prompt_passes = False
        # Whether a prompt pass and an AR step run as one pass (`joins`): timed on this model by
        # `prepare_ar_traces`.
        self.join_passes = False
        # Stage calls count themselves busy so torch's threads follow the busy stage.
        self.threads = thread_budget
        self.decoder = make_decoder(
            model.mimi,
            device,
            int8=decoder_int8,
            trace_after=trace_after,
            native_ops=native_kernels,
            bf16_convs=decoder_convs_bf16,
        )
        self.decoder_states = DecoderStatePool(self.decoder, decoder_slots, device)
        # The input of a clause's first AR step: the BOS latent's embedding.
        with torch.no_grad():
            nan = torch.full((1, self.flow_lm.latent_dim), float("nan"), device=device)
            self.bos_input = self.flow_lm.embed_latents(nan)
        self.decode_parts = decode_parts
        self._decode_pool = concurrent.futures.ThreadPoolExecutor(
            max(1, decode_parts - 1), thread_name_prefix="intone-decode"
        )

    @classmethod
    def from_config(
        cls,
        model: PocketTTS,
        config: EngineConfig,
        precision: Precision,
        io: DeviceIO,
        budget: ThreadBudget | None,
        blocks: BlockManager,
        rows: int,
        ar_traces: traces.TraceCache | None = None,
    ) -> ModelRunner:
        """A runner as `config` sets it, over `blocks` with `rows` decoder rows: the engine's, or
        the admission probe's (`admission.probe`), on a pool of its own; the two share the
        engine's `ar_traces`."""
        return cls(
            model,
            blocks,
            rows,
            config.flow_steps,
            io.device,
            config.batch_buckets,
            decoder_int8=precision.decoder_int8,
            decoder_convs_bf16=precision.decoder_convs_bf16,
            trace_after=config.trace_after,
            thread_budget=budget,
            # With the thread budget, a decode batch runs one part per core, each on one
            # thread (intra-op threads stall on a core that is shared).
            decode_parts=budget.cores if budget and io.device.type == "cpu" else 1,
            native_kernels=config.native_kernels,
            io=io,
            ar_traces=ar_traces,
            half_row_contexts=precision.half_row_contexts,
        )

    def close(self) -> None:
        # After the decoder thread stopped no part is pending; never let close() wait on one.
        self._decode_pool.shutdown(wait=False, cancel_futures=True)

    @torch.no_grad()
    def prompt_embeddings(self, tokens: list[int], tail: torch.Tensor | None) -> torch.Tensor:
        """A clause's prompt: the chaining tail as extra voice frames, then the text."""
        text = self.flow_lm.embed_text(self.io.upload(torch.tensor(tokens)))
        if tail is None or not tail.shape[0]:
            return text
        return torch.cat([self.flow_lm.embed_tail(tail, self.model.tail_projection), text])

    def copy_page(self, source: int, target: int, count: int) -> None:
        """Copy the first `count` slots of a shared page into a private one."""
        size = self.blocks.page_size
        src = slice(source * size, source * size + count)
        dst = slice(target * size, target * size + count)
        self.pool.copy(src, dst)

    def write_voice(self, table: PageTable, voice: Voice) -> None:
        """Write a voice's prompt K/V into its freshly allocated pages."""
        self.pool.write(self.io.upload(self.blocks.slots(table)), voice.keys, voice.values)
        # Written on the caller's stream; the AR stage reads it on its own.
        self.io.synchronize()

    def draw_noise(self, request: Request) -> torch.Tensor:
        """The flow noise of the request's next frame [latent_dim], from its own generator.

        Drawn once per frame: a retried step reuses it, so a retry never shifts the generator.
        """
        return self._noise(request, request.generator)

    def peek_noise(self, request: Request) -> torch.Tensor:
        """The noise `draw_noise` will give the request next, its generator left as it is."""
        generator = torch.Generator()
        generator.set_state(request.generator.get_state())
        return self._noise(request, generator)

    def _noise(self, request: Request, generator: torch.Generator) -> torch.Tensor:
        noise = draw_noise(
            [generator],
            self.flow_lm.latent_dim,
            [request.temperature],
            [request.noise_clamp],
            torch.device("cpu"),
        )
        return self.io.upload(noise[0])

    # ---- prefill

    def prefill_inputs(self, requests: list[Request], noise: list[torch.Tensor]) -> PrefillInputs:
        """Packed prompts and attention for `requests`, each prompt followed by its clause's first
        AR step (the BOS input), so one pass also gives every clause its first latent. Each
        table already holds its prompt and that step's position."""
        sequences = []
        for request in requests:
            assert request.table is not None and request.prompt is not None
            sequences.append((request.table, torch.cat([request.prompt, self.bos_input])))
        return self._packed_inputs(sequences, noise, self._thresholds(requests))

    def _packed_inputs(
        self,
        sequences: list[tuple[PageTable, torch.Tensor]],
        noise: list[torch.Tensor],
        eos_thresholds: torch.Tensor,
    ) -> PrefillInputs:
        """One packed pass over `sequences`, each a table that already holds the positions its
        inputs [n, D] write: their last row's latent each."""
        attention: SlotAttention | SequenceAttention
        if len(sequences) <= TRACED_PROMPT_SEQUENCES:  # the same pass, and one a trace replays
            paged = [PagedSequence(table.pages, table.length, x.shape[0]) for table, x in sequences]
            positions, attention = plan_one_sequence(
                self.pool, paged, self.blocks.page_size, upload=self.io.upload
            )
        else:
            steps = [SequenceStep(self.blocks.slots(table), x.shape[0]) for table, x in sequences]
            positions, attention = plan_step(self.pool, steps, upload=self.io.upload)
        ends = torch.tensor([x.shape[0] for _, x in sequences]).cumsum(0)
        return PrefillInputs(
            torch.cat([x for _, x in sequences]),
            positions,
            attention,
            self.io.upload(ends - 1),
            torch.stack(noise),
            eos_thresholds,
        )

    @torch.no_grad()
    def prefill_step(
        self, inputs: PrefillInputs, trace_now: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(first latents [B, latent_dim], EOS flags [B] as bool), on the device. A pass of up to
        `TRACED_PROMPT_SEQUENCES` sequences replays a trace from `trace_after` passes on
        (`trace_now`: on this one), whatever its prompts and contexts; a bigger packed pass runs
        eagerly (its split into sequences is Python's)."""
        with self._busy():
            attention = inputs.attention
            if self.ar_traces is None or not isinstance(attention, SequenceAttention):
                return self._prefill(
                    inputs.prompts,
                    inputs.positions,
                    attention,
                    inputs.last,
                    inputs.noise,
                    inputs.eos_thresholds,
                )
            tensors = {
                "positions": inputs.positions,
                "last": inputs.last,
                "noise": inputs.noise,
                "eos_thresholds": inputs.eos_thresholds,
                **attention.tensors(),
            }
            return self.ar_traces(
                "prefill", self._prefill_traceable, inputs.prompts, tensors, self.flow_lm, trace_now
            )

    def _prefill(
        self,
        prompts: torch.Tensor,
        positions: torch.Tensor,
        attention: KVCache,
        last: torch.Tensor,
        noise: torch.Tensor,
        eos_thresholds: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.flow_lm.backbone(prompts, positions, attention)
        return self._sample(z.index_select(0, last), noise, eos_thresholds)

    def _prefill_traceable(
        self, prompts: torch.Tensor, tensors: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_prefill` with every other input in `tensors`, the form a trace records."""
        return self._prefill(
            prompts,
            tensors["positions"],
            SequenceAttention.from_tensors(tensors),
            tensors["last"],
            tensors["noise"],
            tensors["eos_thresholds"],
        )

    @torch.no_grad()
    def prefill_drafts(self, drafts: list[tuple[PageTable, list[int]]]) -> None:
        """Write the K/V of first clauses' drafts (`request.Draft`): each table ends with the
        positions of its tokens, on top of what it holds. One packed pass, no latent."""
        steps = [SequenceStep(self.blocks.slots(table), len(tokens)) for table, tokens in drafts]
        prompts = torch.cat([self.prompt_embeddings(tokens, None) for _, tokens in drafts])
        positions, attention = plan_step(self.pool, steps, upload=self.io.upload)
        with self._busy():
            self.flow_lm.backbone(prompts, positions, attention)

    @torch.no_grad()
    def prefill_endings(
        self,
        drafts: list[tuple[PageTable, list[int]]],
        endings: list[tuple[PageTable, list[int], Request]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`prefill_drafts`, and in the same pass the prompts of first clauses' endings
        (`request.Ending`), each followed by its clause's first AR step, with the noise its
        request will draw for it (`peek_noise`): (first latents [E, latent_dim], EOS flags
        [E]) of the endings, on the device."""
        sequences = [(table, self.prompt_embeddings(tokens, None)) for table, tokens in drafts]
        zeros = torch.zeros(self.flow_lm.latent_dim, device=self.device)
        noise = [zeros] * len(drafts)
        for table, tokens, request in endings:
            prompt = torch.cat([self.prompt_embeddings(tokens, None), self.bos_input])
            sequences.append((table, prompt))
            noise.append(self.peek_noise(request))
        # A draft's last row is no AR step: its latent is not read.
        thresholds = self.io.upload(
            torch.tensor([0.0] * len(drafts) + [r.eos_threshold for _, _, r in endings])
        )
        latents, eos = self.prefill_step(self._packed_inputs(sequences, noise, thresholds))
        return latents[len(drafts) :], eos[len(drafts) :]

    def prefill(
        self, requests: list[Request], noise: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One packed pass over the prompts of `requests`, no padding, one sequence each, and
        their clauses' first AR step: (latents [B, latent_dim], EOS flags [B]) on the device.
        Where `split_prompt_passes`, a pass of more sequences than `TRACED_PROMPT_SEQUENCES`
        runs as traced passes of up to that many."""
        part = TRACED_PROMPT_SEQUENCES if self.split_prompt_passes else max(len(requests), 1)
        passes = [
            self.prefill_step(self.prefill_inputs(requests[i : i + part], noise[i : i + part]))
            for i in range(0, len(requests), part)
        ]
        if len(passes) == 1:
            return passes[0]
        return torch.cat([latents for latents, _ in passes]), torch.cat([eos for _, eos in passes])

    # ---- AR step

    def generate_inputs(self, requests: list[Request], noise: list[torch.Tensor]) -> GenerateInputs:
        """Inputs of one AR step; each table already holds the position this step writes. Seats
        each request's context in a dense copy (`RowContexts`), copying in only what it lacks.

        With batch buckets, padding rows attend only to a scratch slot and are dropped.
        """
        steps = [SequenceStep(self.blocks.slots(r.table), 1) for r in requests if r.table]
        assert len(steps) == len(requests)
        # A dense context is one clause's: its page table names it.
        owners: list[object | None] = [r.table for r in requests]
        previous = torch.stack(
            [r.previous_latent for r in requests if r.previous_latent is not None]
        )
        noise_rows = torch.stack(noise)
        thresholds = self._thresholds(requests)
        rows = len(requests)
        padding = self._bucket(rows) - rows
        if padding:
            scratch = torch.tensor([self.blocks.num_pages * self.blocks.page_size])
            steps += [SequenceStep(scratch, 1)] * padding
            owners += [None] * padding
            previous = torch.cat([previous, previous.new_zeros(padding, previous.shape[1])])
            noise_rows = torch.cat([noise_rows, noise_rows.new_zeros(padding, noise_rows.shape[1])])
            thresholds = torch.cat([thresholds, thresholds.new_zeros(padding)])
        key_multiple = self.blocks.page_size if self.batch_buckets else 1
        order, positions, attention = plan_row_context_step(
            self.row_contexts,
            steps,
            owners,
            key_multiple,
            self.native_row_attention,
            upload=self.io.upload,
        )
        order_t = self.io.upload(torch.tensor(order))
        # The requests' order back from context order, padding dropped: planned on the host.
        back = sorted(range(len(order)), key=order.__getitem__)[:rows]
        return GenerateInputs(
            previous.index_select(0, order_t),
            positions,
            attention,
            noise_rows.index_select(0, order_t),
            thresholds.index_select(0, order_t),
            order_t,
            rows,
            self.io.upload(torch.tensor(back)),
        )

    @torch.no_grad()
    def generate_step(
        self, inputs: GenerateInputs, trace_now: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(latents [B', latent_dim], EOS flags [B'] as bool), on the device. Through the native
        attention, replayed as a trace from `trace_after` steps on (`trace_now`: on this one)."""
        with self._busy():
            attention = inputs.attention
            if self.ar_traces is None or not isinstance(attention, NativeRowAttention):
                return self._generate(
                    inputs.previous,
                    inputs.positions,
                    attention,
                    inputs.noise,
                    inputs.eos_thresholds,
                )
            tensors = {
                "positions": inputs.positions,
                "noise": inputs.noise,
                "eos_thresholds": inputs.eos_thresholds,
                **attention.tensors(),
            }
            return self.ar_traces(
                "generate",
                self._generate_traceable,
                inputs.previous,
                tensors,
                self.flow_lm,
                trace_now,
            )

    def _generate(
        self,
        previous: torch.Tensor,
        positions: torch.Tensor,
        attention: KVCache,
        noise: torch.Tensor,
        eos_thresholds: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        flow_lm = self.flow_lm
        z = flow_lm.backbone(flow_lm.embed_latents(previous), positions, attention)
        return self._sample(z, noise, eos_thresholds)

    def _generate_traceable(
        self, previous: torch.Tensor, tensors: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_generate` with every other input in `tensors`, the form a trace records."""
        return self._generate(
            previous,
            tensors["positions"],
            NativeRowAttention.from_tensors(tensors),
            tensors["noise"],
            tensors["eos_thresholds"],
        )

    def generate(
        self, requests: list[Request], noise: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One AR step for every request: (latents [B, latent_dim], EOS flags [B]) on the device."""
        inputs = self.generate_inputs(requests, noise)
        latents, eos = self.generate_step(inputs)
        return latents.index_select(0, inputs.back), eos.index_select(0, inputs.back)

    # ---- a prompt pass and an AR step as one pass

    def joins(self, prompts: int) -> bool:
        """Whether a prompt pass of `prompts` clauses runs in one pass with an AR step
        (`prefill_and_generate`): where that was timed to pay (`join_passes`), a pass of one
        sequence (`plan_one_sequence`), or its first part where passes split into such parts
        (the others then run apart, after the step's latents are out)."""
        one_sequence = prompts <= TRACED_PROMPT_SEQUENCES or self.split_prompt_passes
        return self.join_passes and prompts > 0 and one_sequence

    def prefill_and_generate(
        self,
        prefill: list[Request],
        prefill_noise: list[torch.Tensor],
        generate: list[Request],
        generate_noise: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`prefill` and `generate` in one pass (where `joins`): (latents, EOS flags) of the
        clauses of `prefill`, then of the rows of `generate`, each in its list's order, on the
        device. The weights are read once: at full size an AR step of 2 rows took 15.9 ms and of
        16 rows 22.9 (one Xeon core), so a pass and a step apart read them for ~16 ms twice. At
        most `TRACED_PROMPT_SEQUENCES` clauses: a pass of one sequence (`plan_one_sequence`)."""
        prompt = self.prefill_inputs(prefill, prefill_noise)
        step = self.generate_inputs(generate, generate_noise)
        latents, eos = self.joint_step(prompt, step)
        first = torch.arange(len(prefill), device=self.device)
        order = torch.cat([first, step.back + len(prefill)])
        return latents.index_select(0, order), eos.index_select(0, order)

    @torch.no_grad()
    def joint_step(
        self, prompt: PrefillInputs, step: GenerateInputs, trace_now: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(latents, EOS flags) of `prompt`'s clauses, then of `step`'s rows in context order,
        on the device; replayed as a trace like `prefill_step` and `generate_step`."""
        assert isinstance(prompt.attention, SequenceAttention)
        assert isinstance(step.attention, NativeRowAttention)
        with self._busy():
            tensors = {
                "previous": step.previous,
                "positions": torch.cat([prompt.positions, step.positions]),
                "last": prompt.last,
                "noise": torch.cat([prompt.noise, step.noise]),
                "eos_thresholds": torch.cat([prompt.eos_thresholds, step.eos_thresholds]),
                **JointAttention(prompt.attention, step.attention).tensors(),
            }
            if self.ar_traces is None:
                return self._joint_traceable(prompt.prompts, tensors)
            return self.ar_traces(
                "joint", self._joint_traceable, prompt.prompts, tensors, self.flow_lm, trace_now
            )

    def _joint_traceable(
        self, prompts: torch.Tensor, tensors: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts' pass and the AR rows' step as one backbone call (`JointAttention`): the
        prompts' last rows and every AR row sampled."""
        flow_lm = self.flow_lm
        x = torch.cat([prompts, flow_lm.embed_latents(tensors["previous"])])
        z = flow_lm.backbone(x, tensors["positions"], JointAttention.from_tensors(tensors))
        n = prompts.shape[0]
        z = torch.cat([z[:n].index_select(0, tensors["last"]), z[n:]])
        return self._sample(z, tensors["noise"], tensors["eos_thresholds"])

    def _sample(
        self, z: torch.Tensor, noise: torch.Tensor, eos_thresholds: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        latents = self.flow_lm.sample_latent(z, noise, self.flow_steps, self.flow_schedule)
        return latents, self.flow_lm.eos_logit(z) > eos_thresholds

    def _thresholds(self, requests: list[Request]) -> torch.Tensor:
        thresholds = [r.eos_threshold for r in requests]
        return self.io.upload(torch.tensor(thresholds, dtype=torch.float32))

    def _busy(self) -> contextlib.AbstractContextManager:
        """Stage calls count themselves busy so torch's threads follow the busy stage."""
        return self.threads.busy() if self.threads else contextlib.nullcontext()

    def _bucket(self, rows: int) -> int:
        """Rows padded to the next batch bucket, so steps take a few fixed shapes."""
        if not self.batch_buckets:
            return rows
        return next((b for b in self.batch_buckets if b >= rows), rows)

    # ---- decode

    @torch.no_grad()
    def decode_step(self, index: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """Waveform [B, T * samples_per_frame] for normalised latents [B, T, latent_dim] of the
        decoder rows `index` (in ascending slot order, so a run of slots is read in place); each
        row's history advances only when the whole call succeeds.

        On a CPU with several cores a batch of 2 x `DECODE_SPLIT_ROWS` rows or more runs as one
        part per core, concurrently, each on one thread (see `_decode_parts`)."""
        parts = self._decode_parts(index.shape[0])
        futures = [
            self._decode_pool.submit(self._decode_part, index[part], latents[part])
            for part in parts[1:]
        ]
        try:
            results = [self._decode_part(index[parts[0]], latents[parts[0]])]
        finally:
            # Every part finishes before any history advances or a retry starts.
            concurrent.futures.wait(futures)
        results += [future.result() for future in futures]  # raises a failed part's error
        for part, (state, _) in zip(parts, results, strict=True):
            self.decoder_states.scatter(index[part], state)
        return torch.cat([audio for _, audio in results])[:, 0]

    def _decode_part(
        self, index: torch.Tensor, latents: torch.Tensor
    ) -> tuple[State, torch.Tensor]:
        with torch.no_grad(), self._busy():
            state = self.decoder_states.gather(index)
            return state, self.decoder.decode(self.flow_lm.denormalize(latents), state)

    def _decode_parts(self, rows: int) -> list[slice]:
        """One part per core, of at least `DECODE_SPLIT_ROWS` rows each, whether or not the AR
        stage steps meanwhile: the decoder is the full-size model's bottleneck, and a part that
        shares the AR thread's core costs the AR stage less than the decoder gains from calls
        that end sooner (bench/results/cpu-2core-epyc-avx512-issue16-call-deadline/)."""
        count = min(self.decode_parts, rows // DECODE_SPLIT_ROWS) or 1
        bounds = [rows * i // count for i in range(count + 1)]
        return [slice(a, b) for a, b in itertools.pairwise(bounds)]

    @torch.no_grad()
    def decode_detached(
        self, latents: torch.Tensor, histories: list[dict[str, torch.Tensor] | None]
    ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        """Waveform [B, T * samples_per_frame] of latents [B, T, latent_dim] of rows that hold
        no slot, each from its own history (a fresh one for None), outside the pool: it waits
        for no call on the pool in flight. Returns each row's history after it, in the form
        `DecoderStatePool.restore` takes."""
        with self._busy():
            state = self.decoder_states.detached(histories)
            audio = self.decoder.decode(self.flow_lm.denormalize(latents), state)
        return audio[:, 0], self.decoder_states.histories(state)

    @torch.no_grad()
    def prepare_ar_traces(self) -> None:
        """Make the AR stage's traces now, on a scratch pool and context: the AR step's on one
        row, which replays for any rows and contexts, a prompt pass's on one sequence of two
        positions, which replays for any prompt and context, and the two as one pass's.
        Otherwise each is made in the call that reaches `trace_after`, a stall of about 20 eager
        calls for that call's streams."""
        if self.ar_traces is None:
            return
        pool = self._scratch_pool(1, 2)
        generate = self._scratch_step(pool, range(1), context=0, span=0)
        prefill = self._scratch_prompt_pass(pool, range(1), prompt=2, context=0, as_one=True)
        for name, call in (
            ("AR step", lambda: self.generate_step(generate, trace_now=True)),
            ("prompt pass", lambda: self.prefill_step(prefill, trace_now=True)),
            ("joint pass", lambda: self.joint_step(prefill, generate, trace_now=True)),
        ):
            try:
                call()
            except Exception:
                # It stays eager (traces.TraceCache); a warm-up must not stop serving.
                logger.warning("%s trace failed: eager", name, exc_info=True)
        self.split_prompt_passes = self._split_passes_pay()
        self.join_passes = self._joint_passes_pay()

    def _joint_passes_pay(self) -> bool:
        """Whether a prompt pass of one clause and an AR step of 16 rows take at least
        `JOINT_MIN_SAVING_S` less as one pass than apart, on scratch prompts and rows (best of
        three): the saving is the weights read once, most of a call at full size and little
        for a small model."""
        rows, context, prompt = 16, 48, 8
        span = -(-(context + prompt) // self.blocks.page_size) * self.blocks.page_size
        pool = self._scratch_pool(rows + 1, context + prompt)
        prefill = self._scratch_prompt_pass(pool, range(1), prompt, context, as_one=True)
        step = self._scratch_step(pool, range(1, rows + 1), context, span)

        def apart() -> None:
            self.io.values(self.prefill_step(prefill)[1])
            self.io.values(self.generate_step(step)[1])

        try:
            apart_s = best_seconds(apart)
            joint_s = best_seconds(lambda: self.io.values(self.joint_step(prefill, step)[1]))
        except Exception:
            logger.warning("timing a joint pass failed: passes run apart", exc_info=True)
            return False
        logger.debug(
            "a pass and a step: %.1f ms apart, %.1f ms as one", apart_s * 1e3, joint_s * 1e3
        )
        return apart_s - joint_s >= JOINT_MIN_SAVING_S

    def _split_passes_pay(self) -> bool:
        """Whether a prompt pass of `2 * TRACED_PROMPT_SEQUENCES` short sequences takes less time
        as traced parts than as one eager packed pass, on scratch prompts (best of three). The
        eager pass dispatches each sequence's attention from Python, holding the GIL; each part
        reads the weights again. On a Xeon core, 8 sequences of 8 positions: the 2M model 12.4
        ms packed against 9.7 split (in the engine at c=64, prompt passes 6.3-7.4 -> 4.9-5.6 ms
        a sequence), full size 74 against 90 (bench/results/cpu-2core-xeon-amx-2026-12-07)."""
        count, prompt, context = 2 * TRACED_PROMPT_SEQUENCES, 4, 12
        pool = self._scratch_pool(count, context + prompt)
        part = TRACED_PROMPT_SEQUENCES
        packed = [self._scratch_prompt_pass(pool, range(count), prompt, context, as_one=False)]
        split = [
            self._scratch_prompt_pass(pool, range(first, first + part), prompt, context, True)
            for first in range(0, count, part)
        ]

        def run(passes: list[PrefillInputs]) -> None:
            for pass_inputs in passes:
                self.io.values(self.prefill_step(pass_inputs)[1])

        try:
            packed_s, split_s = best_seconds(lambda: run(packed)), best_seconds(lambda: run(split))
        except Exception:
            logger.warning("timing split prompt passes failed: they stay packed", exc_info=True)
            return False
        logger.debug(
            "prompt pass of %d sequences: %.1f ms packed, %.1f ms split",
            count,
            packed_s * 1e3,
            split_s * 1e3,
        )
        return split_s < packed_s

    def _scratch_pool(self, sequences: int, length: int) -> KVPool:
        """A pool for `sequences` scratch sequences of `length` positions, each on pages of its
        own (`_scratch_prompt_pass`)."""
        page_size = self.blocks.page_size
        return self.flow_lm.new_kv_pool(
            sequences * -(-length // page_size) * page_size, device=self.device
        )

    def _scratch_prompt_pass(
        self, pool: KVPool, sequences: range, prompt: int, context: int, as_one: bool
    ) -> PrefillInputs:
        """A prompt pass on a scratch `pool` (`_scratch_pool`): sequence i of
        `sequences` on pages of its own, `prompt` new positions after `context`; zero prompts and
        noise; packed, or as one sequence (`as_one`), the form a trace replays."""
        length = context + prompt
        page_size = self.blocks.page_size
        per = -(-length // page_size)  # pages a sequence takes
        paged = [
            PagedSequence(list(range(i * per, (i + 1) * per)), length, prompt) for i in sequences
        ]
        attention: SlotAttention | SequenceAttention
        if as_one:
            positions, attention = plan_one_sequence(pool, paged, page_size, upload=self.io.upload)
        else:
            steps = [
                SequenceStep(torch.arange(length) + s.pages[0] * page_size, prompt) for s in paged
            ]
            positions, attention = plan_step(pool, steps, upload=self.io.upload)
        count = len(paged)
        last = self.io.upload(torch.arange(1, count + 1) * prompt - 1)
        zeros = torch.zeros(count, self.flow_lm.latent_dim, device=self.device)
        prompts = torch.zeros(count * prompt, self.bos_input.shape[-1], device=self.device)
        return PrefillInputs(prompts, positions, attention, last, zeros, zeros[:, 0])

    def _scratch_step(
        self, pool: KVPool, sequences: range, context: int, span: int
    ) -> GenerateInputs:
        """An AR step on a scratch `pool`: a row per sequence i of `sequences`, its `context`
        positions and the new one from slot i x `span` on, in dense contexts of its own; zero
        latents and noise."""
        rows = len(sequences)
        steps = [SequenceStep(torch.arange(context + 1) + i * span, 1) for i in sequences]
        order, positions, attention = plan_row_context_step(
            RowContexts(pool, rows, CONTEXT_RUN, self.row_contexts.keys.dtype),
            steps,
            [None] * rows,
            native=True,
            upload=self.io.upload,
        )
        zeros = torch.zeros(rows, self.flow_lm.latent_dim, device=self.device)
        order_t = self.io.upload(torch.tensor(order))
        back = self.io.upload(torch.argsort(torch.tensor(order)))
        return GenerateInputs(zeros, positions, attention, zeros, zeros[:, 0], order_t, rows, back)

    @torch.no_grad()
    def prepare_decoder_traces(self) -> None:
        """Make the CPU decoder's traces now, on scratch rows of a pool of its own: a call on
        pool rows in one run (also the kind of detached rows), and one on scattered rows, the
        kinds of state the engine decodes. Otherwise each is made in the call that reaches
        `trace_after`, a 0.1-0.4 s stall for that call's streams."""
        if not isinstance(self.decoder, CpuDecoder) or self.decoder.traces is None:
            return
        scratch = DecoderStatePool(self.decoder, 3, self.device)
        for _ in range(3):
            scratch.acquire()
        latents = torch.zeros(2, 1, self.flow_lm.latent_dim, device=self.device)
        for rows in ([0, 1], [0, 2]):
            state = scratch.gather(torch.tensor(rows, device=self.device))
            try:
                self.decoder.decode(self.flow_lm.denormalize(latents), state, trace_now=True)
            except Exception:
                # That kind stays eager (traces.TraceCache); a warm-up must not stop serving.
                logger.warning("decoder trace on rows %s failed: eager", rows, exc_info=True)

    def decode(self, slots: list[int], latents: torch.Tensor) -> torch.Tensor:
        """`decode_step` for rows in any order: the audio comes back in the caller's order."""
        # Rows in slot order: a batch holding a run of slots reads their decoder state in place.
        order = sorted(range(len(slots)), key=slots.__getitem__)
        back = sorted(range(len(order)), key=order.__getitem__)  # the caller's order again
        index = self.io.upload(torch.tensor([slots[i] for i in order]))
        audio = self.decode_step(index, latents[self.io.upload(torch.tensor(order))])
        return audio.index_select(0, self.io.upload(torch.tensor(back)))


def best_seconds(call: Callable[[], object]) -> float:
    """The least seconds of three calls of `call`, after one that warms it up."""
    times = []
    for _ in range(4):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times[1:])


def new_ar_traces(config: EngineConfig) -> traces.TraceCache | None:
    """Where an engine's runners trace their AR steps and prompt passes, from
    `config.trace_after` on; None where they stay eager.

    Through the native attention an AR step replays as one TorchScript trace, whatever its rows
    and contexts, and a prompt pass of one sequence as another, whatever its prompt and context
    (traces.py: sizes flow through them). Eager, a full-size step of one row spent about 4 of
    its 14 ms dispatching its ~700 operators from Python with the GIL held, which the decoder's
    thread and the callers' loop wait for; a short first clause's prompt pass 21 of which a
    trace takes 16 (the engine's first audio on an idle 2-core Zen 3: 47 -> 41 ms).
    """
    if config.trace_after is None or not traces.available():
        return None
    return traces.TraceCache(config.trace_after)


def kv_pages(model: PocketTTS, config: EngineConfig) -> int:
    """Pages of the KV pool: `config.num_pages`, else as many as `kv_memory_mb` holds of this
    model's slots."""
    if config.num_pages is not None:
        return config.num_pages
    slot_bytes = model.flow_lm.new_kv_pool(0, device="cpu").slot_bytes
    return max(1, int(config.kv_memory_mb * 2**20 // (slot_bytes * config.page_size)))
