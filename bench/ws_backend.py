"""The `ws` mode: intone's WebSocket server (`intone serve`, a subprocess) through its client.

The server runs the same engine as `batched` (default EngineConfig: `intone serve` has no dtype
option), so ws minus batched is the transport's cost: JSON control messages, PCM over WebSocket,
a second process, and the client's own CPU on the same cores.

`ws-ray` runs the same server as one Ray Serve replica behind Ray's HTTP proxy (`intone serve
--ray --replicas 1`, a local Ray cluster): ws-ray minus ws is the proxy's cost. One stream per
connection there (`--ray-streams-per-connection 1`), so Ray admits as many connections as the
engine has rows (16); those connections fill the replica, so ws-ray reports no stage batch
means (its /stats request would queue behind them).

Connections follow the production advice: opened once before measuring and reused; one
connection per concurrent client slot (as many as the sweep's largest concurrency), requests
spread round-robin over them. Audio is 16-bit PCM at the model's rate (no resampling).
"""

from __future__ import annotations

import itertools
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from common import NO_EOS
from server_process import ServerProcess, free_port

from intone.engine.metrics import STAGES

VOICE = "bench"


class WsBackend:
    trailing_padding = 0

    def __init__(
        self,
        model: str,
        voice_wav: str,
        device: str,
        workdir: Path,
        connections: int = 16,
        ray: bool = False,
        serve_options: dict | None = None,
    ):
        """`serve_options`: `intone serve` flags by EngineConfig name (max_active, pacing)."""
        self.model, self.voice_wav, self.device, self.workdir = model, voice_wav, device, workdir
        self.connections = connections
        self.ray = ray
        self.serve_options = serve_options or {}
        self._stages0: dict | None = None
        self._server_ttfa: dict[int, float] = {}  # seed -> the `done` event's server_ttfa

    async def start(self) -> None:
        from intone.provider.client import IntoneClient

        voices = self.workdir / "ws-voices"
        voices.mkdir(exist_ok=True)
        shutil.copy(self.voice_wav, voices / f"{VOICE}{Path(self.voice_wav).suffix}")
        port = free_port()
        exe = shutil.which("intone") or str(Path(sys.executable).parent / "intone")
        cmd = [exe, "serve", "--model", self.model, "--voices", str(voices)]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--device", self.device]
        cmd += ["--fallback-preset", "none"]
        cmd += ["--max-streams-per-client", "0"]  # every bench client is one address
        for name, value in self.serve_options.items():
            cmd += [f"--{name.replace('_', '-')}", str(value)]
        if self.ray:
            cmd += ["--ray", "--replicas", "1", "--ray-streams-per-connection", "1"]
        self.base = f"http://127.0.0.1:{port}"
        log = self.workdir / ("ws-ray-server.log" if self.ray else "ws-server.log")
        self.server = ServerProcess(cmd, f"{self.base}/healthz", log)
        await self.server.start()
        self.clients = []
        for _ in range(self.connections):
            client = IntoneClient(self.base)
            await client.connect()
            self.clients.append(client)
        self._next = itertools.cycle(self.clients)

    async def request(self, text: str, seed: int) -> AsyncIterator[int]:
        client = next(self._next)
        stream = await client.stream(
            voice=VOICE,
            format="pcm_s16le",
            options={"eos_threshold": NO_EOS, "seed": seed},
            text=text,
            end=True,
        )
        finished = False
        try:
            async for pcm in stream:
                yield len(pcm) // 2
            finished = True
            ttfa = (stream.metrics or {}).get("server_ttfa")
            if ttfa is not None:
                self._server_ttfa[seed] = ttfa
        finally:
            if not finished:
                await stream.cancel(wait=False)

    def server_ttfa(self, seed: int) -> float | None:
        """The server's own time from the request's text to its first audio, in seconds."""
        return self._server_ttfa.pop(seed, None)

    def _engine_stats(self) -> dict | None:
        import httpx

        if self.ray:
            # The benchmark's connections take every slot Ray gives the replica (one per engine
            # row): a /stats request would wait behind them. No stage batch means for ws-ray.
            return None
        try:
            return httpx.get(f"{self.base}/stats", timeout=10).json()["engine"]
        except Exception:
            return None

    def reset_stage_metrics(self) -> None:
        self._stages0 = self._engine_stats()

    def stage_metrics(self) -> dict | None:
        """Batch means over the level, from the server's counters (deltas of /stats)."""
        now, before = self._engine_stats(), self._stages0
        if now is None or before is None:
            return None
        out = {}
        for stage in STAGES:
            batches = now[f"{stage}_batches"] - before[f"{stage}_batches"]
            rows = (
                now[f"{stage}_batch_mean"] * now[f"{stage}_batches"]
                - before[f"{stage}_batch_mean"] * before[f"{stage}_batches"]
            )
            out[f"{stage}_batches"] = batches
            out[f"{stage}_batch_mean"] = rows / batches if batches else 0.0
        return out

    def server_cpu_seconds(self) -> float | None:
        return self.server.cpu_seconds()

    def info(self) -> dict:
        return {
            "server": "intone serve --ray (1 replica)" if self.ray else "intone serve",
            "server_device": self.device,
            "connections": self.connections,
            "cmd": self.server.cmd,
        }

    async def stop(self) -> None:
        for client in self.clients:
            await client.close()
        # Under Ray the replica drains first (module doc of intone.provider.server.ray_serve).
        await self.server.stop(90 if self.ray else 20)
