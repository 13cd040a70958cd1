"""The engine's Mimi decoder on a CPU: Mimi's streaming decoder as plain matrix products on
time-major activations.

`Mimi.decode` runs the decoder as the checkpoint defines it: channels-first convolutions whose
histories are concatenated in front of every call. On a CPU at decode-step sizes (a few frames
per row, up to 16 rows) that costs as much in layout work as in arithmetic: oneDNN reorders the
activations and weights of every convolution on every call, each history concatenation copies the
whole activation, and the transposed convolutions run a slow generic kernel.

`CpuDecoder` computes the same function on [B, T, C] activations with its weights laid out once
for GEMMs:
- a convolution is K accumulated GEMMs over row-shifted views of the flattened [B * (h + T), C]
  input (rows that would straddle two batch rows are computed and dropped), so no im2col copy;
- the ELU in front of a convolution writes straight into the buffer that already holds the
  convolution's history, so the history concatenation costs nothing extra;
- a transposed convolution (kernel = 2 * stride) is a two-tap convolution to stride x C channels,
  reshaped to stride frames: no overlap-add;
- the wide convolutions (128 channels or more on both sides) run as Winograd's F(4, K): the
  kernel-7 input convolution does 10 GEMMs per 4 frames instead of 28, a two-tap one 5 instead
  of 8 (float32 rounding of the transforms: ~1e-5 relative on the full-size decoder's output);
- with `bf16_convs` (where the CPU multiplies bf16 natively), the widest of them, 256 channels or
  more on both sides, are one bf16 GEMM each over their taps' frames side by side instead
  (`BF16_CONV_MIN_CHANNELS`).
Its streaming state has the same entries as `Mimi.init_decoder_state` with time-major buffers.
"""

from __future__ import annotations

import copy
import logging
from fractions import Fraction

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from intone.engine.kernels import bf16, decoder_ops, traces
from intone.engine.kernels.int8 import int8_linears
from intone.engine.models.pocket.conv import State, StreamingConv1d, StreamingConvTranspose1d
from intone.engine.models.pocket.mimi import Mimi, SEANetResnetBlock

logger = logging.getLogger(__name__)


# Interpolation points of the Winograd transforms, taken in this order (infinity comes last):
# small integers and their inverses keep the transforms' rounding error near float32's.
_POINTS = (0, 1, -1, 2, -2, Fraction(1, 2), Fraction(-1, 2), 3, -3, Fraction(1, 3), Fraction(-1, 3))


