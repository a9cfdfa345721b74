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
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class StateRows:
    """Rows of the Gated DeltaNet state arena a round uses: pool slot s is row `slot_base + s`, row `zero`
    is always zero, and rows [scratch, scratch + scratch_count) hold the states of trunks and continued branch
    pieces during a round."""

    zero: int
    scratch: int
    scratch_count: int
    slot_base: int = 0

    @classmethod
    def compact(cls, requests: Sequence[RequestSpec]) -> StateRows:
        """A small standalone table for tests and benchmarks: zero row 0, slots from 1, scratch after them."""
        saving = [r for request in requests for r in request.tree()]
        slots = [r.resume.slot for r in requests if r.resume] + [r.save.slot for r in saving if r.save]
        scratch = 2 + max(slots, default=-1)
        return cls(zero=0, scratch=scratch, scratch_count=state_rows_needed(requests), slot_base=1)

    @property
    def num_rows(self) -> int:
        return self.scratch + self.scratch_count


@dataclass(frozen=True)
class Resume:
    """Where a request resumes: the pool slot of its checkpoint and the KV pages covering [0, start), of the full
    layers and of the sliding ones (the sink page before their window; empty without sliding layers)."""

    slot: int
    pages: np.ndarray
    sliding_pages: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@dataclass(frozen=True)
class Save:
    """A checkpoint a request writes: at absolute position `at`, into pool `slot`; flat KV slots of [start, at), of
    the full layers and of the sliding ones (the sink before the window; empty without sliding layers)."""

    at: int
    slot: int
    kv_slots: np.ndarray
    sliding_kv_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@dataclass(frozen=True)
class TextReads:
    """The token reads of text-scored questions: the log-probability of token `target` at stream offset
    `offset` (from the first branch token of its `Branches`), summed into option `option` of question
    `question` (an index into its `Branches`' questions)."""

    offset: np.ndarray
    target: np.ndarray
    question: np.ndarray
    option: np.ndarray

    @classmethod
    def empty(cls) -> TextReads:
        return cls(*(np.zeros(0, np.int64) for _ in range(4)))

    @classmethod
    def concat(cls, parts: Sequence[TextReads]) -> TextReads:
        return cls(*(np.concatenate([getattr(p, name) for p in parts]) for name in ("offset", "target", "question",
                                                                                      "option")))

    def shifted(self, offset: int, question: int) -> TextReads:
        """The reads with offsets from `offset` tokens earlier and question indices from `question` earlier."""
        return TextReads(self.offset + offset, self.target, self.question + question, self.option)

    def __len__(self) -> int:
        return len(self.offset)

    def scores(self, label_logprobs: np.ndarray, logprobs: np.ndarray) -> np.ndarray:
        """`label_logprobs` [questions, L] with each text-scored question's row the log_softmax over its options
        of their reads' log-probabilities `logprobs` [X or more: the first X are read], each option's summed in
        read order, in float64 (-inf past its options; without reads: `label_logprobs` itself)."""
        if not len(self):
            return label_logprobs
        out = label_logprobs.astype(np.float64)
        sums = np.zeros(out.shape)
        np.add.at(sums, (self.question, self.option), logprobs[: len(self)].astype(np.float64))
        for question in np.unique(self.question).tolist():
            options = int(self.option[self.question == question].max()) + 1
            row = sums[question, :options] - sums[question, :options].max()
            out[question] = -np.inf
            out[question, :options] = row - np.log(np.exp(row).sum())
        return out


def common_prefix(sequences: Sequence[np.ndarray]) -> int:
    """The length of the longest prefix every sequence shares."""
    shortest = min(len(sequence) for sequence in sequences)
    differs = np.zeros(shortest, dtype=bool)
    for sequence in sequences[1:]:
        differs |= sequences[0][:shortest] != sequence[:shortest]
    return int(np.argmax(differs)) if differs.any() else shortest


