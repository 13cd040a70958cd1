"""The engine's reduced-precision paths against float32: the default (`dtype="auto"`, the fastest
configuration for this CPU, engine/precision.py) and `dtype="bfloat16"` with torch's threads
halved between the two stages, as the benchmark's `batched-fast` runs it.

Reduced precision can't hold the float32 equivalence tolerance (1e-4 relative,
tests/models/test_oracle.py), so the fast path has its own, against the float32 single-request
path on the same request (same seed, same noise, EOS off so the lengths match):

- relative RMS error of the waveform:           ||fast - fp32|| / ||fp32|| <= 5e-3
- per-frame log-spectral distance (1920-sample frames, Hann window, dB): mean <= 0.5, max <= 1.5

Measured on the generated checkpoints (random weights) against the fp32 single path: the default
on a CPU (int8 linear layers in the FlowLM and decoder transformers) 2.5e-4 relative RMS and
0.10 dB mean / 0.20 dB worst frame at temperature 0.3, 5.6e-4 and 0.34 / 0.51 dB at 0 (full
size; with the AR rows' contexts in float16, four streams in a batch: 2.9-3.2e-4 and <= 0.14 dB
mean at 0.3, 5.4-6.7e-4 and <= 0.40 / 0.50 dB at 0; with oneDNN's int8 on a Xeon with AMX,
2.2e-4 and <= 0.10 dB mean at 0.3, 3.9-4.1e-4 and <= 0.25 / 0.38 dB at 0); 2e-5 to 5e-5 and
<= 0.16 dB (tiny, both families); `dtype="bfloat16"` (bf16 FlowLM) 9.4e-5 and <= 0.08 dB (full
size, 0.3).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from intone.engine import Engine, EngineConfig, GenerationOptions
from intone.engine.generate import generate
from intone.engine.kernels import native
from intone.engine.kernels.bf16 import Bf16Linear, packs
from intone.engine.kernels.cpu_decoder import BF16_CONV_MIN_CHANNELS, CpuDecoder
from intone.engine.kernels.int8 import Int8Linear, kernel_for
from intone.engine.loading import LoadedModel, load_model
from intone.engine.precision import native_bf16, resolve_precision
from intone.engine.text import split_clauses
from intone.engine.voices import Voice, load_voice

REL_RMS_MAX = 5e-3
LSD_MEAN_MAX_DB = 0.5
LSD_FRAME_MAX_DB = 1.5
FRAME = 1920
TEXT = "I found two flights that leave tomorrow morning. The package should reach your door soon."


def log_spectral_distance(ours: np.ndarray, ref: np.ndarray, frame: int = FRAME) -> np.ndarray:
    """Per-frame RMS difference of the log-magnitude spectra, in dB."""
    window = np.hanning(frame)
    distances = []
    for i in range(len(ref) // frame):
        a = np.abs(np.fft.rfft(ours[i * frame : (i + 1) * frame] * window))
        b = np.abs(np.fft.rfft(ref[i * frame : (i + 1) * frame] * window))
        floor = 1e-5 * max(b.max(), 1e-8)  # -100 dB under the frame's peak
        diff = 20 * np.log10(a + floor) - 20 * np.log10(b + floor)
        distances.append(float(np.sqrt(np.mean(diff**2))))
    return np.array(distances)


# The bfloat16 configuration: the bf16 FlowLM, and torch's intra-op threads halved so the AR and
# decoder threads do not oversubscribe the cores (what bench/common.py's fast_engine_options
# gives `batched-fast` on a CPU; stated here so the tests do not import the benchmarks).
BFLOAT16_OPTIONS = {"dtype": "bfloat16", "torch_threads": max(1, (os.cpu_count() or 2) // 2)}


def config_options(config: str) -> dict:
    return {} if config == "default" else dict(BFLOAT16_OPTIONS)


def check_reduced_precision(engine: Engine) -> None:
    """The engine's modules are in the precision its `dtype` resolves to, and not all float32."""
    precision = resolve_precision(engine.config.dtype, engine.config.device)
    assert precision != resolve_precision("float32", "cpu"), "nothing in reduced precision"
    assert engine.model.flow_lm.transformer.dtype == precision.flow_lm
    int8 = any(isinstance(m, Int8Linear) for m in engine.model.flow_lm.transformer.modules())
    assert int8 == precision.flow_lm_int8
    assert engine.runner.decoder.int8 == precision.decoder_int8
    # The decoder's widest convolutions in bf16 where the policy says so and oneDNN runs bf16
    # (the tiny decoder has none that wide).
    decoder = engine.runner.decoder
    if isinstance(decoder, CpuDecoder):
        wide = [c for c in decoder.convs if min(c.weights.shape[1:]) >= BF16_CONV_MIN_CHANNELS]
        bf16_convs = precision.decoder_convs_bf16 and packs(torch.zeros(1))
        assert decoder.bf16_convs == (wide if bf16_convs else [])
    # The native decode attention reads float32 contexts; the bf16 KV pool attends in torch.
    native_attention = precision.flow_lm == torch.float32 and native.cxx_compiler() is not None
    assert engine.runner.native_row_attention == native_attention
    half = precision.half_row_contexts and native_attention
    contexts = engine.runner.row_contexts.keys.dtype
    assert contexts == (torch.float16 if half else precision.flow_lm)
    flow_head = engine.model.flow_lm.flow_net
    bf16 = any(isinstance(m, Bf16Linear) for m in flow_head.modules())
    assert bf16 == precision.flow_head_bf16
    if bf16:  # every linear layer of the head, none left in float32
        assert not any(isinstance(m, torch.nn.Linear) for m in flow_head.modules())


