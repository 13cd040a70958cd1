"""The engine's Mimi decoder on a CPU (`CpuDecoder`) against `Mimi.decode`, eager and traced, in
torch and with decoder_ops' operators, alone and through the engine's runner."""

from __future__ import annotations

import pytest
import torch

from intone.engine import Engine, EngineConfig
from intone.engine.decoder_states import DecoderStatePool
from intone.engine.kernels import bf16, decoder_ops
from intone.engine.kernels.cpu_decoder import (
    BF16_CONV_MIN_CHANNELS,
    SEANET_GROUP_VALUES,
    CpuDecoder,
    winograd_matrices,
)
from intone.engine.kernels.traces import TraceCache
from intone.engine.loading import LoadedModel, load_model
from intone.engine.models.pocket.conv import State


def decode_in_calls(decoder, latents: torch.Tensor, frames_per_call: list[int]) -> torch.Tensor:
    state = decoder.init_decoder_state(latents.shape[0])
    audio, start = [], 0
    for frames in frames_per_call:
        audio.append(decoder.decode(latents[:, start : start + frames], state))
        start += frames
    return torch.cat(audio, dim=-1)


@pytest.mark.parametrize("checkpoint", ["tiny", "full"])
@pytest.mark.parametrize("group_values", [SEANET_GROUP_VALUES, 1])
@pytest.mark.parametrize("native", [False, True])
@torch.no_grad()
def test_cpu_decoder_equals_mimi(
    checkpoint: str, group_values: int, native: bool, tiny_model: LoadedModel, request
):
    """The engine's CPU decoder computes Mimi.decode: calls of 1 to 6 frames (past its 4-frame
    ring), 20 frames in all (past the transformer's 250-step window); with the SEANet on the
    whole batch at once and on one row at a time (each row's histories advance in place); in
    torch and with decoder_ops' operators."""
    if checkpoint == "full":
        model = load_model(request.getfixturevalue("full_checkpoint")).model
    else:
        model = tiny_model.model
    mimi = model.mimi
    latents = torch.randn(3, 20, mimi.quantizer.output_proj.in_channels)
    calls = [1, 2, 6, 4, 3, 1, 3]
    want = decode_in_calls(mimi, latents, calls)
    decoder = CpuDecoder(mimi, seanet_group_values=group_values, native_ops=native)
    assert decoder.native == (native and decoder_ops.load())
    got = decode_in_calls(decoder, latents, calls)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.skipif(not bf16.packs(torch.zeros(1)), reason="oneDNN does not run bf16 here")
@torch.no_grad()
def test_bf16_convs_are_the_widest_layers_and_stay_close(full_checkpoint):
    """With `bf16_convs`, the full-size decoder's convolutions at least `BF16_CONV_MIN_CHANNELS`
    wide on both sides of their GEMMs (and only those) run as one bf16 GEMM each; the audio stays
    within bf16's rounding of `Mimi.decode`, over calls of 1 to 6 frames."""
    mimi = load_model(full_checkpoint).model.mimi
    decoder = CpuDecoder(mimi, bf16_convs=True, native_ops=True)
    float32 = CpuDecoder(mimi, native_ops=True)
    assert float32.bf16_convs == [] and len(decoder.bf16_convs) == 3
    for conv in decoder.bf16_convs:
        assert min(conv.weights.shape[1:]) >= BF16_CONV_MIN_CHANNELS and conv.tile == 1
    latents = torch.randn(3, 20, mimi.quantizer.output_proj.in_channels)
    calls = [1, 2, 6, 4, 3, 1, 3]
    want = decode_in_calls(mimi, latents, calls)
    got = decode_in_calls(decoder, latents, calls)
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < 2e-3, rel  # bf16's 8-bit mantissa in three layers: close, not exact


