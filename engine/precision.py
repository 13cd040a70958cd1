"""Which precision each part of the model runs in: the one place that decides, per device.

`EngineConfig.dtype` names a policy:
- "float32": everything in float32 (the equivalence tolerance against the reference, 1e-4).
- "bfloat16": the FlowLM transformer and its KV cache in bf16, the flow head's linear layers in
  bf16 (float32 activations), and on the CPU the Mimi decoder transformer's linear layers in int8.
- "auto" (default): the fastest mix that holds the fast path's tolerance (docs/benchmarks.md) on
  this device. On a CPU: the linear layers of the FlowLM transformer and of the Mimi decoder
  transformer in int8 (fbgemm, `kernels/int8.py`: 4x a float32 GEMM at decode-step row
  counts on AVX2; the reference's `quantize=True` does the same to the FlowLM; where the CPU has
  AMX, oneDNN's kernel where a layer's calls carry enough rows: the full-size FlowLM, the Mimi
  decoder), and that
  FlowLM copy's tanh GELU through the decoder's operator (`native_kernels`); where the CPU
  multiplies bf16 natively (AVX-512 BF16 or AMX), the flow head's linear layers in bf16
  (`kernels/bf16.py`: int8 there fails the tolerance at temperature 0, bf16 does not), and the
  Mimi decoder's widest convolutions (512 and 256 channels) as bf16 GEMMs (the narrower ones in
  bf16 fail the tolerance);
  the AR rows' dense copies of the KV cache, which every AR step reads whole, in float16
  (`RowContexts`, where the native attention reads them: half the bytes, a full-size step of 16
  rows 12-18% faster over 30-300 positions; the pool, and so every prompt pass, stays float32);
  activations, attention, the KV cache and the decoder's other convolutions in float32. bf16 is not
  used for the transformers' linears: where it is emulated (AVX2) it is ~8-10x slower than
  float32, and where it is native int8 linears are still faster at decode-step row counts
  (bench/results/cpu-2core-stages/README.md).
  Elsewhere: float32, as before.

On a GPU the float32 path runs without TF32 (`configure_precision`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from intone.engine import device as devices
from intone.engine.kernels import decoder_ops
from intone.engine.kernels.bf16 import bf16_linears
from intone.engine.kernels.int8 import int8_linears
from intone.engine.models.pocket.transformer import TransformerLayer

if TYPE_CHECKING:
    from intone.engine.models.pocket.model import PocketTTS

DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class Precision:
    flow_lm: torch.dtype  # the FlowLM transformer's activations and the KV pool
    decoder_int8: bool  # the Mimi decoder transformer's linear layers
    flow_lm_int8: bool = False  # the FlowLM transformer's linear layers
    flow_head_bf16: bool = False  # the flow head's linear layers (float32 activations)
    # The AR rows' dense contexts (`RowContexts`), where the native attention reads them: the
    # pool (and so every prompt pass) stays float32.
    half_row_contexts: bool = False
    # The Mimi decoder's widest convolutions (`cpu_decoder.BF16_CONV_MIN_CHANNELS`) as bf16 GEMMs.
    decoder_convs_bf16: bool = False


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX): elsewhere torch
    emulates it, far slower than float32."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_precision(dtype: str, device: str | torch.device) -> Precision:
    if dtype not in DTYPES:
        raise ValueError(f"EngineConfig.dtype must be one of {DTYPES}, not {dtype!r}")
    cpu = torch.device(device).type == "cpu"
    if dtype == "float32":
        return Precision(torch.float32, decoder_int8=False)
    if dtype == "bfloat16":
        return Precision(torch.bfloat16, decoder_int8=cpu, flow_head_bf16=True)
    if not cpu:
        return Precision(torch.float32, decoder_int8=False)
    return Precision(
        torch.float32,
        decoder_int8=True,
        flow_lm_int8=True,
        flow_head_bf16=native_bf16(),
        half_row_contexts=True,
        decoder_convs_bf16=native_bf16(),
    )


def configure_precision(device: torch.device, float32: bool) -> None:
    """The float32 path computes in float32 on a GPU too: TF32 (10-bit mantissa) matmuls and
    convolutions would put it ~1e-3 from the CPU, ten times the equivalence tolerance (1e-4).
    Process-wide torch settings, set only for a CUDA engine's float32 path."""
    if device.type == "cuda" and float32:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def serving_model(
    model: PocketTTS, device: torch.device, precision: Precision, native_kernels: bool = True
) -> PocketTTS:
    """The model the engine serves on `device` in `precision`. `model` may be shared with
    float32 users (the single-request path, another engine), so it is never changed: what is
    converted or moved is a copy, and parts converted into new modules anyway are shared with
    it rather than copied first. With `native_kernels`, the int8 FlowLM's tanh GELU is the
    decoder's operator (`decoder_ops.gelu_tanh`: a third of aten's cost; full size on a Xeon
    core, a prompt pass of 40 positions 33-35 ms against 40, four of 20 58-61 against 66-67)."""
    served = model
    shared = model.flow_lm
    if model.device != device:
        # A copy made on the device, tensor by tensor: `.to` would move the caller's model in
        # place, and a copy on the host first would hold the weights twice there.
        transformer = {id(t) for t in shared.transformer.parameters()}
        transformer |= {id(t) for t in shared.transformer.buffers()}
        served = devices.module_on(
            model,
            device,
            lambda t: precision.flow_lm if id(t) in transformer else None,
        )
        shared = served.flow_lm
    converted = [
        part
        for part, convert in (
            (shared.transformer, precision.flow_lm_int8),
            (shared.flow_net, precision.flow_head_bf16),
        )
        if convert
    ]
    if served is model and (converted or precision.flow_lm != torch.float32):
        served = copy.deepcopy(model, {id(part): part for part in converted})
        if not precision.flow_lm_int8:
            served.flow_lm.transformer.to(precision.flow_lm)
    if precision.flow_lm_int8:
        transformer = shared.transformer
        # Rows an AR step carries under load (a prompt pass, more).
        quantized = int8_linears(transformer, rows=16)
        if quantized is not None:
            served.flow_lm.transformer = quantized
            if native_kernels and device.type == "cpu" and decoder_ops.load():
                for layer in quantized.modules():
                    if isinstance(layer, TransformerLayer):
                        layer.activation = decoder_ops.gelu_tanh
    if precision.flow_head_bf16:
        # The engine's own copy (made on the device) is converted where it is.
        own = shared is not model.flow_lm
        served.flow_lm.flow_net = bf16_linears(shared.flow_net, in_place=own)
    configure_precision(device, precision.flow_lm == torch.float32)
    return served
