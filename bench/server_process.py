"""A server under test as a subprocess: started, waited for, its CPU time read, stopped.

Shared by the reference backend and the WebSocket backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess: started, waited for, its CPU time read, stopped."""

    def __init__(self, cmd: list[str], health_url: str, log_path: Path, env: dict | None = None):
        self.cmd, self.health_url, self.log_path = cmd, health_url, log_path
        self.env = env

    async def start(self, timeout: float = 300) -> None:
        import httpx

        self.log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env
        )
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient() as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.cmd[0]} exited with {self.proc.returncode}; log: {self.log_path}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.health_url, timeout=2)).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server not up after {timeout} s; log: {self.log_path}")
                await asyncio.sleep(0.5)

    def cpu_seconds(self) -> float | None:
        try:
            import psutil

            procs = [psutil.Process(self.proc.pid)]
            procs += procs[0].children(recursive=True)
            return sum(p.cpu_times().user + p.cpu_times().system for p in procs)
        except Exception:
            return None

    async def stop(self, timeout: float = 20) -> None:
        self.proc.terminate()
        try:
            await asyncio.to_thread(self.proc.wait, timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)
        self.log.close()
