"""Where the host and the device meet: the one module that checks a device name, moves a step's
host-side inputs to the device, reads results back and orders the two stages' CUDA streams.

On a CPU every call here is today's plain path (no pinning, no streams, `.to` a no-op). On a CUDA
device:

- `upload` copies a host tensor into pinned memory and from there to the device with
  `non_blocking=True`: the host goes on planning while the copy runs, where a pageable `.to`
  waits for the GPU. The pinned buffers come from torch's caching host allocator, which records
  each copy's stream and reuses a buffer only once its copy is done: staging buffers that never
  need freeing by hand.
- Each engine stage (the AR thread, the decoder worker) runs on its own CUDA stream (`Stage`),
  so their kernels overlap as the threads do on a CPU. The AR stage records an event after the
  work whose results it hands over (latents, first frames' histories); the decoder's stream waits
  for the newest such event before each call.
- `values` and `array` are the only reads of device data on the host (EOS flags, audio): the
  data-dependent points of a request. `tests/test_fake_cuda.py` runs the engine on fake CUDA
  tensors (no data, no GPU) and replaces exactly these and the streams (`DeviceIO.stage`,
  `synchronize`), which need a real GPU: `device_io` is the seam it replaces.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np
import torch
from torch import nn

M = TypeVar("M", bound=nn.Module)


def resolve_device(name: str | torch.device, gpus: int, current: int = 0) -> torch.device:
    """The torch device `name` names, with an explicit index for CUDA (`current` for a bare
    "cuda"), on a machine with `gpus` CUDA devices; ValueError naming `EngineConfig.device` for
    anything else."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"EngineConfig.device: {name!r} is not a torch device") from e
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"EngineConfig.device must be cpu or cuda[:N], not {name!r}")
    if gpus == 0:
        raise ValueError(f"EngineConfig.device is {name!r}, but this torch sees no GPU")
    index = current if device.index is None else device.index
    if not 0 <= index < gpus:
        raise ValueError(
            f"EngineConfig.device is {name!r}, but this machine has {gpus} GPU(s): "
            f"cuda:0 .. cuda:{gpus - 1}"
        )
    return torch.device("cuda", index)


def module_on(
    module: M, device: torch.device, dtype_of: Callable[[torch.Tensor], torch.dtype | None]
) -> M:
    """A copy of `module` whose parameters and buffers are made on `device` (floating ones in
    `dtype_of(tensor)`, None: their own), each copied straight from the original's: the original
    stays where it is, and no second copy is made on the way."""
    memo: dict[int, object] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        dtype = dtype_of(tensor) if tensor.is_floating_point() else None
        placed = tensor.detach().to(device=device, dtype=dtype or tensor.dtype)
        if isinstance(tensor, nn.Parameter):
            placed = nn.Parameter(placed, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = placed
    return copy.deepcopy(module, memo)


class Stage:
    """One engine stage's CUDA stream (`enter` on the stage's thread); no-ops on a CPU."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def enter(self) -> Iterator[None]:
        """The calling thread's work runs on this stage's stream while inside."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def record(self) -> torch.cuda.Event | None:
        """An event after everything queued on this stage's stream so far."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Work queued on this stream from now on runs after `event`."""
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def keep(self, tensor: torch.Tensor) -> None:
        """`tensor`, made on another stage's stream, is read on this one: its memory is not
        reused before this stream's work on it is done."""
        if self.stream is not None:
            tensor.record_stream(self.stream)


class DeviceIO:
    """The host-device crossings of one engine (see the module's doc)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        # The AR stage's newest handover event, which the decoder's stream waits for.
        self._handed_over: torch.cuda.Event | None = None
        self._lock = threading.Lock()

    def upload(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on the device: on a CPU as it is; a host tensor to a GPU through a pinned
        staging buffer, asynchronously."""
        if not self.cuda or tensor.device.type != "cpu":
            return tensor.to(self.device)
        staging = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        staging.copy_(tensor)
        return staging.to(self.device, non_blocking=True)

    def values(self, tensor: torch.Tensor) -> list:
        """A small device tensor's values on the host (waits for the stream that makes it)."""
        return tensor.tolist()

    def array(self, tensor: torch.Tensor) -> np.ndarray:
        """A device tensor as a float32 host array (audio)."""
        return tensor.detach().float().cpu().numpy()

    def stage(self) -> Stage:
        """A new stage and its stream."""
        return Stage(self.device)

    def hand_over(self, stage: Stage) -> None:
        """The AR stage's results so far may be read by the decoder (`take_over`)."""
        event = stage.record()
        if event is not None:
            with self._lock:
                self._handed_over = event

    def take_over(self, stage: Stage) -> None:
        """The decoder's next work runs after the AR stage's newest `hand_over`."""
        with self._lock:
            event = self._handed_over
        stage.wait(event)

    def synchronize(self) -> None:
        """Everything queued on the device is done (after setup, and a voice's registration,
        made on the caller's stream before the stages read them on theirs)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)


def device_io(name: str | torch.device) -> DeviceIO:
    """The `DeviceIO` of the device `name` names, on the GPUs this torch sees (ValueError for a
    bad name, see `resolve_device`): the seam `tests/test_fake_cuda.py` replaces."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return DeviceIO(resolve_device(name, gpus, torch.cuda.current_device() if gpus else 0))
