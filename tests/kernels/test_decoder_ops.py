"""The CPU decoder's operators in C++ (engine/kernels/decoder_ops.cpp): each equals the torch
path it replaces, the ring attention reads only the slots a query may see, bad calls are refused,
and where no C++ compiler works the decoder keeps its torch path (the engine's switch,
`native_kernels`, is test_native_kernels.py's). That the whole decoder with them equals
`Mimi.decode`, eager and traced, is test_cpu_decoder.py's `native` cases."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from intone.engine.kernels import decoder_ops, native
from intone.engine.kernels.cpu_decoder import CpuDecoder, RingKV
from intone.engine.loading import LoadedModel


@pytest.fixture(scope="module")
def ops() -> None:
    if not decoder_ops.load():
        if native.cxx_compiler() is None:
            pytest.skip("no C++ compiler on this machine: the decoder runs in torch")
        pytest.fail("a C++ compiler is here, but decoder_ops.cpp did not build")


@pytest.mark.parametrize("history", [0, 2])
def test_elu_equals_torch_on_views_of_wider_buffers(ops: None, history: int) -> None:
    """Into the tail of a history buffer, from a view whose rows are further apart than they
    are long (a convolution's output), as the decoder calls it."""
    wide = torch.randn(3, 9, 40) * 4
    x = wide[:, :7]
    buffer = torch.full((3, history + 7, 40), float("nan"))
    out = decoder_ops.elu_into(x, buffer[:, history:], native=True)
    torch.testing.assert_close(out, F.elu(x), rtol=0, atol=2e-7)
    assert torch.equal(buffer[:, history:], out)
    assert buffer[:, :history].isnan().all()  # the history in front is not touched
    torch.testing.assert_close(
        decoder_ops.elu_into(x, torch.empty_like(x), native=False), F.elu(x), rtol=0, atol=2e-7
    )
    across = wide.transpose(1, 2)[:, :7]  # any other layout is read through a copy
    out = decoder_ops.elu_into(across, torch.empty(3, 7, 9), native=True)
    torch.testing.assert_close(out, F.elu(across), rtol=0, atol=2e-7)


def test_gelu_equals_torch(ops: None) -> None:
    x = torch.cat([torch.randn(4, 1000) * 5, torch.tensor([[0.0, -0.0, 1e-30, -1e-30] * 250])])
    torch.testing.assert_close(
        decoder_ops.gelu_tanh(x), F.gelu(x, approximate="tanh"), rtol=1e-6, atol=1e-6
    )
    half = x.bfloat16()  # other dtypes stay on torch's kernel
    assert torch.equal(decoder_ops.gelu_tanh(half), F.gelu(half, approximate="tanh"))


def reference_conv(
    x: torch.Tensor,
    history: torch.Tensor,
    weights: torch.Tensor,
    bias: torch.Tensor | None,
    dilation: int,
    elu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal convolution through torch's conv1d over [history, ELU(x)], and the history
    after it (that buffer's newest frames)."""
    buf = torch.cat([history, F.elu(x) if elu else x], dim=1)
    weight = weights.permute(2, 1, 0)  # [K, Cin, Cout] -> conv1d's [Cout, Cin, K]
    y = F.conv1d(buf.transpose(1, 2), weight, bias, dilation=dilation).transpose(1, 2)
    return y, buf[:, x.shape[1] :]


@pytest.mark.parametrize(
    ("cin", "cout", "taps", "dilation", "elu", "residual"),
    [
        (24, 12, 3, 1, True, False),  # the 2M SEANet's last residual block
        (12, 24, 1, 1, True, True),  # its second convolution, the residual added
        (48, 96, 2, 1, True, False),  # a transposed convolution's two taps
        (24, 1, 3, 1, True, False),  # the last layer: one output channel
        (7, 70, 3, 2, False, True),  # odd widths, a dilation, no ELU
        (5, 150, 2, 3, True, True),  # more output channels than one register block
    ],
)
def test_causal_conv_equals_torch_conv1d(
    ops: None, cin: int, cout: int, taps: int, dilation: int, elu: bool, residual: bool
) -> None:
    """On views as the decoder passes them: the input a slice of a wider buffer, the history
    rows of a larger pool; the history advances in place, over calls of any length."""
    gen = torch.Generator().manual_seed(cin * cout + taps)
    weights = torch.randn(taps, cin, cout, generator=gen) / cin**0.5
    bias = torch.randn(cout, generator=gen)
    frames = (taps - 1) * dilation
    pool = torch.randn(5, frames, cin, generator=gen)
    history, want_history = pool[1:4], pool[1:4].clone()
    others = pool[[0, 4]].clone()
    for steps in (37, 1, 20):
        wide = torch.randn(3, steps, cin + 4, generator=gen) * 3
        x = wide[..., :cin]
        res = torch.randn(3, steps, cout, generator=gen) if residual else None
        want, want_history = reference_conv(x, want_history, weights, bias, dilation, elu)
        if res is not None:
            want = want + res
        got = torch.ops.intone.causal_conv(
            x, history if frames else None, weights, bias, dilation, elu, res
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(history, want_history, rtol=0, atol=2e-7)
    assert torch.equal(pool[[0, 4]], others)  # the pool's other rows are not touched


def test_causal_conv_refuses_calls_that_do_not_fit(ops: None) -> None:
    conv = torch.ops.intone.causal_conv
    x, weights, history = torch.randn(2, 5, 4), torch.randn(3, 4, 6), torch.zeros(2, 2, 4)
    with pytest.raises(RuntimeError, match="history must be"):
        conv(x, None, weights, None, 1, True, None)
    with pytest.raises(RuntimeError, match="history must be"):
        conv(x, torch.zeros(2, 3, 4), weights, None, 1, True, None)
    with pytest.raises(RuntimeError, match=r"weights \[K, Cin, Cout\]"):
        conv(x, history, torch.randn(3, 5, 6), None, 1, True, None)
    with pytest.raises(RuntimeError, match="float32"):
        conv(x.double(), history, weights, None, 1, True, None)
    with pytest.raises(RuntimeError, match="bias"):
        conv(x, history, weights, torch.zeros(5), 1, True, None)
    with pytest.raises(RuntimeError, match="residual"):
        conv(x, history, weights, None, 1, True, torch.zeros(2, 5, 5))
    with pytest.raises(RuntimeError, match="dilation"):
        conv(x, history, weights, None, 0, True, None)
    assert torch.equal(history, torch.zeros(2, 2, 4))  # a refused call leaves it as it was


def ring_state(
    rows: int, size: int, heads: int, dim: int, filled: list[int], gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """One layer of `rows` rings of `size` slots, row r holding its last filled[r] positions."""
    state = {
        "t.0.keys": torch.randn(rows, size, heads, dim, generator=gen),
        "t.0.values": torch.randn(rows, size, heads, dim, generator=gen),
        "t.0.key_positions": torch.full((rows, size), -1, dtype=torch.long),
    }
    for row, count in enumerate(filled):
        positions = torch.arange(max(0, count - size), count)
        state["t.0.key_positions"][row, positions % size] = positions
    return state


@pytest.mark.parametrize(
    ("heads", "kv_heads", "steps"), [(4, 4, 16), (4, 2, 5), (2, 1, 40), (8, 8, 1)]
)
@pytest.mark.parametrize("pool_rows", [False, True])
def test_ring_attention_equals_the_masked_sdpa(
    ops: None, heads: int, kv_heads: int, steps: int, pool_rows: bool
) -> None:
    """Rows at different points of their streams (an empty ring, one shorter than the window,
    full rings), grouped-query heads, query blocks of 1, 5, 16 and 40 steps (past one block of
    16), and a batch that is rows of a larger pool by index (ROWS) or the pool itself."""
    gen = torch.Generator().manual_seed(7)
    context, dim = 12, 8
    size = context + 40 - 1
    filled = [0, 7, 30, 200, 13]
    state = ring_state(len(filled), size, kv_heads, dim, filled, gen)
    rows = torch.tensor([3, 0, 4, 2]) if pool_rows else torch.arange(len(filled))
    positions = torch.tensor(filled)[rows][:, None] + torch.arange(steps)
    q = torch.randn(len(rows), steps, heads, dim, generator=gen)
    k = torch.randn(len(rows), steps, kv_heads, dim, generator=gen)
    v = torch.randn(len(rows), steps, kv_heads, dim, generator=gen)
    outputs = []
    for use_ops in (False, True):
        layer = {name: tensor.clone() for name, tensor in state.items()}
        if pool_rows:
            layer["transformer.rows"] = rows
        outputs.append(RingKV(layer, "t", context, positions, use_ops).attend(0, q, k, v))
    want, got = outputs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_ring_attention_reads_only_the_slots_a_query_sees(ops: None) -> None:
    """NaN in every slot outside a row's window, or empty, changes nothing."""
    gen = torch.Generator().manual_seed(8)
    context, steps = 10, 3
    state = ring_state(2, 40, 2, 8, [35, 4], gen)
    keys, values, key_pos = state["t.0.keys"], state["t.0.values"], state["t.0.key_positions"]
    positions = torch.tensor([[35, 36, 37], [4, 5, 6]])
    q = torch.randn(2, steps, 2, 8, generator=gen)

    def attend() -> torch.Tensor:
        return torch.ops.intone.ring_attention(q, keys, values, key_pos, positions, None, context)

    clean = attend()
    lowest = positions[:, :1] - context + 1
    unseen = (key_pos < 0) | (key_pos < lowest) | (key_pos > positions[:, -1:])
    keys[unseen] = values[unseen] = float("nan")
    assert torch.equal(attend(), clean) and torch.isfinite(clean).all()


def test_ring_attention_refuses_calls_it_would_read_past(ops: None) -> None:
    keys = torch.randn(2, 8, 2, 4)
    key_pos = torch.zeros(2, 8, dtype=torch.long)
    q, positions = torch.randn(2, 3, 2, 4), torch.zeros(2, 3, dtype=torch.long)
    attend = torch.ops.intone.ring_attention
    with pytest.raises(RuntimeError, match="outside the pool"):
        attend(q, keys, keys, key_pos, positions, torch.tensor([0, 2]), 4)
    with pytest.raises(RuntimeError, match="rows must be int64"):
        attend(q, keys, keys, key_pos, positions, torch.tensor([0]), 4)
    with pytest.raises(RuntimeError, match="heads or dims"):
        attend(torch.randn(2, 3, 3, 4), keys, keys, key_pos, positions, None, 4)
    with pytest.raises(RuntimeError, match="float32"):
        attend(q, keys.double(), keys.double(), key_pos, positions, None, 4)
    with pytest.raises(RuntimeError, match="key_positions"):
        attend(q, keys, keys, key_pos[:, :4], positions, None, 4)
    with pytest.raises(RuntimeError, match="positions must be"):
        attend(q, keys, keys, key_pos, positions[:, :2], None, 4)
    with pytest.raises(RuntimeError, match="context"):
        attend(q, keys, keys, key_pos, positions, None, 0)
    with pytest.raises(RuntimeError, match="contiguous"):
        attend(
            q, keys.transpose(1, 2).contiguous().transpose(1, 2), keys, key_pos, positions, None, 4
        )
    with pytest.raises(RuntimeError, match="must match"):
        torch.ops.intone.elu_into(torch.randn(2, 3, 4), torch.empty(2, 3, 5))
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.intone.elu_into(torch.randn(2, 3, 4), torch.empty(2, 4, 3).transpose(1, 2))


@torch.no_grad()
def test_the_traced_decoder_replays_the_operators(ops: None, tiny_model: LoadedModel) -> None:
    """A trace records the operators like aten's own (a call the tracer left out would replay
    its first output as a constant), so later traced calls equal eager ones bit for bit."""
    mimi = tiny_model.model.mimi
    traced, eager = (CpuDecoder(mimi, native_ops=True, trace_after=t) for t in (1, None))
    assert traced.native and eager.native
    states = [decoder.init_decoder_state(2) for decoder in (traced, eager)]
    gen = torch.Generator().manual_seed(9)
    for frames in (3, 1, 2):
        latents = torch.randn(2, frames, mimi.quantizer.output_proj.in_channels, generator=gen)
        got, want = (d.decode(latents, s) for d, s in zip((traced, eager), states, strict=True))
        assert torch.equal(got, want), frames
    assert len(traced.traces) == 2


def copied_source(tmp_path: Path, name: str) -> Path:
    """A fresh path: `native.load_torch_library` caches its answer per source path."""
    (tmp_path / name).mkdir()
    return Path(shutil.copy(decoder_ops.SOURCE, tmp_path / name / decoder_ops.SOURCE.name))


def test_no_cxx_compiler_means_the_torch_decoder(
    monkeypatch, tmp_path: Path, caplog: pytest.LogCaptureFixture, tiny_model: LoadedModel
) -> None:
    monkeypatch.setenv("INTONE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with caplog.at_level(logging.WARNING, logger="intone.engine.kernels.native"):
        source = copied_source(tmp_path, "src")
        assert native.load_torch_library(source, decoder_ops.HEADERS) is False
    assert "runs in torch" in caplog.text
    monkeypatch.setattr(decoder_ops, "load", lambda: False)
    decoder = CpuDecoder(tiny_model.model.mimi, native_ops=True)
    assert not decoder.native
    layer = decoder.transformer.transformer.layers[0]
    assert layer.activation is not decoder_ops.gelu_tanh