@pytest.mark.parametrize(("tile", "kernel"), [(4, 2), (4, 3), (4, 7), (2, 3)])
def test_winograd_matrices_compute_the_correlation(tile: int, kernel: int):
    """F(m, K) over n = m + K - 1 inputs gives y[p] = sum_k w[k] x[p + k] for every p < m, up to
    the float32 rounding of its matrices (the decoder's full-size layers rely on it; the tiny
    checkpoint is too narrow to use it)."""
    output_transform, weight_transform, input_transform = (
        a.double() for a in winograd_matrices(tile, kernel)
    )
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(kernel, dtype=torch.float64, generator=gen)
    x = torch.randn(tile + kernel - 1, dtype=torch.float64, generator=gen)
    y = output_transform @ ((weight_transform @ w) * (input_transform @ x))
    want = torch.stack([(w * x[p : p + kernel]).sum() for p in range(tile)])
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("native", [False, True])
@torch.no_grad()
def test_cpu_decoder_rows_with_different_histories(
    tiny_model: LoadedModel, int8: bool, native: bool
):
    """Rows of a state pool (the engine's layout: conv histories gathered and scattered, the
    attention rings read and written in place) at different points decode as they would alone.

    int8 quantizes each call's activations with one scale for the batch, so there a row's
    rounding depends on its batch-mates: its audio is equal within the fast path's order of
    error instead, and its transformer keys (raw int8 products) are not compared.
    """
    mimi = tiny_model.model.mimi
    decoder = CpuDecoder(mimi, int8=int8, native_ops=native)
    assert decoder.int8 == int8
    rtol = 1e-3 if int8 else 1e-5
    pool = DecoderStatePool(decoder, 4, torch.device("cpu"))
    assert pool.in_place and all(name.startswith("transformer.") for name in pool.in_place)
    gen = torch.Generator().manual_seed(2)
    slots = [pool.acquire() for _ in range(3)]
    alone = {}
    for slot, frames in zip(slots, (3, 0, 20), strict=True):
        index = torch.tensor([slot])
        alone[slot] = decoder.init_decoder_state(1)
        for _ in range(frames):
            latent = torch.randn(1, 1, 32, generator=gen)
            state = pool.gather(index)
            pool_audio = decoder.decode(latent, state)
            pool.scatter(index, state)
            torch.testing.assert_close(pool_audio, decoder.decode(latent, alone[slot]))
    index = torch.tensor(slots[::-1])
    batch_state = pool.gather(index)
    latents = torch.randn(3, 2, 32, generator=gen)
    batched = decoder.decode(latents, batch_state)
    pool.scatter(index, batch_state)
    for row, slot in enumerate(slots[::-1]):
        single = decoder.decode(latents[row : row + 1], alone[slot])
        atol = rtol * single.abs().max().item()
        torch.testing.assert_close(batched[row : row + 1], single, rtol=rtol, atol=atol)
        for name, tensor in alone[slot].items():
            if int8 and name.startswith("transformer."):
                continue
            scale = rtol * max(1.0, tensor.abs().max().item()) if tensor.numel() else 0.0
            got = pool.rows[name][slot : slot + 1]
            torch.testing.assert_close(got, tensor, rtol=rtol, atol=scale)


