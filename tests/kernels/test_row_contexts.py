"""The engine's decode attention over each AR row's dense context (`RowContexts`) against the
model's own read path, both ways a step attends: torch over views of the contexts, and
row_attention's operators (the engine's default on a CPU, where a C++ compiler works).
"""

from __future__ import annotations

import random

import pytest
import torch

from intone.engine.block_manager import BlockManager
from intone.engine.config import ROW_CONTEXT_FAULT_IN_POSITIONS
from intone.engine.kernels import native, row_attention
from intone.engine.kernels.row_contexts import RowContexts, plan_row_context_step
from intone.engine.loading import LoadedModel, load_model
from intone.engine.model_runner import ModelRunner
from intone.engine.models.pocket.kv_cache import KVPool, SequenceStep
from intone.engine.voices import Voice, load_voice

from support.attention import (
    PaddedGatherAttention,
    assert_relative,
    check_step,
    clone_pool,
    embeddings,
)


@pytest.fixture(params=["torch", "native"])
def native_attention(request) -> bool:
    """Each check runs both ways a step attends: torch over views of the contexts, and
    row_attention's operators (the engine's default on a CPU, where a C++ compiler works)."""
    if request.param == "torch":
        return False
    if not row_attention.load():
        if native.cxx_compiler() is None:
            pytest.skip("no C++ compiler on this machine: the engine attends in torch")
        pytest.fail("a C++ compiler is here, but row_attention.cpp did not build")
    return True


@torch.no_grad()
def check_row_context_step(
    flow_lm,
    contexts: RowContexts,
    steps: list[SequenceStep],
    owners: list[object | None],
    x: torch.Tensor,
    key_multiple: int = 1,
    native: bool = False,
) -> None:
    """A decode step through the dense contexts equals it through the previous path, row for
    row, and
    writes the same keys and values to the pool. Padding rows (owner None) are dropped: in
    the previous path they all read the one scratch slot, whoever wrote it last."""
    old_pool = clone_pool(contexts.pool)
    order, positions, attention = plan_row_context_step(
        contexts, steps, owners, key_multiple, native
    )
    got = flow_lm.backbone(x[order], positions, attention)
    old_positions = torch.tensor([len(s.slots) - 1 for s in steps])
    want = flow_lm.backbone(x, old_positions, PaddedGatherAttention(old_pool, steps, key_multiple))
    rows = [i for i, row in enumerate(order) if owners[row] is not None]
    assert_relative(got[rows], want[[order[i] for i in rows]])
    assert_relative(contexts.pool.keys, old_pool.keys)
    assert_relative(contexts.pool.values, old_pool.values)


