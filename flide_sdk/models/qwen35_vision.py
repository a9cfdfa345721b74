"""Qwen3.5's vision side: the image processor's pixels, the vision tower, and the language model's image tokens and
M-RoPE positions, as transformers computes them (`Qwen3_5ForConditionalGeneration`, `Qwen2VLImageProcessorPil`).

Pixels: the RGB image resized with Pillow (bicubic, as preprocessor_config.json says) to `smart_resize`'s size (both
sides multiples of patch x merge, the area within the processor's bounds), rescaled to [0, 1] in float64 then
float32, normalized per channel in float32, cut into patches in merge-block order, each patch repeated over the
temporal patch (a still image is two identical frames). Tower: a patch embedding (the Conv3d with stride = kernel is
one matmul per patch), learned position embeddings resampled bilinearly (corners aligned) to the image's grid,
`depth` pre-norm blocks of bidirectional attention within each image (2D rotary embedding of the patch's row and
column), then the merger: a LayerNorm per patch, each 2x2 block of patches concatenated, an MLP to the language
model's width. Images of one call are batched: every dense op runs over all their patches at once, attention image
by image. The language model sees an image as `<|vision_start|>`, one `<|image_pad|>` per merged block,
`<|vision_end|>`; its pads take the tower's rows, and their M-RoPE positions are (t, h, w) = the image's start
position + (0, row, column); the text after it starts at start + max(rows, columns).
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

from flide_sdk.errors import CheckpointError, InvalidAssetError
from flide_sdk.models.checkpoint import load_module_weights, read_raw_config, tensor_files

MAX_ASPECT_RATIO = 200  # the processor refuses images more elongated than this


@dataclass(frozen=True)
class VisionConfig:
    """The tower's hyper-parameters (config.json's `vision_config`) and the language model's vision token ids."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    rope_theta: float
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_section: tuple[int, ...]  # the language model's rotary frequencies per (t, h, w) axis (`mrope_axes`)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_config(cls, raw: dict[str, Any], source: str) -> VisionConfig | None:
        """The vision config of a release config.json (`qwen3_5` with `vision_config`), None for a text-only one;
        CheckpointError naming `source` for a value out of range or an unsupported activation."""
        vision = raw.get("vision_config")
        if vision is None:
            return None
        try:
            rope = vision.get("rope_parameters") or {}
            if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
                raise ValueError(f"hidden_act {vision['hidden_act']!r} (gelu_pytorch_tanh only)")
            if rope.get("rope_type", "axial") != "axial":
                raise ValueError(f"rope_type {rope['rope_type']!r} (axial only)")
            config = cls(
                depth=int(vision.get("depth", 27)), hidden_size=int(vision.get("hidden_size", 1152)),
                intermediate_size=int(vision.get("intermediate_size", 4304)),
                num_heads=int(vision.get("num_heads", 16)), in_channels=int(vision.get("in_channels", 3)),
                patch_size=int(vision.get("patch_size", 16)),
                temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
                spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
                out_hidden_size=int(vision.get("out_hidden_size", 3584)),
                num_position_embeddings=int(vision.get("num_position_embeddings", 2304)),
                rope_theta=float(rope.get("rope_theta", 10000.0)),
                image_token_id=int(raw.get("image_token_id", 248056)),
                vision_start_token_id=int(raw.get("vision_start_token_id", 248053)),
                vision_end_token_id=int(raw.get("vision_end_token_id", 248054)),
                mrope_section=tuple(int(x) for x in ((raw.get("text_config") or {}).get("rope_parameters") or {})
                                    .get("mrope_section", (11, 11, 10))),
            )
            if len(config.mrope_section) != 3 or min(config.mrope_section) < 0:
                raise ValueError(f"text_config.rope_parameters.mrope_section {list(config.mrope_section)}")
            sizes = (config.depth, config.hidden_size, config.intermediate_size, config.num_heads, config.in_channels,
                     config.patch_size, config.temporal_patch_size, config.spatial_merge_size,
                     config.out_hidden_size, config.num_position_embeddings)
            if min(sizes) <= 0 or config.hidden_size % config.num_heads or config.head_dim % 4:
                raise ValueError("sizes must be positive, heads must divide hidden_size into multiples of 4")
            if math.isqrt(config.num_position_embeddings) ** 2 != config.num_position_embeddings:
                raise ValueError(f"num_position_embeddings {config.num_position_embeddings} is not a square")
            if not (math.isfinite(config.rope_theta) and config.rope_theta > 0):
                raise ValueError(f"rope_theta {config.rope_theta}")
        except (AttributeError, TypeError, ValueError) as error:
            raise CheckpointError(f"{source}: vision_config: {error}") from None
        return config


