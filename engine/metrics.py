"""Engine metrics: a plain dict for callers and tests, Prometheus text for scrapers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from intone.engine.sequence import RequestMetrics

STAGES = ("prefill", "generate", "decode")
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


class EngineMetrics:
    def __init__(self, gauges: dict[str, Callable[[], float]]):
        self.started_at = time.perf_counter()
        self._lock = threading.Lock()
        self._gauges = gauges
        self._batches = {stage: 0 for stage in STAGES}
        self._batch_rows = {stage: 0 for stage in STAGES}
        self._batch_histogram = {stage: [0] * len(BATCH_BUCKETS) for stage in STAGES}
        self._audio_seconds = 0.0
        self._completed = 0
        self._cancelled = 0

        self.registry = CollectorRegistry()
        self._p_batch = Histogram(
            "intone_batch_size",
            "Rows per engine step",
            ["stage"],
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self._p_requests = Counter(
            "intone_requests", "Finished requests", ["status"], registry=self.registry
        )
        self._p_audio = Counter("intone_audio_seconds", "Audio produced", registry=self.registry)
        self._p_ttfa = Histogram(
            "intone_ttfa_seconds",
            "Time to first audio",
            buckets=(0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2),
            registry=self.registry,
        )
        self._p_rtf = Histogram(
            "intone_rtf",
            "Real-time factor per request",
            buckets=(0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0),
            registry=self.registry,
        )
        for name, read in gauges.items():
            Gauge(f"intone_{name}", name.replace("_", " "), registry=self.registry).set_function(
                read
            )

    def batch(self, stage: str, rows: int) -> None:
        with self._lock:
            self._batches[stage] += 1
            self._batch_rows[stage] += rows
            bucket = next((i for i, b in enumerate(BATCH_BUCKETS) if rows <= b), -1)
            self._batch_histogram[stage][bucket] += 1
        self._p_batch.labels(stage).observe(rows)

    def audio(self, seconds: float) -> None:
        with self._lock:
            self._audio_seconds += seconds
        self._p_audio.inc(seconds)

    def finished(self, request: RequestMetrics, cancelled: bool) -> None:
        with self._lock:
            if cancelled:
                self._cancelled += 1
            else:
                self._completed += 1
        self._p_requests.labels("cancelled" if cancelled else "completed").inc()
        if not cancelled and request.ttfa is not None:
            self._p_ttfa.observe(request.ttfa)
        if not cancelled and request.rtf is not None:
            self._p_rtf.observe(request.rtf)

    def reset_rates(self) -> None:
        """Restart the batch means and throughputs, e.g. after warm-up."""
        with self._lock:
            self.started_at = time.perf_counter()
            for stage in STAGES:
                self._batches[stage] = self._batch_rows[stage] = 0
                self._batch_histogram[stage] = [0] * len(BATCH_BUCKETS)
            self._audio_seconds = 0.0
            self._completed = self._cancelled = 0

    def snapshot(self) -> dict:
        with self._lock:
            elapsed = max(time.perf_counter() - self.started_at, 1e-9)
            result: dict = {name: read() for name, read in self._gauges.items()}
            for stage in STAGES:
                batches = self._batches[stage]
                result[f"{stage}_batches"] = batches
                result[f"{stage}_batch_mean"] = (
                    self._batch_rows[stage] / batches if batches else 0.0
                )
                result[f"{stage}_batch_histogram"] = dict(
                    zip(map(str, BATCH_BUCKETS), self._batch_histogram[stage], strict=True)
                )
            result["audio_seconds"] = self._audio_seconds
            result["audio_throughput"] = self._audio_seconds / elapsed
            result["requests_completed"] = self._completed
            result["requests_cancelled"] = self._cancelled
            result["request_throughput"] = self._completed / elapsed
            return result

    def prometheus(self) -> bytes:
        return generate_latest(self.registry)
