"""Images in a round's stream (issue 63, step 3, the device side): a round whose trunk holds images, with its
questions forking after them and a text-only request beside it, reads as transformers'
`Qwen3_5ForConditionalGeneration` reads each whole prompt (float32 CPU), given the tower's rows at the image pads
and the M-RoPE positions of `plan.images`. The engine, sessions and prompt formats do not pass images yet
(docs/decisions/images-in-rounds.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")

from flide_sdk.engine import Engine
from flide_sdk.models.ops import ops_for
from flide_sdk.models.qwen35_vision import (
    ImageSpan,
    image_patches,
    load_vision,
    mrope_axes,
    mrope_positions,
)
from flide_sdk.plan.images import TrunkImages, stream_positions
from flide_sdk.plan.layout import RequestSpec, RoundImages, plan_round
from tests.test_vision import noise, prompt_of
from tests.vision_checkpoint import tiny_vl_checkpoint, tiny_vl_processor

LABELS = [5, 9, 17]


@pytest.fixture(scope="module")
def served():
    path = tiny_vl_checkpoint()
    engine = Engine.load(path, device="cpu", graphs=False)
    reference = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(path).eval()
    yield path, engine, reference, tiny_vl_processor(path)
    engine.close()


def test_trunk_images_give_the_processors_positions_from_any_start():
    # mutations: text after an image at start + max + 1; h and w swapped; the offset reset after each image
    spans = (ImageSpan(3, 2, 3), ImageSpan(12, 4, 1), ImageSpan(20, 1, 5))
    images = TrunkImages(spans, (b"a", b"b", b"c"), ())
    want = mrope_positions(40, list(spans))
    for start in (0, 5, 13, 26):
        assert np.array_equal(np.arange(start, 40) + images.deltas(start, 40), want[:, start:])
    assert images.final_offset == want[0, -1] - 39


def reference_label_probs(reference, inputs: dict, prompt: np.ndarray) -> torch.Tensor:
    ids = torch.from_numpy(prompt)[None]
    extra = {}
    if "pixel_values" in inputs:
        types = torch.zeros_like(ids)
        types[ids == reference.config.image_token_id] = 1
        extra = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"],
                 "mm_token_type_ids": types}
    with torch.no_grad():
        logits = reference(input_ids=ids, use_cache=False, **extra).logits[0, -1]
    return torch.softmax(logits[LABELS], -1)


@pytest.mark.parametrize("count", [1, 3])
def test_a_round_with_images_reads_as_transformers(served, count):
    # mutations: pads keeping their token embedding; 1D positions at the pads; the branches at index positions
    # (no offset); the text-only request given the image's offset; h/w axes swapped (mrope_axes in blocks)
    path, engine, reference, processor = served
    vision = load_vision(path, "cpu", torch.float32)
    config = vision.config
    pictures = [noise(40 + 30 * k, 70 - 10 * k, seed=k) for k in range(count)]
    inputs = prompt_of(processor, pictures, "Look at these:")
    prompt = inputs["input_ids"][0].numpy()
    tails = [prompt[-3:], np.asarray([7, 11, 13]), np.asarray([3])]
    trunk = prompt[:-3]
    patches = [image_patches(picture, vision.processing) for picture in pictures]
    m = config.spatial_merge_size
    starts = np.flatnonzero(trunk == config.vision_start_token_id) + 1
    spans = tuple(ImageSpan(int(s), p.rows // m, p.cols // m) for s, p in zip(starts, patches))
    text_prompt = np.asarray([1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16], dtype=np.int64)
    requests = [RequestSpec.of(trunk, tails, [LABELS] * 3), RequestSpec.of(text_prompt[:-2], [text_prompt[-2:]], [LABELS])]
    images = [TrunkImages(spans, tuple(b"%d" % k for k in range(count)), tuple(patches)), None]
    pool = engine.pool
    host = plan_round(requests, engine.model.config.conv_kernel, pool.state_rows, pool.kv_sink)
    rnd = host.to("cpu")
    rows = np.concatenate([span.start + np.arange(span.rows * span.cols) for span in spans])  # request 0 first
    with torch.no_grad():
        embeds = torch.cat(vision.tower(patches))
    rope = json.loads((path / "config.json").read_text())["text_config"]["rope_parameters"]
    axes = mrope_axes(engine.model.config.rotary_dim, rope["mrope_section"])
    rnd.images = RoundImages(torch.from_numpy(rows), embeds,
                             torch.from_numpy(stream_positions(requests, images, host.positions)),
                             torch.from_numpy(axes))
    got = torch.softmax(engine.model(rnd, ops_for(torch.device("cpu")), pool.layer_caches()).label_logprobs, -1)
    single = processor.image_processor(pictures, return_tensors="pt")
    for k, tail in enumerate(tails):
        want = reference_label_probs(reference, single, np.concatenate([trunk, tail]))
        torch.testing.assert_close(got[k], want, rtol=0, atol=1e-5)
    want = reference_label_probs(reference, {}, text_prompt)
    torch.testing.assert_close(got[3], want, rtol=0, atol=1e-5)
