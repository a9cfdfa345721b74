"""The Qwen3.5 text decoder's hyper-parameters (`Qwen35Config`), read from either checkpoint layout's config.json
and validated before any weight is read, so that a bad checkpoint fails naming the field and its value. One
config covers the dense family and Qwen3.5-MoE (`num_experts` > 0: every layer's FFN is routed experts plus a
shared expert of `intermediate_size`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
MAX_POSITIONS = 1 << 20
"""The most positions a config may declare (`max_position_embeddings`; the released models have 262,144): the
rotary tables hold cos and sin of every position, made at the first ask (7.7 GB at 1e8 positions)."""
_SIZES = {  # each integer field of `Qwen35Config` and its name in config.json, for the messages
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
    "gdn_key_heads": "linear_num_key_heads", "gdn_value_heads": "linear_num_value_heads",
    "gdn_key_dim": "linear_key_head_dim", "gdn_value_dim": "linear_value_head_dim",
    "conv_kernel": "linear_conv_kernel_dim", "max_position_embeddings": "max_position_embeddings",
}
_MOE_SIZES = {"num_experts": "num_experts", "experts_per_token": "num_experts_per_tok",
              "expert_size": "moe_intermediate_size"}
MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
"""The model types of Qwen3.5-MoE (release layout, text-only layout)."""
_REQUIRED = object()


@dataclass(frozen=True)
class Qwen35Config:
    """The text decoder's hyper-parameters, read from either checkpoint layout's config.json; always valid
    (`validate` runs at construction)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    gdn_key_heads: int
    gdn_value_heads: int
    gdn_key_dim: int
    gdn_value_dim: int
    conv_kernel: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_id: int | None = None
    num_experts: int = 0
    """Routed experts per layer (Qwen3.5-MoE); 0 for the dense models."""
    experts_per_token: int = 0
    expert_size: int = 0
    """Each routed expert's intermediate size (`moe_intermediate_size`)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def conv_dim(self) -> int:
        return 2 * self.gdn_key_heads * self.gdn_key_dim + self.gdn_value_heads * self.gdn_value_dim

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError, naming the config.json field and its value, unless this is a Qwen3.5 decoder the engine runs:
        positive integer sizes, both layer kinds, whole head groups, an even rotary part, a conv window, positive
        finite rope_theta and rms_norm_eps, at most MAX_POSITIONS positions."""
        for name, key in _SIZES.items():
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"{key} must be a positive integer, got {_shown(value)}")
        kinds = set(self.layer_types)
        if not self.layer_types or not kinds <= {FULL_ATTENTION, LINEAR_ATTENTION}:
            raise ValueError(f"layer_types must list {FULL_ATTENTION} and {LINEAR_ATTENTION} layers, got "
                             f"{_shown(list(self.layer_types))}")
        for kind in (LINEAR_ATTENTION, FULL_ATTENTION):
            if kind not in kinds:
                raise ValueError(f"layer_types has no {kind} layer: every Qwen3.5 model has both Gated DeltaNet "
                                 f"({LINEAR_ATTENTION}) and {FULL_ATTENTION} layers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                             f"({self.num_kv_heads})")
        if self.gdn_value_heads % self.gdn_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.gdn_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.gdn_key_heads})")
        if self.conv_kernel < 2:  # a checkpoint keeps the conv's last K - 1 inputs
            raise ValueError(f"linear_conv_kernel_dim must be at least 2, got {self.conv_kernel}")
        if self.max_position_embeddings > MAX_POSITIONS:
            raise ValueError(f"max_position_embeddings must be at most {MAX_POSITIONS:,} (the rotary tables cover "
                             f"every position), got {self.max_position_embeddings:,}")
        rotary = self.rotary_dim
        if type(rotary) is not int or rotary < 2 or rotary % 2 or rotary > self.head_dim:
            raise ValueError(f"head_dim x partial_rotary_factor must be an even number of rotary channels in [2, "
                             f"head_dim={self.head_dim}], got {_shown(rotary)}")
        for key, value in (("rope_theta", self.rope_theta), ("rms_norm_eps", self.rms_norm_eps)):
            if not _finite(value) or value <= 0:
                raise ValueError(f"{key} must be a positive finite number, got {_shown(value)}")
        if type(self.tie_word_embeddings) is not bool:
            raise ValueError(f"tie_word_embeddings must be true or false, got {_shown(self.tie_word_embeddings)}")
        eos = self.eos_token_id
        if eos is not None and (type(eos) is not int or eos < 0):
            raise ValueError(f"eos_token_id must be a token id, got {_shown(eos)}")
        if self.is_moe:
            for name, key in _MOE_SIZES.items():
                value = getattr(self, name)
                if type(value) is not int or value <= 0:
                    raise ValueError(f"{key} must be a positive integer, got {_shown(value)}")
            if self.experts_per_token > self.num_experts:
                raise ValueError(f"num_experts_per_tok ({self.experts_per_token}) must be at most num_experts "
                                 f"({self.num_experts})")

    def check_cuda_kernels(self) -> None:
        """ValueError unless the CUDA kernels take these head sizes (attention: a power-of-two head_dim; Gated
        DeltaNet: power-of-two head dims, keys of at least 16 and values of at least 32, its smallest V tile on
        CUDA); the CPU path takes any."""
        if self.head_dim & (self.head_dim - 1):
            raise ValueError(f"head_dim must be a power of two for the CUDA attention kernel, got {self.head_dim}")
        for key, value, least in (("linear_key_head_dim", self.gdn_key_dim, 16),
                                  ("linear_value_head_dim", self.gdn_value_dim, 32)):
            if value < least or value & (value - 1):
                raise ValueError(f"{key} must be a power of two >= {least} for the CUDA Gated DeltaNet kernel, got "
                                 f"{value}")

    @classmethod
    def from_text_config(
        cls, text: dict[str, Any], tie_word_embeddings: bool | None = None, moe: bool = False
    ) -> Qwen35Config:
        """From a `qwen3_5_text` config dict (the release layout's `text_config`, or a text-only config.json), or
        with `moe` a `qwen3_5_moe_text` one (its shared expert's size is `intermediate_size`).

        ValueError, naming the field and its value, for anything but a Qwen3.5 decoder this engine runs: a
        missing or non-integer size (integral floats are taken), a value out of range (`validate`), a rope type
        other than default, attention biases, another activation than SiLU, or no attention output gate."""
        if not isinstance(text, dict):
            raise TypeError(f"the config must be a JSON object, got {type(text).__name__} {_shown(text)}")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise TypeError(f"rope_parameters must be a JSON object, got {_shown(rope)}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported rope_type {_shown(rope_type)} (only 'default' is implemented)")
        rope_theta = _number(rope.get("rope_theta", text.get("rope_theta", 10_000.0)), "rope_theta")
        partial = _number(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)),
                          "partial_rotary_factor")
        if not 0 < partial <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {_shown(partial)}")
        if text.get("attention_bias", False) is not False:
            raise ValueError(f"attention_bias must be false (Qwen3.5 attention has no biases), got "
                             f"{_shown(text['attention_bias'])}")
        if text.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {_shown(text['hidden_act'])}")
        if text.get("attn_output_gate", True) is not True:
            raise ValueError(f"attn_output_gate must be true (Qwen3.5 gates its attention output), got "
                             f"{_shown(text['attn_output_gate'])}")
        head_dim = _size(text, "head_dim", 256)
        layers = _size(text, "num_hidden_layers")
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = _size(text, "full_attention_interval", 4)
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)]
        if not isinstance(layer_types, list) or len(layer_types) != layers or not all(
            kind in (FULL_ATTENTION, LINEAR_ATTENTION) for kind in layer_types
        ):
            raise ValueError(f"layer_types must list {layers} (num_hidden_layers) of {FULL_ATTENTION}/"
                             f"{LINEAR_ATTENTION}, got {_shown(layer_types)}")
        tie = text.get("tie_word_embeddings", False) if tie_word_embeddings is None else tie_word_embeddings
        eos = text.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        experts = {}
        if moe:
            experts = {"num_experts": _size(text, "num_experts"),
                       "experts_per_token": _size(text, "num_experts_per_tok"),
                       "expert_size": _size(text, "moe_intermediate_size")}
        return cls(
            vocab_size=_size(text, "vocab_size"),
            hidden_size=_size(text, "hidden_size"),
            intermediate_size=_size(text, "shared_expert_intermediate_size" if moe else "intermediate_size"),
            layer_types=tuple(layer_types),
            num_heads=_size(text, "num_attention_heads"),
            num_kv_heads=_size(text, "num_key_value_heads"),
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            rope_theta=rope_theta,
            rms_norm_eps=_number(text.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
            gdn_key_heads=_size(text, "linear_num_key_heads", 16),
            gdn_value_heads=_size(text, "linear_num_value_heads", 32),
            gdn_key_dim=_size(text, "linear_key_head_dim", 128),
            gdn_value_dim=_size(text, "linear_value_head_dim", 128),
            conv_kernel=_size(text, "linear_conv_kernel_dim", 4),
            tie_word_embeddings=tie,
            max_position_embeddings=_size(text, "max_position_embeddings", 32768),
            eos_token_id=eos,
            **experts,
        )


def _shown(value: Any) -> str:
    """A config value as a message shows it (its repr, cut at 80 characters)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _finite(value: Any) -> bool:
    """Whether `value` is a real number (not a bool) of finite float value."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past the float range
        return False


def _size(text: dict[str, Any], key: str, default: Any = _REQUIRED) -> int:
    """The positive integer `text[key]` (an integral float is taken as its integer); ValueError otherwise."""
    value = text.get(key, default)
    if value is _REQUIRED:
        raise ValueError(f"{key} is missing")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int or value <= 0:
        raise ValueError(f"{key} must be a positive integer, got {_shown(value)}")
    return value


def _number(value: Any, key: str) -> float:
    """A finite real number as a float (its range is checked by `Qwen35Config.validate`); ValueError otherwise."""
    if not _finite(value):
        raise ValueError(f"{key} must be a finite number, got {_shown(value)}")
    return float(value)
