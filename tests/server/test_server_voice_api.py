"""`/v1/voices`: upload, list, read and delete voices; use them by id from the WebSocket, the
OpenAI endpoint and the client; each bad upload refused with its code and nothing kept; keys
see only their own; a restart keeps them; a delete while in use lets the stream finish."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile
import torch
import yaml
from safetensors.torch import load_file, save_file
from websockets.asyncio.client import connect

from intone.engine.models.pocket.config import dump_config, load_config
from intone.engine.models.pocket.model import ENCODER_PREFIXES
from intone.engine.voices import Voice, save_voice_state
from intone.provider.client import IntoneClient, IntoneError
from intone.provider.server.voice_store import VoiceStore, is_voice_id, owner_for

from support.server import (
    LONG_TEXT,
    idle_pages,
    recv_event,
    recv_until,
    running_server,
    send,
    wait_engine_idle,
)

RATE = 24000
KEYS = ("alpha-key-1", "beta-key-2")


def tone(seconds: float, rate: int = RATE, channels: int = 1, level: float = 0.3) -> np.ndarray:
    """A voice-like test signal: a few harmonics with a syllable-rate envelope."""
    t = np.arange(int(seconds * rate)) / rate
    wave = sum(np.sin(2 * np.pi * f * t) / (i + 1) for i, f in enumerate((140, 280, 420, 700)))
    wave *= 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2
    wave = (level * wave / np.abs(wave).max()).astype(np.float32)
    return np.stack([wave] * channels, axis=1) if channels > 1 else wave


def encode(samples: np.ndarray, fmt: str = "WAV", subtype: str = "PCM_16", rate: int = RATE):
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def auth(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


async def upload(http, url, data: bytes, key=None, filename="me.wav", **fields) -> httpx.Response:
    return await http.post(
        f"{url}/v1/voices",
        files={"file": (filename, data, "application/octet-stream")},
        data=fields,
        headers=auth(key),
    )


def stored_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("voice-store")


@pytest.fixture(scope="module")
def served(tiny_checkpoint, store):
    with running_server(
        tiny_checkpoint, voice_store=store, max_voice_bytes=400_000, max_voice_seconds=5.0
    ) as (server, engine):
        yield server, engine


async def test_upload_list_get_speak_delete(served, store):
    server, engine = served
    async with httpx.AsyncClient(timeout=30) as http:
        response = await upload(http, server.url, encode(tone(3.0)), name="Ada")
        assert response.status_code == 201, response.text
        voice = response.json()
        assert set(voice) == {"id", "name", "model", "seconds"}
        assert voice["name"] == "Ada" and voice["seconds"] == pytest.approx(3.0, abs=0.01)
        assert stored_files(store) == [f"{voice['id']}.safetensors"]
        assert voice["id"] in engine.voices  # prefilled before the answer
        listed = (await http.get(f"{server.url}/v1/voices")).json()["voices"]
        assert {**voice, "shared": False} in listed
        assert {"id": "default", "name": "default", "model": voice["model"], "seconds": None,
                "shared": True} in listed  # fmt: skip
        got = await http.get(f"{server.url}/v1/voices/{voice['id']}")
        assert got.status_code == 200 and got.json() == {**voice, "shared": False}
        # Uploaded voices are not listed by name anywhere a stranger looks.
        health = (await http.get(f"{server.url}/healthz")).json()
        assert voice["id"] not in json.dumps(health)
        # OpenAI endpoint, by id.
        speech = await http.post(
            f"{server.url}/v1/audio/speech",
            json={"input": "Hi there.", "voice": voice["id"], "response_format": "pcm"},
        )
        assert speech.status_code == 200 and speech.headers["x-intone-voice"] == voice["id"]
        assert len(speech.content) > 0
    # WebSocket and the client, by id.
    async with IntoneClient(server.url) as client:
        assert voice["id"] not in client.voices
        audio = await client.synthesize("Hi.", voice=voice["id"], options={"max_frames": 4})
        assert audio
        assert voice in [
            {k: v for k, v in x.items() if k != "shared"} for x in await client.list_voices()
        ]
        await client.delete_voice(voice["id"])
        with pytest.raises(IntoneError) as info:
            await client.synthesize("Hi.", voice=voice["id"])
        assert info.value.code == "unknown_voice"
        with pytest.raises(IntoneError) as info:
            await client.delete_voice(voice["id"])
        assert info.value.code == "unknown_voice"
    assert stored_files(store) == [] and voice["id"] not in engine.voices


async def test_formats_raw_bodies_and_conversions(served, store):
    """FLAC, MP3 and OGG as raw bodies (name and model in the query); stereo and 8 kHz are
    converted; the client's add_voice takes a path or bytes."""
    server, engine = served
    ids = []
    async with httpx.AsyncClient(timeout=30) as http:
        for fmt, subtype, content_type in (
            ("FLAC", "PCM_16", "audio/flac"),
            ("MP3", "MPEG_LAYER_III", "audio/mpeg"),
            ("OGG", "VORBIS", "audio/ogg"),
        ):
            data = encode(tone(2.0), fmt, subtype)
            response = await http.post(
                f"{server.url}/v1/voices?name={fmt}",
                content=data,
                headers={"content-type": content_type},
            )
            assert response.status_code == 201, (fmt, response.text)
            assert response.json()["name"] == fmt
            ids.append(response.json()["id"])
        for samples, rate in ((tone(2.0, channels=2), RATE), (tone(2.0, rate=8000), 8000)):
            response = await upload(http, server.url, encode(samples, rate=rate))
            assert response.status_code == 201, response.text
            assert response.json()["seconds"] == pytest.approx(2.0, abs=0.01)
            ids.append(response.json()["id"])
    async with IntoneClient(server.url) as client:
        path = store.parent / "client-voice.wav"
        path.write_bytes(encode(tone(1.5)))
        for source in (path, encode(tone(1.5))):
            voice = await client.add_voice(source, name="from client")
            assert voice["name"] == "from client"
            ids.append(voice["id"])
        for voice_id in ids:
            await client.delete_voice(voice_id)
    assert stored_files(store) == []


