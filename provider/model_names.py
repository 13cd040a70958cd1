"""Which model a name means and what a model is called: one home for the server and the plugins.

A model is asked for by a released model's name or any of its aliases ("english", "en",
"kyutai/pocket-tts"), a language ("fr", "fr-FR", "french"), a checkpoint directory, a config
.yaml or an hf:// path (`intone.engine.releases`, `intone.engine.loading`). `model_key` is the
one identity of all those spellings: the plugins share one engine per key (`registry.py`) and
`intone serve` refuses the same model twice. `model_name` is the name it goes by: what the
server calls a model it serves and what a voice state's header says it was made for, in process
and on the server alike.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from intone.engine import LoadedModel, releases

ModelSpec = str | Path | LoadedModel | None


def model_key(model: ModelSpec) -> str:
    """The identity of a model: every spelling of one model has the same key."""
    if isinstance(model, LoadedModel):
        model = model.source
    name = releases.DEFAULT_MODEL if model is None else str(model)
    release = releases.release_name(name)
    if release is not None:  # a release by any of its names ("fr", "french_24l")
        return releases.DEFAULT_MODEL if release == releases.DEFAULT_RELEASE else release
    if name.startswith("hf://"):
        return name
    path = Path(name).expanduser().resolve()
    # A checkpoint directory and its config.yaml are the same model.
    return str(path / "config.yaml") if path.is_dir() else str(path)


def pick_model(model: ModelSpec, language: str | None) -> ModelSpec:
    """The model a TTS speaks with: `model` if given, else `language`'s (a code such as "fr"
    or "fr-FR"; `releases.LANGUAGE_MODELS`), else the default. An unknown language raises
    UnknownModelError naming the known ones: never a silent fallback to English."""
    if model is not None:
        return model
    if language is not None:
        return releases.model_for_language(language)
    return None


def model_name(source: str) -> str:
    """The name of a loaded model (`LoadedModel.source`): a release by its reference name, a
    checkpoint by its hf:// path or its directory's (or config file's) name, never a local
    path (it would tell a client how the host is laid out)."""
    release = releases.release_name(source)
    if release is not None:
        return release
    if source.startswith("hf://"):
        return source
    path = PurePosixPath(source.replace("\\", "/"))
    if path.suffix in (".yaml", ".yml"):
        # A checkpoint directory holds `config.yaml`: its directory's name says which one.
        path = path.parent if path.stem == "config" else path.with_suffix("")
    return path.name or "model"


def requested_name(model: ModelSpec) -> str:
    """A model as a plugin reports it (its settings, LiveKit's metrics): as it was asked for, a
    `LoadedModel` by its source, the default by its hub name."""
    if isinstance(model, LoadedModel):
        return model.source
    return releases.DEFAULT_MODEL if model is None else str(model)
