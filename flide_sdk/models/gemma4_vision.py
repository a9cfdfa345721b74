"""Gemma 4's vision side: the image processor's pixels, the vision tower with its projection into the language
model, the image's tokens and the spans its soft tokens attend within both ways, as transformers computes them
(`Gemma4ForConditionalGeneration`, `Gemma4ImageProcessorPil`, `Gemma4Processor`).

Pixels: the RGB image resized with Pillow (bicubic, as the processor config says) to the largest size keeping the
aspect ratio whose sides are multiples of patch x pooling and whose patches fit `max_soft_tokens` x pooling^2
(unchanged when already that size), rescaled to [0, 1] in float64 then float32, cut into patches in raster order
(each patch's pixels row-major, channels last). No normalization: the tower maps [0, 1] to [-1, 1] itself. Tower: a
linear patch embedding plus learned x and y position embeddings, `num_hidden_layers` blocks (RMSNorms of scale w
around attention and MLP; bidirectional attention within each image, q/k RMSNorm, a scale-free value norm, scores
scaled by 1, 2D rotary embedding: the first half of each head turned by the patch's column, the second by its row;
a GELU-tanh gated MLP; linears optionally clamped in and out), then each k x k block of patches averaged, times
sqrt(hidden) and optionally standardized, in float32. The embedder projects each pooled row (a scale-free RMSNorm,
a linear) to the language model's width. Images of one call are batched: every dense op runs over all their patches
at once, attention and pooling image by image. The language model sees an image as boi, one image token per pooled
row (its embedding is that row, not scaled), eoi; where the text config says `use_bidirectional_attention:
"vision"`, the sliding layers let each image's soft tokens see each other both ways (full layers stay causal).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from flide_sdk.errors import CheckpointError
from flide_sdk.models.checkpoint import load_module_weights, read_raw_config, tensor_files

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # the processor's allowed max_soft_tokens


@dataclass(frozen=True)
class GemmaVisionConfig:
    """The tower's hyper-parameters (config.json's `vision_config`), the language model's width and image token
    ids, and whether its sliding layers let an image's soft tokens attend both ways."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    head_dim: int
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    rope_theta: float
    rms_norm_eps: float
    standardize: bool
    clipped_linears: bool
    text_hidden_size: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    bidirectional: bool

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size**2

    @classmethod
    def from_config(cls, raw: dict[str, Any], source: str) -> GemmaVisionConfig | None:
        """The vision config of a `gemma4` release config.json, None for one without a vision tower; CheckpointError
        naming `source` for a value out of range or a variant not served."""
        vision = raw.get("vision_config")
        if vision is None:
            return None
        try:
            text = raw["text_config"]
            rope = vision.get("rope_parameters") or {}
            if vision.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
                raise ValueError(f"hidden_activation {vision['hidden_activation']!r} (gelu_pytorch_tanh only)")
            if rope.get("rope_type", "default") not in ("default", "axial"):
                raise ValueError(f"rope_type {rope['rope_type']!r} (axial only)")
            heads = int(vision.get("num_attention_heads", 12))
            if int(vision.get("num_key_value_heads", heads)) != heads:
                raise ValueError("num_key_value_heads differs from num_attention_heads (grouped heads not served)")
            mode = text.get("use_bidirectional_attention")
            if mode not in (None, "vision"):
                raise ValueError(f"text_config.use_bidirectional_attention {mode!r} (None or 'vision' only)")
            config = cls(
                num_layers=int(vision.get("num_hidden_layers", 16)), hidden_size=int(vision.get("hidden_size", 768)),
                intermediate_size=int(vision.get("intermediate_size", 3072)), num_heads=heads,
                head_dim=int(vision.get("head_dim", 64)), patch_size=int(vision.get("patch_size", 16)),
                pooling_kernel_size=int(vision.get("pooling_kernel_size", 3)),
                position_embedding_size=int(vision.get("position_embedding_size", 10240)),
                rope_theta=float(rope.get("rope_theta", 100.0)), rms_norm_eps=float(vision.get("rms_norm_eps", 1e-6)),
                standardize=bool(vision.get("standardize", False)),
                clipped_linears=bool(vision.get("use_clipped_linears", False)),
                text_hidden_size=int(text["hidden_size"]), image_token_id=int(raw.get("image_token_id", 258880)),
                boi_token_id=int(raw.get("boi_token_id", 255999)), eoi_token_id=int(raw.get("eoi_token_id", 258882)),
                bidirectional=mode == "vision",
            )
            sizes = (config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads,
                     config.head_dim, config.patch_size, config.pooling_kernel_size, config.position_embedding_size,
                     config.text_hidden_size)
            if min(sizes) <= 0 or config.head_dim % 4:
                raise ValueError("sizes must be positive and head_dim a multiple of 4 (two rotated halves)")
            if not (math.isfinite(config.rope_theta) and config.rope_theta > 0 and config.rms_norm_eps > 0):
                raise ValueError(f"rope_theta {config.rope_theta}, rms_norm_eps {config.rms_norm_eps}")
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise CheckpointError(f"{source}: vision_config: {error}") from None
        return config