def voice_state(engine, voice_id: str, store: Path) -> bytes:
    return (store / f"{voice_id}.safetensors").read_bytes()


async def test_voice_state_uploads(served, store, tiny_voice: Voice, tmp_path):
    """A voice-state .safetensors (ours or the reference's layout) is taken as it is; one of
    the wrong shape, of another model or with NaN values is refused."""
    server, engine = served
    path = tmp_path / "state.safetensors"
    save_voice_state(tiny_voice, path)
    async with httpx.AsyncClient(timeout=30) as http:
        response = await upload(http, server.url, path.read_bytes(), filename="s.safetensors")
        assert response.status_code == 201, response.text
        voice_id = response.json()["id"]
        stored = load_file(store / f"{voice_id}.safetensors")
        torch.testing.assert_close(
            stored["transformer.layers.0.self_attn/cache"][0, 0], tiny_voice.keys[0]
        )
        assert (await http.delete(f"{server.url}/v1/voices/{voice_id}")).status_code == 204

        state = load_file(path)
        wrong = {k: v[..., :8].contiguous() if k.endswith("cache") else v for k, v in state.items()}
        nan = {k: v.clone() for k, v in state.items()}
        nan["transformer.layers.1.self_attn/cache"][0, 0, 3, 0, 0] = float("nan")
        made_for_other = {"format": "intone-voice-1", "model": "other", "name": "x", "seconds": "1"}
        cases = {
            "does not fit": (wrong, None),
            "made for model 'other'": (state, made_for_other),
            "NaN": (nan, None),
        }
        for what, (tensors, metadata) in cases.items():
            save_file(tensors, str(tmp_path / "bad.safetensors"), metadata=metadata)
            data = (tmp_path / "bad.safetensors").read_bytes()
            response = await upload(http, server.url, data, filename="bad.safetensors")
            assert response.status_code == 400, what
            error = response.json()["error"]
            assert error["code"] == "bad_voice_state", (what, error)
            assert what in error["message"] and str(tmp_path) not in error["message"]
    assert stored_files(store) == []


