"""Images in a prompt: a request's decoded assets as the model's image tokens, spliced where the text names them.

The checkpoint's processor turns each placeholder into a start token, one pad per merged patch block (Qwen3.5:
`<|vision_start|>`, `<|image_pad|>`, `<|vision_end|>`) or pooled block (Gemma 4: boi, image tokens, eoi), then an
end token; those are added tokens, so the text on either side of an image is encoded apart, and a
prompt's ids are its text pieces' ids with each image's ids between them (`RequestImages.encode`). The pads of
a trunk become its `TrunkImages`: where they sit, each image's digest and its patches (made here, in the asking
thread, so the round thread only runs the tower).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flide_sdk.errors import InvalidAssetError, InvalidStateError
from flide_sdk.images import DecodedImage, check_references, split_at_placeholders
from flide_sdk.models.gemma4_vision import (
    GemmaImagePatches,
    GemmaImageProcessing,
    GemmaVisionConfig,
    gemma_image_ids,
    gemma_image_patches,
)
from flide_sdk.models.qwen35_vision import (
    ImagePatches,
    ImageProcessing,
    ImageSpan,
    VisionConfig,
    image_ids,
    image_patches,
)
from flide_sdk.plan.images import TrunkImages


@dataclass(frozen=True)
class KeptImage:
    """What a session's history keeps of an appended image: its digest and patches."""

    digest: bytes
    patches: ImagePatches | GemmaImagePatches


