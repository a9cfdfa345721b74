"""A tiny Qwen3.5 vision-language checkpoint built by transformers, with its processor, for the image tests.

The text decoder is `flide_sdk.testing`'s tiny config; the vision tower is small (2 blocks, 8-pixel patches, a
2x2 merge); the tokenizer is the tiny one with Qwen's vision tokens added, and the chat template prints an image
block as `<|vision_start|><|image_pad|><|vision_end|>`, as Qwen3.5's does. Random weights, written by
`Qwen3_5ForConditionalGeneration.save_pretrained` (release layout: `model.language_model.*`, `model.visual.*`)
and `Qwen3VLProcessor.save_pretrained` (preprocessor_config.json, tokenizer, chat template).
"""

from __future__ import annotations

from pathlib import Path

import torch

from flide_sdk.testing import GENERATION_PROMPT, cached_checkpoint, tiny_config_json, train_tiny_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}"
    "{%- for item in message.content %}"
    "{%- if item.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item.type == 'text' %}{{- item.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    + GENERATION_PROMPT
)
VISION_CONFIG = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 8,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 36,
    "hidden_act": "gelu_pytorch_tanh",
}
MIN_PIXELS = 16 * 16 * 2  # the image processor's size bounds: between 2 and 48 merged tokens
MAX_PIXELS = 16 * 16 * 48


def make_tiny_vl_checkpoint(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny vision-language checkpoint and its processor to `path`."""
    from transformers import PreTrainedTokenizerFast, Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tiny_tokenizer(seed)
    tokenizer.add_special_tokens(VISION_TOKENS)
    ids = {token: tokenizer.token_to_id(token) for token in VISION_TOKENS}
    vocab = -(-tokenizer.get_vocab_size() // 64) * 64
    text = tiny_config_json(vocab, tokenizer.token_to_id("<|im_end|>"))
    text = {k: v for k, v in text.items() if k not in ("architectures", "model_type", "tie_word_embeddings", "dtype")}
    vision = {**VISION_CONFIG, "out_hidden_size": text["hidden_size"]}
    config = Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers' init leaves some norms and biases at constants: vary every weight
        for name, parameter in model.named_parameters():
            if "visual" in name:
                parameter.normal_(0.0, 0.05 if parameter.dim() > 1 else 0.02).add_(1.0 if "norm" in name else 0.0)
    model.save_pretrained(path)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=VISION_CONFIG["patch_size"], merge_size=VISION_CONFIG["spatial_merge_size"],
        temporal_patch_size=VISION_CONFIG["temporal_patch_size"], min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
    )
    image_processor.save_pretrained(path)
    fast.chat_template = VL_CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


def tiny_vl_processor(path: str | Path):
    """The checkpoint's processor: Qwen3.5's (`Qwen3VLProcessor`) without its video processor, which needs
    torchvision; images and text go through Qwen3VLProcessor's own code."""
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    class ImageTextProcessor(Qwen3VLProcessor):
        @classmethod
        def get_attributes(cls) -> list[str]:
            return ["image_processor", "tokenizer"]

    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
    return ImageTextProcessor(image_processor, tokenizer, None, chat_template=tokenizer.chat_template)


def tiny_vl_checkpoint(seed: int = 0) -> Path:
    """The cached tiny vision-language checkpoint for `seed` in the temp dir."""
    return cached_checkpoint(f"flide_sdk-tiny-vl-v1-seed{seed}", lambda path: make_tiny_vl_checkpoint(path, seed=seed))
