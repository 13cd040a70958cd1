"""A model runner with two scratch requests on its pages, for the tests that call the stages'
steps directly: the CUDA suite against the same runner on the CPU, the CPU suite on the `meta`
device (where a host tensor meeting a device tensor inside a step raises).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from intone.engine.block_manager import BlockManager
from intone.engine.loading import LoadedModel
from intone.engine.model_runner import ModelRunner
from intone.engine.precision import configure_precision

PROMPT_LENGTHS = (5, 9)


def scratch_runner(
    loaded: LoadedModel,
    device: torch.device,
    batch_buckets: tuple[int, ...] | None = None,
    noise_clamps: tuple[float | None, float | None] = (None, None),
) -> tuple[ModelRunner, list[SimpleNamespace]]:
    """A `ModelRunner` on a copy of `loaded`'s model on `device` (float32, without TF32 on a GPU,
    as the engine runs it), over a pool of 32 pages, with two decoder rows and one flow step; and
    two requests whose tables hold prompts of `PROMPT_LENGTHS` positions (40 reserved each), the
    same on every device (seeded), at the BOS latent, with `noise_clamps`."""
    configure_precision(device, float32=True)
    model = copy.deepcopy(loaded.model).to(device)
    flow_lm = model.flow_lm
    blocks = BlockManager(32, 16)
    runner = ModelRunner(model, blocks, 2, 1, device, batch_buckets=batch_buckets)
    requests = []
    for i, length in enumerate(PROMPT_LENGTHS):
        table = blocks.allocate(0)
        assert blocks.reserve(table, 40)
        blocks.extend(table, length)
        requests.append(
            SimpleNamespace(
                table=table,
                prompt=torch.randn(
                    length, flow_lm.dim, generator=torch.Generator().manual_seed(i)
                ).to(device),
                previous_latent=torch.full((flow_lm.latent_dim,), float("nan"), device=device),
                eos_threshold=0.0,
                temperature=0.3,
                noise_clamp=noise_clamps[i],
                generator=torch.Generator().manual_seed(10 + i),
            )
        )
    return runner, requests