async def compare(
    checkpoint: Path, loaded: LoadedModel, voice: Voice, temperature: float, config: str
):
    options = GenerationOptions(temperature=temperature, eos_threshold=1e9, seed=7)
    clauses = split_clauses(loaded.tokenizer, TEXT)
    assert len(clauses) == 2  # clause chaining is part of what is compared
    ref = torch.cat(list(generate(loaded, voice, clauses, dataclasses.replace(options)))).numpy()
    threads = torch.get_num_threads()  # the fast options may set torch's process-wide count
    engine = Engine(load_model(checkpoint), EngineConfig(**config_options(config))).start()
    try:
        check_reduced_precision(engine)
        ours = await engine.synthesize(TEXT, options=dataclasses.replace(options))
    finally:
        engine.close()
        torch.set_num_threads(threads)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    rel = float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    lsd = log_spectral_distance(ours, ref)
    assert rel > 0, "the fast path gave bit-identical output: did it run in reduced precision?"
    assert rel <= REL_RMS_MAX, f"relative RMS error {rel:.2e} > {REL_RMS_MAX}"
    assert lsd.mean() <= LSD_MEAN_MAX_DB, f"mean log-spectral distance {lsd.mean():.3f} dB"
    assert lsd.max() <= LSD_FRAME_MAX_DB, f"worst frame {lsd.max():.3f} dB at {lsd.argmax()}"


@pytest.mark.parametrize("config", ["default", "bfloat16"])
@pytest.mark.parametrize("temperature", [0.0, 0.3])
async def test_fast_path_within_tolerance_tiny(
    tiny_checkpoint: Path,
    tiny_model: LoadedModel,
    tiny_voice: Voice,
    temperature: float,
    config: str,
):
    await compare(tiny_checkpoint, tiny_model, tiny_voice, temperature, config)


# At full size the default path is held to the tolerance four streams at a time (below); one
# stream alone, and clause chaining, at both temperatures are the tiny model's cases above.
@pytest.mark.full
async def test_bfloat16_path_within_tolerance_full(full_checkpoint: Path):
    loaded = load_model(full_checkpoint)
    voice = load_voice(loaded.model, "default", full_checkpoint / "voices" / "default.wav")
    await compare(full_checkpoint, loaded, voice, 0.3, "bfloat16")


BATCH_TEXTS = (
    "Your table is booked for tonight.",
    "I found two flights that leave tomorrow morning.",
    "The package should reach your door by Thursday afternoon.",
    "Please hold while I check that for you.",
)


