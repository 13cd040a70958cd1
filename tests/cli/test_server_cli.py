"""`intone serve` arguments -> server options."""

from __future__ import annotations

import pytest

from intone.engine import EngineConfig
from intone.provider.cli import build_parser, options_from_args
from intone.provider.server.settings import ServerSettings


def test_serve_defaults():
    options = options_from_args(build_parser().parse_args(["serve"]))
    assert options.model is None and options.fallback_preset == "full"
    assert (options.host, options.port) == ("127.0.0.1", 8000)
    assert options.settings.drain_timeout == 30.0
    assert not options.log_json
    # The engine's own defaults, the server's settings' own: not repeated in the CLI.
    engine, settings = EngineConfig(), ServerSettings()
    assert options.engine_config.max_active == engine.max_active == "auto"
    assert options.engine_config.pacing == engine.pacing == "yield"
    for name in ("max_queued", "kv_memory_mb", "max_text_chars", "device", "dtype"):
        assert getattr(options.engine_config, name) == getattr(engine, name), name
    assert options.settings == settings


@pytest.mark.parametrize("pacing", ["yield", "hold", "off"])
def test_serve_pacing(pacing):
    options = options_from_args(build_parser().parse_args(["serve", "--pacing", pacing]))
    assert options.engine_config.pacing == pacing
    options.engine_config.validate()


def test_serve_max_active_is_auto_or_a_number(capsys):
    parse = build_parser().parse_args
    assert options_from_args(parse(["serve", "--max-active", "auto"])).engine_config.max_active == (
        "auto"
    )
    assert options_from_args(parse(["serve", "--max-active", "24"])).engine_config.max_active == 24
    for bad in (["--max-active", "lots"], ["--pacing", "fast"]):
        with pytest.raises(SystemExit):
            parse(["serve", *bad])


def test_serve_options():
    args = build_parser().parse_args(
        [
            "-v", "serve", "--model", "ckpt", "--voices", "voices", "--host", "0.0.0.0",
            "--port", "9000", "--drain-timeout", "5", "--log-json", "--fallback-preset", "none",
            "--voice-alias", "alloy=alba", "--voice-alias", "echo=marius",
            "--max-streams-per-connection", "8", "--max-message-bytes", "1000",
            "--max-active", "4", "--kv-memory-mb", "64", "--dtype", "float32",
        ]
    )  # fmt: skip
    options = options_from_args(args)
    assert options.model == "ckpt" and str(options.voices_dir) == "voices"
    assert options.fallback_preset is None and options.log_json
    assert options.settings.voice_aliases == {"alloy": "alba", "echo": "marius"}
    assert options.settings.max_streams_per_connection == 8
    assert options.settings.max_message_bytes == 1000
    assert options.settings.drain_timeout == 5.0
    assert options.engine_config.max_active == 4 and options.engine_config.kv_memory_mb == 64
    assert options.engine_config.dtype == "float32"


def test_serve_access_and_limit_options(monkeypatch):
    monkeypatch.setenv("INTONE_API_KEYS", "env-1, env-2")
    args = build_parser().parse_args(
        [
            "serve", "--api-key", "flag-1", "--allowed-origins", "https://a.example,https://b.example",
            "--allowed-hosts", "tts.example", "--public-metrics", "--max-connections", "7",
            "--max-streams-per-client", "3", "--max-chars-per-minute", "900",
            "--max-request-bytes", "1000", "--header-timeout", "2", "--body-timeout", "3",
            "--ws-idle-timeout", "4", "--max-stream-seconds", "5", "--max-buffered-audio", "6",
            "--slow-client-timeout", "8", "--max-text-chars", "500", "--max-rows-per-tenant", "2",
        ]
    )  # fmt: skip
    options = options_from_args(args)
    assert options.engine_config.max_text_chars == 500
    assert options.engine_config.max_rows_per_tenant == 2
    settings = options.settings
    settings.validate()
    assert settings.api_keys == ("flag-1", "env-1", "env-2")
    assert settings.allowed_origins == ("https://a.example", "https://b.example")
    assert settings.allowed_hosts == ("tts.example",) and settings.public_metrics
    assert (settings.max_connections, settings.max_streams_per_client) == (7, 3)
    assert (settings.max_chars_per_minute, settings.max_request_bytes) == (900, 1000)
    assert (settings.header_timeout, settings.body_timeout, settings.ws_idle_timeout) == (2, 3, 4)
    assert (settings.max_stream_seconds, settings.max_buffered_audio) == (5, 6)
    assert settings.slow_client_timeout == 8


def test_keys_must_be_tokens():
    from intone.provider.server import ServerSettings

    for key in ("", "has space", 'quote"', "ümlaut"):
        with pytest.raises(ValueError, match="API keys"):
            ServerSettings(api_keys=(key,)).validate()


@pytest.mark.parametrize("alias", ["alloy", "=alba", "alloy="])
def test_bad_voice_alias(alias):
    with pytest.raises(ValueError, match="NAME=VOICE"):
        options_from_args(build_parser().parse_args(["serve", "--voice-alias", alias]))


@pytest.mark.parametrize("port", ["-1", "65536", "99999"])
def test_a_port_out_of_range_is_refused_before_anything_loads(port):
    with pytest.raises(ValueError, match="port"):
        options_from_args(build_parser().parse_args(["serve", "--port", port]))


@pytest.mark.parametrize(
    "models",
    [["english", "en"], ["english", "kyutai/pocket-tts"], ["{ckpt}", "{ckpt}/config.yaml"]],
)
def test_the_same_model_twice_is_refused_before_anything_loads(models, tiny_checkpoint):
    """It loaded twice, as "tiny" and "tiny-2": two engines whose requests never batch."""
    args = ["serve"]
    for model in models:
        args += ["--model", model.format(ckpt=tiny_checkpoint)]
    with pytest.raises(ValueError, match="same model"):
        options_from_args(build_parser().parse_args(args))
    # Two different models are still served side by side.
    options_from_args(build_parser().parse_args(["serve", "--model", "en", "--model", "fr"]))


def test_serve_reports_a_bad_voices_dir(tiny_checkpoint, tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable, "-m", "intone.provider.cli", "serve", "--model", str(tiny_checkpoint),
            "--voices", str(tmp_path / "missing"), "--port", "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert "is not a directory" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_port_in_use_is_refused_before_the_model_loads(tmp_path):
    """It was uvicorn's bind error after the whole load (minutes for a model from the Hub)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable, "-m", "intone.provider.cli", "serve",
                "--model", str(tmp_path / "never-loaded"), "--port", str(port),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "Traceback" not in result.stderr