@pytest.mark.parametrize("checkpoint", ["tiny", "full"])
def test_attention_equals_previous_path(
    checkpoint: str,
    tiny_model: LoadedModel,
    tiny_voice: Voice,
    native_attention: bool,
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
    # Decode steps through the dense contexts, as the engine runs them: rows skip steps and come
    # back in another order (contexts move), share a step with bucket padding rows, retry after a
    # failed step, and take a step elsewhere (their context goes stale: they re-seat from the
    # pool).
    contexts = RowContexts(runner.pool)
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
            _, _, failed = plan_row_context_step(contexts, steps, owners, native=native_attention)
            tf = flow_lm.transformer
            k = torch.randn(len(steps), tf.num_kv_heads, tf.head_dim)
            failed.attend(0, torch.randn(len(steps), tf.num_heads, tf.head_dim), k, k)
        multiple = page_size if t == 3 else 1
        check_row_context_step(flow_lm, contexts, steps, owners, x, multiple, native_attention)
        if t == 4:
            blocks.extend(tables[1], 1)
            x = embeddings(1, flow_lm.dim, seed=700)
            check_step(flow_lm, runner.pool, [SequenceStep(blocks.slots(tables[1]), 1)], x)


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@torch.no_grad()
def test_row_contexts_with_grouped_query_attention(kv_heads: int, native_attention: bool) -> None:
    """Decode through the dense contexts with fewer KV heads than query heads equals the previous
    path."""
    heads, dim, layers = 8, 16, 2
    gen = torch.Generator().manual_seed(10 + kv_heads)
    pool = KVPool(layers, 96, kv_heads, dim)
    pool.keys.normal_(generator=gen)
    pool.values.normal_(generator=gen)
    order = torch.randperm(96, generator=gen)
    steps = [
        SequenceStep(order[a : a + n], 1) for a, n in zip([0, 30, 70], [9, 30, 2], strict=True)
    ]
    contexts = RowContexts(pool)
    for layer in range(layers):
        q = torch.randn(len(steps), heads, dim, generator=gen)
        k, v = torch.randn(2, len(steps), kv_heads, dim, generator=gen)
        old_pool = clone_pool(pool)
        rows, _, attention = plan_row_context_step(
            contexts, steps, list(steps), native=native_attention
        )
        got = attention.attend(layer, q[rows], k[rows], v[rows])
        want = PaddedGatherAttention(old_pool, steps).attend(layer, q, k, v)
        assert_relative(got, want[rows])
        assert torch.equal(pool.keys, old_pool.keys)


@pytest.mark.parametrize("kv_heads", [2, 8])
@torch.no_grad()
def test_float16_contexts_attend_over_their_rounded_keys_and_values(
    kv_heads: int, native_attention: bool
) -> None:
    """Contexts in float16 (the CPU fast path's) hold the pool's keys and values rounded to it,
    the pool stays float32, and a step over them gives the float32 step over those rounded
    values, both ways a step attends; they take half the memory."""
    heads, dim, layers = 8, 64, 2
    gen = torch.Generator().manual_seed(20 + kv_heads)
    pool = KVPool(layers, 96, kv_heads, dim)
    pool.keys.normal_(generator=gen)
    pool.values.normal_(generator=gen)
    rounded = clone_pool(pool)
    rounded.keys.copy_(pool.keys.half())
    rounded.values.copy_(pool.values.half())
    order = torch.randperm(96, generator=gen)
    steps = [
        SequenceStep(order[a : a + n], 1) for a, n in zip([0, 30, 70], [9, 30, 2], strict=True)
    ]
    half, exact = RowContexts(pool, dtype=torch.float16), RowContexts(rounded)
    for layer in range(layers):
        q = torch.randn(len(steps), heads, dim, generator=gen)
        k, v = torch.randn(2, len(steps), kv_heads, dim, generator=gen)
        native = native_attention
        rows, _, attention = plan_row_context_step(half, steps, list(steps), native=native)
        want_rows, _, want_attention = plan_row_context_step(exact, steps, list(steps))
        assert rows == want_rows
        got = attention.attend(layer, q[rows], k[rows], v[rows])
        want = want_attention.attend(layer, q[rows], k[rows].half().float(), v[rows].half().float())
        assert_relative(got, want, rtol=1e-6)
        for row in rows:  # the pool keeps the new keys exactly
            assert torch.equal(pool.keys[layer, :, steps[row].slots[-1]], k[row])
    assert half.keys.dtype == torch.float16
    assert half.nbytes * 2 == exact.nbytes


@torch.no_grad()
def test_reserved_contexts_stay_put_and_hide_memory_never_written(native_attention: bool) -> None:
    """Contexts reserved for every row do not move when a step has more rows or longer contexts
    than any before (a move zeroed and copied every one while the step waited); memory of the
    reservation never written (here NaN) is zeroed before a step reads it; a context past the
    reservation grows it and still equals the previous path."""
    heads, dim, layers = 4, 16, 2
    gen = torch.Generator().manual_seed(3)
    pool = KVPool(layers, 400, 2, dim)
    pool.keys.normal_(generator=gen)
    pool.values.normal_(generator=gen)
    contexts = RowContexts(pool, rows=4, capacity=128)
    contexts.keys.fill_(float("nan"))
    contexts.values.fill_(float("nan"))
    reserved = contexts.keys.data_ptr()
    order = torch.randperm(400, generator=gen)

    def step(lengths: list[int]) -> None:
        steps = [SequenceStep(order[i * 80 : i * 80 + n], 1) for i, n in enumerate(lengths)]
        q = torch.randn(len(steps), heads, dim, generator=gen)
        k, v = torch.randn(2, len(steps), 2, dim, generator=gen)
        old_pool = clone_pool(pool)
        rows, _, attention = plan_row_context_step(
            contexts, steps, list(steps), native=native_attention
        )
        got = attention.attend(0, q[rows], k[rows], v[rows])
        want = PaddedGatherAttention(old_pool, steps).attend(0, q, k, v)
        assert torch.isfinite(got).all()
        assert_relative(got, want[rows])

    step([5])
    step([9, 70, 3, 40])  # more rows, longer contexts: same memory
    assert contexts.keys.data_ptr() == reserved and contexts.capacity == 128
    # A step reads every context as far as its longest row (71 positions): zeroed in runs of 64.
    assert contexts.clean == [128] * 4 and contexts.nbytes == 2 * 2 * layers * dim * 4 * 512
    step([12, 150])  # past the reservation: it grows, once, to twice the positions
    assert contexts.capacity == 256 and contexts.keys.shape[1] == 4


@pytest.mark.parametrize(("rows", "capacity"), [(2, 1024), (64, 64)])
def test_the_reservation_is_bounded_by_the_pool(
    tiny_model: LoadedModel, rows: int, capacity: int
) -> None:
    """Every row is reserved ROW_CONTEXT_POSITIONS positions, unless that passes
    ROW_CONTEXT_POOL_MULTIPLE times the pool's positions (a reservation past the machine's memory
    is refused): then fewer, in runs of 64."""
    blocks = BlockManager(160, 8)  # 1,288 pool positions with the scratch page
    runner = ModelRunner(tiny_model.model, blocks, rows, 1, torch.device("cpu"))
    contexts = runner.row_contexts
    assert contexts.keys.shape[1] == rows and contexts.capacity == capacity
    # Written (faulted in) at start as far as ROW_CONTEXT_FAULT_IN_POSITIONS, or the whole capacity.
    assert contexts.clean == [min(capacity, ROW_CONTEXT_FAULT_IN_POSITIONS)] * rows
    assert not contexts.keys[:, :, :, : contexts.clean[0]].any()
    runner.close()
