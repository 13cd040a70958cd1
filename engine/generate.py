"""Single-request generation: the plain sequential path, one frame at a time.

This is the baseline the engine is measured against and the definition its batched output is
checked against. A request is a list of clauses. Every clause is prefilled from the voice, then
(with chaining on) the last `chain_frames` latents of the previous clause as extra voice frames,
then the clause text; the Mimi decoder state runs on across clauses. With one clause and chaining
off this equals the reference package.
"""

from __future__ import annotations

import queue
import secrets
import threading
from collections.abc import Iterator
from typing import TypeVar

import numpy as np
import torch

from intone.engine.loading import LoadedModel
from intone.engine.models.pocket.flow_head import draw_noise
from intone.engine.models.pocket.kv_cache import SequenceStep, plan_step
from intone.engine.options import ClausePlan, ClauseProgress, GenerationOptions
from intone.engine.text import plan_clause
from intone.engine.voices import Voice

# The reference fades in the first 5 ms (sample_rate // 200) of a fresh decoder state to hide a
# small step in its first samples.
FADE_IN_DIVISOR = 200
T = TypeVar("T", torch.Tensor, np.ndarray)


def fade_in(audio: T, sample_rate: int) -> T:
    """A stream's first samples ramped up from 0, in place: a tensor or a host array (the
    engine's audio, read back from the device)."""
    ramp = np.linspace(0, 1, sample_rate // FADE_IN_DIVISOR, dtype=np.float32)
    n = min(ramp.size, audio.shape[-1])
    if isinstance(audio, np.ndarray):
        audio[..., :n] *= ramp[:n]
    else:
        audio[..., :n] *= torch.from_numpy(ramp[:n]).to(audio)
    return audio


class ClauseGenerator:
    """Latent generation of one clause for one request: prefill, then one frame per `step`."""

    def __init__(
        self,
        loaded: LoadedModel,
        voice: Voice,
        plan: ClausePlan,
        tail: torch.Tensor | None,
        options: GenerationOptions,
        generator: torch.Generator,
    ):
        model = loaded.model
        self.flow_lm = model.flow_lm
        self.plan = plan
        self.options = options
        self.generator = generator
        self.temperature = (
            loaded.config.default_temperature
            if options.temperature is None
            else options.temperature
        )
        self.eos_threshold = (
            loaded.config.default_eos_threshold
            if options.eos_threshold is None
            else options.eos_threshold
        )
        parts = [self.flow_lm.embed_text(torch.tensor(plan.tokens, device=model.device))]
        if tail is not None and tail.shape[0]:
            parts.insert(0, model.flow_lm.embed_tail(tail, model.tail_projection))
        prompt = torch.cat(parts)
        capacity = voice.length + prompt.shape[0] + plan.max_frames
        self.pool = self.flow_lm.new_kv_pool(capacity, device=model.device)
        self.pool.write(torch.arange(voice.length, device=model.device), voice.keys, voice.values)
        self.slots = torch.arange(capacity)
        self.length = voice.length + prompt.shape[0]
        positions, attention = plan_step(
            self.pool, [SequenceStep(self.slots[: self.length], prompt.shape[0])]
        )
        self.flow_lm.backbone(prompt, positions, attention)
        self.previous = torch.full((1, self.flow_lm.latent_dim), float("nan"), device=model.device)
        self.progress = ClauseProgress(plan)

    def step(self) -> torch.Tensor | None:
        """The next normalised latent [latent_dim], or None when the clause is over."""
        if self.progress.ended:
            return None
        self.length += 1
        positions, attention = plan_step(self.pool, [SequenceStep(self.slots[: self.length], 1)])
        z = self.flow_lm.backbone(self.flow_lm.embed_latents(self.previous), positions, attention)
        is_eos = bool(self.flow_lm.eos_logit(z)[0] > self.eos_threshold)
        noise = draw_noise(
            [self.generator],
            self.flow_lm.latent_dim,
            [self.temperature],
            [self.options.noise_clamp],
            z.device,
        )
        latent = self.flow_lm.sample_latent(z, noise, self.options.flow_steps)
        if not self.progress.advance(is_eos):
            return None
        self.previous = latent
        return latent[0]


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(secrets.randbits(63) if seed is None else seed)
    return generator


@torch.no_grad()
def generate_latents(
    loaded: LoadedModel, voice: Voice, clauses: list[str], options: GenerationOptions
) -> Iterator[tuple[int, torch.Tensor]]:
    """(clause index, normalised latent [latent_dim]) for every frame, in order."""
    options.validate()
    generator = make_generator(options.seed)
    tail: torch.Tensor | None = None
    for index, clause in enumerate(clauses):
        plan = plan_clause(loaded, clause, options)
        clause_gen = ClauseGenerator(loaded, voice, plan, tail, options, generator)
        latents = []
        while (latent := clause_gen.step()) is not None:
            latents.append(latent)
            yield index, latent
        if options.chain_frames and latents:
            tail = torch.stack(latents[-options.chain_frames :])


def generate(
    loaded: LoadedModel, voice: Voice, clauses: list[str], options: GenerationOptions
) -> Iterator[torch.Tensor]:
    """Audio frames [samples_per_frame] (float32, model rate) for the clauses, streamed.

    As in the reference, latent generation runs on its own thread, one frame ahead of the decoder
    that runs in the caller's, so the two halves overlap.
    """
    options.validate()
    latents: queue.Queue[torch.Tensor | BaseException | None] = queue.Queue(maxsize=4)
    stop = threading.Event()

    def offer(item: torch.Tensor | BaseException | None) -> bool:
        """Queue an item unless the consumer went away."""
        while not stop.is_set():
            try:
                latents.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for _, latent in generate_latents(loaded, voice, clauses, options):
                if not offer(latent):
                    return
            offer(None)
        except BaseException as e:  # surfaced in the consumer
            offer(e)

    producer = threading.Thread(target=produce, name="intone-generate", daemon=True)
    producer.start()
    model = loaded.model
    state = model.mimi.init_decoder_state(1, model.device)
    first = True
    try:
        while (latent := latents.get()) is not None:
            if isinstance(latent, BaseException):
                raise latent
            with torch.no_grad():
                audio = model.mimi.decode(model.flow_lm.denormalize(latent)[None, None], state)
            audio = audio[0, 0]
            if first:
                audio = fade_in(audio, model.sample_rate)
                first = False
            yield audio.cpu()
    finally:
        stop.set()
        producer.join()
