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
from torch.nn import functional as F

from intone.engine import native
from intone.engine.block_manager import BlockManager, PageTable
from intone.engine.config import LANE_PREFAULT_POSITIONS
from intone.engine.loading import LoadedModel, load_model
from intone.engine.model_runner import ModelRunner
from intone.engine.models.pocket import lane_ops
from intone.engine.models.pocket.kv_cache import (
    KVLanes,
    KVPool,
    SequenceStep,
    plan_lane_step,
    plan_step,
)
from intone.engine.voices import Voice, load_voice

TOL = dict(rtol=1e-4, atol=1e-5)


def new_pool(flow_lm, num_slots: int) -> KVPool:
    tf = flow_lm.transformer
    return KVPool(flow_lm.num_layers, num_slots, tf.num_kv_heads, tf.head_dim)


def embeddings(n: int, dim: int, seed: int) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


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


@pytest.fixture(params=["torch", "native"])
def native_lanes(request) -> bool:
    """Each decode-through-lanes check runs both ways a step attends: torch over views of the
    lanes, and lane_ops' operators (the engine's default on a CPU, where a C++ compiler works)."""
    if request.param == "torch":
        return False
    if not lane_ops.load():
        if native.cxx_compiler() is None:
            pytest.skip("no C++ compiler on this machine: the engine attends in torch")
        pytest.fail("a C++ compiler is here, but lane_ops.cpp did not build")
    return True


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


