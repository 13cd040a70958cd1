"""A function of a tensor and a streaming state, run as a TorchScript trace per call shape.

The engine's stages are two Python threads (the AR stage and the decoder) on a few cores. An eager
call of the CPU decoder is ~1,500 small torch operators, and the interpreter takes the GIL back
between every two of them, so on 2 cores each stage spent much of its time waiting for the
other's operators instead of computing: beside an AR stage stepping without pause, a 2M decode
call of 4 rows x 1 frame took 28.7 ms against 19.1 alone, and an AR step 19.8 ms against 10.3
(bench/results/cpu-2core-traced-decoder/). A traced call runs its operators in TorchScript's
interpreter, which releases the GIL for the whole call: there the same call took 17.0 ms and a
step 15.6.

A key's first `trace_after - 1` calls run eagerly; the next is traced as it runs (its output and
state updates are the call's own), and later calls replay that trace; a call with `trace_now`
traces at once (the engine's warm-up, `Engine.prepare_traces`). Tracing costs what 20-40 eager
calls do (~150-300 ms for a tiny decoder's call of 5-20 ms, then one replay of 25-45 ms), so
only keys the engine calls again and again are worth it: a short-lived engine (a test's) that
skips the warm-up runs eagerly. A trace records the tensor operations only, so it holds for
every input whose shapes lead the Python code down the same branches: sizes flow through the
trace (a decode call of 8 rows and 3 frames replays a trace made on 1 row and 1 frame, bit for
bit), and the caller's key names whatever else the code branches on (for the decoder: which
state entries there are, which convolutions run as Winograd). Sizes stay free only where the
traced code passes them on: Python's `t[index] = v` with tensor indices strips a value's leading
dimensions of size 1 with a view of fixed shape, so traced code writes through `index_put_`. The
traces run without the JIT's optimizing executor, which took 100-275 ms more on a trace's first
two calls and ran it no faster.

`torch.jit.trace` is deprecated in favour of `torch.compile` and `torch.export`. `torch.compile`
of this decoder (inductor) took 26-55 s to compile on first use, gave nothing after warm-up,
and still calls its kernels from Python. So TorchScript stays, while this torch has it; without
it the calls run eagerly (`available`).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Hashable

import torch
from torch import nn

from intone.engine.models.pocket.conv import State

logger = logging.getLogger(__name__)

# What a traced function returns: a tensor, or a tuple of them.
Output = torch.Tensor | tuple[torch.Tensor, ...]
StateFunction = Callable[[torch.Tensor, State], Output]


def available() -> bool:
    return hasattr(torch.jit, "trace")


class _Recorded(nn.Module):
    """What the tracer runs: `fn` over the state's entries passed positionally. `modules` are
    the modules `fn` calls (the tracer follows only modules registered under the traced one)."""

    def __init__(self, fn: StateFunction, names: list[str], modules: nn.Module | None):
        super().__init__()
        self.fn = fn
        self.names = names
        self.modules_called = modules
        self.outputs: list[Output] = []

    def forward(self, x: torch.Tensor, *entries: torch.Tensor) -> Output:
        out = self.fn(x, dict(zip(self.names, entries, strict=True)))
        self.outputs.append(out)
        return out


class TraceCache:
    """`fn(x, state)` per key: eager for the key's first `trace_after - 1` calls, traced on the
    next, replayed after."""

    def __init__(self, trace_after: int):
        if trace_after < 1:
            raise ValueError(f"trace_after must be at least 1, got {trace_after}")
        self.trace_after = trace_after
        self._traces: dict[Hashable, Callable[..., Output]] = {}
        self._eager_calls: Counter[Hashable] = Counter()
        # Keys whose trace failed stay eager: a shape the tracer cannot follow must not fail
        # every later call of it.
        self._untraced: set[Hashable] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._traces)

    def __call__(
        self,
        key: Hashable,
        fn: StateFunction,
        x: torch.Tensor,
        state: State,
        modules: nn.Module | None = None,
        trace_now: bool = False,
    ) -> Output:
        """`modules`: those `fn` calls (the tracer follows only modules registered under the
        traced one). `trace_now`: trace an untraced key on this call, whatever its count."""
        names = sorted(state)
        key = (key, *names)
        entries = [state[name] for name in names]
        traced = self._traces.get(key)
        if traced is None:
            if key in self._untraced:
                return fn(x, state)
            if not trace_now and self._eager_calls[key] < self.trace_after - 1:
                self._eager_calls[key] += 1  # a lost count among threads only traces later
                return fn(x, state)
            with self._lock:  # decode parts run on several threads: trace a key once
                traced = self._traces.get(key)
                if traced is None:
                    try:
                        out, self._traces[key] = self._trace(fn, names, x, entries, modules)
                    except Exception:
                        # The call fails as an eager one would (its caller retries it); the key
                        # is not traced again.
                        self._untraced.add(key)
                        raise
                    self._eager_calls.pop(key, None)
                    return out
        with torch.jit.optimized_execution(False):
            return traced(x, *entries)

    def _trace(
        self,
        fn: StateFunction,
        names: list[str],
        x: torch.Tensor,
        entries: list[torch.Tensor],
        modules: nn.Module | None,
    ) -> tuple[Output, Callable[..., Output]]:
        recorded = _Recorded(fn, names, modules)
        with warnings.catch_warnings():
            # The tracer warns of every Python branch on a size (the key covers those) and that
            # it is deprecated (see the module's docstring).
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(recorded, (x, *entries), check_trace=False)
        (out,) = recorded.outputs
        recorded.outputs.clear()
        logger.debug("traced %s for %s", fn.__name__, tuple(x.shape))
        # Only the compiled method: the traced module's Python wrappers (hundreds of objects per
        # trace) can go.
        return out, traced.forward
