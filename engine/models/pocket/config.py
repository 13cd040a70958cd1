"""The checkpoint config, in the reference package's YAML schema.

The schema mirrors `pocket_tts/utils/config.py` field for field, and like it forbids unknown keys,
so that one `config.yaml` loads in both intone and `pocket_tts.TTSModel.load_model`. Settings only
intone knows live in a separate `intone.yaml` beside it (see `intone.engine.loading`).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

# The sampler types and how many time conditions each head takes. "lsd": Lagrangian
# self-distillation (start and target time, 1 step by default); "flow_matching": N-step Euler
# integration of an optimal-transport flow (one time); "drifting": the head maps noise to a latent
# in one step; "pointwise": one step, the noise plus the head's output (LSD's 0 -> 1 step without
# times). A config with another type fails at load, with the field's path.
FLOW_TYPES = {"lsd": 2, "flow_matching": 1, "drifting": 0, "pointwise": 0}


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FlowConfig(StrictModel):
    dim: int
    depth: int
    # One of FLOW_TYPES.
    type: str = "lsd"

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value not in FLOW_TYPES:
            raise ValueError(
                f"unsupported sampler type {value!r}: expected one of {list(FLOW_TYPES)}"
            )
        return value


class FlowLMTransformerConfig(StrictModel):
    hidden_scale: int
    max_period: int
    d_model: int
    num_heads: int
    num_layers: int
    attn_dim: int | None = None
    num_kv_heads: int | None = None
    dim_feedforward: int | None = None


class LookupTable(StrictModel):
    dim: int
    n_bins: int
    tokenizer: str
    tokenizer_path: str
    rank: int | None = None


class FlowLMConfig(StrictModel):
    dtype: str
    flow: FlowConfig
    transformer: FlowLMTransformerConfig
    z_dim: int | None = None
    lookup_table: LookupTable
    weights_path: str | None = None
    insert_bos_before_voice: bool = False


class SEANetConfig(StrictModel):
    dimension: int
    channels: int
    n_filters: int
    n_residual_layers: int
    ratios: list[int]
    kernel_size: int
    residual_kernel_size: int
    last_kernel_size: int
    dilation_base: int
    pad_mode: str
    compress: int


class MimiTransformerConfig(StrictModel):
    d_model: int
    input_dimension: int
    output_dimensions: tuple[int, ...]
    num_heads: int
    num_layers: int
    layer_scale: float
    context: int
    max_period: float = 10000.0
    dim_feedforward: int


class QuantizerConfig(StrictModel):
    dimension: int
    output_dimension: int


class MimiConfig(StrictModel):
    dtype: str
    sample_rate: int
    channels: int
    frame_rate: float
    seanet: SEANetConfig
    transformer: MimiTransformerConfig
    quantizer: QuantizerConfig
    weights_path: str | None = None
    inner_dim: int | None = None
    outer_dim: int | None = None
    decoder_seanet: SEANetConfig | None = None
    decoder_transformer: MimiTransformerConfig | None = None


class Config(StrictModel):
    flow_lm: FlowLMConfig
    mimi: MimiConfig
    weights_path: str | None = None
    weights_path_without_voice_cloning: str | None = None
    pad_with_spaces_for_short_inputs: bool = False
    remove_semicolons: bool = False
    append_terminal_punctuation: bool = True
    capitalize_first_letter: bool = True
    replace_characters: dict[str, str] = {}
    model_recommended_frames_after_eos: int | None = None
    default_temperature: float = 0.3
    default_eos_threshold: float = -4.0

    @property
    def latent_dim(self) -> int:
        return self.mimi.quantizer.dimension

    @property
    def sample_rate(self) -> int:
        return self.mimi.sample_rate

    @property
    def samples_per_frame(self) -> int:
        return int(self.mimi.sample_rate / self.mimi.frame_rate)


def load_config(path: str | Path) -> Config:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ValueError(f"config {path} is not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"config {path} is not a YAML mapping")
    try:
        return Config(**raw)
    except ValidationError as e:
        raise ValueError(f"config {path} does not fit the Pocket TTS schema: {e}") from e


def dump_config(config: Config, path: str | Path) -> None:
    data = config.model_dump(mode="json", exclude_none=True)
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(data, f, sort_keys=False)
