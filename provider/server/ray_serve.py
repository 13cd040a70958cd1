"""`intone serve --ray`: the same ASGI app as Ray Serve replicas, one engine per replica.

Each replica builds its own engine: the deployment class is wrapped with `serve.ingress` and a
*builder* function, which Ray calls on the replica after the class's constructor (a built app or
engine would be pickled and shipped instead). Everything Ray-specific lives here; the app, the
WebSocket protocol, the OpenAI endpoint, voices and drain are the ones `intone serve` runs.

Units. Ray counts a request per HTTP request and per WebSocket *connection*, for the
connection's whole life; intone's unit of capacity is a stream (a generating row). The limits
are derived from the engine's capacity (`ray_limits`): streams per connection are capped under
Ray, and `max_ongoing_requests` is the number of such connections that fill the engine's batch,
so Ray's own admission (a replica at `max_ongoing_requests` refuses, the router tries another)
keeps a full replica from getting new connections. The queue in front of the replicas is bounded
(`max_queued_requests`): past it the proxy answers 503 at once instead of holding a WebSocket
handshake open in silence.

Load. Replicas report engine load (streams open, rows generating, queued, KV pages) both to the
request router (`record_routing_stats`, read by `EngineLoadRouter`, which prefers the least
loaded replica and tries full ones last) and to the autoscaler (`record_autoscaling_stats`, read
by `engine_load_policy`, which sizes the deployment to the summed load over `target_load`).

Health and shutdown. `check_health` fails while the engine is unhealthy or could not be built,
so Ray replaces the replica; the replica then closes its connections (1001), so clients
reconnect to a healthy one. Ray 2.60 has no hook at the start of a replica's graceful stop
(rolling update, scale-down) and waits for open requests (our WebSockets) until its timeout,
then kills the actor. But it only health-checks running replicas, so a replica that hears no
health check for a few periods is being stopped: it drains as `intone serve` does on SIGTERM
(new streams refused, in-flight streams get `drain_timeout` to finish, then 1001), well within
`graceful_shutdown_timeout_s`.

Metrics. Each replica copies its engine's and server's numeric counters into Ray gauges named
`intone_<name>` every `metrics_interval` s; Ray exports them from every node's metrics port with
`application`, `deployment` and `replica` labels (docs/deploy.md), so Prometheus sees every
replica, not one picked by the proxy.

Ray is an optional dependency (`pip install 'intone[ray]'`): this module imports it lazily.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from intone.engine import EngineConfig
from intone.provider.server.settings import ServerSettings

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-intone-replica"  # on every HTTP response and WebSocket handshake
APP_NAME = "intone"
DEPLOYMENT_NAME = "IntoneReplica"


@dataclass
class RayOptions:
    """How the deployment is laid out; the engine and server settings come from ServeOptions."""

    address: str | None = None  # a running cluster ("auto", "ray://..."); None: start one here
    replicas: int = 1  # fixed replica count (ignored when max_replicas is set)
    min_replicas: int | None = None  # autoscaling range: both set, min <= max
    max_replicas: int | None = None
    num_cpus: float = 1.0  # per replica
    num_gpus: float = 0.0  # per replica
    streams_per_connection: int = 4  # cap on concurrent streams of one connection under Ray
    max_queued_requests: int | None = None  # None: as many as all replicas hold
    target_load: float = 0.7  # autoscaling: wanted engine occupancy per replica
    health_check_period_s: float = 2.0
    routing_stats_period_s: float = 1.0
    metrics_interval: float = 2.0
    app_name: str = APP_NAME

    def validate(self) -> None:
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("give both --min-replicas and --max-replicas, or neither")
        if self.max_replicas is not None:
            assert self.min_replicas is not None
            if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
                raise ValueError("need 0 <= --min-replicas <= --max-replicas, max >= 1")
        elif self.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError("--replica-cpus and --replica-gpus must be >= 0")
        if self.streams_per_connection < 1:
            raise ValueError("--ray-streams-per-connection must be >= 1")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError("--max-queued-requests must be >= 1")
        if not 0 < self.target_load <= 1:
            raise ValueError("--target-load must be in (0, 1]")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None


@dataclass(frozen=True)
class RayLimits:
    streams_per_connection: int
    max_ongoing_requests: int  # connections (or HTTP requests) per replica
    max_queued_requests: int  # per proxy, waiting for a replica
    capacity_streams: int  # what the limits are derived from


# Streams per replica Ray's limits assume for `--max-active auto`.
RAY_AUTO_CAPACITY = 16


def ray_limits(engine: EngineConfig, settings: ServerSettings, options: RayOptions) -> RayLimits:
    """Ray's per-replica limits from the engine's capacity in streams (`max_active` rows).

    A connection may carry up to `streams_per_connection` streams, so a replica takes
    ceil(capacity / streams_per_connection) connections: with every connection full, at most
    `streams_per_connection - 1` streams wait in the engine's own queue. An HTTP request is one
    stream in one slot, so a replica of OpenAI requests alone runs below its batch.

    The queue holds what the whole deployment holds at most: every request waits there while
    the router picks its replica, so a smaller queue turns a burst into 503s although replicas
    have room; past it, the proxy answers 503 at once.
    """
    # With "auto" the capacity is only known once a replica has measured it: Ray's limits, set
    # before any replica starts, assume the engine's former default (docs/deploy.md).
    capacity = RAY_AUTO_CAPACITY if engine.max_active == "auto" else engine.max_active
    per_connection = min(options.streams_per_connection, settings.max_streams_per_connection)
    ongoing = max(1, math.ceil(capacity / per_connection))
    replicas = options.max_replicas if options.max_replicas is not None else options.replicas
    queued = options.max_queued_requests or ongoing * replicas
    return RayLimits(per_connection, ongoing, queued, capacity)


# ---- load, as the replicas report it


def engine_load(runtime: Any) -> dict[str, float]:
    """A replica's load for routing and autoscaling: all numbers (Ray's requirement).

    `load` is the occupancy, 0..1 and more: streams open over the batch size (a stream holds a
    row, or will as soon as it has text), or the fullest engine's generating plus queued
    requests over its batch, whichever is larger. (A replica serving several models runs an
    engine each; its streams are counted against the default model's batch.)
    """
    engines = runtime.engines
    streams = float(len(runtime.streams))
    load = {"load": 0.0, "streams": streams, "rows": 0.0, "queued": 0.0, "kv_pages": 0.0}
    load["connections"] = float(len(runtime.connections))
    if not engines:
        return load
    busy = 0.0
    for engine in engines:
        m = engine.metrics()
        load["rows"] += m["active_requests"]
        load["queued"] += m["queued_requests"]
        load["kv_pages"] += m["kv_pages_in_use"]
        busy = max(busy, (m["active_requests"] + m["queued_requests"]) / engine.config.max_active)
    load["load"] = max(streams / engines[0].config.max_active, busy)
    return load


def engine_load_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Custom autoscaling policy: enough replicas for the summed engine load at `target_load`.

    Reads the `load` the replicas report through `record_autoscaling_stats` (averaged by Ray
    over the look-back window). Replicas that have not reported yet count as the target, so a
    cold start neither collapses nor explodes the deployment. Scales on engine load, not on
    Ray's ongoing-request count, which counts a connection with 32 streams as one request and
    an idle connection as a busy one.
    """
    target = _policy_target(ctx)
    per_replica = (ctx.aggregated_metrics or {}).get("load", {})
    running = list(ctx.running_replicas)
    total = sum(per_replica.get(r, target) for r in running)
    wanted = math.ceil(total / target - 1e-9) if running else ctx.target_num_replicas
    lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
    return max(lo, min(hi, max(1, wanted) if hi else 0)), {}


def _policy_target(ctx: Any) -> float:
    kwargs = getattr(getattr(ctx.config, "policy", None), "policy_kwargs", None) or {}
    return float(kwargs.get("target_load", 0.7))


# ---- the replica


class ReplicaHeader:
    """ASGI middleware: names the replica on every response and WebSocket handshake."""

    def __init__(self, app: Any, replica: str):
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())
        self.state = app.state  # the runtime stays reachable as app.state.intone

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return

        async def named(message) -> None:
            if message["type"] in ("http.response.start", "websocket.accept"):
                message = dict(message)
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, named)


