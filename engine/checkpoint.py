"""Make a self-contained random checkpoint directory that both intone and pocket_tts can load.

The released weights and tokenizer sit behind a gated Hub repo, so development, tests and benchmarks
run on checkpoints made here: the released architecture ("full") or a small one ("tiny"), random
weights in the released key layout, a SentencePiece tokenizer trained on generated text, and a
synthetic default voice. Everything is a function of the seed, so two runs give identical files.

Layout of OUT_DIR:
    config.yaml        reference schema, absolute paths (pocket_tts resolves relative ones against
                       the current directory, not the YAML's)
    model.safetensors  flow_lm.* and mimi.* tensors, as `TTSModel.state_dict()` names them
    tokenizer.model    SentencePiece unigram, 4000 pieces
    intone.yaml        settings only intone reads (the reference schema forbids unknown keys)
    voices/default.wav 24 kHz mono int16, ~3 s
"""

from __future__ import annotations

import io
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece
import soundfile
import torch
import yaml
from safetensors.torch import save_file

from intone.engine.corpus import sentences
from intone.engine.models.pocket.config import Config, dump_config
from intone.engine.models.pocket.model import PocketTTS

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.model"
INTONE_FILE = "intone.yaml"
DEFAULT_VOICE = "default"
DEFAULT_VOICE_FILE = "voices/default.wav"

VOCAB_SIZE = 4000
_CORPUS_SENTENCES = 20_000  # ~1 MB of text: enough for 4000 pieces, trains in well under a second

# Widths per preset; everything else (rates, latent size, ratios, context) is the released one.
_PRESETS: dict[str, dict[str, int]] = {
    "full": dict(
        d_model=1024, num_heads=16, num_layers=6, flow_dim=512, flow_depth=6,
        mimi_dim=512, n_filters=64, mimi_heads=8, mimi_layers=2, mimi_ff=2048,
    ),
    "tiny": dict(
        d_model=64, num_heads=4, num_layers=2, flow_dim=64, flow_depth=2,
        mimi_dim=64, n_filters=8, mimi_heads=4, mimi_layers=2, mimi_ff=256,
    ),
}  # fmt: skip
PRESETS = tuple(_PRESETS)


def preset_config(preset: str, weights_path: str, tokenizer_path: str) -> Config:
    """The config of a preset, pointing at the given weights and SentencePiece model."""
    if preset not in _PRESETS:
        raise ValueError(f"unknown preset {preset!r}, expected one of {PRESETS}")
    p = _PRESETS[preset]
    latent_dim = 32
    mimi_transformer = {
        "d_model": p["mimi_dim"],
        "num_heads": p["mimi_heads"],
        "num_layers": p["mimi_layers"],
        "layer_scale": 0.01,
        "context": 250,
        "dim_feedforward": p["mimi_ff"],
        "input_dimension": p["mimi_dim"],
        "output_dimensions": [p["mimi_dim"]],
    }
    return Config(
        weights_path=weights_path,
        default_temperature=0.3,
        replace_characters={"\u2019": "'", "\u2018": "'"},
        flow_lm={
            "dtype": "float32",
            "insert_bos_before_voice": True,
            "flow": {"dim": p["flow_dim"], "depth": p["flow_depth"], "type": "lsd"},
            "transformer": {
                "d_model": p["d_model"],
                "hidden_scale": 4,
                "max_period": 10000,
                "num_heads": p["num_heads"],
                "num_layers": p["num_layers"],
            },
            "lookup_table": {
                "dim": p["d_model"],
                "n_bins": VOCAB_SIZE,
                "tokenizer": "sentencepiece",
                "tokenizer_path": tokenizer_path,
            },
        },
        mimi={
            "dtype": "float32",
            "sample_rate": 24000,
            "inner_dim": latent_dim,
            "outer_dim": p["mimi_dim"],
            "channels": 1,
            "frame_rate": 12.5,
            "seanet": {
                "dimension": p["mimi_dim"],
                "channels": 1,
                "n_filters": p["n_filters"],
                "n_residual_layers": 1,
                "ratios": [6, 5, 4],
                "kernel_size": 7,
                "residual_kernel_size": 3,
                "last_kernel_size": 3,
                "dilation_base": 2,
                "pad_mode": "constant",
                "compress": 2,
            },
            "transformer": mimi_transformer,
            "quantizer": {"dimension": latent_dim, "output_dimension": p["mimi_dim"]},
        },
    )


def train_tokenizer(seed: int, vocab_size: int = VOCAB_SIZE) -> bytes:
    """A serialized SentencePiece unigram model trained on generated sentences.

    Trained from an iterator into memory so that no temp-file path ends up in the model's trainer
    spec; one thread and no sampling or shuffling keep the bytes identical from run to run.
    """
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=sentences(seed, _CORPUS_SENTENCES),
        model_writer=model,
        model_type="unigram",
        vocab_size=vocab_size,
        character_coverage=1.0,  # keep every punctuation mark and digit as a piece
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    return model.getvalue()


def random_state_dict(config: Config, seed: int) -> dict[str, torch.Tensor]:
    """Randomly initialised weights in the released layout, as contiguous float tensors."""
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = PocketTTS(config)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    # Tensors that the reference only ever gets from a checkpoint (or creates as zeros) are redrawn
    # here so that a random model conditions on voices and starts generating non-trivially.
    g = torch.Generator().manual_seed(seed + 1)
    speaker = state["flow_lm.speaker_proj_weight"]  # [d_model, latent_dim]
    state["flow_lm.speaker_proj_weight"] = torch.randn(speaker.shape, generator=g) / math.sqrt(
        speaker.shape[1]
    )
    for key in ("flow_lm.bos_emb", "flow_lm.bos_before_voice"):
        state[key] = torch.randn(state[key].shape, generator=g)
    # Identity latent normalisation: decoded latents are the generated ones.
    state["flow_lm.emb_std"] = torch.ones_like(state["flow_lm.emb_std"])
    state["flow_lm.emb_mean"] = torch.zeros_like(state["flow_lm.emb_mean"])
    return state


