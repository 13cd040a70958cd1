"""Voices: the prompt that sets who is speaking, kept as the backbone's keys and values.

A voice comes from audio (encoded by Mimi, projected, and prefilled once) or from a reference
voice-state file (already prefilled keys and values). Either way it ends up as per-layer K/V for
its prompt positions, which every request with that voice reuses instead of prefilling again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors
import torch
from safetensors.torch import save_file

from intone.engine.audio import end_on_pause, read_audio, resample
from intone.engine.loading import fetch
from intone.engine.models.pocket.kv_cache import SequenceStep, plan_step
from intone.engine.models.pocket.model import PocketTTS

logger = logging.getLogger(__name__)

# The reference's CLI and server keep the first 30 s of a prompt. A longer one would not change
# the voice much, but its positions sit in every request's attention (12.5 per second of audio).
MAX_VOICE_SECONDS = 30.0


@dataclass
class Voice:
    name: str
    keys: torch.Tensor  # [layers, T, H, D], rotated as stored in a cache
    values: torch.Tensor  # [layers, T, H, D]

    @property
    def length(self) -> int:
        return self.keys.shape[1]


def voice_from_audio(
    model: PocketTTS, name: str, samples: np.ndarray | torch.Tensor, sample_rate: int
) -> Voice:
    """Voice from mono float samples [T] (on the host) at any rate; the first
    MAX_VOICE_SECONDS of them. The prompt is prepared on the host, in numpy (nothing of it is
    read back from a device), and moved to the model's device once."""
    if not model.has_voice_encoder:
        raise ValueError(
            "these weights have no Mimi encoder (the release without voice cloning): voices "
            "must be voice-state .safetensors files, not audio. Get access to kyutai/pocket-tts "
            "for voice cloning."
        )
    samples = np.asarray(samples, dtype=np.float32)
    if samples.size == 0:
        raise ValueError(f"voice {name!r} has no audio")
    if not np.isfinite(samples).all():
        # A float WAV can hold them; they would reach every KV page the voice fills.
        raise ValueError(f"voice {name!r}: its audio holds NaN or infinite samples")
    max_samples = int(MAX_VOICE_SECONDS * sample_rate)
    if samples.size > max_samples:
        logger.info(
            "voice %r: keeping the first %g s of %.1f s of audio",
            name,
            MAX_VOICE_SECONDS,
            samples.size / sample_rate,
        )
        samples = samples[:max_samples]
    samples = resample(samples, sample_rate, model.sample_rate)
    prompt = torch.from_numpy(end_on_pause(samples[None], model.sample_rate))
    with torch.no_grad():
        latents = model.mimi.encode(prompt[None].to(model.device))[0]
        embeddings = model.flow_lm.embed_voice(latents)
        return _prefill_voice(model, name, embeddings)


def _prefill_voice(model: PocketTTS, name: str, embeddings: torch.Tensor) -> Voice:
    flow_lm = model.flow_lm
    length = embeddings.shape[0]
    pool = flow_lm.new_kv_pool(length)
    positions, attention = plan_step(pool, [SequenceStep(torch.arange(length), length)])
    flow_lm.backbone(embeddings, positions, attention)
    # Read back where the pool lives: a host index into a device pool is refused.
    return Voice(name, *pool.read(torch.arange(length, device=pool.keys.device)))