@dataclass(frozen=True)
class GemmaImageProcessing:
    """What the image processor's config says of the pixels: patch size, soft-token budget, pooling, the resize
    filter and the rescale factor."""

    patch_size: int
    max_soft_tokens: int
    pooling_kernel_size: int
    resample: int
    rescale_factor: float

    @property
    def side(self) -> int:
        """Both sides of a resized image are multiples of this many pixels."""
        return self.patch_size * self.pooling_kernel_size

    @classmethod
    def from_checkpoint(cls, path: Path, vision: GemmaVisionConfig) -> GemmaImageProcessing | None:
        """The image processor's config as transformers finds it (processor_config.json's `image_processor`, else
        preprocessor_config.json), None when there is neither; CheckpointError when malformed, not served (a
        normalization) or not matching the tower's patches."""
        nested, flat = path / "processor_config.json", path / "preprocessor_config.json"
        file = nested if nested.is_file() else flat
        try:
            raw = json.loads(nested.read_text(encoding="utf-8")).get("image_processor") if nested.is_file() else None
            if raw is None:
                file = flat
                if not flat.is_file():
                    return None
                raw = json.loads(flat.read_text(encoding="utf-8"))
            processing = cls(
                patch_size=int(raw.get("patch_size", 16)), max_soft_tokens=int(raw.get("max_soft_tokens", 280)),
                pooling_kernel_size=int(raw.get("pooling_kernel_size", 3)), resample=int(raw.get("resample", 3)),
                rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
            )
            for key in ("do_resize", "do_rescale", "do_convert_rgb"):
                if raw.get(key, True) is not True:
                    raise ValueError(f"{key} is not true")
            if raw.get("do_normalize", False) is not False:
                raise ValueError("do_normalize is not false (Gemma 4 normalizes in the tower)")
            if processing.max_soft_tokens not in SOFT_TOKEN_BUDGETS:
                raise ValueError(f"max_soft_tokens {processing.max_soft_tokens} (one of {SOFT_TOKEN_BUDGETS})")
        except (OSError, ValueError, TypeError, AttributeError) as error:
            raise CheckpointError(f"{file}: {error}") from None
        got = (processing.patch_size, processing.pooling_kernel_size)
        if got != (vision.patch_size, vision.pooling_kernel_size):
            raise CheckpointError(f"{file}: patch and pooling sizes {got} do not match the tower's "
                                  f"{(vision.patch_size, vision.pooling_kernel_size)}")
        if processing.max_soft_tokens * processing.pooling_kernel_size > vision.position_embedding_size:
            raise CheckpointError(f"{file}: max_soft_tokens {processing.max_soft_tokens} makes images longer than "
                                  f"the tower's {vision.position_embedding_size} positions")
        return processing


