"""Where a round's images sit: a trunk's image spans, the M-RoPE (t, h, w) position of each stream token (Qwen3.5)
and the last key each token sees when an image's tokens see each other (Gemma 4).

A prompt's text token at index i is at position i + the offset of the last image before it (0 before any); an
image's pads are at its start + (0, row, col), and the text after it at start + max(rows, cols)
(`models.qwen35_vision.mrope_positions`). A trunk's spans carry those offsets, so a trunk resumed past its images
continues at the right positions, and its branches follow its last offset.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flide_sdk.models.gemma4_vision import GemmaImagePatches
from flide_sdk.models.qwen35_vision import ImagePatches, ImageSpan
from flide_sdk.plan.requests import RequestSpec


@dataclass(frozen=True)
class TrunkImages:
    """A trunk's images in prompt order: each one's pads (`ImageSpan`, prompt indices), its digest and the patches
    the tower reads."""

    spans: tuple[ImageSpan, ...]
    digests: tuple[bytes, ...]
    patches: tuple[ImagePatches | GemmaImagePatches, ...]

    def marks(self, length: int) -> list[tuple[int, bytes]]:
        """(first pad, digest) of each image starting before `length`: what a prefix of the trunk holds besides
        its tokens."""
        return [(span.start, digest) for span, digest in zip(self.spans, self.digests) if span.start < length]

    def offsets(self) -> np.ndarray:
        """The position offset (position - index) of the text after each image, cumulated."""
        out, offset = [], 0
        for span in self.spans:
            start = span.start + offset
            offset = start + max(span.rows, span.cols) - (span.start + span.rows * span.cols)
            out.append(offset)
        return np.asarray(out, dtype=np.int64)

    @property
    def final_offset(self) -> int:
        return int(self.offsets()[-1]) if self.spans else 0

    def deltas(self, start: int, stop: int) -> np.ndarray:
        """(t, h, w) position minus index [3, stop - start] of the prompt's tokens [start, stop)."""
        index = np.arange(start, stop)
        offsets = np.concatenate([[0], self.offsets()])
        starts = np.asarray([span.start for span in self.spans], dtype=np.int64)
        after = np.searchsorted(starts, index, side="right")  # images starting at or before each token
        out = np.repeat(offsets[np.where(after > 0, after, 0)][None, :], 3, axis=0)
        for k, span in enumerate(self.spans):
            pads = span.rows * span.cols
            inside = (index >= span.start) & (index < span.start + pads)
            if inside.any():
                grid = index[inside] - span.start
                base = offsets[k]  # the image starts at its index + the offset before it
                out[0, inside] = base - grid
                out[1, inside] = base + grid // span.cols - grid
                out[2, inside] = base + grid % span.cols - grid
        return out


def stream_positions(requests: Sequence[RequestSpec], images: Sequence[TrunkImages | None],
                     positions: np.ndarray) -> np.ndarray:
    """The M-RoPE positions [3, T] of a round's stream, whose tokens are at prompt `positions` [T]: each request
    of `requests` and its forks (depth first, `RequestSpec.tree`, with `images` of each in that order) lays out
    its computed trunk, then its branches (after the trunk's last image)."""
    out = np.repeat(positions[None, :], 3, axis=0)
    cursor = 0
    specs = [spec for request in requests for spec in request.tree()]
    for spec, trunk_images in zip(specs, images, strict=True):
        computed, branch = len(spec.trunk), int(spec.branches.lengths.sum())
        if trunk_images is not None and trunk_images.spans:
            out[:, cursor:cursor + computed] += trunk_images.deltas(spec.start, spec.start + computed)
            out[:, cursor + computed:cursor + computed + branch] += trunk_images.final_offset
        cursor += computed + branch
    return out


@dataclass(frozen=True)
class PadRows:
    """The image pads a round computes: their stream rows, and for each the row of the tower's output it takes;
    the tower runs once over `patches`, each distinct image (by digest) once, in order of first use."""

    stream: np.ndarray
    tower: np.ndarray
    patches: tuple[ImagePatches | GemmaImagePatches, ...]


def pad_rows(requests: Sequence[RequestSpec], images: Sequence[TrunkImages | None]) -> PadRows:
    """The pads of `requests` (and their forks, depth first, `images` of each in that order) inside the tokens
    each computes: pads already in a checkpoint are not computed, so their images are not encoded again."""
    first: dict[bytes, int] = {}  # digest -> its first tower row
    patches: list[ImagePatches | GemmaImagePatches] = []
    stream, tower = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    cursor, rows = 0, 0
    specs = [spec for request in requests for spec in request.tree()]
    for spec, trunk_images in zip(specs, images, strict=True):
        computed = len(spec.trunk)
        found = () if trunk_images is None else zip(trunk_images.spans, trunk_images.digests, trunk_images.patches)
        for span, digest, picture in found:
            pads = span.rows * span.cols
            low, high = max(span.start, spec.start), min(span.start + pads, spec.start + computed)
            if low >= high:
                continue
            if digest not in first:
                first[digest] = rows
                patches.append(picture)
                rows += pads
            stream.append(cursor + np.arange(low, high) - spec.start)
            tower.append(first[digest] + np.arange(low, high) - span.start)
        cursor += computed + int(spec.branches.lengths.sum())
    return PadRows(np.concatenate(stream), np.concatenate(tower), tuple(patches))


def image_bounds(requests: Sequence[RequestSpec], images: Sequence[TrunkImages | None], tokens: int) -> np.ndarray:
    """The last stream key each of a round's `tokens` sees when an image's soft tokens attend both ways
    (`AttentionPlan.see_hi`): the last soft token of its image for a soft token the round computes, itself for any
    other. A trunk computes to its end in one round, so an image whose first computed soft token is in the round
    has all its later ones there too (soft tokens in a checkpoint were computed with the whole image)."""
    out = np.arange(tokens, dtype=np.int64)
    cursor = 0
    specs = [spec for request in requests for spec in request.tree()]
    for spec, trunk_images in zip(specs, images, strict=True):
        computed = len(spec.trunk)
        for span in () if trunk_images is None else trunk_images.spans:
            low, high = max(span.start, spec.start), span.start + span.rows * span.cols
            if low < high:
                if high > spec.start + computed:
                    raise ValueError("a round computes part of an image's soft tokens")
                out[cursor + low - spec.start:cursor + high - spec.start] = cursor + high - 1 - spec.start
        cursor += computed + int(spec.branches.lengths.sum())
    return out
