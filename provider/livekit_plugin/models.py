from typing import Literal

# The released Pocket TTS models (`intone models`; `intone.engine.releases`); a checkpoint
# directory, config .yaml or hf:// path works as well.
TTSModels = Literal[
    "kyutai/pocket-tts",
    "dutch",
    "dutch_24l",
    "english",
    "english_18m_2026-10",
    "english_18m_refl_2026-10",
    "english_2026-01",
    "english_2026-04",
    "english_2026-04_24l",
    "english_2026-09",
    "english_2026-09_2",
    "english_2026-09_24l",
    "english_2026-10",
    "english_2m_2026-10",
    "english_2m_refl_2026-10",
    "english_7m_2026-10",
    "english_7m_refl_2026-10",
    "english_drifting_26-09",
    "french",
    "french_24l",
    "german",
    "german_24l",
    "italian",
    "italian_24l",
    "portuguese",
    "portuguese_24l",
    "spanish",
    "spanish_24l",
]

# The released model's named voices. A checkpoint's own voice names, a voice WAV or a
# voice-state .safetensors path work as well.
TTSVoices = Literal[
    "alba",
    "marius",
    "javert",
    "jean",
    "fantine",
    "cosette",
    "eponine",
    "azelma",
    "anna",
    "vera",
    "charles",
    "paul",
    "george",
    "mary",
    "jane",
    "michael",
    "eve",
]
