"""C kernels built on this machine (engine/native.py) and the decode attention in C
(engine/models/pocket/lane_kernel.py): the cache, the fallback to torch where nothing builds,
and the checks that keep a bad call from reading past the lanes. That the kernel equals the
torch path is tests/models/test_paged_attention.py's `lane_kernel` cases."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from intone.engine import Engine, EngineConfig, native
from intone.engine.loading import load_model
from intone.engine.models.pocket import decoder_ops
from intone.engine.models.pocket.lane_kernel import SOURCE, LaneKernel, load_lane_kernel

needs_compiler = pytest.mark.skipif(
    native.compiler() is None, reason="no C compiler on this machine: the engine attends in torch"
)


@pytest.fixture
def kernel_cache(monkeypatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("INTONE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


def copied_source(tmp_path: Path, name: str) -> Path:
    """A fresh path: `native.build` caches its answer per source path for the process."""
    (tmp_path / name).mkdir()
    return Path(shutil.copy(SOURCE, tmp_path / name / SOURCE.name))


@needs_compiler
def test_a_build_is_cached_by_source_and_reused(kernel_cache: Path, tmp_path: Path) -> None:
    library = native.build(copied_source(tmp_path, "first"))
    assert library is not None and hasattr(library, "lane_attention")
    (built,) = kernel_cache.iterdir()  # no temporary file left beside it
    stamp = built.stat().st_mtime_ns
    assert native.build(copied_source(tmp_path, "second")) is not None
    assert list(kernel_cache.iterdir()) == [built] and built.stat().st_mtime_ns == stamp
    changed = copied_source(tmp_path, "changed")
    changed.write_text(changed.read_text() + "\n/* another source */\n")
    assert native.build(changed) is not None
    assert len(list(kernel_cache.iterdir())) == 2


def test_no_compiler_means_torch(
    kernel_cache: Path, tmp_path: Path, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger="intone.engine.native"):
        assert native.build(copied_source(tmp_path, "src")) is None
    assert "runs in torch" in caplog.text
    assert not kernel_cache.exists()


@needs_compiler
def test_a_source_that_does_not_compile_means_torch(
    kernel_cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = tmp_path / "broken.c"
    source.write_text("int lane_attention(void) { return }\n")
    with caplog.at_level(logging.WARNING, logger="intone.engine.native"):
        assert native.build(source) is None
    assert "failed to compile" in caplog.text
    assert list(kernel_cache.iterdir()) == []  # the partial outputs are gone


@pytest.fixture
def kernel() -> LaneKernel:
    built = load_lane_kernel()
    if built is None:
        pytest.skip("no C compiler on this machine: the engine attends in torch")
    return built


def lanes(rows: int = 3, heads: int = 2, capacity: int = 8, dim: int = 16):
    keys = torch.randn(rows, heads, capacity, dim)
    return keys, torch.randn_like(keys)


def test_the_kernel_reads_no_further_than_each_row(kernel: LaneKernel) -> None:
    """Positions past a row's length are never read: NaN there changes nothing."""
    keys, values = lanes()
    q = torch.randn(3, 4, 16)
    lengths = torch.tensor([1, 5, 8])
    clean = kernel(q, keys, values, lengths)
    for row, n in enumerate(lengths.tolist()):
        keys[row, :, n:] = values[row, :, n:] = float("nan")
    assert torch.equal(kernel(q, keys, values, lengths), clean)
    assert torch.isfinite(clean).all()
    # One position: the output is that position's value, whatever the query.
    torch.testing.assert_close(clean[0].view(2, 2, 16), values[0, :, :1].expand(2, 2, 16))


@pytest.mark.parametrize(
    ("lengths", "error"),
    [
        (torch.tensor([1, 0, 3]), ValueError),  # a row reads at least its own position
        (torch.tensor([1, 9, 3]), ValueError),  # past the lanes' capacity
        (torch.tensor([1, 2]), ValueError),  # one length per row
        (torch.tensor([1, 2, 3], dtype=torch.int32), ValueError),
    ],
)
def test_the_kernel_refuses_bounds_it_would_read_past(
    kernel: LaneKernel, lengths: torch.Tensor, error: type[Exception]
) -> None:
    keys, values = lanes()
    with pytest.raises(error):
        kernel(torch.randn(3, 4, 16), keys, values, lengths)


def test_the_kernel_refuses_other_layouts(kernel: LaneKernel) -> None:
    keys, values = lanes()
    q, lengths = torch.randn(3, 4, 16), torch.tensor([1, 2, 3])
    with pytest.raises(TypeError):
        kernel(q, keys.bfloat16(), values.bfloat16(), lengths)
    with pytest.raises(ValueError):  # positions not `dim` apart
        kernel(q, keys.transpose(2, 3).contiguous().transpose(2, 3), values, lengths)
    with pytest.raises(ValueError):  # more rows than lanes
        kernel(torch.randn(4, 4, 16), keys, values, torch.tensor([1, 2, 3, 4]))
    with pytest.raises(ValueError):  # query heads not a multiple of the KV heads
        kernel(torch.randn(3, 3, 16), keys, values, lengths)


def test_native_kernels_is_the_switch(tiny_checkpoint: Path) -> None:
    """On by default on a CPU where a compiler works: the AR attention kernel and the decoder's
    operators; False keeps torch's paths for both."""
    loaded = load_model(tiny_checkpoint)
    for enabled in (True, False):
        engine = Engine(loaded, EngineConfig(native_kernels=enabled))
        try:
            expected = enabled and native.compiler() is not None
            assert (engine.runner.lane_kernel is not None) == expected
            expected = enabled and native.cxx_compiler() is not None
            assert engine.runner.decoder.native == expected
        finally:
            engine.close()
    # The model's own decoder transformer keeps torch's GELU: the operator is on a copy.
    for layer in loaded.model.mimi.decoder_transformer.transformer.layers:
        assert layer.activation is not decoder_ops.gelu_tanh


def test_store_writes_each_row_where_its_offset_says(kernel: LaneKernel) -> None:
    pool = torch.zeros(2, 10, 16)  # [heads, slots, D] of one layer
    new = torch.randn(3, 2, 16)
    kernel.store(new, pool, torch.tensor([7, 0, 4]) * 16)
    for row, slot in enumerate([7, 0, 4]):
        assert torch.equal(pool[:, slot], new[row])
    assert int((pool.abs().sum(-1) > 0).sum()) == 6


@pytest.mark.parametrize("offset", [-16, 9 * 16 + 1, 10 * 16])
def test_store_refuses_offsets_past_its_target(kernel: LaneKernel, offset: int) -> None:
    pool = torch.zeros(2, 10, 16)
    with pytest.raises(ValueError):
        kernel.store(torch.randn(1, 2, 16), pool, torch.tensor([offset]))
    assert not pool.any()


@needs_compiler
def test_a_damaged_cache_file_means_torch_and_a_rebuild(
    kernel_cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A cached library that does not load is deleted, the engine attends in torch, and the
    next start builds it again. (Built in another process: this one never loaded the file,
    which the dynamic loader would hand back again whatever the file holds now.)"""
    source = copied_source(tmp_path, "first")
    build = "import sys; from pathlib import Path; from intone.engine import native; "
    build += "native.build(Path(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", build, str(source)], check=True, timeout=120)
    (built,) = kernel_cache.iterdir()
    built.write_bytes(b"not a shared library")
    with caplog.at_level(logging.WARNING, logger="intone.engine.native"):
        assert native.build(copied_source(tmp_path, "second")) is None
    assert "does not load" in caplog.text and not built.exists()
    assert native.build(copied_source(tmp_path, "third")) is not None
