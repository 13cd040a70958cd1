"""Per-request Mimi decoder histories, kept as rows of one preallocated state.

Each active request owns a row (a slot). A decode batch gathers its requests' rows into a
contiguous batch state, runs, and scatters the advanced rows back, so requests that share a batch
never see each other's history. A slot is reset to a fresh history when it is handed out.
"""

from __future__ import annotations

from typing import Protocol

import torch

from intone.engine.models.pocket.conv import State


class Decoder(Protocol):
    """What decodes latents with explicit per-row state: `Mimi` itself, or its `GemmDecoder`."""

    def init_decoder_state(self, batch_size: int, device: torch.device | str = "cpu") -> State: ...

    def decode(self, latents: torch.Tensor, state: State) -> torch.Tensor: ...


class DecoderStatePool:
    def __init__(self, decoder: Decoder, num_slots: int, device: torch.device):
        self.rows = decoder.init_decoder_state(num_slots, device)
        self.fresh = decoder.init_decoder_state(1, device)
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))

    @property
    def in_use(self) -> int:
        return self.num_slots - len(self.free_slots)

    def acquire(self) -> int:
        slot = self.free_slots.pop()
        for name, tensor in self.rows.items():
            tensor[slot] = self.fresh[name][0]
        return slot

    def release(self, slot: int) -> None:
        self.free_slots.append(slot)

    def gather(self, slots: torch.Tensor) -> State:
        return {name: tensor.index_select(0, slots) for name, tensor in self.rows.items()}

    def scatter(self, slots: torch.Tensor, state: State) -> None:
        for name, tensor in self.rows.items():
            tensor.index_copy_(0, slots, state[name])
