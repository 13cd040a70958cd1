"""Text in, audio out: stream text to `intone serve` over its WebSocket and play what comes back.

Start a server (the first run downloads the released model; `--model` takes a local checkpoint,
e.g. one made with `intone make-checkpoint --preset tiny --out /tmp/tiny`):

    intone serve --port 8000 [--model DIR]

Then:

    python agents_examples/websocket_client.py "Hello there! How can I help you today?"
    echo "Your table is booked for 7:30 pm." | python agents_examples/websocket_client.py
    python agents_examples/websocket_client.py --word-by-word --speed 1.2 "As an LLM sends it."

Text comes from the arguments, or from stdin when there are none. `--word-by-word` sends it one
word at a time, `--word-delay` apart, as an LLM's tokens arrive. The audio plays on the speakers
when a sound device is there (`pip install sounddevice`), else it is written to a WAV file
(`--out`, or always with `--out`). TTFA, the time from the first text sent to the first audio
received, is printed with the server's own metrics for the stream.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import wave
from pathlib import Path
from typing import Any

from intone.provider.client import IntoneClient, IntoneError


def open_speaker(sample_rate: int) -> Any | None:
    """A 16-bit mono output stream on the default sound device, or None if there is none."""
    try:
        import sounddevice
    except (ImportError, OSError):  # not installed, or no PortAudio on this machine
        return None
    try:
        sounddevice.query_devices(kind="output")
        speaker = sounddevice.RawOutputStream(samplerate=sample_rate, channels=1, dtype="int16")
    except Exception:  # no output device (a server, a container)
        return None
    speaker.start()
    return speaker


async def send_text(stream: Any, text: str, word_by_word: bool, delay: float) -> None:
    if word_by_word:
        words = text.split(" ")
        for i, word in enumerate(words):
            await stream.push_text(word if i == len(words) - 1 else word + " ")
            await asyncio.sleep(delay)
    else:
        await stream.push_text(text)
    await stream.end_input()


async def speak(args: argparse.Namespace, text: str) -> None:
    options: dict[str, Any] = {}
    if args.speed is not None:
        options["speed"] = args.speed
    if args.no_normalize:
        options["normalize"] = False
    speaker = None if args.out else open_speaker(args.sample_rate)
    out_path = args.out or Path("websocket_client.wav")
    pcm = bytearray()
    async with IntoneClient(args.url) as client:
        stream = await client.stream(
            voice=args.voice,
            sample_rate=args.sample_rate,
            format="pcm_s16le",
            options=options or None,
        )
        sent_at = time.perf_counter()
        sender = asyncio.create_task(send_text(stream, text, args.word_by_word, args.word_delay))
        first_audio: float | None = None
        try:
            async for chunk in stream:
                if first_audio is None:
                    first_audio = time.perf_counter() - sent_at
                    print(f"TTFA {first_audio * 1000:.0f} ms", flush=True)
                if speaker is not None:
                    await asyncio.to_thread(speaker.write, chunk)
                else:
                    pcm += chunk
        finally:
            sender.cancel()
    seconds = len(pcm) / 2 / args.sample_rate
    if speaker is not None:
        speaker.stop()
        speaker.close()
    else:
        with wave.open(str(out_path), "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(args.sample_rate)
            wav.writeframes(bytes(pcm))
        print(f"wrote {seconds:.2f} s of audio to {out_path}")
    if stream.metrics:
        shown = {k: round(v, 3) for k, v in stream.metrics.items() if isinstance(v, float)}
        print(f"server metrics: {shown}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text", nargs="*", help="the text to speak (default: read stdin)")
    parser.add_argument("--url", default="ws://127.0.0.1:8000", help="the server")
    parser.add_argument("--voice", default=None, help="a voice the server knows")
    parser.add_argument("--sample-rate", type=int, default=24000)
    parser.add_argument("--speed", type=float, default=None, help="0.5-2.0, pitch kept")
    parser.add_argument("--no-normalize", action="store_true", help="send the text unread")
    parser.add_argument("--word-by-word", action="store_true", help="send a word at a time")
    parser.add_argument("--word-delay", type=float, default=0.05, help="seconds between words")
    parser.add_argument("--out", type=Path, help="write a WAV file instead of playing")
    args = parser.parse_args()
    if args.out is not None and not args.out.parent.is_dir():
        parser.error(f"--out: no folder {args.out.parent}")  # known before any audio is made
    text = " ".join(args.text) if args.text else sys.stdin.read()
    if not text.strip():
        parser.error("no text: pass it as arguments or on stdin")
    try:
        asyncio.run(speak(args, text.strip()))
    except (IntoneError, OSError) as e:  # the server's refusal, or no server at --url
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
