"""`intone serve --ray`: two Ray Serve replicas of the tiny checkpoint on a local Ray cluster.

Opt-in (marker `ray`): `pytest -m ray tests/server/test_ray_serve.py`. The unmarked tests at the top
(limits, autoscaling policy, the KubeRay manifest) need Ray installed but no cluster.

Each replica: max_active 8, 2 streams per connection, so Ray admits 4 connections per replica
(max_ongoing_requests) and queues 8 more in front of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

import httpx  # noqa: E402
import yaml  # noqa: E402
from websockets.asyncio.client import connect  # noqa: E402

from intone.engine import EngineConfig  # noqa: E402
from intone.provider.cli import app_builder  # noqa: E402
from intone.provider.client import IntoneClient, IntoneConnectionError  # noqa: E402
from intone.provider.server.ray_serve import (  # noqa: E402
    REPLICA_HEADER,
    RayOptions,
    build_deployment,
    engine_load_policy,
    ray_limits,
)
from intone.provider.server.serve import ServeOptions  # noqa: E402
from intone.provider.server.settings import ServerSettings  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "docs" / "deploy" / "rayservice.yaml"
STREAMS_PER_CONNECTION = 2
MAX_ACTIVE = 8
CONNECTIONS_PER_REPLICA = MAX_ACTIVE // STREAMS_PER_CONNECTION
KEY = "ray-test-key"
TEXT = "Hello there. This is a test of the scale-out path, one clause after another."


# ---- no cluster needed


def test_limits_follow_the_engine_capacity_in_streams():
    limits = ray_limits(
        EngineConfig(max_active=16), ServerSettings(), RayOptions(streams_per_connection=4)
    )
    assert (limits.max_ongoing_requests, limits.streams_per_connection) == (4, 4)
    assert limits.max_queued_requests == 4  # bounded: what the deployment holds
    scaled = ray_limits(
        EngineConfig(), ServerSettings(), RayOptions(min_replicas=1, max_replicas=5)
    )
    assert scaled.max_queued_requests == 20
    odd = ray_limits(EngineConfig(max_active=10), ServerSettings(), RayOptions())
    assert odd.max_ongoing_requests == 3  # ceil: at most 3 streams wait in the engine queue
    capped = ray_limits(EngineConfig(), ServerSettings(max_streams_per_connection=2), RayOptions())
    assert capped.streams_per_connection == 2 and capped.max_ongoing_requests == 8
    with pytest.raises(ValueError):
        RayOptions(min_replicas=2).validate()
    with pytest.raises(ValueError):
        RayOptions(min_replicas=3, max_replicas=2).validate()


def _policy_context(loads: dict[str, float], running: int, lo: int = 1, hi: int = 10):
    policy = SimpleNamespace(policy_kwargs={"target_load": 0.5})
    return SimpleNamespace(
        running_replicas=[f"r{i}" for i in range(running)],
        aggregated_metrics={"load": loads},
        target_num_replicas=running,
        capacity_adjusted_min_replicas=lo,
        capacity_adjusted_max_replicas=hi,
        config=SimpleNamespace(policy=policy),
    )


def test_autoscaling_policy_sizes_to_the_summed_engine_load():
    # Two replicas at 90 % and 70 %: 1.6 replicas of load at 50 % each -> 4 replicas.
    assert engine_load_policy(_policy_context({"r0": 0.9, "r1": 0.7}, 2))[0] == 4
    # Idle: down to the minimum.
    assert engine_load_policy(_policy_context({"r0": 0.0, "r1": 0.0}, 2, lo=1))[0] == 1
    # Capped by the range; a replica without a report counts as on target.
    assert engine_load_policy(_policy_context({"r0": 1.0}, 3, hi=3))[0] == 3
    assert engine_load_policy(_policy_context({}, 2))[0] == 2


def test_rayservice_manifest():
    """The KubeRay manifest: a RayService whose Serve config Ray accepts and whose args build
    the deployment (kubectl's client-side dry run needs the CRD from a cluster, so the schema
    is checked here)."""
    from ray.serve.schema import ServeDeploySchema

    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    service = next(d for d in docs if d["kind"] == "RayService")
    assert service["apiVersion"] == "ray.io/v1"
    spec = service["spec"]
    serve_config = yaml.safe_load(spec["serveConfigV2"])
    schema = ServeDeploySchema.model_validate(serve_config)
    app = schema.applications[0]
    assert app.import_path == "intone.provider.cli:app_builder"
    assert app.route_prefix == "/"
    # KubeRay's v1 RayServiceSpec / RayClusterSpec field names (deprecated ones refused).
    assert set(spec) <= {"serveConfigV2", "rayClusterConfig", "serveService", "upgradeStrategy"}
    cluster = spec["rayClusterConfig"]
    assert set(cluster) <= {
        "rayVersion",
        "enableInTreeAutoscaling",
        "autoscalerOptions",
        "headGroupSpec",
        "workerGroupSpecs",
        "headServiceAnnotations",
    }
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        # rayStartParams is a map of strings; every pod needs a container with an image.
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        containers = group["template"]["spec"]["containers"]
        assert containers and all(c["image"] for c in containers)
    for group in cluster["workerGroupSpecs"]:
        assert (
            group["groupName"] and group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        )
    # The args parse as `intone serve` flags and build the deployment.
    bound = app_builder(app.args)
    assert bound is not None


async def test_an_unhealthy_engine_fails_the_replica_health_check(tiny_checkpoint: Path):
    """What `check_health` raises on: the engine's own health (here: closed under the server)."""
    from intone.provider.server.app import create_app
    from intone.provider.server.ray_serve import unhealthy_reason

    app = create_app(model=str(tiny_checkpoint), fallback_preset=None)
    runtime = app.state.intone
    try:
        assert await unhealthy_reason(runtime) is None
        runtime.engine.close()
        reason = await unhealthy_reason(runtime)
        assert reason and not runtime.engine.health().ok
    finally:
        await runtime.close()


