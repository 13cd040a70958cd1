"""intone's server: an ASGI app with WebSocket streaming and an OpenAI-compatible speech API.

    from intone.provider.server import create_app
    app = create_app(engine)            # or create_app() to build the default engine lazily

Exports load lazily so that `intone.provider.client`, which shares `protocol`, doesn't import
Starlette, uvicorn or the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from intone.provider.server.app import create_app
    from intone.provider.server.runtime import Runtime
    from intone.provider.server.serve import ServeOptions, serve
    from intone.provider.server.settings import ServerSettings

__all__ = ["Runtime", "ServeOptions", "ServerSettings", "create_app", "serve"]

_EXPORTS = {
    "create_app": "intone.provider.server.app",
    "Runtime": "intone.provider.server.runtime",
    "ServeOptions": "intone.provider.server.serve",
    "serve": "intone.provider.server.serve",
    "ServerSettings": "intone.provider.server.settings",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
