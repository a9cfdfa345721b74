"""Fixed round shapes for CUDA graphs: the capacity ladder, bucket choice, and padding a round to a capacity.

A captured graph reads fixed-size buffers, so every round quantity has a capacity: stream tokens T (the
ladder, 128 to 16,384 by default), requests, questions, label columns, history pages, and per Gated
DeltaNet level its chunks and segments. Requests and questions scale with T (a request needs tokens; a
question's branch needs some too), so a small graph also has small tables. `choose` picks the smallest
capacity a round fits; `pad_into` has the round's plan write its arrays straight into a capacity's arrays,
padded only at the tail (`RoundPlan.write` says how), and `pad_round` gives them as a padded HostRound.
A graph's pinned staging buffer holds less (`stage_into`, `Capacity.staged_shapes`): the per-token and
per-chunk-position arrays (token rows, conv sources, chunk tables) are expanded on the device from a piece
table and the chunk rows' spans (`kernels.round_metadata`), which leaves the host a few small writes per
round. Everything here is host code (numpy), tested on CPU against the unpadded layout.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from flide_sdk.plan.layout import (
    DEVICE_FIELDS,
    GDN_CHUNK,
    PAGE,
    PIECE_ROWS,
    SEGMENT_ROWS,
    TOKEN_ROWS,
    HostLevel,
    HostRound,
    RoundPlan,
)

# steps of at most 1.25x above 384 tokens, finer where lone RACE passages (390-680 tokens) and 2,000-token
# states with 1-16 questions land, and rungs where cuBLAS's GEMMs run faster (docs/decisions/round-planning.md)
TOKEN_LADDER = (128, 256, 384, 448, 512, 544, 576, 640, 704, 768, 896, 1024, 1280, 1536, 1664, 1792, 1920, 2048,
                2240, 2304, 2432, 2560, 2688, 2816, 2944, 3072, 3584, 4096, 4608, 5120, 5632, 6144, 7168, 8192,
                10240, 12288, 14336, 16384)
LABELS = 32  # label columns of a graph (a question has at most 26 options: letters)
TOKENS_PER_REQUEST = 64  # requests capacity = T / this (at least MIN_REQUESTS)
TOKENS_PER_QUESTION = 16  # questions capacity = T / this (at least MIN_QUESTIONS)
MIN_REQUESTS, MIN_QUESTIONS = 4, 16
# the arrays of a round a graph's staging buffer does not hold (with each level's chunk_tokens): expanded on the
# device from the staged pieces and chunk spans
EXPANDED_FIELDS = ("token_rows", "conv_src")


@dataclass(frozen=True)
class Capacity:
    """The fixed shape of one captured round."""

    tokens: int
    requests: int
    questions: int
    labels: int
    pages: int
    conv_kernel: int

    @property
    def segments(self) -> tuple[int, int, int]:
        """Segments per level: trunks to their save point, trunk remainders, branches."""
        return self.requests, self.requests, self.questions

    @property
    def chunks(self) -> tuple[int, ...]:
        """Chunks per level: a level's segments hold at most T tokens, each segment starts a chunk."""
        return tuple(self.tokens // GDN_CHUNK + segments for segments in self.segments)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of every array of a round of this capacity, named as `HostRound.arrays()`."""
        t, r, q, k = self.tokens, self.requests, self.questions, self.conv_kernel
        shapes: dict[str, tuple[int, ...]] = {
            "ids": (t,), "token_rows": (len(TOKEN_ROWS), t), "history_len": (r + 1,), "page_offset": (r + 1,),
            "pages": (self.pages,), "conv_src": (t, k), "resume_slots": (r,), "save_slots": (r,),
            "save_window_src": (r, k - 1), "kv_slots": (t,), "readout_rows": (q,), "label_ids": (q, self.labels),
            "num_tokens": (1,),
        }
        for index, (chunks, segments) in enumerate(zip(self.chunks, self.segments)):
            shapes[f"level{index}.chunk_tokens"] = (chunks, GDN_CHUNK)
            shapes[f"level{index}.segment_rows"] = (len(SEGMENT_ROWS), segments)
            shapes[f"level{index}.sizes"] = (2,)
        return shapes

    def staged_shapes(self) -> dict[str, tuple[int, ...]]:
        """The arrays of a graph's staging buffer (`stage_into`): `shapes()` less EXPANDED_FIELDS, plus what
        those are expanded from on the device (`kernels.round_metadata`): a piece table (a request's trunk
        and each of its questions' branches are pieces), the piece and request counts, and the chunk rows'
        spans, the levels' rows one after the other."""
        shapes = {name: shape for name, shape in self.shapes().items() if not _expanded(name)}
        shapes.update(pieces=(len(PIECE_ROWS), self.requests + self.questions), piece_counts=(2,),
                      chunk_spans=(2, sum(self.chunks)))
        return shapes

    def expanded_shapes(self) -> dict[str, tuple[int, ...]]:
        """The arrays the device expands a staged round into: the token rows, the conv sources, and the levels'
        chunk tables as one [rows, GDN_CHUNK] table (`level_views` cuts it per level)."""
        return {"token_rows": (len(TOKEN_ROWS), self.tokens), "conv_src": (self.tokens, self.conv_kernel),
                "chunk_tokens": (sum(self.chunks), GDN_CHUNK)}

    def level_views(self, chunk_tokens: Any) -> dict[str, Any]:
        """Each level's chunk table (`level{i}.chunk_tokens`) as a view of the whole table of `expanded_shapes`."""
        bounds = itertools.accumulate(self.chunks, initial=0)
        return {f"level{index}.chunk_tokens": chunk_tokens[start:end]
                for index, (start, end) in enumerate(itertools.pairwise(bounds))}

    @property
    def elements(self) -> int:
        """The int64 elements of a staging buffer of this capacity."""
        return sum(int(np.prod(shape)) for shape in self.staged_shapes().values())

    def fits(self, round_: RoundPlan | HostRound) -> bool:
        """Whether a round (unpadded) fits, with at least one padding token (padded readout rows read it)."""
        plan = plan_of(round_)
        return (
            plan.num_real < self.tokens
            and plan.num_requests <= self.requests
            and plan.num_questions <= self.questions
            and plan.label_width <= self.labels
            and plan.num_pages <= self.pages
            and all(level.segments <= s and level.chunks <= c
                    for level, s, c in zip(plan.levels, self.segments, self.chunks))
        )


def plan_of(round_: RoundPlan | HostRound) -> RoundPlan:
    """The plan of a round given as its plan or as its unpadded arrays."""
    return round_.plan if isinstance(round_, HostRound) else round_


def capacity_ladder(
    conv_kernel: int,
    max_tokens: int = TOKEN_LADDER[-1],
    max_requests: int = 64,
    max_prompt_tokens: int = 32768,
    tokens: tuple[int, ...] = TOKEN_LADDER,
) -> list[Capacity]:
    """Capacities from the smallest to `max_tokens` (which is always the last rung)."""
    rungs = sorted({t for t in tokens if t < max_tokens} | {max_tokens})
    history_pages = -(-max_prompt_tokens // PAGE)
    return [
        Capacity(
            tokens=t,
            requests=min(max_requests, max(MIN_REQUESTS, t // TOKENS_PER_REQUEST)),
            questions=max(MIN_QUESTIONS, t // TOKENS_PER_QUESTION),
            labels=LABELS,
            pages=max(history_pages, t // 2),
            conv_kernel=conv_kernel,
        )
        for t in rungs
    ]


def choose(ladder: list[Capacity], round_: RoundPlan | HostRound) -> Capacity | None:
    """The smallest capacity a round fits, or None (the round runs eagerly)."""
    plan = plan_of(round_)
    first = bisect.bisect_right(ladder, plan.num_real, key=lambda capacity: capacity.tokens)  # fewer tokens never fit
    return next((capacity for capacity in ladder[first:] if capacity.fits(plan)), None)


def pad_into(round_: RoundPlan | HostRound, capacity: Capacity, out: dict[str, np.ndarray], window_sink: int,
             kv_sink: int, zero_row: int) -> None:
    """Write a round padded to `capacity` into the arrays `out` (shaped as `capacity.shapes()`), from its plan
    (`RoundPlan.write`: padding only at the tail).

    window_sink: a pool slot that padded conv-window saves write to (and padded resumes read);
    kv_sink: the flat pool position padding tokens' keys/values go to; zero_row: the always-zero state row.
    """
    plan = plan_of(round_)
    plan.write(out, window_sink, kv_sink, zero_row)


def stage_into(plan: RoundPlan, capacity: Capacity, out: dict[str, np.ndarray], window_sink: int, kv_sink: int,
               zero_row: int) -> None:
    """Write a round's staged form for `capacity` into the arrays `out` (shaped as `capacity.staged_shapes()`:
    `RoundPlan.write_staged`), which the device expands into what `pad_into` writes (`kernels.round_metadata`).
    The arguments are `pad_into`'s."""
    plan.write_staged(out, capacity.chunks, window_sink, kv_sink, zero_row)


def _expanded(name: str) -> bool:
    """Whether an array of `Capacity.shapes()` is expanded on the device from the staged arrays."""
    return name in EXPANDED_FIELDS or name.endswith(".chunk_tokens")


def pad_round(host: HostRound, capacity: Capacity, window_sink: int, kv_sink: int, zero_row: int) -> HostRound:
    """`host` padded to `capacity` as a new HostRound (the host-side lists are kept as they are)."""
    if not capacity.fits(host):
        raise ValueError(f"the round does not fit {capacity}")
    arrays = {name: np.empty(shape, dtype=np.int64) for name, shape in capacity.shapes().items()}
    pad_into(host, capacity, arrays, window_sink, kv_sink, zero_row)
    levels = [HostLevel(arrays[f"level{i}.chunk_tokens"], arrays[f"level{i}.segment_rows"], arrays[f"level{i}.sizes"],
                        level.active, level.chained)
              for i, level in enumerate(host.levels)]
    return HostRound(host.plan, levels=levels, **{name: arrays[name] for name in DEVICE_FIELDS})
