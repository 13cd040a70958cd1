"""The AR stage's calls replayed as TorchScript traces (`ModelRunner.ar_traces`): the AR step's
trace, made on one scratch row, replays every step bit for bit, whatever its rows, their
contexts' lengths and the contexts' reservation (which moves when a context outgrows it); a
prompt pass's, made on two positions, replays a pass of one sequence of any prompt and context,
and a packed pass of a few sequences as one (`kv_cache.plan_one_sequence`); a pass of more
sequences runs as traced parts of that many where that was timed faster
(`ModelRunner.split_prompt_passes`); and a pass and a step as one pass replays the two."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from intone.engine import Engine, EngineConfig
from intone.engine.config import TRACED_PROMPT_SEQUENCES
from intone.engine.kernels.row_contexts import NativeRowAttention, plan_row_context_step
from intone.engine.loading import LoadedModel
from intone.engine.model_runner import GenerateInputs, ModelRunner, PrefillInputs
from intone.engine.models.pocket.kv_cache import (
    PagedSequence,
    SequenceStep,
    plan_one_sequence,
    plan_step,
)


@pytest.fixture
def engines(tiny_model: LoadedModel) -> Iterator[tuple[Engine, Engine]]:
    """(eager, traced with its traces made) on pools that hold the same keys and values."""
    config = EngineConfig(torch_threads=0, max_active=8, dtype="float32", num_pages=256)
    eager = Engine(tiny_model, replace(config, trace_after=None))
    traced = Engine(tiny_model, replace(config, trace_after=1))
    try:
        if not traced.runner.native_row_attention:
            pytest.skip("no native attention here: AR steps run eagerly in torch")
        assert eager.runner.ar_traces is None
        traced.prepare_traces()
        for runner in (eager.runner, traced.runner):
            generator = torch.Generator().manual_seed(0)
            for tensor in (runner.pool.keys, runner.pool.values):
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
        yield eager, traced
    finally:
        eager.close()
        traced.close()


def assert_same_pools(a: ModelRunner, b: ModelRunner) -> None:
    assert torch.equal(a.pool.keys, b.pool.keys)
    assert torch.equal(a.pool.values, b.pool.values)


def step(runner: ModelRunner, lengths: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    """One AR step of rows whose contexts are `lengths` positions of the pool (this one's
    included), in the requests' order, as `ModelRunner.generate` returns it."""
    inputs = step_inputs(runner, lengths, seed)
    latents, eos = runner.generate_step(inputs)
    return latents[inputs.back], eos[inputs.back]


def step_inputs(
    runner: ModelRunner, lengths: list[int], seed: int, first_slot: int = 0
) -> GenerateInputs:
    """`step`'s inputs, its rows' positions drawn from the pool's slots from `first_slot` on."""
    generator = torch.Generator().manual_seed(seed)
    slots = runner.pool.num_slots - 1 - first_slot
    steps = [
        SequenceStep(first_slot + torch.randperm(slots, generator=generator)[:n], 1)
        for n in lengths
    ]
    latent_dim = runner.flow_lm.latent_dim
    previous = torch.randn(len(lengths), latent_dim, generator=generator)
    noise = torch.randn(len(lengths), latent_dim, generator=generator)
    thresholds = torch.randn(len(lengths), generator=generator)
    owners = [object() for _ in lengths]
    order, positions, attention = plan_row_context_step(
        runner.row_contexts, steps, owners, native=runner.native_row_attention
    )
    assert isinstance(attention, NativeRowAttention)
    order_t = torch.tensor(order)
    return GenerateInputs(
        previous[order_t],
        positions,
        attention,
        noise[order_t],
        thresholds[order_t],
        order_t,
        len(lengths),
        torch.argsort(order_t),
    )


def prompt_pass(
    runner: ModelRunner,
    sequences: list[tuple[int, int]],
    seed: int,
    as_one: bool = True,
    shared_pages: int = 0,
) -> tuple[torch.Tensor, ...]:
    """One packed prompt pass: per sequence, `prompt` new positions after `context` on pages of
    the pool drawn at random, as one sequence (`as_one`) or as `plan_step` plans it; every
    sequence's context starts with the same `shared_pages` pages (a voice's, as streams share
    them)."""
    return runner.prefill_step(prompt_inputs(runner, sequences, seed, as_one, shared_pages))


