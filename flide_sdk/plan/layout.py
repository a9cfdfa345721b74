"""The flat stream of a round (DESIGN.md §5): token packing and every piece of metadata the kernels read.

A round is a list of requests, each a trunk (the state) and branches (one per question). The stream packs
each request's trunk then its branches, with no padding between requests. `RoundPlan` lays the list of
requests out as Python lists per piece (a trunk or a branch), segment and question, and writes the host
arrays from them with a few vectorised numpy calls per array (no per-token Python), either at the round's
own size (`plan_round`, a `HostRound`) or straight into the arrays of a fixed capacity, padded only at the
tail, so a captured CUDA graph can read any round that fits (`capacity.pad_into`); `HostRound.to(device)`
copies them. A graph's staging buffer gets less (`write_staged`): a piece table and chunk spans in place of
the per-token and per-chunk-position arrays, which the device expands (`kernels.round_metadata`). Token-wise
metadata other than the ids is one [5, T] block (`TOKEN_ROWS`) and a level's per-segment tables one [5, S]
block (`SEGMENT_ROWS`): one copy each into a staging buffer, with a few numpy calls per array (the
history of that choice: docs/decisions/round-planning.md). Nothing here looks at the model's weights.

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

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

# the kernels own their input structs and constants; the planner fills them (callers import them here too)
from flide_sdk.kernels.plans import DISCARD_ROW, GDN_CHUNK, PAGE, AttentionPlan, DeltaLevel, DeltaPlan
from flide_sdk.plan.requests import Branches, RequestSpec, Resume, Save, StateRows  # noqa: F401 (callers import them here)


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


TOKEN_ROWS = ("positions", "key_lo", "ctx_hi", "seg_lo", "request_of")  # the rows of `HostRound.token_rows`
SEGMENT_ROWS = ("init_row", "final_row", "chunk_count", "step_base", "chain")  # the rows of `HostLevel.segment_rows`
# a piece's row of a graph's staged `pieces` table (`RoundPlan.write_staged`): its stream start and what its first
# K - 1 tokens' conv taps before it read (CONV_PIECE_ROWS), then the TOKEN_ROWS values of its tokens (the
# position's as position - stream index)
CONV_PIECE_ROWS = ("start", "position", "first", "trunk_start", "resume_index")
PIECE_ROWS = CONV_PIECE_ROWS + TOKEN_ROWS


def _row(block: str, index: int, doc: str) -> property:
    """A named row of one of the object's blocks, as a property."""
    return property(lambda self: getattr(self, block)[index], doc=doc)


@dataclass
class HostLevel:
    chunk_tokens: np.ndarray  # [chunks, GDN_CHUNK] stream index per chunk position (padding: the round's tokens)
    segment_rows: np.ndarray  # [5, segments]: SEGMENT_ROWS, one block (one copy into a staging buffer)
    sizes: np.ndarray  # [len(chunk_tokens), segments]: the real rows, which padding keeps (capacity.pad_into)
    active: list[int]  # host: active segments at scan step j (non-increasing)
    chained: bool = False  # every segment continues one of the level before (`DeltaLevel.chained`)

    init_row = _row("segment_rows", 0, "state row each segment starts from")
    final_row = _row("segment_rows", 1, "row its final state is written to (DISCARD_ROW: none)")
    chunk_count = _row("segment_rows", 2, "chunks (scan steps) of each segment")
    step_base = _row("segment_rows", 3, "segment s's chunk j > 0 is row step_base[s] + j")
    chain = _row("segment_rows", 4, "the next level's segment continuing each segment's final state, -1 if none")