@dataclass(frozen=True)
class ImagePrompt:
    """A checkpoint's image tokens: its vision token ids and how its processor makes patches (Qwen3.5's or Gemma
    4's)."""

    config: VisionConfig | GemmaVisionConfig
    processing: ImageProcessing | GemmaImageProcessing

    @property
    def merge(self) -> int:
        """Patches per side of the block one image token stands for."""
        if isinstance(self.config, GemmaVisionConfig):
            return self.config.pooling_kernel_size
        return self.config.spatial_merge_size

    @property
    def start_id(self) -> int:
        """The token before an image's pads."""
        if isinstance(self.config, GemmaVisionConfig):
            return self.config.boi_token_id
        return self.config.vision_start_token_id

    def patches(self, image: Any, name: str) -> ImagePatches | GemmaImagePatches:
        if isinstance(self.processing, GemmaImageProcessing):
            return gemma_image_patches(image, self.processing)
        return image_patches(image, self.processing, name)

    def ids(self, patches: Any) -> np.ndarray:
        """An image's tokens: start, its pads, end."""
        if isinstance(self.config, GemmaVisionConfig):
            return gemma_image_ids(self.config, patches)
        return image_ids(self.config, patches)

    @classmethod
    def of_checkpoint(cls, path: Path, raw_config: dict[str, Any]) -> ImagePrompt | None:
        """The image tokens of a Qwen3.5 or Gemma 4 release checkpoint with a vision tower and its image
        processor's config; None for one without (CheckpointError for a malformed one)."""
        if raw_config.get("model_type") == "gemma4":
            gemma = GemmaVisionConfig.from_config(raw_config, str(path / "config.json"))
            processing = None if gemma is None else GemmaImageProcessing.from_checkpoint(path, gemma)
            return None if processing is None else cls(gemma, processing)
        if raw_config.get("model_type") not in ("qwen3_5", "qwen3_5_moe"):
            return None
        if not (path / "preprocessor_config.json").is_file():
            return None
        config = VisionConfig.from_config(raw_config, str(path / "config.json"))
        if config is None:
            return None
        return cls(config, ImageProcessing.from_checkpoint(path, config))

    def trunk_images(self, kept: list[tuple[int, KeptImage]]) -> TrunkImages:
        """A session history's images (first pad, what it kept) as its trunk's (`History.image_builder`)."""
        merge = self.merge
        spans = tuple(ImageSpan(start, k.patches.rows // merge, k.patches.cols // merge) for start, k in kept)
        return TrunkImages(spans, tuple(k.digest for _, k in kept), tuple(k.patches for _, k in kept))

    def request(self, assets: Mapping[str, DecodedImage]) -> RequestImages:
        """The request's images as tokens and patches (InvalidAssetError for one the processor refuses)."""
        names = list(assets)
        patches = {name: self.patches(assets[name].image, name) for name in names}
        return RequestImages(names, dict(assets), patches, {name: self.ids(p) for name, p in patches.items()},
                             self.config.image_token_id, self.start_id, self.merge)


@dataclass(frozen=True)
class RequestImages:
    """One request's images: placeholder names (in `assets` order), decoded images, patches and token ids."""

    names: list[str]
    images: dict[str, DecodedImage]
    patches: dict[str, ImagePatches | GemmaImagePatches]
    ids: dict[str, np.ndarray]
    pad_id: int
    start_id: int
    merge: int

    def split(self, text: str) -> list[str | int]:
        """`text` cut at placeholders (`images.split_at_placeholders`)."""
        return split_at_placeholders(text, self.names)

    def holds(self, text: str) -> bool:
        return any(name in text for name in self.names)

    def image(self, index: int) -> tuple[np.ndarray, bytes, KeptImage]:
        """Image `index`'s token ids, digest, and what a session's history keeps of it (`text.history.History`)."""
        name = self.names[index]
        digest = self.images[name].digest
        return self.ids[name], digest, KeptImage(digest, self.patches[name])

    def outside(self, text: str, at: int) -> int:
        """`at`, or the start of the placeholder of `text` it falls inside: a cut there splits no image name (the
        text before an image is encoded apart, so its start is as good a cut as its end)."""
        done = 0
        for piece in self.split(text):
            size = len(self.names[piece]) if isinstance(piece, int) else len(piece)
            if isinstance(piece, int) and done < at < done + size:
                return done
            done += size
            if done >= at:
                break
        return at

    def check(self, text: str) -> None:
        """InvalidAssetError for a TypeSafe `<image:...>` reference in `text` with no asset."""
        check_references(text, self.names)

    def encode(self, text: str, encode: Callable[[str], np.ndarray]) -> np.ndarray:
        """The ids of `text` with each placeholder's image tokens: its text pieces encoded apart by `encode`."""
        pieces = [self.ids[self.names[p]] if isinstance(p, int) else encode(p) for p in self.split(text)]
        return np.concatenate(pieces).astype(np.int64, copy=False) if pieces else np.zeros(0, dtype=np.int64)

    def order(self, text: str) -> list[str]:
        """The placeholders of a prompt's text in the order its images appear."""
        return [self.names[p] for p in self.split(text) if isinstance(p, int)]

    def trunk_images(self, trunk: np.ndarray, order: list[str], branch_pads: bool = False) -> TrunkImages | None:
        """The images of a trunk whose prompt places the images `order` (None without pads); InvalidAssetError
        when a question's branch holds pads (`branch_pads`: images are read in the state only), InvalidStateError
        when the trunk's image tokens are not those of the placeholders."""
        if branch_pads:
            raise InvalidAssetError(order[-1] if order else "assets",
                                    "an image in a question's text is not served (place images in the state)")
        starts = np.flatnonzero(trunk[:-1] == self.start_id) + 1
        starts = starts[trunk[starts] == self.pad_id]
        if len(starts) == 0:
            return None
        if len(starts) > len(order):
            raise InvalidStateError("the state holds image tokens no placeholder made")
        spans, digests, patches = [], [], []
        for start, name in zip(starts.tolist(), order):
            found = self.patches[name]
            rows, cols = found.rows // self.merge, found.cols // self.merge
            if not np.array_equal(trunk[start - 1 : start + rows * cols + 1], self.ids[name]):
                raise InvalidStateError("the state holds image tokens no placeholder made")
            spans.append(ImageSpan(start, rows, cols))
            digests.append(self.images[name].digest)
            patches.append(found)
        return TrunkImages(tuple(spans), tuple(digests), tuple(patches))
