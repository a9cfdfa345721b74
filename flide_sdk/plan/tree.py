"""A round as a tree of pieces laid out as one flat stream, and the one writer of its staged form.

A piece is a run of stream tokens with a parent: a request's trunk (depth 0) continues its cached history,
each question's branch (depth 1) continues its trunk, a text-scored question's options (depths 2 and 3)
continue its branch (read at their tokens: `text_reads`), and a fork of the request computed in the same round
continues its trunk at the trunk's save point (`RequestSpec.forks`: its own trunk, branches and forks below).
The stream packs each request's trunk, its branch pieces, then its forks' subtrees, in tree order (a piece's
subtree follows it), with no padding between requests. Visibility follows the tree: a token sees its request's
cached history, its ancestors' tokens and its own piece up to itself; in stream coordinates, the keys
[key_lo, ctx_hi) (the root trunk up to its depth-1 ancestor's position) and those k of [seg_lo, t] (from its
depth-1 ancestor on) whose piece's subtree holds t (t < vis_end[k]).

Gated DeltaNet runs level by level, the levels being depths of the tree: the root trunk up to its save point,
the root trunk past it, then one level per depth from 1. Each piece is a segment of its level that starts from
a row of the state arena (`StateRows`) and may write its final state to another (a scratch row where other
pieces continue it, a pool slot at a save point), so resuming and saving move no state. Short siblings of one
parent share chunk rows (`pack_siblings`). Within a level, segments are sorted by chunk count, longest first,
so at scan step j the active segments are exactly the first `active[j]`; the segments' first chunks are the
level's first rows, then each segment's later chunks follow one segment after the other (`step_base`). A trunk's first part names its remainder in the next level (`chain`), so the scan
carries the state from one into the other without a launch between.

`RoundPlan.stage` writes the round's staged form into arrays of any `RoundShape` it fits, padded at the tail
only (so a captured graph reads any round that fits): the piece table, the segment tables and the chunk rows'
spans, from which `kernels.round_metadata` derives every per-token and per-chunk-position array.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from flide_sdk.kernels.plans import DISCARD_ROW, GDN_CHUNK, MAX_CONV_WINDOW, PAGE, PIECE_ROWS, ZERO_TAP
from flide_sdk.plan.requests import Branches, RequestSpec, StateRows, TextReads, state_rows_needed
from flide_sdk.plan.shape import LEVELS, RoundShape


class Piece(NamedTuple):
    """A node of the round's tree: `length` stream tokens from `start`, at prompt positions from `position`;
    `parent` is the index of the piece it continues (-1: the request's cached history)."""

    start: int
    length: int
    position: int
    parent: int
    depth: int
    request: int


class Segment(NamedTuple):
    """A Gated DeltaNet segment: `length` tokens from stream index `start`, from state row `init_row`, its
    final state written to `final_row` (DISCARD_ROW: not kept)."""

    start: int
    length: int
    init_row: int
    final_row: int


class TrunkSave(NamedTuple):
    """Where a request's checkpoint comes from in the stream: its trunk's start and the tokens up to the save
    point (their keys/values go to `kv_slots`); the conv window before the save point is the conv taps of the
    token before it."""

    stream_start: int
    tokens: int
    slot: int
    kv_slots: np.ndarray
    sliding_kv_slots: np.ndarray


def pack_siblings(segments: list[Segment]) -> list[Segment]:
    """Runs of stream-adjacent segments from one init row whose final states are not kept, as few segments of at
    most GDN_CHUNK tokens: short siblings (a trunk's questions, a question's options) share a chunk row, each of
    its pieces from the segment's state (`DeltaPlan.piece_lo`)."""
    packed: list[Segment] = []
    for segment in segments:
        last = packed[-1] if packed else None
        if (last is not None and segment.final_row == last.final_row == DISCARD_ROW
                and segment.init_row == last.init_row and last.start + last.length == segment.start
                and last.length + segment.length <= GDN_CHUNK):
            packed[-1] = last._replace(length=last.length + segment.length)
        else:
            packed.append(segment)
    return packed


class LevelPlan:
    """One Gated DeltaNet level of a round (host lists): segments longest first, each segment's first chunk at
    row s, its later chunks at consecutive rows from `step_base[s] + 1`, so the scan's tile addresses are affine
    in the step and its loads can be issued ahead."""

    def __init__(self, segments: list[Segment]) -> None:
        ordered = sorted(segments, key=lambda segment: -segment.length)  # stable: ties keep stream order
        counts = [-(-segment.length // GDN_CHUNK) for segment in ordered]
        self.row_start = [segment.start for segment in ordered]
        self.row_end = [segment.start + segment.length for segment in ordered]
        step_base, base = [], len(ordered) - 1
        for segment, count in zip(ordered, counts):
            step_base.append(base)
            if count > 1:
                end = segment.start + segment.length
                self.row_start.extend(range(segment.start + GDN_CHUNK, segment.start + count * GDN_CHUNK, GDN_CHUNK))
                self.row_end.extend([end] * (count - 1))
            base += count - 1
        # SEGMENT_ROWS
        self.segment_rows = [[s.init_row for s in ordered], [s.final_row for s in ordered], counts, step_base,
                             [-1] * len(ordered)]
        self.chained = False  # every segment continues one of the level before (`DeltaLevel.chained`)

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


class RoundPlan:
    """A round's requests as a tree of pieces in one flat stream, and its Gated DeltaNet levels, as host lists:
    a round has few pieces, and a Python list costs far less per element than a numpy call per call.

    rows: where states live (default: a compact standalone table, `StateRows.compact`). kv_sink: the flat
    pool position that keys/values of unsaved tokens are written to (-1: the last position of the arena).
    pack: whether short sibling pieces share Gated DeltaNet chunk rows (`pack_siblings`; not in the
    batch-invariant mode, where a chunk's sums must not depend on its neighbours). sliding: whether the model's
    sliding-window layers have pages of their own (the round stages their page table and KV slots too, from the
    requests' `Resume.sliding_pages` and `Save.sliding_kv_slots`). Empty levels are kept (with
    no chunks), so a round has at least LEVELS levels.
    """

    def __init__(self, requests: Sequence[RequestSpec], conv_kernel: int, rows: StateRows | None = None,
                 kv_sink: int = -1, pack: bool = True, sliding: bool = False) -> None:
        if conv_kernel - 1 > MAX_CONV_WINDOW:
            raise ValueError(f"a conv kernel of {conv_kernel} reads more than {MAX_CONV_WINDOW} tokens back")
        rows = rows or StateRows.compact(requests)
        needed = state_rows_needed(requests)
        if needed > rows.scratch_count:
            raise ValueError(f"{needed} scratch state rows needed (trunks, splits and continued branches), "
                             f"{rows.scratch_count} available")
        self.requests, self.conv_kernel, self.rows, self.kv_sink = list(requests), conv_kernel, rows, kv_sink
        self.sliding = sliding
        self.pieces: list[Piece] = []
        self.saves: list[TrunkSave] = []
        self.resume_index: list[int] = []  # per request: its index among the resumed requests (-1: none)
        self.readout: list[int] = []  # stream index of each question's last token
        self.request_bounds: list[tuple[int, int]] = []
        self.label_width = 1
        self.num_pages = 0
        self._text: list[TextReads] = []  # the reads of text-scored options: stream rows, round question indices
        self._segments: list[list[Segment]] = [[] for _ in range(LEVELS)]
        self._finals: dict[int, int] = {}  # piece index -> the row its final state is kept in
        self._next_row = rows.scratch  # the next free scratch row
        self._ids: list[np.ndarray] = []  # the stream's ids, piece by piece
        self._branches: list[Branches] = []  # each request's and fork's branches, in stream order
        cursor = resumes = 0
        for index, request in enumerate(self.requests):
            first = request.start
            if (first > 0) != (request.resume is not None):
                raise ValueError("a request starts past position 0 exactly when it resumes from a checkpoint")
            init = rows.zero
            self.resume_index.append(resumes if request.resume is not None else -1)
            if request.resume is not None:
                init = rows.slot_base + request.resume.slot
                resumes += 1
                self.num_pages += len(request.resume.pages[: -(-first // PAGE)])
            end = self._lay_out(request, index, cursor, -1, init)
            self.request_bounds.append((cursor, end))
            cursor = end
        self.num_real = cursor
        self.text_reads = TextReads.concat(self._text) if self._text else TextReads.empty()
        self.num_resumes = resumes
        self.levels = [LevelPlan(pack_siblings(level) if pack and index >= LEVELS - 1 else level)
                       for index, level in enumerate(self._segments)]
        # a trunk's remainder starts from its first part's final row: the scan runs both in one program
        first_parts, remainders = self.levels[0].segment_rows, self.levels[1].segment_rows
        continuing = {init: k for k, init in enumerate(remainders[0])}
        first_parts[4] = [continuing.get(final, -1) for final in first_parts[1]]
        self.levels[1].chained = True
        self.shape = RoundShape.of(self)

    def _row(self) -> int:
        row, self._next_row = self._next_row, self._next_row + 1
        return row

    def _segment(self, level: int, segment: Segment) -> None:
        while len(self._segments) <= level:
            self._segments.append([])
        self._segments[level].append(segment)

    def _lay_out(self, request: RequestSpec, index: int, cursor: int, parent: int, init: int) -> int:
        """Lay out `request` (a trunk, or with `parent` >= 0 a fork continuing that piece from position
        request.start) from stream index `cursor`: its trunk, its branches, then its forks' subtrees; its state
        starts from row `init`. Returns the stream index after it."""
        first, computed = request.start, len(request.trunk)
        if computed < 1:
            raise ValueError("every request computes at least one trunk token")
        split = request.save.at if request.save is not None else request.forks[0].start if request.forks else None
        if split is not None and not first < split <= first + computed:
            raise ValueError("a save or fork point lies outside its request's computed trunk (start, end]")
        if any(fork.start != split for fork in request.forks):
            raise ValueError("a request's forks continue it from its save point")
        split_row = None if split is None else (
            self.rows.slot_base + request.save.slot if request.save is not None else self._row())
        if request.save is not None:
            self.saves.append(TrunkSave(cursor, split - first, request.save.slot, request.save.kv_slots,
                                        request.save.sliding_kv_slots))
        self._ids.append(request.trunk)
        if parent < 0:  # a root trunk: one piece; the GDN runs it to its split point, then on (chained)
            trunk = anchor = len(self.pieces)
            self.pieces.append(Piece(cursor, computed, first, -1, 0, index))
            last = self._row()  # a row of its own even when its save point ends it: rows follow the requests
            if split is not None and split == first + computed:
                last = split_row
            if split is None:
                self._segment(0, Segment(cursor, computed, init, last))
            else:
                self._segment(0, Segment(cursor, split - first, init, split_row))
                if split < first + computed:
                    self._segment(1, Segment(cursor + split - first, first + computed - split, split_row, last))
        else:  # a fork: its part before its split point is a piece of its own, which its forks continue
            depth = self.pieces[parent].depth + 1
            head = computed if split is None else split - first
            trunk = anchor = len(self.pieces)
            self.pieces.append(Piece(cursor, head, first, parent, depth, index))
            last = split_row if split is not None and head == computed else self._row()
            self._segment(depth + 1, Segment(cursor, head, init, split_row if split is not None else last))
            if head < computed:
                trunk = len(self.pieces)
                self.pieces.append(Piece(cursor + head, computed - head, first + head, anchor, depth + 1, index))
                self._segment(depth + 2, Segment(cursor + head, computed - head, split_row, last))
        self._finals[trunk] = last
        at, branches, first_branch = cursor + computed, request.branches, len(self.pieces)
        continued = set(branches.parents.tolist())
        for local, (length, above_index) in enumerate(zip(branches.lengths.tolist(), branches.parents.tolist())):
            above_index = trunk if above_index < 0 else first_branch + above_index
            above = self.pieces[above_index]
            self.pieces.append(Piece(at, length, above.position + above.length, above_index, above.depth + 1, index))
            final = DISCARD_ROW
            if local in continued:
                final = self._finals[len(self.pieces) - 1] = self._row()
            self._segment(above.depth + 2, Segment(at, length, self._finals[above_index], final))
            at += length
        self._ids.append(branches.ids)
        self._branches.append(branches)
        if len(branches.reads):
            self._text.append(branches.reads.shifted(cursor + computed, len(self.readout)))
        self.readout.extend((branches.readout + cursor + computed).tolist())
        self.label_width = max(self.label_width, branches.labels.shape[1])
        for fork in request.forks:
            at = self._lay_out(fork, index, at, anchor, split_row)
        return at

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def num_questions(self) -> int:
        return len(self.readout)

    def piece_table(self) -> np.ndarray:
        """The pieces as `kernels.round_metadata` reads them, [PIECE_ROWS, pieces]: each piece's start and its
        conv taps' sources before it (`plans.CONV_PIECE_ROWS`), its offset (position - start), its visible ranges
        (key_lo, ctx_hi: the trunk; seg_lo: from its depth-1 ancestor, or itself), its request, the end of its
        subtree (vis_end) and its own start (piece_lo)."""
        ends = [piece.start + piece.length for piece in self.pieces]
        for index in range(len(self.pieces) - 1, -1, -1):  # children come after their parents
            parent = self.pieces[index].parent
            if parent >= 0:
                ends[parent] = max(ends[parent], ends[index])
        columns, roots, lows, highs = [], [], [], []
        for piece, vis_end in zip(self.pieces, ends):
            if piece.parent < 0:
                root = piece
                ctx_hi = seg_lo = piece.start
            elif piece.depth == 1:  # it sees the root's tokens before its position
                root = roots[piece.parent]
                ctx_hi, seg_lo = root.start + piece.position - root.position, piece.start
            else:
                root, ctx_hi, seg_lo = roots[piece.parent], highs[piece.parent], lows[piece.parent]
            roots.append(root)
            lows.append(seg_lo)
            highs.append(ctx_hi)
            columns.append((piece.start, *self._taps(piece, root), piece.position - piece.start, root.start, ctx_hi,
                            seg_lo, piece.request, vis_end, piece.start))
        return np.array(columns, dtype=np.int64).reshape(-1, len(PIECE_ROWS)).T

    def _taps(self, piece: Piece, root: Piece) -> list[int]:
        """The sources of positions piece.position - d, d = 1..MAX_CONV_WINDOW (`plans.CONV_PIECE_ROWS`): the
        ancestor's stream token holding it, else the request's resumed conv window, else zero."""
        window, taps = self.conv_kernel - 1, []
        for back in range(1, MAX_CONV_WINDOW + 1):
            position, node = piece.position - back, piece.parent
            while node >= 0 and position < self.pieces[node].position:
                node = self.pieces[node].parent
            if node >= 0:
                taps.append(self.pieces[node].start + position - self.pieces[node].position)
            elif back <= window and position >= 0:  # before the root: a resumed request's window
                window_entry = self.resume_index[piece.request] * window + position - root.position + window
                taps.append(-2 - window_entry)
            else:
                taps.append(ZERO_TAP)
        return taps

    def stage(self, out: dict[str, np.ndarray], shape: RoundShape, window_sink: int) -> None:
        """The round's staged form into `out` (arrays shaped as `shape.staged_shapes()`, a shape the round
        fits), padded only at the tail: padding tokens form one region of their own after the real tokens (they
        see nothing real and nothing real sees them; their keys/values go to the kv sink), padded segments are
        empty and start from the zero row (`level_sizes` keeps the real counts, so the Gated DeltaNet kernels
        never visit them), padded saves and resumes use the pool slot `window_sink`, and padded readout rows read
        the first padding token (with one label, so their softmax stays finite; padded text reads with target -1)."""
        real, count, questions = self.num_real, self.num_requests, self.num_questions
        ids = out["ids"]
        if real:
            np.concatenate(self._ids, out=ids[:real], casting="unsafe")
        ids[real:] = 0
        out["pieces"][:, : len(self.pieces)] = self.piece_table()
        out["pieces"][:, len(self.pieces) :] = 0
        out["piece_counts"][:] = (len(self.pieces), count)
        out["num_tokens"][0] = real

        kv = out["kv_slots"]
        kv[:] = self.kv_sink
        for save in self.saves:
            kv[save.stream_start : save.stream_start + save.tokens] = save.kv_slots
        if self.sliding:
            kv = out["sliding_kv_slots"]
            kv[:] = self.kv_sink  # both kinds share the sink page
            for save in self.saves:
                kv[save.stream_start : save.stream_start + save.tokens] = save.sliding_kv_slots
        save_tokens, save_slots = out["save_tokens"], out["save_slots"]
        save_tokens[: len(self.saves)] = [save.stream_start + save.tokens - 1 for save in self.saves]
        save_tokens[len(self.saves) :] = 0
        save_slots[: len(self.saves)] = [save.slot for save in self.saves]
        save_slots[len(self.saves) :] = window_sink
        resume_slots = out["resume_slots"]
        resume_slots[: self.num_resumes] = [r.resume.slot for r in self.requests if r.resume is not None]
        resume_slots[self.num_resumes :] = window_sink

        readout, labels = out["readout_rows"], out["label_ids"]
        readout[:questions] = self.readout
        readout[questions:] = real
        if questions:
            table = Branches.join(self._branches).labels
            labels[:questions, : table.shape[1]] = table
            labels[:questions, table.shape[1] :] = -1
        labels[questions:] = -1
        labels[questions:, 0] = 0
        reads, count_reads = self.text_reads, len(self.text_reads)
        out["text_rows"][:count_reads] = reads.offset
        out["text_rows"][count_reads:] = real
        out["text_targets"][:count_reads] = reads.target
        out["text_targets"][count_reads:] = -1  # no token: the head skips padded reads

        history_len, page_offset, pages = out["history_len"], out["page_offset"], out["pages"]
        history_len[:count] = [request.start for request in self.requests]
        history_len[count:] = 0
        offsets, used, parts, sliding_parts = [], 0, [], []
        for request in self.requests:
            offsets.append(used)
            if request.resume is not None:
                blocks = -(-request.start // PAGE)
                parts.append(np.asarray(request.resume.pages[:blocks]))
                if self.sliding:
                    sliding_parts.append(np.asarray(request.resume.sliding_pages[:blocks]))
                used += len(parts[-1])
        page_offset[:count] = offsets
        page_offset[count:] = 0
        tables = [(pages, parts)] + ([(out["sliding_pages"], sliding_parts)] if self.sliding else [])
        for table, table_parts in tables:  # the sliding layers' table at the same offsets as the full layers'
            if table_parts:
                np.concatenate(table_parts, out=table[:used], casting="unsafe")
            table[used:] = 0

        segment_rows, spans, sizes = out["segment_rows"], out["chunk_spans"], out["level_sizes"]
        segment_rows[:] = np.array([[self.rows.zero], [DISCARD_ROW], [0], [0], [-1]], dtype=np.int64)  # SEGMENT_ROWS
        spans[:] = shape.tokens  # padding rows: the empty span at the capacity's end
        sizes[:] = 0  # the shape's levels past the round's are empty
        if len(self.levels) > len(shape.segments):
            raise ValueError(f"a round of {len(self.levels)} levels staged at a shape of {len(shape.segments)}")
        for level, plan, segment_at, chunk_at in zip(range(len(self.levels)), self.levels, shape.segment_offsets,
                                                     shape.chunk_offsets):
            if plan.segments:
                segment_rows[:, segment_at : segment_at + plan.segments] = plan.segment_rows
            if plan.chunks:
                spans[0, chunk_at : chunk_at + plan.chunks] = plan.row_start
                spans[1, chunk_at : chunk_at + plan.chunks] = plan.row_end
            sizes[level] = (plan.chunks, plan.segments)
