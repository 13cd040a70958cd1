"""The released Pocket TTS models: their names, languages and packaged configs.

intone packages the 27 configs that the reference package (`pocket-tts` 4.0.1) ships, under the
reference's names (`english`, `french_24l`, `english_2m_2026-10`, ...), and each loads by that
name. `kyutai/pocket-tts` and `pocket-tts` mean `english`; a language code picks that language's
model, as Pipecat's Pocket TTS service does (French is `french_24l`, the others their 6-layer
model). Torch-free, so that command lines and servers can list models without loading one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

CONFIGS_DIR = Path(__file__).parent / "configs"
DEFAULT_MODEL = "kyutai/pocket-tts"
DEFAULT_RELEASE = "english"
# Hub-style names of the default English model.
ALIASES = {DEFAULT_MODEL: DEFAULT_RELEASE, "pocket-tts": DEFAULT_RELEASE}
# Language code -> the model a language shortcut means.
LANGUAGE_MODELS = {
    "en": "english",
    "fr": "french_24l",
    "de": "german",
    "es": "spanish",
    "it": "italian",
    "pt": "portuguese",
    "nl": "dutch",
}
LANGUAGES = {
    "english": "en",
    "french": "fr",
    "german": "de",
    "spanish": "es",
    "italian": "it",
    "portuguese": "pt",
    "dutch": "nl",
}


@functools.cache
def _release_names() -> tuple[str, ...]:
    return tuple(sorted(path.stem for path in CONFIGS_DIR.glob("*.yaml")))


def release_names() -> list[str]:
    """Every packaged release, by its reference name."""
    return list(_release_names())


def language_of(name: str) -> str:
    """The language (`english`, `french`, ...) of a release name."""
    language = name.split("_", 1)[0]
    if language not in LANGUAGES:
        raise ValueError(f"release {name!r} names no known language")
    return language


def release_name(model: str) -> str | None:
    """The release a model name, alias or language code means, or None if it names none."""
    model = ALIASES.get(model, model)
    model = LANGUAGE_MODELS.get(model.lower(), model)
    return model if model in release_names() else None


def config_path(name: str) -> Path:
    """The packaged config of a release name (as `release_name` returns it)."""
    return CONFIGS_DIR / f"{name}.yaml"


def model_for_language(language: str) -> str:
    """The model of a language: a code ("fr", "fr-FR", "pt_BR") or an English name ("french").

    Raises UnknownModelError naming the languages there are models for.
    """
    from intone.engine.errors import UnknownModelError

    base = language.replace("_", "-").split("-")[0].lower()
    base = LANGUAGES.get(base, base)
    model = LANGUAGE_MODELS.get(base)
    if model is None:
        raise UnknownModelError(
            f"no model speaks language {language!r}; languages: "
            + ", ".join(f"{code} ({name})" for code, name in LANGUAGE_MODELS.items())
        )
    return model


def known_names() -> list[str]:
    """Everything `release_name` accepts, for error messages."""
    return release_names() + sorted(ALIASES) + sorted(LANGUAGE_MODELS)


def language_shortcuts(name: str) -> list[str]:
    """The language codes and aliases that mean release `name`."""
    codes = [code for code, release in LANGUAGE_MODELS.items() if release == name]
    return codes + [alias for alias, release in ALIASES.items() if release == name]


@dataclass(frozen=True)
class ReleaseInfo:
    name: str
    language: str
    # Parameters that generation uses: the FlowLM and the Mimi decoder, not the voice encoder.
    parameters: int
    # The weights with the Mimi encoder (voice cloning from audio) are gated on the Hub; without
    # them a voice must be a predefined voice state.
    cloning_gated: bool
    shortcuts: list[str]


def release_table() -> list[ReleaseInfo]:
    """Every release with its language and parameter count (counted on the meta device)."""
    import torch

    from intone.engine.models.pocket.config import load_config
    from intone.engine.models.pocket.model import ENCODER_PREFIXES, PocketTTS

    table = []
    for name in release_names():
        config = load_config(config_path(name))
        with torch.device("meta"):
            model = PocketTTS(config)
        parameters = sum(
            p.numel() for key, p in model.named_parameters() if not key.startswith(ENCODER_PREFIXES)
        )
        table.append(
            ReleaseInfo(
                name,
                language_of(name),
                parameters,
                config.weights_path_without_voice_cloning is not None,
                language_shortcuts(name),
            )
        )
    return table
