"""Voices people bring, as bytes: checked, then encoded (audio) or read (a voice state).

One home for what makes a file a usable voice, for the server's `POST /v1/voices` and the
plugins' in-process `voice=bytes`: WAV, FLAC, MP3 or OGG audio that soundfile reads, whose
header is true to the file (a WAV whose data chunk promises more than it holds, or a FLAC
whose header promises more frames, is truncated), finite, from 1 s to `max_seconds` long (only
the first 30 s are used, as the reference does), and not silent; stereo is mixed down and any
rate resampled. Or a voice-state `.safetensors` (`pocket-tts export-voice`) that fits the
model. A model released without voice cloning takes voice states only. Each refusal is a
`VoiceRefusedError` with its protocol code.
"""

from __future__ import annotations

import io
import math
import tempfile
from pathlib import Path

import numpy as np
import safetensors
import soundfile
import torch

from intone.engine.models.pocket.model import PocketTTS
from intone.engine.voices import MAX_VOICE_SECONDS, Voice, voice_from_audio, voice_from_state_file
from intone.provider.errors import VoiceRefusedError
from intone.provider.protocol import ErrorCode, echo

# The metadata `format` of a voice-state file intone wrote (`server/voice_store.py`): its header
# names the model it was made for.
STORED_VOICE_FORMAT = "intone-voice-1"

DEFAULT_MAX_SECONDS = 120.0
MIN_SECONDS = 1.0
# Peak under which audio counts as silence (-60 dBFS): no voice to clone.
SILENCE_PEAK = 1e-3
# WAV data chunk sizes that mean "unknown length" (streamed WAVs), not a lie.
UNKNOWN_WAV_SIZES = (0, 0xFFFFFFFF)


def _refuse(code: ErrorCode, message: str, status: int = 400) -> VoiceRefusedError:
    return VoiceRefusedError(str(code), message, status)


def decode_voice(
    model: PocketTTS, model_name: str, data: bytes, max_seconds: float = DEFAULT_MAX_SECONDS
) -> tuple[Voice, float]:
    """The voice a file's bytes hold and the seconds of audio it was made from;
    VoiceRefusedError for anything that is not a usable voice. Blocking (audio is encoded)."""
    if _is_safetensors(data):
        return _voice_state(model, model_name, data)
    if not model.has_voice_encoder:
        raise _refuse(
            ErrorCode.VOICE_CLONING_UNAVAILABLE,
            f"model {model_name!r} was released without voice cloning (no Mimi encoder): "
            "upload a voice state (.safetensors, `pocket-tts export-voice`) instead of audio",
        )
    samples, rate = read_upload_audio(data, max_seconds)
    seconds = samples.shape[0] / rate
    with torch.no_grad():
        voice = voice_from_audio(model, "upload", torch.from_numpy(samples), rate)
    return voice, min(seconds, MAX_VOICE_SECONDS)