# Formants (F1, F2, F3 in Hz) of a few vowels; the voice glides between them syllable by syllable.
_VOWELS = np.array(
    [[730, 1090, 2440], [270, 2290, 3010], [300, 870, 2240], [530, 1840, 2480], [570, 840, 2410]],
    dtype=np.float64,
)
_BANDWIDTHS = np.array([90.0, 110.0, 170.0])


def synthesize_voice(
    seed: int, sample_rate: int = 24000, seconds: float = 3.0, pause: float = 0.3
) -> np.ndarray:
    """A speech-like mono int16 waveform: a voiced source shaped by moving formants.

    Harmonics of a declining, accented pitch contour are weighted by a formant envelope, split into
    syllables by a ~4 Hz amplitude envelope, with noise bursts at onsets; the last `pause` seconds
    are near-silent so that pocket_tts's `end_on_pause` trims the prompt at a pause.
    """
    rng = np.random.default_rng(seed)
    n = int(round(seconds * sample_rate))
    n_voiced = n - int(round(pause * sample_rate))
    t = np.arange(n_voiced) / sample_rate

    # Syllables of 150-300 ms (the last one stretched to the end), some followed by a short gap.
    bounds = [0.0]
    while bounds[-1] + 0.3 < t[-1]:
        bounds.append(bounds[-1] + rng.uniform(0.15, 0.3))
    bounds[-1] = t[-1]
    starts, ends = np.array(bounds[:-1]), np.array(bounds[1:])
    ends -= rng.choice([0.0, 0.04], size=len(ends))
    centers = (starts + ends) / 2

    envelope = np.zeros(n_voiced)
    for start, end in zip(starts, ends, strict=True):
        inside = (t >= start) & (t < end)
        envelope[inside] = np.sin(np.pi * (t[inside] - start) / (end - start)) ** 0.7

    formants = _VOWELS[rng.integers(len(_VOWELS), size=len(centers))]
    formants *= rng.uniform(0.95, 1.05, size=formants.shape)  # no two syllables quite alike
    tracks = np.stack([np.interp(t, centers, formants[:, i]) for i in range(3)])

    base = rng.uniform(100.0, 180.0)
    accents = rng.uniform(-0.08, 0.15, size=len(centers))
    f0 = base * (1.1 - 0.2 * t / t[-1]) * (1 + np.interp(t, centers, accents))
    f0 *= 1 + 0.01 * np.sin(2 * np.pi * 5.5 * t)  # slight vibrato
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate

    voiced = np.zeros(n_voiced)
    for k in range(1, int(5000 / f0.min()) + 1):
        freq = k * f0
        gain = (
            sum(1 / (1 + ((freq - tracks[i]) / _BANDWIDTHS[i]) ** 2) for i in range(3)) / k**0.5
        )  # spectral tilt of a glottal source
        voiced += gain * np.sin(k * phase + rng.uniform(0, 2 * np.pi))
    voiced *= envelope

    # Consonant-like bursts: 30 ms of high-passed noise at each syllable onset.
    noise = np.diff(rng.standard_normal(n_voiced + 1))
    burst = np.zeros(n_voiced)
    for start in starts:
        inside = (t >= start) & (t < start + 0.03)
        burst[inside] = np.hanning(inside.sum())
    speech = voiced / np.abs(voiced).max() + 0.15 * burst * noise

    audio = np.concatenate([speech, np.zeros(n - n_voiced)])
    audio = 0.5 * audio / np.abs(audio).max() + 1e-4 * rng.standard_normal(n)
    return np.round(audio * 32767).astype(np.int16)


def make_checkpoint(preset: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a random `preset` checkpoint for `seed` into `out_dir` (created) and return it."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = preset_config(preset, str(out / WEIGHTS_FILE), str(out / TOKENIZER_FILE))

    # The tokenizer goes first so that the config never points at a missing file.
    (out / TOKENIZER_FILE).write_bytes(train_tokenizer(seed))
    dump_config(config, out / CONFIG_FILE)
    logger.info("wrote %s and %s", out / TOKENIZER_FILE, out / CONFIG_FILE)

    state = random_state_dict(config, seed)
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    n_params = sum(v.numel() for v in state.values())
    logger.info(
        "wrote %s (%d tensors, %.1fM values)", out / WEIGHTS_FILE, len(state), n_params / 1e6
    )

    voice = out / DEFAULT_VOICE_FILE
    voice.parent.mkdir(exist_ok=True)
    soundfile.write(voice, synthesize_voice(seed, config.sample_rate), config.sample_rate, "PCM_16")

    settings: dict[str, Any] = {
        "preset": preset,
        "seed": seed,
        "default_voice": DEFAULT_VOICE,
        "voices": {DEFAULT_VOICE: DEFAULT_VOICE_FILE},
    }
    with open(out / INTONE_FILE, "w", encoding="utf-8") as f:
        yaml.safe_dump(settings, f, sort_keys=False)
    logger.info("wrote %s checkpoint (seed %d) to %s", preset, seed, out)
    return out
