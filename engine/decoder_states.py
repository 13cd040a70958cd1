"""Per-request Mimi decoder histories, kept as rows of one preallocated state.

Each active request owns a row (a slot); a request that gives its row up between clauses (it has
no text yet, or it is far ahead of playback) keeps a saved copy of its history instead. A decode
batch gathers its requests' rows into a contiguous batch state, runs, and scatters the advanced
rows back, so requests that share a batch never see each other's history. Entries the decoder
names in `in_place_state` are not copied: the batch state holds the whole pool tensor and `ROWS`
the batch's slots, and the decoder reads and writes those rows in place. A slot is reset to a
fresh history when it is handed out. A new stream's first frames may be decoded before it holds a
slot (`DecoderWorker.decode_first_frames`): on a `detached` state, whose rows come back in the saved
form.
"""

from __future__ import annotations

from typing import Protocol

import torch

from intone.engine.kernels.cpu_decoder import ROWS
from intone.engine.models.pocket.conv import State


class Decoder(Protocol):
    """What decodes latents with explicit per-row state: `Mimi` itself, or its `CpuDecoder`."""

    def init_decoder_state(self, batch_size: int, device: torch.device | str = "cpu") -> State: ...

    in_place_state: frozenset[str]

    def decode(self, latents: torch.Tensor, state: State) -> torch.Tensor: ...


class DecoderStatePool:
    def __init__(self, decoder: Decoder, num_slots: int, device: torch.device):
        self.rows = decoder.init_decoder_state(num_slots, device)
        self.fresh = decoder.init_decoder_state(1, device)
        self.num_slots = num_slots
        self.in_place = decoder.in_place_state
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

    def save(self, slot: int) -> dict[str, torch.Tensor]:
        """A copy of a row's history, for a request that gives its row up between clauses."""
        return {name: tensor[slot].clone() for name, tensor in self.rows.items()}

    def restore(self, slot: int, saved: dict[str, torch.Tensor]) -> None:
        for name, tensor in self.rows.items():
            tensor[slot] = saved[name]

    def detached(self, histories: list[dict[str, torch.Tensor] | None]) -> State:
        """A batch state of rows that hold no slot: row i from `histories[i]` (the form `save`
        returns), or fresh for None. Decoding it touches no pool row."""
        return {
            name: torch.stack([self.fresh[name][0] if h is None else h[name] for h in histories])
            for name in self.rows
        }

    @staticmethod
    def histories(state: State) -> list[dict[str, torch.Tensor]]:
        """Each row of a `detached` state after a decode, in the form `restore` takes."""
        rows = next(iter(state.values())).shape[0]
        return [{name: tensor[row] for name, tensor in state.items()} for row in range(rows)]

    def gather(self, slots: torch.Tensor) -> State:
        state = {
            name: tensor if name in self.in_place else tensor.index_select(0, slots)
            for name, tensor in self.rows.items()
        }
        if self.in_place:
            state[ROWS] = slots
        return state

    def scatter(self, slots: torch.Tensor, state: State) -> None:
        for name, tensor in self.rows.items():
            if name not in self.in_place:
                tensor.index_copy_(0, slots, state[name])
