"""Causal convolutions whose streaming history lives in an explicit state dict.

State entries are per-row tensors [B, ...] keyed by `<module name>.<field>`, so a caller can
gather rows from different requests, run them as one batch, and scatter them back.
`state=None` runs one-shot from an empty history (the encoder's case).
"""

from __future__ import annotations

import torch
from torch import nn

State = dict[str, torch.Tensor]


class StreamingModule(nn.Module):
    state_name: str = ""

    def init_state(self, batch_size: int, device: torch.device) -> State:
        raise NotImplementedError


class StreamingConv1d(StreamingModule):
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        dilation: int = 1,
        groups: int = 1,
        bias: bool = True,
        pad_mode: str = "constant",
    ):
        super().__init__()
        if pad_mode not in ("constant", "replicate"):
            raise ValueError(f"unsupported pad_mode {pad_mode!r}")
        self.pad_mode = pad_mode
        self.conv = nn.Conv1d(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            dilation=dilation,
            groups=groups,
            bias=bias,
        )
        self.history = (kernel_size - 1) * dilation + 1 - stride

    def init_state(self, batch_size: int, device: torch.device) -> State:
        shape = (batch_size, self.conv.in_channels, self.history)
        state = {f"{self.state_name}.previous": torch.zeros(shape, device=device)}
        if self.pad_mode == "replicate":
            # Replicate padding copies the first sample of the stream, which only the first
            # call sees.
            state[f"{self.state_name}.first"] = torch.ones(
                batch_size, dtype=torch.bool, device=device
            )
        return state

    def forward(self, x: torch.Tensor, state: State | None) -> torch.Tensor:
        if self.history == 0:
            return self.conv(x)
        if state is None:
            state = self.init_state(x.shape[0], x.device)
        previous = state[f"{self.state_name}.previous"]
        if self.pad_mode == "replicate":
            first = state[f"{self.state_name}.first"]
            previous.copy_(torch.where(first[:, None, None], x[..., :1], previous))
            first.zero_()
        x = torch.cat([previous, x], dim=-1)
        previous.copy_(x[..., -self.history :])
        return self.conv(x)


class StreamingConvTranspose1d(StreamingModule):
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        groups: int = 1,
        bias: bool = True,
    ):
        super().__init__()
        self.convtr = nn.ConvTranspose1d(
            in_channels, out_channels, kernel_size, stride, groups=groups, bias=bias
        )
        self.overlap = kernel_size - stride

    def init_state(self, batch_size: int, device: torch.device) -> State:
        shape = (batch_size, self.convtr.out_channels, self.overlap)
        return {f"{self.state_name}.partial": torch.zeros(shape, device=device)}

    def forward(self, x: torch.Tensor, state: State | None) -> torch.Tensor:
        y = self.convtr(x)
        if self.overlap == 0:
            return y
        if state is None:
            state = self.init_state(x.shape[0], x.device)
        partial = state[f"{self.state_name}.partial"]
        y[..., : self.overlap] += partial
        # The tail is completed by the next call's head; its bias is added then, once.
        tail = y[..., -self.overlap :]
        if self.convtr.bias is not None:
            tail = tail - self.convtr.bias[:, None]
        partial.copy_(tail)
        return y[..., : -self.overlap]
