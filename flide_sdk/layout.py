"""The flat stream of a round (DESIGN.md §5): token packing and every piece of metadata the kernels read.

A round is a list of requests, each a trunk (the state) and branches (one per question). The stream packs
each request's trunk then its branches, with no padding between requests. This module turns the list of
requests into host arrays (numpy) once, and `HostRound.to(device)` copies them in one go. Nothing here
looks at the model's weights; the model and kernels only read the resulting tensors.

Visibility (the exactness contract): a trunk token sees its trunk up to itself; a branch token sees the
whole trunk and its own branch up to itself. In stream coordinates every token t sees the keys
[key_lo, ctx_hi) (its request's trunk, empty for trunk tokens) and [seg_lo, t] (its own segment).

Gated DeltaNet runs level by level: level 0 holds the trunks (from a zero state), level 1 the branches,
each starting from the final state of its trunk, referenced by slot index in a per-round state table
(slot 0 is the zero state). Within a level, segments are sorted by chunk count, longest first, and chunks
are stored step-major, so at scan step j the active segments are exactly the first `active[j]`.
The short convolution reads each token's predecessors through `conv_src`: row 0 is a zero row, row 1 + t
is stream token t, so a branch's first tokens read its trunk's last tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

GDN_CHUNK = 64
ZERO_SLOT = 0
DISCARD_SLOT = -1


@dataclass(frozen=True)
class RequestSpec:
    """One request of a round: trunk token ids, and per question its branch ids and label token ids."""

    trunk: np.ndarray
    branches: Sequence[np.ndarray]
    labels: Sequence[np.ndarray]

    @property
    def num_tokens(self) -> int:
        return len(self.trunk) + sum(len(branch) for branch in self.branches)


@dataclass
class AttentionPlan:
    key_lo: torch.Tensor  # [T] first stream index of the token's request
    ctx_hi: torch.Tensor  # [T] end of the fully visible range [key_lo, ctx_hi) (the trunk, for branch tokens)
    seg_lo: torch.Tensor  # [T] start of the token's own causal segment
    request_bounds: list[tuple[int, int]]  # host: stream [start, end) of each request


@dataclass
class DeltaLevel:
    chunk_tokens: torch.Tensor  # [num_chunks, GDN_CHUNK] stream index per chunk position, T for padding
    active: list[int]  # host: active segments at scan step j (non-increasing)
    init_slot: torch.Tensor  # [num_segments] state-table slot each segment starts from
    final_slot: torch.Tensor  # [num_segments] slot its final state is written to (DISCARD_SLOT: none)


@dataclass
class DeltaPlan:
    levels: list[DeltaLevel]
    num_slots: int


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
    conv_src: torch.Tensor  # [T, K] rows of cat(zero row, stream) feeding each conv tap, oldest first

    readout: ReadoutPlan


@dataclass
class _HostLevel:
    chunk_tokens: np.ndarray
    active: list[int]
    init_slot: np.ndarray
    final_slot: np.ndarray


@dataclass
class HostRound:
    """The host arrays of a round; `to(device)` gives the `RoundTensors` the model reads."""

    ids: np.ndarray
    positions: np.ndarray
    key_lo: np.ndarray
    ctx_hi: np.ndarray
    seg_lo: np.ndarray
    request_bounds: list[tuple[int, int]]
    levels: list[_HostLevel]
    num_slots: int
    conv_src: np.ndarray
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
            DeltaLevel(dev(level.chunk_tokens), level.active, dev(level.init_slot), dev(level.final_slot))
            for level in self.levels
        ]
        return RoundTensors(
            ids=dev(self.ids),
            positions=dev(self.positions),
            attention=AttentionPlan(dev(self.key_lo), dev(self.ctx_hi), dev(self.seg_lo), self.request_bounds),
            delta=DeltaPlan(levels, self.num_slots),
            conv_src=dev(self.conv_src),
            readout=ReadoutPlan(dev(self.readout_rows), dev(self.label_ids), dev(self.label_valid)),
        )


@dataclass
class _Segment:
    start: int
    length: int
    init_slot: int
    final_slot: int


def plan_round(requests: Sequence[RequestSpec], conv_kernel: int) -> HostRound:
    """Lay out `requests` as one flat stream and build all metadata (host side, numpy)."""
    total = sum(request.num_tokens for request in requests)
    ids = np.empty(total, dtype=np.int64)
    positions = np.empty(total, dtype=np.int64)
    key_lo = np.empty(total, dtype=np.int64)
    ctx_hi = np.empty(total, dtype=np.int64)
    seg_lo = np.empty(total, dtype=np.int64)
    # predecessor position of each token in its standalone prompt, per conv tap (oldest first)
    conv_src = np.zeros((total, conv_kernel), dtype=np.int64)
    taps = np.arange(-(conv_kernel - 1), 1, dtype=np.int64)

    request_bounds: list[tuple[int, int]] = []
    trunk_segments: list[_Segment] = []
    branch_segments: list[_Segment] = []
    readout_rows: list[int] = []
    labels: list[np.ndarray] = []
    cursor = 0
    for request in requests:
        start = cursor
        trunk_len = len(request.trunk)
        trunk_slot = len(trunk_segments) + 1
        trunk = slice(start, start + trunk_len)
        ids[trunk] = request.trunk
        positions[trunk] = np.arange(trunk_len)
        key_lo[trunk] = start
        ctx_hi[trunk] = start
        seg_lo[trunk] = start
        trunk_segments.append(_Segment(start, trunk_len, ZERO_SLOT, trunk_slot))
        cursor += trunk_len
        for branch, label in zip(request.branches, request.labels):
            span = slice(cursor, cursor + len(branch))
            ids[span] = branch
            positions[span] = trunk_len + np.arange(len(branch))
            key_lo[span] = start
            ctx_hi[span] = start + trunk_len
            seg_lo[span] = cursor
            branch_segments.append(_Segment(cursor, len(branch), trunk_slot, DISCARD_SLOT))
            cursor += len(branch)
            readout_rows.append(cursor - 1)
            labels.append(np.asarray(label, dtype=np.int64))
        end = cursor
        request_bounds.append((start, end))
        # conv taps: a position p of the standalone prompt lives at stream start + p (trunk) or in the branch
        for lo, hi, offset in _stream_runs(request, start):
            pred = positions[lo:hi, None] + taps[None, :]
            rows = np.where(pred >= trunk_len, pred + offset, pred + start)
            conv_src[lo:hi] = np.where(pred >= 0, rows + 1, 0)

    max_labels = max((len(label) for label in labels), default=1)
    label_ids = np.zeros((len(labels), max_labels), dtype=np.int64)
    label_valid = np.zeros((len(labels), max_labels), dtype=bool)
    for row, label in enumerate(labels):
        label_ids[row, : len(label)] = label
        label_valid[row, : len(label)] = True

    levels = [_plan_level(trunk_segments, total), _plan_level(branch_segments, total)]
    return HostRound(
        ids=ids,
        positions=positions,
        key_lo=key_lo,
        ctx_hi=ctx_hi,
        seg_lo=seg_lo,
        request_bounds=request_bounds,
        levels=[level for level in levels if level is not None],
        num_slots=len(trunk_segments) + 1,
        conv_src=conv_src,
        readout_rows=np.asarray(readout_rows, dtype=np.int64),
        label_ids=label_ids,
        label_valid=label_valid,
    )


def _stream_runs(request: RequestSpec, start: int) -> list[tuple[int, int, int]]:
    """(lo, hi, offset) per segment of a request: stream index = standalone position + offset (branch part)."""
    trunk_len = len(request.trunk)
    runs = [(start, start + trunk_len, 0)]
    cursor = start + trunk_len
    for branch in request.branches:
        runs.append((cursor, cursor + len(branch), cursor - trunk_len))
        cursor += len(branch)
    return runs


def _plan_level(segments: list[_Segment], pad_index: int) -> _HostLevel | None:
    if not segments:
        return None
    order = sorted(range(len(segments)), key=lambda i: -segments[i].length)
    ordered = [segments[i] for i in order]
    chunk_counts = np.array([-(-s.length // GDN_CHUNK) for s in ordered], dtype=np.int64)
    steps = int(chunk_counts[0])
    active = [int((chunk_counts > j).sum()) for j in range(steps)]
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
        init_slot=np.array([s.init_slot for s in ordered], dtype=np.int64),
        final_slot=np.array([s.final_slot for s in ordered], dtype=np.int64),
    )
