"""Mimi: the causal audio codec. The decoder turns 12.5 Hz latents into 24 kHz waveform.

Decoding is streaming and batched over requests with different histories: every piece of
history (conv `previous` buffers, conv-transpose overlaps, the decoder transformer's last
`context` keys/values and its position) is a row of an explicit `State` dict, created by
`init_decoder_state` and advanced by `decode`. Parameter names follow the released checkpoint
(`mimi.*`).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from intone.engine.models.pocket.config import MimiConfig, MimiTransformerConfig, SEANetConfig
from intone.engine.models.pocket.conv import (
    State,
    StreamingConv1d,
    StreamingConvTranspose1d,
    StreamingModule,
)
from intone.engine.models.pocket.transformer import Transformer


class SEANetResnetBlock(nn.Module):
    def __init__(self, dim: int, kernel_size: int, dilation: int, pad_mode: str, compress: int):
        super().__init__()
        hidden = dim // compress
        self.block = nn.ModuleList(
            [
                nn.ELU(alpha=1.0),
                StreamingConv1d(dim, hidden, kernel_size, dilation=dilation, pad_mode=pad_mode),
                nn.ELU(alpha=1.0),
                StreamingConv1d(hidden, dim, 1, pad_mode=pad_mode),
            ]
        )

    def forward(self, x: torch.Tensor, state: State | None) -> torch.Tensor:
        return x + _run(self.block, x, state)


def _run(layers: nn.ModuleList, x: torch.Tensor, state: State | None) -> torch.Tensor:
    for layer in layers:
        stateful = isinstance(layer, (StreamingModule, SEANetResnetBlock))
        x = layer(x, state) if stateful else layer(x)
    return x


class SEANetEncoder(nn.Module):
    def __init__(self, cfg: SEANetConfig):
        super().__init__()
        self.hop_length = math.prod(cfg.ratios)
        mult = 1
        layers: list[nn.Module] = [
            StreamingConv1d(cfg.channels, cfg.n_filters, cfg.kernel_size, pad_mode=cfg.pad_mode)
        ]
        for ratio in reversed(cfg.ratios):
            width = mult * cfg.n_filters
            for j in range(cfg.n_residual_layers):
                layers.append(
                    SEANetResnetBlock(
                        width,
                        cfg.residual_kernel_size,
                        cfg.dilation_base**j,
                        cfg.pad_mode,
                        cfg.compress,
                    )
                )
            layers += [
                nn.ELU(alpha=1.0),
                StreamingConv1d(
                    width, width * 2, kernel_size=ratio * 2, stride=ratio, pad_mode=cfg.pad_mode
                ),
            ]
            mult *= 2
        layers += [
            nn.ELU(alpha=1.0),
            StreamingConv1d(
                mult * cfg.n_filters, cfg.dimension, cfg.last_kernel_size, pad_mode=cfg.pad_mode
            ),
        ]
        self.model = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self.model, x, None)


class SEANetDecoder(nn.Module):
    def __init__(self, cfg: SEANetConfig):
        super().__init__()
        mult = 2 ** len(cfg.ratios)
        layers: list[nn.Module] = [
            StreamingConv1d(
                cfg.dimension, mult * cfg.n_filters, cfg.kernel_size, pad_mode=cfg.pad_mode
            )
        ]
        for ratio in cfg.ratios:
            width = mult * cfg.n_filters
            layers += [
                nn.ELU(alpha=1.0),
                StreamingConvTranspose1d(width, width // 2, kernel_size=ratio * 2, stride=ratio),
            ]
            for j in range(cfg.n_residual_layers):
                layers.append(
                    SEANetResnetBlock(
                        width // 2,
                        cfg.residual_kernel_size,
                        cfg.dilation_base**j,
                        cfg.pad_mode,
                        cfg.compress,
                    )
                )
            mult //= 2
        layers += [
            nn.ELU(alpha=1.0),
            StreamingConv1d(
                cfg.n_filters, cfg.channels, cfg.last_kernel_size, pad_mode=cfg.pad_mode
            ),
        ]
        self.model = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, state: State | None) -> torch.Tensor:
        return _run(self.model, x, state)


class WindowedKV:
    """Sliding-window attention cache for the Mimi transformer (implements `KVCache`).

    Each row keeps its own last `context` keys/values and their positions; a key is visible to a
    query when 0 <= query_pos - key_pos < context, as in the reference's windowed mask.
    """

    def __init__(self, state: State, prefix: str, context: int, positions: torch.Tensor):
        self.state = state
        self.prefix = prefix
        self.context = context
        self.positions = positions  # [B, T]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        past_k = self.state[f"{self.prefix}.{layer}.keys"]
        past_v = self.state[f"{self.prefix}.{layer}.values"]
        past_pos = self.state[f"{self.prefix}.{layer}.key_positions"]
        keys = torch.cat([past_k, k], dim=1)
        values = torch.cat([past_v, v], dim=1)
        key_pos = torch.cat([past_pos, self.positions], dim=1)
        delta = self.positions[:, :, None] - key_pos[:, None, :]
        mask = (key_pos[:, None, :] >= 0) & (delta >= 0) & (delta < self.context)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask[:, None]
        )
        keep = past_k.shape[1]
        past_k.copy_(keys[:, -keep:])
        past_v.copy_(values[:, -keep:])
        past_pos.copy_(key_pos[:, -keep:])
        return out.transpose(1, 2)


class ProjectedTransformer(nn.Module):
    def __init__(self, cfg: MimiTransformerConfig):
        super().__init__()
        if cfg.d_model != cfg.input_dimension or tuple(cfg.output_dimensions) != (cfg.d_model,):
            raise ValueError("Mimi transformers with input/output projections are not supported")
        self.context = cfg.context
        self.transformer = Transformer(
            d_model=cfg.d_model,
            num_heads=cfg.num_heads,
            num_layers=cfg.num_layers,
            dim_feedforward=cfg.dim_feedforward,
            max_period=cfg.max_period,
            layer_scale=cfg.layer_scale,
        )

    def init_state(
        self, name: str, batch_size: int, device: torch.device, slots: int | None = None
    ) -> State:
        """The KV ring of every layer, `slots` positions (the context unless a caller's ring
        holds more, as the engine's CPU decoder's does), empty."""
        slots = self.context if slots is None else slots
        t = self.transformer
        kv_shape = (batch_size, slots, t.num_kv_heads, t.head_dim)
        state = {f"{name}.offset": torch.zeros(batch_size, dtype=torch.long, device=device)}
        for layer in range(len(t.layers)):
            state[f"{name}.{layer}.keys"] = torch.zeros(kv_shape, device=device)
            state[f"{name}.{layer}.values"] = torch.zeros(kv_shape, device=device)
            state[f"{name}.{layer}.key_positions"] = torch.full(
                (batch_size, slots), -1, dtype=torch.long, device=device
            )
        return state

    def forward(self, x: torch.Tensor, name: str, state: State) -> torch.Tensor:
        """x [B, C, T] -> [B, C, T], advancing the rows' positions by T."""
        offset = state[f"{name}.offset"]
        steps = x.shape[-1]
        positions = offset[:, None] + torch.arange(steps, device=x.device)
        cache = WindowedKV(state, name, self.context, positions)
        y = self.transformer(x.transpose(1, 2), positions, cache)
        offset += steps
        return y.transpose(1, 2)


