"""Make a self-contained random checkpoint directory that both intone and pocket_tts can load.

The released weights and tokenizers sit behind the Hub, so development, tests and benchmarks run on
checkpoints made here: random weights in a config's released key layout, a tokenizer trained on
generated text in the config's language (covering its alphabet, digits and punctuation), and a
synthetic default voice. Everything is a function of the preset and the seed, so two runs give
identical files. Presets:

    a release name    (`english`, `french_24l`, `english_2m_2026-10`, ...: `releases.py`) that
                      release's packaged config, full size
    tiny-NAME         the release NAME shrunk to a few layers and narrow widths, same structure
                      (sampler type, GQA, low-rank table, z_dim, decoder shape, text rules)
    tiny-FAMILY       a tiny variant per architecture family (`TINY_FAMILIES`), for fast tests
    full, tiny        intone's original English presets (SentencePiece tokenizer)

Layout of OUT_DIR:
    config.yaml        reference schema, absolute paths (pocket_tts resolves relative ones against
                       the current directory, not the YAML's)
    model.safetensors  flow_lm.* and mimi.* tensors, as `TTSModel.state_dict()` names them
    tokenizer.model    SentencePiece unigram (or tokenizer.json, when the config's `tokenizer` is
                       `tokenizers`: the same model converted), n_bins pieces
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
import tokenizers
import torch
import yaml
from safetensors.torch import save_file
from tokenizers import decoders, normalizers, pre_tokenizers

from intone.engine import releases
from intone.engine.corpus import sentences
from intone.engine.models.pocket.config import Config, dump_config, load_config
from intone.engine.models.pocket.model import PocketTTS

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.model"
TOKENIZER_JSON_FILE = "tokenizer.json"
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
# A tiny variant per architecture family: the release it shrinks.
TINY_FAMILIES = {
    "tiny-standard": "french",  # 6 layers, lsd; French text rules (remove_semicolons, ...)
    "tiny-24l": "german_24l",  # the 24-layer releases
    "tiny-2026-01": "english_2026-01",  # no BOS before the voice, inner_dim, space padding
    "tiny-drifting": "english_drifting_26-09",  # one-step drifting head
    "tiny-small": "english_18m_2026-10",  # small family: drifting, z_dim, asymmetric decoder
    "tiny-gqa": "english_7m_2026-10",  # + grouped-query attention, attn_dim, low-rank table
    "tiny-pointwise": "english_2m_2026-10",  # + pointwise head, dim_feedforward, one KV head
}
TINY_PREFIX = "tiny-"


def preset_names() -> list[str]:
    """The presets to list: intone's own, the tiny families, and every release name.

    `tiny-NAME` for any release NAME is accepted too.
    """
    return list(_PRESETS) + list(TINY_FAMILIES) + releases.release_names()


def preset_release(preset: str) -> tuple[str | None, bool]:
    """(the release a preset is made from, whether shrunk); (None, _) for intone's own."""
    if preset in _PRESETS:
        return None, preset == "tiny"
    if preset in TINY_FAMILIES:
        return TINY_FAMILIES[preset], True
    if preset.startswith(TINY_PREFIX) and releases.release_name(preset[len(TINY_PREFIX) :]):
        return releases.release_name(preset[len(TINY_PREFIX) :]), True
    if preset in releases.release_names():
        return preset, False
    raise ValueError(
        f"unknown preset {preset!r}: expected one of {preset_names()}, or tiny-NAME for a "
        "release NAME"
    )


def _shrink(config: Config) -> Config:
    """The release's structure at tiny widths: every optional feature it sets stays set."""
    c = config.model_copy(deep=True)
    flow, tf, lookup = c.flow_lm.flow, c.flow_lm.transformer, c.flow_lm.lookup_table
    flow.dim, flow.depth = 64, 2
    tf.num_layers = 4 if tf.num_layers > 8 else 2
    tf.d_model = 64
    if tf.num_kv_heads is not None or tf.attn_dim is not None:
        # Keep the query/key-value head counts; 8-wide heads.
        tf.attn_dim = 8 * tf.num_heads
    else:
        tf.num_heads = 4
    if tf.dim_feedforward is not None:
        tf.dim_feedforward = 48
    lookup.dim = tf.d_model
    if lookup.rank is not None:
        lookup.rank = 16
    if c.flow_lm.z_dim is not None:
        c.flow_lm.z_dim = 16
    m = c.mimi
    asymmetric = m.decoder_seanet is not None
    wide_voice = m.inner_dim is not None and m.inner_dim == m.seanet.dimension
    m.seanet.dimension, m.seanet.n_filters = 64, 8
    m.transformer.d_model = m.transformer.input_dimension = 64
    m.transformer.output_dimensions = (64,)
    m.transformer.num_heads, m.transformer.num_layers = 4, 2
    m.transformer.dim_feedforward = 256
    if m.inner_dim is not None:
        m.inner_dim = m.seanet.dimension if wide_voice else m.quantizer.dimension
    outer = 32 if asymmetric else m.seanet.dimension
    if m.outer_dim is not None:
        m.outer_dim = outer
    m.quantizer.output_dimension = outer
    if asymmetric:
        assert m.decoder_seanet is not None and m.decoder_transformer is not None
        m.decoder_seanet.dimension, m.decoder_seanet.n_filters = outer, 8
        d = m.decoder_transformer
        d.d_model = d.input_dimension = outer
        d.output_dimensions = (outer,)
        d.num_heads, d.num_layers, d.dim_feedforward = 4, 2, 96
    return c


