"""Faults stay local: an injected exception in any stage ends only the request it is pinned on.

Each stage's fault is injected under 6 concurrent streams. The culprit's stream ends with a typed
`EngineFailedError` carrying the cause; every other stream completes and equals the single-request
path (a failed batch is retried row by row on the noise and pages it already consumed, so nobody
else's audio changes); afterwards pages, decoder rows and active requests are back to the floor.
An error no request can be blamed for fails the engine: every open stream ends within a second,
`health()` says why, and new streams are refused.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from intone.engine import (
    AudioChunk,
    Engine,
    EngineClosedError,
    EngineConfig,
    EngineFailedError,
    EngineFullError,
    GenerationOptions,
    InvalidOptionError,
)
from intone.engine.block_manager import BlockManager
from intone.engine.loading import LoadedModel
from intone.engine.model_runner import ModelRunner
from intone.engine.options import option_names

from support.engine import (
    SECOND_VOICE,
    TEXTS,
    TIMEOUT,
    Outcome,
    Reference,
    check_outcome,
    options,
    run_request,
    voice_pages,
    wait_idle,
)
from support.faults import (
    CULPRIT,
    STREAMS,
    InjectedFault,
    check_bystanders,
    collect,
    inject,
    jobs,
    open_streams,
    push_all,
)
from support.runner import scratch_runner

FAIL_WITHIN = 1.0  # seconds for every open stream to end after an unrecoverable error


@pytest.mark.parametrize(
    "stage", ["start_clause", "prefill", "ar_step", "noise", "decode", "first_frame"]
)
@pytest.mark.parametrize("joined", [False, True])
async def test_a_fault_ends_only_its_request(
    make_engine, reference: Reference, stage: str, joined: bool
) -> None:
    """`joined`: prompt passes run in one pass with the AR step (`ModelRunner.join_passes`); a
    joint pass that fails runs the two apart, where the fault ends its request alone."""
    engine = make_engine()
    engine.runner.join_passes = joined
    floor = voice_pages(engine)
    streams = open_streams(engine)
    counts = inject(engine, stage, streams[CULPRIT].request)
    results = await push_all(streams)

    assert counts["raised"] >= 1, f"the {stage} fault never fired"
    outcome, error = results[CULPRIT]
    assert isinstance(error, EngineFailedError), f"culprit ended with {error!r}"
    assert isinstance(error.__cause__, InjectedFault), error.__cause__
    assert error.code == "engine_error"
    # What the culprit got before its fault is the start of its own audio.
    text, voice, opts = jobs()[CULPRIT]
    want = reference.audio(text, voice, opts)
    got = outcome.audio
    assert got.shape[0] < want.shape[0]
    if got.shape[0]:
        check_outcome(
            Outcome(outcome.events, cancelled=True), reference, text, voice, opts, "culprit"
        )
    check_bystanders(results, reference, skip=CULPRIT)
    await wait_idle(engine, floor)
    assert engine.health().ok, engine.health()
    m = engine.metrics()
    assert m["requests_completed"] == STREAMS - 1


async def test_a_failed_voice_add_hurts_nobody(
    make_engine, reference: Reference, second_voice_wav: Path
) -> None:
    """A voice registration that fails half way (pages allocated, K/V write fails) while six
    streams run: the caller gets a typed error, the old voice is intact, nothing leaks."""
    engine = make_engine()
    floor = voice_pages(engine)
    old_table = engine.scheduler.voices[SECOND_VOICE].table
    old_pages = list(old_table.pages)

    def faulty_write(table, voice):
        raise InjectedFault("voice add")

    streams = open_streams(engine)
    running = asyncio.create_task(push_all(streams))
    await asyncio.sleep(0.05)
    engine.runner.write_voice = faulty_write
    with pytest.raises(EngineFailedError) as failure:
        engine.add_voice(SECOND_VOICE, second_voice_wav)
    assert isinstance(failure.value.__cause__, InjectedFault)
    assert engine.scheduler.voices[SECOND_VOICE].table is old_table
    assert old_table.pages == old_pages
    results = await running
    check_bystanders(results, reference, skip=None)
    await wait_idle(engine, floor)
    assert engine.health().ok


async def test_full_pool_add_voice_keeps_the_old_voice(
    make_engine, reference: Reference, second_voice_wav: Path
) -> None:
    engine = make_engine(second_voice=False)
    floor = voice_pages(engine)
    # Shrink what is free to one page: no second voice fits, nor a replacement of the first.
    spare = engine.blocks.allocate((engine.blocks.pages_available - 1) * engine.blocks.page_size)
    assert engine.blocks.pages_available == 1
    before = engine.metrics()["kv_pages_in_use"]
    old_table = engine.scheduler.voices["default"].table
    for name in ("default", "another"):
        with pytest.raises(EngineFullError):
            engine.add_voice(name, second_voice_wav)
        assert engine.metrics()["kv_pages_in_use"] == before
        assert engine.voices == ["default"]
        assert engine.scheduler.voices["default"].table is old_table
    engine.blocks.release(spare)
    opts = options(5, 0.3, max_frames=6)
    outcome = await run_request(engine, TEXTS[1], None, opts)
    check_outcome(outcome, reference, TEXTS[1], "default", opts, "after the refused voice")
    await wait_idle(engine, floor)


@pytest.mark.parametrize("where", ["ar", "decoder", "decoder_exit"])
async def test_an_unrecoverable_error_ends_every_stream(make_engine, where: str) -> None:
    engine = make_engine()
    streams = open_streams(engine)
    for stream, (text, _, _) in zip(streams, jobs(), strict=True):
        stream.push_text(text)
        stream.end_input()
    for stream in streams:  # all are generating
        assert isinstance(await asyncio.wait_for(stream.__anext__(), TIMEOUT), AudioChunk)
    waiting = engine.stream()  # open, no text yet

    def boom(*args) -> None:
        raise InjectedFault(where)

    def leave(*args) -> None:
        raise SystemExit  # a thread that quits without an Exception

    if where == "ar":
        engine.ar._retire_requests = boom
    elif where == "decoder":
        engine.decoder._run_control_items = boom
    else:
        engine.decoder._run_control_items = leave
    engine.stream_host.cancel(streams[0].request)  # wakes both stages up
    started = time.monotonic()
    results = await asyncio.wait_for(
        asyncio.gather(*[collect(s) for s in [*streams, waiting]]), FAIL_WITHIN
    )
    assert time.monotonic() - started < FAIL_WITHIN
    for i, (_, error) in enumerate(results):
        assert isinstance(error, EngineFailedError), f"stream {i}: {error!r}"
    health = engine.health()
    assert not health.ok and health.reason
    assert ("AR" in health.reason) == (where == "ar"), health.reason
    with pytest.raises(EngineFailedError):
        engine.stream()
    closed_at = time.monotonic()
    engine.close()
    assert time.monotonic() - closed_at < 5.0


async def test_stream_during_or_after_close_is_refused(make_engine) -> None:
    engine = make_engine()
    opened = [engine.stream(None, options(1, max_frames=4)) for _ in range(3)]
    opened[0].push_text(TEXTS[0])
    opened[0].end_input()
    opened[1].push_text(TEXTS[1])
    engine.close()
    for stream in opened:
        _, error = await collect(stream)  # every stream made before close() has a final event
        assert error is None or isinstance(error, EngineClosedError), error
    with pytest.raises(EngineClosedError):
        engine.stream()
    assert not engine.health().ok


async def test_healthz_answers_503_with_the_reason(make_engine) -> None:
    """An orchestrator restarts a process whose engine failed: /healthz says 503 and why."""
    import httpx

    from intone.provider.server.app import create_app

    from support.server import ServerThread

    engine = make_engine(second_voice=False)
    server = ServerThread(create_app(engine=engine)).start()
    try:
        async with httpx.AsyncClient() as http:
            healthy = await http.get(f"{server.url}/healthz")
            assert healthy.status_code == 200 and healthy.json()["status"] == "ok"

            def boom(*args) -> None:
                raise InjectedFault("AR")

            engine.ar._retire_requests = boom
            stream = engine.stream(None, options(1, max_frames=4))
            stream.push_text(TEXTS[0])  # wakes the AR thread, which dies
            _, error = await collect(stream)
            assert isinstance(error, EngineFailedError)
            failed = await http.get(f"{server.url}/healthz")
            assert failed.status_code == 503, failed.text
            body = failed.json()
            assert body["status"] == "unhealthy" and "AR stage failed" in body["error"]
    finally:
        server.stop()


# ---- options


# 10**400 is too large to convert to a float.
BAD_VALUES = [float("nan"), float("inf"), float("-inf"), 1e300, -1e300, 2**80, 10**400, "1", True]


@pytest.mark.parametrize("name", option_names())
async def test_bad_option_values_never_reach_a_step(make_engine, name: str) -> None:
    engine = make_engine(second_voice=False)
    steps = engine.metrics()["generate_batches"]
    # A switch (normalize) takes only True or False; every other option refuses a bool.
    bad = [v for v in BAD_VALUES if not isinstance(v, bool)] if name == "normalize" else BAD_VALUES
    for value in bad:
        with pytest.raises(InvalidOptionError):
            GenerationOptions(**{name: value})
        opts = GenerationOptions()
        setattr(opts, name, value)  # changed after validation: the engine validates again
        with pytest.raises(InvalidOptionError):
            engine.stream(None, opts)
    assert engine.metrics()["generate_batches"] == steps
    assert engine.metrics()["queued_requests"] == 0


@pytest.mark.parametrize("tenant", [["a"], {"key": 1}, 7])
async def test_a_bad_tenant_is_refused_at_stream_not_by_the_ar_stage(make_engine, tenant) -> None:
    """The AR stage counts rows per tenant: an unhashable tenant there failed every stream."""
    engine = make_engine(second_voice=False, max_rows_per_tenant=1)
    with pytest.raises(InvalidOptionError, match="tenant"):
        engine.stream(None, tenant=tenant)
    assert engine.metrics()["queued_requests"] == 0
    audio = await engine.synthesize("Hello there.", options=options(1, max_frames=4))
    assert audio.size and engine.health().ok


async def test_a_chaining_tail_too_big_for_the_pool_is_refused_at_stream(make_engine) -> None:
    engine = make_engine(second_voice=False, page_size=16)
    floor = voice_pages(engine)
    engine.close()
    # Two pages beyond the voice: a 32-frame tail (plus a token and a frame) cannot fit.
    engine = make_engine(second_voice=False, page_size=16, num_pages=floor + 2)
    with pytest.raises(InvalidOptionError, match="chain_frames"):
        engine.stream(None, options(1, chain_frames=32))
    assert engine.metrics()["queued_requests"] == 0
    stream = engine.stream(None, options(1, chain_frames=0, max_frames=4))
    stream.cancel()


@pytest.fixture
def option_engine(make_engine):
    """One engine for every example of the property test below."""
    return make_engine(second_voice=False)


values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(name=st.sampled_from(option_names()), value=values)
def test_property_option_values_are_refused_or_safe(
    option_engine, name: str, value: object
) -> None:
    """Any value is refused with InvalidOptionError, at construction and again at stream(), or
    is a finite number (or None where a default applies) that the engine takes."""
    try:
        GenerationOptions(**{name: value})
        accepted = True
    except InvalidOptionError:
        accepted = False
    if accepted and name == "normalize":
        assert isinstance(value, bool), value
    elif accepted:
        assert value is None or (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ), value
    # This engine runs one flow step: any other count is refused at stream() too.
    expected = accepted and (name != "flow_steps" or value == 1)

    async def opens() -> bool:
        opts = GenerationOptions()
        setattr(opts, name, value)
        try:
            stream = option_engine.stream(None, opts)
        except InvalidOptionError:
            return False
        stream.cancel()
        return True

    assert asyncio.run(opens()) == expected
    assert option_engine.metrics()["generate_batches"] == 0


def test_option_lists_derive_from_generation_options() -> None:
    """The server's, the Pipecat service's and the LiveKit plugin's options are its fields."""
    import inspect

    from livekit.plugins import intone as livekit_intone

    from intone.provider import pipecat, protocol

    names = [name for name in option_names() if name != "flow_steps"]  # fixed per engine
    assert list(protocol.STREAM_OPTIONS) == names
    assert list(pipecat.GENERATION_FIELDS) == names
    assert set(names) <= set(inspect.signature(livekit_intone.TTS.__init__).parameters)
    assert set(names) <= set(inspect.signature(livekit_intone.TTS.update_options).parameters)


