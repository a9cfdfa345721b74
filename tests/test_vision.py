"""Qwen3.5's vision side against transformers, float32 on CPU: the processor's pixels (bit for bit), the tower's rows
for the language model, the image pads the processor expands, and the language model's M-RoPE positions and
rotary frequencies. The checkpoint is a tiny `Qwen3_5ForConditionalGeneration` with its processor
(tests/vision_checkpoint.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
from PIL import Image

from flide_sdk.errors import CheckpointError, InvalidAssetError
from flide_sdk.models.qwen35_vision import (
    ImageProcessing,
    ImageSpan,
    VisionConfig,
    image_ids,
    image_patches,
    load_vision,
    load_vision_tower,
    mrope_axes,
    mrope_positions,
    smart_resize,
)
from tests.vision_checkpoint import tiny_vl_checkpoint, tiny_vl_processor

SIZES = [(50, 70), (300, 40), (9, 9), (129, 257), (16, 16)]  # (height, width): up, down, elongated, minimum


def noise(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def checkpoint():
    path = tiny_vl_checkpoint()
    config = VisionConfig.from_config(json.loads((path / "config.json").read_text()), "config.json")
    return path, config, ImageProcessing.from_checkpoint(path, config), tiny_vl_processor(path)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(checkpoint[0]).eval()


def test_pixels_are_the_processors_bit_for_bit(checkpoint):
    # mutations: a torch bicubic resize, rescaling in float32, patches in raster order, smart_resize rounding down
    _, _, processing, processor = checkpoint
    images = [noise(h, w, seed) for seed, (h, w) in enumerate(SIZES)]
    expected = processor.image_processor(images, return_tensors="pt")
    ours = [image_patches(image, processing) for image in images]
    assert [[1, p.rows, p.cols] for p in ours] == expected["image_grid_thw"].tolist()
    assert torch.equal(torch.cat([p.pixels for p in ours]), expected["pixel_values"])


def test_smart_resize_bounds():
    assert smart_resize(50, 70, 16, 512, 12288) == (48, 64)
    assert smart_resize(9, 9, 16, 512, 12288) == (32, 32)  # scaled up to min_pixels
    rows, cols = smart_resize(4000, 3000, 16, 512, 12288)
    assert rows * cols <= 12288 and rows % 16 == 0 and cols % 16 == 0
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 201, 16, 512, 12288)


def test_elongated_images_are_typed(checkpoint):
    with pytest.raises(InvalidAssetError, match="aspect ratio") as info:
        image_patches(noise(1, 300, 0), checkpoint[2], "<strip>")
    assert info.value.name == "<strip>"


def test_tower_rows_equal_transformers(checkpoint, reference):
    # mutations: exact GELU in the blocks, align_corners=False, rotary over (col, row), one attention over all
    # images, the merger's norm after the 2x2 concatenation
    path, config, processing, processor = checkpoint
    images = [noise(h, w, seed) for seed, (h, w) in enumerate(SIZES)]
    expected = processor.image_processor(images, return_tensors="pt")
    tower = load_vision_tower(path, config, sorted(path.glob("*.safetensors")), "cpu", torch.float32)
    with torch.no_grad():
        want = reference.model.visual(expected["pixel_values"], grid_thw=expected["image_grid_thw"]).pooler_output
        patches = [image_patches(image, processing) for image in images]
        got = tower(patches)
        alone = tower(patches[1:2])[0]
    assert [len(rows) for rows in got] == [p.tokens(config.spatial_merge_size) for p in patches]
    torch.testing.assert_close(torch.cat(got), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(alone, got[1], rtol=0, atol=1e-6)  # batching does not mix images


def prompt_of(processor, images: list[Image.Image], text: str) -> dict:
    content = [{"type": "text", "text": text}] + [{"type": "image", "image": image} for image in images]
    content.append({"type": "text", "text": " done."})
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True, return_tensors="pt")


def test_image_pads_and_mrope_positions_equal_transformers(checkpoint, reference):
    # mutations: text after an image at start + max + 1, h and w swapped, pads counted before the merge
    _, config, processing, processor = checkpoint
    images = [noise(h, w, seed) for seed, (h, w) in enumerate(SIZES[:3])]
    inputs = prompt_of(processor, images, "Look:")
    ids = inputs["input_ids"][0].numpy()
    patches = [image_patches(image, processing) for image in images]
    starts = np.flatnonzero(ids == config.vision_start_token_id)
    spans = []
    for start, p in zip(starts, patches):
        block = image_ids(config, p)
        assert np.array_equal(ids[start:start + len(block)], block)
        m = config.spatial_merge_size
        spans.append(ImageSpan(int(start) + 1, p.rows // m, p.cols // m))
    want, _ = reference.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                             image_grid_thw=inputs["image_grid_thw"])
    assert np.array_equal(mrope_positions(len(ids), spans), want[:, 0].numpy())


def test_mrope_axes_are_the_language_models(checkpoint, reference):
    # mutation: sections laid out in blocks (t t h w) instead of interleaved
    rotary = reference.model.language_model.rotary_emb
    positions = torch.tensor([[[5]], [[1000]], [[2000000]]])  # t, h, w of one token
    cos, _ = rotary(torch.zeros(1, dtype=torch.float32), positions)
    half = cos.shape[-1] // 2
    axes = mrope_axes(2 * half, rotary.mrope_section)
    inv_freq = rotary.inv_freq
    expected = torch.cos(positions.view(3)[torch.from_numpy(axes)].float() * inv_freq)
    torch.testing.assert_close(cos[0, 0, :half], expected, rtol=0, atol=1e-6)
    assert set(axes.tolist()) == {0, 1, 2}


def test_bad_vision_configs_are_checkpoint_errors(checkpoint, tmp_path):
    path, config, _, _ = checkpoint
    raw = json.loads((path / "config.json").read_text())
    assert VisionConfig.from_config({k: v for k, v in raw.items() if k != "vision_config"}, "c") is None
    for change in ({"num_heads": 3}, {"num_position_embeddings": 35}, {"hidden_act": "relu"}):
        with pytest.raises(CheckpointError, match="vision_config"):
            VisionConfig.from_config({**raw, "vision_config": {**raw["vision_config"], **change}}, "c")
    preprocessor = json.loads((path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**preprocessor, "patch_size": 14}))
    with pytest.raises(CheckpointError, match="do not match"):
        ImageProcessing.from_checkpoint(tmp_path, config)
    with pytest.raises(CheckpointError, match="vision tower tensors missing"):
        load_vision_tower(tmp_path, config, [], "cpu", torch.float32)


def test_load_vision_reads_release_checkpoints_only(checkpoint, tmp_path):
    # mutation: load_vision ignoring the missing preprocessor_config.json (the tower without its pixels)
    from flide_sdk.testing import tiny_checkpoint

    path, config, processing, _ = checkpoint
    vision = load_vision(path, "cpu", torch.float32)
    assert vision is not None and vision.config == config and vision.processing == processing
    assert load_vision(tiny_checkpoint(), "cpu", torch.float32) is None  # text-only layout
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).symlink_to(path / name)
    assert load_vision(tmp_path, "cpu", torch.float32) is None