@dataclass
class HostRound:
    """The host arrays of a round (as `RoundPlan.write` lays them out); `to(device)` gives the `RoundTensors`
    the model reads."""

    plan: RoundPlan
    ids: np.ndarray
    token_rows: np.ndarray  # [5, T]: TOKEN_ROWS, one block
    history_len: np.ndarray
    page_offset: np.ndarray
    pages: np.ndarray
    levels: list[HostLevel]
    conv_src: np.ndarray
    resume_slots: np.ndarray
    save_slots: np.ndarray
    save_window_src: np.ndarray
    kv_slots: np.ndarray
    readout_rows: np.ndarray
    label_ids: np.ndarray

    positions = _row("token_rows", 0, "position of each token in its standalone prompt")
    key_lo = _row("token_rows", 1, "first stream index of the token's request")
    ctx_hi = _row("token_rows", 2, "end of the fully visible range [key_lo, ctx_hi)")
    seg_lo = _row("token_rows", 3, "start of the token's own causal segment")
    request_of = _row("token_rows", 4, "request index of each token")

    @property
    def num_real(self) -> int:
        return self.plan.num_real

    @property
    def num_rows(self) -> int:
        return self.plan.rows.num_rows

    @property
    def request_bounds(self) -> list[tuple[int, int]]:
        return self.plan.request_bounds

    @property
    def history(self) -> list[tuple[int, np.ndarray | None]]:
        return [(r.start, r.resume.pages if r.resume else None) for r in self.plan.requests]

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
        levels = []
        for i, level in enumerate(self.levels):
            init_row, final_row, chunk_count, step_base, chain = t[f"level{i}.segment_rows"]
            levels.append(DeltaLevel(t[f"level{i}.chunk_tokens"], level.active, init_row, final_row, chunk_count,
                                     step_base, chain, t[f"level{i}.sizes"], level.chained))
        positions, key_lo, ctx_hi, seg_lo, request_of = t["token_rows"]
        attention = AttentionPlan(key_lo, ctx_hi, seg_lo, request_of, t["history_len"], t["page_offset"], t["pages"],
                                  t["num_tokens"], self.request_bounds, self.history)
        return RoundTensors(
            ids=t["ids"],
            positions=positions,
            attention=attention,
            delta=DeltaPlan(levels, self.num_rows),
            conv_src=t["conv_src"],
            checkpoint=CheckpointPlan(t["resume_slots"], t["save_slots"], t["save_window_src"], t["kv_slots"]),
            readout=ReadoutPlan(t["readout_rows"], t["label_ids"]),
        )


DEVICE_FIELDS = ("ids", "token_rows", "history_len", "page_offset", "pages", "conv_src", "resume_slots", "save_slots",
                 "save_window_src", "kv_slots", "readout_rows", "label_ids")
LEVEL_FIELDS = ("chunk_tokens", "segment_rows", "sizes")
_CHUNK_OFFSETS = np.arange(GDN_CHUNK, dtype=np.int64)


# rows of a round plan's host lists, plain tuples: a lone ask with 64 questions builds about 200 of them per round,
# and a NamedTuple costs 20x a tuple to build
Segment = tuple[int, int, int, int]  # a Gated DeltaNet segment: stream start, tokens, init row, final row


class TrunkSave(NamedTuple):
    """A request's checkpoint as a round plan writes it: the trunk's stream start, the tokens it saves (from its
    start to the save point), the save, and the request's first position and resume index (-1: none)."""

    stream_start: int
    tokens: int
    save: Save
    first: int
    resume_index: int