@torch.no_grad()
def test_engine_decode_calls_equal_mimi_per_row(tiny_checkpoint):
    """ModelRunner.decode (float32) on unsorted subsets of its rows, a run of slots among them:
    each row's audio is Mimi.decode of that row's own history."""
    loaded = load_model(tiny_checkpoint)
    engine = Engine(loaded, EngineConfig(dtype="float32", torch_threads=0, max_active=8))
    try:
        runner, mimi = engine.runner, loaded.model.mimi
        slots = [runner.decoder_states.acquire() for _ in range(8)]
        alone = {slot: mimi.init_decoder_state(1) for slot in slots}
        order = [5, 2, 7, 0, 3, 1, 6, 4]
        gen = torch.Generator().manual_seed(0)
        for step in range(5):
            rows = [slots[i] for i in order[: 8 - step % 3]]
            latents = torch.randn(len(rows), 2, 32, generator=gen)
            got = runner.decode(rows, latents)
            for j, slot in enumerate(rows):
                z = loaded.model.flow_lm.denormalize(latents[j : j + 1])
                want = mimi.decode(z, alone[slot])[0, 0]
                torch.testing.assert_close(got[j], want, rtol=1e-5, atol=1e-5 * want.abs().max())
    finally:
        engine.close()


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("group_values", [SEANET_GROUP_VALUES, 1 << 14])
@pytest.mark.parametrize("native", [False, True])
@torch.no_grad()
def test_traced_decoder_replays_the_eager_decoder_exactly(
    tiny_model: LoadedModel, int8: bool, group_values: int, native: bool
):
    """The traced decoder gives the eager one's audio and histories bit for bit, on calls whose
    shapes differ from the call each trace was made on: 1 to 9 rows, 1 to 6 frames, rows of a
    pool in one run (views) or scattered (gathered), and detached rows; with the SEANet in one
    group and in groups of a few rows (the last one shorter). Traced on a key's first call,
    and on its third (the first two eager)."""
    mimi = tiny_model.model.mimi
    decoders = [
        CpuDecoder(
            mimi,
            int8=int8,
            seanet_group_values=group_values,
            trace_after=trace_after,
            native_ops=native,
        )
        for trace_after in (None, 1, 3)
    ]
    pools = [DecoderStatePool(decoder, 12, torch.device("cpu")) for decoder in decoders]
    for pool in pools:
        for _ in range(12):
            pool.acquire()
    gen = torch.Generator().manual_seed(4)
    calls = [
        ("run", [0], 1),  # a trace made on one row, then calls of more
        ("run", [3, 4], 1),
        ("run", [0], 2),
        ("scattered", [1, 5, 6, 11], 1),
        ("run", list(range(2, 11)), 3),
        ("detached", [0, 1, 2], 4),
        ("scattered", [0, 7, 9], 6),
        ("run", [5, 6, 7, 8, 9], 1),
        ("scattered", [2, 4, 6, 8, 10, 11], 2),
        ("detached", [0], 1),
        ("run", [11], 1),
    ]
    for kind, rows, frames in calls:
        latents = torch.randn(len(rows), frames, 32, generator=gen)
        audio = []
        for decoder, pool in zip(decoders, pools, strict=True):
            if kind == "detached":
                state = pool.detached([None] * len(rows))
                audio.append(decoder.decode(latents, state))
                continue
            index = torch.tensor(rows)
            state = pool.gather(index)
            audio.append(decoder.decode(latents, state))
            pool.scatter(index, state)
        for other in audio[1:]:
            assert torch.equal(other, audio[0]), (kind, rows, frames)
    for pool in pools[1:]:
        for name, tensor in pools[0].rows.items():
            assert torch.equal(pool.rows[name], tensor), name
    first_call, third_call = (decoder.traces for decoder in decoders[1:])
    assert first_call is not None and third_call is not None
    # One trace per part and kind of state, whatever the rows and frames: the transformer part
    # on pool rows in place and gathered, and the SEANet.
    assert len(first_call) == len(third_call) == 3


@pytest.mark.parametrize("bf16_convs", [False, True])
@torch.no_grad()
def test_one_trace_serves_every_frame_count(full_checkpoint, bf16_convs: bool):
    """The full-size decoder, whose wide convolutions run as Winograd (or as bf16 GEMMs, their
    packed weights buffers of the SEANet's trace): traces made on a call of one row and one
    frame replay calls of 1 to 3 rows and 1 to 4 frames bit for bit, so the engine makes one
    trace per part, not one per shape (each trace is a stall of up to a second while it is
    made)."""
    mimi = load_model(full_checkpoint).model.mimi
    # The engine's decoder: decoder_ops' operators where they build.
    traced = CpuDecoder(mimi, trace_after=1, native_ops=True, bf16_convs=bf16_convs)
    assert traced.winograd_rates, "the full-size decoder should have Winograd layers"
    if bf16_convs and bf16.packs(torch.zeros(1)):
        assert traced.bf16_convs
    eager = CpuDecoder(mimi, native_ops=True, bf16_convs=bf16_convs)
    states = [decoder.init_decoder_state(3) for decoder in (traced, eager)]
    gen = torch.Generator().manual_seed(5)
    for rows, frames in ((1, 1), (1, 3), (2, 2), (3, 4), (1, 4), (3, 1)):
        latents = torch.randn(rows, frames, mimi.quantizer.output_proj.in_channels, generator=gen)
        got, want = (
            decoder.decode(latents, {name: entry[:rows] for name, entry in state.items()})
            for decoder, state in zip((traced, eager), states, strict=True)
        )
        assert torch.equal(got, want), (rows, frames)
    assert len(traced.traces) == 2  # the transformer part and the SEANet


