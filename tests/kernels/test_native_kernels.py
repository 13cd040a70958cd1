"""Native operators built on this machine (engine/kernels/native.py) and the decode attention over
each AR row's dense context as torch operators (engine/kernels/row_attention.py): the cache, the
fallback to torch where nothing builds, and the checks that keep a bad call from reading past the
contexts. That the operators equal the torch path is tests/kernels/test_row_contexts.py's
`native_attention` cases."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from intone.engine import Engine, EngineConfig
from intone.engine.kernels import decoder_ops, native, row_attention
from intone.engine.loading import load_model

needs_compiler = pytest.mark.skipif(
    native.cxx_compiler() is None, reason="no C++ compiler on this machine: torch runs instead"
)

# A library with a shared header, small enough to build in well under a second: the cache does
# not depend on what the source registers (torch's headers alone take seconds to compile).
SOURCE = '#include "answer.h"\nextern "C" int answer(void) { return ANSWER; }\n'
HEADER = "#define ANSWER 42\n"


@pytest.fixture
def kernel_cache(monkeypatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("INTONE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


def small_library(
    tmp_path: Path, name: str, source: str = SOURCE, header: str = HEADER
) -> tuple[Path, tuple[Path, ...]]:
    """Fresh paths (`native.load_torch_library` caches its answer per path for the process) of
    a source and the header it includes."""
    (tmp_path / name).mkdir()
    (tmp_path / name / "answer.h").write_text(header)
    (tmp_path / name / "answer.cpp").write_text(source)
    return tmp_path / name / "answer.cpp", (tmp_path / name / "answer.h",)


@needs_compiler
def test_a_build_is_cached_by_source_and_headers_and_reused(
    kernel_cache: Path, tmp_path: Path
) -> None:
    assert native.load_torch_library(*small_library(tmp_path, "first"))
    (built,) = kernel_cache.iterdir()  # no temporary file left beside it
    stamp = built.stat().st_mtime_ns
    assert native.load_torch_library(*small_library(tmp_path, "second"))
    assert list(kernel_cache.iterdir()) == [built] and built.stat().st_mtime_ns == stamp
    changed = SOURCE + "/* another source */\n"
    assert native.load_torch_library(*small_library(tmp_path, "changed", source=changed))
    assert len(list(kernel_cache.iterdir())) == 2
    header = "#define ANSWER 43\n"
    assert native.load_torch_library(*small_library(tmp_path, "header", header=header))
    assert len(list(kernel_cache.iterdir())) == 3


def test_no_compiler_means_torch(
    kernel_cache: Path, tmp_path: Path, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with caplog.at_level(logging.WARNING, logger="intone.engine.kernels.native"):
        assert not native.load_torch_library(*small_library(tmp_path, "src"))
    assert "runs in torch" in caplog.text
    assert not kernel_cache.exists()


@needs_compiler
def test_a_source_that_does_not_compile_means_torch(
    kernel_cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = small_library(tmp_path, "broken", source='extern "C" int answer(void) { return }\n')
    with caplog.at_level(logging.WARNING, logger="intone.engine.kernels.native"):
        assert not native.load_torch_library(*broken)
    assert "failed to compile" in caplog.text
    assert list(kernel_cache.iterdir()) == []  # the partial outputs are gone


@pytest.fixture(scope="module")
def ops() -> None:
    if not row_attention.load():
        if native.cxx_compiler() is None:
            pytest.skip("no C++ compiler on this machine: the engine attends in torch")
        pytest.fail("a C++ compiler is here, but row_attention.cpp did not build")


def row_contexts(rows: int = 3, heads: int = 2, capacity: int = 8, dim: int = 16):
    keys = torch.randn(rows, heads, capacity, dim)
    return keys, torch.randn_like(keys)


def test_the_kernel_reads_no_further_than_each_row(ops: None) -> None:
    """Positions past a row's length are never read: NaN there changes nothing."""
    keys, values = row_contexts()
    q = torch.randn(3, 4, 16)
    lengths = torch.tensor([1, 5, 8])
    clean = row_attention.attend(q, keys, values, lengths)
    for row, n in enumerate(lengths.tolist()):
        keys[row, :, n:] = values[row, :, n:] = float("nan")
    assert torch.equal(row_attention.attend(q, keys, values, lengths), clean)
    assert torch.isfinite(clean).all()
    # One position: the output is that position's value, whatever the query.
    torch.testing.assert_close(clean[0].view(2, 2, 16), values[0, :, :1].expand(2, 2, 16))


@pytest.mark.parametrize(
    ("lengths", "error"),
    [
        (torch.tensor([1, 0, 3]), ValueError),  # a row reads at least its own position
        (torch.tensor([1, 9, 3]), ValueError),  # past the contexts' capacity
        (torch.tensor([1, 2]), ValueError),  # one length per row
        (torch.tensor([1, 2, 3], dtype=torch.int32), ValueError),
    ],
)
def test_the_kernel_refuses_bounds_it_would_read_past(
    ops: None, lengths: torch.Tensor, error: type[Exception]
) -> None:
    keys, values = row_contexts()
    with pytest.raises(error):
        row_attention.attend(torch.randn(3, 4, 16), keys, values, lengths)