@dataclass(frozen=True)
class ImageProcessing:
    """What preprocessor_config.json says of the pixels: the resize bounds and filter, rescale and normalization."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    resample: int
    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_checkpoint(cls, path: Path, vision: VisionConfig) -> ImageProcessing:
        """The checkpoint's preprocessor_config.json (CheckpointError when missing, malformed, or not matching
        the tower's patches)."""
        file = path / "preprocessor_config.json"
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
            size = raw.get("size") or {}
            processing = cls(
                patch_size=int(raw.get("patch_size", 14)), temporal_patch_size=int(raw.get("temporal_patch_size", 2)),
                merge_size=int(raw.get("merge_size", 2)),
                min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge", 56 * 56)),
                max_pixels=int(raw.get("max_pixels") or size.get("longest_edge", 28 * 28 * 1280)),
                resample=int(raw.get("resample", 3)), rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
                image_mean=tuple(float(x) for x in raw.get("image_mean", (0.48145466, 0.4578275, 0.40821073))),
                image_std=tuple(float(x) for x in raw.get("image_std", (0.26862954, 0.26130258, 0.27577711))),
            )
            for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
                if raw.get(key, True) is not True:
                    raise ValueError(f"{key} is not true")
        except (OSError, ValueError, TypeError, AttributeError) as error:
            raise CheckpointError(f"{file}: {error}") from None
        expected = (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
        got = (processing.patch_size, processing.temporal_patch_size, processing.merge_size)
        if got != expected or len(processing.image_mean) != 3 or len(processing.image_std) != 3:
            raise CheckpointError(f"{file}: patch, temporal patch and merge sizes {got} do not match the tower's "
                                  f"{expected}, or the mean / std are not per RGB channel")
        if not 0 < processing.min_pixels <= processing.max_pixels:
            raise CheckpointError(f"{file}: size bounds {processing.min_pixels}..{processing.max_pixels}")
        return processing


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The processor's target (height, width): each side a multiple of `factor` near the original, the area
    brought within [min_pixels, max_pixels] keeping the aspect ratio."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is more than {MAX_ASPECT_RATIO}")
    rows, cols = round(height / factor) * factor, round(width / factor) * factor
    if rows * cols > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        rows = max(factor, math.floor(height / scale / factor) * factor)
        cols = max(factor, math.floor(width / scale / factor) * factor)
    elif rows * cols < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        rows, cols = math.ceil(height * scale / factor) * factor, math.ceil(width * scale / factor) * factor
    return rows, cols


@dataclass(frozen=True)
class ImagePatches:
    """One image as the tower reads it: `pixels` [rows * cols, patch_dim] float32 in merge-block order, and its
    grid of patches (rows, cols), both multiples of the merge size."""

    pixels: torch.Tensor
    rows: int
    cols: int

    def tokens(self, merge: int) -> int:
        """How many `<|image_pad|>` tokens the language model sees for this image."""
        return self.rows * self.cols // (merge * merge)