def _replica_class(serve_options: Any, ray_options: RayOptions) -> type:
    """The deployment class, wrapped with `serve.ingress` and a builder for its app."""
    from ray import serve

    def build_app() -> Any:
        # Runs on the replica: its engine is built here, at the app's lifespan startup.
        from intone.provider.server.app import create_app
        from intone.provider.server.logs import configure_logging

        configure_logging(serve_options.log_level, serve_options.log_json)
        app = create_app(
            model=serve_options.model,
            voices_dir=serve_options.voices_dir,
            voice_store=serve_options.voice_store,
            engine_config=serve_options.engine_config,
            settings=serve_options.settings,
            fallback_preset=serve_options.fallback_preset,
        )
        return ReplicaHeader(app, _replica_name())

    @serve.ingress(build_app)
    class IntoneReplica:
        def __init__(self) -> None:
            self._last_health_check = time.monotonic()
            self._stopping = False
            self._watcher: asyncio.Task | None = None
            self._closing: asyncio.Task | None = None  # the drain of an unhealthy replica
            self._gauges: dict[str, Any] = {}

        @property
        def runtime(self) -> Any:
            return self.app.state.intone

        # -- health

        async def check_health(self) -> None:
            """Raise while the engine is unusable: Ray then replaces this replica."""
            self._last_health_check = time.monotonic()
            if self._watcher is None:
                self._watcher = asyncio.get_running_loop().create_task(self._watch())
            runtime = self.runtime
            if self._stopping:
                # Health checks came back after a silence taken for a stop (a busy controller):
                # this replica has drained and refuses streams, so have Ray replace it.
                raise RuntimeError("drained after health checks stopped; replace this replica")
            reason = await unhealthy_reason(runtime)
            if reason is not None:
                if self._closing is None and not runtime.draining:
                    logger.error("replica unhealthy: %s; closing its connections", reason)
                    self._closing = asyncio.get_running_loop().create_task(runtime.drain(0.0))
                raise RuntimeError(f"intone engine unhealthy: {reason}")

        async def _watch(self) -> None:
            """Drain when health checks stop (Ray stops them once a replica is stopping), and
            copy the metrics into Ray's gauges."""
            silence = stop_silence(ray_options)
            while not self.runtime.closed:
                await asyncio.sleep(min(ray_options.metrics_interval, 1.0))
                try:
                    self._export_metrics()
                except Exception:  # metrics must never take the replica down
                    logger.debug("exporting metrics to Ray failed", exc_info=True)
                quiet = time.monotonic() - self._last_health_check
                if quiet > silence and not self._stopping:
                    self._stopping = True
                    logger.info("no health check for %.1f s: the replica is stopping", quiet)
                    await self.runtime.drain()

        # -- load

        async def record_routing_stats(self) -> dict[str, float]:
            return engine_load(self.runtime)

        async def record_autoscaling_stats(self) -> dict[str, float]:
            return engine_load(self.runtime)

        # -- metrics

        def _export_metrics(self) -> None:
            from ray.serve.metrics import Gauge

            runtime = self.runtime
            rows: list[tuple[str, dict[str, Any]]] = [
                (model.name, model.engine.metrics())
                for model in runtime.models
                if model.engine is not None and runtime.voices is not None
            ]
            replica = {f"server_{k}": v for k, v in runtime.metrics.snapshot().items()}
            replica.update({f"load_{k}": v for k, v in engine_load(runtime).items()})
            rows.append(("", replica))
            for model, values in rows:
                for key, value in values.items():
                    if isinstance(value, bool) or not isinstance(value, int | float):
                        continue
                    gauge = self._gauges.get(key)
                    if gauge is None:
                        gauge = self._gauges[key] = Gauge(
                            f"intone_{key}",
                            description=f"intone replica: {key.replace('_', ' ')}",
                            tag_keys=("model",),
                        )
                    gauge.set(float(value), tags={"model": model})

    return IntoneReplica