def winograd_matrices(m: int, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Winograd's F(m, r) for a correlation y[p] = sum_k w[k] x[p + k], p < m, over n = m + r - 1
    inputs: y = AT @ ((G @ w) * (BT @ x)), returned as (AT [m, n], G [n, r], BT [n, n]).

    It is the transpose of the Toom-Cook linear convolution that evaluates both factors at n - 1
    points and infinity, multiplies, and interpolates: n products instead of m * r."""
    n = m + r - 1
    if n - 1 > len(_POINTS):
        raise ValueError(f"no Winograd points for F({m}, {r})")

    def evaluation(k: int) -> np.ndarray:
        rows = [[float(Fraction(p) ** i) for i in range(k)] for p in _POINTS[: n - 1]]
        rows.append([0.0] * (k - 1) + [1.0])  # infinity: the leading coefficient
        return np.array(rows)

    interpolation = np.linalg.inv(evaluation(n))
    matrices = (evaluation(m).T, evaluation(r), interpolation.T)
    return tuple(torch.tensor(a, dtype=torch.float32) for a in matrices)


# With `CpuDecoder(bf16_convs=True)`, the convolutions at least this wide on both sides of their
# GEMMs (the 512- and 256-channel layers nearest the latents) run as bf16 GEMMs. On a Xeon with
# AMX a full-size decode call of 16 rows x 4 frames took 170-190 ms against 229-236 (one thread,
# traced), and the fast path's error hardly moved (four streams at temperature 0: 5.5-5.7e-4
# against ~4e-4 relative RMS, 0.30-0.35 dB mean log-spectral distance); the 128-channel layers
# too fail the tolerance (0.76-0.84 dB mean), as do bf16 Winograd products (1.2 dB: their
# transforms amplify the rounding). bench/results/cpu-2core-xeon-amx-2026-12-07/README.md.
BF16_CONV_MIN_CHANNELS = 256

# Convolutions with at most this many weights (K x Cin x Cout floats, a quarter of a 2 MB L2)
# and no Winograd tile or bf16 GEMM for a call run as decoder_ops' direct convolution: the
# SEANet's narrow layers (12-96 channels at 480-1920 steps a frame), where K GEMMs of a few dozen
# columns run at a fraction of a core's rate and the history and ELU cost passes of their own.
# 2M decoder, 29 rows x 1 frame on one Xeon core: its SEANet 12.0-12.4 against 22.0-22.1 ms
# (bench/results/cpu-2core-xeon-amx-2026-12-07/README.md).
DIRECT_CONV_MAX_WEIGHTS = 1 << 17


def winograd_tile(in_channels: int, out_channels: int) -> int:
    """F(4, K) where it pays on a CPU. Measured per layer (full-size and 2M decoders, one
    thread): F(4, 7) at 512 channels takes 37% of the direct time, and from 256 channels on each
    kernel-2 or kernel-3 layer gains 10-35%; where either side has under 128 channels the
    transforms cost as much as the GEMMs save, or more."""
    return 4 if min(in_channels, out_channels) >= 128 else 1


class _Conv:
    """A causal convolution; with `elu`, the ELU in front of it is fused into its history copy.

    `weights` is [K, Cin, Cout]: tap k's matrix, contiguous for the GEMM; tap K - 1 reads the
    newest frame. With `tile` m > 1 (dilation 1), a call whose frame count m divides runs as
    Winograd's F(m, K): n = m + K - 1 GEMMs over every m-th frame instead of K over every frame,
    K * m / n times fewer multiplications for a transform of the input and output.

    With `bf16_gemm` and both sides at least `BF16_CONV_MIN_CHANNELS` wide (where oneDNN runs bf16),
    it is one bf16 GEMM of the K taps' frames side by side instead (`packed`, the weights in
    oneDNN's layout; float32 out, its bias added in float32), with no Winograd. With `native`,
    a call that neither serves and of at most `DIRECT_CONV_MAX_WEIGHTS` weights is one
    `causal_conv` operator call instead (`direct`): history, ELU and residual sum in it."""

    def __init__(
        self,
        key: str,
        weights: torch.Tensor,
        bias: torch.Tensor | None,
        dilation: int,
        elu: bool,
        tile: int = 1,
        native: bool = False,
        bf16_gemm: bool = False,
    ):
        self.key = key
        self.weights = weights
        self.bias = bias
        self.dilation = dilation
        self.history = (weights.shape[0] - 1) * dilation
        self.in_channels = weights.shape[1]
        self.elu = elu
        self.native = native  # the ELU through decoder_ops' operator
        # Through decoder_ops' direct convolution where no bf16 GEMM or Winograd tile serves it.
        self.direct = native and weights.numel() <= DIRECT_CONV_MAX_WEIGHTS
        self.tile = tile if dilation == 1 and weights.shape[0] > 1 else 1
        self.packed: torch.Tensor | None = None
        taps, cin, cout = weights.shape
        if bf16_gemm and min(cin, cout) >= BF16_CONV_MIN_CHANNELS:
            # Tap k's input channels at columns k * Cin ... of the taps side by side.
            weight = weights.reshape(taps * cin, cout).t().to(torch.bfloat16).contiguous()
            if bf16.packs(weight):
                self.packed, self.tile, self.direct = bf16.pack(weight), 1, False
        if self.tile > 1:
            out_t, g, in_t = winograd_matrices(self.tile, weights.shape[0])
            self.output_transform, self.input_transform = out_t, in_t
            self.transformed = torch.einsum("jk,kio->jio", g, weights).contiguous()

    @classmethod
    def of(cls, module: StreamingConv1d, elu: bool, native: bool, bf16_gemm: bool) -> _Conv:
        conv = module.conv
        if conv.groups != 1 or conv.stride[0] != 1 or module.pad_mode != "constant":
            raise ValueError("CpuDecoder supports ungrouped stride-1 zero-padded convolutions")
        if module.history != (conv.kernel_size[0] - 1) * conv.dilation[0]:
            raise ValueError("CpuDecoder supports causal convolutions")
        weights = conv.weight.detach().permute(2, 1, 0).contiguous()
        bias = None if conv.bias is None else conv.bias.detach().clone()
        tile = winograd_tile(conv.in_channels, conv.out_channels)
        key = f"{module.state_name}.previous"
        return cls(key, weights, bias, conv.dilation[0], elu, tile, native, bf16_gemm)

    def init_state(self, batch_size: int, device: torch.device) -> State:
        if self.history == 0:
            return {}
        shape = (batch_size, self.history, self.in_channels)
        return {self.key: torch.zeros(shape, device=device)}

    def with_history(self, x: torch.Tensor, state: State) -> torch.Tensor:
        """[B, history + T, C]: the stored history, then `x` (through the ELU); the newest
        `history` frames become the stored history."""
        b, t, c = x.shape
        previous = state[self.key]
        buf = x.new_empty(b, self.history + t, c)
        buf[:, : self.history] = previous
        if self.elu:
            decoder_ops.elu_into(x, buf[:, self.history :], self.native)
        else:
            buf[:, self.history :] = x
        previous.copy_(buf[:, t:])
        return buf

    def winograd(self, buf: torch.Tensor) -> torch.Tensor:
        """The convolution of [B, history + T, C] `buf` as F(m, K) over its T / m tiles."""
        b, length, c = buf.shape
        m, n = self.tile, self.transformed.shape[0]
        tiles = (length - self.history) // m
        # Tile i reads frames i * m ... i * m + n - 1: gathered once, [n, B * tiles * C].
        inputs = buf.unfold(1, n, m).permute(3, 0, 1, 2).reshape(n, -1)
        v = torch.mm(self.input_transform, inputs).view(n, b * tiles, c)
        products = torch.bmm(v, self.transformed)  # [n, B * tiles, Cout]
        y = torch.mm(self.output_transform, products.view(n, -1))
        y = y.view(m, b, tiles, -1).permute(1, 2, 0, 3).reshape(b, tiles * m, -1)
        if self.bias is not None:
            y += self.bias
        return y

    def by_bf16_gemm(self, buf: torch.Tensor) -> torch.Tensor:
        """The convolution of [B, history + T, C] `buf` as one bf16 GEMM (`packed`)."""
        assert self.packed is not None
        b, length, _ = buf.shape
        t = length - self.history
        half = buf.to(torch.bfloat16)
        taps = range(0, self.history + 1, self.dilation)
        frames = torch.cat([half[:, k : k + t] for k in taps], dim=2).view(b * t, -1)
        y = bf16.product(frames, self.packed).to(torch.float32).view(b, t, -1)
        return y if self.bias is None else y.add_(self.bias)

    def __call__(
        self, x: torch.Tensor, state: State, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The convolution of `x` [B, T, Cin], plus `residual` [B, T, Cout] where given."""
        winograd = self.tile > 1 and x.shape[1] % self.tile == 0
        if self.direct and not winograd:
            history = state[self.key] if self.history else None
            return torch.ops.intone.causal_conv(
                x, history, self.weights, self.bias, self.dilation, self.elu, residual
            )
        y = self._by_gemms(x, state, winograd)
        return y if residual is None else y.add_(residual)

    def _by_gemms(self, x: torch.Tensor, state: State, winograd: bool) -> torch.Tensor:
        b, t, _ = x.shape
        if self.history == 0:
            if self.elu:
                x = decoder_ops.elu_into(x, torch.empty_like(x), self.native)
            if self.packed is not None:
                return self.by_bf16_gemm(x)
            return F.linear(x, self.weights[0].t(), self.bias)
        buf = self.with_history(x, state)
        if self.packed is not None:
            return self.by_bf16_gemm(buf)
        if winograd:
            return self.winograd(buf)
        length = buf.shape[1]
        flat = buf.view(b * length, -1)
        rows = b * length - self.history
        out = x.new_empty(b * length, self.weights.shape[2])
        if self.bias is None:
            torch.mm(flat[:rows], self.weights[0], out=out[:rows])
        else:
            torch.addmm(self.bias, flat[:rows], self.weights[0], out=out[:rows])
        for k in range(1, self.weights.shape[0]):
            shift = k * self.dilation
            out[:rows].addmm_(flat[shift : shift + rows], self.weights[k])
        return out.view(b, length, -1)[:, :t]


class _ConvTranspose:
    """A transposed convolution with kernel = 2 * stride, ELU in front optional.

    Output frames t * stride + j (j < stride) depend on input frames t and t - 1 only, so it is
    a two-tap causal convolution to stride x Cout channels, reshaped to stride frames: no
    overlap-add pass, and the ELU fuses into the one-frame history as in `_Conv`."""

    def __init__(
        self, module: StreamingConvTranspose1d, elu: bool, native: bool, bf16_gemm: bool = False
    ):
        convtr = module.convtr
        kernel, stride = convtr.kernel_size[0], convtr.stride[0]
        if kernel != 2 * stride:
            raise ValueError("CpuDecoder supports transposed convolutions with kernel 2 * stride")
        self.stride = stride
        self.out_channels = convtr.out_channels
        weight = convtr.weight.detach()  # [Cin, Cout / groups, K]
        # Tap 0 reads frame t - 1 (the kernel's second half), tap 1 frame t (its first half).
        taps = (weight[:, :, stride:], weight[:, :, :stride])
        bias = None if convtr.bias is None else convtr.bias.detach().repeat(stride)
        key = f"{module.state_name}.previous"
        self.depthwise = convtr.groups > 1
        if self.depthwise:
            if not (convtr.groups == convtr.in_channels == convtr.out_channels):
                raise ValueError("CpuDecoder supports dense or depthwise transposed convolutions")
            weights = torch.stack([tap[:, 0].t() for tap in taps])  # [2, stride, C]
        else:
            cin = weight.shape[0]
            weights = torch.stack([tap.permute(0, 2, 1).reshape(cin, -1) for tap in taps])
            weights = weights.contiguous()  # [2, Cin, stride * Cout]
        tile = 1 if self.depthwise else winograd_tile(*weights.shape[1:])
        self.conv = _Conv(
            key,
            weights,
            bias,
            dilation=1,
            elu=elu,
            tile=tile,
            native=native,
            bf16_gemm=bf16_gemm and not self.depthwise,
        )

    def init_state(self, batch_size: int, device: torch.device) -> State:
        if self.depthwise:
            # Its taps are [stride, C] scales, not [Cin, Cout] matrices: the history has C
            # channels, which `self.conv` cannot read off its weights.
            shape = (batch_size, 1, self.out_channels)
            return {self.conv.key: torch.zeros(shape, device=device)}
        return self.conv.init_state(batch_size, device)

    def __call__(self, x: torch.Tensor, state: State) -> torch.Tensor:
        b, t, _ = x.shape
        if self.depthwise:
            buf = self.conv.with_history(x, state)[:, :, None, :]
            before, current = self.conv.weights
            y = buf[:, 1:] * current + buf[:, :-1] * before
            if self.conv.bias is not None:
                y += self.conv.bias.view(self.stride, -1)
        else:
            y = self.conv(x, state)
        return y.reshape(b, t * self.stride, self.out_channels)


class _ResBlock:
    def __init__(self, block: SEANetResnetBlock, native: bool, bf16_gemm: bool):
        layers = list(block.block)
        if not (
            len(layers) == 4
            and isinstance(layers[0], nn.ELU)
            and isinstance(layers[2], nn.ELU)
            and all(isinstance(m, StreamingConv1d) for m in layers[1::2])
        ):
            raise ValueError("CpuDecoder supports ELU-conv-ELU-conv residual blocks")
        self.convs = [_Conv.of(layers[i], True, native, bf16_gemm) for i in (1, 3)]

    def init_state(self, batch_size: int, device: torch.device) -> State:
        state: State = {}
        for conv in self.convs:
            state.update(conv.init_state(batch_size, device))
        return state

    def __call__(self, x: torch.Tensor, state: State) -> torch.Tensor:
        first, second = self.convs
        return second(first(x, state), state, residual=x)


def _convs(layer: _Conv | _ConvTranspose | _ResBlock) -> list[_Conv]:
    """The convolutions a SEANet layer runs, on its input's time steps."""
    if isinstance(layer, _ResBlock):
        return layer.convs
    return [layer.conv] if isinstance(layer, _ConvTranspose) else [layer]


# The state entry holding a batch's pool rows, where the ring entries stay in the caller's pool.
ROWS = "transformer.rows"

# The SEANet runs on groups of rows whose widest activation (samples x channels, at the last
# upsampling stage) holds about this many values, so that a layer's output is still in cache
# when the next layer reads it: a large call then costs no more per row-frame than a small one
# (bench/results/cpu-2core-stages/README.md). Much smaller groups lose it again to the per-call
# overhead of the many small layers.
SEANET_GROUP_VALUES = 1 << 20


class RingKV:
    """The decoder transformer's sliding-window cache as a ring (implements `KVCache`).

    `WindowedKV` concatenates the window in front of the new keys and copies it back, per layer
    and call. Here each row's keys live in a ring of `size` >= context + new - 1 slots that the
    new keys are written into at position % size: nothing a query may still see is overwritten,
    and attention reads the ring in place, masked by the stored positions.

    With `state[ROWS]`, the ring entries of `state` are a whole pool of rows and ROWS says which
    rows this batch is: the new keys go straight into the pool and attention gathers the rows'
    rings once, instead of the caller gathering them before and scattering them back after.
    (`CpuDecoder` hands a batch whose rows are one ascending run over as views of the pool
    instead, without ROWS: nothing to gather.)
    A call that fails after writing leaves keys at positions its row has not reached (its offset
    did not advance): a query never sees a later position, and the row's next call overwrites
    each such slot before it attends to it, so a failed call leaves no trace.
    """

    def __init__(
        self,
        state: State,
        prefix: str,
        context: int,
        positions: torch.Tensor,
        native: bool = False,
    ):
        self.state = state
        self.prefix = prefix
        self.context = context
        self.positions = positions  # [B, T]
        self.native = native  # attend through decoder_ops' operator
        size = state[f"{prefix}.0.key_positions"].shape[1]
        self.slots = positions % size
        self.index = state.get(ROWS)
        rows = torch.arange(positions.shape[0], device=positions.device)
        self.rows = (rows if self.index is None else self.index)[:, None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys = self.state[f"{self.prefix}.{layer}.keys"]
        values = self.state[f"{self.prefix}.{layer}.values"]
        key_pos = self.state[f"{self.prefix}.{layer}.key_positions"]
        # index_put_, not `keys[where] = k`: for one row, that views k without its leading 1
        # at a fixed shape, which a trace made on one row would keep (traces.py).
        where = (self.rows, self.slots)
        keys.index_put_(where, k)
        values.index_put_(where, v)
        key_pos.index_put_(where, self.positions)
        if self.native:
            return torch.ops.intone.ring_attention(
                q, keys, values, key_pos, self.positions, self.index, self.context
            )
        if self.index is not None:
            keys, values = keys[self.index], values[self.index]
            key_pos = key_pos[self.index]
        delta = self.positions[:, :, None] - key_pos[:, None, :]
        mask = (key_pos[:, None, :] >= 0) & (delta >= 0) & (delta < self.context)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None],
            enable_gqa=True,
        )
        return out.transpose(1, 2)