def image_patches(image: Any, processing: ImageProcessing, name: str = "image") -> ImagePatches:
    """The processor's patches of an RGB PIL image (InvalidAssetError naming `name` for a too elongated one)."""
    try:
        height, width = smart_resize(image.height, image.width, processing.factor, processing.min_pixels,
                                     processing.max_pixels)
    except ValueError as error:
        raise InvalidAssetError(name, str(error)) from None
    resized = np.asarray(image.resize((width, height), resample=processing.resample), dtype=np.uint8)
    scaled = (resized.astype(np.float64) * processing.rescale_factor).astype(np.float32)
    mean = np.asarray(processing.image_mean, dtype=np.float32)
    std = np.asarray(processing.image_std, dtype=np.float32)
    normalized = torch.from_numpy((scaled - mean) / std).permute(2, 0, 1)  # [C, H, W]
    p, m, t = processing.patch_size, processing.merge_size, processing.temporal_patch_size
    rows, cols = height // p, width // p
    blocks = normalized.reshape(3, rows // m, m, p, cols // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    frames = blocks.unsqueeze(5).expand(*blocks.shape[:5], t, p, p)
    return ImagePatches(frames.reshape(rows * cols, 3 * t * p * p).contiguous(), rows, cols)


def merge_block_order(rows: int, cols: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of each patch of a rows x cols grid, in merge-block order (blocks row-major, then within)."""
    r = torch.arange(rows).view(rows // merge, merge, 1, 1).expand(-1, -1, cols // merge, merge)
    c = torch.arange(cols).view(1, 1, cols // merge, merge).expand(rows // merge, merge, -1, -1)
    return r.permute(0, 2, 1, 3).reshape(-1), c.permute(0, 2, 1, 3).reshape(-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class VisionBlock(nn.Module):
    """Pre-norm block: bidirectional attention within each image (2D rotary q/k), then a GELU-tanh MLP."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.heads = config.num_heads
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.attn.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.mlp.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.attn.qkv(self.norm1(x)).view(tokens, 3, self.heads, -1).unbind(1)  # [N, H, D] each
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        outputs = [
            F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1)).transpose(0, 1)
            for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))
        ]
        x = x + self.attn.proj(torch.cat(outputs).reshape(tokens, -1))
        return x + self.mlp.linear_fc2(F.gelu(self.mlp.linear_fc1(self.norm2(x)), approximate="tanh"))