def target_size(height: int, width: int, processing: GemmaImageProcessing) -> tuple[int, int]:
    """The processor's (height, width): the largest keeping the aspect ratio with both sides multiples of
    `processing.side` and at most max_soft_tokens x pooling^2 patches; a side rounding to zero (a strip) becomes one
    multiple and the other its ratio's floor, capped. (Both cannot: the budget is at least pooling^2 patches.)"""
    side, k = processing.side, processing.pooling_kernel_size
    max_patches = processing.max_soft_tokens * k * k
    factor = math.sqrt(max_patches * processing.patch_size**2 / (height * width))
    rows, cols = math.floor(factor * height / side) * side, math.floor(factor * width / side) * side
    longest = processing.max_soft_tokens * side  # a side of max_soft_tokens pooled rows
    if rows == 0:
        rows, cols = side, min(width // height * side, longest)
    elif cols == 0:
        rows, cols = min(height // width * side, longest), side
    return rows, cols


@dataclass(frozen=True)
class GemmaImagePatches:
    """One image as the tower reads it: `pixels` [rows * cols, 3 * patch^2] float32 in raster order, and its grid
    of patches (rows, cols), both multiples of the pooling kernel."""

    pixels: torch.Tensor
    rows: int
    cols: int

    def soft_tokens(self, pooling: int) -> int:
        """How many image tokens the language model sees for this image."""
        return self.rows * self.cols // (pooling * pooling)


def gemma_image_patches(image: Any, processing: GemmaImageProcessing) -> GemmaImagePatches:
    """The processor's patches of an RGB PIL image (any size: a strip becomes one pooled row or column)."""
    height, width = target_size(image.height, image.width, processing)
    if (height, width) != (image.height, image.width):
        image = image.resize((width, height), resample=processing.resample)
    scaled = (np.asarray(image, dtype=np.uint8).astype(np.float64) * processing.rescale_factor).astype(np.float32)
    p = processing.patch_size
    rows, cols = height // p, width // p
    patches = torch.from_numpy(scaled).reshape(rows, p, cols, p, 3).permute(0, 2, 1, 3, 4)
    return GemmaImagePatches(patches.reshape(rows * cols, 3 * p * p).contiguous(), rows, cols)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / rms(x) in float32, times `weight` (not 1 + weight) when given, in x's dtype."""
    y = x.float()
    y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (y if weight is None else y * weight.float()).type_as(x)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding applied to each half of the head on its own (the first half by the column's angles, the
    second by the row's; `cos` / `sin` [N, 1, head_dim] hold both)."""
    parts = []
    for xi, ci, si in zip(x.chunk(2, -1), cos.chunk(2, -1), sin.chunk(2, -1)):
        first, second = xi.chunk(2, -1)
        parts.append(xi * ci + torch.cat([-second, first], dim=-1) * si)
    return torch.cat(parts, dim=-1)


class ClippableLinear(nn.Module):
    """A bias-free linear, its input and output clamped to learned bounds when the config says so."""

    def __init__(self, config: GemmaVisionConfig, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.clipped = config.clipped_linears
        if self.clipped:
            for bound in ("input_min", "input_max", "output_min", "output_max"):
                self.register_buffer(bound, torch.empty(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        return self.linear(x.clamp(self.input_min, self.input_max)).clamp(self.output_min, self.output_max)


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class VisionLayer(nn.Module):
    """Norm-sandwiched attention within each image, then a norm-sandwiched GELU-tanh gated MLP."""

    def __init__(self, config: GemmaVisionConfig) -> None:
        super().__init__()
        c, eps, width = config, config.rms_norm_eps, config.num_heads * config.head_dim
        self.heads, self.eps = c.num_heads, eps
        self.input_layernorm = Norm(c.hidden_size, eps)
        self.post_attention_layernorm = Norm(c.hidden_size, eps)
        self.pre_feedforward_layernorm = Norm(c.hidden_size, eps)
        self.post_feedforward_layernorm = Norm(c.hidden_size, eps)
        self.self_attn = nn.Module()
        for name, (inputs, outputs) in {"q_proj": (c.hidden_size, width), "k_proj": (c.hidden_size, width),
                                        "v_proj": (c.hidden_size, width), "o_proj": (width, c.hidden_size)}.items():
            setattr(self.self_attn, name, ClippableLinear(c, inputs, outputs))
        self.self_attn.q_norm = Norm(c.head_dim, eps)
        self.self_attn.k_norm = Norm(c.head_dim, eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = ClippableLinear(c, c.hidden_size, c.intermediate_size)
        self.mlp.up_proj = ClippableLinear(c, c.hidden_size, c.intermediate_size)
        self.mlp.down_proj = ClippableLinear(c, c.intermediate_size, c.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        attn, tokens = self.self_attn, x.shape[0]
        h = self.input_layernorm(x)
        q = rotate_halves(attn.q_norm(attn.q_proj(h).view(tokens, self.heads, -1)), cos, sin)
        k = rotate_halves(attn.k_norm(attn.k_proj(h).view(tokens, self.heads, -1)), cos, sin)
        v = rms_norm(attn.v_proj(h).view(tokens, self.heads, -1), None, self.eps)
        outputs = [
            F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1),
                                           scale=1.0).transpose(0, 1)
            for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))
        ]
        x = x + self.post_attention_layernorm(attn.o_proj(torch.cat(outputs).reshape(tokens, -1)))
        h = self.pre_feedforward_layernorm(x)
        h = self.mlp.down_proj(F.gelu(self.mlp.gate_proj(h), approximate="tanh") * self.mlp.up_proj(h))
        return x + self.post_feedforward_layernorm(h)


class GemmaVisionTower(nn.Module):
    """Gemma 4's vision model and its embedder into the language model; parameter names are the checkpoint's
    under `model.` (`vision_tower.*`, `embed_vision.*`)."""

    def __init__(self, config: GemmaVisionConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.vision_tower = nn.Module()
        self.vision_tower.patch_embedder = nn.Module()
        self.vision_tower.patch_embedder.input_proj = nn.Linear(c.patch_dim, c.hidden_size, bias=False)
        self.vision_tower.patch_embedder.position_embedding_table = nn.Parameter(
            torch.empty(2, c.position_embedding_size, c.hidden_size))
        self.vision_tower.encoder = nn.Module()
        self.vision_tower.encoder.layers = nn.ModuleList(VisionLayer(c) for _ in range(c.num_layers))
        if c.standardize:
            self.vision_tower.register_buffer("std_bias", torch.empty(c.hidden_size))
            self.vision_tower.register_buffer("std_scale", torch.empty(c.hidden_size))
        self.embed_vision = nn.Module()
        self.embed_vision.embedding_projection = nn.Linear(c.hidden_size, c.text_hidden_size, bias=False)

    def forward(self, images: list[GemmaImagePatches]) -> list[torch.Tensor]:
        """The language-model rows [soft_tokens_i, text_hidden_size] of each image, all images in one batch."""
        c, tower = self.config, self.vision_tower
        weight = tower.patch_embedder.input_proj.weight
        pixels = torch.cat([image.pixels for image in images]).to(weight.device)
        x = F.linear((2 * (pixels - 0.5)).to(weight.dtype), weight)
        grid = [torch.meshgrid(torch.arange(image.rows), torch.arange(image.cols), indexing="ij") for image in images]
        rows = torch.cat([r.reshape(-1) for r, _ in grid]).to(x.device)
        cols = torch.cat([col.reshape(-1) for _, col in grid]).to(x.device)
        table = tower.patch_embedder.position_embedding_table
        x = x + (table[0][cols] + table[1][rows])
        quarter = c.head_dim // 4
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float32, device=x.device)
                                          / (2 * quarter))
        col_angles, row_angles = cols[:, None].float() * inv_freq, rows[:, None].float() * inv_freq
        angles = torch.cat([col_angles, col_angles, row_angles, row_angles], dim=-1)[:, None, :]  # [N, 1, head_dim]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        lengths = [image.rows * image.cols for image in images]
        for layer in tower.encoder.layers:
            x = layer(x, cos, sin, lengths)
        k = c.pooling_kernel_size
        pooled = torch.cat([
            xi.float().view(image.rows // k, k, image.cols // k, k, -1).mean(dim=(1, 3)).reshape(-1, c.hidden_size)
            for xi, image in zip(x.split(lengths), images)
        ]).to(x.dtype).float() * c.hidden_size**0.5
        if c.standardize:
            pooled = (pooled - tower.std_bias.float()) * tower.std_scale.float()
        out = self.embed_vision.embedding_projection(rms_norm(pooled.to(x.dtype), None, c.rms_norm_eps))
        return list(out.split([image.soft_tokens(k) for image in images]))


def load_gemma_vision_tower(path: Path, config: GemmaVisionConfig, files: list[Path], device: torch.device | str,
                            dtype: torch.dtype) -> GemmaVisionTower:
    """The tower's and embedder's weights (`model.vision_tower.*`, `model.embed_vision.*` in the checkpoint's
    safetensors `files`), shapes checked as read."""
    with torch.device("meta"):
        tower = GemmaVisionTower(config)
    return load_module_weights(tower, path, files, "model.", device, dtype, "vision tower")


def gemma_image_ids(config: GemmaVisionConfig, patches: GemmaImagePatches) -> np.ndarray:
    """An image's tokens in a prompt, as the processor expands its image token: boi, one image token per soft
    token, eoi."""
    soft = patches.soft_tokens(config.pooling_kernel_size)
    return np.array([config.boi_token_id, *([config.image_token_id] * soft), config.eoi_token_id], dtype=np.int64)


@dataclass(frozen=True)
class SoftTokenSpan:
    """One image's soft tokens in a prompt: `start` (index of the first) and `length`. With `bidirectional` on, a
    sliding layer lets every token of the span attend to every other (still within the window); elsewhere the
    attention is causal."""

    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


def soft_token_spans(ids: np.ndarray, config: GemmaVisionConfig) -> list[SoftTokenSpan]:
    """The spans of a prompt's images, in order: each maximal run of image tokens (boi and eoi outside it)."""
    is_image = np.concatenate([[False], np.asarray(ids) == config.image_token_id, [False]])
    edges = np.flatnonzero(is_image[1:] != is_image[:-1])
    return [SoftTokenSpan(int(start), int(end - start)) for start, end in zip(edges[::2], edges[1::2])]


@dataclass(frozen=True)
class GemmaVision:
    """A checkpoint's vision side: the tower's config, how its pixels are made, and the tower with its embedder."""

    config: GemmaVisionConfig
    processing: GemmaImageProcessing
    tower: GemmaVisionTower


def load_gemma_vision(path: str | Path, device: torch.device | str, dtype: torch.dtype) -> GemmaVision | None:
    """The vision side of a Gemma 4 release checkpoint (config.json's `vision_config`, the image processor's
    config, `model.vision_tower.*` and `model.embed_vision.*`), or None for one without (not `gemma4`, no vision
    tower, or no image processor config)."""
    path = Path(path)
    raw = read_raw_config(path)
    if raw.get("model_type") != "gemma4":
        return None
    config = GemmaVisionConfig.from_config(raw, str(path / "config.json"))
    if config is None:
        return None
    processing = GemmaImageProcessing.from_checkpoint(path, config)
    if processing is None:
        return None
    return GemmaVision(config, processing, load_gemma_vision_tower(path, config, tensor_files(path), device, dtype))
