"""Engine metrics: a plain dict for callers and tests, Prometheus text for scrapers.

Besides the batch sizes and throughput: how long AR steps and decode calls take (histograms),
how far streams run ahead of playback (the distribution of their leads), how long pacing held
streams back, how much audio streams generated while more than `lead_s` ahead (the compute pacing
"yield" gave them because nobody else needed it), idle timeouts, and streams open against rows
generating.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from intone.engine.request import RequestMetrics

STAGES = ("prefill", "generate", "decode")
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
STEP_SECONDS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
LEAD_QUANTILES = (0.0, 0.5, 0.9, 1.0)


class EngineMetrics:
    def __init__(
        self,
        gauges: dict[str, Callable[[], float]],
        leads: Callable[[], list[float]] = list,
    ):
        """`gauges`: name -> read; `leads`: seconds ahead of playback of every stream with a
        row, read when a snapshot or a scrape asks."""
        self.started_at = time.perf_counter()
        self._lock = threading.Lock()
        self._gauges = gauges
        self._leads = leads
        self._step_seconds = {stage: 0.0 for stage in STAGES}
        self._paced_seconds = 0.0
        self._yielded_seconds = 0.0
        self._idle_timeouts = 0
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
        self._p_step = Histogram(
            "intone_step_seconds",
            "Duration of an AR step, a prefill pass or a decode call",
            ["stage"],
            buckets=STEP_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self._p_paced = Counter(
            "intone_pacing_paused_seconds",
            "Stream-seconds held back by playback pacing",
            registry=self.registry,
        )
        self._p_yielded = Counter(
            "intone_yielded_seconds",
            "Audio generated while more than lead_s ahead of its listener",
            registry=self.registry,
        )
        self._p_idle = Counter(
            "intone_idle_timeouts", "Streams ended by the idle timeout", registry=self.registry
        )
        lead = Gauge(
            "intone_stream_lead_seconds",
            "Seconds of audio ahead of playback, over streams holding a row (quantiles)",
            ["quantile"],
            registry=self.registry,
        )
        for q in LEAD_QUANTILES:
            lead.labels(f"{q:g}").set_function(lambda q=q: self._lead_quantiles().get(q, 0.0))
        for name, read in gauges.items():
            Gauge(f"intone_{name}", name.replace("_", " "), registry=self.registry).set_function(
                read
            )

    def step(self, stage: str, rows: int, seconds: float) -> None:
        """One batched call of `stage` over `rows` rows that took `seconds`."""
        with self._lock:
            self._batches[stage] += 1
            self._batch_rows[stage] += rows
            self._step_seconds[stage] += seconds
            bucket = next((i for i, b in enumerate(BATCH_BUCKETS) if rows <= b), -1)
            self._batch_histogram[stage][bucket] += 1
        self._p_batch.labels(stage).observe(rows)
        self._p_step.labels(stage).observe(seconds)

    def paced(self, seconds: float) -> None:
        """Stream-seconds pacing held back (a held stream counts for each second it waits)."""
        with self._lock:
            self._paced_seconds += seconds
        self._p_paced.inc(seconds)

    def yielded(self, seconds: float) -> None:
        """Audio generated while its stream was more than `lead_s` ahead of its listener."""
        with self._lock:
            self._yielded_seconds += seconds
        self._p_yielded.inc(seconds)

    def idle_timeout(self) -> None:
        with self._lock:
            self._idle_timeouts += 1
        self._p_idle.inc()

    def _lead_quantiles(self) -> dict[float, float]:
        leads = sorted(self._leads())
        if not leads:
            return {}
        return {q: leads[min(len(leads) - 1, int(q * len(leads)))] for q in LEAD_QUANTILES}

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
                self._step_seconds[stage] = 0.0
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
                result[f"{stage}_seconds_mean"] = (
                    self._step_seconds[stage] / batches if batches else 0.0
                )
            result["pacing_paused_seconds"] = self._paced_seconds
            result["yielded_seconds"] = self._yielded_seconds
            result["idle_timeouts"] = self._idle_timeouts
            result["stream_lead_seconds"] = {f"{q:g}": v for q, v in self._lead_quantiles().items()}
            result["audio_seconds"] = self._audio_seconds
            result["audio_throughput"] = self._audio_seconds / elapsed
            result["requests_completed"] = self._completed
            result["requests_cancelled"] = self._cancelled
            result["request_throughput"] = self._completed / elapsed
            return result

    def prometheus(self) -> bytes:
        return generate_latest(self.registry)
