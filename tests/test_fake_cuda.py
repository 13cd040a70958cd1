"""The whole engine on CUDA, on a machine with no GPU: fake CUDA tensors catch every device mix.

Under `torch._subclasses.fake_tensor.FakeTensorMode` a tensor made on "cuda" is a fake CUDA
tensor (shapes, dtypes and devices, no data), and an operator that mixes one with a host tensor
raises `FakeTensorDeviceMismatchError`, as CUDA itself refuses the mix. Each case builds an
`Engine` with `EngineConfig(device="cuda")` from a tiny checkpoint of one architecture family,
registers a voice from a WAV (Mimi's encoder and a prefill) and one from a voice-state file, and
runs two requests through the engine's own threads: the first's prefill, AR steps, clause end,
the chaining tail into its second clause and the decode of its audio; the second cancelled.

What needs a GPU sits behind one seam, `intone.engine.device.device_io`, which the test replaces
(`FakeDeviceIO`): the host reads of device data (`values`: EOS flags; `array`: audio) give fixed
values, since fake tensors hold none; the stages' CUDA streams and events become the stage's
fake mode (a CPU-only torch makes no CUDA stream), and `synchronize` does nothing. Everything
else runs as on a GPU, host-to-device uploads through pinned buffers included.

A CPU-only torch has no CUDA device guard, which Python indexing and cross-device copies open
for a CUDA tensor (fake or not); `fake_cuda_guard.cpp` registers torch's no-op one (what
FakeTensorMode itself installs on a CUDA build with no device). The guard builds with the C++
compiler the decoder's native operators use; where none is found the tests skip.
docs/architecture.md ("GPU readiness") says what only a GPU can check.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch._subclasses.fake_tensor import FakeTensorMode

from intone.engine import Engine, EngineConfig
from intone.engine import device as devices
from intone.engine.checkpoint import TINY_FAMILIES
from intone.engine.device import DeviceIO, Stage
from intone.engine.kernels.native import load_torch_library
from intone.engine.loading import LoadedModel, load_model
from intone.engine.options import GenerationOptions
from intone.engine.voices import load_voice

from support.checkpoints import checkpoint

GUARD = Path(__file__).with_name("fake_cuda_guard.cpp")
# Two clauses; each ends at its EOS, the earliest a clause may (the seam reads every row as at EOS).
TEXT = "Hello there, this is a test."
OPTIONS = GenerationOptions(frames_after_eos=0, chain_frames=2)


@pytest.fixture(scope="module")
def fake_cuda() -> None:
    """Fake CUDA tensors work on this torch: a CUDA device guard exists (a CPU-only build gets
    the no-op one)."""
    if not torch.backends.cuda.is_built() and not load_torch_library(GUARD):
        pytest.skip("no C++ compiler for the no-op CUDA device guard")


@pytest.fixture
def tf32_on() -> Iterator[None]:
    """TF32 allowed, as torch leaves cuDNN by default (the float32 path turns it off); the
    process's settings again afterwards."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = cudnn.allow_tf32, matmul.allow_tf32
    cudnn.allow_tf32 = matmul.allow_tf32 = True
    yield
    cudnn.allow_tf32, matmul.allow_tf32 = saved


class SharedFakeMode(FakeTensorMode):
    """One fake mode for the test's thread and the engine's two stage threads. A fake mode keeps
    per-call state on itself: its operators run one at a time, and whether a thread is inside one
    (while it is, fake tensors say they are on "meta") is the thread's own."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.lock = threading.RLock()
        # Host tensors the engine makes (inputs planned on the host, a voice's audio) meet fake
        # ones as fake host tensors: mixing one with a fake CUDA tensor still raises.
        super().__init__(allow_non_fake_inputs=True)

    @property
    def in_kernel_invocation(self) -> bool:
        return getattr(self._local, "in_kernel_invocation", False)

    @in_kernel_invocation.setter
    def in_kernel_invocation(self, value: bool) -> None:
        self._local.in_kernel_invocation = value

    def __deepcopy__(self, memo: dict) -> SharedFakeMode:
        return self  # a copied fake tensor (`bf16_linears`) stays in this mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with self.lock:
            return super().__torch_dispatch__(func, types, args, kwargs)


class FakeStage(Stage):
    """A stage whose thread runs in the test's fake mode instead of on a CUDA stream."""

    def __init__(self, mode: FakeTensorMode):
        super().__init__(torch.device("cpu"))
        self.mode = mode

    def enter(self):
        return self.mode