async def compare_in_a_batch(checkpoint: Path, loaded: LoadedModel, voice: Voice, streams: int):
    """The default path's int8 activations are quantized per call, over every row of the batch,
    so a stream's rounding depends on its batch-mates: each of `streams` concurrent streams must
    still hold the tolerance against its own float32 single path."""
    jobs = [
        (BATCH_TEXTS[i % len(BATCH_TEXTS)], GenerationOptions(temperature=0.3, seed=40 + i))
        for i in range(streams)
    ]
    jobs = [(text, dataclasses.replace(options, eos_threshold=1e9)) for text, options in jobs]
    refs = [
        torch.cat(list(generate(loaded, voice, split_clauses(loaded.tokenizer, text), opts)))
        for text, opts in jobs
    ]
    threads = torch.get_num_threads()
    engine = Engine(load_model(checkpoint), EngineConfig(lead_s=None)).start()
    try:
        assert resolve_precision(engine.config.dtype, engine.config.device).flow_lm_int8
        check_reduced_precision(engine)
        outputs = await asyncio.gather(
            *[engine.synthesize(text, options=dataclasses.replace(opts)) for text, opts in jobs]
        )
        assert engine.metrics()["generate_batch_mean"] > 1, "the streams never shared a step"
    finally:
        engine.close()
        torch.set_num_threads(threads)
    for i, (ours, ref) in enumerate(zip(outputs, refs, strict=True)):
        ref = ref.numpy()
        assert ours.shape == ref.shape, f"stream {i}"
        rel = float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
        lsd = log_spectral_distance(ours, ref)
        assert rel <= REL_RMS_MAX, f"stream {i}: relative RMS error {rel:.2e}"
        assert lsd.mean() <= LSD_MEAN_MAX_DB, f"stream {i}: mean LSD {lsd.mean():.3f} dB"
        assert lsd.max() <= LSD_FRAME_MAX_DB, f"stream {i}: worst frame {lsd.max():.3f} dB"


async def test_default_path_within_tolerance_in_a_batch_tiny(
    tiny_checkpoint: Path, tiny_model: LoadedModel, tiny_voice: Voice
):
    await compare_in_a_batch(tiny_checkpoint, tiny_model, tiny_voice, streams=8)


@pytest.mark.full
async def test_default_path_within_tolerance_in_a_batch_full(full_checkpoint: Path):
    loaded = load_model(full_checkpoint)
    voice = load_voice(loaded.model, "default", full_checkpoint / "voices" / "default.wav")
    await compare_in_a_batch(full_checkpoint, loaded, voice, streams=4)


def test_float32_is_one_option_away():
    exact = resolve_precision("float32", "cpu")
    assert exact.flow_lm == torch.float32 and not exact.decoder_int8 and not exact.flow_lm_int8
    assert resolve_precision("auto", "cpu").flow_lm_int8  # fbgemm's int8 GEMMs are CPU-only
    assert not resolve_precision("auto", "cuda").flow_lm_int8
    assert not exact.flow_head_bf16
    assert not exact.half_row_contexts
    # The AR rows' dense contexts in float16 on the CPU's fast path (the pool stays float32).
    assert resolve_precision("auto", "cpu").half_row_contexts
    assert not resolve_precision("auto", "cuda").half_row_contexts
    # bf16 where the CPU multiplies it natively; emulated it is far slower than float32.
    assert resolve_precision("auto", "cpu").flow_head_bf16 == native_bf16()
    assert resolve_precision("bfloat16", "cpu").flow_head_bf16
    assert EngineConfig().dtype == "auto"
    with pytest.raises(ValueError):
        EngineConfig(dtype="float16").validate()


def test_log_spectral_distance_sees_a_difference():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal(FRAME * 4).astype(np.float32)
    assert log_spectral_distance(ref, ref).max() == 0
    louder = log_spectral_distance(ref * 10 ** (1 / 20), ref)  # +1 dB everywhere
    assert np.allclose(louder, 1.0, atol=1e-3)


