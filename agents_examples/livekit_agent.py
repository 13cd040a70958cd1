"""A LiveKit voice agent that speaks through intone.

The worker runs its jobs on threads (JobExecutorType.THREAD), so every session in the process
shares one intone engine and their speech batches; `intone.load_fnc` reports that engine's
occupancy so LiveKit sends no new jobs to a worker whose engine is full. The engine is loaded and
warmed once per process by the setup function.

Console mode (your microphone and speakers, no LiveKit server):

    pip install "intone[livekit]" livekit-plugins-openai sounddevice
    export OPENAI_API_KEY=...      # speech-to-text and the LLM; intone does the speaking
    python agents_examples/livekit_agent.py console

    Without OPENAI_API_KEY the agent has no ears: it greets you through intone, and in text mode
    (`console --text`, or Ctrl+T) it echoes what you type.

Against a LiveKit server:

    export LIVEKIT_URL=wss://... LIVEKIT_API_KEY=... LIVEKIT_API_SECRET=...
    python agents_examples/livekit_agent.py start

Settings (environment):
    INTONE_MODEL   checkpoint dir, config .yaml or hf:// path (default: kyutai/pocket-tts;
                   `intone make-checkpoint --preset tiny --out DIR` makes an offline one)
    INTONE_VOICE   a voice of the model ("alba" ... for the released one), a WAV or .safetensors
    INTONE_URL     ws://host:port of an `intone serve`: remote mode, for process-per-job workers
"""

from __future__ import annotations

import asyncio
import logging
import os

from livekit.agents import (
    Agent,
    AgentServer,
    AgentSession,
    APIConnectOptions,
    JobContext,
    JobExecutorType,
    JobProcess,
    cli,
    llm,
)
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS
from livekit.plugins import intone

logger = logging.getLogger("intone-agent")

MODEL = os.environ.get("INTONE_MODEL") or None
VOICE = os.environ.get("INTONE_VOICE") or None
URL = os.environ.get("INTONE_URL") or None

GREETING = "Hello! I am a voice agent speaking through intone. How can I help you today?"


def make_tts() -> intone.TTS:
    """The one line a user of another TTS plugin changes."""
    if URL:
        return intone.TTS(base_url=URL, voice=VOICE)
    return intone.TTS(model=MODEL, voice=VOICE)


class EchoLLM(llm.LLM):
    """An offline stand-in for an LLM: repeats the user's last message, word by word."""

    def chat(
        self,
        *,
        chat_ctx: llm.ChatContext,
        tools: list | None = None,
        conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS,
        **kwargs: object,
    ) -> llm.LLMStream:
        return _EchoStream(self, chat_ctx=chat_ctx, tools=tools or [], conn_options=conn_options)


class _EchoStream(llm.LLMStream):
    async def _run(self) -> None:
        said = next(
            (m.text_content for m in reversed(self.chat_ctx.messages()) if m.role == "user"),
            None,
        )
        reply = f"You said: {said}" if said else GREETING
        for i, word in enumerate(reply.split(" ")):
            await asyncio.sleep(0.02)  # an LLM's token rate, roughly
            delta = llm.ChoiceDelta(role="assistant", content=word if i == 0 else " " + word)
            self._event_ch.send_nowait(llm.ChatChunk(id="echo", delta=delta))


def make_session() -> AgentSession:
    if os.environ.get("OPENAI_API_KEY"):
        from livekit.plugins import openai

        return AgentSession(
            stt=openai.STT(use_realtime=True),
            llm=openai.LLM(model="gpt-4o-mini"),
            tts=make_tts(),
        )
    logger.warning("OPENAI_API_KEY is not set: no speech-to-text, and the LLM only echoes")
    return AgentSession(llm=EchoLLM(), tts=make_tts())


class Assistant(Agent):
    def __init__(self) -> None:
        super().__init__(
            instructions="You are a friendly voice assistant. Answer in one or two short "
            "sentences, in plain words: no lists, no markdown, no emojis."
        )

    async def on_enter(self) -> None:
        self.session.say(GREETING)


def prewarm(proc: JobProcess) -> None:
    """Load and warm the shared engine once per worker process, before any job needs it."""
    if not URL:
        intone.prewarm(MODEL)


server = AgentServer(
    # Jobs on threads of this process: their sessions share the engine and batch together.
    job_executor_type=JobExecutorType.THREAD,
    # Dispatch by the engine's occupancy (0..1), not by CPU usage (remote: the default).
    load_fnc=None if URL else intone.load_fnc,
    setup_fnc=prewarm,
)


@server.rtc_session()
async def entrypoint(ctx: JobContext) -> None:
    session = make_session()
    await session.start(agent=Assistant(), room=ctx.room)


if __name__ == "__main__":
    cli.run_app(server)