# ---- a local Ray cluster with two replicas


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint: Path):
    """The app behind Ray's proxy, with an API key (IntoneClient reads INTONE_API_KEY)."""
    from ray import serve

    saved_key = os.environ.get("INTONE_API_KEY")
    os.environ["INTONE_API_KEY"] = KEY
    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="intone-test")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = ServeOptions(
            model=str(tiny_checkpoint),
            fallback_preset=None,
            engine_config=EngineConfig(max_active=MAX_ACTIVE),
            settings=ServerSettings(drain_timeout=5.0, api_keys=(KEY,)),
        )
        layout = RayOptions(
            replicas=2,
            num_cpus=0.5,
            streams_per_connection=STREAMS_PER_CONNECTION,
            health_check_period_s=1.0,
            routing_stats_period_s=0.5,
        )
        serve.run(build_deployment(options, layout), name="intone", route_prefix="/")
        yield SimpleNamespace(http=f"http://127.0.0.1:{port}", ws=f"ws://127.0.0.1:{port}")
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        if saved_key is None:
            os.environ.pop("INTONE_API_KEY", None)
        else:
            os.environ["INTONE_API_KEY"] = saved_key


def _replica_actor(replica: str):
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].endswith(f"#{replica}"):
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise LookupError(replica)


async def _raw_connection(url: str, timeout: float = 10.0):
    ws = await connect(
        f"{url}/v1/stream",
        open_timeout=timeout,
        additional_headers={"Authorization": f"Bearer {KEY}"},
    )
    hello = json.loads(await asyncio.wait_for(ws.recv(), timeout))
    assert hello["limits"]["max_streams"] == STREAMS_PER_CONNECTION
    return ws, ws.response.headers[REPLICA_HEADER]


async def _speak(client: IntoneClient, text: str = TEXT, **options) -> bytes:
    stream = await client.stream(text=text, end=True, options={"seed": 1, **options})
    return b"".join([pcm async for pcm in stream])


