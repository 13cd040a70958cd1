"""Server limits and knobs, one dataclass shared by the app, the CLI and the tests.

docs/server.md documents each with its `intone serve` flag. A limit of 0 is off.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerSettings:
    # Access (access.py).
    api_keys: tuple[str, ...] = ()  # none: no key needed (fine on loopback; warned elsewhere)
    allowed_origins: tuple[str, ...] = ()  # browser origins besides the server's own; "*": any
    allowed_hosts: tuple[str, ...] = ()  # Host header names accepted; none: any
    public_metrics: bool = False  # /metrics and /stats without a key
    # Connections and callers (limits.py); a caller is an API key, or a client address.
    max_connections: int = 512  # WebSockets plus speech requests in flight, server-wide
    max_streams_per_client: int = 128  # concurrent streams of one caller
    max_chars_per_minute: int = 0  # text one caller may send per minute
    # WebSocket protocol.
    max_message_bytes: int = 64 * 1024  # one client message; bigger ones get message_too_large
    max_streams_per_connection: int = 32  # concurrent streams on one WebSocket
    remembered_stream_ids: int = 1024  # finished ids a connection refuses to reuse
    ws_idle_timeout: float = 300.0  # seconds without a message while no stream is open
    # HTTP (OpenAI-compatible) API.
    max_request_bytes: int = 256 * 1024  # request body of POST /v1/audio/speech
    header_timeout: float = 10.0  # seconds to receive a request's headers (intone serve)
    body_timeout: float = 30.0  # seconds to receive a request's body
    # Streams, both APIs.
    max_stream_seconds: float = 1200.0  # a stream's maximum lifetime
    max_buffered_audio: float = 10.0  # seconds of audio queued for a client per stream
    slow_client_timeout: float = 30.0  # a client that takes no audio for this long is dropped
    # Voices: OpenAI name (or any alias) -> registry voice; see voices.py for the defaults.
    voice_aliases: dict[str, str] = field(default_factory=dict)
    # Uploaded voices (voice_api.py): a file's bytes, its audio's seconds (past 30 s only the
    # first 30 are used, as the reference does), stored voices per API key (0: no limit).
    max_voice_bytes: int = 16 * 2**20
    max_voice_seconds: float = 120.0
    max_voices_per_key: int = 100
    # Proxies (addresses or networks; "*": any) whose X-Forwarded-For / Forwarded header names
    # the client (forwarded.py); none: the peer address is the client.
    forwarded_allow_ips: tuple[str, ...] = ()
    # Shutdown.
    drain_timeout: float = 30.0  # seconds in-flight streams get to finish on SIGTERM

    def validate(self) -> None:
        for name in (
            "max_message_bytes",
            "max_streams_per_connection",
            "remembered_stream_ids",
            "max_request_bytes",
            "max_voice_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerSettings.{name} must be >= 1")
        for name in (
            "max_connections",
            "max_streams_per_client",
            "max_chars_per_minute",
            "max_voices_per_key",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"ServerSettings.{name} must be >= 0 (0: no limit)")
        for name in (
            "ws_idle_timeout",
            "header_timeout",
            "body_timeout",
            "max_stream_seconds",
            "max_buffered_audio",
            "slow_client_timeout",
            "max_voice_seconds",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServerSettings.{name} must be > 0 seconds")
        from intone.provider.server.forwarded import trusted_networks

        trusted_networks(self.forwarded_allow_ips)  # ValueError naming a bad entry
        if self.drain_timeout < 0:
            raise ValueError("ServerSettings.drain_timeout must be >= 0")
        for key in self.api_keys:
            # Keys travel in headers and as a WebSocket subprotocol token.
            if not key or not all(c.isascii() and (c.isalnum() or c in "-_.~") for c in key):
                raise ValueError(
                    "API keys must be non-empty and use only letters, digits and - _ . ~"
                )
