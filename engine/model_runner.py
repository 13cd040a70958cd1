"""The tensor work of the two engine stages, on batches the schedulers formed.

Step functions take prepared tensors (positions, slots, masks, noise) and return tensors; the
only host reads (EOS flags) happen after a step, in the scheduler's bookkeeping. That keeps each
step free of data-dependent Python, the precondition for replaying it as a CUDA graph.
"""

from __future__ import annotations

import contextlib

import torch

from intone.engine.block_manager import BlockManager, PageTable
from intone.engine.decoder_states import DecoderStatePool
from intone.engine.models.pocket.flow_head import draw_noise
from intone.engine.models.pocket.gemm_decoder import make_decoder
from intone.engine.models.pocket.kv_cache import SequenceStep, SlotAttention, plan_step
from intone.engine.models.pocket.model import PocketTTS
from intone.engine.sequence import Request
from intone.engine.thread_budget import ThreadBudget
from intone.engine.voices import Voice


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
        thread_budget: ThreadBudget | None = None,
    ):
        self.model = model
        self.flow_lm = model.flow_lm
        self.blocks = blocks
        self.flow_steps = flow_steps
        self.device = device
        self.batch_buckets = sorted(batch_buckets) if batch_buckets else None
        # One page past the pool's end is scratch space for the padding rows of a bucket.
        self.pool = self.flow_lm.new_kv_pool(
            (blocks.num_pages + 1) * blocks.page_size, device=device
        )
        # Stage calls count themselves busy so torch's threads follow the busy stage.
        self.threads = thread_budget
        self.decoder = make_decoder(model.mimi, device, int8=decoder_int8)
        self.decoder_states = DecoderStatePool(self.decoder, decoder_slots, device)

    def prompt_embeddings(self, tokens: list[int], tail: torch.Tensor | None) -> torch.Tensor:
        """A clause's prompt: the chaining tail as extra voice frames, then the text."""
        text = self.flow_lm.embed_text(torch.tensor(tokens, device=self.device))
        if tail is None or not tail.shape[0]:
            return text
        voice_like = self.model.latents_as_voice(tail)
        return torch.cat([voice_like, text])

    def copy_page(self, source: int, target: int, count: int) -> None:
        """Copy the first `count` slots of a shared page into a private one."""
        size = self.blocks.page_size
        src = slice(source * size, source * size + count)
        dst = slice(target * size, target * size + count)
        self.pool.keys[:, dst] = self.pool.keys[:, src]
        self.pool.values[:, dst] = self.pool.values[:, src]

    def add_voice(self, voice: Voice) -> PageTable:
        """Write a voice's prompt K/V into pages of its own, shared by its requests later."""
        table = self.blocks.allocate(voice.length)
        self.pool.write(self.blocks.slots(table).to(self.device), voice.keys, voice.values)
        return table

    @torch.no_grad()
    def prefill(self, requests: list[Request]) -> None:
        """One packed pass over the prompts of `requests`: no padding, one sequence each."""
        steps = []
        for request in requests:
            assert request.table is not None and request.prompt is not None
            self.blocks.extend(request.table, request.prompt.shape[0])
            steps.append(SequenceStep(self.blocks.slots(request.table), request.prompt.shape[0]))
        positions, attention = plan_step(self.pool, steps)
        prompts = torch.cat([r.prompt for r in requests if r.prompt is not None])
        with self._busy():
            self.flow_lm.backbone(prompts, positions, attention)

    @torch.no_grad()
    def generate(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """One AR step for every request: (latents [B, latent_dim], EOS logits [B]).

        With batch buckets, padding rows attend only to a scratch slot and are dropped.
        """
        steps = []
        for request in requests:
            assert request.table is not None
            self.blocks.extend(request.table, 1)
            steps.append(SequenceStep(self.blocks.slots(request.table), 1))
        previous = torch.stack(
            [r.previous_latent for r in requests if r.previous_latent is not None]
        )
        noise = draw_noise(
            [r.generator for r in requests],
            self.flow_lm.latent_dim,
            [r.temperature for r in requests],
            [r.noise_clamp for r in requests],
            self.device,
        )
        rows = len(requests)
        padding = self._bucket(rows) - rows
        if padding:
            scratch = torch.tensor([self.blocks.num_pages * self.blocks.page_size])
            steps += [SequenceStep(scratch, 1)] * padding
            previous = torch.cat([previous, previous.new_zeros(padding, previous.shape[1])])
            noise = torch.cat([noise, noise.new_zeros(padding, noise.shape[1])])
        key_multiple = self.blocks.page_size if self.batch_buckets else 1
        positions, attention = plan_step(self.pool, steps, key_multiple)
        with self._busy():
            latents, eos_logits = self._generate_step(previous, positions, attention, noise)
        return latents[:rows], eos_logits[:rows]

    def _busy(self) -> contextlib.AbstractContextManager:
        return self.threads.busy() if self.threads else contextlib.nullcontext()

    def _bucket(self, rows: int) -> int:
        """Rows padded to the next batch bucket, so steps take a few fixed shapes."""
        if not self.batch_buckets:
            return rows
        return next((b for b in self.batch_buckets if b >= rows), rows)

    def _generate_step(
        self,
        previous: torch.Tensor,
        positions: torch.Tensor,
        attention: SlotAttention,
        noise: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.flow_lm.backbone(self.flow_lm.embed_latents(previous), positions, attention)
        return self.flow_lm.sample_latent(z, noise, self.flow_steps), self.flow_lm.eos_logit(z)

    @torch.no_grad()
    def decode(self, slots: list[int], latents: torch.Tensor) -> torch.Tensor:
        """Waveform [B, T * samples_per_frame] for normalised latents [B, T, latent_dim]."""
        index = torch.tensor(slots, device=self.device)
        with self._busy():
            state = self.decoder_states.gather(index)
            audio = self.decoder.decode(self.flow_lm.denormalize(latents), state)
            self.decoder_states.scatter(index, state)
        return audio[:, 0]
