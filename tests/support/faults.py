"""Fault injection for the engine suites: make one stage raise on the calls that involve one
request (the culprit) among `STREAMS` concurrent streams, and collect every stream's outcome.
"""

from __future__ import annotations

import asyncio
import time

import torch

from intone.engine import GenerationOptions, Stream

from support.engine import (
    SECOND_VOICE,
    TEXTS,
    TIMEOUT,
    Outcome,
    Reference,
    check_outcome,
    on_prompt_passes,
    options,
)

STREAMS = 6
CULPRIT = 2


class InjectedFault(Exception):
    pass


def involves(requests, culprit) -> bool:
    return any(r is culprit for r in requests)


def inject(engine, stage: str, culprit) -> dict:
    """Make `stage` raise on every call involving the culprit from its `after`-th call on (so
    the culprit has produced something first), batched calls and the row-by-row retry alike."""
    counts = {"calls": 0, "raised": 0}
    calls_before = {
        "start_clause": 1,
        "prefill": 1,
        "ar_step": 3,
        "noise": 3,
        "decode": 2,
        "first_frame": 0,  # it is the culprit's first audio: nothing comes before it
    }
    after = calls_before[stage]

    def trip(involved: bool) -> None:
        if involved:
            counts["calls"] += 1
            if counts["calls"] > after:
                counts["raised"] += 1
                raise InjectedFault(stage)

    if stage == "start_clause":
        start_clause = engine.scheduler.start_clause

        def faulty_start(request):
            trip(request is culprit)
            return start_clause(request)

        engine.scheduler.start_clause = faulty_start
    elif stage == "prefill":
        # A prompt pass joined with an AR step that fails runs again apart: there too.
        on_prompt_passes(engine, lambda requests: trip(involves(requests, culprit)))
    elif stage == "ar_step":
        generate, joint = engine.runner.generate, engine.runner.prefill_and_generate

        def faulty_generate(requests, noise):
            trip(involves(requests, culprit))
            return generate(requests, noise)

        def faulty_joint(prefill, prefill_noise, requests, noise):
            trip(involves(requests, culprit))
            return joint(prefill, prefill_noise, requests, noise)

        engine.runner.generate, engine.runner.prefill_and_generate = faulty_generate, faulty_joint
    elif stage == "noise":
        draw_noise = engine.runner.draw_noise

        def faulty_noise(request):
            trip(request is culprit)
            return draw_noise(request)

        engine.runner.draw_noise = faulty_noise
    elif stage == "decode":
        decode = engine.runner.decode

        def faulty_decode(slots, latents):
            trip(culprit.decoder_slot is not None and culprit.decoder_slot in slots)
            return decode(slots, latents)

        engine.runner.decode = faulty_decode
    elif stage == "first_frame":
        # The culprit's first frame fails, whichever thread decodes it: the AR thread (while the
        # decoder is busy: slowed here), outside the pool, from latents alone, so the culprit's
        # is known by its value, taken from the prefill pass that computed it; or the decoder.
        decode = engine.runner.decode
        decode_detached = engine.runner.decode_detached
        first: list[torch.Tensor] = []

        def record_first(requests, latents) -> None:
            first.extend(latents[i] for i, r in enumerate(requests) if r is culprit)

        def faulty_decode_detached(latents, histories):
            trip(bool(first) and any(torch.equal(row[0], first[0]) for row in latents))
            return decode_detached(latents, histories)

        def faulty_slow_decode(slots, latents):
            time.sleep(0.03)
            trip(culprit.frames_delivered == 0 and culprit.decoder_slot in slots)
            return decode(slots, latents)

        on_prompt_passes(engine, lambda requests: None, record_first)
        engine.runner.decode_detached = faulty_decode_detached
        engine.runner.decode = faulty_slow_decode
    return counts


async def collect(stream: Stream) -> tuple[Outcome, BaseException | None]:
    outcome = Outcome()
    try:
        async with asyncio.timeout(TIMEOUT):
            async for event in stream:
                outcome.events.append(event)
    except TimeoutError:
        raise
    except Exception as e:
        return outcome, e
    return outcome, None


def jobs() -> list[tuple[str, str, GenerationOptions]]:
    return [
        (
            TEXTS[2] if i == CULPRIT else TEXTS[i % len(TEXTS)],
            ("default", SECOND_VOICE)[i % 2],
            options(300 + i, 0.3, max_frames=8),
        )
        for i in range(STREAMS)
    ]


def open_streams(engine) -> list[Stream]:
    return [engine.stream(voice, opts) for _, voice, opts in jobs()]


async def push_all(streams: list[Stream]) -> list[tuple[Outcome, BaseException | None]]:
    for stream, (text, _, _) in zip(streams, jobs(), strict=True):
        stream.push_text(text)
        stream.end_input()
    return await asyncio.gather(*[collect(s) for s in streams])


def check_bystanders(results, reference: Reference, skip: int | None) -> None:
    for i, ((text, voice, opts), (outcome, error)) in enumerate(zip(jobs(), results, strict=True)):
        if i == skip:
            continue
        assert error is None, f"stream {i} ended with {error!r}"
        check_outcome(outcome, reference, text, voice, opts, f"stream {i}")
