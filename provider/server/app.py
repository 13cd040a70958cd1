"""The ASGI app: WebSocket streaming, OpenAI-compatible speech, demo page, health and metrics.

`create_app()` returns a Starlette app that runs anywhere ASGI runs: `intone serve` (uvicorn),
mounted in a FastAPI/Starlette app, or as a Ray Serve / Modal ASGI deployment. It needs no
lifespan events: the engine is passed in, or built on the first request.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from contextlib import asynccontextmanager
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from intone.engine import Engine, EngineConfig
from intone.provider import protocol
from intone.provider.protocol import ErrorCode
from intone.provider.server import openai_api, voice_api
from intone.provider.server.access import bearer
from intone.provider.server.forwarded import ForwardedClients
from intone.provider.server.openai_api import error_response
from intone.provider.server.runtime import EngineUnavailableError, Runtime, ServedModel
from intone.provider.server.settings import ServerSettings
from intone.provider.server.websocket import websocket_endpoint

logger = logging.getLogger(__name__)


def create_app(
    engine: Engine | Sequence[Engine] | None = None,
    *,
    model: str | Path | Sequence[str | Path] | None = None,
    voices_dir: str | Path | None = None,
    engine_config: EngineConfig | None = None,
    settings: ServerSettings | None = None,
    fallback_preset: str | None = "full",
    voice_store: str | Path | None = None,
) -> Starlette:
    """The intone server as an ASGI app.

    engine: a built engine, or several (one per model), shared by every connection; the caller
        owns them (starts them if needed, closes them). Without one, the app builds its own on
        first use (or at startup when lifespan events run) from `model` (None: the released
        default, or a generated checkpoint if that cannot be had and `fallback_preset` is set;
        a list: one engine per model) and closes them at lifespan shutdown or
        `await app.state.intone.close()`.
    The first model is the default; a request picks another by name or alias (`GET /v1/models`).
    voices_dir: voice prompts to add to every model's registry, named by file stem.
    voice_store: where uploaded voices (`POST /v1/voices`) are kept across restarts; None: a
        temporary directory, removed when the runtime closes.
    The runtime (engines, voices, drain) is `app.state.intone`.
    """
    if engine is not None and (model is not None or engine_config is not None):
        raise ValueError("pass either an engine or model/engine_config, not both")

    def build(spec: str | Path | None) -> Engine:
        from intone.provider.server.model_source import load_serving_model

        loaded = load_serving_model(spec, fallback_preset=fallback_preset)
        return Engine(loaded, engine_config)

    if engine is not None:
        engines = [engine] if isinstance(engine, Engine) else list(engine)
        served = [ServedModel(engine=e) for e in engines]
    else:
        specs = list(model) if isinstance(model, list | tuple) else [model]
        served = [
            ServedModel(requested=None if s is None else str(s), factory=partial(build, s))
            for s in specs
        ]
    runtime = Runtime(
        models=served, voices_dir=voices_dir, settings=settings, voice_store=voice_store
    )

    @asynccontextmanager
    async def lifespan(app: Starlette):
        # A failure is logged by the runtime; requests then get 503 and /healthz says why.
        with contextlib.suppress(EngineUnavailableError):
            await runtime.ready()
        yield
        await runtime.close()

    async def speech(request: Request) -> Response:
        return await openai_api.speech(request, runtime)

    async def models(request: Request) -> Response:
        return await openai_api.models(request, runtime)

    async def stream(websocket: WebSocket) -> None:
        await websocket_endpoint(websocket, runtime)

    routes = [
        Route("/", partial(index, runtime), methods=["GET"]),
        Route("/healthz", partial(healthz, runtime), methods=["GET"]),
        Route("/stats", partial(stats, runtime), methods=["GET"]),
        Route("/metrics", partial(metrics, runtime), methods=["GET"]),
        Route("/v1/audio/speech", speech, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/voices", partial(voice_api.create_voice, runtime=runtime), methods=["POST"]),
        Route("/v1/voices", partial(voice_api.list_voices, runtime=runtime), methods=["GET"]),
        Route(
            "/v1/voices/{voice_id}",
            partial(voice_api.get_voice, runtime=runtime),
            methods=["GET"],
        ),
        Route(
            "/v1/voices/{voice_id}",
            partial(voice_api.delete_voice, runtime=runtime),
            methods=["DELETE"],
        ),
        WebSocketRoute(protocol.WS_PATH, stream),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[
            # First: every later check and log sees the client behind a trusted proxy.
            Middleware(ForwardedClients, forwarded_allow_ips=runtime.settings.forwarded_allow_ips),
            Middleware(BrowserAccess, runtime=runtime),
        ],
    )
    app.state.intone = runtime
    return app


def _page() -> str:
    return (resources.files("intone.provider.server") / "static" / "index.html").read_text(
        encoding="utf-8"
    )


async def index(runtime: Runtime, request: Request) -> Response:
    return HTMLResponse(_page(), headers={"cache-control": "no-cache"})


class BrowserAccess:
    """HTTP requests from web pages: the Host check (DNS rebinding), the Origin check, CORS
    headers and preflights. Requests without an Origin (not a browser) pass untouched, but
    for the Host check. WebSockets check the same rules in websocket.py, where a refusal can
    be an event and a close code a browser can read."""

    def __init__(self, app: Any, runtime: Runtime):
        self.app = app
        self.runtime = runtime

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        access = self.runtime.access
        headers = Headers(scope=scope)
        if not access.host_allowed(headers):
            refusal = error_response(
                403, ErrorCode.ORIGIN_NOT_ALLOWED, "this host name is not served here"
            )
            await refusal(scope, receive, send)
            return
        origin = headers.get("origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        if not access.origin_allowed(headers):
            self.runtime.metrics.error(str(ErrorCode.ORIGIN_NOT_ALLOWED))
            refusal = error_response(
                403,
                ErrorCode.ORIGIN_NOT_ALLOWED,
                "this origin may not use the server: see --allowed-origins",
            )
            await refusal(scope, receive, send)
            return
        cors = {
            "access-control-allow-origin": origin,
            "vary": "Origin",
            "access-control-expose-headers": "x-request-id, x-intone-model, x-intone-voice",
        }
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            preflight = Response(
                status_code=204,
                headers={
                    **cors,
                    "access-control-allow-methods": "GET, POST, DELETE",
                    "access-control-allow-headers": "authorization, content-type",
                    "access-control-max-age": "600",
                },
            )
            await preflight(scope, receive, send)
            return

        async def send_with_cors(message: Any) -> None:
            if message["type"] == "http.response.start":
                response_headers = MutableHeaders(scope=message)
                for name, value in cors.items():
                    response_headers[name] = value
            await send(message)

        await self.app(scope, receive, send_with_cors)


def _key_refused(runtime: Runtime, request: Request) -> Response | None:
    """401 for /metrics and /stats without a valid key, unless they are public."""
    access = runtime.access
    if not access.keys_required or runtime.settings.public_metrics:
        return None
    if access.key_label(bearer(request.headers)) is not None:
        return None
    return error_response(
        401, ErrorCode.UNAUTHORIZED, "a valid API key is required (or --public-metrics)"
    )


async def healthz(runtime: Runtime, request: Request) -> Response:
    """Liveness and what is loaded: 200 when serving; 503 while draining, if unavailable, or if
    an engine failed (`Engine.health()`: the reason is in "error"), so an orchestrator restarts
    the process. Open without a key; it names the model but never a path on the host."""
    try:
        engine = await runtime.ready()
    except EngineUnavailableError:
        return JSONResponse(
            {"status": "unavailable", "error": "the engine could not be started: see the log"},
            status_code=503,
        )
    assert runtime.voices is not None
    loaded = engine.loaded
    engine_metrics = engine.metrics()
    failures = [h.reason for h in (e.health() for e in runtime.engines) if not h.ok]
    body = {
        "status": "draining" if runtime.draining else "unhealthy" if failures else "ok",
        "model": runtime.models[0].name,  # as the hello and /v1/models name it
        "version": runtime.version,
        "weights": loaded.weights,
        "sample_rate": engine.sample_rate,
        "default_voice": engine.default_voice,
        "voices": runtime.voices.server_voices(),
        "aliases": runtime.voices.alias_table(),
        "active_requests": engine_metrics["active_requests"],
        "queued_requests": engine_metrics["queued_requests"],
        "kv_pages_in_use": engine_metrics["kv_pages_in_use"],
        "connections": len(runtime.connections),
        "streams": len(runtime.streams),
        # Every served model's load (the keys above are the default model's).
        "models": [_model_load(served) for served in runtime.ready_models],
    }
    if failures:
        body["error"] = "; ".join(str(reason) for reason in failures)
    return JSONResponse(body, status_code=503 if runtime.draining or failures else 200)


def _model_load(served: ServedModel) -> dict:
    assert served.engine is not None
    health, m = served.engine.health(), served.engine.metrics()
    return {
        "name": served.name,
        "status": "ok" if health.ok else "unhealthy",
        "active_requests": m["active_requests"],
        "queued_requests": m["queued_requests"],
        "streams_open": m["streams_open"],
        "kv_pages_in_use": m["kv_pages_in_use"],
    }


async def stats(runtime: Runtime, request: Request) -> Response:
    """Everything the engine and the server count, as JSON (the demo page polls this)."""
    refused = _key_refused(runtime, request)
    if refused is not None:
        return refused
    try:
        engine = await runtime.ready()
    except EngineUnavailableError as e:
        return JSONResponse({"error": str(e)}, status_code=503)
    return JSONResponse(
        {
            "weights": engine.loaded.weights,
            "engine": engine.metrics(),  # the default model's
            "models": {m.name: m.engine.metrics() for m in runtime.ready_models if m.engine},
            "server": runtime.metrics.snapshot(),
        },
        headers={"cache-control": "no-cache"},
    )


async def metrics(runtime: Runtime, request: Request) -> Response:
    """Prometheus text: the engine's metrics, then the server's."""
    refused = _key_refused(runtime, request)
    if refused is not None:
        return refused
    return Response(runtime.prometheus(), media_type=CONTENT_TYPE_LATEST)