@dataclass(frozen=True)
class Branches:
    """The branch pieces of one or more questions, concatenated in tree order (a piece before its children):
    ids, each piece's length and parent (-1: the trunk; else the index of the piece it continues), each
    question's label ids (one row per question, padded with -1), its readout offset (its first piece's last
    token), its number of pieces (`counts`) and the reads of its text-scored options (`reads`). A label question
    is one piece, read at its last token; a text-scored question is its question piece and, under it, its
    options' tokens as a tree of two levels: the options with the same first token share a piece of their common
    prefix, each option's rest a piece under it (an option's `<|im_end|>` is read, never fed). Built once per ask,
    when it is submitted."""

    ids: np.ndarray
    lengths: np.ndarray
    parents: np.ndarray
    labels: np.ndarray
    readout: np.ndarray
    counts: np.ndarray
    reads: TextReads

    @classmethod
    def of(cls, branches: Sequence[np.ndarray], labels: Sequence[np.ndarray],
           replies: Sequence[Sequence[np.ndarray]] | None = None, shared: Sequence[bool] | None = None) -> Branches:
        """One question per branch (`labels`: its label ids), or, where `replies[i]` is not empty, question i
        scored by the text of its options: reply r (the option's tokens, then the end of the turn) is read at the
        question's last token and at the option's tokens; its label row holds one label (any finite row). The
        questions where `shared[i]` is set read inside one piece, the longest of their branches, each at its own
        branch's last token (each must be a prefix of that piece: one prompt read at several marks)."""
        if len(branches) != len(labels) or replies is not None and len(replies) != len(branches):
            raise ValueError("one label array (and one reply list) per question")
        if any(len(branch) == 0 for branch in branches):
            raise ValueError("a branch must have at least one token")
        in_piece = [False] * len(branches) if shared is None else list(shared)
        piece = max((b for b, s in zip(branches, in_piece) if s), key=len, default=None)
        parts, lengths, parents, counts, rows, readout = [], [], [], [], [], []
        reads = [[], [], [], []]
        at, piece_at = 0, None
        for index, (branch, label) in enumerate(zip(branches, labels)):
            options = () if replies is None else replies[index]
            if in_piece[index]:
                if piece_at is None:
                    piece_at = at
                    parts.append(piece)
                    lengths.append(len(piece))
                    parents.append(-1)
                    at += len(piece)
                readout.append(piece_at + len(branch) - 1)
                counts.append(int(len(branch) == len(piece)))  # the piece counted once: with its longest reader
                rows.append(label)
                continue
            question = len(lengths)
            parts.append(branch)
            lengths.append(len(branch))
            parents.append(-1)
            at += len(branch)
            readout.append(at - 1)
            if not len(options):
                counts.append(1)
                rows.append(label)
                continue
            if any(len(reply) < 2 for reply in options):
                raise ValueError("a reply holds an option's tokens and the end of the turn")
            groups: dict[int, list[int]] = {}  # options by first token, in order
            for option, reply in enumerate(options):
                groups.setdefault(int(reply[0]), []).append(option)
            for members in groups.values():
                tokens = [np.asarray(options[option][:-1]) for option in members]
                shared = len(tokens[0]) if len(members) == 1 else common_prefix(tokens)
                node, node_at = len(lengths), at
                parts.append(tokens[0][:shared])
                lengths.append(shared)
                parents.append(question)
                at += shared
                for option, sequence in zip(members, tokens):
                    offsets = [np.array([readout[-1]]), np.arange(node_at, node_at + min(shared, len(sequence)))]
                    if len(sequence) > shared:  # the rest of the option, a piece under the shared prefix
                        parts.append(sequence[shared:])
                        lengths.append(len(sequence) - shared)
                        parents.append(node)
                        offsets.append(np.arange(at, at + len(sequence) - shared))
                        at += len(sequence) - shared
                    reads[0].append(np.concatenate(offsets))
                    reads[1].append(np.asarray(options[option]))
                    reads[2].append(np.full(len(sequence) + 1, index))
                    reads[3].append(np.full(len(sequence) + 1, option))
            counts.append(len(lengths) - question)
            rows.append(np.array([0] + [-1] * (len(options) - 1)))  # one label: a finite softmax, not read
        widths = [len(row) for row in rows]
        width = max(widths, default=1)
        if widths and min(widths) == width:  # as many labels in every row (questions of one kind)
            table = np.array(rows, dtype=np.int64).reshape(len(rows), width)
        else:
            table = np.full((len(rows), width), -1, dtype=np.int64)
            for row, label in enumerate(rows):
                table[row, : len(label)] = label
        ids = np.concatenate(parts, dtype=np.int64, casting="unsafe") if parts else np.zeros(0, np.int64)
        text = TextReads(*(np.concatenate(r).astype(np.int64) for r in reads)) if reads[0] else TextReads.empty()
        return cls(ids, np.array(lengths, dtype=np.int64), np.array(parents, dtype=np.int64), table,
                   np.array(readout, dtype=np.int64), np.array(counts, dtype=np.int64), text)

    @classmethod
    def join(cls, parts: Sequence[Branches]) -> Branches:
        if not parts:
            return cls.of([], [])
        if len(parts) == 1:
            return parts[0]
        width = max(part.labels.shape[1] for part in parts)
        labels = np.full((sum(len(part) for part in parts), width), -1, dtype=np.int64)
        row = 0
        for part in parts:
            labels[row : row + len(part), : part.labels.shape[1]] = part.labels
            row += len(part)
        reads, at, first, pieces, text, parents, readout = TextReads.empty(), 0, 0, 0, [], [], []
        for part in parts:  # most asks have no text-scored question: no arrays made for them
            if len(part.reads):
                text.append(part.reads.shifted(at, first))
            parents.append(np.where(part.parents < 0, -1, part.parents + pieces))
            readout.append(part.readout + at)
            at, first, pieces = at + len(part.ids), first + len(part), pieces + len(part.lengths)
        if text:
            reads = TextReads.concat(text)
        return cls(np.concatenate([p.ids for p in parts]), np.concatenate([p.lengths for p in parts]),
                   np.concatenate(parents), labels, np.concatenate(readout), np.concatenate([p.counts for p in parts]),
                   reads)

    def __len__(self) -> int:
        """Questions (readout rows)."""
        return len(self.labels)

    @property
    def inner(self) -> int:
        """Pieces that others continue: each keeps its final state in a scratch state row during a round."""
        return len(np.unique(self.parents[self.parents >= 0]))