def prompt_inputs(
    runner: ModelRunner,
    sequences: list[tuple[int, int]],
    seed: int,
    as_one: bool = True,
    shared_pages: int = 0,
    pages: int | None = None,
) -> PrefillInputs:
    """`prompt_pass`'s inputs, its pages drawn from the pool's first `pages` (default all)."""
    generator = torch.Generator().manual_seed(seed)
    page_size = runner.blocks.page_size
    own = [-(-(context + prompt) // page_size) for context, prompt in sequences]
    drawn = torch.randperm(pages or runner.blocks.num_pages, generator=generator)
    voice, rest = drawn[:shared_pages].tolist(), drawn[shared_pages:].tolist()
    paged = []
    for (context, prompt), count in zip(sequences, own, strict=True):
        pages, rest = voice + rest[:count], rest[count:]
        paged.append(PagedSequence(pages, shared_pages * page_size + context + prompt, prompt))
    if as_one:
        positions, attention = plan_one_sequence(runner.pool, paged, page_size)
        # A page several sequences use is read once.
        assert attention.read_slots.shape[0] == (shared_pages + sum(own)) * page_size
    else:
        offsets = torch.arange(page_size)
        steps = [
            SequenceStep(
                (torch.tensor(s.pages)[:, None] * page_size + offsets).view(-1)[: s.length],
                s.num_new,
            )
            for s in paged
        ]
        positions, attention = plan_step(runner.pool, steps)
    prompts = [prompt for _, prompt in sequences]
    width = runner.bos_input.shape[-1]
    latent_dim = runner.flow_lm.latent_dim
    return PrefillInputs(
        torch.randn(sum(prompts), width, generator=generator),
        positions,
        attention,
        torch.tensor(list(itertools.accumulate(prompts))) - 1,
        torch.randn(len(sequences), latent_dim, generator=generator),
        torch.randn(len(sequences), generator=generator),
    )


def test_one_trace_replays_every_step_bit_for_bit(engines: tuple[Engine, Engine]) -> None:
    eager, traced = engines
    traces = traced.runner.ar_traces
    assert traces is not None and len(traces) == 3  # the AR step, a prompt pass, the two
    capacity = traced.runner.row_contexts.capacity
    cases = [[1], [3, 70, 12], [200, 1, 5, 33, 64, 9, 150], [capacity + 7, 4]]
    assert capacity + 7 < traced.runner.pool.num_slots
    for seed, lengths in enumerate(cases):
        want = step(eager.runner, lengths, seed)
        got = step(traced.runner, lengths, seed)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), lengths
        assert_same_pools(traced.runner, eager.runner)
    # The last case grew the reservation: the same trace read the new one.
    assert traced.runner.row_contexts.capacity > capacity
    assert len(traces) == 3


def test_one_trace_replays_every_prompt_pass_of_one_sequence_bit_for_bit(
    engines: tuple[Engine, Engine],
) -> None:
    eager, traced = engines
    traces = traced.runner.ar_traces
    assert traces is not None
    for seed, (context, prompt) in enumerate([(0, 2), (0, 9), (37, 3), (150, 31), (5, 120)]):
        want = prompt_pass(eager.runner, [(context, prompt)], seed)
        got = prompt_pass(traced.runner, [(context, prompt)], seed)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (context, prompt)
        assert_same_pools(traced.runner, eager.runner)
    assert len(traces) == 3


def test_a_packed_prompt_pass_replayed_as_one_sequence_is_the_packed_pass(
    engines: tuple[Engine, Engine],
) -> None:
    """The prompt pass's trace replays a pass of several sequences, each query masked to its own
    sequence's keys, keys that several sequences share read once: it gives what the eager
    packed pass (each sequence's attention on its own keys) gives, latents, EOS flags and the
    keys and values written."""
    eager, traced = engines
    traces = traced.runner.ar_traces
    assert traces is not None
    cases = [
        ([(0, 2), (37, 3)], 0),
        ([(150, 31), (5, 9), (0, 2)], 0),
        ([(12, 4)] * 4, 0),
        # Clauses of streams of one voice: its keys are read once, each query still sees them.
        ([(3, 4), (0, 9), (20, 2)], 4),
    ]
    for seed, (sequences, shared_pages) in enumerate(cases):
        want = prompt_pass(eager.runner, sequences, seed, as_one=False, shared_pages=shared_pages)
        got = prompt_pass(traced.runner, sequences, seed, shared_pages=shared_pages)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        got_pool, want_pool = traced.runner.pool, eager.runner.pool
        torch.testing.assert_close(got_pool.keys, want_pool.keys, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_pool.values, want_pool.values, rtol=1e-6, atol=1e-6)
    assert len(traces) == 3


def test_a_prompt_pass_split_into_traced_parts_is_the_packed_pass(
    engines: tuple[Engine, Engine],
) -> None:
    """Where split passes were timed faster, a prompt pass of more sequences than a traced pass
    packs runs as traced parts: each request still gets its own latent and EOS flag, and its
    keys and values land in its own slots, as in one eager packed pass."""
    eager, traced = engines
    assert not eager.runner.split_prompt_passes  # no traces: never split
    traced.runner.split_prompt_passes = True  # whatever the warm-up timed here
    parts: list[int] = []
    prefill_step = traced.runner.prefill_step

    def counted(inputs: PrefillInputs) -> tuple[torch.Tensor, torch.Tensor]:
        parts.append(inputs.last.shape[0])
        return prefill_step(inputs)

    traced.runner.prefill_step = counted  # type: ignore[method-assign]
    sequences = [(0, 2), (37, 3), (150, 31), (5, 9), (12, 4), (60, 7)]
    assert len(sequences) > TRACED_PROMPT_SEQUENCES

    def prompt_passes(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(7)
        width, latent_dim = runner.bos_input.shape[-1], runner.flow_lm.latent_dim
        requests = [
            SimpleNamespace(
                table=runner.blocks.allocate(context + prompt + 1),
                prompt=torch.randn(prompt, width, generator=generator),
                eos_threshold=float(torch.randn(1, generator=generator)),
            )
            for context, prompt in sequences
        ]
        noise = [torch.randn(latent_dim, generator=generator) for _ in requests]
        return runner.prefill(requests, noise)  # type: ignore[arg-type]

    want = prompt_passes(eager.runner)
    got = prompt_passes(traced.runner)
    assert parts == [TRACED_PROMPT_SEQUENCES, len(sequences) - TRACED_PROMPT_SEQUENCES]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    got_pool, want_pool = traced.runner.pool, eager.runner.pool
    torch.testing.assert_close(got_pool.keys, want_pool.keys, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_pool.values, want_pool.values, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("sequences", "lengths"), [([(0, 2)], [1]), ([(37, 3), (150, 31)], [5, 90, 151])]
)
def test_a_prompt_pass_and_an_ar_step_as_one_pass_are_the_two_apart(
    engines: tuple[Engine, Engine], sequences: list[tuple[int, int]], lengths: list[int]
) -> None:
    """A prompt pass and an AR step as one pass (`ModelRunner.joint_step`, the trace made on
    scratch rows) give each clause and each row the latent and EOS flag that the pass and the
    step give apart (eager), and write the same keys and values: the weights are read once."""
    eager, traced = engines
    half = eager.runner.blocks.num_pages // 2  # the pass's pages; the step's slots past them
    first_slot = half * eager.runner.blocks.page_size

    def inputs(runner: ModelRunner) -> tuple[PrefillInputs, GenerateInputs]:
        prompt = prompt_inputs(runner, sequences, seed=5, pages=half)
        return prompt, step_inputs(runner, lengths, seed=6, first_slot=first_slot)

    prompt, ar_step = inputs(eager.runner)
    apart = [eager.runner.prefill_step(prompt), eager.runner.generate_step(ar_step)]
    want = [torch.cat(parts) for parts in zip(*apart, strict=True)]
    got = traced.runner.joint_step(*inputs(traced.runner))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(traced.runner.pool.keys, eager.runner.pool.keys)
    torch.testing.assert_close(traced.runner.pool.values, eager.runner.pool.values)
