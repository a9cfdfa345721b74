"""`Ask`: one request on its way through the engine, from the asking thread's validation to its answers.

The asking thread builds it whole (questions parsed and rendered, state tokenized, branches laid out), so
the round thread only schedules, concatenates and launches.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from flide_sdk.plan.layout import Branches
from flide_sdk.prompt.base import RenderedQuestion
from flide_sdk.questions import Question, SystemOneResponse, Usage
from flide_sdk.text.history import BLOCK, Trunk


@dataclass(frozen=True)
class TrunkKey:
    """Equal for asks with the same trunk (a quick filter: `Ask.same_trunk` compares the tokens)."""

    length: int
    boundary: int
    boundary_hash: int


@dataclass(eq=False)
class Ask:
    """A validated ask: its trunk, questions and their rendered branches, the future its caller awaits, and
    when it was queued (time.perf_counter())."""

    trunk: Trunk
    questions: dict[str, Question]
    rendered: dict[str, RenderedQuestion]
    branches: Branches = field(init=False)
    branch_tokens: int = field(init=False)  # stream tokens of its branches
    option_counts: list[int] = field(init=False)  # each question's number of options, in question order
    temperatures: list[float] = field(init=False)  # each question's (a decision model's; 1: none)
    prompt_tokens: int = field(init=False)  # the prompts' tokens: the trunk, and each question's text once
    output_tokens: int = field(init=False)  # the reply tokens read: one label per question, or its options' replies
    trunk_key: TrunkKey = field(init=False)
    first_block: int | None = field(init=False)  # hash of the first BLOCK tokens (None if shorter)
    future: Future = field(default_factory=Future)
    queued_at: float = 0.0

    def __post_init__(self) -> None:
        """Everything the round thread reads about the ask, computed once here on the asking thread."""
        rendered = [self.rendered[name] for name in self.questions]
        self.branches = Branches.of([q.ids for q in rendered], [q.label_ids for q in rendered],
                                    [q.replies for q in rendered], [q.shared for q in rendered])
        self.branch_tokens = int(self.branches.lengths.sum())
        self.option_counts = [q.options for q in rendered]
        self.temperatures = [q.temperature for q in rendered]
        self.prompt_tokens = len(self.trunk) + sum(len(q.ids) for q in rendered if not q.shared) + max(
            (len(q.ids) for q in rendered if q.shared), default=0)
        self.output_tokens = sum(sum(len(reply) for reply in q.replies) or 1 for q in rendered)
        trunk = self.trunk
        self.trunk_key = TrunkKey(len(trunk), trunk.boundary, trunk.block_hash(trunk.boundary // BLOCK))
        self.first_block = trunk.block_hash(1) if len(trunk) >= BLOCK else None

    @property
    def tokens(self) -> int:
        """Stream tokens this ask adds to a round at most (before any checkpoint is found)."""
        return self.trunk.fresh + self.branch_tokens

    def same_trunk(self, other: Ask) -> bool:
        a, b = self.trunk, other.trunk
        return (
            len(a) == len(b)
            and a.boundary == b.boundary
            and a.block_hash(a.boundary // BLOCK) == b.block_hash(b.boundary // BLOCK)  # stored hashes: a quick no
            and np.array_equal(a.tail, b.tail)
            and a.marks(len(a)) == b.marks(len(b))
            and a.prefix_equals(b.buffer, b.boundary)
        )


@dataclass(eq=False)
class AskGroup:
    """One request whose questions a decision model's prompts split over several trunks: an ask per trunk,
    queued together (so they share a round), answered as one response in the request's question order."""

    asks: list[Ask]
    names: list[str]

    def merge(self, responses: list[SystemOneResponse]) -> SystemOneResponse:
        answers = {name: answer for response in responses for name, answer in response.items()}
        usage = Usage(input_tokens=sum(r.usage.input_tokens for r in responses),
                      output_tokens=sum(r.usage.output_tokens for r in responses))
        return SystemOneResponse({name: answers[name] for name in self.names}, model=responses[0].model, usage=usage)
