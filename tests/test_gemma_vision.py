"""Gemma 4's vision side against transformers, float32 on CPU: the image processor's pixels (bit for bit), the tower's
rows for the language model (tower, pooling, standardization, embedder), the image tokens the processor expands, and
the attention the language model gives them (each image's soft tokens both ways on sliding layers). The checkpoint
is a tiny `Gemma4ForConditionalGeneration` with its image processor (tests/gemma_vision_checkpoint.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
from PIL import Image

from flide_sdk.errors import CheckpointError
from flide_sdk.models.gemma4_vision import (
    GemmaImageProcessing,
    GemmaVisionConfig,
    SoftTokenSpan,
    gemma_image_ids,
    gemma_image_patches,
    load_gemma_vision,
    load_gemma_vision_tower,
    soft_token_spans,
    target_size,
)
from tests.gemma_vision_checkpoint import gemma_vision_checkpoint, gemma_vision_processor

# (height, width): up, down and elongated, tiny, both resized, already the target (kept as is), a strip
SIZES = [(50, 70), (300, 40), (9, 9), (129, 257), (96, 96), (5, 400)]


def noise(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def checkpoint():
    path = gemma_vision_checkpoint()
    config = GemmaVisionConfig.from_config(json.loads((path / "config.json").read_text()), "config.json")
    return path, config, GemmaImageProcessing.from_checkpoint(path, config), gemma_vision_processor(path)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return transformers.Gemma4ForConditionalGeneration.from_pretrained(checkpoint[0]).eval()


def test_pixels_are_the_processors_bit_for_bit(checkpoint):
    # mutations: rescaling in float32, channels first within a patch, target sides rounded instead of floored,
    # a strip's long side not capped
    _, _, processing, processor = checkpoint
    images = [noise(h, w, seed) for seed, (h, w) in enumerate(SIZES)]
    expected = processor.image_processor(images, return_tensors="pt")
    ours = [gemma_image_patches(image, processing) for image in images]
    for patches, pixels, positions in zip(ours, expected["pixel_values"], expected["image_position_ids"]):
        count = patches.rows * patches.cols
        rows, cols = torch.meshgrid(torch.arange(patches.rows), torch.arange(patches.cols), indexing="ij")
        assert torch.equal(positions[:count], torch.stack([cols.reshape(-1), rows.reshape(-1)], dim=-1))
        assert (positions[count:] == -1).all()
        assert torch.equal(patches.pixels, pixels[:count])
    assert (ours[4].rows, ours[4].cols) == (24, 24)  # 96 x 96 is its own target
    assert (ours[5].rows, ours[5].cols) == (3, 210)  # the strip: one pooled row of max_soft_tokens


def test_target_sizes_fill_the_budget(checkpoint):
    processing = checkpoint[2]
    for height, width in [(50, 70), (4000, 3000), (1, 10000), (10000, 1), (12, 12)]:
        rows, cols = target_size(height, width, processing)
        assert rows % 12 == 0 and cols % 12 == 0 and 0 < rows * cols <= 70 * 9 * 16
    assert target_size(1, 10000, processing) == (12, 840) and target_size(10000, 1, processing) == (840, 12)


def test_tower_rows_equal_transformers(checkpoint, reference):
    # mutations: the rotary halves turned by (row, column), exact GELU, scores scaled by 1/sqrt(head_dim), the
    # clamps left out, standardization left out, pooled rows column-major, the embedder's norm left out
    path, config, processing, processor = checkpoint
    images = [noise(h, w, seed) for seed, (h, w) in enumerate(SIZES)]
    expected = processor.image_processor(images, return_tensors="pt")
    tower = load_gemma_vision_tower(path, config, sorted(path.glob("*.safetensors")), "cpu", torch.float32)
    with torch.no_grad():
        want = reference.model.get_image_features(expected["pixel_values"], expected["image_position_ids"])
        patches = [gemma_image_patches(image, processing) for image in images]
        got = tower(patches)
        alone = tower(patches[1:2])[0]
    assert [len(rows) for rows in got] == [p.soft_tokens(config.pooling_kernel_size) for p in patches]
    for ours, theirs in zip(got, want.pooler_output):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    torch.testing.assert_close(alone, got[1], rtol=0, atol=1e-6)  # batching does not mix images


def prompt_of(processor, images: list[Image.Image]) -> dict:
    text = "Look: " + " and ".join(["<|image|>"] * len(images)) + " done."
    return processor(text=[text], images=[images], return_tensors="pt")


def test_image_ids_and_soft_token_spans_equal_the_processors(checkpoint):
    # mutations: boi and eoi inside the span, the soft tokens counted before pooling, spans of an image's boi
    _, config, processing, processor = checkpoint
    images = [noise(h, w, seed) for seed, (h, w) in enumerate(SIZES[:3])]
    inputs = prompt_of(processor, images)
    ids = inputs["input_ids"][0].numpy()
    starts = np.flatnonzero(ids == config.boi_token_id)
    assert len(starts) == len(images)
    spans = soft_token_spans(ids, config)
    for start, image, span in zip(starts, images, spans):
        block = gemma_image_ids(config, gemma_image_patches(image, processing))
        assert np.array_equal(ids[start:start + len(block)], block)
        assert span == SoftTokenSpan(int(start) + 1, len(block) - 2)
    groups = transformers.models.gemma4.modeling_gemma4.get_block_sequence_ids_for_mask(
        inputs["mm_token_type_ids"], "cpu")[0].numpy()
    assert [(int(np.flatnonzero(groups == g)[0]), int((groups == g).sum())) for g in range(len(images))] == [
        (span.start, span.length) for span in spans]


def test_soft_tokens_attend_both_ways_on_sliding_layers_only(checkpoint, reference):
    # The rule the engine implements, checked against transformers' masks for a prompt with three images:
    # sliding layers: within the window and (causal or the same image's soft tokens); full layers: causal.
    # mutations: full layers bidirectional too, the window not applied to the span's keys, boi in the span
    _, config, _, processor = checkpoint
    images = [noise(h, w, seed) for seed, (h, w) in enumerate(SIZES[:3])]
    inputs = prompt_of(processor, images)
    ids = inputs["input_ids"][0].numpy()
    text_config = reference.config.get_text_config()
    text_config._attn_implementation = "eager"
    embeds = torch.zeros(1, len(ids), text_config.hidden_size)
    block_ids = transformers.models.gemma4.modeling_gemma4.get_block_sequence_ids_for_mask(
        inputs["mm_token_type_ids"], "cpu")
    masks = transformers.models.gemma4.modeling_gemma4.create_masks_for_vision_model(
        text_config, embeds, None, None, torch.arange(len(ids))[None], block_ids)
    query, key = np.arange(len(ids))[:, None], np.arange(len(ids))[None, :]
    image = np.full(len(ids), -1)
    for index, span in enumerate(soft_token_spans(ids, config)):
        image[span.start:span.end] = index
    same_image = (image[:, None] == image[None, :]) & (image[:, None] >= 0)
    window = text_config.sliding_window
    sliding = ((key <= query) | same_image) & (key > query - window)
    assert config.bidirectional and same_image.sum() > len(ids) and (same_image & (key > query)).any()
    assert np.array_equal(masks["sliding_attention"][0, 0].numpy() == 0, sliding)
    assert np.array_equal(masks["full_attention"][0, 0].numpy() == 0, key <= query)


def test_bad_vision_configs_are_checkpoint_errors(checkpoint, tmp_path):
    path, config, _, _ = checkpoint
    raw = json.loads((path / "config.json").read_text())
    assert GemmaVisionConfig.from_config({k: v for k, v in raw.items() if k != "vision_config"}, "c") is None
    for change in ({"num_key_value_heads": 1}, {"hidden_activation": "relu"}, {"head_dim": 6},
                   {"rope_parameters": {"rope_type": "linear", "rope_theta": 100.0}}, {"patch_size": 0}):
        with pytest.raises(CheckpointError, match="vision_config"):
            GemmaVisionConfig.from_config({**raw, "vision_config": {**raw["vision_config"], **change}}, "c")
    for mode in ("all", True):
        with pytest.raises(CheckpointError, match="use_bidirectional_attention"):
            GemmaVisionConfig.from_config({**raw, "text_config": {**raw["text_config"],
                                                                  "use_bidirectional_attention": mode}}, "c")
    preprocessor = json.loads((path / "preprocessor_config.json").read_text())
    for change, message in (({"patch_size": 16}, "do not match"), ({"do_normalize": True}, "do_normalize"),
                            ({"max_soft_tokens": 100}, "max_soft_tokens"), ({"do_rescale": False}, "do_rescale")):
        (tmp_path / "preprocessor_config.json").write_text(json.dumps({**preprocessor, **change}))
        with pytest.raises(CheckpointError, match=message):
            GemmaImageProcessing.from_checkpoint(tmp_path, config)
    with pytest.raises(CheckpointError, match="vision tower tensors missing"):
        load_gemma_vision_tower(tmp_path, config, [], "cpu", torch.float32)
    small = GemmaVisionConfig.from_config(
        {**raw, "vision_config": {**raw["vision_config"], "position_embedding_size": 200}}, "c")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    with pytest.raises(CheckpointError, match="positions"):  # a 70-token strip is 210 patches long
        GemmaImageProcessing.from_checkpoint(tmp_path, small)


def test_load_gemma_vision_reads_release_checkpoints_only(checkpoint, tmp_path):
    # mutations: load_gemma_vision ignoring a missing image processor config, preprocessor_config.json read before
    # processor_config.json's image_processor (transformers' order)
    path, config, processing, _ = checkpoint
    vision = load_gemma_vision(path, "cpu", torch.float32)
    assert vision is not None and vision.config == config and vision.processing == processing
    raw = json.loads((path / "config.json").read_text())
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({**raw["text_config"], "model_type": "gemma4_text"}))
    assert load_gemma_vision(tmp_path, "cpu", torch.float32) is None  # a text-only layout
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_gemma_vision(tmp_path, "cpu", torch.float32) is None  # no image processor config
    shutil.copy(path / "preprocessor_config.json", tmp_path)
    preprocessor = json.loads((path / "preprocessor_config.json").read_text())
    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"image_processor": {**preprocessor, "resample": 2}, "image_seq_length": 70}))
    vision = load_gemma_vision(tmp_path, "cpu", torch.float32)
    assert vision is not None and vision.processing.resample == 2


def test_release_vision_configs_are_read():
    # E2B/E4B: clipped linears, no standardization, image tokens causal; 26B-A4B/31B: standardized, image tokens both
    # ways on sliding layers; 12B (gemma4_unified, no ViT trunk) is not this tower. Mutation caught: the text
    # config's use_bidirectional_attention ignored.
    data = Path("/work/shared/data/configs")
    if not (data / "Gemma-4-E2B.json").is_file():
        pytest.skip("no release configs here")
    seen = {}
    for name in ("E2B", "E4B", "26B-A4B", "31B"):
        config = GemmaVisionConfig.from_config(json.loads((data / f"Gemma-4-{name}.json").read_text()), name)
        assert (config.patch_size, config.pooling_kernel_size, config.rope_theta) == (16, 3, 100.0)
        assert (config.boi_token_id, config.image_token_id, config.eoi_token_id) == (255999, 258880, 258882)
        seen[name] = (config.hidden_size, config.num_layers, config.clipped_linears, config.standardize,
                      config.bidirectional, config.text_hidden_size)
    assert seen == {"E2B": (768, 16, True, False, False, 1536), "E4B": (768, 16, True, False, False, 2560),
                    "26B-A4B": (1152, 27, False, True, True, 2816), "31B": (1152, 27, False, True, True, 5376)}
    assert json.loads((data / "Gemma-4-12B.json").read_text())["model_type"] == "gemma4_unified"


def test_a_malformed_processor_config_is_named(checkpoint, tmp_path):
    # mutation: the error naming preprocessor_config.json while processor_config.json is the one read
    (tmp_path / "processor_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"/processor_config.json: "):
        GemmaImageProcessing.from_checkpoint(tmp_path, checkpoint[1])
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"do_normalize": True}}))
    with pytest.raises(CheckpointError, match=r"/processor_config.json: do_normalize"):
        GemmaImageProcessing.from_checkpoint(tmp_path, checkpoint[1])
