"""The Mimi decoder's explicit streaming state (the engine's CPU decoder: tests/kernels/)."""

from __future__ import annotations

import torch

from intone.engine.loading import LoadedModel
from intone.engine.models.pocket.conv import State


def select_rows(state: State, rows: list[int]) -> State:
    return {name: tensor[rows].clone() for name, tensor in state.items()}


@torch.no_grad()
def test_frame_by_frame_equals_one_shot(tiny_model: LoadedModel):
    mimi = tiny_model.model.mimi
    latents = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(0))
    one_shot = mimi.decode(latents, mimi.init_decoder_state(2))
    state = mimi.init_decoder_state(2)
    frames = torch.cat([mimi.decode(latents[:, i : i + 1], state) for i in range(7)], dim=-1)
    assert one_shot.shape == (2, 1, 7 * 1920)
    torch.testing.assert_close(frames, one_shot, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_rows_with_different_histories_equal_rows_alone(tiny_model: LoadedModel):
    """Row 0 is 3 frames in, row 1 is fresh, row 2 is 30 frames in (past the 250-step window)."""
    mimi = tiny_model.model.mimi
    gen = torch.Generator().manual_seed(1)
    histories = [torch.randn(1, n, 32, generator=gen) for n in (3, 0, 30)]
    alone_states = []
    for history in histories:
        state = mimi.init_decoder_state(1)
        for i in range(history.shape[1]):
            mimi.decode(history[:, i : i + 1], state)
        alone_states.append(state)
    batch_state = {name: torch.cat([s[name] for s in alone_states]) for name in alone_states[0]}
    next_frames = torch.randn(3, 2, 32, generator=gen)
    batched = mimi.decode(next_frames, batch_state)
    for row, state in enumerate(alone_states):
        alone = mimi.decode(next_frames[row : row + 1], state)
        torch.testing.assert_close(batched[row : row + 1], alone, rtol=1e-5, atol=1e-6)
        for name, tensor in state.items():
            torch.testing.assert_close(batch_state[name][row : row + 1], tensor)
    assert select_rows(batch_state, [1])["transformer.offset"].item() == 2 * mimi.steps_per_frame