def voice_from_state_file(model: PocketTTS, name: str, path: Path) -> Voice:
    """Voice from a pocket-tts voice-state file (`pocket-tts export-voice`, predefined voices)."""
    flow_lm = model.flow_lm
    try:
        tensors = _read_arrays(path)
    except Exception as e:
        raise ValueError(f"cannot read voice state {path}: {e}") from e
    keys, values = [], []
    for layer in range(flow_lm.num_layers):
        prefix = f"transformer.layers.{layer}.self_attn"
        cache = tensors.get(f"{prefix}/cache")
        if cache is None:
            raise ValueError(f"voice state {path} has no {prefix}/cache: not a voice-state file")
        if f"{prefix}/offset" in tensors:
            length = int(tensors[f"{prefix}/offset"].reshape(-1)[0])
        elif f"{prefix}/current_end" in tensors:
            length = tensors[f"{prefix}/current_end"].shape[0]
        else:
            length = cache.shape[2]
        expected = (flow_lm.transformer.num_kv_heads, flow_lm.transformer.head_dim)
        if cache.ndim != 5 or tuple(cache.shape[3:]) != expected or length == 0:
            raise ValueError(
                f"voice state {path} does not fit this model: cache {tuple(cache.shape)}, "
                f"length {length}, model kv heads/head_dim {expected}"
            )
        keys.append(cache[0, 0, :length])
        values.append(cache[1, 0, :length])
    file_layers = {
        int(key.split(".")[2]) for key in tensors if key.startswith("transformer.layers.")
    }
    if max(file_layers) + 1 > flow_lm.num_layers:
        raise ValueError(
            f"voice state {path} does not fit this model: it holds {max(file_layers) + 1} "
            f"layers, the model has {flow_lm.num_layers}"
        )
    keys_t, values_t = (torch.from_numpy(np.stack(part)) for part in (keys, values))
    return Voice(name, keys_t.to(model.device), values_t.to(model.device))


def _read_arrays(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file's tensors as host arrays (its data is read on the host, never through
    torch's device dispatch); one in a dtype numpy lacks (bfloat16) in float32."""
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except TypeError:  # a dtype numpy does not know
        with safetensors.safe_open(str(path), framework="pt") as f:
            return {key: _as_array(f.get_tensor(key)) for key in f.keys()}


def _as_array(tensor: torch.Tensor) -> np.ndarray:
    return (tensor.float() if tensor.is_floating_point() else tensor).numpy()


def save_voice_state(voice: Voice, path: Path, metadata: dict[str, str] | None = None) -> None:
    """`voice` as a voice-state file in the reference's layout (what `pocket-tts export-voice`
    writes: per layer a [2, 1, T, H, D] cache and its offset), which `load_voice` reads back.
    `metadata`: strings kept in the file's header."""
    state = {}
    for layer in range(voice.keys.shape[0]):
        prefix = f"transformer.layers.{layer}.self_attn"
        cache = torch.stack([voice.keys[layer], voice.values[layer]])[:, None]
        state[f"{prefix}/cache"] = cache.detach().to("cpu", torch.float32).contiguous()
        state[f"{prefix}/offset"] = torch.tensor([voice.length])
    save_file(state, str(path), metadata=metadata)


def voice_state_length(model: PocketTTS, path: Path) -> int:
    """A voice-state file's prompt positions, from its header and first layer's length only
    (registering many stored voices must not read them all). ValueError if it holds no
    first-layer cache, or one whose shape does not fit `model`."""
    prefix = "transformer.layers.0.self_attn"
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            if f"{prefix}/cache" not in keys:
                raise ValueError(f"voice state {path} has no {prefix}/cache")
            shape = tuple(f.get_slice(f"{prefix}/cache").get_shape())
            if f"{prefix}/offset" in keys:
                length = int(f.get_tensor(f"{prefix}/offset").view(-1)[0])
            elif f"{prefix}/current_end" in keys:
                length = int(f.get_slice(f"{prefix}/current_end").get_shape()[0])
            else:
                length = shape[2] if len(shape) == 5 else 0
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"cannot read voice state {path}: {e}") from e
    transformer = model.flow_lm.transformer
    expected = (transformer.num_kv_heads, transformer.head_dim)
    if len(shape) != 5 or shape[3:] != expected or not 0 < length <= shape[2]:
        raise ValueError(f"voice state {path} does not fit this model: cache {shape}")
    return length


def load_voice(model: PocketTTS, name: str, source: str | Path) -> Voice:
    """A voice from audio (any format soundfile reads) or a voice-state .safetensors.

    `source` is a local path or an hf:// path.
    """
    path = fetch(str(source), f"voice {name!r}")
    if path.suffix == ".safetensors":
        return voice_from_state_file(model, name, path)
    samples, sample_rate = read_audio(path)
    logger.info("encoding voice %r from %s", name, path)
    return voice_from_audio(model, name, samples, sample_rate)
