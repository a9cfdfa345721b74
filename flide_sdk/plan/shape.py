"""The sizes of a round's arrays: a round's own (`RoundShape.of`) or a graph capacity's (`Capacity.shape`).

One shape names every array of a round and its size: the staged arrays the host writes (`RoundPlan.stage`) and
the arrays the device expands them into (`kernels.round_metadata`). The levels' tables are single arrays, each
level a slice at the offsets the shape gives, so a round has one table of each kind whatever its depth.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flide_sdk.kernels.plans import GDN_CHUNK, PIECE_ROWS, SEGMENT_ROWS, TOKEN_ROWS

if TYPE_CHECKING:
    from flide_sdk.plan.tree import RoundPlan

LEVELS = 3  # Gated DeltaNet levels of a round at least: trunks up to their save point, trunk remainders, branches


@dataclass(frozen=True)
class RoundShape:
    """How many of each thing a round's arrays hold."""

    tokens: int
    requests: int  # rows of the per-request tables (a capacity has one more: its padding tokens' request)
    resumes: int
    saves: int
    questions: int
    labels: int
    pages: int
    pieces: int
    conv_kernel: int
    segments: tuple[int, ...]  # per level
    chunks: tuple[int, ...]  # per level
    text_reads: int = 0  # token reads of text-scored options
    sliding: bool = False  # with the sliding-window layers' page table and KV slots

    @classmethod
    def of(cls, plan: RoundPlan) -> RoundShape:
        """A round's own shape, unpadded."""
        return cls(plan.num_real, plan.num_requests, plan.num_resumes, len(plan.saves), plan.num_questions,
                   plan.label_width, plan.num_pages, len(plan.pieces), plan.conv_kernel,
                   tuple(level.segments for level in plan.levels), tuple(level.chunks for level in plan.levels),
                   len(plan.text_reads), plan.sliding)

    @functools.cached_property
    def segment_offsets(self) -> list[int]:
        return list(itertools.accumulate(self.segments, initial=0))

    @functools.cached_property
    def chunk_offsets(self) -> list[int]:
        return list(itertools.accumulate(self.chunks, initial=0))

    def staged_shapes(self) -> dict[str, tuple[int, ...]]:
        """The arrays the host writes (`RoundPlan.stage`), in a graph's staging buffer or a round's own."""
        t, r, q = self.tokens, self.requests, self.questions
        sliding = {"sliding_kv_slots": (t,), "sliding_pages": (self.pages,)} if self.sliding else {}
        return sliding | {
            "ids": (t,), "pieces": (len(PIECE_ROWS), self.pieces), "piece_counts": (2,), "num_tokens": (1,),
            "kv_slots": (t,), "save_tokens": (self.saves,), "save_slots": (self.saves,),
            "resume_slots": (self.resumes,), "readout_rows": (q,), "label_ids": (q, self.labels),
            "text_rows": (self.text_reads,), "text_targets": (self.text_reads,),
            "history_len": (r,), "page_offset": (r,), "pages": (self.pages,),
            "segment_rows": (len(SEGMENT_ROWS), sum(self.segments)), "level_sizes": (len(self.segments), 2),
            "chunk_spans": (2, sum(self.chunks)),
        }

    def expanded_shapes(self) -> dict[str, tuple[int, ...]]:
        """The arrays the device derives from the staged ones (`kernels.round_metadata`)."""
        return {"token_rows": (len(TOKEN_ROWS), self.tokens), "conv_src": (self.tokens, self.conv_kernel),
                "chunk_tokens": (sum(self.chunks), GDN_CHUNK), "save_window_src": (self.saves, self.conv_kernel - 1)}

    def level(self, arrays: dict[str, Any], index: int) -> tuple[Any, Any, Any]:
        """Level `index`'s chunk table, segment table and sizes: views of the round's single tables."""
        chunks, segments = self.chunk_offsets, self.segment_offsets
        return (arrays["chunk_tokens"][chunks[index] : chunks[index + 1]],
                arrays["segment_rows"][:, segments[index] : segments[index + 1]], arrays["level_sizes"][index])
