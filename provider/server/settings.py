"""Server limits and knobs, one dataclass shared by the app, the CLI and the tests."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerSettings:
    # WebSocket protocol.
    max_message_bytes: int = 64 * 1024  # one client message; bigger ones get message_too_large
    max_streams_per_connection: int = 32  # concurrent streams on one WebSocket
    remembered_stream_ids: int = 1024  # finished ids a connection refuses to reuse
    # HTTP (OpenAI-compatible) API.
    max_request_bytes: int = 256 * 1024  # request body of POST /v1/audio/speech
    # Voices: OpenAI name (or any alias) -> registry voice; see voices.py for the defaults.
    voice_aliases: dict[str, str] = field(default_factory=dict)
    # Shutdown.
    drain_timeout: float = 30.0  # seconds in-flight streams get to finish on SIGTERM

    def validate(self) -> None:
        for name in (
            "max_message_bytes",
            "max_streams_per_connection",
            "remembered_stream_ids",
            "max_request_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerSettings.{name} must be >= 1")
        if self.drain_timeout < 0:
            raise ValueError("ServerSettings.drain_timeout must be >= 0")
