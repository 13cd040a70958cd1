"""`EngineConfig.max_active="auto"`: how many streams this model can keep in real time here.

At start the engine times its two stages on scratch rows of a runner of its own (`measure`): an AR
step and a decode call of `DECODE_FRAMES` frames per row at a few batch sizes (`PROBE_ROWS`), a
second or two on a CPU at full size. Each stage's cost is fitted as a line in the rows (a per-call
part and a per-row part) and the engine admits the most streams whose one frame of audio costs at
most `HEADROOM` of a frame's duration:

- on a CPU, in CPU seconds (the two stages run on threads of their own that share the cores, and a
  decode call splits across them): AR step + decode call / frames per call <= HEADROOM x cores x
  frame; and the AR step alone, which runs on one thread while the decoder works, within HEADROOM
  of a frame;
- on a GPU, in wall seconds, the two stages one after the other on the device.

The headroom keeps room for what the probe leaves out: prompt passes of new clauses, new streams'
first frames, the server's encoding and the listener's slack. The result is logged and reported
in the engine's metrics (`/stats`), and docs/deploy.md says how it came out on the machines
measured. An explicit `max_active` skips all this.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from intone.engine.block_manager import BlockManager
from intone.engine.config import (
    DECODE_FRAMES,
    HEADROOM,
    PROBE_CONTEXT,
    PROBE_ROWS,
    PROBE_STEPS,
    REPEATS,
    EngineConfig,
)
from intone.engine.model_runner import ModelRunner
from intone.engine.request import Request, RequestMetrics
from intone.engine.thread_budget import ThreadBudget

logger = logging.getLogger(__name__)


AUTO_MIN, AUTO_MAX = 1, 256


@dataclass(frozen=True)
class StageCost:
    """A stage's measured seconds per call at each batch size, and the line fitted to them."""

    seconds: dict[int, float]  # rows -> median seconds of one call
    per_call: float
    per_row: float

    def at(self, rows: int) -> float:
        return self.per_call + self.per_row * rows

    @classmethod
    def fit(cls, seconds: dict[int, float]) -> StageCost:
        rows = sorted(seconds)
        if len(rows) == 1:
            return cls(seconds, 0.0, seconds[rows[0]] / rows[0])
        slope, intercept = statistics.linear_regression(rows, [seconds[r] for r in rows])
        # Noise may bend the line below zero; a row never costs nothing.
        slope = max(slope, seconds[rows[-1]] / rows[-1] / 4)
        return cls(seconds, max(intercept, 0.0), slope)


@dataclass(frozen=True)
class Admission:
    """What `max_active="auto"` measured and chose (in the engine's metrics as `admission`)."""

    max_active: int
    frame_seconds: float
    cores: int  # 0 on a GPU: wall seconds count there
    generate: StageCost  # one AR step
    decode: StageCost  # one decode call of `DECODE_FRAMES` frames per row
    measured_in_s: float

    def as_dict(self) -> dict:
        result = asdict(self)
        result["headroom"] = HEADROOM
        return result


def choose(generate: StageCost, decode: StageCost, frame_seconds: float, cores: int) -> int:
    """The most rows that keep every stream in real time with `HEADROOM` to spare."""
    budget = HEADROOM * frame_seconds

    def fits(rows: int) -> bool:
        cost = generate.at(rows) + decode.at(rows) / DECODE_FRAMES
        if cores:  # CPU seconds against the cores, and the AR step on its own thread
            return cost <= budget * cores and generate.at(rows) <= budget
        return cost <= budget

    rows = AUTO_MIN
    while rows < AUTO_MAX and fits(rows + 1):
        rows += 1
    return rows