class FakeDeviceIO(DeviceIO):
    """`DeviceIO` on fake CUDA tensors: host reads give fixed values (every row at EOS, silent
    audio), stages run in the fake mode; uploads are the engine's own."""

    def __init__(self, device: torch.device, mode: FakeTensorMode):
        super().__init__(device)
        self.mode = mode
        self.reads = 0

    def values(self, tensor: torch.Tensor) -> list:
        self.reads += 1
        return [True] * tensor.shape[0] if tensor.dtype == torch.bool else [0] * tensor.shape[0]

    def array(self, tensor: torch.Tensor) -> np.ndarray:
        self.reads += 1
        return np.zeros(tuple(tensor.shape), dtype=np.float32)

    def stage(self) -> Stage:
        return FakeStage(self.mode)

    def synchronize(self) -> None:
        pass


@pytest.fixture(scope="module")
def family(
    family_checkpoints: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], tuple[LoadedModel, Path]]:
    """Per preset, once for both paths: its model on the host and a voice-state file."""
    made: dict[str, tuple[LoadedModel, Path]] = {}

    def get(preset: str) -> tuple[LoadedModel, Path]:
        if preset not in made:
            path = checkpoint(family_checkpoints, preset, tmp_path_factory)
            loaded = load_model(path)
            state = tmp_path_factory.mktemp("states") / f"{preset}.safetensors"
            made[preset] = loaded, write_voice_state(loaded, path, state)
        return made[preset]

    return get


def write_voice_state(loaded: LoadedModel, checkpoint: Path, path: Path) -> Path:
    """A pocket-tts voice-state file of the checkpoint's default voice, made on the CPU."""
    voice = load_voice(loaded.model, "state", checkpoint / "voices" / "default.wav")
    state = {}
    for layer in range(voice.keys.shape[0]):
        prefix = f"transformer.layers.{layer}.self_attn"
        cache = torch.stack([voice.keys[layer], voice.values[layer]])[:, None]
        state[f"{prefix}/cache"] = cache.contiguous()
        state[f"{prefix}/offset"] = torch.tensor([voice.length])
    save_file(state, str(path))
    return path


async def run_request(engine: Engine, voice: str) -> list:
    stream = engine.stream(voice, OPTIONS)
    stream.push_text(TEXT)
    stream.end_input()
    return [event async for event in stream]


async def cancel_request(engine: Engine) -> None:
    stream = engine.stream()
    stream.push_text(TEXT)
    stream.cancel()
    async for _ in stream:
        pass


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", list(TINY_FAMILIES))
async def test_a_request_on_fake_cuda_mixes_no_devices(
    fake_cuda, tf32_on, family, preset: str, dtype: str, monkeypatch
) -> None:
    # Real weights on the host; the engine makes its copy on "cuda" from them.
    loaded, state_file = family(preset)
    mode = SharedFakeMode()
    ios: list[FakeDeviceIO] = []

    def fake_device_io(name: str) -> FakeDeviceIO:
        ios.append(FakeDeviceIO(devices.resolve_device(name, gpus=1), mode))
        return ios[-1]

    monkeypatch.setattr(devices, "device_io", fake_device_io)
    with mode:
        # As fast as possible: no playback pacing.
        config = EngineConfig(
            device="cuda", dtype=dtype, num_pages=64, max_active=4, lead_s=None, max_unread_s=None
        )
        engine = Engine(loaded, config)  # registers the default voice, from its WAV
        assert engine.device == torch.device("cuda", 0)
        assert loaded.model.device == torch.device("cpu"), "the caller's model moved"
        assert engine.runner.pool.keys.device == engine.device
        tf32 = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
        assert tf32 == ((False, False) if dtype == "float32" else (True, True))
        engine.add_voice("state", state_file)
        with engine:
            events = await asyncio.wait_for(run_request(engine, "state"), 60)
            await asyncio.wait_for(cancel_request(engine), 60)
    clauses = [e for e in events if type(e).__name__ == "ClauseDone"]
    chunks = [e for e in events if type(e).__name__ == "AudioChunk"]
    assert len(clauses) >= 2, "clauses after the first are prefilled with the previous tail"
    assert chunks and all(c.samples.size > 0 for c in chunks)
    assert ios[-1].reads > 0


@pytest.mark.parametrize(
    ("name", "gpus", "want"),
    [("cuda", 2, "cuda:0"), ("cuda:1", 2, "cuda:1"), ("cpu", 0, "cpu"), ("cuda:0", 1, "cuda:0")],
)
def test_a_device_name_resolves_to_an_indexed_device(name: str, gpus: int, want: str) -> None:
    assert devices.resolve_device(name, gpus) == torch.device(want)


@pytest.mark.parametrize(
    ("name", "gpus", "says"),
    [
        ("cuda:2", 2, "has 2 GPU"),
        ("cuda", 0, "sees no GPU"),
        ("cuda:0", 0, "sees no GPU"),
        ("mps", 1, "cpu or cuda"),
        ("gpu", 1, "not a torch device"),
    ],
)
def test_a_bad_device_is_refused_with_a_clear_error(name: str, gpus: int, says: str) -> None:
    with pytest.raises(ValueError, match="EngineConfig.device") as error:
        devices.resolve_device(name, gpus)
    assert says in str(error.value)
