"""Finding and loading a checkpoint: config, tokenizer, weights and intone's own settings.

`--model` may name a released model (`english`, `french_24l`, `english_2m_2026-10`, ...: see
`releases.py`; `kyutai/pocket-tts`, language codes such as `fr`), a checkpoint directory (holding
`config.yaml`), a config file, an `hf://` path, or nothing, which means the released Pocket TTS
English model. A release's weights, tokenizer and voices are fetched from the Hugging Face Hub.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import safetensors
import safetensors.torch
import torch
import yaml

from intone.engine import releases
from intone.engine.models.pocket.config import Config, load_config
from intone.engine.models.pocket.model import ENCODER_PREFIXES, PocketTTS
from intone.engine.text import TextOptions, Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL = releases.DEFAULT_MODEL
# Predefined voices: voice states precomputed per release, as the reference fetches them.
RELEASED_VOICE_URL = (
    "hf://kyutai/pocket-tts-without-voice-cloning/languages/{release}/embeddings/"
    "{name}.safetensors@a7056f505a4a8ca72d8b5fb1440071d6f1a35739"
)
RELEASED_VOICES = (
    "alba", "marius", "javert", "jean", "fantine", "cosette", "eponine", "azelma", "anna",
    "vera", "charles", "paul", "george", "mary", "jane", "michael", "eve", "bill_boerst",
    "peter_yearsley", "stuart_bell", "caro_davy", "giovanni", "lola", "juergen", "rafael",
    "daan", "estelle",
)  # fmt: skip
# The reference's default voice per language.
DEFAULT_VOICES = {
    "english": "alba", "french": "estelle", "german": "juergen", "spanish": "lola",
    "italian": "giovanni", "portuguese": "rafael", "dutch": "daan",
}  # fmt: skip
INTONE_SETTINGS_FILE = "intone.yaml"


class ModelUnavailableError(FileNotFoundError):
    """A model file could not be found locally nor fetched."""


@dataclass
class LoadedModel:
    model: PocketTTS
    tokenizer: Tokenizer
    config: Config
    text_options: TextOptions
    source: str
    # "released", "generated" (random weights made by `intone make-checkpoint`) or "custom".
    weights: str
    # Named voices: a WAV, a voice-state .safetensors, or an hf:// path to either.
    voices: dict[str, str] = field(default_factory=dict)
    default_voice: str | None = None
    # The language the model speaks: spoken-form text (`normalize_text`) is written in it.
    language: str = "en"

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate


def fetch(path: str, what: str) -> Path:
    """A local path for `path`, downloading `hf://owner/repo/file[@revision]` if needed."""
    if not path.startswith("hf://"):
        local = Path(path)
        if not local.is_file():
            raise ModelUnavailableError(f"{what} not found: {local}")
        return local
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    spec, _, revision = path.removeprefix("hf://").partition("@")
    parts = spec.split("/", 2)
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"{what} {path!r} is not of the form hf://owner/repo/path[@revision]")
    owner, repo, filename = parts
    try:
        return Path(hf_hub_download(f"{owner}/{repo}", filename, revision=revision or None))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise ModelUnavailableError(
            f"{what} {path} is not in the local Hugging Face cache and could not be downloaded "
            f"({type(e).__name__}). Pass a local checkpoint with --model DIR, or make an offline "
            "one with `intone make-checkpoint --preset tiny --out DIR`."
        ) from e


def sibling(source: str, name: str) -> str:
    """A file next to a config, as a local path or an hf:// path at the same revision."""
    if source.startswith("hf://"):
        spec, at, revision = source.partition("@")
        return f"{spec.rsplit('/', 1)[0]}/{name}{at}{revision}"
    return str(Path(source).parent / name)