class DummyQuantizer(nn.Module):
    def __init__(self, dimension: int, output_dimension: int):
        super().__init__()
        self.output_proj = nn.Conv1d(dimension, output_dimension, 1, bias=False)


class ConvDownsample1d(nn.Module):
    def __init__(self, stride: int, dimension: int, out_dimension: int):
        super().__init__()
        self.conv = StreamingConv1d(
            dimension, out_dimension, 2 * stride, stride=stride, bias=False, pad_mode="replicate"
        )


class ConvTrUpsample1d(nn.Module):
    def __init__(self, stride: int, dimension: int, in_dimension: int):
        super().__init__()
        self.convtr = StreamingConvTranspose1d(
            in_dimension, dimension, 2 * stride, stride=stride, groups=dimension, bias=False
        )


class Mimi(nn.Module):
    # State entries a state pool may leave in place (see engine/kernels/cpu_decoder.py); none here.
    in_place_state: frozenset[str] = frozenset()

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        self.sample_rate = cfg.sample_rate
        self.frame_rate = cfg.frame_rate
        self.samples_per_frame = int(cfg.sample_rate / cfg.frame_rate)
        decoder_seanet = cfg.decoder_seanet or cfg.seanet
        self.encoder = SEANetEncoder(cfg.seanet)
        self.decoder = SEANetDecoder(decoder_seanet)
        self.encoder_transformer = ProjectedTransformer(cfg.transformer)
        self.decoder_transformer = ProjectedTransformer(cfg.decoder_transformer or cfg.transformer)
        self.quantizer = DummyQuantizer(cfg.quantizer.dimension, cfg.quantizer.output_dimension)
        encoder_frame_rate = cfg.sample_rate / self.encoder.hop_length
        stride = encoder_frame_rate / cfg.frame_rate
        if stride <= 1 or stride != int(stride):
            raise ValueError(f"unsupported Mimi frame rates: stride {stride}")
        self.steps_per_frame = int(stride)
        self.downsample = ConvDownsample1d(
            self.steps_per_frame, cfg.seanet.dimension, cfg.inner_dim or cfg.seanet.dimension
        )
        self.upsample = ConvTrUpsample1d(
            self.steps_per_frame,
            decoder_seanet.dimension,
            cfg.outer_dim or decoder_seanet.dimension,
        )
        for name, module in self.named_modules():
            if isinstance(module, StreamingModule):
                module.state_name = name

    def _decoder_modules(self) -> list[StreamingModule]:
        modules = [self.upsample.convtr]
        modules += [m for m in self.decoder.modules() if isinstance(m, StreamingModule)]
        return modules

    def init_decoder_state(self, batch_size: int, device: torch.device | str = "cpu") -> State:
        device = torch.device(device)
        state: State = {}
        for module in self._decoder_modules():
            state.update(module.init_state(batch_size, device))
        state.update(self.decoder_transformer.init_state("transformer", batch_size, device))
        return state

    def decode(self, latents: torch.Tensor, state: State) -> torch.Tensor:
        """De-normalised latents [B, T, C] -> audio [B, channels, T * samples_per_frame]."""
        x = self.quantizer.output_proj(latents.transpose(1, 2))
        x = self.upsample.convtr(x, state)
        x = self.decoder_transformer(x, "transformer", state)
        return self.decoder(x, state)

    def encode(self, audio: torch.Tensor) -> torch.Tensor:
        """Audio [B, channels, samples] -> de-normalised latents [B, T, C], one shot."""
        frame = self.samples_per_frame
        audio = F.pad(audio, (0, -audio.shape[-1] % frame))
        x = self.encoder(audio)
        state = self.encoder_transformer.init_state("encoder", x.shape[0], x.device)
        x = self.encoder_transformer(x, "encoder", state)
        # The encoder's window state is sized to `context`, and a one-shot pass over a longer
        # prompt must still see `context` keys back: it does, because the window is only
        # trimmed after the pass.
        x = self.downsample.conv(x, None)
        return x.transpose(1, 2)