def test_the_kernel_refuses_other_layouts(ops: None) -> None:
    keys, values = row_contexts()
    q, lengths = torch.randn(3, 4, 16), torch.tensor([1, 2, 3])
    with pytest.raises(TypeError):
        row_attention.attend(q, keys.bfloat16(), values.bfloat16(), lengths)
    with pytest.raises(ValueError):  # positions not `dim` apart
        row_attention.attend(q, keys.transpose(2, 3).contiguous().transpose(2, 3), values, lengths)
    with pytest.raises(ValueError):  # more rows than contexts
        row_attention.attend(torch.randn(4, 4, 16), keys, values, torch.tensor([1, 2, 3, 4]))
    with pytest.raises(ValueError):  # query heads not a multiple of the KV heads
        row_attention.attend(torch.randn(3, 3, 16), keys, values, lengths)


def test_the_kernel_reads_float16_contexts_as_their_values(ops: None) -> None:
    """Over float16 contexts the kernel gives what it gives over the same values in float32, and
    refuses a head size its vector loop does not cover."""
    gen = torch.Generator().manual_seed(3)
    for heads, kv_heads, dim in ((4, 2, 64), (2, 2, 128)):
        keys, values = torch.randn(2, 5, kv_heads, 40, dim, generator=gen).half()
        q = torch.randn(5, heads, dim, generator=gen)
        lengths = torch.tensor([1, 40, 17, 3, 33])
        got = row_attention.attend(q, keys, values, lengths)
        want = row_attention.attend(q, keys.float(), values.float(), lengths)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    keys = torch.randn(1, 1, 4, 12).half()
    with pytest.raises(ValueError, match="head size"):
        row_attention.attend(torch.randn(1, 1, 12), keys, keys, torch.tensor([2]))
    with pytest.raises(TypeError):
        row_attention.attend(torch.randn(1, 1, 12), keys, keys.float(), torch.tensor([2]))


def test_store_rounds_into_float16_as_torch_does(ops: None) -> None:
    contexts = torch.zeros(3, 2, 10, 64, dtype=torch.float16)
    new = torch.randn(2, 2, 64) * 100
    # Context 1's position 3, context 0's position 7.
    offsets = torch.tensor([1 * 2 * 10 * 64 + 3 * 64, 7 * 64])
    row_attention.store(new, contexts, offsets)
    assert torch.equal(contexts[1, :, 3], new[0].half())
    assert torch.equal(contexts[0, :, 7], new[1].half())
    assert int((contexts != 0).sum()) == int((new.half() != 0).sum())


def test_native_kernels_is_the_switch(tiny_checkpoint: Path) -> None:
    """On by default on a CPU where a C++ compiler works: the AR attention's operators, the
    decoder's and the int8 FlowLM's GELU; False keeps torch's paths for all."""
    loaded = load_model(tiny_checkpoint)
    for enabled in (True, False):
        engine = Engine(loaded, EngineConfig(native_kernels=enabled))
        try:
            expected = enabled and native.cxx_compiler() is not None
            assert engine.runner.native_row_attention == expected
            assert engine.runner.decoder.native == expected
            layers = engine.model.flow_lm.transformer.layers
            assert all((layer.activation is decoder_ops.gelu_tanh) == expected for layer in layers)
        finally:
            engine.close()
    # The model's own transformers keep torch's GELU: the operator is on copies.
    for layer in loaded.model.mimi.decoder_transformer.transformer.layers:
        assert layer.activation is not decoder_ops.gelu_tanh
    for layer in loaded.model.flow_lm.transformer.layers:
        assert layer.activation is not decoder_ops.gelu_tanh


def test_store_writes_each_row_where_its_offset_says(ops: None) -> None:
    pool = torch.zeros(2, 10, 16)  # [heads, slots, D] of one layer
    new = torch.randn(3, 2, 16)
    row_attention.store(new, pool, torch.tensor([7, 0, 4]) * 16)
    for row, slot in enumerate([7, 0, 4]):
        assert torch.equal(pool[:, slot], new[row])
    assert int((pool.abs().sum(-1) > 0).sum()) == 6


@pytest.mark.parametrize("offset", [-16, 9 * 16 + 1, 10 * 16])
def test_store_refuses_offsets_past_its_target(ops: None, offset: int) -> None:
    pool = torch.zeros(2, 10, 16)
    with pytest.raises(ValueError):
        row_attention.store(torch.randn(1, 2, 16), pool, torch.tensor([offset]))
    assert not pool.any()


@needs_compiler
def test_a_damaged_cache_file_means_torch_and_a_rebuild(
    kernel_cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A cached library that does not load is deleted, the engine runs torch's path, and the
    next start builds it again. (Built in another process: this one never loaded the file,
    which the dynamic loader would hand back again whatever the file holds now.)"""
    source, headers = small_library(tmp_path, "first")
    build = "import sys; from pathlib import Path; from intone.engine.kernels import native; "
    build += "native.load_torch_library(Path(sys.argv[1]), (Path(sys.argv[2]),))"
    subprocess.run(
        [sys.executable, "-c", build, str(source), str(headers[0])], check=True, timeout=120
    )
    (built,) = kernel_cache.iterdir()
    built.write_bytes(b"not a shared library")
    with caplog.at_level(logging.WARNING, logger="intone.engine.kernels.native"):
        assert not native.load_torch_library(*small_library(tmp_path, "second"))
    assert "does not load" in caplog.text and not built.exists()
    assert native.load_torch_library(*small_library(tmp_path, "third"))
