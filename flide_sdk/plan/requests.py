"""What a round is asked to compute: requests (a trunk and its branches, one per question), where a request
resumes from and saves a checkpoint, and the rows of the Gated DeltaNet state arena a round may use. Built by
the scheduler per ask; `tree.RoundPlan` lays a list of them out as one flat stream.

A request may *resume* from a checkpoint at position r (its trunk in the stream then starts at r: keys and
values of [0, r) come from pool pages, the Gated DeltaNet state and conv window from a pool slot) and may
*save* a checkpoint at its stable boundary m (the trunk then runs as two segments split at m, and the
state at m, the conv inputs before m and the keys/values of [r, m) are written to the pool).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StateRows:
    """Rows of the Gated DeltaNet state arena a round uses: pool slot s is row `slot_base + s`, row `zero`
    is always zero, and rows [scratch, scratch + scratch_count) hold trunk states during a round."""

    zero: int
    scratch: int
    scratch_count: int
    slot_base: int = 0

    @classmethod
    def compact(cls, requests: Sequence[RequestSpec]) -> StateRows:
        """A small standalone table for tests and benchmarks: zero row 0, slots from 1, scratch after them."""
        slots = [r.resume.slot for r in requests if r.resume] + [r.save.slot for r in requests if r.save]
        scratch = 2 + max(slots, default=-1)
        return cls(zero=0, scratch=scratch, scratch_count=len(requests), slot_base=1)

    @property
    def num_rows(self) -> int:
        return self.scratch + self.scratch_count


@dataclass(frozen=True)
class Resume:
    """Where a request resumes: the pool slot of its checkpoint and the KV pages covering [0, start)."""

    slot: int
    pages: np.ndarray


@dataclass(frozen=True)
class Save:
    """A checkpoint a request writes: at absolute position `at`, into pool `slot`; flat KV slots of [start, at)."""

    at: int
    slot: int
    kv_slots: np.ndarray


@dataclass(frozen=True)
class Branches:
    """The branches of one or more questions, concatenated: ids, each branch's length, its label ids
    (one row per branch, padded with -1). Built once per ask, when it is submitted."""

    ids: np.ndarray
    lengths: np.ndarray
    labels: np.ndarray

    @classmethod
    def of(cls, branches: Sequence[np.ndarray], labels: Sequence[np.ndarray]) -> Branches:
        if len(branches) != len(labels):
            raise ValueError("one label array per branch")
        lengths = np.array([len(branch) for branch in branches], dtype=np.int64)
        if (lengths == 0).any():
            raise ValueError("a branch must have at least one token")
        widths = [len(label) for label in labels]
        width = max(widths, default=1)
        if widths and min(widths) == width:  # as many labels in every row (questions of one kind)
            table = np.array(labels, dtype=np.int64).reshape(len(labels), width)
        else:
            table = np.full((len(labels), width), -1, dtype=np.int64)
            for row, label in enumerate(labels):
                table[row, : len(label)] = label
        ids = np.concatenate(branches, dtype=np.int64, casting="unsafe") if branches else np.zeros(0, np.int64)
        return cls(ids, lengths, table)

    @classmethod
    def join(cls, parts: Sequence[Branches]) -> Branches:
        if len(parts) == 1:
            return parts[0]
        width = max(part.labels.shape[1] for part in parts)
        labels = np.full((sum(len(part) for part in parts), width), -1, dtype=np.int64)
        row = 0
        for part in parts:
            labels[row : row + len(part), : part.labels.shape[1]] = part.labels
            row += len(part)
        return cls(np.concatenate([p.ids for p in parts]), np.concatenate([p.lengths for p in parts]), labels)

    def __len__(self) -> int:
        return len(self.lengths)


@dataclass(frozen=True)
class RequestSpec:
    """One request of a round: trunk token ids from position `start`, and its branches (one per question)."""

    trunk: np.ndarray
    branches: Branches
    start: int = 0
    resume: Resume | None = None
    save: Save | None = None

    @classmethod
    def of(cls, trunk: np.ndarray, branches: Sequence[np.ndarray], labels: Sequence[np.ndarray], **where) -> RequestSpec:
        """From per-question branch and label arrays (tests, benchmarks)."""
        return cls(np.asarray(trunk, dtype=np.int64), Branches.of(branches, labels), **where)

    @property
    def num_tokens(self) -> int:
        return len(self.trunk) + int(self.branches.lengths.sum())
