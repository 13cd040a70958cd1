"""Audio file I/O, resampling and PCM encoding."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import numpy as np
import soundfile
import soxr
import torch


def read_audio(path: str | Path) -> tuple[np.ndarray, int]:
    """Mono float32 samples in [-1, 1] and the file's sample rate; any format soundfile reads."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"audio file not found: {path}")
    try:
        data, sample_rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError) as e:
        raise ValueError(f"cannot read audio file {path}: {e}") from e
    if data.shape[0] == 0:
        raise ValueError(f"audio file {path} is empty")
    return data.mean(axis=1), int(sample_rate)


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    if from_rate == to_rate:
        return samples
    return soxr.resample(samples, from_rate, to_rate, quality="HQ").astype(np.float32)


def end_on_pause(
    wav: torch.Tensor,
    sample_rate: int,
    pause_sec: float = 0.08,
    fade_sec: float = 0.02,
    floor_db: float = 35.0,
) -> torch.Tensor:
    """End a voice prompt [..., T] on exactly `pause_sec` of silence, as the reference does.

    A prompt that stops mid-word makes the model continue that word; one that ends on a long
    silence delays the onset. Cut the trailing silence (20 ms frames more than `floor_db` below
    the loudest), fade out the last `fade_sec`, append `pause_sec` of zeros.
    """
    frame = max(1, int(0.02 * sample_rate))
    n = wav.shape[-1] // frame
    if n == 0:
        return wav
    rms = wav[..., : n * frame].reshape(-1, n, frame).square().mean(dim=(0, 2)).sqrt()
    db = 20 * torch.log10(rms + 1e-12)
    loud = torch.nonzero(db > db.max() - floor_db).flatten()
    end = (int(loud[-1]) + 1) * frame
    wav = wav[..., :end].clone()
    fade = min(int(fade_sec * sample_rate), end)
    wav[..., end - fade :] *= torch.linspace(1, 0, fade, dtype=wav.dtype)
    pause = wav.new_zeros(*wav.shape[:-1], int(pause_sec * sample_rate))
    return torch.cat([wav, pause], dim=-1)


def write_wav(
    path: str | Path | BinaryIO, samples: np.ndarray, sample_rate: int, float32: bool = False
) -> None:
    """A WAV file whatever `path` is named (a seekable binary file works too)."""
    subtype = "FLOAT" if float32 else "PCM_16"
    target = str(path) if isinstance(path, str | Path) else path
    samples = np.asarray(samples, dtype=np.float32)
    soundfile.write(target, samples, sample_rate, subtype=subtype, format="WAV")


def to_pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