class LevelPlan:
    """One Gated DeltaNet level of a round (host lists): segments longest first; the segments' first chunks
    come first (row s: segment s's chunk 0, what a level's step 0 reads), then each segment's later chunks in
    order, one segment after the other, so a segment's chunks past its first are consecutive rows
    (`step_base`): the scan's tile addresses are then affine in the step and its loads can be issued ahead."""

    def __init__(self, segments: list[Segment]) -> None:
        """segments: (stream start, tokens, init row, final row), each at least one token, in stream order."""
        ordered = sorted(segments, key=lambda segment: -segment[1])  # stable: ties keep stream order
        counts = [-(-length // GDN_CHUNK) for _, length, _, _ in ordered]
        self.row_start = [start for start, _, _, _ in ordered]
        self.row_end = [start + length for start, length, _, _ in ordered]
        step_base, base = [], len(ordered) - 1
        for (start, length, _, _), count in zip(ordered, counts):
            step_base.append(base)
            if count > 1:
                self.row_start.extend(range(start + GDN_CHUNK, start + count * GDN_CHUNK, GDN_CHUNK))
                self.row_end.extend([start + length] * (count - 1))
            base += count - 1
        init_rows = [init for _, _, init, _ in ordered]
        final_rows = [final for _, _, _, final in ordered]
        self.segment_rows = [init_rows, final_rows, counts, step_base, [-1] * len(ordered)]  # SEGMENT_ROWS
        self.chained = False

    def active(self) -> list[int]:
        """Active segments at each scan step (non-increasing; the reference ops loop over them)."""
        counts = self.segment_rows[2]
        active = [0] * (counts[0] if counts else 0)
        for count in counts:
            active[count - 1] += 1
        for step in range(len(active) - 2, -1, -1):
            active[step] += active[step + 1]
        return active

    @property
    def chunks(self) -> int:
        return len(self.row_start)

    @property
    def segments(self) -> int:
        return len(self.segment_rows[0])

    def write(self, chunk_tokens: np.ndarray, segment_rows: np.ndarray, sizes: np.ndarray, pad: int,
              pad_column: np.ndarray) -> None:
        """The level's tables into arrays of at least its sizes: chunk positions past a segment's end and padding
        rows read stream index `pad`; padding segments are `pad_column` (SEGMENT_ROWS' padding values)."""
        chunks = self.chunks
        if chunks:
            head = chunk_tokens[:chunks]
            np.add(np.array(self.row_start, dtype=np.int64)[:, None], _CHUNK_OFFSETS, out=head)
            np.putmask(head, head >= np.array(self.row_end, dtype=np.int64)[:, None], pad)
        chunk_tokens[chunks:] = pad
        self._write_segments(segment_rows, sizes, pad_column)

    def write_spans(self, spans: np.ndarray, segment_rows: np.ndarray, sizes: np.ndarray, pad: int,
                    pad_column: np.ndarray) -> None:
        """As `write`, with each chunk row's span [2, rows] (its first stream index, its segment's end) in place
        of its positions; padding rows are the empty span (pad, pad)."""
        chunks = self.chunks
        if chunks:
            spans[0, :chunks] = self.row_start
            spans[1, :chunks] = self.row_end
        spans[:, chunks:] = pad
        self._write_segments(segment_rows, sizes, pad_column)

    def _write_segments(self, segment_rows: np.ndarray, sizes: np.ndarray, pad_column: np.ndarray) -> None:
        segments = self.segments
        if segments:
            segment_rows[:, :segments] = self.segment_rows
        segment_rows[:, segments:] = pad_column
        sizes[0], sizes[1] = self.chunks, segments


class RoundPlan:
    """A round's requests as one flat stream, planned on the host as lists per piece (a trunk or a branch),
    Gated DeltaNet segment and question: a round has few of them, and Python lists cost far less per element
    than a numpy call costs per call (a lone ask's plan and staging were about 150 numpy calls). It knows the
    counts a capacity must hold (`Capacity.fits`); `write` then builds every array straight into the arrays of
    any capacity it fits (a graph's pinned staging views, padded at the tail) with a few vectorised calls per
    array, and `host_round` into arrays of its own size.

    rows: where states live (default: a compact standalone table, `StateRows.compact`). kv_sink: the flat
    pool position that keys/values of unsaved tokens are written to (-1: the last position of the arena).
    Empty levels are kept (with no chunks), so a round always has three levels.
    """

    def __init__(self, requests: Sequence[RequestSpec], conv_kernel: int, rows: StateRows | None = None,
                 kv_sink: int = -1) -> None:
        rows = rows or StateRows.compact(requests)
        if len(requests) > rows.scratch_count:
            raise ValueError(f"{len(requests)} requests but {rows.scratch_count} scratch state rows")
        self.requests, self.conv_kernel, self.rows, self.kv_sink = list(requests), conv_kernel, rows, kv_sink
        # per piece, PIECE_ROWS: its stream start and what its first tokens' conv taps before it read (first
        # position, its request's first position, trunk start, resume index), then token_rows' values
        self._pieces: list[tuple[int, ...]] = []
        self._lengths: list[int] = []
        self._ids: list[np.ndarray] = []
        self._saves: list[TrunkSave] = []
        self.readout: list[int] = []
        self.request_bounds: list[tuple[int, int]] = []
        self.label_width = 1
        self.num_pages = 0
        segments: tuple[list[Segment], list[Segment], list[Segment]] = ([], [], [])
        cursor = resumes = 0
        for index, request in enumerate(self.requests):
            first, computed = request.start, len(request.trunk)
            if computed < 1:
                raise ValueError("every request computes at least one trunk token")
            if (first > 0) != (request.resume is not None):
                raise ValueError("a request starts past position 0 exactly when it resumes from a checkpoint")
            init, scratch, resume_index = rows.zero, rows.scratch + index, -1
            if request.resume is not None:
                init, resume_index = rows.slot_base + request.resume.slot, resumes
                resumes += 1
                self.num_pages += len(request.resume.pages[: -(-first // PAGE)])
            start = cursor
            split, trunk_final = computed, scratch
            if request.save is not None:
                at = request.save.at
                if not first < at <= first + computed:
                    raise ValueError("a save point lies outside its request's computed trunk (start, end]")
                split, save_row = at - first, rows.slot_base + request.save.slot
                segments[0].append((start, split, init, save_row))
                if split < computed:
                    segments[1].append((start + split, computed - split, save_row, scratch))
                else:
                    trunk_final = save_row
                self._saves.append(TrunkSave(start, split, request.save, first, resume_index))
            else:
                segments[0].append((start, computed, init, scratch))
            self._pieces.append((start, first, first, start, resume_index, first - start, start, start, start, index))
            self._lengths.append(computed)
            self._ids += (request.trunk, request.branches.ids)
            at, position = start + computed, first + computed
            for length in request.branches.lengths.tolist():
                self._pieces.append((at, position, first, start, resume_index,
                                     position - at, start, start + computed, at, index))
                self._lengths.append(length)
                segments[2].append((at, length, trunk_final, DISCARD_ROW))
                at += length
                self.readout.append(at - 1)
            self.label_width = max(self.label_width, request.branches.labels.shape[1])
            self.request_bounds.append((start, at))
            cursor = at
        self.num_real = cursor
        self.num_resumes = resumes
        self.levels = [LevelPlan(level) for level in segments]
        # a trunk's remainder starts from its first part's final row: the scan runs both in one program
        first_parts, remainders = self.levels[0].segment_rows, self.levels[1].segment_rows
        continuing = {init: k for k, init in enumerate(remainders[0])}
        first_parts[4] = [continuing.get(final, -1) for final in first_parts[1]]
        self.levels[1].chained = True

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def num_questions(self) -> int:
        return len(self.readout)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of every array of the round unpadded, named as `HostRound.arrays()`."""
        real, count, saves, window = self.num_real, self.num_requests, len(self._saves), self.conv_kernel - 1
        shapes: dict[str, tuple[int, ...]] = {
            "ids": (real,), "token_rows": (len(TOKEN_ROWS), real), "history_len": (count,), "page_offset": (count,),
            "pages": (self.num_pages,), "conv_src": (real, self.conv_kernel), "resume_slots": (self.num_resumes,),
            "save_slots": (saves,), "save_window_src": (saves, window), "kv_slots": (real,),
            "readout_rows": (self.num_questions,), "label_ids": (self.num_questions, self.label_width),
        }
        for index, level in enumerate(self.levels):
            shapes[f"level{index}.chunk_tokens"] = (level.chunks, GDN_CHUNK)
            shapes[f"level{index}.segment_rows"] = (len(SEGMENT_ROWS), level.segments)
            shapes[f"level{index}.sizes"] = (2,)
        return shapes

    def host_round(self) -> HostRound:
        """The round's arrays unpadded (the eager path and the reference ops)."""
        arrays = {name: np.empty(shape, dtype=np.int64) for name, shape in self.shapes().items()}
        self.write(arrays, window_sink=-1, kv_sink=self.kv_sink, zero_row=self.rows.zero)
        levels = [HostLevel(arrays[f"level{i}.chunk_tokens"], arrays[f"level{i}.segment_rows"],
                            arrays[f"level{i}.sizes"], level.active(), level.chained)
                  for i, level in enumerate(self.levels)]
        return HostRound(self, levels=levels, **{name: arrays[name] for name in DEVICE_FIELDS})

    def write(self, out: dict[str, np.ndarray], window_sink: int, kv_sink: int, zero_row: int) -> None:
        """Every array of the round into `out` (arrays of at least its sizes, shaped as `shapes()` names them;
        with `num_tokens` where a graph reads it), padding only at the tail, so a captured graph can read any
        round that fits. Padding tokens form one region of their own after the real tokens (they see nothing
        real and nothing real sees them), padded segments and chunks are empty (each level's `sizes` keeps the
        real counts, so the Gated DeltaNet kernels never visit them), padded saves go to `window_sink` and
        padding tokens' keys/values to `kv_sink`, padded segments start from `zero_row`, padded readout rows
        read the first padding token (and one label, so their softmax stays finite).

        Conv-table rows: the zero row, the stream tokens (row 1 + t), then per resumed request its saved window
        (K - 1 rows after all stream rows of the arrays, padding included)."""
        real, count, window = self.num_real, self.num_requests, self.conv_kernel - 1
        total = len(out["ids"])
        pieces = self._piece_block()
        rows = out["token_rows"]
        lengths = np.array(self._lengths, dtype=np.int64)
        if real:
            rows[:, :real] = np.repeat(pieces[len(CONV_PIECE_ROWS) :], lengths, axis=1)
            rows[0, :real] += _iota(real)
        rows[:, real:] = np.array([[0], [real], [real], [real], [count]], dtype=np.int64)

        # conv sources: token t's tap j reads row t + 1 - (K - 1 - j) inside its piece; the first K - 1 tokens
        # of a piece read the taps before it from their trunk's rows, its resumed window or the zero row
        conv = out["conv_src"]
        conv[:real] = _conv_rows(self.conv_kernel, real)
        conv[real:] = 0
        if self._pieces:
            lead, back = _lead_taps(window)
            start, position, first, trunk_start, resume_index = pieces[: len(CONV_PIECE_ROWS), :, None]
            q = position + (lead - back)  # the position each such tap reads
            src = np.where(q >= first, trunk_start + (q - first) + 1,
                           np.where(q >= 0, 1 + total + resume_index * window + (q - first) + window, 0))
            flat = (start + lead) * self.conv_kernel + (window - back)  # into conv_src's rows (contiguous)
            if lengths.min() < window:  # pieces shorter than the window: only their own tokens
                valid = lead < lengths[:, None]
                flat, src = flat[valid], src[valid]
            np.put(conv, flat, src)

        self._write_shared(out, window_sink, kv_sink)
        pad_column = _segment_padding(zero_row)
        for index, level in enumerate(self.levels):
            prefix = f"level{index}."
            level.write(out[prefix + "chunk_tokens"], out[prefix + "segment_rows"], out[prefix + "sizes"], total,
                        pad_column)

    def write_staged(self, out: dict[str, np.ndarray], chunk_rows: Sequence[int], window_sink: int, kv_sink: int,
                     zero_row: int) -> None:
        """The round as a graph's staging buffer holds it (`Capacity.staged_shapes`): the arrays of `write`, but
        in place of the token rows, the conv sources and the levels' chunk tables (per token or per chunk
        position: most of `write`'s host time) their compact sources, which `kernels.round_metadata` expands on
        the device into exactly what `write` gives: `pieces` [PIECE_ROWS, pieces] (a piece's tokens are the
        stream from its start to the next piece's), `piece_counts` (pieces, requests) and `chunk_spans` [2, rows]
        (each chunk row's first stream index and its segment's end; the levels' rows one after the other,
        `chunk_rows` per level, padding rows empty at the round's capacity)."""
        total = len(out["ids"])
        out["pieces"][:, : len(self._pieces)] = self._piece_block()
        out["piece_counts"][:] = (len(self._pieces), self.num_requests)
        self._write_shared(out, window_sink, kv_sink)
        pad_column = _segment_padding(zero_row)
        spans, offset = out["chunk_spans"], 0
        for index, (level, rows) in enumerate(zip(self.levels, chunk_rows)):
            prefix = f"level{index}."
            level.write_spans(spans[:, offset : offset + rows], out[prefix + "segment_rows"], out[prefix + "sizes"],
                              total, pad_column)
            offset += rows

    def _piece_block(self) -> np.ndarray:
        """The pieces as a [PIECE_ROWS, pieces] block."""
        return np.array(self._pieces, dtype=np.int64).reshape(-1, len(PIECE_ROWS)).T

    def _write_shared(self, out: dict[str, np.ndarray], window_sink: int, kv_sink: int) -> None:
        """The arrays `write` and `write_staged` both write (`write` says how)."""
        real, count, window = self.num_real, self.num_requests, self.conv_kernel - 1
        total = len(out["ids"])
        ids = out["ids"]
        if self._ids:
            np.concatenate(self._ids, out=ids[:real], casting="unsafe")
        ids[real:] = 0

        kv = out["kv_slots"]
        kv[:real] = self.kv_sink
        kv[real:] = kv_sink
        windows = []
        for start, saved, save, first, resume_index in self._saves:  # TrunkSave
            kv[start : start + saved] = save.kv_slots
            for q in range(save.at - window, save.at):
                windows.append(start + q - first + 1 if q >= first
                               else 1 + total + resume_index * window + q - first + window if q >= 0 else 0)
        save_window_src = out["save_window_src"]
        save_window_src[: len(self._saves)] = np.array(windows, dtype=np.int64).reshape(-1, window)
        save_window_src[len(self._saves) :] = 0

        questions = self.num_questions
        readout = out["readout_rows"]
        readout[:questions] = self.readout
        readout[questions:] = real
        labels = out["label_ids"]
        if questions:
            table = Branches.join([request.branches for request in self.requests]).labels
            labels[:questions, : table.shape[1]] = table
            labels[:questions, table.shape[1] :] = -1
        labels[questions:] = -1
        labels[questions:, 0] = 0

        history_len, page_offset, pages = out["history_len"], out["page_offset"], out["pages"]
        history_len[:count] = [request.start for request in self.requests]
        history_len[count:] = 0
        offsets, used, parts = [], 0, []
        for request in self.requests:
            offsets.append(used)
            if request.resume is not None:
                parts.append(np.asarray(request.resume.pages[: -(-request.start // PAGE)]))
                used += len(parts[-1])
        page_offset[:count] = offsets
        page_offset[count:] = 0
        if parts:
            np.concatenate(parts, out=pages[:used], casting="unsafe")
        pages[used:] = 0
        resume_slots, save_slots = out["resume_slots"], out["save_slots"]
        resume_slots[: self.num_resumes] = [r.resume.slot for r in self.requests if r.resume is not None]
        resume_slots[self.num_resumes :] = window_sink
        save_slots[: len(self._saves)] = [trunk_save.save.slot for trunk_save in self._saves]
        save_slots[len(self._saves) :] = window_sink
        if "num_tokens" in out:
            out["num_tokens"][0] = real


def _segment_padding(zero_row: int) -> np.ndarray:
    """A padding segment's column of SEGMENT_ROWS: it starts from the zero row, keeps no state, has no chunks."""
    return np.array([[zero_row], [DISCARD_ROW], [0], [0], [-1]], dtype=np.int64)


def _iota(count: int) -> np.ndarray:
    """0, 1, ..., count - 1 (int64, read-only: the head of one array kept for all rounds, grown as needed)."""
    return _kept(0, count)


def _conv_rows(conv_kernel: int, count: int) -> np.ndarray:
    """[count, K]: token t's conv taps inside its piece, oldest first, read rows t + 1 - (K - 1 - j) (read-only,
    kept; a copy of it costs a tenth of building it)."""
    return _kept(conv_kernel, count)


_KEPT: dict[int, np.ndarray] = {}


def _kept(conv_kernel: int, count: int) -> np.ndarray:
    kept = _KEPT.get(conv_kernel)
    if kept is None or len(kept) < count:
        size = max(count, 4096, 2 * (0 if kept is None else len(kept)))
        kept = np.arange(size, dtype=np.int64)
        if conv_kernel:
            kept = kept[:, None] + np.arange(2 - conv_kernel, 2, dtype=np.int64)
        kept.flags.writeable = False
        _KEPT[conv_kernel] = kept
    return kept[:count]


@functools.cache
def _lead_taps(window: int) -> tuple[np.ndarray, np.ndarray]:
    """(lead, back) pairs [1, n] with lead < window and back > lead: token `lead` of a piece, tap reading `back`
    tokens back, before the piece."""
    pairs = [(lead, back) for lead in range(window) for back in range(lead + 1, window + 1)]
    lead, back = (np.array([p[i] for p in pairs], dtype=np.int64)[None, :] for i in (0, 1))
    return lead, back


def plan_round(
    requests: Sequence[RequestSpec], conv_kernel: int, rows: StateRows | None = None, kv_sink: int = -1
) -> HostRound:
    """Lay out `requests` as one flat stream and build all metadata, unpadded (`RoundPlan`)."""
    return RoundPlan(requests, conv_kernel, rows, kv_sink).host_round()
