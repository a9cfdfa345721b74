"""Fixed round shapes for CUDA graphs: the capacity ladder and the choice of graph.

A captured graph reads fixed-size buffers, so every round quantity has a capacity: stream tokens T (the
ladder, 128 to 16,384 by default), requests, questions, label columns, history pages, and per Gated
DeltaNet level its chunks and segments. A round with text-scored options needs rows for their token reads and
levels for its option pieces, a round with forks levels for them: each capacity has a twin with both
(`text_capacity`), captured when such a round first needs it. Requests and questions scale with T (a request
needs tokens; a question's branch needs some too), so a small graph also has small tables. `choose` picks the smallest
capacity a round fits; the round is then staged at the capacity's `shape` (`RoundPlan.stage`, padded at the
tail). Everything here is host code, tested on CPU against the unpadded layout.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from flide_sdk.kernels.plans import GDN_CHUNK, PAGE
from flide_sdk.plan.layout import HostRound
from flide_sdk.plan.shape import LEVELS, RoundShape
from flide_sdk.plan.tree import RoundPlan

# steps of at most 1.25x above 384 tokens, finer where lone RACE passages (390-680 tokens) and 2,000-token
# states with 1-16 questions land, and rungs where cuBLAS's GEMMs run faster (docs/decisions/round-planning.md)
TOKEN_LADDER = (128, 256, 384, 448, 512, 544, 576, 640, 704, 768, 896, 1024, 1280, 1536, 1664, 1792, 1920, 2048,
                2240, 2304, 2432, 2560, 2688, 2816, 2944, 3072, 3584, 4096, 4608, 5120, 5632, 6144, 7168, 8192,
                10240, 12288, 14336, 16384)
LABELS = 32  # label columns of a graph (a question has at most 26 options: letters)
TOKENS_PER_REQUEST = 64  # requests capacity = T / this (at least MIN_REQUESTS)
TOKENS_PER_QUESTION = 16  # questions capacity = T / this, in [MIN_QUESTIONS, MAX_QUESTIONS]
# at most MAX_QUESTIONS: a question's branch takes a Gated DeltaNet chunk row of its own, whose work tables make
# most of a large graph's memory (docs/decisions/start-up.md)
MIN_REQUESTS, MIN_QUESTIONS, MAX_QUESTIONS = 4, 16, 256
# a text capacity's token reads of text-scored options = T / this, at most MAX_TEXT_READS (an option's tokens and
# its question's last token are read; with the state and the question's text around them, a quarter of the
# stream is more than most rounds read: a round that reads more takes a larger capacity)
TOKENS_PER_TEXT_READ, MAX_TEXT_READS = 4, 2048
# a twin's Gated DeltaNet levels: two launch groups (`kernels.gated_delta.LEVELS_PER_LAUNCH`), which hold two
# levels of options under a question, or a fork of a fork with their branches
TWIN_LEVELS = 2 * LEVELS
FIRST_RUNGS_TOKENS = 1024  # graphs captured smallest first up to here, then largest first (`capture_order`)


@dataclass(frozen=True)
class Capacity:
    """The fixed shape of one captured round."""

    tokens: int
    requests: int
    questions: int
    labels: int
    pages: int
    conv_kernel: int
    text_reads: int = 0
    levels: int = LEVELS
    sliding: bool = False  # rounds stage the sliding-window layers' tables (`RoundShape.sliding`)

    @property
    def segments(self) -> tuple[int, ...]:
        """Segments per level: trunks to their save point, trunk remainders, branch pieces of each depth (the
        scheduler keeps a round's branch pieces within `questions`)."""
        return (self.requests, self.requests) + (self.questions,) * (self.levels - 2)

    @property
    def chunks(self) -> tuple[int, ...]:
        """Chunks per level: a level's segments hold at most T tokens, each segment starts a chunk."""
        return tuple(self.tokens // GDN_CHUNK + segments for segments in self.segments)

    @functools.cached_property
    def shape(self) -> RoundShape:
        """The arrays of a round of this capacity (one more request row: the padding tokens')."""
        r = self.requests
        return RoundShape(self.tokens, r + 1, r, r, self.questions, self.labels, self.pages, r + self.questions,
                          self.conv_kernel, self.segments, self.chunks, self.text_reads, self.sliding)

    @property
    def elements(self) -> int:
        """The int64 elements of a staging buffer of this capacity."""
        return sum(int(np.prod(shape)) for shape in self.shape.staged_shapes().values())

    def fits(self, round_: RoundPlan | HostRound) -> bool:
        """Whether a round (unpadded) fits, with at least one padding token (padded readout rows read it)."""
        plan = plan_of(round_)
        return (
            plan.num_real < self.tokens
            and plan.num_requests <= self.requests
            and plan.num_questions <= self.questions
            and plan.label_width <= self.labels
            and plan.num_pages <= self.pages
            and len(plan.text_reads) <= self.text_reads
            and len(plan.levels) <= self.levels
            and plan.sliding == self.sliding
            and all(level.segments <= s and level.chunks <= c
                    for level, s, c in zip(plan.levels, self.segments, self.chunks))
        )


def capture_order(ladder: list[Capacity]) -> list[Capacity]:
    """The order graphs are captured in while the engine serves: the largest first, so every later graph takes
    its blocks from the memory it left in the graphs' shared pool instead of adding its own (a graph that came
    before a larger one keeps blocks too small for it); then the rungs lone asks land on (up to
    FIRST_RUNGS_TOKENS) smallest first, so they replay soonest; then the rest largest first."""
    ascending = sorted(ladder, key=lambda capacity: capacity.tokens)
    largest, rest = ascending[-1:], ascending[:-1]
    first = [capacity for capacity in rest if capacity.tokens <= FIRST_RUNGS_TOKENS]
    return largest + first + [capacity for capacity in reversed(rest) if capacity.tokens > FIRST_RUNGS_TOKENS]


def plan_of(round_: RoundPlan | HostRound) -> RoundPlan:
    """The plan of a round given as its plan or as its unpadded arrays."""
    return round_.plan if isinstance(round_, HostRound) else round_


def capacity_ladder(
    conv_kernel: int,
    max_tokens: int = TOKEN_LADDER[-1],
    max_requests: int = 64,
    max_prompt_tokens: int = 32768,
    tokens: tuple[int, ...] = TOKEN_LADDER,
    sliding: bool = False,
) -> list[Capacity]:
    """Capacities from the smallest to `max_tokens` (which is always the last rung)."""
    rungs = sorted({t for t in tokens if t < max_tokens} | {max_tokens})
    history_pages = -(-max_prompt_tokens // PAGE)
    return [
        Capacity(
            tokens=t,
            requests=min(max_requests, max(MIN_REQUESTS, t // TOKENS_PER_REQUEST)),
            questions=min(MAX_QUESTIONS, max(MIN_QUESTIONS, t // TOKENS_PER_QUESTION)),
            labels=LABELS,
            pages=max(history_pages, t // 2),
            conv_kernel=conv_kernel,
            sliding=sliding,
        )
        for t in rungs
    ]


def text_capacity(capacity: Capacity) -> Capacity:
    """`capacity` with rows for the token reads of text-scored options and deeper levels (TWIN_LEVELS): the
    graph of rounds with text-scored options or forks (other rounds replay the capacity without, whose forward
    has no read path and one Gated DeltaNet launch group)."""
    return dataclasses.replace(capacity, text_reads=min(MAX_TEXT_READS, capacity.tokens // TOKENS_PER_TEXT_READ),
                               levels=TWIN_LEVELS)


def choose(ladder: list[Capacity], round_: RoundPlan | HostRound) -> Capacity | None:
    """The smallest capacity a round fits, or None (the round runs eagerly); `ladder` sorted by tokens, then
    text reads (a label-only round takes the capacity without reads of its size)."""
    plan = plan_of(round_)
    first = bisect.bisect_right(ladder, plan.num_real, key=lambda capacity: capacity.tokens)  # fewer tokens never fit
    return next((capacity for capacity in ladder[first:] if capacity.fits(plan)), None)


def pad_round(round_: RoundPlan | HostRound, capacity: Capacity, window_sink: int) -> HostRound:
    """A round padded to `capacity` (staged there, expanded by the reference); `window_sink`: the pool slot
    that padded conv-window saves write to and padded resumes read."""
    if not capacity.fits(round_):
        raise ValueError(f"the round does not fit {capacity}")
    return HostRound.of(plan_of(round_), capacity.shape, window_sink)
