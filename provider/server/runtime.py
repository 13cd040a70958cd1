"""What one server process shares: the engines, their voices, the streams in flight, the drain.

A server runs one or more models (`intone serve --model english --model fr`), one engine each
with its own voices; the first is the default, and a request picks another by name or alias
(`select`). The app gets each engine either ready-made (the caller owns it) or from a factory
that runs on first use. Lazy start matters because a sub-app mounted in a user's
FastAPI/Starlette app (and some hosts) never sees lifespan events; the lifespan, when it runs,
only makes the start eager.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest

from intone.engine import Engine, releases
from intone.engine.collector import freeze_long_lived
from intone.engine.errors import UnknownModelError
from intone.provider.model_names import model_name
from intone.provider.protocol import echo
from intone.provider.server.access import Access
from intone.provider.server.limits import Limits
from intone.provider.server.logs import ClientErrorLog
from intone.provider.server.metrics import EnginesCollector, ServerMetrics
from intone.provider.server.settings import ServerSettings
from intone.provider.server.voice_store import VoiceStore
from intone.provider.server.voices import VoiceResolver, add_voice_dir
from intone.provider.voices import known_voices

logger = logging.getLogger(__name__)


def server_version() -> str:
    try:
        return metadata.version("intone")
    except metadata.PackageNotFoundError:  # running from a source tree
        return "unknown"


# Model names OpenAI clients send (Pipecat's and LiveKit's OpenAI TTS do): the default model.
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")


@dataclass
class ServedModel:
    """One model the server runs: its engine (or how to build it), its voices and names."""

    requested: str | None = None  # the --model value; None: the default model
    engine: Engine | None = None
    factory: Callable[[], Engine] | None = None
    voices: VoiceResolver | None = None  # set once ready
    name: str = ""  # what clients call it; set once ready
    aliases: list[str] = field(default_factory=list)  # other names that pick it
    language: str | None = None  # a release's language

    def take_names(self, taken: set[str]) -> None:
        """Its name and aliases, none of them in `taken` (which then holds them): a release by
        its reference name (plus the --model value, its shortcuts and its language), another
        checkpoint by its directory or file name (`model_names.model_name`)."""
        assert self.engine is not None
        source = self.engine.loaded.source
        name = model_name(source)
        aliases: list[str] = []
        release = releases.release_name(source)
        if release is not None:
            self.language = releases.language_of(release)
            aliases = [*releases.language_shortcuts(release), self.language]
            aliases.append(releases.LANGUAGES[self.language])
        if self.requested is not None:
            aliases.insert(0, self.requested)
        base, n = name, 2
        while name in taken:
            name, n = f"{base}-{n}", n + 1
        taken.add(name)
        self.name = name
        # A language or shortcut served twice picks the first model that has it.
        self.aliases = [a for a in dict.fromkeys(aliases) if a not in taken]
        taken.update(self.aliases)

    def describe(self) -> dict[str, Any]:
        assert self.engine is not None and self.voices is not None
        return {
            "name": self.name,
            "aliases": self.aliases,
            "language": self.language,
            "weights": self.engine.loaded.weights,
            "voices": self.voices.known(),
            "default_voice": self.engine.default_voice,
        }


class EngineUnavailableError(RuntimeError):
    """The engine could not be built; requests get 503."""


WATCHDOG_INTERVAL = 0.5  # seconds between the watchdog's rounds


class InFlight(Protocol):
    """A stream the drain can end: WebSocket stream or HTTP response."""

    request_id: str
    started_at: float  # time.perf_counter()

    def shutdown(self) -> None:
        """Cancel now and tell the client with a final event."""

    def expire(self) -> None:
        """The stream outlived the maximum lifetime: end it with a final error."""


class Closable(Protocol):
    async def close(self, code: int, reason: str) -> None: ...

    def watch(self, now: float) -> None:
        """Enforce the connection's timeouts (idle, slow client); called every round."""


