"""intone's server: an ASGI app with WebSocket streaming and an OpenAI-compatible speech API.

from intone.provider.server import create_app
app = create_app(engine)            # or create_app() to build the default engine lazily
"""

from __future__ import annotations

from intone.provider.server.app import create_app
from intone.provider.server.runtime import Runtime
from intone.provider.server.serve import ServeOptions, serve
from intone.provider.server.settings import ServerSettings

__all__ = ["Runtime", "ServeOptions", "ServerSettings", "create_app", "serve"]