def test_bf16_linear_is_a_bf16_product_in_a_float32_layer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    x = torch.randn(5, 64)
    layer = Bf16Linear(linear)
    ours = layer(x)
    assert ours.dtype == torch.float32
    exact = linear(x).detach()
    rel = float((ours - exact).norm() / exact.norm())
    assert 0 < rel < 1e-2  # bf16's 8-bit mantissa: close, not exact
    # Packed for oneDNN where it runs bf16 (AVX-512 or native bf16): the same product as torch's
    # bf16 GEMM, to the bit, eager and in a trace (replayed at another row count).
    packed = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert (layer.packed is not None, layer.weight is None) == (packed, packed)
    bf16 = torch.nn.functional.linear(x.bfloat16(), linear.weight.detach().bfloat16())
    assert torch.equal(ours, bf16.float() + linear.bias.detach())
    traced = torch.jit.trace(layer, torch.randn(3, 64))
    assert torch.equal(traced(x), ours)


INT8_KERNELS = [
    pytest.param(
        kernel,
        marks=pytest.mark.skipif(
            kernel not in torch.backends.quantized.supported_engines, reason=f"torch lacks {kernel}"
        ),
    )
    for kernel in ("fbgemm", "onednn")
]


@pytest.mark.parametrize("kernel", INT8_KERNELS)
def test_int8_linear_is_an_int8_product_through_either_kernel(kernel: str):
    """Each kernel's packing and activation range (oneDNN's full 8 bits, fbgemm's 7) give an int8
    product of the layer at every row count, in a trace replayed at other row counts too."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(1024, 96, bias=False)
    layer = Int8Linear(linear, kernel)
    assert layer.kernel == kernel
    traced = torch.jit.trace(layer, torch.randn(3, 1024))
    for rows in (1, 16, 80):
        x = torch.randn(rows, 1024)
        exact = linear(x).detach()
        ours = layer(x)
        rel = float((ours - exact).norm() / exact.norm())
        assert 0 < rel < 3e-2, f"{kernel}, {rows} rows: relative error {rel:.2e}"
        assert torch.equal(traced(x), ours)


def test_onednn_takes_the_layers_whose_calls_carry_enough_rows():
    """oneDNN's int8 GEMM costs more per call than fbgemm's and pays from rows x width of
    `ONEDNN_MIN_WORK` (16 x 1024), on a CPU with AMX: the full-size FlowLM at an AR step's 16
    rows, the Mimi decoder's 512-wide layers at a call's two frames (32 rows); not the 2M
    FlowLM."""
    amx = torch.cpu._is_amx_tile_supported()
    onednn = "onednn" if amx else "fbgemm"
    full_size = torch.nn.Linear(1024, 4096, bias=False)
    decoder = torch.nn.Linear(512, 2048, bias=False)
    two_m = torch.nn.Linear(112, 336, bias=False)
    assert kernel_for(full_size, rows=16) == onednn
    assert kernel_for(full_size, rows=8) == "fbgemm"
    assert kernel_for(decoder, rows=32) == onednn
    assert kernel_for(decoder, rows=16) == "fbgemm"
    assert kernel_for(two_m, rows=16) == "fbgemm"


@pytest.mark.parametrize("kernel", INT8_KERNELS)
def test_packing_puts_the_process_quantized_engine_back(kernel: str):
    before = torch.backends.quantized.engine
    Int8Linear(torch.nn.Linear(64, 32, bias=False), kernel)
    assert torch.backends.quantized.engine == before  # a process-wide setting


def test_engine_converts_a_copy_of_the_flow_head(tiny_checkpoint: Path):
    """The loaded model may serve float32 users too (the single-request path): the engine's
    reduced-precision layers replace its own copy's, never the loaded model's."""
    loaded = load_model(tiny_checkpoint)
    threads = torch.get_num_threads()
    engine = Engine(loaded, EngineConfig(dtype="bfloat16"))
    try:
        assert any(isinstance(m, Bf16Linear) for m in engine.model.flow_lm.flow_net.modules())
        assert not any(isinstance(m, Bf16Linear) for m in loaded.model.modules())
        assert loaded.model.flow_lm.transformer.dtype == torch.float32
    finally:
        engine.close()
        torch.set_num_threads(threads)
