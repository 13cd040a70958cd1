"""--forwarded-allow-ips: behind a trusted proxy the client named by X-Forwarded-For or
Forwarded is the caller for per-address limits and logs; from anyone else the headers are
ignored."""

from __future__ import annotations

import logging

import httpx
import pytest
from starlette.datastructures import Headers
from websockets.asyncio.client import connect

from intone.provider.server import ServerSettings
from intone.provider.server.forwarded import ForwardedClients, forwarded_for

from support.server import recv_event, running_server, send

SPEECH = {"input": "Hi there, you.", "voice": "alloy", "response_format": "pcm"}  # 14 chars


def client(trusted: tuple[str, ...], peer: str, **headers: str) -> str:
    middleware = ForwardedClients(None, trusted)
    return middleware.client(
        peer, Headers(headers={k.replace("_", "-"): v for k, v in headers.items()})
    )


def test_the_client_is_the_rightmost_untrusted_hop() -> None:
    proxies = ("10.0.0.0/8", "127.0.0.1")
    xff = "x-forwarded-for"
    # From an untrusted peer the header is a claim anyone can make: ignored.
    assert client(proxies, "198.51.100.7", x_forwarded_for="1.2.3.4") == "198.51.100.7"
    assert client(proxies, "127.0.0.1", x_forwarded_for="1.2.3.4") == "1.2.3.4"
    # A client that forges entries only adds to the left of what the proxies append.
    assert client(proxies, "10.0.0.2", x_forwarded_for="6.6.6.6, 1.2.3.4, 10.0.0.9") == "1.2.3.4"
    # Several header lines are one list; spaces and ports do not matter.
    middleware = ForwardedClients(None, proxies)
    headers = Headers(raw=[(xff.encode(), b"6.6.6.6"), (xff.encode(), b" 1.2.3.4:5678 ")])
    assert middleware.client("10.1.1.1", headers) == "1.2.3.4"
    # Only trusted hops: the leftmost is as far as anyone can tell.
    assert client(proxies, "10.0.0.2", x_forwarded_for="10.0.0.5, 10.0.0.9") == "10.0.0.5"
    # Garbage or "unknown" ends the walk at the hop that reported it.
    assert client(proxies, "10.0.0.2", x_forwarded_for="1.2.3.4, <script>") == "10.0.0.2"
    assert client(proxies, "10.0.0.2", x_forwarded_for="1.2.3.4, unknown, 10.0.0.3") == "10.0.0.3"
    # No header: the peer.
    assert client(proxies, "10.0.0.2") == "10.0.0.2"
    # "*" trusts every hop.
    assert client(("*",), "198.51.100.7", x_forwarded_for="1.2.3.4, 5.6.7.8") == "1.2.3.4"


def test_rfc_7239_forwarded() -> None:
    proxies = ("127.0.0.1",)
    forwarded = 'for=192.0.2.60;proto=http;by=203.0.113.43, For="[2001:db8:cafe::17]:4711"'
    assert client(proxies, "127.0.0.1", forwarded=forwarded) == "2001:db8:cafe::17"
    assert client(proxies, "127.0.0.1", forwarded='for="192.0.2.61:80"') == "192.0.2.61"
    # Forwarded wins over X-Forwarded-For when both are sent.
    both = {"forwarded": "for=192.0.2.60", "x_forwarded_for": "1.2.3.4"}
    assert client(proxies, "127.0.0.1", **both) == "192.0.2.60"
    assert client(proxies, "127.0.0.1", forwarded="for=_hidden") == "127.0.0.1"
    assert client(proxies, "127.0.0.1", forwarded="proto=https") == "127.0.0.1"
    # An IPv4 address mapped into IPv6 is the IPv4 one (one caller, one key in the limits).
    assert client(proxies, "::ffff:127.0.0.1", x_forwarded_for="1.2.3.4") == "1.2.3.4"
    assert forwarded_for(Headers(headers={"forwarded": "for=a;by=b, for=c"})) == ["a", "c"]


def test_bad_entries_are_refused() -> None:
    with pytest.raises(ValueError, match="not an IP address"):
        ServerSettings(forwarded_allow_ips=("10.0.0.0/8", "proxy.example.com")).validate()
    ServerSettings(forwarded_allow_ips=("10.0.0.0/8", "::1", "*")).validate()


async def test_limits_count_the_forwarded_client(tiny_checkpoint, caplog) -> None:
    caplog.set_level(logging.INFO, logger="intone.provider.server")
    limits = dict(max_chars_per_minute=20, max_streams_per_client=1)

    async def speak(http, url, **headers) -> int:
        response = await http.post(f"{url}/v1/audio/speech", json=SPEECH, headers=headers)
        return response.status_code

    with running_server(tiny_checkpoint, forwarded_allow_ips=("127.0.0.1",), **limits) as (
        server,
        _,
    ):
        async with httpx.AsyncClient(timeout=30) as http:
            assert await speak(http, server.url, **{"x-forwarded-for": "203.0.113.5"}) == 200
            assert await speak(http, server.url, **{"x-forwarded-for": "203.0.113.5"}) == 429
            assert await speak(http, server.url, **{"x-forwarded-for": "203.0.113.6"}) == 200
            assert await speak(http, server.url, forwarded='for="[2001:db8::1]:4711"') == 200
        # WebSocket connections too: one stream each, as two clients.
        xff = {"x-forwarded-for": "198.51.100.1"}
        async with (
            connect(server.ws_url, additional_headers=xff) as a,
            connect(server.ws_url, additional_headers={"x-forwarded-for": "198.51.100.2"}) as b,
        ):
            await recv_event(a)
            await recv_event(b)
            await send(a, type="start", stream="s")
            await send(b, type="start", stream="s")
            assert (await recv_event(a))["type"] == "started"
            assert (await recv_event(b))["type"] == "started"
    assert any("198.51.100.1" in str(getattr(r, "client", "")) for r in caplog.records)

    # Without trusted proxies the header changes nothing: one caller, over its limit.
    with running_server(tiny_checkpoint, **limits) as (server, _):
        async with httpx.AsyncClient(timeout=30) as http:
            assert await speak(http, server.url, **{"x-forwarded-for": "203.0.113.5"}) == 200
            assert await speak(http, server.url, **{"x-forwarded-for": "203.0.113.6"}) == 429
