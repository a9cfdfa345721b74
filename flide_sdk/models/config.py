"""The text decoders' hyper-parameters, read from either checkpoint layout's config.json and validated before any
weight is read, so that a bad checkpoint fails naming the field and its value: Qwen3.5's (`Qwen35Config`, dense
or Qwen3.5-MoE: `num_experts` > 0, every layer's FFN routed experts plus a shared expert of `intermediate_size`)
and Gemma 4's (`Gemma4Config`: sliding-window and full attention layers, dense or 26B-A4B's experts). Each says
what its checkpoints hold per layer (`state_layout`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from flide_sdk.models.state import KeyValueShape, RecurrentShape, StateLayout

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

    def state_layout(self) -> StateLayout:
        """A checkpoint holds each Gated DeltaNet layer's state and conv window and each attention layer's keys and
        values."""
        kinds = list(enumerate(self.layer_types))
        recurrent = RecurrentShape(self.gdn_value_heads, self.gdn_key_dim, self.gdn_value_dim, self.conv_kernel,
                                   self.conv_dim)
        return StateLayout(recurrent, tuple(i for i, kind in kinds if kind == LINEAR_ATTENTION),
                           tuple(KeyValueShape(i, self.num_kv_heads, self.head_dim) for i, kind in kinds
                                 if kind == FULL_ATTENTION),
                           tuple(range(self.num_layers)))

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


SLIDING_ATTENTION = "sliding_attention"
GEMMA_LAYER_KINDS = (SLIDING_ATTENTION, FULL_ATTENTION)
GEMMA_ROPE_TYPES = ("default", "proportional")
_GEMMA_DEFAULT_ROPE = {SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 10_000.0},
                       FULL_ATTENTION: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 1_000_000.0}}
"""transformers' rope parameters of a Gemma 4 config that names none."""
GEMMA_FULL_HEAD_DIM = 512  # transformers' `global_head_dim` when a config names neither it nor `per_layer_config`
_GEMMA_LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")  # what a `per_layer_config` entry may set


class GemmaAttention(NamedTuple):
    """One of Gemma 4's two attention layer types: its head shape, its window (None: full attention), its rotary
    embedding (the first `rotary_pairs` of the head's head_dim // 2 channel pairs turn, pair i at
    theta^(-2i / head_dim) / rope_factor radians per position, the rest stay) and whether its values are its keys'
    projection (`attention_k_eq_v`, full layers only)."""

    head_dim: int
    kv_heads: int
    window: int | None
    rope_theta: float
    rotary_pairs: int
    rope_factor: float
    keys_are_values: bool