@pytest.mark.ray
async def test_streams_and_openai_requests_spread_over_both_replicas(cluster):
    async def ws_stream() -> tuple[str, int]:
        async with IntoneClient(cluster.ws) as client:
            audio = await _speak(client)
            return client.response_headers[REPLICA_HEADER], len(audio)

    served = await asyncio.wait_for(asyncio.gather(*(ws_stream() for _ in range(8))), 120)
    assert all(size > 0 for _, size in served)
    assert len({replica for replica, _ in served}) == 2, served

    async with httpx.AsyncClient(timeout=60) as http:
        # Keys and voice aliases work through the proxy as they do without it.
        body = {"model": "tts-1", "voice": "alloy", "input": "Hi.", "response_format": "pcm"}
        refused = await http.post(f"{cluster.http}/v1/audio/speech", json=body)
        assert refused.status_code == 401
        http.headers["authorization"] = f"Bearer {KEY}"

        async def speech() -> tuple[str, int]:
            # Long enough that all 8 are in flight at once: 4 fill a replica.
            body = {"model": "tts-1", "voice": "alloy", "input": TEXT * 3, "response_format": "pcm"}
            response = await http.post(f"{cluster.http}/v1/audio/speech", json=body)
            assert response.status_code == 200, response.text
            return response.headers[REPLICA_HEADER], len(response.content)

        answered = await asyncio.wait_for(asyncio.gather(*(speech() for _ in range(8))), 120)
    assert all(size > 0 for _, size in answered)
    assert len({replica for replica, _ in answered}) == 2, answered


@pytest.mark.ray
async def test_a_full_replica_gets_no_new_connections(cluster):
    held = []
    try:
        per_replica: dict[str, int] = {}
        for _ in range(2 * CONNECTIONS_PER_REPLICA):
            ws, replica = await _raw_connection(cluster.ws)
            held.append(ws)
            per_replica[replica] = per_replica.get(replica, 0) + 1
            # Whatever the order, no replica ever holds more than it can serve.
            assert per_replica[replica] <= CONNECTIONS_PER_REPLICA, per_replica
        assert sorted(per_replica.values()) == [CONNECTIONS_PER_REPLICA] * 2
        # Both full: the next connection waits in Ray's bounded queue, it is not accepted.
        with pytest.raises(TimeoutError):
            await _raw_connection(cluster.ws, timeout=2.0)
        # Room again on one replica: the next connection goes there.
        freed = held.pop(0)
        freed_replica = freed.response.headers[REPLICA_HEADER]
        await freed.close()
        ws, replica = await _raw_connection(cluster.ws)
        held.append(ws)
        assert replica == freed_replica
    finally:
        await asyncio.gather(*(ws.close() for ws in held), return_exceptions=True)


@pytest.mark.ray
async def test_every_replica_exports_its_metrics_with_its_label(cluster):
    """Ray's metrics endpoint on the node lists intone's gauges of each replica."""
    port = ray.nodes()[0]["MetricsExportPort"]
    replicas: set[str] = set()
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient(timeout=10) as http:
        while time.monotonic() < deadline and len(replicas) < 2:
            with contextlib.suppress(httpx.HTTPError):
                text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
                for line in text.splitlines():
                    if line.startswith("ray_intone_kv_pages_in_use{"):
                        labels = line[line.index("{") + 1 : line.index("}")]
                        fields = dict(f.split("=", 1) for f in labels.split(","))
                        replicas.add(fields["replica"].strip('"'))
            await asyncio.sleep(1.0)
    assert len(replicas) == 2, replicas


@pytest.mark.ray
async def test_a_replica_killed_mid_stream(cluster):
    """Streams with audio end at once with a connection error; a turn with no audio yet
    reconnects and completes on the other replica."""
    clients = [IntoneClient(cluster.ws, reconnect=True) for _ in range(3)]
    await asyncio.gather(*(c.connect() for c in clients))
    try:
        by_replica: dict[str, list[IntoneClient]] = {}
        for client in clients:
            by_replica.setdefault(client.response_headers[REPLICA_HEADER], []).append(client)
        victim, pair = next((r, cs) for r, cs in by_replica.items() if len(cs) >= 2)
        waiting, speaking = pair[:2]

        # A turn that has had audio (and stays open), and one that has none yet (its first
        # clause is still open).
        heard = await speaking.stream(text="Hello there. ", options={"seed": 2})
        iterator = heard.__aiter__()
        assert await asyncio.wait_for(iterator.__anext__(), 30)
        pending = await waiting.stream(options={"seed": 3})
        await pending.push_text("Hello from a turn that has not spoken")

        ray.kill(_replica_actor(victim), no_restart=False)
        started = time.monotonic()
        with pytest.raises(IntoneConnectionError):
            async for _ in iterator:
                pass
        assert time.monotonic() - started < 10  # a clear end, not a hang

        await pending.push_text(" yet, and now it will.")
        await pending.end_input()
        audio = b"".join([pcm async for pcm in _bounded(pending, 60)])
        assert audio and pending.metrics is not None
        assert waiting.reconnects == 1
        assert waiting.response_headers[REPLICA_HEADER] != victim
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


