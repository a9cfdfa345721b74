"""A tiny Gemma 4 vision-language checkpoint built by transformers, with its image processor, for the vision tests.

The text decoder is test_gemma4's tiny one with image tokens attending both ways (`use_bidirectional_attention:
"vision"`, as the 26B and 31B releases) and narrow per-layer inputs (as E2B/E4B), its vocabulary covering the
media tokens' ids (about 259k rows, so the decoder is narrow), a full layer between sliding ones (the last
layer reads out only); the vision tower is small (2 layers, 4-pixel patches, 3x3 pooling, at most
70 soft tokens per image), with clipped linears and standardization both on so that every part of the tower counts.
The tokenizer is `flide_sdk.testing`'s tiny Gemma one with Gemma 4's image and audio tokens added at the releases'
ids (boi 255999, image 258880, eoi 258882; the processor refuses a tokenizer without the audio ones). Random weights,
written by `Gemma4ForConditionalGeneration.save_pretrained` (release layout: `model.vision_tower.*`,
`model.embed_vision.*`) and `Gemma4ImageProcessorPil.save_pretrained` (preprocessor_config.json).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer

from flide_sdk.testing import (
    GEMMA_CHAT_TEMPLATE,
    cached_checkpoint,
    gemma_tokenizer,
    train_gemma_tokenizer,
    write_gemma_tokenizer,
)

MEDIA_TOKENS = {  # the releases' ids and the tokenizer_config.json keys naming them
    255999: ("<|image>", "boi_token"), 258880: ("<|image|>", "image_token"), 258882: ("<image|>", "eoi_token"),
    256000: ("<|audio>", "boa_token"), 258881: ("<|audio|>", "audio_token"), 258883: ("<audio|>", "eoa_token"),
    258884: ("<|video|>", None),
}
VISION_CONFIG = {
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4, "pooling_kernel_size": 3,
    "position_embedding_size": 256, "standardize": True, "use_clipped_linears": True,
}
# Gemma 4's turns, a message's content also a list of text and image parts (an image: the processor's image token)
CHAT_TEMPLATE = GEMMA_CHAT_TEMPLATE.replace(
    "message['content'] | trim + '<turn|>\\n' -}}",
    "'' -}}{%- if message['content'] is string -%}{{- message['content'] | trim -}}{%- else -%}"
    "{%- for item in message['content'] -%}{%- if item['type'] == 'image' -%}{{- '<|image|>' -}}{%- else -%}"
    "{%- set text = item['text'].lstrip() if loop.first else item['text'] -%}"
    "{{- text.rstrip() if loop.last else text -}}{%- endif -%}{%- endfor -%}{%- endif -%}{{- '<turn|>\\n' -}}")
MAX_SOFT_TOKENS = 70  # the smallest the processor allows: 630 patches of 4 x 4 pixels
TEXT_CONFIG = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "hidden_size_per_layer_input": 8,
    "max_position_embeddings": 4096, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
    "use_bidirectional_attention": "vision",
}


def gemma_vision_tokenizer() -> Tokenizer:
    """The tiny Gemma tokenizer with the media tokens of MEDIA_TOKENS at their ids."""
    base = train_gemma_tokenizer()
    state = json.loads(base.model.__getstate__())
    vocab = {**state["vocab"], **{token: index for index, (token, _) in MEDIA_TOKENS.items()}}
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tokenizer = gemma_tokenizer(vocab, merges)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token, _ in MEDIA_TOKENS.values()])
    return tokenizer


def make_gemma_vision_checkpoint(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny Gemma 4 vision-language checkpoint, its tokenizer and image processor to `path`."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig, Gemma4VisionConfig
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = gemma_vision_tokenizer()
    vocab = max(MEDIA_TOKENS) + 1
    text = Gemma4TextConfig(vocab_size=vocab, vocab_size_per_layer_input=vocab, **TEXT_CONFIG)
    config = Gemma4Config(text_config=text.to_dict(), vision_config=Gemma4VisionConfig(**VISION_CONFIG).to_dict(),
                          audio_config=None)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # transformers' init leaves norms at one and clips at infinity: vary every vision weight
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "vision" not in name:
                continue
            noise = torch.randn(tensor.shape, generator=generator)
            if name.endswith(("_min", "_max")):  # clip bounds that cut some activations
                tensor.copy_((noise.abs() * 0.5 + 1.0) * (-1 if name.endswith("_min") else 1))
            elif "norm" in name or name.endswith("std_scale"):
                tensor.copy_(noise * 0.1 + 1.0)
            elif tensor.dim() > 1:
                tensor.copy_(noise / tensor.shape[-1] ** 0.5)
            else:
                tensor.copy_(noise * 0.5)
    model.save_pretrained(path)
    write_gemma_tokenizer(path, tokenizer, CHAT_TEMPLATE)
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config.update({key: token for token, key in MEDIA_TOKENS.values() if key})
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    Gemma4ImageProcessorPil(patch_size=VISION_CONFIG["patch_size"], max_soft_tokens=MAX_SOFT_TOKENS,
                            pooling_kernel_size=VISION_CONFIG["pooling_kernel_size"]).save_pretrained(path)
    return path


def gemma_vision_processor(path: str | Path):
    """The checkpoint's processor: Gemma 4's (`Gemma4Processor`) without its audio feature extractor and video
    processor (the latter needs torchvision); images and text go through Gemma4Processor's own code."""
    from transformers import AutoImageProcessor, AutoTokenizer, ProcessorMixin
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    class WithoutAbsent(ProcessorMixin):  # Gemma4Processor's __init__ hands every part on: drop the absent ones
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **{key: value for key, value in kwargs.items() if value is not None})

    class ImageTextProcessor(Gemma4Processor, WithoutAbsent):
        @classmethod
        def get_attributes(cls) -> list[str]:
            return ["image_processor", "tokenizer"]

    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
    return ImageTextProcessor(None, image_processor, tokenizer, None, chat_template=tokenizer.chat_template)


def gemma_vision_checkpoint(seed: int = 0) -> Path:
    """The cached tiny Gemma 4 vision-language checkpoint for `seed` in the temp dir."""
    return cached_checkpoint(f"flide_sdk-tiny-gemma-vl-v2-seed{seed}",
                             lambda path: make_gemma_vision_checkpoint(path, seed=seed))