def release_preset_config(
    release: str, tiny: bool, weights_path: str, tokenizer_path: str
) -> Config:
    """A release's packaged config (shrunk if `tiny`), pointing at local weights and tokenizer."""
    config = load_config(releases.config_path(release))
    if tiny:
        config = _shrink(config)
    config.weights_path = weights_path
    config.weights_path_without_voice_cloning = None
    config.flow_lm.lookup_table.tokenizer_path = tokenizer_path
    return config


def preset_config(preset: str, weights_path: str, tokenizer_path: str) -> Config:
    """The config of intone's own presets (`full`, `tiny`), pointing at the given files."""
    if preset not in _PRESETS:
        raise ValueError(f"unknown preset {preset!r}, expected one of {list(_PRESETS)}")
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


def train_tokenizer(
    seed: int,
    vocab_size: int = VOCAB_SIZE,
    language: str = "english",
    normalization: str = "nmt_nfkc",
) -> bytes:
    """A serialized SentencePiece unigram model trained on generated sentences in `language`.

    Trained from an iterator into memory so that no temp-file path ends up in the model's trainer
    spec; one thread and no sampling or shuffling keep the bytes identical from run to run.
    """
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=sentences(seed, _CORPUS_SENTENCES, language),
        model_writer=model,
        model_type="unigram",
        vocab_size=vocab_size,
        character_coverage=1.0,  # keep every letter, punctuation mark and digit as a piece
        normalization_rule_name=normalization,
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    return model.getvalue()


def tokenizer_json(sp_model: bytes) -> str:
    """The SentencePiece unigram model `sp_model` as a HuggingFace `tokenizers` JSON file.

    Same pieces, scores and unknown id; NFKC, whitespace stripping and collapsing, then the
    word-start marker, as SentencePiece does with the "nfkc" rule it must have been trained with.
    """
    sp = sentencepiece.SentencePieceProcessor(model_proto=sp_model)
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.vocab_size())]
    tokenizer = tokenizers.Tokenizer(tokenizers.models.Unigram(vocab, unk_id=sp.unk_id()))
    tokenizer.normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.Strip(),
            normalizers.Replace(tokenizers.Regex(" {2,}"), " "),
        ]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="always"
    )
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    return tokenizer.to_str()


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
        if key in state:  # no BOS before the voice in some releases
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
    release, tiny = preset_release(preset)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"the seed must be an integer >= 0, got {seed!r}")
    out = Path(out_dir).resolve()
    existing = next(path for path in (out, *out.parents) if path.exists())
    if not existing.is_dir():
        raise ValueError(f"cannot write a checkpoint into {out}: {existing} is a file")
    out.mkdir(parents=True, exist_ok=True)
    weights = str(out / WEIGHTS_FILE)
    if release is None:
        config = preset_config(preset, weights, str(out / TOKENIZER_FILE))
        language = "english"
    else:
        json_kind = load_config(releases.config_path(release)).flow_lm.lookup_table.tokenizer in (
            "tokenizers",
            "json",
        )
        tokenizer_file = out / (TOKENIZER_JSON_FILE if json_kind else TOKENIZER_FILE)
        config = release_preset_config(release, tiny, weights, str(tokenizer_file))
        language = releases.language_of(release)
    tokenizer_path = Path(config.flow_lm.lookup_table.tokenizer_path)
    n_bins = config.flow_lm.lookup_table.n_bins

    # The tokenizer goes first so that the config never points at a missing file.
    if tokenizer_path.suffix == ".json":
        sp_model = train_tokenizer(seed, n_bins, language, normalization="nfkc")
        tokenizer_path.write_text(tokenizer_json(sp_model), encoding="utf-8")
    else:
        tokenizer_path.write_bytes(train_tokenizer(seed, n_bins, language))
    dump_config(config, out / CONFIG_FILE)
    logger.info("wrote %s and %s", tokenizer_path, out / CONFIG_FILE)

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
        "language": language,
        "seed": seed,
        "default_voice": DEFAULT_VOICE,
        "voices": {DEFAULT_VOICE: DEFAULT_VOICE_FILE},
    }
    with open(out / INTONE_FILE, "w", encoding="utf-8") as f:
        yaml.safe_dump(settings, f, sort_keys=False)
    logger.info("wrote %s checkpoint (seed %d) to %s", preset, seed, out)
    return out
