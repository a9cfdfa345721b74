"""The flat stream of a round (DESIGN.md §5): token packing and every piece of metadata the kernels read.

A round is a list of requests, each a trunk (the state) and branches (one per question). The stream packs
each request's trunk then its branches, with no padding between requests. This module turns the list of
requests into host arrays (numpy) once, and `HostRound.to(device)` copies them in one go. Nothing here
looks at the model's weights; the model and kernels only read the resulting tensors.

A request may *resume* from a checkpoint at position r (its trunk in the stream then starts at r: keys and
values of [0, r) come from pool pages, the Gated DeltaNet state and conv window from a pool slot) and may
*save* a checkpoint at its stable boundary m (the trunk then runs as two segments split at m, and the
state at m, the conv inputs before m and the keys/values of [r, m) are written to the pool).

Visibility (the exactness contract): a trunk token sees its history and its trunk up to itself; a branch
token sees the history, the whole trunk and its own branch up to itself. In stream coordinates every
token t sees its request's cached history, the keys [key_lo, ctx_hi) (the trunk, for branch tokens) and
[seg_lo, t] (its own segment).

Gated DeltaNet runs level by level: trunks up to their save point, trunk remainders, then branches, each
segment starting from a row of a per-round state table (row 0 zero, then the resumed states, then the
rows segments write). Within a level, segments are sorted by chunk count, longest first, and chunks are
stored step-major, so at scan step j the active segments are exactly the first `active[j]`.
The short convolution reads each token's predecessors through `conv_src`, rows of the table
[zero row, stream tokens, resumed conv windows], so a branch's first tokens read its trunk's last tokens
and a resumed trunk reads its saved window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

GDN_CHUNK = 64
PAGE = 64  # tokens per key/value page of the checkpoint pool
ZERO_ROW = 0
DISCARD_ROW = -1


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
class RequestSpec:
    """One request of a round: trunk token ids from position `start`, and per question its branch and labels."""

    trunk: np.ndarray
    branches: Sequence[np.ndarray]
    labels: Sequence[np.ndarray]
    start: int = 0
    resume: Resume | None = None
    save: Save | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.trunk) + sum(len(branch) for branch in self.branches)


@dataclass
class AttentionPlan:
    key_lo: torch.Tensor  # [T] first stream index of the token's request
    ctx_hi: torch.Tensor  # [T] end of the fully visible range [key_lo, ctx_hi) (the trunk, for branch tokens)
    seg_lo: torch.Tensor  # [T] start of the token's own causal segment
    request_of: torch.Tensor  # [T] request index of each token
    history_len: torch.Tensor  # [R] cached positions [0, r) of each request (keys/values in pool pages)
    page_table: torch.Tensor  # [R, max pages] pool page of each cached PAGE-token block, padded with 0
    request_bounds: list[tuple[int, int]]  # host: stream [start, end) of each request (reference op)
    history: list[tuple[int, torch.Tensor | None]]  # host: per request, cached length r and its pages


@dataclass
class DeltaLevel:
    chunk_tokens: torch.Tensor  # [num_chunks, GDN_CHUNK] stream index per chunk position, T for padding
    active: list[int]  # host: active segments at scan step j (non-increasing)
    init_row: torch.Tensor  # [num_segments] state-table row each segment starts from
    final_row: torch.Tensor  # [num_segments] row its final state is written to (DISCARD_ROW: none)
    chunk_count: torch.Tensor  # [num_segments] chunks (scan steps) of each segment
    step_start: torch.Tensor  # [num_steps] first chunk row of step j: segment s's chunk j is row step_start[j] + s


@dataclass
class DeltaPlan:
    levels: list[DeltaLevel]
    num_rows: int


@dataclass
class CheckpointPlan:
    """Pool traffic of a round: states and windows read at resume, everything written at save."""

    resume_slots: torch.Tensor  # [n_resume] pool slots copied into state-table rows 1..n_resume
    save_slots: torch.Tensor  # [n_save] pool slots written
    save_rows: torch.Tensor  # [n_save] state-table rows holding the state at each save point
    save_window_src: torch.Tensor  # [n_save, K-1] conv-table rows of the conv inputs before each save point
    kv_rows: torch.Tensor  # [N] stream rows whose keys/values are saved
    kv_slots: torch.Tensor  # [N] flat pool positions (page * PAGE + offset) they go to

    @property
    def saves(self) -> bool:
        return self.save_slots.numel() > 0


@dataclass
class ReadoutPlan:
    rows: torch.Tensor  # [R] stream index of each question's last token
    label_ids: torch.Tensor  # [R, L] label token ids, padded with 0
    label_valid: torch.Tensor  # [R, L] which label columns are real


@dataclass
class RoundTensors:
    """Everything the forward of one round reads, on the device."""

    ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] position of each token in its standalone prompt
    attention: AttentionPlan
    delta: DeltaPlan
    conv_src: torch.Tensor  # [T, K] rows of the conv table feeding each conv tap, oldest first
    checkpoint: CheckpointPlan
    readout: ReadoutPlan


@dataclass
class _Segment:
    start: int
    length: int
    init_row: int
    final_row: int


@dataclass
class _HostLevel:
    chunk_tokens: np.ndarray
    active: list[int]
    init_row: np.ndarray
    final_row: np.ndarray
    chunk_count: np.ndarray
    step_start: np.ndarray


@dataclass
class HostRound:
    """The host arrays of a round; `to(device)` gives the `RoundTensors` the model reads."""

    ids: np.ndarray
    positions: np.ndarray
    key_lo: np.ndarray
    ctx_hi: np.ndarray
    seg_lo: np.ndarray
    request_of: np.ndarray
    request_bounds: list[tuple[int, int]]
    history: list[tuple[int, np.ndarray | None]]
    levels: list[_HostLevel]
    num_rows: int
    conv_src: np.ndarray
    resume_slots: np.ndarray
    save_slots: np.ndarray
    save_rows: np.ndarray
    save_window_src: np.ndarray
    kv_rows: np.ndarray
    kv_slots: np.ndarray
    readout_rows: np.ndarray
    label_ids: np.ndarray
    label_valid: np.ndarray

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def to(self, device: torch.device | str) -> RoundTensors:
        def dev(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device, non_blocking=True)

        levels = [
            DeltaLevel(
                dev(v.chunk_tokens), v.active, dev(v.init_row), dev(v.final_row), dev(v.chunk_count), dev(v.step_start)
            )
            for v in self.levels
        ]
        history = [(length, None if pages is None else dev(pages)) for length, pages in self.history]
        history_len = np.array([length for length, _ in self.history], dtype=np.int64)
        page_table = np.zeros((len(self.history), max(1, -(-int(history_len.max(initial=0)) // PAGE))), dtype=np.int64)
        for row, (length, pages) in enumerate(self.history):
            if length:
                page_table[row, : len(pages)] = pages
        attention = AttentionPlan(
            dev(self.key_lo), dev(self.ctx_hi), dev(self.seg_lo), dev(self.request_of), dev(history_len),
            dev(page_table), self.request_bounds, history,
        )
        return RoundTensors(
            ids=dev(self.ids),
            positions=dev(self.positions),
            attention=attention,
            delta=DeltaPlan(levels, self.num_rows),
            conv_src=dev(self.conv_src),
            checkpoint=CheckpointPlan(
                dev(self.resume_slots), dev(self.save_slots), dev(self.save_rows), dev(self.save_window_src),
                dev(self.kv_rows), dev(self.kv_slots),
            ),
            readout=ReadoutPlan(dev(self.readout_rows), dev(self.label_ids), dev(self.label_valid)),
        )


@dataclass
class _Builder:
    """Accumulates the per-request pieces of a round before they become arrays."""

    num_resumed: int
    request_bounds: list[tuple[int, int]] = field(default_factory=list)
    history: list[tuple[int, np.ndarray | None]] = field(default_factory=list)
    levels: tuple[list[_Segment], ...] = field(default_factory=lambda: ([], [], []))
    next_row: int = 0
    resume_slots: list[int] = field(default_factory=list)
    save_slots: list[int] = field(default_factory=list)
    save_rows: list[int] = field(default_factory=list)
    save_window_src: list[np.ndarray] = field(default_factory=list)
    kv_rows: list[np.ndarray] = field(default_factory=list)
    kv_slots: list[np.ndarray] = field(default_factory=list)
    readout_rows: list[int] = field(default_factory=list)
    labels: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.next_row = 1 + self.num_resumed

    def take_row(self) -> int:
        self.next_row += 1
        return self.next_row - 1


def plan_round(requests: Sequence[RequestSpec], conv_kernel: int) -> HostRound:
    """Lay out `requests` as one flat stream and build all metadata (host side, numpy)."""
    total = sum(request.num_tokens for request in requests)
    build = _Builder(sum(request.resume is not None for request in requests))
    ids = np.empty(total, dtype=np.int64)
    positions = np.empty(total, dtype=np.int64)
    key_lo = np.empty(total, dtype=np.int64)
    ctx_hi = np.empty(total, dtype=np.int64)
    seg_lo = np.empty(total, dtype=np.int64)
    request_of = np.empty(total, dtype=np.int64)
    conv_src = np.zeros((total, conv_kernel), dtype=np.int64)
    taps = np.arange(-(conv_kernel - 1), 1, dtype=np.int64)

    cursor = 0
    for request in requests:
        start, first, computed = cursor, request.start, len(request.trunk)
        end_of_trunk = first + computed  # absolute position just past the trunk
        window_base = 1 + total + len(build.resume_slots) * (conv_kernel - 1)

        def trunk_rows(q: np.ndarray) -> np.ndarray:
            """Conv-table row of the conv input at absolute trunk position q (q < end_of_trunk)."""
            resumed = np.where(q >= 0, window_base + q - first + conv_kernel - 1, ZERO_ROW)
            return np.where(q >= first, start + q - first + 1, resumed)

        if (first > 0) != (request.resume is not None):
            raise ValueError("a request starts past position 0 exactly when it resumes from a checkpoint")
        resume_row = ZERO_ROW
        if request.resume is not None:
            resume_row = 1 + len(build.resume_slots)
            build.resume_slots.append(request.resume.slot)
        build.history.append((first, None if request.resume is None else request.resume.pages))

        trunk = slice(start, start + computed)
        ids[trunk] = request.trunk
        positions[trunk] = first + np.arange(computed)
        key_lo[trunk] = ctx_hi[trunk] = seg_lo[trunk] = start
        conv_src[trunk] = trunk_rows(positions[trunk, None] + taps[None, :])

        trunk_row = build.take_row()
        if request.save is not None:
            save = request.save
            if not first < save.at <= end_of_trunk:
                raise ValueError(f"save point {save.at} outside the computed trunk ({first}, {end_of_trunk}]")
            split = save.at - first
            save_row = trunk_row if split == computed else build.take_row()
            build.levels[0].append(_Segment(start, split, resume_row, save_row))
            if split < computed:
                build.levels[1].append(_Segment(start + split, computed - split, save_row, trunk_row))
            build.save_slots.append(save.slot)
            build.save_rows.append(save_row)
            build.save_window_src.append(trunk_rows(save.at + taps[:-1]))
            build.kv_rows.append(start + np.arange(split))
            build.kv_slots.append(np.asarray(save.kv_slots, dtype=np.int64))
        else:
            build.levels[0].append(_Segment(start, computed, resume_row, trunk_row))
        cursor += computed

        for branch, label in zip(request.branches, request.labels):
            span = slice(cursor, cursor + len(branch))
            ids[span] = branch
            positions[span] = end_of_trunk + np.arange(len(branch))
            key_lo[span] = start
            ctx_hi[span] = start + computed
            seg_lo[span] = cursor
            pred = positions[span, None] + taps[None, :]
            conv_src[span] = np.where(pred >= end_of_trunk, cursor + pred - end_of_trunk + 1, trunk_rows(pred))
            build.levels[2].append(_Segment(cursor, len(branch), trunk_row, DISCARD_ROW))
            cursor += len(branch)
            build.readout_rows.append(cursor - 1)
            build.labels.append(np.asarray(label, dtype=np.int64))
        request_of[start:cursor] = len(build.request_bounds)
        build.request_bounds.append((start, cursor))

    max_labels = max((len(label) for label in build.labels), default=1)
    label_ids = np.zeros((len(build.labels), max_labels), dtype=np.int64)
    label_valid = np.zeros((len(build.labels), max_labels), dtype=bool)
    for row, label in enumerate(build.labels):
        label_ids[row, : len(label)] = label
        label_valid[row, : len(label)] = True

    levels = [_plan_level(segments, total) for segments in build.levels]
    return HostRound(
        ids=ids,
        positions=positions,
        key_lo=key_lo,
        ctx_hi=ctx_hi,
        seg_lo=seg_lo,
        request_of=request_of,
        request_bounds=build.request_bounds,
        history=build.history,
        levels=[level for level in levels if level is not None],
        num_rows=build.next_row,
        conv_src=conv_src,
        resume_slots=np.asarray(build.resume_slots, dtype=np.int64),
        save_slots=np.asarray(build.save_slots, dtype=np.int64),
        save_rows=np.asarray(build.save_rows, dtype=np.int64),
        save_window_src=np.array(build.save_window_src, dtype=np.int64).reshape(-1, conv_kernel - 1),
        kv_rows=_concatenate(build.kv_rows),
        kv_slots=_concatenate(build.kv_slots),
        readout_rows=np.asarray(build.readout_rows, dtype=np.int64),
        label_ids=label_ids,
        label_valid=label_valid,
    )


def _concatenate(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _plan_level(segments: list[_Segment], pad_index: int) -> _HostLevel | None:
    if not segments:
        return None
    ordered = sorted(segments, key=lambda s: -s.length)
    chunk_counts = np.array([-(-s.length // GDN_CHUNK) for s in ordered], dtype=np.int64)
    active = [int((chunk_counts > j).sum()) for j in range(int(chunk_counts[0]))]
    chunk_tokens = np.full((sum(active), GDN_CHUNK), pad_index, dtype=np.int64)
    within = np.arange(GDN_CHUNK, dtype=np.int64)
    row = 0
    for j, count in enumerate(active):
        for segment in ordered[:count]:
            offset = j * GDN_CHUNK
            length = min(GDN_CHUNK, segment.length - offset)
            chunk_tokens[row, :length] = segment.start + offset + within[:length]
            row += 1
    return _HostLevel(
        chunk_tokens=chunk_tokens,
        active=active,
        init_row=np.array([s.init_row for s in ordered], dtype=np.int64),
        final_row=np.array([s.final_row for s in ordered], dtype=np.int64),
        chunk_count=chunk_counts,
        step_start=np.cumsum([0, *active[:-1]], dtype=np.int64),
    )