class PaddedGatherAttention:
    """The previous read path, kept as the reference: every layer gathers each row's context
    into a padded [G, L, H, D] copy and runs SDPA under a dense mask (block-diagonal over the
    whole packed pass for prefill). KV heads are repeated for grouped-query attention."""

    def __init__(self, pool: KVPool, steps: list[SequenceStep], key_multiple: int = 1):
        self.pool = pool
        lengths = [len(s.slots) for s in steps]
        pairs = zip(steps, lengths, strict=True)
        positions = torch.cat([torch.arange(n - s.num_new, n) for s, n in pairs])
        self.write_slots = torch.cat([s.slots[len(s.slots) - s.num_new :] for s in steps])
        if all(s.num_new == 1 for s in steps):
            longest = -(-max(lengths) // key_multiple) * key_multiple
            self.read_slots = torch.zeros(len(steps), longest, dtype=torch.long)
            for row, s in enumerate(steps):
                self.read_slots[row, : len(s.slots)] = s.slots
            mask = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
            self.mask = mask[:, None, None, :]
        else:
            self.read_slots = torch.cat([s.slots for s in steps])[None, :]
            key_seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
            key_pos = torch.cat([torch.arange(n) for n in lengths])
            query_seq = torch.cat([torch.full((s.num_new,), i) for i, s in enumerate(steps)])
            mask = (query_seq[:, None] == key_seq[None, :]) & (
                key_pos[None, :] <= positions[:, None]
            )
            self.mask = mask[None, None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Slot-major views [S, H, D] of the head-major pool, as the previous path read it.
        keys, values = (
            self.pool.keys[layer].transpose(0, 1),
            self.pool.values[layer].transpose(0, 1),
        )
        keys.index_copy_(0, self.write_slots, k)
        values.index_copy_(0, self.write_slots, v)
        groups = self.read_slots.shape[0]
        n, heads, dim = q.shape
        repeat = heads // keys.shape[1]
        q = q.view(groups, n // groups, heads, dim).transpose(1, 2)
        k_ctx = keys[self.read_slots].repeat_interleave(repeat, dim=2).transpose(1, 2)
        v_ctx = values[self.read_slots].repeat_interleave(repeat, dim=2).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k_ctx, v_ctx, attn_mask=self.mask)
        return out.transpose(1, 2).reshape(n, heads, dim)


def clone_pool(pool: KVPool) -> KVPool:
    copy = KVPool.__new__(KVPool)
    copy.keys, copy.values = pool.keys.clone(), pool.values.clone()
    return copy


def assert_relative(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    error = float((got - want).norm() / want.norm())
    assert error <= rtol, f"relative error {error:.2e}"


@torch.no_grad()
def check_step(
    flow_lm, pool: KVPool, steps: list[SequenceStep], x: torch.Tensor, key_multiple: int = 1
) -> None:
    """The backbone through plan_step equals it through the previous path, and both write the
    same keys and values; the pool then holds the step (as the engine's would)."""
    old_pool = clone_pool(pool)
    positions, attention = plan_step(pool, steps, key_multiple)
    got = flow_lm.backbone(x, positions, attention)
    want = flow_lm.backbone(x, positions, PaddedGatherAttention(old_pool, steps, key_multiple))
    assert_relative(got, want)
    assert_relative(pool.keys, old_pool.keys)
    assert_relative(pool.values, old_pool.values)


@torch.no_grad()
def check_lane_step(
    flow_lm,
    lanes: KVLanes,
    steps: list[SequenceStep],
    owners: list[object | None],
    x: torch.Tensor,
    key_multiple: int = 1,
    native: bool = False,
) -> None:
    """A decode step through the lanes equals it through the previous path, row for row, and
    writes the same keys and values to the pool. Padding rows (owner None) are dropped: in
    the previous path they all read the one scratch slot, whoever wrote it last."""
    old_pool = clone_pool(lanes.pool)
    order, positions, attention = plan_lane_step(lanes, steps, owners, key_multiple, native)
    got = flow_lm.backbone(x[order], positions, attention)
    old_positions = torch.tensor([len(s.slots) - 1 for s in steps])
    want = flow_lm.backbone(x, old_positions, PaddedGatherAttention(old_pool, steps, key_multiple))
    rows = [lane for lane, row in enumerate(order) if owners[row] is not None]
    assert_relative(got[rows], want[[order[lane] for lane in rows]])
    assert_relative(lanes.pool.keys, old_pool.keys)
    assert_relative(lanes.pool.values, old_pool.values)


@pytest.mark.parametrize("checkpoint", ["tiny", "full"])
def test_attention_equals_previous_path(
    checkpoint: str,
    tiny_model: LoadedModel,
    tiny_voice: Voice,
    native_lanes: bool,
    request,
) -> None:
    """Shared voice pages with a private copy of the partial last page, packed prefill of mixed
    lengths, then decode steps of changing membership, exact and page-rounded (bucket) keys."""
    if checkpoint == "full":
        full = request.getfixturevalue("full_checkpoint")
        model = load_model(full).model
        voice = load_voice(model, "default", full / "voices" / "default.wav")
    else:
        model, voice = tiny_model.model, tiny_voice
    flow_lm = model.flow_lm
    page_size = 8
    blocks = BlockManager(160, page_size)
    random.Random(7).shuffle(blocks.free_pages)
    runner = ModelRunner(model, blocks, 2, 1, torch.device("cpu"))
    voice_table = blocks.allocate(voice.length)
    runner.write_voice(voice_table, voice)
    lengths = [3, 17, 8, 1] if checkpoint == "tiny" else [5, 12]
    decode_steps = 6
    tables = []
    for n in lengths:
        table, partial = blocks.share(voice_table)
        assert blocks.reserve(
            table, voice.length + n + decode_steps, copy_partial=partial is not None
        )
        if partial is not None:
            runner.copy_page(partial, table.pages[-1], voice.length % page_size)
        tables.append(table)
    steps = []
    for table, n in zip(tables, lengths, strict=True):
        blocks.extend(table, n)
        steps.append(SequenceStep(blocks.slots(table), n))
    x = embeddings(sum(lengths), flow_lm.dim, seed=500)
    check_step(flow_lm, runner.pool, steps, x)
    # Decode steps through the lanes, as the engine runs them: rows skip steps and come back
    # in another order (lanes move), share a step with bucket padding rows, retry after a
    # failed step, and take a step elsewhere (their lane goes stale: they re-seat from the pool).
    lanes = KVLanes(runner.pool)
    scratch = SequenceStep(torch.tensor([blocks.num_pages * page_size]), 1)
    everyone = list(range(len(tables)))
    schedule = [everyone, [everyone[-1], 0], everyone, everyone[::-1], everyone[:1] + everyone[2:]]
    for t, members in enumerate([*schedule, everyone]):
        steps = []
        for i in members:
            blocks.extend(tables[i], 1)
            steps.append(SequenceStep(blocks.slots(tables[i]), 1))
        owners: list[object | None] = [tables[i] for i in members]
        if t == 3:
            steps, owners = steps + [scratch] * 2, owners + [None, None]
        x = embeddings(len(steps), flow_lm.dim, seed=600 + t)
        if t == 2:
            # A step that fails after writing part of its position: the retry re-seats.
            _, _, failed = plan_lane_step(lanes, steps, owners, native=native_lanes)
            tf = flow_lm.transformer
            k = torch.randn(len(steps), tf.num_kv_heads, tf.head_dim)
            failed.attend(0, torch.randn(len(steps), tf.num_heads, tf.head_dim), k, k)
        multiple = page_size if t == 3 else 1
        check_lane_step(flow_lm, lanes, steps, owners, x, multiple, native_lanes)
        if t == 4:
            blocks.extend(tables[1], 1)
            x = embeddings(1, flow_lm.dim, seed=700)
            check_step(flow_lm, runner.pool, [SequenceStep(blocks.slots(tables[1]), 1)], x)


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


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@torch.no_grad()
def test_lanes_with_grouped_query_attention(kv_heads: int, native_lanes: bool) -> None:
    """Decode through the lanes with fewer KV heads than query heads equals the previous path."""
    heads, dim, layers = 8, 16, 2
    gen = torch.Generator().manual_seed(10 + kv_heads)
    pool = KVPool(layers, 96, kv_heads, dim)
    pool.keys.normal_(generator=gen)
    pool.values.normal_(generator=gen)
    order = torch.randperm(96, generator=gen)
    steps = [
        SequenceStep(order[a : a + n], 1) for a, n in zip([0, 30, 70], [9, 30, 2], strict=True)
    ]
    lanes = KVLanes(pool)
    for layer in range(layers):
        q = torch.randn(len(steps), heads, dim, generator=gen)
        k, v = torch.randn(2, len(steps), kv_heads, dim, generator=gen)
        old_pool = clone_pool(pool)
        rows, _, attention = plan_lane_step(lanes, steps, list(steps), native=native_lanes)
        got = attention.attend(layer, q[rows], k[rows], v[rows])
        want = PaddedGatherAttention(old_pool, steps).attend(layer, q, k, v)
        assert_relative(got, want[rows])
        assert torch.equal(pool.keys, old_pool.keys)


@torch.no_grad()
def test_reserved_lanes_stay_put_and_hide_memory_never_written(
    native_lanes: bool,
) -> None:
    """Lanes reserved for every row do not move when a step has more rows or longer contexts
    than any before (a move zeroed and copied every lane while the step waited); memory of the
    reservation never written (here NaN) is zeroed before a step reads it; a context past the
    reservation grows it and still equals the previous path."""
    heads, dim, layers = 4, 16, 2
    gen = torch.Generator().manual_seed(3)
    pool = KVPool(layers, 400, 2, dim)
    pool.keys.normal_(generator=gen)
    pool.values.normal_(generator=gen)
    lanes = KVLanes(pool, rows=4, capacity=128)
    lanes.keys.fill_(float("nan"))
    lanes.values.fill_(float("nan"))
    reserved = lanes.keys.data_ptr()
    order = torch.randperm(400, generator=gen)

    def step(lengths: list[int]) -> None:
        steps = [SequenceStep(order[i * 80 : i * 80 + n], 1) for i, n in enumerate(lengths)]
        q = torch.randn(len(steps), heads, dim, generator=gen)
        k, v = torch.randn(2, len(steps), 2, dim, generator=gen)
        old_pool = clone_pool(pool)
        rows, _, attention = plan_lane_step(lanes, steps, list(steps), native=native_lanes)
        got = attention.attend(0, q[rows], k[rows], v[rows])
        want = PaddedGatherAttention(old_pool, steps).attend(0, q, k, v)
        assert torch.isfinite(got).all()
        assert_relative(got, want[rows])

    step([5])
    step([9, 70, 3, 40])  # more rows, longer contexts: same memory
    assert lanes.keys.data_ptr() == reserved and lanes.capacity == 128
    # A step reads every lane as far as its longest row (71 positions): zeroed in runs of 64.
    assert lanes.clean == [128] * 4 and lanes.nbytes == 2 * 2 * layers * dim * 4 * 512
    step([12, 150])  # past the reservation: it grows, once, to twice the positions
    assert lanes.capacity == 256 and lanes.keys.shape[1] == 4


@pytest.mark.parametrize(("rows", "capacity"), [(2, 1024), (64, 64)])
def test_the_lanes_reservation_is_bounded_by_the_pool(
    tiny_model: LoadedModel, rows: int, capacity: int
) -> None:
    """Every row is reserved LANE_POSITIONS positions, unless that passes LANE_POOL_MULTIPLE
    times the pool's positions (a reservation past the machine's memory is refused): then
    fewer, in runs of 64."""
    blocks = BlockManager(160, 8)  # 1,288 pool positions with the scratch page
    runner = ModelRunner(tiny_model.model, blocks, rows, 1, torch.device("cpu"))
    assert runner.lanes.keys.shape[1] == rows and runner.lanes.capacity == capacity
    # Written (faulted in) at start as far as LANE_PREFAULT_POSITIONS, or the whole capacity.
    assert runner.lanes.clean == [min(capacity, LANE_PREFAULT_POSITIONS)] * rows
    assert not runner.lanes.keys[:, :, :, : runner.lanes.clean[0]].any()
    runner.close()
