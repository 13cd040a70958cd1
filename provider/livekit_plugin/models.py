from typing import Literal

# The released Pocket TTS English model; a checkpoint directory, config .yaml or hf:// path
# works as well.
TTSModels = Literal["kyutai/pocket-tts"]

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