def state_rows_needed(requests: Sequence[RequestSpec]) -> int:
    """Scratch state rows a round of `requests` uses: per request and fork, its trunk's final state, one per
    branch piece others continue, and a split row where forks continue it without a save."""
    return sum(1 + r.branches.inner + (r.save is None and bool(r.forks))
               for request in requests for r in request.tree())


@dataclass(frozen=True)
class RequestSpec:
    """One request of a round: trunk token ids from position `start`, its branches (one per question), and its
    forks: requests computed in the same round that continue its trunk from its save point (their `start`;
    they neither resume nor save past a save of this one's)."""

    trunk: np.ndarray
    branches: Branches
    start: int = 0
    resume: Resume | None = None
    save: Save | None = None
    forks: tuple[RequestSpec, ...] = ()

    def tree(self) -> list[RequestSpec]:
        """This request and its forks, depth first (stream order)."""
        return [self, *(spec for fork in self.forks for spec in fork.tree())]

    @classmethod
    def of(cls, trunk: np.ndarray, branches: Sequence[np.ndarray], labels: Sequence[np.ndarray], **where) -> RequestSpec:
        """From per-question branch and label arrays (tests, benchmarks)."""
        return cls(np.asarray(trunk, dtype=np.int64), Branches.of(branches, labels), **where)

    @property
    def num_tokens(self) -> int:
        return len(self.trunk) + int(self.branches.lengths.sum())
