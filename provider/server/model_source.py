"""Which checkpoint the server runs: the one asked for, the released default, or a fallback.

With no --model the server wants the released Pocket TTS model from the Hugging Face Hub. On a
machine that cannot get it (offline, gated, no cache) it still starts, on a checkpoint of random
weights generated locally and cached, and says so loudly: a console warning, `weights:
"generated"` in /healthz and a banner on the demo page. It speaks noise, not words.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from intone.engine.cache_dir import cache_dir
from intone.engine.loading import LoadedModel, ModelUnavailableError, load_model

logger = logging.getLogger(__name__)

FALLBACK_PRESETS = ("full", "tiny")
HUB_PROBE_TIMEOUT = 3.0  # seconds; the hub client itself retries for ~20 s when offline


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT) -> bool:
    """A quick TCP connect to the Hub endpoint; True when a proxy is configured (can't tell)."""
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY")):
        return True
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def use_hub_cache_only() -> None:
    """Hub offline mode for this process: cached files still load, misses fail at once."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import huggingface_hub.constants as hub_constants
    except ImportError:
        return
    # The flag is read from the environment at import time; it may already have happened.
    hub_constants.HF_HUB_OFFLINE = True


def fallback_checkpoint(preset: str = "full", directory: Path | None = None) -> Path:
    """A generated random-weight checkpoint, made once and cached (make_checkpoint is seeded)."""
    if preset not in FALLBACK_PRESETS:
        raise ValueError(f"fallback preset must be one of {FALLBACK_PRESETS}, got {preset!r}")
    target = (directory or cache_dir()) / f"fallback-{preset}"
    if (target / "config.yaml").is_file():
        return target
    from intone.engine.checkpoint import make_checkpoint

    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    # Built aside and renamed, so a crash or a concurrent start never leaves half a checkpoint.
    scratch = Path(tempfile.mkdtemp(prefix=f".fallback-{preset}-", dir=target.parent))
    try:
        make_checkpoint(preset, scratch, seed=0)
        _rewrite_paths(scratch, target)
        try:
            scratch.rename(target)
        except OSError:
            if not (target / "config.yaml").is_file():
                raise  # not a concurrent start that won the race
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    elapsed = time.perf_counter() - started
    logger.info("generated the %s fallback checkpoint in %.1f s", preset, elapsed)
    return target


def _rewrite_paths(scratch: Path, target: Path) -> None:
    """make_checkpoint writes absolute paths into config.yaml: point them at the final place."""
    config = scratch / "config.yaml"
    text = config.read_text(encoding="utf-8")
    for old in {str(scratch.resolve()), str(scratch)}:
        text = text.replace(old, str(target.resolve()))
    config.write_text(text, encoding="utf-8")


def load_serving_model(
    model: str | Path | None = None,
    fallback_preset: str | None = "full",
    directory: Path | None = None,
) -> LoadedModel:
    """The checkpoint to serve. An explicit `model` must load; the default may fall back."""
    if model is not None:
        return load_model(model)
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if not offline and not hub_reachable():
        logger.info("the Hugging Face Hub is unreachable: using the local cache only")
        use_hub_cache_only()
    try:
        return load_model(None)
    except ModelUnavailableError as e:
        if fallback_preset is None:
            raise
        reason = str(e)
    path = fallback_checkpoint(fallback_preset, directory)
    loaded = load_model(path)
    logger.warning(
        "\n" + "*" * 76 + "\n"
        "* The released Pocket TTS weights are unavailable. Serving a GENERATED\n"
        "* checkpoint with RANDOM weights (preset %s): it produces noise, not speech.\n"
        "* Pass --model DIR for a real checkpoint.\n" + "*" * 76 + "\n"
        "reason: %s\ncheckpoint: %s",
        fallback_preset,
        reason,
        path,
        extra={"weights": loaded.weights, "source": loaded.source},
    )
    return loaded
