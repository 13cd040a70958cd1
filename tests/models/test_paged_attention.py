"""Packed and paged FlowLM steps against one sequence at a time on contiguous slots (tiny model).

The reference for every check is the single-request layout: one sequence, its own pool, slots
0..n-1, one step per call. The engine's layouts (several prompts packed into one pass, positions
on scattered pages, a batch of sequences of different lengths, a voice prefix on shared pages with
a private copy of its partial last page) must give the same backbone outputs and write the same
keys and values.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from intone.engine.block_manager import BlockManager, PageTable
from intone.engine.loading import LoadedModel
from intone.engine.model_runner import ModelRunner
from intone.engine.models.pocket.kv_cache import KVPool, SequenceStep, plan_step
from intone.engine.voices import Voice

from support.attention import PaddedGatherAttention, assert_relative, clone_pool, embeddings

TOL = dict(rtol=1e-4, atol=1e-5)


def new_pool(flow_lm, num_slots: int) -> KVPool:
    tf = flow_lm.transformer
    return KVPool(flow_lm.num_layers, num_slots, tf.num_kv_heads, tf.head_dim)


class Contiguous:
    """One sequence alone: slots 0..n-1 of its own pool, as the single-request path lays it out."""

    def __init__(self, flow_lm, history: Voice | None, capacity: int = 256):
        self.flow_lm = flow_lm
        self.pool = new_pool(flow_lm, capacity)
        self.length = 0
        if history is not None:
            self.pool.write(torch.arange(history.length), history.keys, history.values)
            self.length = history.length

    @torch.no_grad()
    def step(self, x: torch.Tensor) -> torch.Tensor:
        self.length += x.shape[0]
        slots = torch.arange(self.length)
        positions, attention = plan_step(self.pool, [SequenceStep(slots, x.shape[0])])
        return self.flow_lm.backbone(x, positions, attention)

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.read(torch.arange(self.length))


class Paged:
    """Sequences on pages of one shared pool, stepped together in packed passes."""

    def __init__(self, flow_lm, num_pages: int, page_size: int, seed: int):
        self.flow_lm = flow_lm
        self.blocks = BlockManager(num_pages, page_size)
        random.Random(seed).shuffle(self.blocks.free_pages)
        self.pool = new_pool(flow_lm, num_pages * page_size)
        self.tables: list[PageTable] = []

    def add(self, history: Voice | None, final_length: int) -> int:
        table = PageTable()
        assert self.blocks.reserve(table, final_length)
        if history is not None:
            self.blocks.extend(table, history.length)
            self.pool.write(self.blocks.slots(table), history.keys, history.values)
        self.tables.append(table)
        return len(self.tables) - 1

    @torch.no_grad()
    def step(
        self, inputs: dict[int, torch.Tensor], key_multiple: int = 1
    ) -> dict[int, torch.Tensor]:
        """One packed pass: inputs[i] [n_i, D] appended to sequence i. Outputs per sequence."""
        steps = []
        for index, x in inputs.items():
            table = self.tables[index]
            self.blocks.extend(table, x.shape[0])
            steps.append(SequenceStep(self.blocks.slots(table), x.shape[0]))
        positions, attention = plan_step(self.pool, steps, key_multiple)
        out = self.flow_lm.backbone(torch.cat(list(inputs.values())), positions, attention)
        return dict(zip(inputs, out.split([x.shape[0] for x in inputs.values()]), strict=True))

    def kv(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.read(self.blocks.slots(self.tables[index]))


def assert_scattered(blocks: BlockManager, table: PageTable) -> None:
    pages = table.pages
    assert any(b != a + 1 for a, b in zip(pages, pages[1:], strict=False)), pages


@pytest.mark.parametrize("with_history", [False, True])
def test_packed_prefill_equals_separate_prefills(
    tiny_model: LoadedModel, tiny_voice: Voice, with_history: bool
) -> None:
    flow_lm = tiny_model.model.flow_lm
    dim = flow_lm.dim
    lengths = [1, 5, 12, 30]
    prompts = [embeddings(n, dim, seed=i) for i, n in enumerate(lengths)]
    history = tiny_voice if with_history else None

    alone = []
    for prompt in prompts:
        seq = Contiguous(flow_lm, history)
        alone.append((seq.step(prompt), seq))

    # Packed on plain contiguous ranges of one pool (no paging involved)...
    pool = new_pool(flow_lm, 512)
    steps, start = [], 0
    base = tiny_voice.length if with_history else 0
    ranges = []
    for prompt in prompts:
        slots = torch.arange(start, start + base + prompt.shape[0])
        if with_history:
            pool.write(slots[:base], tiny_voice.keys, tiny_voice.values)
        steps.append(SequenceStep(slots, prompt.shape[0]))
        ranges.append(slots)
        start += len(slots) + 3  # gaps between sequences
    positions, attention = plan_step(pool, steps)
    with torch.no_grad():
        packed = flow_lm.backbone(torch.cat(prompts), positions, attention)
    assert packed.shape[0] == sum(lengths)
    for (out, seq), got, slots in zip(alone, packed.split(lengths), ranges, strict=True):
        torch.testing.assert_close(got, out, **TOL)
        keys, values = pool.read(slots)
        ref_keys, ref_values = seq.kv()
        torch.testing.assert_close(keys, ref_keys, **TOL)
        torch.testing.assert_close(values, ref_values, **TOL)

    # ...and on scattered pages.
    paged = Paged(flow_lm, num_pages=64, page_size=5, seed=1)
    for prompt in prompts:
        paged.add(history, base + prompt.shape[0])
    outs = paged.step(dict(enumerate(prompts)))
    for index, (out, seq) in enumerate(alone):
        torch.testing.assert_close(outs[index], out, **TOL)
        for got, ref in zip(paged.kv(index), seq.kv(), strict=True):
            torch.testing.assert_close(got, ref, **TOL)


def test_packed_prefill_is_not_trivially_equal(tiny_model: LoadedModel) -> None:
    """Guard for the test above: sequences packed into one pass really must not see each other."""
    flow_lm = tiny_model.model.flow_lm
    a, b = embeddings(6, flow_lm.dim, 10), embeddings(6, flow_lm.dim, 11)
    alone = Contiguous(flow_lm, None).step(b)
    joined = Contiguous(flow_lm, None).step(torch.cat([a, b]))[6:]  # b attending to a
    assert not torch.allclose(alone, joined, **TOL)


def test_scattered_pages_equal_contiguous_slots(tiny_model: LoadedModel, tiny_voice: Voice) -> None:
    flow_lm = tiny_model.model.flow_lm
    dim = flow_lm.dim
    prompt = embeddings(11, dim, seed=3)
    decode = [embeddings(1, dim, seed=100 + i) for i in range(8)]
    final = tiny_voice.length + prompt.shape[0] + len(decode)

    ref = Contiguous(flow_lm, tiny_voice)
    paged = Paged(flow_lm, num_pages=40, page_size=7, seed=2)
    index = paged.add(tiny_voice, final)
    torch.testing.assert_close(paged.step({index: prompt})[index], ref.step(prompt), **TOL)
    for x in decode:
        torch.testing.assert_close(paged.step({index: x})[index], ref.step(x), **TOL)
    assert_scattered(paged.blocks, paged.tables[index])
    for got, want in zip(paged.kv(index), ref.kv(), strict=True):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("key_multiple", [1, 4])
def test_batch_of_sequences_of_different_lengths(
    tiny_model: LoadedModel, tiny_voice: Voice, key_multiple: int
) -> None:
    """Prefill packed, then decode steps batched with padding; pages interleave across sequences.

    key_multiple rounds the keys a decode step reads up to whole pages (the engine's batch buckets),
    so rows also read masked slots past their end.
    """
    flow_lm = tiny_model.model.flow_lm
    dim = flow_lm.dim
    lengths = [3, 17, 8, 1]
    histories = [tiny_voice, None, tiny_voice, tiny_voice]
    steps = 7
    prompts = [embeddings(n, dim, seed=20 + i) for i, n in enumerate(lengths)]
    decode = [[embeddings(1, dim, seed=200 + 10 * i + t) for t in range(steps)] for i in lengths]

    refs = [Contiguous(flow_lm, h) for h in histories]
    paged = Paged(flow_lm, num_pages=80, page_size=4, seed=3)
    for h, n in zip(histories, lengths, strict=True):
        paged.add(h, (h.length if h else 0) + n + steps)

    outs = paged.step(dict(enumerate(prompts)))
    for i, ref in enumerate(refs):
        torch.testing.assert_close(outs[i], ref.step(prompts[i]), **TOL)
    for t in range(steps):
        # Sequence 1 skips a step now and then: batches change membership.
        members = [i for i in range(len(refs)) if not (i == 1 and t % 3 == 1)]
        outs = paged.step({i: decode[i][t] for i in members}, key_multiple)
        for i in members:
            torch.testing.assert_close(outs[i], refs[i].step(decode[i][t]), **TOL)
    for i, ref in enumerate(refs):
        assert_scattered(paged.blocks, paged.tables[i])
        for got, want in zip(paged.kv(i), ref.kv(), strict=True):
            torch.testing.assert_close(got, want, **TOL)
    # Slot 0 pads short rows of decode batches: it must hold somebody's data for this to matter.
    assert paged.blocks.ref_counts[0] > 0


def test_mixed_prefill_and_decode_in_one_step(tiny_model: LoadedModel, tiny_voice: Voice) -> None:
    flow_lm = tiny_model.model.flow_lm
    dim = flow_lm.dim
    a_prompt, b_prompt = embeddings(9, dim, 40), embeddings(5, dim, 41)
    a_next, b_more = embeddings(1, dim, 42), embeddings(1, dim, 43)
    ref_a, ref_b = Contiguous(flow_lm, tiny_voice), Contiguous(flow_lm, tiny_voice)
    paged = Paged(flow_lm, num_pages=40, page_size=6, seed=4)
    a = paged.add(tiny_voice, tiny_voice.length + 10)
    b = paged.add(tiny_voice, tiny_voice.length + 6)
    torch.testing.assert_close(paged.step({a: a_prompt})[a], ref_a.step(a_prompt), **TOL)
    outs = paged.step({a: a_next, b: b_prompt})  # a decodes while b prefills
    torch.testing.assert_close(outs[a], ref_a.step(a_next), **TOL)
    torch.testing.assert_close(outs[b], ref_b.step(b_prompt), **TOL)
    outs = paged.step({b: b_more})
    torch.testing.assert_close(outs[b], ref_b.step(b_more), **TOL)


@pytest.mark.parametrize("page_size", [7, 12, 16])
def test_shared_voice_prefix_and_private_copy_page(
    tiny_model: LoadedModel, tiny_voice: Voice, page_size: int
) -> None:
    """The engine's layout: voice pages shared by all, a partial last page copied per request."""
    model = tiny_model.model
    flow_lm = model.flow_lm
    dim = flow_lm.dim
    blocks = BlockManager(60, page_size)
    random.Random(page_size).shuffle(blocks.free_pages)
    runner = ModelRunner(model, blocks, 2, 1, torch.device("cpu"))
    voice_table = blocks.allocate(tiny_voice.length)
    runner.write_voice(voice_table, tiny_voice)
    voice_slots = blocks.slots(voice_table)
    voice_kv = [t.clone() for t in runner.pool.read(voice_slots)]
    torch.testing.assert_close(voice_kv[0], tiny_voice.keys)

    lengths = [4, 13, 7]
    steps = 5
    prompts = [embeddings(n, dim, 60 + i) for i, n in enumerate(lengths)]
    requests, refs = [], []
    for prompt in prompts:
        table, partial = blocks.share(voice_table)
        assert (partial is not None) == (tiny_voice.length % page_size != 0)
        final = tiny_voice.length + prompt.shape[0] + 1 + steps
        assert blocks.reserve(table, final, copy_partial=partial is not None)
        if partial is not None:
            runner.copy_page(partial, table.pages[-1], tiny_voice.length % page_size)
        requests.append(SimpleNamespace(table=table, prompt=prompt, eos_threshold=0.0))
        refs.append(Contiguous(flow_lm, tiny_voice))
    full_pages = voice_table.pages[: tiny_voice.length // page_size]
    assert all(blocks.ref_counts[p] == 1 + len(prompts) for p in full_pages)

    # Prefill through the runner (packed, each prompt followed by its first AR step's BOS
    # input), then compare each with its contiguous reference by reading its keys/values and
    # stepping both with the same decode inputs. The engine extends the page tables before a
    # step (the runner never changes page bookkeeping).
    for request in requests:
        blocks.extend(request.table, request.prompt.shape[0] + 1)
    noise = [torch.zeros(flow_lm.latent_dim)] * len(requests)
    latents, _ = runner.prefill(requests, noise)
    for request, ref, prompt, latent in zip(requests, refs, prompts, latents, strict=True):
        z = ref.step(torch.cat([prompt, runner.bos_input]))[-1:]
        torch.testing.assert_close(latent[None], flow_lm.sample_latent(z, noise[0][None], 1), **TOL)
        for got, want in zip(runner.pool.read(blocks.slots(request.table)), ref.kv(), strict=True):
            torch.testing.assert_close(got, want, **TOL)
    for t in range(steps):
        step = []
        for request in requests:
            blocks.extend(request.table, 1)
            step.append(SequenceStep(blocks.slots(request.table), 1))
        positions, attention = plan_step(runner.pool, step)
        xs = [embeddings(1, dim, 300 + 10 * i + t) for i in range(len(requests))]
        with torch.no_grad():
            outs = flow_lm.backbone(torch.cat(xs), positions, attention)
        for i, ref in enumerate(refs):
            torch.testing.assert_close(outs[i : i + 1], ref.step(xs[i]), **TOL)

    # Nobody wrote into the voice's own pages, the partial one included.
    for got, want in zip(runner.pool.read(voice_slots), voice_kv, strict=True):
        assert torch.equal(got, want)
    for request in requests:
        blocks.release(request.table)
    assert blocks.pages_in_use == len(voice_table.pages)
    assert all(blocks.ref_counts[p] == 1 for p in voice_table.pages)


# ---- the attention read path against the previous implementation


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@torch.no_grad()
def test_grouped_query_attention_equals_repeated_kv_heads(kv_heads: int) -> None:
    """KV with fewer heads than the queries: each group of query heads reads one KV head."""
    heads, dim, layers = 8, 16, 2
    gen = torch.Generator().manual_seed(kv_heads)
    pool = KVPool(layers, 96, kv_heads, dim)
    pool.keys.normal_(generator=gen)
    pool.values.normal_(generator=gen)
    order = torch.randperm(96, generator=gen)
    lengths, new = [9, 30, 2], [4, 11, 2]
    sequences = [order[start : start + n] for start, n in zip([0, 30, 70], lengths, strict=True)]
    for num_new in (new, [1, 1, 1]):
        steps = [SequenceStep(s, n) for s, n in zip(sequences, num_new, strict=True)]
        total = sum(num_new)
        for layer in range(layers):
            q = torch.randn(total, heads, dim, generator=gen)
            k, v = torch.randn(2, total, kv_heads, dim, generator=gen)
            old_pool = clone_pool(pool)
            _, attention = plan_step(pool, steps, key_multiple=4)
            got = attention.attend(layer, q, k, v)
            want = PaddedGatherAttention(old_pool, steps, key_multiple=4).attend(layer, q, k, v)
            assert got.shape == (total, heads, dim)
            assert_relative(got, want)
            assert torch.equal(pool.keys, old_pool.keys)