def resolve_config_path(model: str | Path | None) -> tuple[Path, str]:
    """The config file for a --model value, and a description of where it came from."""
    name = str(model) if model is not None else DEFAULT_MODEL
    release = releases.release_name(name)
    if release is not None:
        source = DEFAULT_MODEL if release == releases.DEFAULT_RELEASE else release
        return releases.config_path(release), source
    if name.startswith("hf://"):
        return fetch(name, "config"), name
    path = Path(name)
    if path.is_dir():
        path = path / "config.yaml"
    if not path.is_file():
        raise ModelUnavailableError(
            f"no model at {name!r}: expected a released model name "
            f"({', '.join(releases.known_names())}), a checkpoint directory holding "
            "config.yaml, a config .yaml file, or an hf:// path."
        )
    return path, str(path)


def load_weights(model: PocketTTS, path: Path) -> None:
    """Strictly load a single-safetensors checkpoint in the released key layout."""
    try:
        state = safetensors.torch.load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"cannot read weights file {path}: {e}") from e
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    without_encoder = bool(missing) and all(k.startswith(ENCODER_PREFIXES) for k in missing)
    if (missing and not without_encoder) or unexpected:
        raise ValueError(
            f"weights file {path} does not match the config: "
            f"missing keys {missing[:20]}{' ...' if len(missing) > 20 else ''}, "
            f"unexpected keys {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}"
        )
    wrong_shapes = [
        f"{k}: file {tuple(state[k].shape)}, model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if wrong_shapes:
        raise ValueError(f"weights file {path} has wrong shapes: {wrong_shapes[:20]}")
    model.load_state_dict(state, strict=not without_encoder)
    if without_encoder:
        logger.warning("%s has no Mimi encoder: voices must be voice states, not audio", path)
        model.has_voice_encoder = False


def load_model(
    model: str | Path | None = None,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    config_path, source = resolve_config_path(model)
    config = load_config(config_path)
    if config.flow_lm.weights_path or config.mimi.weights_path:
        raise ValueError(
            "split flow_lm/mimi training weights are not supported: export a single "
            "safetensors file and set weights_path"
        )
    if config.weights_path is None:
        raise ValueError(f"{config_path} has no weights_path")

    lookup = config.flow_lm.lookup_table
    tokenizer = Tokenizer(
        lookup.n_bins, fetch(lookup.tokenizer_path, "tokenizer"), lookup.tokenizer
    )
    net = PocketTTS(config)
    try:
        weights_file = fetch(config.weights_path, "weights")
    except ModelUnavailableError:
        if config.weights_path_without_voice_cloning is None:
            raise
        # The voice-cloning release is gated; the public one lacks the encoder.
        logger.warning("voice-cloning weights unavailable; using the release without them")
        weights_file = fetch(config.weights_path_without_voice_cloning, "weights")
    load_weights(net, weights_file)
    net.eval().to(device)

    release = releases.release_name(source)
    settings = {} if release is not None else _read_intone_settings(source)
    voices = {name: sibling(source, rel) for name, rel in settings.get("voices", {}).items()}
    default_voice = settings.get("default_voice")
    weights = "generated" if "preset" in settings else "custom"
    if release is not None:
        weights = "released"
        voices.update(
            {
                name: RELEASED_VOICE_URL.format(release=release, name=name)
                for name in RELEASED_VOICES
            }
        )
        default_voice = DEFAULT_VOICES[releases.language_of(release)]
    language = releases.language_of(release) if release else settings.get("language", "english")
    logger.info("loaded %s (%s weights) from %s", source, weights, weights_file)
    return LoadedModel(
        model=net,
        tokenizer=tokenizer,
        config=config,
        text_options=TextOptions.from_config(config),
        source=source,
        weights=weights,
        voices=voices,
        default_voice=default_voice,
        language=releases.LANGUAGES.get(language, "en"),
    )


def _read_intone_settings(source: str) -> dict:
    try:
        path = fetch(sibling(source, INTONE_SETTINGS_FILE), "intone settings")
    except ModelUnavailableError:
        return {}  # a plain reference-package checkpoint
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}
