"""Every architecture family of the released configs, against the reference and the engine.

Each tiny preset shrinks one release and keeps its structure (sampler head, grouped-query
attention, low-rank table, z_dim, decoder shape, text rules, tokenizer kind and language). On each:
intone's single-request path equals `pocket-tts` at temperature 0 with EOS off, on a text in the
release's language with its diacritics; and the batched engine equals the single path. The
full-size releases run the same oracle under the `full` marker.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from intone.engine import AudioChunk, Engine, EngineConfig
from intone.engine.checkpoint import TINY_FAMILIES, make_checkpoint
from intone.engine.generate import generate
from intone.engine.loading import LoadedModel, load_model
from intone.engine.options import GenerationOptions
from intone.engine.releases import language_of
from intone.engine.voices import load_voice

from support.checkpoints import checkpoint
from support.engine import NO_EOS, engine_clauses
from support.oracle import Reference, ours, relative_error

MAX_REL = 1e-4
TEXTS = {
    "english": "Hello world, this is test 42 of the streaming system; it's quick.",
    "french": "Le garçon a mangé une crème brûlée à l'hôtel; c'était déjà Noël, où êtes-vous?",
    "german": "Die Mädchen aßen früh Brötchen mit Käse an der Straße; Österreich ist schön.",
    "spanish": "El niño comió una piña en España; ¿qué más quería él, señor?",
    "italian": "La città è più bella di lunedì; perché così, signorina?",
    "portuguese": "O irmão não comeu pão na manhã da lição; você está lá?",
    "dutch": "De ruïne in België was één geïnteresseerde coördinatie waard.",
}
# A tiny variant per family, plus the standard releases of the other languages (text rules and
# alphabets differ per language).
TINY_PRESETS = [*TINY_FAMILIES, "tiny-english", "tiny-spanish", "tiny-italian"]
TINY_PRESETS += ["tiny-portuguese", "tiny-dutch"]
# One full-size release per family.
FULL_RELEASES = [
    "french",
    "german_24l",
    "english_2026-01",
    "english_drifting_26-09",
    "english_18m_2026-10",
    "english_7m_2026-10",
    "english_2m_2026-10",
]


def checkpoint_language(checkpoint: Path) -> str:
    import yaml

    settings = yaml.safe_load((checkpoint / "intone.yaml").read_text())
    return settings["language"]


def check_against_reference(path: Path, text: str) -> dict[str, float]:
    loaded = load_model(path)
    wav = path / "voices" / "default.wav"
    voice = load_voice(loaded.model, "default", wav)
    ref_latents, ref_audio = Reference(path, NO_EOS).run(wav, text)
    latents, audio = ours(loaded, voice, text, NO_EOS)
    assert latents.shape == ref_latents.shape, "frame budgets differ"
    assert audio.shape == ref_audio.shape
    errors = {
        "latents": relative_error(latents, ref_latents),
        "audio": relative_error(audio, ref_audio),
    }
    assert max(errors.values()) < MAX_REL, errors
    return errors


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_tiny_family_equals_reference(
    preset: str, family_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = checkpoint(family_checkpoints, preset, tmp_path_factory)
    errors = check_against_reference(path, TEXTS[checkpoint_language(path)])
    print(f"{preset}: {errors}")  # shown with -s: the numbers for the notes


@pytest.mark.parametrize(
    ("preset", "text"),
    [
        # SentencePiece: the unknown piece decodes to " ⁇ ", which encodes to other tokens and
        # adds words (fewer frames after EOS by default).
        ("tiny-small", "Le garçon ✓ est là."),
        # tokenizers: it decodes to "<unk>".
        ("tiny-standard", "Un crochet ✓ et 字 ici."),
        # Fewer than five words: english_2026-01 pads the prompt with spaces.
        ("tiny-2026-01", "Hi there, you"),
    ],
)
def test_out_of_vocabulary_and_short_texts_equal_reference(
    preset: str,
    text: str,
    family_checkpoints: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    path = checkpoint(family_checkpoints, preset, tmp_path_factory)
    check_against_reference(path, text)


@pytest.mark.full
@pytest.mark.releases  # about 14 min on 2 cores: opt-in (-m full), not in the default run
@pytest.mark.parametrize("release", FULL_RELEASES)
def test_full_release_equals_reference(
    release: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = make_checkpoint(release, tmp_path_factory.mktemp(release), seed=0)
    errors = check_against_reference(path, TEXTS[language_of(release)])
    print(f"{release}: {errors}")


def single_path_audio(loaded: LoadedModel, voice, text: str, opts: GenerationOptions) -> np.ndarray:
    return torch.cat(list(generate(loaded, voice, engine_clauses(loaded, text), opts))).numpy()


async def engine_audio(engine: Engine, text: str, opts: GenerationOptions) -> np.ndarray:
    stream = engine.stream(None, opts)
    stream.push_text(text)
    stream.end_input()
    chunks = []
    async with asyncio.timeout(60):
        async for event in stream:
            if isinstance(event, AudioChunk):
                chunks.append(event.samples)
    return np.concatenate(chunks)


@pytest.mark.parametrize("preset", list(TINY_FAMILIES))
async def test_engine_equals_single_path_per_family(
    preset: str, family_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = checkpoint(family_checkpoints, preset, tmp_path_factory)
    text = TEXTS[checkpoint_language(path)]
    loaded = load_model(path)
    voice = load_voice(loaded.model, "default", path / "voices" / "default.wav")
    jobs = [
        GenerationOptions(temperature=t, eos_threshold=NO_EOS, max_frames=10, seed=s)
        for t, s in [(0.0, 1), (0.3, 2), (0.3, 3)]
    ]
    # float32: held to the single path at 1e-4 (the int8 default has its own tolerance).
    engine = Engine(load_model(path), EngineConfig(num_pages=256, dtype="float32")).start()
    try:
        got = await asyncio.gather(*[engine_audio(engine, text, opts) for opts in jobs])
    finally:
        engine.close()
    for opts, audio in zip(jobs, got, strict=True):
        want = single_path_audio(loaded, voice, text, opts)
        assert audio.shape == want.shape
        error = float(np.sqrt(np.mean((audio - want) ** 2)) / np.sqrt(np.mean(want**2)))
        assert error < MAX_REL, (opts, error)