def wav_claiming_more(data: bytes) -> bytes:
    """A WAV whose data chunk says it holds ten times the samples it has."""
    at = data.index(b"data")
    size = int.from_bytes(data[at + 4 : at + 8], "little")
    return data[: at + 4] + (size * 10).to_bytes(4, "little") + data[at + 8 :]


async def test_bad_uploads_are_refused_with_a_code_and_nothing_kept(served, store):
    server, engine = served
    good = encode(tone(2.0))
    nan = tone(2.0)
    nan[100] = np.nan
    inf = tone(2.0)
    inf[100] = np.inf
    cases = {
        "not audio": (b"hello, this is not a sound file" * 20, 400, "bad_audio"),
        "truncated header": (good[:30], 400, "bad_audio"),
        "truncated samples": (good[: len(good) // 2], 400, "bad_audio"),
        "lying header": (wav_claiming_more(good), 400, "bad_audio"),
        "zero sample rate": (good[:24] + bytes(4) + good[28:], 400, "bad_audio"),
        "silence": (encode(np.zeros(RATE * 2, np.float32)), 400, "voice_silent"),
        "under a second": (encode(tone(0.6)), 400, "voice_too_short"),
        "over the duration limit": (encode(tone(6.0)), 400, "voice_too_long"),
        "over the size limit": (encode(tone(5.0), subtype="FLOAT") * 2, 413, "voice_too_large"),
        "NaN samples": (encode(nan, subtype="FLOAT"), 400, "bad_audio"),
        "infinite samples": (encode(inf, subtype="FLOAT"), 400, "bad_audio"),
        "empty": (b"", 400, "bad_audio"),
    }
    pages = idle_pages(engine)
    voices = engine.voices
    async with httpx.AsyncClient(timeout=30) as http:
        for what, (data, status, code) in cases.items():
            response = await upload(http, server.url, data)
            assert response.status_code == status, (what, response.text)
            assert response.json()["error"]["code"] == code, (what, response.json())
        # The same refusals for a raw body.
        response = await http.post(
            f"{server.url}/v1/voices", content=b"x" * 500_000, headers={"content-type": "audio/wav"}
        )
        assert (response.status_code, response.json()["error"]["code"]) == (413, "voice_too_large")
        # Not an upload at all.
        for kwargs, status in (
            (dict(content=good, headers={"content-type": "text/plain"}), 415),
            (dict(data={"name": "no file"}, files={"other": ("a.wav", good)}), 400),
            (dict(files={"file": ("a.wav", good)}, data={"name": "\x00bad"}), 400),
            (dict(files={"file": ("a.wav", good)}, data={"name": "x" * 101}), 400),
        ):
            response = await http.post(f"{server.url}/v1/voices", **kwargs)
            assert response.status_code == status, (kwargs.get("data"), response.text)
            assert response.json()["error"]["code"] == "bad_upload"
        response = await upload(http, server.url, good, model="fr")  # a model not served
        assert (response.status_code, response.json()["error"]["code"]) == (400, "unknown_model")
        unknown = await http.get(f"{server.url}/v1/voices/voice_0123456789abcdef01234567")
        assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "unknown_voice")
        shared = await http.delete(f"{server.url}/v1/voices/default")
        assert (shared.status_code, shared.json()["error"]["code"]) == (403, "voice_read_only")
    assert stored_files(store) == []
    assert engine.voices == voices
    await wait_engine_idle(engine, pages)


async def test_keys_see_their_own_voices_and_a_quota(tiny_checkpoint, tmp_path):
    alpha, beta = KEYS
    with running_server(
        tiny_checkpoint, voice_store=tmp_path, api_keys=KEYS, max_voices_per_key=2
    ) as (server, engine):
        async with httpx.AsyncClient(timeout=30) as http:
            assert (await upload(http, server.url, encode(tone(1.5)))).status_code == 401
            assert (await http.get(f"{server.url}/v1/voices")).status_code == 401
            mine = []
            for _ in range(2):
                response = await upload(http, server.url, encode(tone(1.5)), key=alpha)
                assert response.status_code == 201
                mine.append(response.json()["id"])
            response = await upload(http, server.url, encode(tone(1.5)), key=alpha)
            assert (response.status_code, response.json()["error"]["code"]) == (
                429,
                "too_many_voices",
            )
            assert len(stored_files(tmp_path)) == 2
            theirs = await upload(http, server.url, encode(tone(1.5)), key=beta)
            assert theirs.status_code == 201
            listed = (await http.get(f"{server.url}/v1/voices", headers=auth(beta))).json()
            ids = {v["id"] for v in listed["voices"]}
            assert theirs.json()["id"] in ids and not ids & set(mine) and "default" in ids
            for method in ("get", "delete"):
                response = await http.request(
                    method, f"{server.url}/v1/voices/{mine[0]}", headers=auth(beta)
                )
                assert (response.status_code, response.json()["error"]["code"]) == (
                    404,
                    "unknown_voice",
                )
            speech = await http.post(
                f"{server.url}/v1/audio/speech",
                json={"input": "Hi.", "voice": mine[0], "response_format": "pcm"},
                headers=auth(beta),
            )
            assert speech.json()["error"]["code"] == "unknown_voice"
            assert mine[0] not in speech.json()["error"]["message"].split("known voices")[1]
        async with IntoneClient(server.url, api_key=beta) as client:
            with pytest.raises(IntoneError) as info:
                await client.synthesize("Hi.", voice=mine[0])
            assert info.value.code == "unknown_voice"
        async with IntoneClient(server.url, api_key=alpha) as client:
            assert await client.synthesize("Hi.", voice=mine[0], options={"max_frames": 4})
            await client.delete_voice(mine[0])
            assert (await client.add_voice(encode(tone(1.5))))["id"]  # a place came back


async def test_a_restart_keeps_the_voices(tiny_checkpoint, tmp_path):
    options = {"max_frames": 4, "seed": 3, "temperature": 0.0}
    with running_server(tiny_checkpoint, voice_store=tmp_path) as (server, _):
        async with IntoneClient(server.url) as client:
            voice = await client.add_voice(encode(tone(2.0)), name="kept")
            before = await client.synthesize("Hi there.", voice=voice["id"], options=options)
    assert stored_files(tmp_path) == [f"{voice['id']}.safetensors"]
    with running_server(tiny_checkpoint, voice_store=tmp_path) as (server, engine):
        # Registered from its header only: its pages are written by its first stream.
        assert voice["id"] in engine.voices
        assert engine.metrics()["voices_resident"] == 1
        async with IntoneClient(server.url) as client:
            assert {**voice, "shared": False} in await client.list_voices()
            after = await client.synthesize("Hi there.", voice=voice["id"], options=options)
    # The same voice: the same audio (to int8 rounding between runs).
    got, want = (np.frombuffer(pcm, "<i2").astype(np.int32) for pcm in (after, before))
    assert got.shape == want.shape and np.abs(got - want).max() <= 8


@pytest.fixture(scope="module")
def no_cloning(tiny_checkpoint, tiny_voice, tmp_path_factory) -> Path:
    """The tiny checkpoint without its Mimi encoder, as the release without voice cloning: its
    default voice is a voice state."""
    directory = tmp_path_factory.mktemp("no-cloning") / "nocloning"
    shutil.copytree(tiny_checkpoint, directory)
    weights = load_file(directory / "model.safetensors")
    kept = {k: v for k, v in weights.items() if not k.startswith(ENCODER_PREFIXES)}
    assert len(kept) < len(weights)
    save_file(kept, str(directory / "model.safetensors"))
    config = load_config(directory / "config.yaml")
    config.weights_path = str(directory / "model.safetensors")
    config.flow_lm.lookup_table.tokenizer_path = str(directory / "tokenizer.model")
    dump_config(config, directory / "config.yaml")
    save_voice_state(tiny_voice, directory / "voices" / "default.safetensors")
    settings = yaml.safe_load((directory / "intone.yaml").read_text())
    settings["voices"]["default"] = "voices/default.safetensors"
    (directory / "intone.yaml").write_text(yaml.safe_dump(settings))
    return directory


async def test_a_model_without_voice_cloning_refuses_audio(no_cloning, tiny_voice, tmp_path):
    state = tmp_path / "state.safetensors"
    save_voice_state(tiny_voice, state)
    store = tmp_path / "store"
    with running_server(no_cloning, voice_store=store) as (server, engine):
        assert not engine.model.has_voice_encoder
        async with httpx.AsyncClient(timeout=30) as http:
            response = await upload(http, server.url, encode(tone(2.0)))
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["code"] == "voice_cloning_unavailable"
            assert "'nocloning'" in error["message"]
            assert stored_files(store) == []
            response = await upload(http, server.url, state.read_bytes(), filename="s.safetensors")
            assert response.status_code == 201, response.text


async def test_deleting_a_voice_in_use_lets_its_stream_finish(served, store):
    server, engine = served
    async with IntoneClient(server.url) as client:
        voice = await client.add_voice(encode(tone(2.0)))
    pages = idle_pages(engine)
    voice_table = engine.scheduler.voices[voice["id"]].table
    assert voice_table is not None
    voice_pages = len(voice_table.pages)
    async with connect(server.ws_url) as ws:
        await recv_event(ws)
        await send(ws, type="start", stream="s", voice=voice["id"], text=LONG_TEXT[:600])
        assert (await recv_event(ws))["type"] == "started"
        async with httpx.AsyncClient(timeout=30) as http:
            response = await http.delete(f"{server.url}/v1/voices/{voice['id']}")
            assert response.status_code == 204
        await send(ws, type="start", stream="t", voice=voice["id"], text="Hi.")
        await send(ws, type="end", stream="s")
        refused, _ = await recv_until(ws, lambda e: e.get("stream") == "t")
        assert refused["code"] == "unknown_voice"
        done, _ = await recv_until(
            ws, lambda e: e.get("stream") == "s" and e["type"] in ("done", "cancelled", "error"), 60
        )
        assert done["type"] == "done", done
    assert stored_files(store) == []
    # The voice's pages went with its last stream.
    await wait_engine_idle(engine, pages - voice_pages)


async def test_a_voice_budget_evicts_idle_voices_and_loads_them_again(tiny_checkpoint, tmp_path):
    """--voice-cache-mb 0: no idle voice keeps its pages; each stream loads its voice again."""
    config = {"voice_cache_mb": 0.0}
    with running_server(tiny_checkpoint, engine_config=config, voice_store=tmp_path) as (
        server,
        engine,
    ):
        async with IntoneClient(server.url) as client:
            ids = [(await client.add_voice(encode(tone(1.5 + i / 4))))["id"] for i in range(3)]
            assert engine.metrics()["voices_resident"] == 0
            for voice_id in [*ids, "default", *ids]:
                audio = await client.synthesize("Hi.", voice=voice_id, options={"max_frames": 4})
                assert len(audio) == 4 * 1920 * 2
        m = await wait_engine_idle(engine, 0)
        assert m["voices_resident"] == 0 and m["voice_evictions"] >= 9
        assert m["voice_loads"] >= 3 + 7


def test_the_store_keeps_only_its_own_files(tiny_voice: Voice, tmp_path, caplog):
    store = VoiceStore(tmp_path)
    kept = store.save(tiny_voice, "Ada", "tiny", 3.0, owner_for("k"))
    assert is_voice_id(kept.id) and store.visible(kept.id, owner_for("k")) == kept
    assert (
        store.visible(kept.id, owner_for("other")) is None and store.visible(kept.id, None) is None
    )
    (tmp_path / "foreign.safetensors").write_bytes(b"junk")
    save_voice_state(tiny_voice, tmp_path / "voice_0123456789abcdef01234567.safetensors")
    (tmp_path / f".{kept.id}.safetensors.tmp").write_bytes(b"half")  # a crash mid-write
    reopened = VoiceStore(tmp_path)
    assert list(reopened.voices) == [kept.id] and reopened.voices[kept.id] == kept
    assert "skipping foreign.safetensors" in caplog.text
    assert not (tmp_path / f".{kept.id}.safetensors.tmp").exists()
    assert reopened.reserve(kept.owner, 2) and not reopened.reserve(kept.owner, 2)
    reopened.unreserve(kept.owner)
    reopened.delete(kept.id)
    assert not kept.path.exists() and kept.id not in reopened
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ValueError, match="--voice-store"):
        VoiceStore(tmp_path / "file")

    temporary = VoiceStore()
    stored = temporary.save(tiny_voice, "Ada", "tiny", 3.0, None)
    assert stored.path.exists()
    temporary.close()
    assert not stored.path.parent.exists()