# ---- device correctness


def test_steps_mix_no_host_tensor_into_device_math(tiny_model: LoadedModel) -> None:
    """The runner's prefill, AR step and decode step on the `meta` device: a host tensor meeting a
    device tensor inside a step raises (meta runs no host read-back, so those stay outside)."""
    meta = torch.device("meta")
    runner, requests = scratch_runner(
        tiny_model, meta, batch_buckets=(4,), noise_clamps=(2.0, None)
    )
    blocks, flow_lm = runner.blocks, runner.flow_lm
    for request in requests:
        blocks.extend(request.table, 1)  # the clause's first AR step, taken in the prefill pass
    noise = [runner.draw_noise(r) for r in requests]
    assert all(n.device == meta for n in noise)
    latents, eos = runner.prefill(requests, noise)
    assert latents.device == meta and latents.shape == (2, flow_lm.latent_dim)
    assert eos.device == meta and eos.dtype == torch.bool and eos.shape == (2,)
    for request in requests:
        blocks.extend(request.table, 1)
    noise = [runner.draw_noise(r) for r in requests]
    latents, eos = runner.generate(requests, noise)
    assert latents.device == meta and latents.shape == (2, flow_lm.latent_dim)
    assert eos.device == meta and eos.dtype == torch.bool and eos.shape == (2,)
    slots = [runner.decoder_states.acquire() for _ in requests]
    audio = runner.decode(slots, latents[:, None])
    assert audio.device == meta and audio.shape == (2, runner.model.samples_per_frame)


