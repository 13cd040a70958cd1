"""Who may use the server: API keys, browser origins and (on loopback) the Host header.

Keys: a request presents one as `Authorization: Bearer KEY` (HTTP, the Python client, the
OpenAI SDKs); a browser's WebSocket, which cannot set headers, offers it as the subprotocol
`intone.key.KEY` (next to `intone.v1`, which the server selects) or as `?api_key=KEY`. Keys are
compared in constant time, against every configured key, so timing tells nothing about them.

Origins: a request with an `Origin` header comes from a web page; it must come from an allowed
origin or from the server's own host (the demo page). Requests without one (the Python client,
the plugins, curl) are not browsers and are not affected; a page cannot drop the header.

Hosts: a server bound to loopback answers only to loopback host names, so a public DNS name
pointed at 127.0.0.1 (DNS rebinding) does not give a web page a same-origin way in.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from intone.provider.protocol import KEY_SUBPROTOCOL_PREFIX

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
QUERY_KEY = "api_key"


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def host_name(host_header: str) -> str:
    """`example.com:8000` -> `example.com`, `[::1]:8000` -> `::1`; lower case."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host[1:]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


@dataclass(frozen=True)
class Caller:
    """Who a request comes from, for limits and logs: a key's label or the client address."""

    tenant: str
    key_label: str | None = None


class Access:
    def __init__(
        self,
        api_keys: Iterable[str] = (),
        allowed_origins: Iterable[str] = (),
        allowed_hosts: Iterable[str] = (),
    ):
        self._keys = [key.encode() for key in api_keys]
        self.origins = {origin.rstrip("/").lower() for origin in allowed_origins}
        self.hosts = {host_name(host) for host in allowed_hosts}

    @property
    def keys_required(self) -> bool:
        return bool(self._keys)

    def key_label(self, presented: str | None) -> str | None:
        """The label of the matching key (`key1`, ...) or None; constant time per key."""
        if presented is None:
            return None
        candidate = presented.encode("utf-8", "replace")
        found = None
        for index, key in enumerate(self._keys):
            # Every key is compared, match or not: the time taken does not depend on which.
            if hmac.compare_digest(candidate, key) and found is None:
                found = f"key{index + 1}"
        return found

    def host_allowed(self, headers: Mapping[str, str]) -> bool:
        if not self.hosts:
            return True
        return host_name(headers.get("host", "")) in self.hosts

    def origin_allowed(self, headers: Mapping[str, str]) -> bool:
        """No Origin (not a browser), an allowed one, or the request's own host."""
        origin = headers.get("origin")
        if origin is None:
            return True
        origin = origin.rstrip("/").lower()
        if "*" in self.origins or origin in self.origins:
            return True
        # Same host: the page was served by this server (the demo page).
        return bool(origin) and urlsplit(origin).netloc == headers.get("host", "").lower()


def bearer(headers: Mapping[str, str]) -> str | None:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def websocket_key(headers: Mapping[str, str], query_string: bytes) -> str | None:
    """A WebSocket's key: the Authorization header, a key subprotocol, or the query token."""
    key = bearer(headers)
    if key is not None:
        return key
    for offered in headers.get("sec-websocket-protocol", "").split(","):
        offered = offered.strip()
        if offered.startswith(KEY_SUBPROTOCOL_PREFIX):
            return offered[len(KEY_SUBPROTOCOL_PREFIX) :]
    values = parse_qs(query_string.decode("latin-1")).get(QUERY_KEY)
    return values[0] if values else None
