"""The released Pocket TTS models: their names, languages and packaged configs.

intone packages the 27 configs that the reference package (`pocket-tts` 4.0.1) ships, under the
reference's names (`english`, `french_24l`, `english_2m_2026-10`, ...), and each loads by that
name. `kyutai/pocket-tts` and `pocket-tts` mean `english`; a language code picks that language's
model, as Pipecat's Pocket TTS service does (French is `french_24l`, the others their 6-layer
model). Torch-free, so that command lines and servers can list models without loading one.
"""

from __future__ import annotations

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


def release_names() -> list[str]:
    """Every packaged release, by its reference name."""
    return sorted(path.stem for path in CONFIGS_DIR.glob("*.yaml"))


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
    return model if (CONFIGS_DIR / f"{model}.yaml").is_file() else None


def config_path(name: str) -> Path:
    """The packaged config of a release name (as `release_name` returns it)."""
    return CONFIGS_DIR / f"{name}.yaml"


def known_names() -> list[str]:
    """Everything `release_name` accepts, for error messages."""
    return release_names() + sorted(ALIASES) + sorted(LANGUAGE_MODELS)