def test_prepare_traces_makes_every_trace_the_engine_calls(tiny_checkpoint):
    """After `Engine.prepare_traces`, none of the engine's kinds of decode call makes a trace
    (with `trace_after=1` an unprepared kind would make one at once): rows in one run
    of slots, scattered slots and detached rows, of any count and frames; nor does its AR step
    (tests/kernels/test_step_trace.py). Calling it again makes nothing new."""
    engine = Engine(load_model(tiny_checkpoint), EngineConfig(trace_after=1))
    runner = engine.runner
    try:
        engine.prepare_traces()
        traces = runner.decoder.traces
        assert len(traces) == 3  # the transformer part in place and gathered, and the SEANet
        assert runner.ar_traces is not None and len(runner.ar_traces) == 3  # step, pass, both
        slots = [runner.decoder_states.acquire() for _ in range(5)]
        latent_dim = runner.flow_lm.latent_dim
        for chosen, frames in ((slots[1:4], 2), ([slots[0], slots[3]], 1), (slots, 4)):
            audio = runner.decode(chosen, torch.randn(len(chosen), frames, latent_dim))
            assert audio.shape == (len(chosen), frames * runner.decoder.samples_per_frame)
        runner.decode_detached(torch.randn(1, 1, latent_dim), [None])
        engine.prepare_traces()
        assert len(traces) == 3 and len(runner.ar_traces) == 3
    finally:
        engine.close()


def test_engine_decoder_traces_as_configured(tiny_checkpoint):
    """`EngineConfig.trace_after` reaches the CPU decoder and the AR step; None keeps them
    eager, and a count under 1 is refused."""
    with pytest.raises(ValueError, match="trace_after"):
        EngineConfig(trace_after=0).validate()
    loaded = load_model(tiny_checkpoint)
    for trace_after in (None, 5):
        engine = Engine(loaded, EngineConfig(torch_threads=0, trace_after=trace_after))
        try:
            traces = engine.runner.decoder.traces
            assert (traces is None) == (trace_after is None)
            assert traces is None or traces.trace_after == 5
            ar_traces = engine.runner.ar_traces
            native = engine.runner.native_row_attention  # eager in torch without it
            assert (ar_traces is None) == (trace_after is None or not native)
            assert ar_traces is None or ar_traces.trace_after == 5
        finally:
            engine.close()


def test_a_shape_whose_trace_fails_stays_eager():
    """A call whose trace raises fails as an eager call would, and later calls of its key run
    eagerly instead of failing the same way; other keys still trace."""
    calls: list[int] = []

    def double(x: torch.Tensor, state: State) -> torch.Tensor:
        calls.append(x.shape[0])
        if torch.jit.is_tracing() and x.shape[0] == 3:
            raise RuntimeError("the tracer cannot follow this")
        return x * state["scale"]

    cache = TraceCache(trace_after=1)
    state = {"scale": torch.tensor(2.0)}
    with pytest.raises(RuntimeError, match="cannot follow"):
        cache("k", double, torch.ones(3), state)
    assert len(cache) == 0
    for _ in range(2):
        torch.testing.assert_close(cache("k", double, torch.ones(3), state), torch.full((3,), 2.0))
    assert calls == [3, 3, 3]  # eager both times: no second trace
    torch.testing.assert_close(cache("other", double, torch.ones(2), state), torch.full((2,), 2.0))
    torch.testing.assert_close(cache("other", double, torch.ones(5), state), torch.full((5,), 2.0))
    assert len(cache) == 1 and calls == [3, 3, 3, 2]  # traced once, then replayed