class CpuDecoder:
    """The decoder of a float32 `Mimi`, computed as GEMMs; equal to `Mimi.decode` up to rounding.

    A call decodes at most `max_frames` frames per row at once (the ring's size depends on it);
    longer calls run in pieces, which is exact since the decoder is causal. The SEANet runs on
    groups of rows whose widest activation holds about `seanet_group_values` values. With
    `int8`, the decoder transformer's linear layers run in int8 (`Int8Linear`): its output
    enters the residual stream through a small layer scale, so this costs little accuracy (the
    fast path's tolerance, tests/engine/test_fast_path.py) and about a fifth of the decoder's time.
    With `bf16_convs`, the SEANet's widest convolutions run as bf16 GEMMs
    (`BF16_CONV_MIN_CHANNELS`), where oneDNN runs bf16.
    With `trace_after`, its two parts (the transformer, and the SEANet per group of rows) run as
    TorchScript traces, one per part and kind of state (pool rows in place or gathered), for
    every row and frame count, from that many calls on (`traces.TraceCache`): the same
    operators, without holding the GIL.
    """

    def __init__(
        self,
        mimi: Mimi,
        max_frames: int = 4,
        int8: bool = False,
        seanet_group_values: int = SEANET_GROUP_VALUES,
        trace_after: int | None = None,
        native_ops: bool = False,
        bf16_convs: bool = False,
    ):
        if mimi.quantizer.output_proj.kernel_size[0] != 1:
            raise ValueError("CpuDecoder needs a 1x1 quantizer output projection")
        self.samples_per_frame = mimi.samples_per_frame
        self.max_frames = max_frames
        layers = range(len(mimi.decoder_transformer.transformer.layers))
        fields = ("keys", "values", "key_positions")
        # The rings are most of a row's state (2.6 MB per row, full size): a state pool leaves
        # them in place and passes the batch's rows as state[ROWS] (see RingKV).
        self.in_place_state = frozenset(f"transformer.{i}.{f}" for i in layers for f in fields)
        self.ring = mimi.decoder_transformer.context + max_frames * mimi.steps_per_frame - 1
        self.output_proj = mimi.quantizer.output_proj.weight.detach()[:, :, 0].clone()
        self.upsample = _ConvTranspose(mimi.upsample.convtr, elu=False, native=False)
        self.native = native_ops and decoder_ops.load()
        self.transformer = mimi.decoder_transformer
        self.int8 = False
        if int8:
            # A call carries at least a new stream's first two frames.
            quantized = int8_linears(mimi.decoder_transformer, rows=2 * mimi.steps_per_frame)
            if quantized is not None:
                self.transformer, self.int8 = quantized, True
        if self.native:
            if not self.int8:  # its own copy: `mimi`'s layers keep torch's GELU
                self.transformer = copy.deepcopy(mimi.decoder_transformer)
            for layer in self.transformer.transformer.layers:
                layer.activation = decoder_ops.gelu_tanh
        self.layers: list = []
        elu = False
        for module in mimi.decoder.model:
            if isinstance(module, nn.ELU):
                elu = True
                continue
            if isinstance(module, StreamingConv1d):
                self.layers.append(_Conv.of(module, elu, self.native, bf16_convs))
            elif isinstance(module, StreamingConvTranspose1d):
                self.layers.append(_ConvTranspose(module, elu, self.native, bf16_convs))
            elif isinstance(module, SEANetResnetBlock):
                if elu:
                    raise ValueError("CpuDecoder: an ELU in front of a residual block")
                self.layers.append(_ResBlock(module, self.native, bf16_convs))
            else:
                raise ValueError(f"CpuDecoder: unsupported decoder layer {type(module).__name__}")
            elu = False
        # The convolutions that run as bf16 GEMMs; their packed weights are buffers of a module
        # the SEANet's trace is given (the tracer cannot hold them as constants).
        self.convs = [conv for layer in self.layers for conv in _convs(layer)]
        self.bf16_convs = [conv for conv in self.convs if conv.packed is not None]
        self.seanet_weights = nn.Module()
        for i, conv in enumerate(self.bf16_convs):
            self.seanet_weights.register_buffer(f"packed_{i}", conv.packed)
        self.seanet_keys = [
            key for layer in self.layers for key in layer.init_state(1, torch.device("meta"))
        ]
        # A call's only Python branch on a size is a Winograd convolution's `t % tile` (the
        # tracer follows every other size through the operators): (tile, time steps per frame)
        # of each convolution that has one.
        self.winograd_rates = [(self.upsample.conv.tile, 1)] if self.upsample.conv.tile > 1 else []
        # The widest SEANet activation per frame: samples at its rate x channels.
        steps, widest = mimi.steps_per_frame, 0
        for layer in self.layers:
            self.winograd_rates += [(conv.tile, steps) for conv in _convs(layer) if conv.tile > 1]
            if isinstance(layer, _ConvTranspose):
                steps *= layer.stride
                widest = max(widest, steps * layer.out_channels)
            elif isinstance(layer, _Conv):
                widest = max(widest, steps * layer.weights.shape[2])
        self.seanet_values_per_frame = widest
        self.seanet_group_values = seanet_group_values
        self.traces = None
        if trace_after is not None:
            self.traces = traces.TraceCache(trace_after)

    def init_decoder_state(self, batch_size: int, device: torch.device | str = "cpu") -> State:
        device = torch.device(device)
        state = self.upsample.init_state(batch_size, device)
        for layer in self.layers:
            state.update(layer.init_state(batch_size, device))
        state.update(self.transformer.init_state("transformer", batch_size, device, self.ring))
        return state

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, state: State, trace_now: bool = False) -> torch.Tensor:
        """De-normalised latents [B, T, C] -> audio [B, 1, T * samples_per_frame].
        `trace_now`: trace the parts this call runs that have no trace yet (a warm-up)."""
        if latents.shape[1] > self.max_frames:
            pieces = latents.split(self.max_frames, dim=1)
            return torch.cat([self.decode(p, state, trace_now) for p in pieces], dim=-1)
        state = self._pool_run_as_views(state)
        frames = latents.shape[1]
        # Sizes flow through a trace, so one serves every row count and every frame count that
        # takes the same Winograd branches (with 16 decoder steps per frame, every count does).
        branches = tuple(frames * rate % tile == 0 for tile, rate in self.winograd_rates)
        key = ("transformer", branches)
        x = self._call(key, self._transformer_part, latents, state, trace_now, self.transformer)
        group = max(1, self.seanet_group_values // (frames * self.seanet_values_per_frame))
        audio = []
        for first in range(0, x.shape[0], group):
            rows = slice(first, first + group)
            # Views of the group's rows: each layer advances its history in place.
            group_state = {name: state[name][rows] for name in self.seanet_keys}
            y = x[rows]
            key = ("seanet", branches)
            audio.append(
                self._call(key, self._seanet, y, group_state, trace_now, self.seanet_weights)
            )
        return torch.cat(audio).transpose(1, 2).contiguous()

    def _call(
        self,
        key: tuple,
        part: traces.StateFunction,
        x: torch.Tensor,
        state: State,
        trace_now: bool,
        modules: nn.Module | None = None,
    ) -> torch.Tensor:
        if self.traces is None:
            return part(x, state)
        return self.traces(key, part, x, state, modules, trace_now)

    def _pool_run_as_views(self, state: State) -> State:
        """Pool rows in one ascending run (the engine sorts a batch by slot) as views of the pool,
        without ROWS: read and written in place, with no gather."""
        index = state.get(ROWS)
        if index is None:
            return state
        first, last = int(index[0]), int(index[-1])
        if last - first + 1 != len(index) or not bool((index.diff() == 1).all()):
            return state
        run = slice(first, last + 1)
        return {
            key: value[run] if key in self.in_place_state else value
            for key, value in state.items()
            if key != ROWS
        }

    def _transformer_part(self, latents: torch.Tensor, state: State) -> torch.Tensor:
        """The output projection, the upsampling and the decoder transformer."""
        x = F.linear(latents, self.output_proj)
        x = self.upsample(x, state)
        offset = state["transformer.offset"]
        steps = x.shape[1]
        positions = offset[:, None] + torch.arange(steps, device=x.device)
        cache = RingKV(state, "transformer", self.transformer.context, positions, self.native)
        x = self.transformer.transformer(x, positions, cache)
        offset += steps
        return x

    def _seanet(self, x: torch.Tensor, state: State) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, state)
        return x


def make_decoder(
    mimi: Mimi,
    device: torch.device,
    int8: bool = False,
    trace_after: int | None = None,
    native_ops: bool = True,
    bf16_convs: bool = False,
) -> Mimi | CpuDecoder:
    """The engine's decoder: `CpuDecoder` on the CPU (float32, or int8 transformer linears and
    with `bf16_convs` the widest convolutions in bf16; traced from `trace_after` calls of a
    shape on, where this torch can; with `native_ops`, decoder_ops' operators where they
    build), `Mimi` itself elsewhere (cuDNN convolutions)."""
    if device.type != "cpu":
        return mimi
    if not traces.available():
        trace_after = None
    try:
        return CpuDecoder(
            mimi,
            int8=int8,
            trace_after=trace_after,
            native_ops=native_ops,
            bf16_convs=bf16_convs,
        )
    except ValueError as e:
        logger.warning("Mimi decoder layout not supported by CpuDecoder (%s): eager path", e)
        return mimi
