"""Server-side metrics (connections, streams, errors), next to the engine's own."""

from __future__ import annotations

import threading
from collections import Counter as Tally
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric


class EnginesCollector:
    """Every served model's engine metrics as one set of families, each sample labelled with its
    model: the engines' registries hold the same metric names, which one exposition may not
    repeat."""

    def __init__(self, engines: Callable[[], list[tuple[str, CollectorRegistry]]]):
        self._engines = engines

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for model, registry in self._engines():
            for family in registry.collect():
                out = merged.get(family.name)
                if out is None:
                    out = Metric(family.name, family.documentation, family.type, family.unit)
                    merged[family.name] = out
                out.samples.extend(
                    sample._replace(labels={"model": model, **sample.labels})
                    for sample in family.samples
                )
        return iter(merged.values())


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