class VisionTower(nn.Module):
    """Qwen3.5's vision model; parameter names are the checkpoint's under `model.visual.`."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Module()
        self.patch_embed.proj.weight = nn.Parameter(
            torch.empty(c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size))
        self.patch_embed.proj.bias = nn.Parameter(torch.empty(c.hidden_size))
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        merged = c.hidden_size * c.spatial_merge_size**2
        self.merger = nn.Module()
        self.merger.norm = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.merger.linear_fc1 = nn.Linear(merged, merged)
        self.merger.linear_fc2 = nn.Linear(merged, c.out_hidden_size)

    def position_embeddings(self, rows: torch.Tensor, cols: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The learned side x side table resampled bilinearly (corners aligned) to a height x width grid, at each
        patch's (row, col)."""
        side = math.isqrt(self.config.num_position_embeddings)
        table = self.pos_embed.weight

        def taps(index: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            source = index.float() * (side - 1) / max(size - 1, 1)
            low = source.floor()
            frac = source - low
            low = low.long()
            return low.clamp(max=side - 1), (low + 1).clamp(max=side - 1), frac

        r0, r1, fr = taps(rows, height)
        c0, c1, fc = taps(cols, width)
        weights = ((1 - fr) * (1 - fc), (1 - fr) * fc, fr * (1 - fc), fr * fc)
        indices = (r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1)
        return sum(table[i] * w[:, None] for i, w in zip(indices, weights))

    def forward(self, images: list[ImagePatches]) -> list[torch.Tensor]:
        """The language-model rows [tokens_i, out_hidden_size] of each image, all images in one batch."""
        c = self.config
        weight = self.patch_embed.proj.weight
        pixels = torch.cat([image.pixels for image in images]).to(weight.device, weight.dtype)
        x = F.linear(pixels, weight.view(c.hidden_size, -1), self.patch_embed.proj.bias)
        grid = [merge_block_order(image.rows, image.cols, c.spatial_merge_size) for image in images]
        positions = torch.cat([self.position_embeddings(r.to(x.device), col.to(x.device), image.rows, image.cols)
                               for (r, col), image in zip(grid, images)])
        x = x + positions.to(x.dtype)
        quarter = c.head_dim // 4
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float32, device=x.device)
                                          / (2 * quarter))
        rows = torch.cat([r for r, _ in grid]).to(x.device)
        cols = torch.cat([col for _, col in grid]).to(x.device)
        angles = torch.cat([rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]  # [N, 1, head_dim]
        cos, sin = angles.cos(), angles.sin()
        lengths = [image.rows * image.cols for image in images]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        merged = self.merger.norm(x).view(-1, c.hidden_size * c.spatial_merge_size**2)
        out = self.merger.linear_fc2(F.gelu(self.merger.linear_fc1(merged)))
        return list(out.split([n // c.spatial_merge_size**2 for n in lengths]))


def load_vision_tower(path: Path, config: VisionConfig, files: list[Path], device: torch.device | str,
                      dtype: torch.dtype) -> VisionTower:
    """The tower's weights (`model.visual.*` in the checkpoint's safetensors `files`), shapes checked as read."""
    with torch.device("meta"):
        tower = VisionTower(config)
    return load_module_weights(tower, path, files, "model.visual.", device, dtype, "vision tower")


@dataclass(frozen=True)
class ImageSpan:
    """Where an image's pads sit in a prompt: the first pad's index and the merged grid (rows, cols)."""

    start: int
    rows: int
    cols: int


def image_ids(config: VisionConfig, patches: ImagePatches) -> np.ndarray:
    """An image's tokens in a prompt: vision start, one pad per merged block, vision end."""
    pads = patches.tokens(config.spatial_merge_size)
    return np.array([config.vision_start_token_id, *([config.image_token_id] * pads), config.vision_end_token_id],
                    dtype=np.int64)


def mrope_positions(length: int, spans: list[ImageSpan]) -> np.ndarray:
    """The (t, h, w) positions [3, length] of a prompt of `length` tokens whose images' pads are at `spans` (in
    order): text advances all three by one per token; an image's pads are its start + (0, row, col), and the text
    after it starts at start + max(rows, cols)."""
    positions = np.empty((3, length), dtype=np.int64)
    offset, cursor = 0, 0  # offset: a position minus its index, for the text since the last image
    for span in spans:
        positions[:, cursor:span.start] = np.arange(cursor, span.start) + offset
        start = span.start + offset
        pads = span.rows * span.cols
        grid = np.arange(pads)
        positions[0, span.start:span.start + pads] = start
        positions[1, span.start:span.start + pads] = start + grid // span.cols
        positions[2, span.start:span.start + pads] = start + grid % span.cols
        cursor = span.start + pads
        offset = start + max(span.rows, span.cols) - cursor
    positions[:, cursor:] = np.arange(cursor, length) + offset
    return positions


def mrope_axes(rotary_dim: int, section: list[int]) -> np.ndarray:
    """Which axis (0 t, 1 h, 2 w) each rotary frequency of the language model reads, interleaved: frequency j reads
    h when j % 3 == 1 and j < 3 * section[1], w when j % 3 == 2 and j < 3 * section[2], else t."""
    index = np.arange(rotary_dim // 2)
    axes = np.zeros_like(index)
    axes[(index % 3 == 1) & (index < 3 * section[1])] = 1
    axes[(index % 3 == 2) & (index < 3 * section[2])] = 2
    return axes


@dataclass(frozen=True)
class Vision:
    """A checkpoint's vision side: the tower's config, how its pixels are made, and the tower."""

    config: VisionConfig
    processing: ImageProcessing
    tower: VisionTower


def load_vision(path: str | Path, device: torch.device | str, dtype: torch.dtype) -> Vision | None:
    """The vision side of a Qwen3.5 release checkpoint (config.json's `vision_config`, preprocessor_config.json,
    `model.visual.*`), or None for one without (a text-only layout, or no preprocessor_config.json)."""
    path = Path(path)
    raw = read_raw_config(path)
    if raw.get("model_type") not in ("qwen3_5", "qwen3_5_moe") or not (path / "preprocessor_config.json").is_file():
        return None
    config = VisionConfig.from_config(raw, str(path / "config.json"))
    if config is None:
        return None
    processing = ImageProcessing.from_checkpoint(path, config)
    return Vision(config, processing, load_vision_tower(path, config, tensor_files(path), device, dtype))