async def _bounded(stream, timeout: float):
    deadline = time.monotonic() + timeout
    iterator = stream.__aiter__()
    while True:
        try:
            yield await asyncio.wait_for(iterator.__anext__(), deadline - time.monotonic())
        except StopAsyncIteration:
            return


@pytest.mark.ray
async def test_a_stopping_replica_drains(cluster):
    """Deleting the app stops its replicas as a rolling update does: each drains like
    SIGTERM (the stream in flight finishes, then the connection closes)."""
    from ray import serve

    await _wait_for_replicas(cluster, 2)
    async with IntoneClient(cluster.ws) as client:
        stream = await client.stream(options={"seed": 4})
        await stream.push_text("A turn that is still being spoken")
        deleting = asyncio.get_running_loop().run_in_executor(
            None, lambda: serve.delete("intone", _blocking=True)
        )
        await asyncio.sleep(1.0)
        await stream.push_text(" when the replica is told to stop.")
        await stream.end_input()
        audio = b"".join([pcm async for pcm in _bounded(stream, 60)])
        assert audio and stream.metrics is not None  # finished, not cancelled
        await asyncio.wait_for(deleting, 90)
        # The drain closed the connection (1001) after the stream was done.
        with pytest.raises(IntoneConnectionError):
            await client.stream(text="More?", end=True)


async def _wait_for_replicas(cluster, count: int, timeout: float = 90) -> None:
    """Until `count` replicas answer (a killed one is restarted by Ray)."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=10) as http:
        while len(seen) < count:
            assert time.monotonic() < deadline, seen
            with contextlib.suppress(httpx.HTTPError):
                response = await http.get(f"{cluster.http}/healthz")
                if response.status_code == 200:
                    seen.add(response.headers[REPLICA_HEADER])
            await asyncio.sleep(0.2)


@pytest.mark.ray
async def test_autoscaling_grows_on_engine_load(cluster, tiny_checkpoint):
    """One replica, two streams open on it (load 2/8 over a target of 0.1): the policy asks for
    more replicas and Ray starts the second."""
    from ray import serve

    options = ServeOptions(
        model=str(tiny_checkpoint),
        fallback_preset=None,
        engine_config=EngineConfig(max_active=MAX_ACTIVE),
    )
    layout = RayOptions(
        min_replicas=1,
        max_replicas=2,
        num_cpus=0.5,
        streams_per_connection=STREAMS_PER_CONNECTION,
        target_load=0.1,
        health_check_period_s=1.0,
    )
    app = build_deployment(options, layout)
    await asyncio.get_running_loop().run_in_executor(
        None, lambda: serve.run(app, name="autoscaled", route_prefix="/")
    )
    try:
        async with IntoneClient(cluster.ws) as client:
            streams = [await client.stream(options={"seed": s}) for s in (5, 6)]
            for stream in streams:
                await stream.push_text("Streams held open so the engine reports load")
            deadline = time.monotonic() + 90
            while _running_replicas("autoscaled") < 2:
                assert time.monotonic() < deadline, "no second replica"
                await asyncio.sleep(1.0)
            for stream in streams:
                await stream.cancel()
    finally:
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: serve.delete("autoscaled", _blocking=True)
        )


def _running_replicas(app_name: str) -> int:
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None:
        return 0
    return sum(d.replica_states.get("RUNNING", 0) for d in app.deployments.values())
