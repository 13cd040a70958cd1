"""The embedded default: no --model and no released weights -> a generated checkpoint, loudly."""

from __future__ import annotations

import logging
import time

import huggingface_hub.constants
import pytest

from intone.engine.cache_dir import cache_dir
from intone.provider.server import model_source
from intone.provider.server.model_source import (
    fallback_checkpoint,
    hub_reachable,
    load_serving_model,
)


@pytest.fixture
def no_hub(monkeypatch):
    """A Hub endpoint that refuses connections, offline mode off: the slow case to avoid."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    # Restored after the test: the fallback switches the hub client to offline mode.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def test_hub_probe_fails_fast(no_hub):
    started = time.monotonic()
    assert hub_reachable() is False
    assert time.monotonic() - started < 2


def test_default_falls_back_to_a_generated_checkpoint_fast_and_loudly(no_hub, tmp_path, caplog):
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=model_source.__name__):
        loaded = load_serving_model(None, fallback_preset="tiny", directory=tmp_path)
    # No ~20 s of hub retries: the probe switched the hub client to its cache.
    assert time.monotonic() - started < 15
    assert huggingface_hub.constants.HF_HUB_OFFLINE is True
    assert loaded.weights == "generated"
    assert loaded.source == str(tmp_path / "fallback-tiny" / "config.yaml")
    assert loaded.default_voice == "default"
    assert any("RANDOM weights" in r.getMessage() for r in caplog.records)
    # The checkpoint is cached: a second start reuses it.
    mtime = (tmp_path / "fallback-tiny" / "model.safetensors").stat().st_mtime
    assert fallback_checkpoint("tiny", tmp_path) == tmp_path / "fallback-tiny"
    assert (tmp_path / "fallback-tiny" / "model.safetensors").stat().st_mtime == mtime
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".fallback")]


def test_no_fallback_when_asked(no_hub, tmp_path):
    with pytest.raises(model_source.ModelUnavailableError):
        load_serving_model(None, fallback_preset=None, directory=tmp_path)


def test_explicit_model_never_falls_back(tmp_path):
    with pytest.raises(model_source.ModelUnavailableError):
        load_serving_model(tmp_path / "missing", directory=tmp_path)


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("INTONE_CACHE_DIR", str(tmp_path / "a"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("INTONE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert cache_dir() == tmp_path / "b" / "intone"
