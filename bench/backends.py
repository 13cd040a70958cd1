"""The serving approaches the runner compares, behind one interface.

Each backend: `await start()`, `request(text, seed)` -> async iterator of chunk sizes in samples,
`stage_metrics()` (engine batch means since `reset_stage_metrics()`, where there is an engine to
ask), `server_cpu_seconds()` (network modes), `await stop()`.

- sequential:  one request at a time through the single-request path (engine/generate.py) in one
               worker thread; later requests queue (FIFO).
- interleaved: requests take turns, each model call serving one request. An AR thread round-robins
               over the active requests' single-request latent generators
               (`generate_latents`: one prefill or one AR step per turn), a decoder thread decodes
               their frames one per call, each request with its own Mimi state. This is the
               engine's own two-thread pipeline with batch size 1 everywhere: interleaving without
               batching, so the difference from `batched` is the batching alone.
- batched:     the engine (`Engine`), default EngineConfig.
- batched-fast: the engine with `common.fast_engine_options()` (bf16 where the engine offers it).
- batched-float32: the engine in float32 throughout (`EngineConfig.dtype="float32"`).
- reference:   `pocket-tts serve` (the reference package's FastAPI server) on the same checkpoint
               over HTTP streaming, one keep-alive connection per client.
- ws:          intone's WebSocket server (`intone serve`) through `intone.provider.client`.
- ws-ray:      the same through Ray Serve's proxy: `intone serve --ray`, one replica.
"""

from __future__ import annotations

import asyncio
import os
import queue
import shutil
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from common import NO_EOS
from server_process import ServerProcess, free_port

_DONE = object()


def _poster(loop: asyncio.AbstractEventLoop, q: asyncio.Queue) -> Callable[[object], None]:
    return lambda item: loop.call_soon_threadsafe(q.put_nowait, item)


async def _drain(q: asyncio.Queue) -> AsyncIterator[int]:
    while (item := await q.get()) is not _DONE:
        if isinstance(item, BaseException):
            raise item
        yield item


class _LocalModel:
    trailing_padding = 0

    def __init__(self, model: str, voice_wav: str, device: str):
        self.model_path, self.voice_wav, self.device = model, voice_wav, device

    def _load(self) -> None:
        from intone.engine.loading import load_model
        from intone.engine.voices import load_voice

        self.loaded = load_model(self.model_path, device=self.device)
        self.voice = load_voice(self.loaded.model, "bench", self.voice_wav)

    def _options(self, seed: int):
        from intone.engine.options import GenerationOptions

        return GenerationOptions(eos_threshold=NO_EOS, seed=seed)

    def _clauses(self, text: str) -> list[str]:
        from intone.engine.text import split_clauses

        return split_clauses(self.loaded.tokenizer, text)

    def stage_metrics(self) -> dict | None:
        return None

    def reset_stage_metrics(self) -> None:
        pass

    def server_cpu_seconds(self) -> float | None:
        return None

    def info(self) -> dict:
        import torch

        return {"torch_threads": torch.get_num_threads()}


class SequentialBackend(_LocalModel):
    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._worker, name="sequential", daemon=True)
        self._thread.start()

    def _worker(self) -> None:
        from intone.engine.generate import generate

        while (job := self._jobs.get()) is not None:
            text, seed, post = job
            try:
                clauses = self._clauses(text)
                for frame in generate(self.loaded, self.voice, clauses, self._options(seed)):
                    post(frame.shape[-1])
                post(_DONE)
            except Exception as e:
                post(e)

    async def request(self, text: str, seed: int) -> AsyncIterator[int]:
        q: asyncio.Queue = asyncio.Queue()
        self._jobs.put((text, seed, _poster(asyncio.get_running_loop(), q)))
        async for n in _drain(q):
            yield n

    async def stop(self) -> None:
        self._jobs.put(None)
        await asyncio.to_thread(self._thread.join, 30)


class _Job:
    def __init__(self, latents, post):
        self.latents = latents  # the single-request path's latent generator
        self.post = post
        self.state = None  # Mimi decoder state, decoder thread only
        self.frames = 0


