"""A Pipecat bot that speaks through intone, behind a WebSocket transport.

Every WebSocket connection gets its own pipeline (transport in -> text turns -> intone TTS ->
transport out); all of them share the process's one engine, so concurrent connections batch.
A client sends JSON text messages and gets raw 16-bit mono PCM back as binary messages:

    {"type": "reply", "text": "..."}  spoken as an LLM turn: streamed word by word
    {"type": "speak", "text": "..."}  spoken as one TTSSpeakFrame
    {"type": "interrupt"}             barge-in: stops the audio and the engine request
    server -> client: binary PCM, {"type": "tts_started"} / {"type": "tts_stopped"} around each
    turn's audio, and {"type": "error", "message": "..."} for a message it cannot use or a turn
    the TTS failed

Put your STT and LLM services in front of the TTS for a voice agent; the TTS is the same.

Run the bot (the first run downloads the released model; --model takes a local checkpoint,
e.g. one made with `intone make-checkpoint --preset tiny --out /tmp/tiny`):

    pip install "intone[pipecat]"
    python agents_examples/pipecat_bot.py serve --port 8765 [--model DIR] [--voice alba]
    # remote mode: the engine runs in `intone serve` instead of in the bot's process
    python agents_examples/pipecat_bot.py serve --port 8765 --base-url ws://127.0.0.1:8000

Talk to it (writes what the bot said to a WAV file):

    python agents_examples/pipecat_bot.py say "Hello there! How can I help you today?" --out hi.wav
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time
import wave
from typing import Any

# At module level: FastAPI resolves the endpoint's annotations from the module's globals.
from fastapi import WebSocket

logger = logging.getLogger("pipecat_bot")

SAMPLE_RATE = 24000  # the transport's output rate; the service resamples if it differs


def make_app(model: str | None, voice: str | None, base_url: str | None, sample_rate: int) -> Any:
    from fastapi import FastAPI
    from pipecat.frames.frames import (
        ErrorFrame,
        Frame,
        InputAudioRawFrame,
        InputTransportMessageFrame,
        LLMFullResponseEndFrame,
        LLMFullResponseStartFrame,
        LLMTextFrame,
        OutputAudioRawFrame,
        OutputTransportMessageFrame,
        TTSSpeakFrame,
        TTSStartedFrame,
        TTSStoppedFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.serializers.base_serializer import FrameSerializer
    from pipecat.transports.websocket.fastapi import (
        FastAPIWebsocketParams,
        FastAPIWebsocketTransport,
    )
    from pipecat.workers.runner import WorkerRunner

    from intone.provider import registry
    from intone.provider.pipecat import IntoneTTSService

    class JsonInPcmOutSerializer(FrameSerializer):
        """JSON messages in, raw PCM (binary) and JSON events out."""

        async def serialize(self, frame: Frame) -> str | bytes | None:
            if isinstance(frame, OutputAudioRawFrame):
                return frame.audio
            if isinstance(frame, OutputTransportMessageFrame):
                return json.dumps(frame.message)
            return None

        async def deserialize(self, data: str | bytes) -> Frame | None:
            if isinstance(data, bytes):
                return None  # no microphone audio in this demo
            try:
                return InputTransportMessageFrame(message=json.loads(data))
            except json.JSONDecodeError:
                return InputTransportMessageFrame(message={"type": "reply", "text": data})

    class TextTurns(FrameProcessor):
        """Client messages to what an STT + LLM would send the TTS; the TTS's errors (they
        travel upstream) back to the client."""

        async def tell_client(self, error: str) -> None:
            message = {"type": "error", "message": error}
            await self.push_frame(OutputTransportMessageFrame(message=message))

        async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, ErrorFrame) and direction == FrameDirection.UPSTREAM:
                await self.tell_client(frame.error)
            if not isinstance(frame, InputTransportMessageFrame):
                if not isinstance(frame, InputAudioRawFrame):
                    await self.push_frame(frame, direction)
                return
            if direction != FrameDirection.DOWNSTREAM:
                return
            message = frame.message if isinstance(frame.message, dict) else {}
            kind, text = message.get("type"), str(message.get("text", ""))
            if kind == "interrupt":
                await self.broadcast_interruption()
            elif kind == "speak" and text.strip():
                await self.push_frame(TTSSpeakFrame(text))
            elif kind == "reply" and text.strip():
                await self.push_frame(LLMFullResponseStartFrame())
                for i, word in enumerate(text.split(" ")):
                    await self.push_frame(LLMTextFrame(word if i == 0 else " " + word))
                await self.push_frame(LLMFullResponseEndFrame())
            elif kind in ("speak", "reply"):
                await self.tell_client(f"nothing to say: {kind} needs a non-blank text")
            else:
                await self.tell_client(
                    f"unknown message type {kind!r}: use reply, speak, interrupt"
                )

    class TurnEvents(FrameProcessor):
        """Tell the client where each turn's audio starts and ends."""

        async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            await self.push_frame(frame, direction)
            if isinstance(frame, TTSStartedFrame):
                await self.push_frame(OutputTransportMessageFrame(message={"type": "tts_started"}))
            elif isinstance(frame, TTSStoppedFrame):
                await self.push_frame(OutputTransportMessageFrame(message={"type": "tts_stopped"}))

    if base_url is None:
        # Load and warm the engine once, before the first connection; every pipeline shares it.
        registry.prewarm(model)

    app = FastAPI()

    @app.websocket("/ws")
    async def bot(websocket: WebSocket) -> None:
        await websocket.accept()
        transport = FastAPIWebsocketTransport(
            websocket,
            FastAPIWebsocketParams(
                serializer=JsonInPcmOutSerializer(),
                audio_out_enabled=True,
                audio_out_sample_rate=sample_rate,
                allowed_origins=[],
            ),
        )
        tts = IntoneTTSService(
            model=model,
            base_url=base_url,
            settings=IntoneTTSService.Settings(voice=voice),
        )
        pipeline = Pipeline([transport.input(), TextTurns(), tts, TurnEvents(), transport.output()])
        worker = PipelineWorker(
            pipeline,
            params=PipelineParams(enable_metrics=True, enable_usage_metrics=True),
            enable_rtvi=False,  # this demo's client speaks its own little protocol
        )

        @transport.event_handler("on_client_disconnected")
        async def on_client_disconnected(transport: Any, websocket: Any) -> None:
            await worker.cancel()

        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        await runner.run()

    return app