class Runtime:
    def __init__(
        self,
        engine: Engine | None = None,
        *,
        engine_factory: Callable[[], Engine] | None = None,
        voices_dir: str | Path | None = None,
        settings: ServerSettings | None = None,
        models: list[ServedModel] | None = None,
        voice_store: str | Path | None = None,
    ):
        if models is None:
            if engine is None and engine_factory is None:
                raise ValueError("pass an engine, an engine_factory or models")
            models = [ServedModel(engine=engine, factory=None if engine else engine_factory)]
        elif engine is not None or engine_factory is not None:
            raise ValueError("pass either models or an engine/engine_factory")
        if not models or any(m.engine is None and m.factory is None for m in models):
            raise ValueError("every served model needs an engine or a factory")
        self.settings = settings or ServerSettings()
        self.settings.validate()
        self.models = models
        self._voices_dir = Path(voices_dir) if voices_dir is not None else None
        # Uploaded voices (voice_store.py): opened with the engines; None: a temporary directory.
        self._voice_store_dir = Path(voice_store) if voice_store is not None else None
        self.voice_store: VoiceStore | None = None
        self.voice_uploads = asyncio.Semaphore(1)  # one upload encodes at a time
        self._lock: asyncio.Lock | None = None
        self._failure: Exception | None = None
        self.voices: VoiceResolver | None = None
        self.streams: set[InFlight] = set()
        self.connections: set[Closable] = set()
        self.draining = False
        self.closed = False
        self.version = server_version()
        self.access = Access(
            self.settings.api_keys, self.settings.allowed_origins, self.settings.allowed_hosts
        )
        self.limits = Limits(self.settings)
        self.client_errors = ClientErrorLog()
        self._watchdog: asyncio.Task | None = None
        self.metrics = ServerMetrics(lambda: len(self.connections), lambda: len(self.streams))
        self._engine_metrics = CollectorRegistry()
        self._engine_metrics.register(EnginesCollector(self._engine_registries))

    # ---- engine

    @property
    def engine(self) -> Engine | None:
        """The default model's engine once ready(), else None."""
        return self.models[0].engine if self.voices is not None else None

    @property
    def owns_engine(self) -> bool:
        """Whether the default model's engine is this runtime's to close (it built it)."""
        return self.models[0].factory is not None

    @property
    def engines(self) -> list[Engine]:
        """Every served model's engine once ready(), else none."""
        return [m.engine for m in self.ready_models if m.engine is not None]

    @property
    def ready_models(self) -> list[ServedModel]:
        """Every served model once ready() has built their engines, else none."""
        if self.voices is None:
            return []
        return [m for m in self.models if m.engine is not None]

    def _engine_registries(self) -> list[tuple[str, CollectorRegistry]]:
        return [(m.name, m.engine.prometheus_registry) for m in self.ready_models if m.engine]

    def prometheus(self) -> bytes:
        """Prometheus text: every served model's engine metrics (labelled `model`), then the
        server's."""
        return generate_latest(self._engine_metrics) + self.metrics.prometheus()

    def select(self, model: str | None) -> ServedModel:
        """The served model a request names (name or alias; None, "" or an OpenAI model name:
        the default). Raises UnknownModelError naming the served ones. Only once ready().

        A server of one model also takes a name that means no model intone knows (OpenAI
        clients send ids of their own), as it did before it served several; a release name or
        language it does not serve is refused, never spoken by another model.
        """
        if model is None or model == "" or model in OPENAI_MODELS:
            return self.models[0]
        for served in self.models:
            if model == served.name or model in served.aliases:
                return served
        known_model = releases.release_name(model) is not None or model in releases.LANGUAGES
        if len(self.models) == 1 and not known_model:
            return self.models[0]
        served_names = ", ".join(
            f"{m.name} ({', '.join(m.aliases)})" if m.aliases else m.name for m in self.models
        )
        raise UnknownModelError(
            f"this server does not serve model {echo(model)}; it serves: {served_names}"
        )

    async def ready(self) -> Engine:
        """The default model's started engine; every model is built (with its voices) on the
        first call."""
        if self.voices is not None:
            assert self.models[0].engine is not None
            return self.models[0].engine
        if self._failure is not None:
            raise EngineUnavailableError(str(self._failure)) from self._failure
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.voices is None:
                try:
                    await self._prepare()
                except Exception as e:
                    # Building is slow and failures are configuration errors: don't retry.
                    if isinstance(e, ValueError | FileNotFoundError):
                        logger.error("the engine could not be started: %s", e)
                    else:
                        logger.exception("the engine could not be started")
                    self._failure = e
                    raise EngineUnavailableError(str(e)) from e
        engine = self.models[0].engine
        assert engine is not None
        if self._watchdog is None and not self.closed:
            self._watchdog = asyncio.create_task(self._watch(), name="intone-watchdog")
        return engine

    async def _watch(self) -> None:
        """Timeouts that no event triggers: stream lifetimes, idle and slow connections."""
        rounds = 0
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL)
            now = time.perf_counter()
            try:
                limit = self.settings.max_stream_seconds
                for stream in list(self.streams):
                    if now - stream.started_at > limit:
                        stream.expire()
                for connection in list(self.connections):
                    connection.watch(now)
                rounds += 1
                if rounds % 60 == 0:
                    self.limits.prune()
            except Exception:  # a bug here must not end the watchdog
                logger.exception("watchdog round failed")

    def log_client_error(self, log: logging.LoggerAdapter, message: str, **fields: object) -> None:
        """Log a client's mistake at INFO, within the client-error budget."""
        dropped = self.client_errors.allow()
        if dropped is None:
            return
        if dropped:
            fields["suppressed"] = dropped  # similar lines dropped since the last one
        log.info("%s", message, extra=fields)

    async def _prepare(self) -> None:
        taken: set[str] = set()
        store = self.voice_store or await asyncio.to_thread(VoiceStore, self._voice_store_dir)
        self.voice_store = store
        for index, served in enumerate(self.models):
            await self._prepare_model(served, default=index == 0)
            served.take_names(taken)
            assert served.voices is not None and served.engine is not None
            served.voices.store, served.voices.model = store, served.name
            await asyncio.to_thread(_register_stored, served.engine, store, served.name)
        # Marks the runtime ready: the default model's voices.
        self.voices = self.models[0].voices
        if len(self.models) > 1:
            logger.info("serving models %s", [m.name for m in self.models])
        freeze_long_lived()  # the engines serve until the app ends

    async def _prepare_model(self, served: ServedModel, default: bool) -> None:
        if served.engine is None:
            assert served.factory is not None
            started = time.perf_counter()
            served.engine = await asyncio.to_thread(served.factory)
            logger.info("engine built in %.1f s", time.perf_counter() - started)
        engine = served.engine
        engine.start()
        await asyncio.to_thread(engine.prepare_traces)
        if self._voices_dir is not None:
            await asyncio.to_thread(add_voice_dir, engine, self._voices_dir)
        known = known_voices(engine)
        # Aliases must name a voice of the default model; other models take those they can.
        aliases = {}
        for alias, target in self.settings.voice_aliases.items():
            if target in known:
                aliases[alias] = target
            elif default:
                raise ValueError(f"voice alias {alias}={target}: no voice {target!r}")
        served.voices = VoiceResolver(engine, aliases)
        loaded = engine.loaded
        logger.info(
            "serving %s (%s weights), voices %s",
            loaded.source,
            loaded.weights,
            engine.voices,
            extra={"weights": loaded.weights, "source": loaded.source},
        )

    # ---- streams and connections

    def add_stream(self, stream: InFlight) -> None:
        self.streams.add(stream)

    def remove_stream(self, stream: InFlight) -> None:
        self.streams.discard(stream)

    def add_connection(self, connection: Closable) -> None:
        self.connections.add(connection)
        self.metrics.connection_opened()

    def remove_connection(self, connection: Closable) -> None:
        self.connections.discard(connection)

    # ---- shutdown

    async def drain(self, timeout: float | None = None) -> None:
        """Refuse new streams, give in-flight ones `timeout` s to finish, cancel the rest (each
        gets a final event), then close the WebSocket connections with 1001 (going away)."""
        timeout = self.settings.drain_timeout if timeout is None else timeout
        self.draining = True
        self.metrics.draining = True
        logger.info("draining: %d stream(s) in flight, up to %.1f s", len(self.streams), timeout)
        deadline = time.monotonic() + timeout
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.streams:
            logger.warning("drain deadline: cancelling %d stream(s)", len(self.streams))
            for stream in list(self.streams):
                stream.shutdown()
        # Let the final events and HTTP responses go out before the connections close.
        settle = time.monotonic() + 2.0
        while self.streams and time.monotonic() < settle:
            await asyncio.sleep(0.02)
        await asyncio.gather(
            *(c.close(1001, "server shutting down") for c in list(self.connections)),
            return_exceptions=True,
        )
        logger.info("drained")

    async def close(self) -> None:
        """Cancel whatever is left and release an engine this runtime built."""
        if self.closed:
            return
        self.closed = True
        self.draining = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        for stream in list(self.streams):
            stream.shutdown()
        for served in self.models:
            if served.factory is not None and served.engine is not None:
                await asyncio.to_thread(served.engine.close)
                logger.info("engine closed")
        if self.voice_store is not None:
            self.voice_store.close()  # a temporary store goes; a --voice-store stays


def _register_stored(engine: Engine, store: VoiceStore, model: str) -> None:
    """The model's stored voices, registered lazily: their headers are read, their pages are
    written when a stream first uses them."""
    count = 0
    for stored in list(store.voices.values()):
        if stored.model != model:
            continue
        try:
            engine.add_voice(stored.id, stored.path, lazy=True)
        except (ValueError, OSError) as e:
            logger.warning("stored voice %s (%s) skipped: %s", stored.id, stored.path.name, e)
            continue
        count += 1
    if count:
        logger.info("%d stored voice(s) for %s from %s", count, model, store.directory)