class InterleavedBackend(_LocalModel):
    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        self._inbox: queue.Queue = queue.Queue()
        self._frames: queue.Queue = queue.Queue()
        self._threads = [
            threading.Thread(target=self._ar_loop, name="interleaved-ar", daemon=True),
            threading.Thread(target=self._decode_loop, name="interleaved-dec", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _ar_loop(self) -> None:
        from intone.engine.generate import generate_latents

        active: list[_Job] = []
        while True:
            try:  # block only when there is nothing to do
                while True:
                    job = self._inbox.get(block=not active)
                    if job is None:
                        self._frames.put(None)
                        return
                    text, seed, post = job
                    gen = generate_latents(
                        self.loaded, self.voice, self._clauses(text), self._options(seed)
                    )
                    active.append(_Job(gen, post))
            except queue.Empty:
                pass
            for job in list(active):  # one turn each: one model call for one request
                try:
                    _, latent = next(job.latents)
                    self._frames.put((job, latent))
                except StopIteration:
                    active.remove(job)
                    self._frames.put((job, _DONE))
                except Exception as e:
                    active.remove(job)
                    self._frames.put((job, e))

    def _decode_loop(self) -> None:
        import torch

        from intone.engine.generate import fade_in

        model = self.loaded.model
        while (item := self._frames.get()) is not None:
            job, latent = item
            if latent is _DONE or isinstance(latent, BaseException):
                job.post(latent)
                continue
            try:
                with torch.no_grad():
                    if job.state is None:
                        job.state = model.mimi.init_decoder_state(1, model.device)
                    z = model.flow_lm.denormalize(latent)[None, None]
                    audio = model.mimi.decode(z, job.state)[0, 0]
                    if job.frames == 0:
                        audio = fade_in(audio, model.sample_rate)
                    audio = audio.cpu()
                job.frames += 1
                job.post(audio.shape[-1])
            except Exception as e:
                job.post(e)

    async def request(self, text: str, seed: int) -> AsyncIterator[int]:
        q: asyncio.Queue = asyncio.Queue()
        self._inbox.put((text, seed, _poster(asyncio.get_running_loop(), q)))
        async for n in _drain(q):
            yield n

    async def stop(self) -> None:
        self._inbox.put(None)
        for thread in self._threads:
            await asyncio.to_thread(thread.join, 30)


class EngineBackend(_LocalModel):
    def __init__(self, model: str, voice_wav: str, device: str, options: dict):
        super().__init__(model, voice_wav, device)
        self.engine_options = options
        self._streams: dict = {}  # seed -> the engine stream in flight

    async def start(self) -> None:
        from intone.engine import Engine, EngineConfig
        from intone.engine.loading import load_model

        def build():
            loaded = load_model(self.model_path, device=self.device)
            engine = Engine(loaded, EngineConfig(device=self.device, **self.engine_options))
            engine.add_voice("bench", self.voice_wav)
            engine.start()
            engine.prepare_traces()  # as the server and the plugins' prewarm do
            return engine

        self.engine = await asyncio.to_thread(build)

    async def request(self, text: str, seed: int) -> AsyncIterator[int]:
        from intone.engine import AudioChunk

        stream = self.engine.stream(voice="bench", options=self._options(seed))
        self._streams[seed] = stream
        finished = False
        try:
            stream.push_text(text)
            stream.end_input()
            async for event in stream:
                if isinstance(event, AudioChunk):
                    yield len(event.samples)
            finished = True
        finally:
            del self._streams[seed]
            if not finished:
                stream.cancel()

    def generated(self, seed: int) -> float | None:
        """Seconds of audio the engine has generated for the request `seed`, so far."""
        stream = self._streams.get(seed)
        if stream is None:
            return None
        frame_s = self.engine.model.samples_per_frame / self.engine.sample_rate
        return stream.request.frames_generated * frame_s

    def stage_metrics(self) -> dict | None:
        m = self.engine.metrics()
        return {
            key: m[key]
            for key in m
            if key.endswith(("_batch_mean", "_batches", "_batch_histogram"))
        }

    def reset_stage_metrics(self) -> None:
        self.engine.reset_rates()

    def info(self) -> dict:
        import dataclasses

        return {**super().info(), "engine_config": dataclasses.asdict(self.engine.config)}

    async def stop(self) -> None:
        await asyncio.to_thread(self.engine.close)


# ---- network modes


class ReferenceBackend:
    """`pocket-tts serve`, CPU only (it has no device option), driven over HTTP streaming.

    EOS is disabled through a copy of the config with `default_eos_threshold`, the voice is the
    same WAV (`--default-voice`). The server writes the WAV header before any audio, so the first
    chunk counted is the first PCM byte; it appends 200 ms of silence, left out of the counts.
    """

    def __init__(self, model: str, voice_wav: str, workdir: Path, max_connections: int = 64):
        self.model, self.voice_wav, self.workdir = model, voice_wav, workdir
        self.max_connections = max_connections
        self.trailing_padding = 24_000 * 200 // 1000

    async def start(self) -> None:
        import httpx
        import yaml

        config = yaml.safe_load(Path(self.model, "config.yaml").read_text())
        config["default_eos_threshold"] = NO_EOS
        config_path = self.workdir / "reference-config.yaml"
        config_path.write_text(yaml.safe_dump(config))
        port = free_port()
        exe = shutil.which("pocket-tts") or str(Path(sys.executable).parent / "pocket-tts")
        cmd = [exe, "serve", "--config", str(config_path), "--default-voice", self.voice_wav]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
        base = f"http://127.0.0.1:{port}"
        self.server = ServerProcess(cmd, f"{base}/health", self.workdir / "reference-server.log")
        await self.server.start()
        limits = httpx.Limits(
            max_connections=self.max_connections, max_keepalive_connections=self.max_connections
        )
        # One client session for the whole run: connections are opened once and reused.
        self.client = httpx.AsyncClient(base_url=base, timeout=None, limits=limits)

    async def request(self, text: str, seed: int) -> AsyncIterator[int]:
        async with self.client.stream("POST", "/tts", data={"text": text}) as response:
            response.raise_for_status()
            header = b""
            carry = 0  # a byte of an int16 sample split across chunks
            in_data = False
            async for chunk in response.aiter_raw():
                if not in_data:
                    header += chunk
                    at = header.find(b"data")
                    if at < 0 or len(header) < at + 8:
                        continue
                    in_data = True
                    chunk = header[at + 8 :]
                total = carry + len(chunk)
                carry = total % 2
                if total // 2:
                    yield total // 2

    def stage_metrics(self) -> dict | None:
        return None

    def reset_stage_metrics(self) -> None:
        pass

    def server_cpu_seconds(self) -> float | None:
        return self.server.cpu_seconds()

    def info(self) -> dict:
        return {"server": "pocket-tts serve", "server_device": "cpu", "cmd": self.server.cmd}

    async def stop(self) -> None:
        await self.client.aclose()
        await self.server.stop()


def make_backend(
    mode: str, model: str, voice_wav: str, device: str, workdir: Path, engine_options: dict
):
    """`engine_options`: the EngineConfig fields of the engine modes (none for `batched`)."""
    if mode == "sequential":
        return SequentialBackend(model, voice_wav, device)
    if mode == "interleaved":
        return InterleavedBackend(model, voice_wav, device)
    if mode in ("batched", "batched-fast", "batched-paced", "batched-float32"):
        return EngineBackend(model, voice_wav, device, engine_options)
    if mode == "reference":
        return ReferenceBackend(model, voice_wav, workdir)
    if mode in ("ws", "ws-ray"):
        from ws_backend import WsBackend

        serve_options = {
            k: engine_options[k] for k in ("max_active", "pacing") if k in engine_options
        }
        return WsBackend(
            model, voice_wav, device, workdir, ray=mode == "ws-ray", serve_options=serve_options
        )
    raise ValueError(f"unknown mode {mode!r}")


def temp_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="intone-bench-"))


def cpu_count() -> int:
    return os.cpu_count() or 1