def test_a_decode_split_across_cores_equals_one_part_and_fails_whole(
    tiny_model: LoadedModel,
) -> None:
    """A decode batch run as one part per core gives the audio of one part, and a part that
    fails advances no row's history: the retry then gives the audio the call would have given."""
    model = tiny_model.model
    cpu = torch.device("cpu")
    one, split = (
        ModelRunner(model, BlockManager(4, 16), 8, 1, cpu, decode_parts=parts) for parts in (1, 2)
    )
    slots = [[runner.decoder_states.acquire() for _ in range(8)] for runner in (one, split)]
    gen = torch.Generator().manual_seed(0)
    frames = [torch.randn(8, 1, model.flow_lm.latent_dim, generator=gen) for _ in range(3)]
    decode = split.decoder.decode
    armed = False

    def faulty_decode(latents: torch.Tensor, state: dict) -> torch.Tensor:
        # The second part runs on the runner's pool thread.
        if armed and threading.current_thread().name.startswith("intone-decode"):
            raise InjectedFault("decode part")
        return decode(latents, state)

    split.decoder.decode = faulty_decode
    try:
        for step, latents in enumerate(frames):
            want = one.decode(slots[0], latents)
            if step == 1:
                before = {k: v.clone() for k, v in split.decoder_states.rows.items()}
                armed = True
                with pytest.raises(InjectedFault):
                    split.decode(slots[1], latents)
                armed = False
                for name, tensor in split.decoder_states.rows.items():
                    if name not in split.decoder_states.in_place:
                        assert torch.equal(tensor, before[name]), f"{name} advanced"
            got = split.decode(slots[1], latents)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    finally:
        one.close()
        split.close()


@pytest.mark.parametrize(
    "bad",
    [
        {"device": "tpu"},
        {"device": "meta"},
        {"torch_threads": -3},
        {"kv_memory_mb": 0},
        {"kv_memory_mb": float("nan")},
        {"num_pages": 0},
        {"max_active": 0},
        {"lead_s": -1.0},
        {"pacing": "fast"},
        {"idle_timeout_s": float("nan")},
        {"dtype": "int4"},
    ]
    + ([] if torch.cuda.is_available() else [{"device": "cuda"}]),
)
def test_a_bad_engine_config_is_refused_naming_its_field(tiny_model, bad: dict) -> None:
    """ValueError naming the field, before the engine builds anything (not torch's own error
    from deep inside, nor a full KV pool for a pool of no memory)."""
    (name,) = bad
    with pytest.raises(ValueError, match=f"EngineConfig.{name}"):
        Engine(tiny_model, EngineConfig(**bad))
