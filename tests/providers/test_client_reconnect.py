"""The client's `reconnect=True`: a dropped connection or a drain restarts the turns that had
no audio yet on a new connection; turns already heard end with a connection error at once.

Between the client and two servers sits a WebSocket relay (a load balancer in small, as Ray
Serve's proxy is): it can drop every connection without a close frame, as the proxy does when a
replica dies, and send new connections to the other server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

from intone.provider.client import IntoneClient, IntoneConnectionError

from support.server import running_server


class Relay:
    def __init__(self, upstream: str, then: str | None = None):
        self.upstream = upstream  # ws://host:port; new connections go here
        self.then = then  # if set: where connections go after the next one
        self.links: set[tuple[ServerConnection, object]] = set()

    async def __aenter__(self) -> Relay:
        self.server = await serve(self._relay, "127.0.0.1", 0, compression=None, max_size=2**24)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, client: ServerConnection) -> None:
        target = self.upstream
        if self.then is not None:
            self.upstream, self.then = self.then, None
        async with connect(
            target + client.request.path,
            compression=None,
            max_size=2**24,
        ) as upstream:
            link = (client, upstream)
            self.links.add(link)

            async def pump(source, sink) -> None:
                with contextlib.suppress(Exception):
                    async for message in source:
                        await sink.send(message)

            tasks = [
                asyncio.create_task(pump(client, upstream)),
                asyncio.create_task(pump(upstream, client)),
            ]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                task.cancel()
            self.links.discard(link)
            # Pass the server's close on (code and reason), as a proxy does.
            if upstream.close_code is not None:
                await client.close(upstream.close_code, upstream.close_reason or "")

    def drop_all(self) -> None:
        """Every connection gone at once, no close frame: a replica died."""
        for client, upstream in list(self.links):
            client.transport.abort()
            upstream.transport.abort()


@pytest.fixture(scope="module")
def servers(tiny_checkpoint):
    with running_server(tiny_checkpoint) as a, running_server(tiny_checkpoint) as b:
        yield a[0], b[0]


async def _first_audio(stream, timeout: float = 30.0) -> bytes:
    return await asyncio.wait_for(stream.__aiter__().__anext__(), timeout)


async def _rest(stream, timeout: float = 60.0) -> bytes:
    async def collect() -> bytes:
        return b"".join([pcm async for pcm in stream])

    return await asyncio.wait_for(collect(), timeout)


async def test_dropped_connection_restarts_only_unheard_turns(servers):
    a, b = servers
    async with (
        Relay(f"ws://127.0.0.1:{a.port}") as relay,
        IntoneClient(relay.url, reconnect=True) as client,
    ):
        heard = await client.stream(text="Hello there. ", options={"seed": 1})
        heard_audio = heard.__aiter__()
        assert await asyncio.wait_for(heard_audio.__anext__(), 30)
        pending = await client.stream(options={"seed": 2})
        await pending.push_text("A turn that has not been heard")

        relay.upstream = f"ws://127.0.0.1:{b.port}"  # the live "replica"
        relay.drop_all()
        started = time.monotonic()
        with pytest.raises(IntoneConnectionError):
            async for _ in heard_audio:
                pass
        assert time.monotonic() - started < 5

        await pending.push_text(" yet, and it will be now.")
        await pending.end_input()
        assert await _rest(pending)
        assert pending.metrics is not None and pending.metrics["clauses"] >= 1
        assert client.reconnects == 1
        # The connection is usable for new turns.
        fresh = await client.stream(text="And one more.", end=True, options={"seed": 3})
        assert await _rest(fresh)


async def test_without_reconnect_a_drop_ends_every_stream(servers):
    a, _ = servers
    async with (
        Relay(f"ws://127.0.0.1:{a.port}") as relay,
        IntoneClient(relay.url) as client,
    ):
        pending = await client.stream(options={"seed": 5})
        await pending.push_text("Never heard")
        relay.drop_all()
        with pytest.raises(IntoneConnectionError):
            await _rest(pending, 10)
        assert client.reconnects == 0


async def test_plugins_remote_backend_retries_an_unheard_turn(servers):
    """The LiveKit plugin's and the Pipecat service's remote mode (RemoteBackend) ride on the
    same reconnect: a turn cut before its first audio still speaks."""
    from intone.engine import AudioChunk
    from intone.provider.backends import RemoteBackend

    a, b = servers
    async with Relay(f"ws://127.0.0.1:{a.port}") as relay:
        backend = RemoteBackend(relay.url)
        try:
            turn = await backend.open_stream(None, {"seed": 6})
            await turn.push_text("A plugin turn cut off")
            relay.upstream = f"ws://127.0.0.1:{b.port}"
            relay.drop_all()
            await turn.push_text(" before it spoke.")
            await turn.end_input()

            async def audio() -> int:
                return sum([len(e.samples) async for e in turn if isinstance(e, AudioChunk)])

            assert await asyncio.wait_for(audio(), 60) > 0
        finally:
            await backend.aclose()


# Last: server A stays drained.
async def test_drain_cancel_before_first_audio_retries_elsewhere(servers):
    a, b = servers
    async with (
        Relay(f"ws://127.0.0.1:{a.port}") as relay,
        IntoneClient(relay.url, reconnect=True) as client,
    ):
        pending = await client.stream(options={"seed": 4})
        await pending.push_text("Spoken after a drain")
        relay.upstream = f"ws://127.0.0.1:{b.port}"
        # Server A drains with no time left: `cancelled` (shutdown), then close 1001.
        runtime = a.app.state.intone
        await asyncio.get_running_loop().run_in_executor(None, lambda: a.call(runtime.drain(0.0)))
        await pending.push_text(", on the other server.")
        await pending.end_input()
        assert await _rest(pending)
        assert not pending.cancelled and client.reconnects == 1


async def test_plugins_remote_backend_retries_a_draining_server(servers):
    """A turn refused with `shutting_down` (server A drained by the test above) is retried on a
    fresh connection, which the load balancer sends to server B."""
    from intone.provider.backends import RemoteBackend

    a, b = servers
    assert a.app.state.intone.draining
    async with Relay(f"ws://127.0.0.1:{a.port}", then=f"ws://127.0.0.1:{b.port}") as relay:
        backend = RemoteBackend(relay.url)
        try:
            turn = await backend.open_stream(None, {"seed": 7})
            await turn.push_text("Spoken by the server that is not draining.")
            await turn.end_input()
            assert await asyncio.wait_for(_count_audio(turn), 60) > 0
        finally:
            await backend.aclose()


async def _count_audio(turn) -> int:
    from intone.engine import AudioChunk

    return sum([len(e.samples) async for e in turn if isinstance(e, AudioChunk)])


async def test_a_server_that_never_answers_times_out_with_a_typed_error():
    """A hung server holds the socket open: `stream()` waited forever for `started` (dead air
    in a turn); a missing hello raised a bare TimeoutError."""
    from intone.engine.errors import Kind
    from intone.provider import protocol
    from intone.provider.backends import RemoteBackend
    from intone.provider.client import IntoneTimeoutError
    from intone.provider.errors import error_kind

    received: list[str] = []

    async def hung(ws: ServerConnection) -> None:
        limits = protocol.Limits(**{f.name: 1 for f in dataclasses.fields(protocol.Limits)})
        hello = protocol.HelloEvent(
            "c", "m", "0", 24000, ["default"], "default", "generated", limits
        )
        await ws.send(protocol.encode_event(hello))
        async for message in ws:  # never answers
            received.append(protocol.parse_message(message).TYPE)

    async with serve(hung, "127.0.0.1", 0) as server:
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with IntoneClient(url, open_timeout=0.5) as client:
            started = time.perf_counter()
            with pytest.raises(IntoneTimeoutError) as e:
                await asyncio.wait_for(client.stream(text="Hello.", end=True), 10)
            assert time.perf_counter() - started < 5
            assert error_kind(e.value) is Kind.CONNECTION  # the frameworks retry it
            await asyncio.sleep(0.1)
            assert received == ["start", "cancel"]  # freed there, should it start later

    async def mute(ws: ServerConnection) -> None:  # accepts the WebSocket, never says hello
        await ws.wait_closed()

    async with serve(mute, "127.0.0.1", 0) as server:
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        with pytest.raises(IntoneTimeoutError, match="no hello"):
            await asyncio.wait_for(IntoneClient(url, open_timeout=0.5).connect(), 10)

    async with serve(hung, "127.0.0.1", 0) as server:
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        # The plugins' remote backend tries one fresh connection, then reports the timeout.
        backend = RemoteBackend(url, open_timeout=0.5)
        with pytest.raises(IntoneTimeoutError):
            await asyncio.wait_for(backend.open_stream(None, {}), 10)
        await backend.aclose()