def _is_safetensors(data: bytes) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then a JSON object."""
    if len(data) < 10:
        return False
    size = int.from_bytes(data[:8], "little")
    return 2 <= size <= len(data) - 8 and data[8:9] == b"{"


def _voice_state(model: PocketTTS, model_name: str, data: bytes) -> tuple[Voice, float]:
    with tempfile.TemporaryDirectory(prefix="intone-upload-") as directory:
        path = Path(directory) / "upload.safetensors"
        path.write_bytes(data)
        try:
            with safetensors.safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
            voice = voice_from_state_file(model, "upload", path)
        except ValueError as e:
            raise _refuse(
                ErrorCode.BAD_VOICE_STATE, str(e).replace(str(path), "the file")
            ) from None
        except Exception as e:
            raise _refuse(ErrorCode.BAD_VOICE_STATE, f"not a voice state: {e}") from None
    made_for = metadata.get("model") if metadata.get("format") == STORED_VOICE_FORMAT else None
    if made_for is not None and made_for != model_name:
        raise _refuse(
            ErrorCode.BAD_VOICE_STATE,
            f"this voice state was made for model {echo(made_for)}, not {model_name!r}",
        )
    if not (torch.isfinite(voice.keys).all() and torch.isfinite(voice.values).all()):
        raise _refuse(ErrorCode.BAD_VOICE_STATE, "the voice state holds NaN or infinite values")
    frame_rate = model.sample_rate / model.samples_per_frame
    max_length = math.ceil(MAX_VOICE_SECONDS * frame_rate) + 16  # BOS and the closing pause
    if voice.length > max_length:
        raise _refuse(
            ErrorCode.VOICE_TOO_LONG,
            f"the voice state holds {voice.length} positions; at most {max_length} "
            f"({MAX_VOICE_SECONDS:g} s of prompt)",
        )
    return voice, voice.length / frame_rate


def read_upload_audio(data: bytes, max_seconds: float) -> tuple[np.ndarray, int]:
    """Mono float32 samples and their rate from an uploaded file, checked: VoiceRefusedError if it
    is no audio soundfile reads, truncated (its header promises more), longer than
    `max_seconds` or under a second, silent, or holds NaN or infinite samples."""
    _check_wav_header(data)
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            rate, declared, kind = f.samplerate, f.frames, f.format
            if rate < 1:
                raise _refuse(ErrorCode.BAD_AUDIO, "the file's sample rate is not positive")
            most = math.floor(max_seconds * rate) if math.isfinite(max_seconds) else -1
            # Read at most one frame past the limit: a long file is refused, not decoded whole.
            samples = f.read(frames=most + 1 if most >= 0 else -1, dtype="float32", always_2d=True)
    except VoiceRefusedError:
        raise
    except (soundfile.LibsndfileError, RuntimeError, ValueError, TypeError) as e:
        raise _refuse(ErrorCode.BAD_AUDIO, f"not audio this server reads: {e}") from None
    frames = samples.shape[0]
    if kind == "FLAC" and declared > 0 and frames < declared and (most < 0 or frames <= most):
        raise _refuse(
            ErrorCode.BAD_AUDIO,
            f"the FLAC header promises {declared} frames, the file holds {frames}: truncated",
        )
    if most >= 0 and frames > most:
        raise _refuse(
            ErrorCode.VOICE_TOO_LONG,
            f"the audio is over {max_seconds:g} s (only the first {MAX_VOICE_SECONDS:g} s of a "
            "voice are used: trim it)",
        )
    if frames / rate < MIN_SECONDS:
        raise _refuse(
            ErrorCode.VOICE_TOO_SHORT,
            f"{frames / rate:.2f} s of audio: a voice needs at least {MIN_SECONDS:g} s",
        )
    if not np.isfinite(samples).all():
        raise _refuse(ErrorCode.BAD_AUDIO, "the audio holds NaN or infinite samples")
    mono = samples.mean(axis=1, dtype=np.float32)
    if float(np.abs(mono).max()) < SILENCE_PEAK:
        raise _refuse(ErrorCode.VOICE_SILENT, "the audio is silent: no voice to clone")
    return mono, rate


def _check_wav_header(data: bytes) -> None:
    """A WAV whose data chunk claims more bytes than the file holds is truncated (or its header
    lies): refused, where libsndfile would quietly read what is there."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return
    offset = 12
    while offset + 8 <= len(data):
        chunk, size = (
            data[offset : offset + 4],
            int.from_bytes(data[offset + 4 : offset + 8], "little"),
        )
        if chunk == b"data":
            present = len(data) - offset - 8
            if size not in UNKNOWN_WAV_SIZES and size > present:
                raise _refuse(
                    ErrorCode.BAD_AUDIO,
                    f"the WAV header promises {size} bytes of samples, the file holds {present}: "
                    "truncated, or the header is wrong",
                )
            return
        offset += 8 + size + (size & 1)
    # No data chunk in reach: libsndfile says so.