class BotError(Exception):
    """The bot refused the text, its TTS failed, or it went silent."""


async def say(
    url: str,
    text: str,
    out: str,
    sample_rate: int,
    interrupt_after: float | None,
    timeout: float = 30.0,
) -> None:
    """A client: send one reply, collect the audio until the turn stops, write a WAV.

    BotError if the bot answers with an error, or sends nothing for `timeout` seconds."""
    import websockets

    pcm = bytearray()
    async with websockets.connect(url, open_timeout=timeout) as ws:
        await ws.send(json.dumps({"type": "reply", "text": text}))
        started = time.perf_counter()
        first_audio = None
        while True:
            barge_in = None
            if interrupt_after is not None:
                barge_in = max(0.0, started + interrupt_after - time.perf_counter())
                barge_in = barge_in if barge_in < timeout else None
            try:
                message = await asyncio.wait_for(
                    ws.recv(), timeout if barge_in is None else barge_in
                )
            except TimeoutError:
                if barge_in is None:
                    raise BotError(f"the bot sent nothing for {timeout:g} s") from None
                await ws.send(json.dumps({"type": "interrupt"}))
                break
            except websockets.ConnectionClosed as e:
                raise BotError(f"the bot closed the connection ({e})") from None
            if isinstance(message, bytes):
                first_audio = first_audio or time.perf_counter() - started
                pcm += message
                continue
            event = json.loads(message)
            if event.get("type") == "error":
                raise BotError(event.get("message", "error"))
            if event.get("type") == "tts_stopped":
                if not pcm:
                    raise BotError(await _reason(ws) or "the turn ended with no audio")
                break
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(bytes(pcm))
    seconds = len(pcm) / 2 / sample_rate
    print(f"{seconds:.2f} s of audio (first after {first_audio or 0:.3f} s) -> {out}")


async def _reason(ws: Any) -> str | None:
    """The error the bot sends after a turn that failed, if one comes within a second (the
    TTS's error travels upstream and back, so it may come after the turn's tts_stopped)."""
    import websockets

    with contextlib.suppress(TimeoutError, websockets.ConnectionClosed):
        async with asyncio.timeout(1.0):
            while True:
                message = await ws.recv()
                if isinstance(message, str) and json.loads(message).get("type") == "error":
                    return json.loads(message).get("message")
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the bot's WebSocket server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8765)
    serve.add_argument("--model", default=None, help="checkpoint dir (default: released model)")
    serve.add_argument("--voice", default=None)
    serve.add_argument("--base-url", default=None, help="use a running `intone serve` instead")
    serve.add_argument("--sample-rate", type=int, default=SAMPLE_RATE)
    client = commands.add_parser("say", help="send text to a running bot, save the audio")
    client.add_argument("text")
    client.add_argument("--url", default="ws://127.0.0.1:8765/ws")
    client.add_argument("--out", default="bot.wav")
    client.add_argument("--sample-rate", type=int, default=SAMPLE_RATE)
    client.add_argument("--interrupt-after", type=float, default=None, help="barge in after S s")
    client.add_argument("--timeout", type=float, default=30.0, help="give up after S s of silence")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    if args.command == "serve":
        import uvicorn

        app = make_app(args.model, args.voice, args.base_url, args.sample_rate)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    else:
        try:
            asyncio.run(
                say(
                    args.url,
                    args.text,
                    args.out,
                    args.sample_rate,
                    args.interrupt_after,
                    args.timeout,
                )
            )
        except (BotError, OSError) as e:
            raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