def measure(
    runner: ModelRunner, blocks: BlockManager, frame_seconds: float, cores: int
) -> Admission:
    """Time `runner`'s AR step and decode call at `PROBE_ROWS` rows on scratch requests (pages
    of `blocks`, decoder slots of the runner's pool; all given back) and choose. `cores`: the CPU
    cores the stages share, 0 on a GPU."""
    started = time.perf_counter()
    clock = time.process_time if cores else time.perf_counter
    device = runner.device
    latent_dim = runner.flow_lm.latent_dim
    most = max(PROBE_ROWS)
    requests = [_scratch_request(i, blocks, latent_dim, device) for i in range(most)]
    slots = [runner.decoder_states.acquire() for _ in range(most)]
    noise = [torch.zeros(latent_dim, device=device) for _ in range(most)]
    latents = torch.zeros(most, DECODE_FRAMES, latent_dim, device=device)
    # The engine's steps replay a trace (shared with this runner): time that, not eager steps.
    runner.prepare_ar_traces()
    try:

        def timed(call) -> float:
            call()  # warm-up: shapes, row contexts, allocator
            times = []
            for _ in range(REPEATS):
                _sync(device)
                before = clock()
                call()
                _sync(device)
                times.append(clock() - before)
            return statistics.median(times)

        def step(rows: list[Request]) -> None:
            for request in rows:
                assert request.table is not None
                blocks.extend(request.table, 1)
            runner.generate(rows, noise[: len(rows)])

        generate = {n: timed(lambda n=n: step(requests[:n])) for n in PROBE_ROWS}
        decode = {n: timed(lambda n=n: runner.decode(slots[:n], latents[:n])) for n in PROBE_ROWS}
    finally:
        for request in requests:
            if request.table is not None:
                blocks.release(request.table)
        for slot in slots:
            runner.decoder_states.release(slot)
    generate_cost, decode_cost = StageCost.fit(generate), StageCost.fit(decode)
    rows = choose(generate_cost, decode_cost, frame_seconds, cores)
    admission = Admission(
        rows, frame_seconds, cores, generate_cost, decode_cost, time.perf_counter() - started
    )
    logger.info(
        "max_active auto: %d rows (AR step %s ms, decode call of %d frames %s ms, by rows; "
        "%s; measured in %.1f s)",
        rows,
        _ms(generate),
        DECODE_FRAMES,
        _ms(decode),
        f"CPU seconds on {cores} cores" if cores else "wall seconds",
        admission.measured_in_s,
    )
    return admission


def probe(
    make_runner: Callable[[BlockManager, int], ModelRunner],
    page_size: int,
    frame_seconds: float,
    cores: int,
) -> Admission:
    """`measure` on a scratch runner of `max(PROBE_ROWS)` rows over a pool of its own, just big
    enough, closed after."""
    positions = PROBE_CONTEXT + PROBE_STEPS
    blocks = BlockManager(max(PROBE_ROWS) * -(-positions // page_size), page_size)
    runner = make_runner(blocks, max(PROBE_ROWS))
    try:
        return measure(runner, blocks, frame_seconds, cores)
    finally:
        runner.close()


def resolve(
    config: EngineConfig,
    make_runner: Callable[[BlockManager, int], ModelRunner],
    frame_seconds: float,
    budget: ThreadBudget | None,
    device: torch.device,
) -> tuple[EngineConfig, Admission | None]:
    """`config` with the `max_active` this engine runs, and for "auto" what was measured to
    choose it (`probe`; None for a number given). On a CPU the stages share the thread budget's
    cores (torch's threads without one); on a GPU wall seconds count."""
    if config.max_active != "auto":
        return config, None
    cores = (budget.cores if budget else torch.get_num_threads()) if device.type == "cpu" else 0
    admission = probe(make_runner, config.page_size, frame_seconds, cores)
    return replace(config, max_active=admission.max_active), admission


def _scratch_request(index: int, blocks: BlockManager, latent_dim: int, device) -> Request:
    """A row for timing only: `PROBE_CONTEXT` positions of whatever the pool holds."""
    request = Request(
        id=f"probe-{index}",
        voice="",
        temperature=0.7,
        eos_threshold=0.0,
        noise_clamp=None,
        chain_frames=0,
        generator=torch.Generator(),
        metrics=RequestMetrics(submitted_at=0.0),
    )
    request.table = blocks.allocate(PROBE_CONTEXT)
    blocks.reserve(request.table, PROBE_CONTEXT + PROBE_STEPS)
    request.previous_latent = torch.zeros(latent_dim, device=device)
    return request


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ms(seconds: dict[int, float]) -> str:
    return ", ".join(f"{rows}: {1000 * s:.1f}" for rows, s in sorted(seconds.items()))