@dataclass(frozen=True)
class Gemma4Config:
    """Gemma 4's text decoder (`gemma4_text`, or a `gemma4` release's `text_config`); always valid (`validate`
    runs at construction). Every layer attends, sliding-window or full (`attention`, per layer type); the last
    `kv_shared_layers` layers reuse the keys and values of the last earlier layer of their type; with
    `per_layer_size` > 0 each layer adds a per-layer input (a token embedding of its own plus a projection of
    the input embedding); with `num_experts` > 0 each layer's FFN adds routed experts to its dense MLP."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    sliding: GemmaAttention
    full: GemmaAttention
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    final_logit_softcap: float | None
    per_layer_size: int = 0
    """`hidden_size_per_layer_input`: each layer's per-layer input width (0: none)."""
    per_layer_vocab: int = 0
    pad_token_id: int = 0
    """What an image's soft tokens look up in the per-layer embeddings (transformers replaces their ids by it)."""
    kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    """The KV-shared layers' MLPs are twice `intermediate_size` wide."""
    num_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def attention(self, layer: int) -> GemmaAttention:
        return self.sliding if self.layer_types[layer] == SLIDING_ATTENTION else self.full

    @property
    def first_shared_layer(self) -> int:
        return self.num_layers - self.kv_shared_layers

    def kv_source(self, layer: int) -> int:
        """The layer whose keys and values `layer` attends over: itself, or for a KV-shared layer the last layer
        of its type before the shared ones."""
        first = self.first_shared_layer
        if layer < first:
            return layer
        kind = self.layer_types[layer]
        return max(i for i in range(first) if self.layer_types[i] == kind)

    def mlp_size(self, layer: int) -> int:
        wide = self.double_wide_mlp and layer >= self.first_shared_layer
        return self.intermediate_size * (2 if wide else 1)

    def state_layout(self) -> StateLayout:
        """No recurrent layers; a checkpoint holds the keys and values of each layer that computes its own (a
        KV-shared layer reads its source's)."""
        return StateLayout(None, (), tuple(KeyValueShape(i, self.attention(i).kv_heads, self.attention(i).head_dim,
                                                         self.attention(i).window)
                                           for i in range(self.first_shared_layer)),
                           tuple(self.kv_source(i) for i in range(self.num_layers)))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError, naming the config.json field and its value, unless this is a Gemma 4 decoder the engine
        runs: positive integer sizes, known layer types ending with full attention, whole head groups, even
        head dims, rotary pairs within the head, a positive window, KV-shared layers with a source of their type,
        per-layer inputs over the whole vocabulary, a valid expert count, positive finite numbers."""
        for key, value in (("vocab_size", self.vocab_size), ("hidden_size", self.hidden_size),
                           ("intermediate_size", self.intermediate_size), ("num_attention_heads", self.num_heads),
                           ("max_position_embeddings", self.max_position_embeddings)):
            if type(value) is not int or value <= 0:
                raise ValueError(f"{key} must be a positive integer, got {_shown(value)}")
        if not self.layer_types or not set(self.layer_types) <= set(GEMMA_LAYER_KINDS):
            raise ValueError(f"layer_types must list {SLIDING_ATTENTION}/{FULL_ATTENTION} layers, got "
                             f"{_shown(list(self.layer_types))}")
        if self.layer_types[-1] != FULL_ATTENTION:
            raise ValueError(f"the last of layer_types must be {FULL_ATTENTION}, got {self.layer_types[-1]!r}")
        if self.max_position_embeddings > MAX_POSITIONS:
            raise ValueError(f"max_position_embeddings must be at most {MAX_POSITIONS:,} (the rotary tables cover "
                             f"every position), got {self.max_position_embeddings:,}")
        for kind, shape in ((SLIDING_ATTENTION, self.sliding), (FULL_ATTENTION, self.full)):
            for key, value in (("head_dim", shape.head_dim), ("num_key_value_heads", shape.kv_heads)):
                if type(value) is not int or value <= 0:
                    raise ValueError(f"{key} of the {kind} layers must be a positive integer, got {_shown(value)}")
            if shape.head_dim % 2:
                raise ValueError(f"head_dim of the {kind} layers must be even (rotary pairs), got {shape.head_dim}")
            if self.num_heads % shape.kv_heads:
                raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of the {kind} layers' "
                                 f"num_key_value_heads ({shape.kv_heads})")
            if not 0 <= shape.rotary_pairs <= shape.head_dim // 2:
                raise ValueError(f"rope_parameters.{kind}: partial_rotary_factor turns {shape.rotary_pairs} channel "
                                 f"pairs, outside [0, head_dim / 2 = {shape.head_dim // 2}]")
            for key, value in (("rope_theta", shape.rope_theta), ("factor", shape.rope_factor)):
                if not _finite(value) or value <= 0:
                    raise ValueError(f"rope_parameters.{kind}.{key} must be a positive finite number, got "
                                     f"{_shown(value)}")
        window = self.sliding.window
        if type(window) is not int or window <= 0:
            raise ValueError(f"sliding_window must be a positive integer, got {_shown(window)}")
        if not _finite(self.rms_norm_eps) or self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be a positive finite number, got {_shown(self.rms_norm_eps)}")
        cap = self.final_logit_softcap
        if cap is not None and (not _finite(cap) or cap <= 0):
            raise ValueError(f"final_logit_softcapping must be null or a positive finite number, got {_shown(cap)}")
        if type(self.tie_word_embeddings) is not bool:
            raise ValueError(f"tie_word_embeddings must be true or false, got {_shown(self.tie_word_embeddings)}")
        shared = self.kv_shared_layers
        if type(shared) is not int or not 0 <= shared < self.num_layers:
            raise ValueError(f"num_kv_shared_layers must be an integer in [0, num_hidden_layers = {self.num_layers}),"
                             f" got {_shown(shared)}")
        sources = set(self.layer_types[: self.first_shared_layer])
        for kind in set(self.layer_types[self.first_shared_layer :]) - sources:
            raise ValueError(f"num_kv_shared_layers = {shared} leaves no {kind} layer before the shared ones to take "
                             "their keys and values from")
        if self.per_layer_size:
            if type(self.per_layer_size) is not int or self.per_layer_size < 0:
                raise ValueError(f"hidden_size_per_layer_input must be a non-negative integer, got "
                                 f"{_shown(self.per_layer_size)}")
            if type(self.per_layer_vocab) is not int or self.per_layer_vocab < self.vocab_size:
                raise ValueError(f"vocab_size_per_layer_input must be an integer of at least vocab_size "
                                 f"({self.vocab_size}): every token needs a per-layer embedding, got "
                                 f"{_shown(self.per_layer_vocab)}")
        if self.is_moe:
            for key, value in (("num_experts", self.num_experts), ("top_k_experts", self.experts_per_token),
                               ("moe_intermediate_size", self.expert_size)):
                if type(value) is not int or value <= 0:
                    raise ValueError(f"{key} must be a positive integer, got {_shown(value)}")
            if self.experts_per_token > self.num_experts:
                raise ValueError(f"top_k_experts ({self.experts_per_token}) must be at most num_experts "
                                 f"({self.num_experts})")

    def check_cuda_kernels(self) -> None:
        """ValueError unless the CUDA attention kernel takes both layer types' head dims: powers of two from 16
        (its dot products' least width) to 512 (Gemma 4's full layers, the widest tiling it has); the CPU path
        takes any."""
        for name, shape in (("head_dim", self.sliding), ("global_head_dim", self.full)):
            if shape.head_dim & (shape.head_dim - 1) or not 16 <= shape.head_dim <= 512:
                raise ValueError(f"{name} must be a power of two from 16 to 512 for the CUDA attention kernel, got "
                                 f"{shape.head_dim}")

    @classmethod
    def from_text_config(cls, text: dict[str, Any], tie_word_embeddings: bool | None = None) -> Gemma4Config:
        """From a `gemma4_text` config dict (a text-only config.json, or a release's `text_config`).

        ValueError, naming the field and its value, for anything but a Gemma 4 decoder this engine runs: a
        missing or non-integer size, a value out of range (`validate`), attention biases, another activation
        than gelu_pytorch_tanh, bidirectional attention over text, a rope type other than default or
        proportional, per-layer overrides of anything but head_dim and num_key_value_heads, or layer types
        whose overrides differ."""
        if not isinstance(text, dict):
            raise TypeError(f"the config must be a JSON object, got {type(text).__name__} {_shown(text)}")
        if text.get("attention_bias", False) is not False:
            raise ValueError(f"attention_bias must be false (Gemma 4 attention has no biases), got "
                             f"{_shown(text['attention_bias'])}")
        if text.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation must be 'gelu_pytorch_tanh', got {_shown(text['hidden_activation'])}")
        if text.get("use_bidirectional_attention") not in (None, "vision"):
            raise ValueError(f"use_bidirectional_attention {_shown(text['use_bidirectional_attention'])} is not "
                             "served: text attention must stay causal (null or 'vision')")
        layers = _size(text, "num_hidden_layers")
        layer_types = text.get("layer_types")
        if layer_types is None:  # transformers' default: five sliding layers, then a full one
            layer_types = [FULL_ATTENTION if (i + 1) % 6 == 0 else SLIDING_ATTENTION for i in range(layers)]
        if not isinstance(layer_types, list) or len(layer_types) != layers or not all(
            kind in GEMMA_LAYER_KINDS for kind in layer_types
        ):
            raise ValueError(f"layer_types must list {layers} (num_hidden_layers) of {SLIDING_ATTENTION}/"
                             f"{FULL_ATTENTION}, got {_shown(layer_types)}")
        layer_types = [*layer_types[:-1], FULL_ATTENTION]  # transformers makes the last layer full attention
        heads = _size(text, "num_attention_heads")
        head_dims, kv_heads = _gemma_layer_shapes(text, layer_types)
        rope = text.get("rope_parameters") or _GEMMA_DEFAULT_ROPE
        if not isinstance(rope, dict):
            raise TypeError(f"rope_parameters must be a JSON object, got {_shown(rope)}")
        k_eq_v = text.get("attention_k_eq_v", False)
        if type(k_eq_v) is not bool:
            raise ValueError(f"attention_k_eq_v must be true or false, got {_shown(k_eq_v)}")
        window = text.get("sliding_window", 512)
        shapes = {kind: GemmaAttention(head_dims[kind], kv_heads[kind], window if kind == SLIDING_ATTENTION else None,
                                       *_gemma_rope(rope, kind, head_dims[kind]), k_eq_v and kind == FULL_ATTENTION)
                  for kind in GEMMA_LAYER_KINDS}
        moe = text.get("enable_moe_block", False)
        if type(moe) is not bool:
            raise ValueError(f"enable_moe_block must be true or false, got {_shown(moe)}")
        experts = {}
        if moe:
            experts = {"num_experts": _size(text, "num_experts"), "experts_per_token": _size(text, "top_k_experts"),
                       "expert_size": _size(text, "moe_intermediate_size")}
        double_wide = text.get("use_double_wide_mlp", False)
        if type(double_wide) is not bool:
            raise ValueError(f"use_double_wide_mlp must be true or false, got {_shown(double_wide)}")
        per_layer = text.get("hidden_size_per_layer_input") or 0
        cap = text.get("final_logit_softcapping")
        tie = text.get("tie_word_embeddings", True) if tie_word_embeddings is None else tie_word_embeddings
        return cls(
            vocab_size=_size(text, "vocab_size"),
            hidden_size=_size(text, "hidden_size"),
            intermediate_size=_size(text, "intermediate_size"),
            layer_types=tuple(layer_types),
            num_heads=heads,
            sliding=shapes[SLIDING_ATTENTION],
            full=shapes[FULL_ATTENTION],
            rms_norm_eps=_number(text.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
            tie_word_embeddings=tie,
            max_position_embeddings=_size(text, "max_position_embeddings", 131_072),
            final_logit_softcap=None if cap is None else _number(cap, "final_logit_softcapping"),
            per_layer_size=per_layer,
            per_layer_vocab=text.get("vocab_size_per_layer_input", 262_144) if per_layer else 0,
            pad_token_id=text.get("pad_token_id") or 0,
            kv_shared_layers=text.get("num_kv_shared_layers") or 0,
            double_wide_mlp=double_wide,
            **experts,
        )


def _gemma_layer_shapes(text: dict[str, Any], layer_types: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """Each layer type's head_dim and num_key_value_heads: `head_dim` / `num_key_value_heads` with the per-layer
    overrides of transformers 5.25 (`per_layer_config`: layer index -> overrides) or, without them, a release's
    `global_head_dim` (default 512) for the full layers and, where `attention_k_eq_v`, their
    `num_global_key_value_heads`. The layers of one type must agree (they share a rotary table and a pool
    layout)."""
    base = {"head_dim": _size(text, "head_dim", 256), "num_key_value_heads": _size(text, "num_key_value_heads")}
    overrides = text.get("per_layer_config")
    if overrides is None:
        full = {"head_dim": _size(text, "global_head_dim", GEMMA_FULL_HEAD_DIM)}
        if text.get("attention_k_eq_v", False) and text.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = _size(text, "num_global_key_value_heads")
        overrides = {str(i): full for i, kind in enumerate(layer_types) if kind == FULL_ATTENTION}
    if not isinstance(overrides, dict):
        raise TypeError(f"per_layer_config must be a JSON object, got {_shown(overrides)}")
    per_layer = [dict(base) for _ in layer_types]
    for index, values in overrides.items():
        if not str(index).isdigit() or int(index) >= len(layer_types) or not isinstance(values, dict):
            raise ValueError(f"per_layer_config must map layer indices below {len(layer_types)} to objects, got "
                             f"{_shown(index)}: {_shown(values)}")
        unknown = sorted(set(values) - set(_GEMMA_LAYER_OVERRIDES))
        if unknown:
            raise ValueError(f"per_layer_config.{index} overrides {unknown[0]!r}: only "
                             f"{', '.join(_GEMMA_LAYER_OVERRIDES)} are served")
        for key, value in values.items():
            per_layer[int(index)][key] = _size(values, key) if value is not None else base[key]
    shapes: dict[str, dict[str, int]] = {}
    for index, (kind, values) in enumerate(zip(layer_types, per_layer)):
        if shapes.setdefault(kind, values) != values:
            raise ValueError(f"per_layer_config: layer {index} ({kind}) has {values}, other {kind} layers "
                             f"{shapes[kind]}; the layers of one type must share their head shape")
    missing = {"head_dim": base["head_dim"], "num_key_value_heads": base["num_key_value_heads"]}
    return ({kind: shapes.get(kind, missing)["head_dim"] for kind in GEMMA_LAYER_KINDS},
            {kind: shapes.get(kind, missing)["num_key_value_heads"] for kind in GEMMA_LAYER_KINDS})


def _gemma_rope(rope: dict[str, Any], kind: str, head_dim: int) -> tuple[float, int, float]:
    """(theta, rotary pairs, factor) of a layer type's `rope_parameters` entry: default rope turns every pair;
    proportional rope the first int(partial_rotary_factor * head_dim // 2), divided by `factor`."""
    entry = rope.get(kind)
    if not isinstance(entry, dict):
        raise TypeError(f"rope_parameters.{kind} must be a JSON object, got {_shown(entry)}")
    rope_type = entry.get("rope_type", "default")
    if rope_type not in GEMMA_ROPE_TYPES:
        raise ValueError(f"rope_parameters.{kind}: unsupported rope_type {_shown(rope_type)} (default and "
                         "proportional are implemented)")
    theta = _number(entry.get("rope_theta", 10_000.0), f"rope_parameters.{kind}.rope_theta")
    if rope_type == "default":
        return theta, head_dim // 2, 1.0
    partial = _number(entry.get("partial_rotary_factor", 1.0), f"rope_parameters.{kind}.partial_rotary_factor")
    if not 0 <= partial <= 1:
        raise ValueError(f"rope_parameters.{kind}.partial_rotary_factor must be in [0, 1], got {_shown(partial)}")
    return theta, int(partial * head_dim // 2), _number(entry.get("factor", 1.0), f"rope_parameters.{kind}.factor")


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