async def test_a_hundred_uploads_with_a_budget_for_ten(tiny_checkpoint, tiny_voice, tmp_path):
    """100 voices uploaded (as voice states: no encoding), a KV budget for 10 of them, a stream
    on every one at once: each sounds as the single path does with its voice."""
    from intone.engine import load_model

    from support.voices import VOICES, single_path, variant

    loaded = load_model(tiny_checkpoint)
    page_bytes = loaded.model.flow_lm.new_kv_pool(0, device="cpu").slot_bytes * 16
    budget_mb = 10 * -(-tiny_voice.length // 16) * page_bytes / 2**20
    config = {"voice_cache_mb": budget_mb, "dtype": "float32", "num_pages": 2048}
    settings = {"max_streams_per_connection": VOICES, "max_voices_per_key": VOICES}
    with running_server(
        tiny_checkpoint, engine_config=config, voice_store=tmp_path / "store", **settings
    ) as (server, engine):
        ids = []
        async with IntoneClient(server.url) as client:
            for index in range(VOICES):
                path = tmp_path / f"{index}.safetensors"
                save_voice_state(variant(tiny_voice, index), path)
                ids.append((await client.add_voice(path))["id"])
            assert engine.metrics()["voice_pages"] * page_bytes <= budget_mb * 2**20
            wire = {"eos_threshold": 1e9, "max_frames": 4, "chain_frames": 0}
            audio = await asyncio.gather(
                *(
                    client.synthesize(
                        "Hi there.", voice=voice_id, format="pcm_f32le", options={**wire, "seed": i}
                    )
                    for i, voice_id in enumerate(ids)
                )
            )
        for index, pcm in enumerate(audio):
            got = np.frombuffer(pcm, "<f4")
            want = single_path(loaded, variant(tiny_voice, index), index)
            assert got.shape == want.shape, index
            error = np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want**2))
            assert error < 1e-4, f"voice {index}: relative RMS error {error:.2e}"
        m = await wait_engine_idle(engine, engine.metrics()["voice_pages"])
        assert m["voice_pages"] * page_bytes <= budget_mb * 2**20
        assert m["voice_evictions"] >= VOICES - 10 and m["voice_loads"] >= 2 * VOICES - 10
