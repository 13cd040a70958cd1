"""The client behind a trusted proxy: `X-Forwarded-For` and `Forwarded` (RFC 7239).

Behind a TLS terminator or a load balancer every connection comes from the proxy, so limits per
client address would lump every caller together. For a connection from a trusted proxy
(`--forwarded-allow-ips`: addresses or networks, `*` for any), the client is read from the
forwarding header: the right-most address that is not itself a trusted proxy (each proxy
appends the address it saw, so entries left of the last trusted hop may be forged by the
client). `Forwarded` is read when present, else `X-Forwarded-For`. An entry that is no address
(`unknown`, an obfuscated `_name`, garbage) ends the walk: the hop that reported it is the client.

The app rewrites the ASGI scope's `client` (HTTP and WebSocket alike), so everything that reads
it (limits, logs) sees the client. This is the server's only proxy-header handling: `intone
serve` turns uvicorn's own off, which reads only `X-Forwarded-For` and would trust 127.0.0.1
unless told otherwise, and other ASGI hosts (Ray Serve, a mounting app) get the same rules.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any

from starlette.datastructures import Headers

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def trusted_networks(entries: Iterable[str]) -> list[Network] | None:
    """The trusted proxies as networks; None for `*` (any). ValueError naming a bad entry."""
    networks: list[Network] = []
    for entry in entries:
        entry = entry.strip()
        if entry == "*":
            return None
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(
                f"--forwarded-allow-ips: {entry!r} is not an IP address or network"
            ) from None
    return networks


def _address(value: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address from a forwarding entry: `1.2.3.4`, `1.2.3.4:80`, `[::1]:80`, `::1`."""
    value = value.strip().strip('"')
    if value.startswith("["):
        value = value[1 : value.find("]")] if "]" in value else ""
    elif value.count(":") == 1:
        value = value.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def forwarded_for(headers: Headers) -> list[str]:
    """The hops a request passed, client first: `Forwarded`'s `for=`, else X-Forwarded-For."""
    forwarded = headers.getlist("forwarded")
    if forwarded:
        hops = []
        for element in ",".join(forwarded).split(","):
            value = ""  # an element without for= is a hop that did not say (unknown)
            for pair in element.split(";"):
                key, _, item = pair.partition("=")
                if key.strip().lower() == "for":
                    value = item.strip()
            hops.append(value)
        return hops
    return [hop.strip() for hop in ",".join(headers.getlist("x-forwarded-for")).split(",")]


class ForwardedClients:
    """ASGI middleware: the scope's client is the forwarded one, from a trusted proxy."""

    def __init__(self, app: Any, forwarded_allow_ips: Iterable[str] = ()):
        self.app = app
        entries = list(forwarded_allow_ips)
        self.enabled = bool(entries)
        self.networks = trusted_networks(entries)

    def trusted(self, host: str) -> bool:
        if self.networks is None:
            return True
        address = _address(host)
        return address is not None and any(address in network for network in self.networks)

    def client(self, peer: str, headers: Headers) -> str:
        """The client's address for a connection from `peer`."""
        if not self.trusted(peer):
            return peer
        client = peer
        for hop in reversed(forwarded_for(headers)):
            address = _address(hop)
            if address is None:
                break  # unknown or garbage: the hop that reported it is as far as we know
            client = str(address)
            if not self.trusted(client):
                break
        return client

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.enabled and scope["type"] in ("http", "websocket") and scope.get("client"):
            peer, port = scope["client"]
            client = self.client(peer, Headers(scope=scope))
            if client != peer:
                scope = dict(scope, client=(client, 0))
        await self.app(scope, receive, send)
