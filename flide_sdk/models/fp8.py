"""Which weights an FP8 engine holds in float8, and how an FP8 checkpoint's weights are read.

`Engine.load(weights="fp8")`, or an FP8 checkpoint with `weights="auto"`, holds the decoder's projection matrices
(attention's q/k/v/o, the Gated DeltaNet's qkv, z and output projections, the MLPs', the routed and the shared
experts') as `kernels.fp8.Fp8Weight`: float8_e4m3fn with one float32 scale per output row, quantized from float32
after any LoRA merge. Embeddings, the language-model and decision heads, norms, the router, the shared expert's
gate, the Gated DeltaNet's a/b gate projections and conv, and Gemma's per-layer projections stay in the compute
dtype (`quantized`).

An FP8 checkpoint is transformers' fine-grained layout (`quantization_config.quant_method` "fp8", dynamic
activations): float8_e4m3fn weights with `*.weight_scale_inv` (a stacked experts tensor's `*_scale_inv`) scales
over `weight_block_size` blocks, or one scale per row ([N, 1]) or per tensor when it has no block size. Each
weight is dequantized in float32 as it is read and then held like any other weight (a block-scaled matrix is
re-quantized per row). Static activation scales, other scale formats and other methods are CheckpointErrors.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flide_sdk.errors import CheckpointError, InvalidOptionError
from flide_sdk.kernels.fp8 import FP8, Fp8Weight

WEIGHTS = ("auto", "fp8")
"""`Engine.load`'s `weights`: the checkpoint's own (FP8 for an FP8 checkpoint, else the compute dtype), or FP8."""

QUANTIZED = re.compile(
    r"layers\.\d+\.(self_attn\.[qkvo]_proj\.weight|linear_attn\.(in_proj_qkv|in_proj_z|out_proj)\.weight"
    r"|mlp\.(experts\.\d+\.|shared_expert\.)?(gate|up|down)_proj\.weight|experts\.(gate_up|down)_proj)"
)


def quantized(name: str) -> bool:
    """Whether an FP8 engine holds the decoder parameter `name` (our names, no prefix) in float8."""
    return QUANTIZED.fullmatch(name) is not None


def check_weights(weights: Any) -> None:
    if weights not in WEIGHTS:
        raise InvalidOptionError(f"weights must be one of {', '.join(map(repr, WEIGHTS))}, got {weights!r}")


@dataclass(frozen=True)
class Fp8Layout:
    """An FP8 checkpoint's layout: its weights' block size (rows, columns), or None for row or tensor scales."""

    block: tuple[int, int] | None


SERVED_FORMAT_KEYS = {"quant_method", "activation_scheme", "weight_block_size", "scale_fmt", "modules_to_not_convert",
                      "dequantize", "quantization_method"}


def read_layout(raw: dict[str, Any], config_path: Path) -> Fp8Layout | None:
    """The FP8 layout config.json's `quantization_config` describes (None: no quantization_config); a method or
    scheme this does not read is a CheckpointError naming the field."""
    config = raw.get("quantization_config")
    if config is None:
        return None
    where = f"{config_path}: quantization_config"
    if not isinstance(config, dict):
        raise CheckpointError(f"{where}: must be a JSON object, got {type(config).__name__}")
    method = config.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"{where}.quant_method {method!r}: only 'fp8' (transformers' fine-grained FP8) loads")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise CheckpointError(f"{where}.activation_scheme {scheme!r}: only 'dynamic' (activations scaled per token "
                              "as they come; static input scales are not served)")
    scale_format = config.get("scale_fmt", "float")
    if scale_format not in (None, "float"):
        raise CheckpointError(f"{where}.scale_fmt {scale_format!r}: only float32 scales ('float') are served")
    if config.get("dequantize"):
        raise CheckpointError(f"{where}.dequantize true: load the dequantized checkpoint instead")
    block = config.get("weight_block_size")
    if block is None:
        return Fp8Layout(None)
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
        raise CheckpointError(f"{where}.weight_block_size {block!r}: expected [rows, columns], positive integers")
    return Fp8Layout((block[0], block[1]))


def scale_key(key: str) -> str:
    """Where an FP8 checkpoint keeps a weight's scales: `x.weight` -> `x.weight_scale_inv`, `x.gate_up_proj` ->
    `x.gate_up_proj_scale_inv`."""
    return key + "_scale_inv"


def dequantized(values: torch.Tensor, scale_inv: torch.Tensor, layout: Fp8Layout, key: str, file: Path) -> torch.Tensor:
    """An FP8 checkpoint's weight [..., N, K] in float32: `values` times its block's (row's, tensor's) scale."""
    wide, scale = values.float(), scale_inv.float()
    rows, cols = wide.shape[-2:]
    lead = tuple(wide.shape[:-2])
    if layout.block is not None:
        block_rows, block_cols = layout.block
        expected = (*lead, math.ceil(rows / block_rows), math.ceil(cols / block_cols))
        if tuple(scale.shape) != expected:
            raise CheckpointError(f"{file}: {scale_key(key)} has shape {tuple(scale.shape)}, expected {expected} "
                                  f"(blocks of {list(layout.block)} over {key} {tuple(wide.shape)})")
        full = scale.repeat_interleave(block_rows, dim=-2)[..., :rows, :]
        return wide * full.repeat_interleave(block_cols, dim=-1)[..., :cols]
    if tuple(scale.shape) in ((*lead, rows, 1), (*lead, rows)):
        return wide * scale.reshape(*lead, rows, 1)
    if scale.numel() == 1:
        return wide * scale.reshape(())
    raise CheckpointError(f"{file}: {scale_key(key)} has shape {tuple(scale.shape)}: with no weight_block_size a "
                          f"scale is one per row {(*lead, rows, 1)} or one per tensor")


def hold(module: nn.Module, name: str, weight: Fp8Weight) -> None:
    """`module.<name>` becomes `weight` (what the forward passes to the ops); its values and scales stay registered as
    buffers `<name>_fp8` and `<name>_scale`, so the state dict (and the engine's weight bytes) count them."""
    if isinstance(getattr(module, name, None), nn.Parameter):
        delattr(module, name)
    module.register_buffer(name + "_fp8", weight.values)
    module.register_buffer(name + "_scale", weight.scale)
    setattr(module, name, weight)


def attach(model: nn.Module, scales: dict[str, torch.Tensor]) -> None:
    """After the state dict is loaded with float8 values under the quantized names: each such parameter becomes an
    `Fp8Weight` of its values and `scales[name]`."""
    for name, scale in scales.items():
        owner, _, attribute = name.rpartition(".")
        module = model.get_submodule(owner)
        hold(module, attribute, Fp8Weight(getattr(module, attribute).detach(), scale))


def holds_fp8(model: nn.Module) -> bool:
    """Whether `model`'s projections are FP8."""
    return any(buffer.dtype == FP8 for buffer in model.buffers())
