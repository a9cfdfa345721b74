"""The flat stream of a round (DESIGN.md §5): token packing and every piece of metadata the kernels read.

A round is a list of requests, each a trunk (the state) and branches (one per question). The stream packs
each request's trunk then its branches, with no padding between requests. `plan_round` turns the list of
requests into host arrays (numpy, vectorised over tokens, branches and chunks: no per-token Python);
`pad_round` pads them to fixed capacities (padding only at the tail, so a captured CUDA graph can read
any round that fits); `HostRound.to(device)` copies them. Nothing here looks at the model's weights.

A request may *resume* from a checkpoint at position r (its trunk in the stream then starts at r: keys and
values of [0, r) come from pool pages, the Gated DeltaNet state and conv window from a pool slot) and may
*save* a checkpoint at its stable boundary m (the trunk then runs as two segments split at m, and the
state at m, the conv inputs before m and the keys/values of [r, m) are written to the pool).

Visibility (the exactness contract): a trunk token sees its history and its trunk up to itself; a branch
token sees the history, the whole trunk and its own branch up to itself. In stream coordinates every
token t sees its request's cached history, the keys [key_lo, ctx_hi) (the trunk, for branch tokens) and
[seg_lo, t] (its own segment).

Gated DeltaNet runs level by level: trunks up to their save point, trunk remainders, then branches, each
segment starting from a row of the state arena (`StateRows`: the pool's slots, an always-zero row and a
few scratch rows for trunk states, so resuming and saving move no state at all). Within a level, segments
are sorted by chunk count, longest first, so at scan step j the active segments are exactly the first
`active[j]`; the segments' first chunks are the level's first rows, then each segment's later chunks follow
one segment after the other (`step_base`). A trunk's first part names its remainder in the next level
(`chain`), so the scan can carry the state from one into the other without a launch between. The short
convolution reads each token's predecessors through `conv_src`, rows of the table [zero row, stream tokens,
resumed conv windows], so a branch's first tokens read its trunk's last tokens and a resumed trunk reads its
saved window. Keys and values are saved per token through `kv_slots` (a pool position, or the pool's sink
slot for tokens that are not saved).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

GDN_CHUNK = 64
PAGE = 64  # tokens per key/value page of the checkpoint pool
DISCARD_ROW = -1


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


@dataclass
class AttentionPlan:
    key_lo: torch.Tensor  # [T] first stream index of the token's request
    ctx_hi: torch.Tensor  # [T] end of the fully visible range [key_lo, ctx_hi) (the trunk, for branch tokens)
    seg_lo: torch.Tensor  # [T] start of the token's own causal segment
    request_of: torch.Tensor  # [T] request index of each token
    history_len: torch.Tensor  # [R] cached positions [0, r) of each request (keys/values in pool pages)
    page_offset: torch.Tensor  # [R] where each request's pages start in `pages`
    pages: torch.Tensor  # [P] pool page of each cached PAGE-token block, requests one after the other
    num_tokens: torch.Tensor  # [1] real stream tokens (rows at or past it are padding)
    request_bounds: list[tuple[int, int]]  # host: stream [start, end) of each request (reference op)
    history: list[tuple[int, np.ndarray | None]]  # host: per request, cached length r and its pages
    # device tile tables derived from this plan, built by the first attention layer of a round that needs
    # one and reused by the others (kernels.fork_attention.tile_table); keyed by the kernel's tiling
    tile_tables: dict = field(default_factory=dict, repr=False)


@dataclass
class DeltaLevel:
    chunk_tokens: torch.Tensor  # [num_chunks, GDN_CHUNK] stream index per chunk position, T for padding
    active: list[int]  # host: active segments at scan step j (non-increasing)
    init_row: torch.Tensor  # [num_segments] state row each segment starts from
    final_row: torch.Tensor  # [num_segments] row its final state is written to (DISCARD_ROW: none)
    chunk_count: torch.Tensor  # [num_segments] chunks (scan steps) of each segment
    step_base: torch.Tensor  # [num_segments] segment s's chunk 0 is row s, its chunk j > 0 row step_base[s] + j
    chain: torch.Tensor  # [num_segments] the next level's segment that continues this one's final state (-1: none)
    sizes: torch.Tensor  # [2] the level's chunk rows and segments; a captured graph's tables are padded past them
    chained: bool = False  # host: every segment of this level continues one of the level before (its `chain`)


@dataclass
class DeltaPlan:
    levels: list[DeltaLevel]
    num_rows: int  # rows of the standalone state table the plan was made for (StateRows.num_rows)


@dataclass
class CheckpointPlan:
    """Pool traffic of a round besides the states (which levels read and write in place)."""

    resume_slots: torch.Tensor  # [n_resume] pool slots whose conv windows are read
    save_slots: torch.Tensor  # [n_save] pool slots whose conv windows are written
    save_window_src: torch.Tensor  # [n_save, K-1] conv-table rows of the conv inputs before each save point
    kv_slots: torch.Tensor  # [T] flat pool position of each token's keys/values (the sink if not saved)


@dataclass
class ReadoutPlan:
    rows: torch.Tensor  # [R] stream index of each question's last token
    label_ids: torch.Tensor  # [R, L] label token ids, padded with -1


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
class HostLevel:
    chunk_tokens: np.ndarray
    active: list[int]
    init_row: np.ndarray
    final_row: np.ndarray
    chunk_count: np.ndarray
    step_base: np.ndarray
    chain: np.ndarray  # the next level's segment continuing each segment's final state, -1 if none (`DeltaLevel`)
    sizes: np.ndarray  # [len(chunk_tokens), len(init_row)]: what padding a round keeps (capacity.pad_into)
    chained: bool = False  # every segment continues one of the level before (`DeltaLevel.chained`)


@dataclass
class HostRound:
    """The host arrays of a round; `to(device)` gives the `RoundTensors` the model reads."""

    ids: np.ndarray
    positions: np.ndarray
    key_lo: np.ndarray
    ctx_hi: np.ndarray
    seg_lo: np.ndarray
    request_of: np.ndarray
    history_len: np.ndarray
    page_offset: np.ndarray
    pages: np.ndarray
    num_real: int  # real tokens; rows past it (to len(ids)) are padding
    request_bounds: list[tuple[int, int]]
    history: list[tuple[int, np.ndarray | None]]
    levels: list[HostLevel]
    num_rows: int
    conv_src: np.ndarray
    resume_slots: np.ndarray
    save_slots: np.ndarray
    save_window_src: np.ndarray
    kv_slots: np.ndarray
    readout_rows: np.ndarray
    label_ids: np.ndarray

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def num_questions(self) -> int:
        return len(self.readout_rows)

    def arrays(self) -> dict[str, np.ndarray]:
        """Every int64 array the device needs, by name (level arrays as `level{i}.<field>`)."""
        named = {name: getattr(self, name) for name in DEVICE_FIELDS}
        named["num_tokens"] = np.array([self.num_real], dtype=np.int64)
        for index, level in enumerate(self.levels):
            for name in LEVEL_FIELDS:
                named[f"level{index}.{name}"] = getattr(level, name)
        return named

    def to(self, device: torch.device | str) -> RoundTensors:
        tensors = {name: torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)
                   for name, a in self.arrays().items()}
        return self.tensors(tensors)

    def tensors(self, t: dict[str, torch.Tensor]) -> RoundTensors:
        """The `RoundTensors` view of device tensors named as in `arrays()` (the host lists come from self)."""
        levels = [
            DeltaLevel(t[f"level{i}.chunk_tokens"], level.active, t[f"level{i}.init_row"], t[f"level{i}.final_row"],
                       t[f"level{i}.chunk_count"], t[f"level{i}.step_base"], t[f"level{i}.chain"], t[f"level{i}.sizes"],
                       level.chained)
            for i, level in enumerate(self.levels)
        ]
        attention = AttentionPlan(
            t["key_lo"], t["ctx_hi"], t["seg_lo"], t["request_of"], t["history_len"], t["page_offset"], t["pages"],
            t["num_tokens"], self.request_bounds, self.history,
        )
        return RoundTensors(
            ids=t["ids"],
            positions=t["positions"],
            attention=attention,
            delta=DeltaPlan(levels, self.num_rows),
            conv_src=t["conv_src"],
            checkpoint=CheckpointPlan(t["resume_slots"], t["save_slots"], t["save_window_src"], t["kv_slots"]),
            readout=ReadoutPlan(t["readout_rows"], t["label_ids"]),
        )


DEVICE_FIELDS = ("ids", "positions", "key_lo", "ctx_hi", "seg_lo", "request_of", "history_len", "page_offset",
                 "pages", "conv_src", "resume_slots", "save_slots", "save_window_src", "kv_slots", "readout_rows",
                 "label_ids")
LEVEL_FIELDS = ("chunk_tokens", "init_row", "final_row", "chunk_count", "step_base", "chain", "sizes")


def plan_round(
    requests: Sequence[RequestSpec], conv_kernel: int, rows: StateRows | None = None, kv_sink: int = -1
) -> HostRound:
    """Lay out `requests` as one flat stream and build all metadata (host side, numpy, vectorised).

    rows: where states live (default: a compact standalone table, `StateRows.compact`). kv_sink: the flat
    pool position that keys/values of unsaved tokens are written to (-1: the last position of the arena).
    Empty levels are kept (with no chunks), so a round always has NUM_LEVELS levels.
    """
    rows = rows or StateRows.compact(requests)
    if len(requests) > rows.scratch_count:
        raise ValueError(f"{len(requests)} requests but {rows.scratch_count} scratch state rows")
    count = len(requests)
    first = np.fromiter((r.start for r in requests), dtype=np.int64, count=count)
    computed = np.fromiter((len(r.trunk) for r in requests), dtype=np.int64, count=count)
    if (computed < 1).any():
        raise ValueError("every request computes at least one trunk token")
    resumed = np.fromiter((r.resume is not None for r in requests), dtype=bool, count=count)
    if ((first > 0) != resumed).any():
        raise ValueError("a request starts past position 0 exactly when it resumes from a checkpoint")
    branches = Branches.join([r.branches for r in requests]) if requests else Branches.of([], [])
    per_request = np.fromiter((len(r.branches) for r in requests), dtype=np.int64, count=count)
    branch_request = np.repeat(np.arange(count), per_request)

    # pieces in stream order: each request's trunk, then its branches; per-token metadata repeats per-piece values
    piece_len = np.empty(count + len(branches), dtype=np.int64)
    piece_request = np.empty_like(piece_len)
    trunk_piece = np.arange(count) + _offsets(per_request)
    is_trunk_piece = np.zeros(len(piece_len), dtype=bool)
    is_trunk_piece[trunk_piece] = True
    piece_len[is_trunk_piece], piece_len[~is_trunk_piece] = computed, branches.lengths
    piece_request[is_trunk_piece], piece_request[~is_trunk_piece] = np.arange(count), branch_request
    piece_start = _offsets(piece_len)
    total = int(piece_len.sum())
    trunk_start = piece_start[trunk_piece]
    branch_start = piece_start[~is_trunk_piece]
    branch_tokens = np.bincount(branch_request, weights=branches.lengths, minlength=count).astype(np.int64)
    request_end = trunk_start + computed + branch_tokens

    past_trunk = np.where(is_trunk_piece, 0, computed[piece_request])  # a branch continues after its whole trunk
    piece_position = first[piece_request] + past_trunk  # position of each piece's first token
    piece_key_lo = trunk_start[piece_request]
    request_of = np.repeat(piece_request, piece_len)
    positions = np.arange(total, dtype=np.int64) + np.repeat(piece_position - piece_start, piece_len)
    key_lo = np.repeat(piece_key_lo, piece_len)
    ctx_hi = np.repeat(piece_key_lo + past_trunk, piece_len)
    seg_lo = np.repeat(piece_start, piece_len)  # a trunk piece starts at its trunk's start
    parts = [part for r in requests for part in (r.trunk, r.branches.ids)]
    ids = np.concatenate(parts, dtype=np.int64, casting="unsafe") if parts else np.zeros(0, dtype=np.int64)

    # conv sources: stream rows 1 + t, resumed windows 1 + total + resume_index * (K - 1) + j, else 0
    window_rows = conv_kernel - 1
    resume_index = np.cumsum(resumed) - 1
    taps = np.arange(-window_rows, 1, dtype=np.int64)

    def trunk_rows(request: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Conv-table row of the conv input at absolute trunk position q of `request` (q < its trunk end)."""
        f = first[request]
        window = 1 + total + resume_index[request] * window_rows + q - f + window_rows
        return np.where(q >= f, trunk_start[request] + q - f + 1, np.where(q >= 0, window, 0))

    # a tap inside its own piece reads the stream row of that token (a trunk is contiguous across its save
    # point); only the first K - 1 tokens of a piece have taps before it: trunk rows, the resumed window or 0
    conv_src = np.empty((total, conv_kernel), dtype=np.int64)
    stream_rows = np.arange(2 - conv_kernel, total + 1, dtype=np.int64)
    for tap in range(conv_kernel):  # column by column: token t's tap j reads row t + 1 + taps[j]
        conv_src[:, tap] = stream_rows[tap : tap + total]
    piece, lead = np.nonzero(np.arange(window_rows)[None, :] < piece_len[:, None])
    lead_tokens = piece_start[piece] + lead
    before = (lead[:, None] + taps[None, :]) < 0
    conv_src[lead_tokens] = np.where(
        before, trunk_rows(piece_request[piece, None], (piece_position[piece] + lead)[:, None] + taps[None, :]),
        conv_src[lead_tokens])

    # Gated DeltaNet segments
    save_at = np.fromiter((r.save.at if r.save else 0 for r in requests), dtype=np.int64, count=count)
    saves = np.fromiter((r.save is not None for r in requests), dtype=bool, count=count)
    if (saves & ~((first < save_at) & (save_at <= first + computed))).any():
        raise ValueError("a save point lies outside its request's computed trunk (start, end]")
    split = np.where(saves, save_at - first, computed)
    scratch = rows.scratch + np.arange(count, dtype=np.int64)
    save_row = np.fromiter((rows.slot_base + r.save.slot if r.save else -1 for r in requests), dtype=np.int64,
                           count=count)
    init = np.fromiter((rows.slot_base + r.resume.slot if r.resume else rows.zero for r in requests),
                       dtype=np.int64, count=count)
    trunk_final = np.where(saves & (split == computed), save_row, scratch)
    remainder = saves & (split < computed)
    levels = [
        _plan_level(trunk_start, split, init, np.where(saves, save_row, scratch), total),
        _plan_level((trunk_start + split)[remainder], (computed - split)[remainder], save_row[remainder],
                    scratch[remainder], total),
        _plan_level(branch_start, branches.lengths, trunk_final[branch_request],
                    np.full(len(branches), DISCARD_ROW, dtype=np.int64), total),
    ]
    # a trunk's remainder starts from its first part's final row: the scan runs both in one program
    levels[0].chain = _continuations(levels[0].final_row, levels[1].init_row)
    levels[1].chained = True

    # checkpoint traffic
    kv_slots = np.full(total, kv_sink, dtype=np.int64)
    for request, start, n in zip(requests, trunk_start.tolist(), split.tolist()):
        if request.save is not None:
            kv_slots[start : start + n] = request.save.kv_slots
    saving = np.flatnonzero(saves)
    save_window_src = trunk_rows(saving[:, None], save_at[saving, None] + taps[None, :-1]).reshape(-1, window_rows)

    history_len = first.copy()
    page_count = -(-first // PAGE)
    page_offset = _offsets(page_count)
    pages = np.concatenate([np.asarray(r.resume.pages, dtype=np.int64)[:n]
                            for r, n in zip(requests, page_count.tolist()) if r.resume] + [np.zeros(0, np.int64)])

    return HostRound(
        ids=ids,
        positions=positions,
        key_lo=key_lo,
        ctx_hi=ctx_hi,
        seg_lo=seg_lo,
        request_of=request_of,
        history_len=history_len,
        page_offset=page_offset,
        pages=pages,
        num_real=total,
        request_bounds=list(zip(trunk_start.tolist(), request_end.tolist())),
        history=[(int(r.start), r.resume.pages if r.resume else None) for r in requests],
        levels=levels,
        num_rows=rows.num_rows,
        conv_src=conv_src,
        resume_slots=np.array([r.resume.slot for r in requests if r.resume], dtype=np.int64),
        save_slots=np.array([r.save.slot for r in requests if r.save], dtype=np.int64),
        save_window_src=save_window_src,
        kv_slots=kv_slots,
        readout_rows=branch_start + branches.lengths - 1,
        label_ids=branches.labels,
    )


def _continuations(final_row: np.ndarray, init_row: np.ndarray) -> np.ndarray:
    """For each segment ending in `final_row` (rows unique: a save slot or a request's scratch row), the
    segment of the next level starting from that row, or -1."""
    if len(init_row) == 0:
        return np.full(len(final_row), -1, dtype=np.int64)
    order = np.argsort(init_row)
    match = order[np.minimum(np.searchsorted(init_row[order], final_row), len(order) - 1)]
    return np.where(init_row[match] == final_row, match, -1).astype(np.int64, copy=False)


def _offsets(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums: where each of a list of consecutive runs of `counts` starts."""
    return (np.cumsum(counts) - counts).astype(np.int64, copy=False)


def _plan_level(start: np.ndarray, length: np.ndarray, init_row: np.ndarray, final_row: np.ndarray,
                pad_index: int) -> HostLevel:
    """Chunk table of one level (vectorised): segments longest first; the segments' first chunks come first
    (row s: segment s's chunk 0, what a level's step 0 reads), then each segment's later chunks in order, one
    segment after the other, so a segment's chunks past its first are consecutive rows (`step_base`): the
    scan's tile addresses are then affine in the step and its loads can be issued steps ahead."""
    none = np.full(len(length), -1, dtype=np.int64)  # chains are set by plan_round
    if len(length) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return HostLevel(np.zeros((0, GDN_CHUNK), dtype=np.int64), [], empty, empty, empty, empty, none,
                         np.zeros(2, np.int64))
    if len(length) == 1 and length[0] > 0:  # one segment (a lone request's trunk levels): its chunks in order
        tokens, steps = int(length[0]), -(-int(length[0]) // GDN_CHUNK)
        chunk_tokens = np.arange(int(start[0]), int(start[0]) + steps * GDN_CHUNK, dtype=np.int64).reshape(steps, -1)
        chunk_tokens[-1, tokens - (steps - 1) * GDN_CHUNK :] = pad_index
        return HostLevel(chunk_tokens, [1] * steps, init_row.copy(), final_row.copy(), np.array([steps], dtype=np.int64),
                         np.zeros(1, dtype=np.int64), none, np.array([steps, 1], dtype=np.int64))
    order = np.argsort(-length, kind="stable")
    start, length, init_row, final_row = start[order], length[order], init_row[order], final_row[order]
    counts = (-(-length // GDN_CHUNK)).astype(np.int64, copy=False)  # non-increasing
    active = (counts[None, :] > np.arange(counts[0])[:, None]).sum(axis=1)
    firsts = int(active[0]) if len(active) else 0  # segments with a chunk: the first rows
    later = np.maximum(counts - 1, 0)
    step_base = firsts + _offsets(later) - 1
    later_segment = np.repeat(np.arange(len(counts), dtype=np.int64), later)
    later_rows = np.arange(firsts, firsts + len(later_segment), dtype=np.int64)
    segment = np.concatenate([np.arange(firsts, dtype=np.int64), later_segment])
    chunk = np.concatenate([np.zeros(firsts, dtype=np.int64), later_rows - step_base[later_segment]])
    chunk_tokens = (start[segment] + chunk * GDN_CHUNK)[:, None] + np.arange(GDN_CHUNK)[None, :]
    chunk_tokens = np.where(chunk_tokens < (start + length)[segment, None], chunk_tokens, pad_index)
    sizes = np.array([len(chunk_tokens), len(init_row)], dtype=np.int64)
    return HostLevel(chunk_tokens, active.tolist(), init_row, final_row, counts, step_base, none, sizes)
