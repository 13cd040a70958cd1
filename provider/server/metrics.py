"""Server-side metrics (connections, streams, errors), next to the engine's own."""

from __future__ import annotations

import threading
from collections import Counter as Tally
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class ServerMetrics:
    def __init__(self, connections: Callable[[], int], streams: Callable[[], int]):
        self._lock = threading.Lock()
        self._outcomes: Tally[str] = Tally()
        self._errors: Tally[str] = Tally()
        self._connections_total = 0
        self._connections = connections
        self._streams = streams
        self.draining = False

        self.registry = CollectorRegistry()
        Gauge(
            "intone_server_connections", "Open WebSocket connections", registry=self.registry
        ).set_function(connections)
        Gauge(
            "intone_server_streams",
            "Streams in flight (WebSocket and HTTP)",
            registry=self.registry,
        ).set_function(streams)
        Gauge(
            "intone_server_draining", "1 while shutting down", registry=self.registry
        ).set_function(lambda: float(self.draining))
        self._p_connections = Counter(
            "intone_server_connections_opened",
            "WebSocket connections opened",
            registry=self.registry,
        )
        self._p_streams = Counter(
            "intone_server_streams_finished",
            "Finished streams by API and outcome",
            ["api", "outcome"],
            registry=self.registry,
        )
        self._p_errors = Counter(
            "intone_server_errors", "Error events and responses by code", ["code"],
            registry=self.registry,
        )  # fmt: skip
        self._p_ttfb = Histogram(
            "intone_server_first_audio_seconds",
            "From the first text received to the first audio handed to the socket",
            ["api"],
            buckets=(0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2),
            registry=self.registry,
        )

    def connection_opened(self) -> None:
        with self._lock:
            self._connections_total += 1
        self._p_connections.inc()

    def stream_finished(self, api: str, outcome: str) -> None:
        with self._lock:
            self._outcomes[f"{api}_{outcome}"] += 1
        self._p_streams.labels(api, outcome).inc()

    def error(self, code: str) -> None:
        with self._lock:
            self._errors[code] += 1
        self._p_errors.labels(code).inc()

    def first_audio(self, api: str, seconds: float) -> None:
        self._p_ttfb.labels(api).observe(seconds)

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "connections": self._connections(),
                "connections_opened": self._connections_total,
                "streams": self._streams(),
                "streams_finished": dict(self._outcomes),
                "errors": dict(self._errors),
                "draining": self.draining,
            }

    def prometheus(self) -> bytes:
        return generate_latest(self.registry)