def stop_silence(options: RayOptions) -> float:
    """Seconds without a health check after which a replica takes itself for stopping."""
    return max(5 * options.health_check_period_s, 10.0)


async def unhealthy_reason(runtime: Any) -> str | None:
    """Why the replica cannot serve, or None."""
    from intone.provider.server.runtime import EngineUnavailableError

    if runtime.closed:
        return "closed"
    try:
        await runtime.ready()
    except EngineUnavailableError as e:
        return f"the engine could not be started: {e}"
    for engine in runtime.engines:
        health = engine.health()  # a failed stage, a dead thread, closed
        if not health.ok:
            return health.reason or "the engine is unhealthy"
    return None


def _replica_name() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not on a replica (tests building the app directly)
        return "local"


# ---- deployment


def build_deployment(serve_options: Any, ray_options: RayOptions) -> Any:
    """The bound Ray Serve application: `serve.run(build_deployment(...))`."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

    from intone.provider.server.ray_routing import EngineLoadRouter

    ray_options.validate()
    limits = ray_limits(serve_options.engine_config, serve_options.settings, ray_options)
    settings = replace(
        serve_options.settings, max_streams_per_connection=limits.streams_per_connection
    )
    serve_options = replace(serve_options, settings=settings)
    drain = settings.drain_timeout
    health_period = ray_options.health_check_period_s
    config: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "max_ongoing_requests": limits.max_ongoing_requests,
        "max_queued_requests": limits.max_queued_requests,
        "ray_actor_options": {"num_cpus": ray_options.num_cpus, "num_gpus": ray_options.num_gpus},
        "health_check_period_s": health_period,
        "health_check_timeout_s": max(10.0, 5 * health_period),
        # Stop detection (a few silent health-check periods) + the drain + its settling.
        "graceful_shutdown_timeout_s": stop_silence(ray_options) + drain + 10.0,
        "graceful_shutdown_wait_loop_s": 1.0,
        "request_router_config": RequestRouterConfig(
            request_router_class=EngineLoadRouter,
            request_routing_stats_period_s=ray_options.routing_stats_period_s,
            request_routing_stats_timeout_s=max(5.0, 3 * ray_options.routing_stats_period_s),
        ),
    }
    if ray_options.autoscaling:
        config["autoscaling_config"] = AutoscalingConfig(
            min_replicas=ray_options.min_replicas,
            max_replicas=ray_options.max_replicas,
            initial_replicas=max(1, ray_options.min_replicas or 0),
            target_ongoing_requests=max(1.0, limits.max_ongoing_requests * ray_options.target_load),
            metrics_interval_s=2.0,
            look_back_period_s=10.0,
            upscale_delay_s=5.0,
            downscale_delay_s=120.0,
            policy=AutoscalingPolicy(
                policy_function=engine_load_policy,
                policy_kwargs={"target_load": ray_options.target_load},
            ),
        )
    else:
        config["num_replicas"] = ray_options.replicas
    deployment = serve.deployment(**config)(_replica_class(serve_options, ray_options))
    logger.info(
        "Ray Serve deployment: %s replica(s), %s streams per connection, "
        "max_ongoing_requests %d, max_queued_requests %d (engine capacity %d streams)",
        f"{ray_options.min_replicas}-{ray_options.max_replicas}"
        if ray_options.autoscaling
        else ray_options.replicas,
        limits.streams_per_connection,
        limits.max_ongoing_requests,
        limits.max_queued_requests,
        limits.capacity_streams,
    )
    return deployment.bind()


def serve_ray(serve_options: Any, ray_options: RayOptions) -> None:
    """`intone serve --ray`: deploy, serve until SIGTERM/SIGINT, then drain and shut down."""
    import ray
    from ray import serve

    from intone.provider.server.logs import configure_logging
    from intone.provider.server.serve import prepare_settings

    configure_logging(serve_options.log_level, serve_options.log_json)
    prepare_settings(serve_options)  # the proxy binds --host: the same Host check and warning
    ray_options.validate()
    app = build_deployment(serve_options, ray_options)
    ray.init(address=ray_options.address, include_dashboard=False, log_to_driver=True)
    serve.start(http_options={"host": serve_options.host, "port": serve_options.port})
    serve.run(app, name=ray_options.app_name, route_prefix="/", blocking=False)
    host = serve_options.host if serve_options.host not in ("0.0.0.0", "::") else "127.0.0.1"
    logger.info("serving through Ray Serve at http://%s:%d/", host, serve_options.port)
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        stop.wait()
        logger.info("stopping: replicas drain, then the application is deleted")
        # Deleting the app stops every replica gracefully: each drains (see the module doc).
        serve.delete(ray_options.app_name)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if ray_options.address is None:
            serve.shutdown()
            ray.shutdown()
        logger.info("bye")
