"""One long request on an idle `intone serve`: how many times real time it renders, per pacing.

For each `--pacing` mode, a fresh server (`intone serve --pacing MODE`, a subprocess, otherwise
its defaults), one warm-up request, then one request of `--chars` characters (about 20 s of audio
at 2,500 on the generated checkpoints; the model's own EOS on both endpoints, which take the same
text) over the WebSocket (`start` with `end: true`, the client reading as fast as it can,
never reporting playback) and one over `POST /v1/audio/speech` (raw PCM, read as it streams).
Reported per endpoint: audio seconds, wall seconds from the request to its last byte, and x real
time (audio / wall). This is issue 52's "idle server, one request of ~20 s" check: `yield` should
render several times real time, `hold` at real time at best (the listener's clock without reports).

    python bench/idle_request.py --model /tmp/full-ckpt --pacing hold,yield --out results.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PROMPTS, SEED, machine_info, round_floats  # noqa: E402
from server_process import ServerProcess, free_port  # noqa: E402

VOICE = "bench"


def long_text(chars: int) -> str:
    """Sentences of the bench prompts, repeated up to about `chars` characters."""
    words, total = [], 0
    while total < chars:
        for prompt in PROMPTS:
            words.append(prompt)
            total += len(prompt) + 1
            if total >= chars:
                break
    return " ".join(words)


async def over_websocket(base: str, text: str) -> tuple[float, int, dict]:
    from intone.provider.client import IntoneClient

    client = IntoneClient(base)
    await client.connect()
    try:
        started = time.perf_counter()
        stream = await client.stream(
            voice=VOICE,
            format="pcm_s16le",
            options={"seed": SEED},
            text=text,
            end=True,
        )
        samples = 0
        async for pcm in stream:
            samples += len(pcm) // 2
        return time.perf_counter() - started, samples, dict(stream.metrics or {})
    finally:
        await client.close()


async def over_http(base: str, text: str) -> tuple[float, int]:
    import httpx

    body = {"model": "tts-1", "input": text, "voice": VOICE, "response_format": "pcm"}
    samples = 0
    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        async with client.stream("POST", f"{base}/v1/audio/speech", json=body) as response:
            response.raise_for_status()
            async for chunk in response.aiter_bytes():
                samples += len(chunk) // 2
        return time.perf_counter() - started, samples


async def run_mode(args: argparse.Namespace, pacing: str, workdir: Path) -> dict:
    import httpx

    voices = workdir / "voices"
    voices.mkdir(exist_ok=True)
    shutil.copy(args.voice, voices / f"{VOICE}{Path(args.voice).suffix}")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    exe = shutil.which("intone") or str(Path(sys.executable).parent / "intone")
    cmd = [exe, "serve", "--model", args.model, "--voices", str(voices), "--port", str(port)]
    cmd += ["--fallback-preset", "none", "--pacing", pacing]
    if args.max_active:
        cmd += ["--max-active", args.max_active]
    server = ServerProcess(cmd, f"{base}/healthz", workdir / f"server-{pacing}.log")
    await server.start()
    try:
        await over_websocket(base, PROMPTS[0])  # warm-up
        text = long_text(args.chars)
        rate = 24000
        ws_wall, ws_samples, ws_metrics = await over_websocket(base, text)
        http_wall, http_samples = await over_http(base, text)
        stats = httpx.get(f"{base}/stats", timeout=10).json()["engine"]
    finally:
        await server.stop()
    result: dict = {"pacing": pacing, "chars": len(text)}
    for name, wall, samples in (
        ("websocket", ws_wall, ws_samples),
        ("openai", http_wall, http_samples),
    ):
        audio = samples / rate
        result[name] = {"audio_s": audio, "wall_s": wall, "x_real_time": audio / wall}
    result["websocket"]["yielded_s"] = ws_metrics.get("yielded_seconds")
    result["engine"] = {
        key: stats.get(key)
        for key in ("max_active", "yielded_seconds", "pacing_paused_seconds", "admission")
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint dir (24 kHz model)")
    parser.add_argument("--voice", help="voice prompt (default: the checkpoint's default.wav)")
    parser.add_argument("--pacing", default="hold,yield", help="comma-separated modes")
    parser.add_argument("--chars", type=int, default=2500, help="characters of the long request")
    parser.add_argument("--max-active", default=None, help="passed to intone serve (default auto)")
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    args = parser.parse_args()
    args.voice = args.voice or str(Path(args.model) / "voices" / "default.wav")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for pacing in args.pacing.split(","):
            run = asyncio.run(run_mode(args, pacing, Path(tmp)))
            runs.append(run)
            for endpoint in ("websocket", "openai"):
                r = run[endpoint]
                print(
                    f"{pacing:6s} {endpoint:9s} {r['audio_s']:6.1f} s audio in"
                    f" {r['wall_s']:6.1f} s: {r['x_real_time']:.2f}x real time",
                    flush=True,
                )
    result = round_floats({"machine": machine_info(), "model": args.model, "runs": runs})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
