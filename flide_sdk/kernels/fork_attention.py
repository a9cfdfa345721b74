"""ForkAttention: causal grouped-query attention over a round's flat stream, following each request's tree.

Token t sees its request's cached history (pool pages), the stream keys [key_lo[t], ctx_hi[t]) and the keys k
of [seg_lo[t], t] with t < vis_end[k] (its ancestors' and its own, not its earlier siblings'), and nothing else (`fork_attention_reference` is the definition). The kernel is a flash-attention
style online softmax over work items planned on the device (`TileTable`: tiles of rows that never cross a
trunk or branch region, their keys cut into splits merged afterwards), with Qwen3.5's output gate fused.
Launch shapes depend on the number of query rows and requests alone. Its tuning constants are one frozen
`ForkAttentionConfig`; why these values: docs/decisions/fork-attention-kernel.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flide_sdk.kernels import multiprocessors
from flide_sdk.kernels.plans import PAGE, AttentionPlan, TileTable

MAX_HEADS_PER_PROGRAM = 4  # the 16-bit default: the largest power of two dividing the group, up to this
SLOTS_PER_SM = 2  # program slots per multiprocessor at the 16-bit tiling: the default bound of extra work items
# the work planner (`_plan_work_kernel`, one program of PLAN_WARPS warps) takes PLAN_ROW_BLOCK query rows, then
# PLAN_BLOCK tiles at a time; the merge holds a whole tile's sums (MERGE_WARPS keep it in registers)
PLAN_ROW_BLOCK, PLAN_BLOCK, PLAN_WARPS, MERGE_WARPS = 2048, 256, 8, 8


@dataclass(frozen=True)
class ForkAttentionConfig:
    """The kernel's tuning constants. A program takes `heads_per_program` query heads sharing a key/value head
    (a power of two dividing the group; None: the largest up to MAX_HEADS_PER_PROGRAM) for a tile of
    block_rows // heads_per_program tokens (at least 16), so each key block it loads serves block_rows rows
    (`max_heads_per_program` bounds the default),
    and keys `block_keys` at a time (a divisor of the page size: a history block never crosses a page). A tile
    with more than `min_split_keys` keys (a multiple of the page size) and more than its share of the round's
    keys over `extra_items` (None: SLOTS_PER_SM per multiprocessor, per head block) is split. With
    `piece_tiles`, tiles never cross a piece (a trunk or one branch), so a branch's masked keys start at its
    fork whatever its siblings (`fork_attention_config`, batch-invariant)."""

    block_rows: int = 64
    heads_per_program: int | None = None
    max_heads_per_program: int = MAX_HEADS_PER_PROGRAM
    block_keys: int = 32
    warps: int = 4
    large_head_warps: int | None = None  # warps for head dims of 128 or more (None: `warps`)
    stages: int = 2
    min_split_keys: int = 512
    extra_items: int | None = None
    piece_tiles: bool = False


NO_SPLIT = 1 << 30  # min_split_keys of a config that never splits a tile's keys
FORK_ATTENTION = ForkAttentionConfig()  # 16-bit inputs
# float32 inputs (exact engine runs): one head per program, page-sized key blocks, one stage (shared memory)
FORK_ATTENTION_FLOAT32 = ForkAttentionConfig(heads_per_program=1, block_keys=PAGE, large_head_warps=8, stages=1)
# heads wider than WIDE_HEAD_DIM (Gemma 4's full layers: 512): a program's accumulator is rows x head_dim float32
# in registers and its q, key and value blocks rows (keys) x head_dim in shared memory, so fewer rows and keys a
# program. 16-bit: 32 rows (two heads of 16 tokens), 32 keys, two stages: q 32 KiB + keys and values 2 x 2 x 32
# KiB of shared memory on Hopper's 227, 64 accumulator registers a thread at 8 warps. float32: 16 rows, 16 keys,
# one stage: 32 + 2 x 32 KiB.
WIDE_HEAD_DIM = 256
FORK_ATTENTION_WIDE = ForkAttentionConfig(block_rows=32, max_heads_per_program=2, block_keys=32, warps=8)
FORK_ATTENTION_FLOAT32_WIDE = ForkAttentionConfig(block_rows=16, heads_per_program=1, block_keys=16, warps=8,
                                                  stages=1)


def fork_attention_config(dtype: torch.dtype, batch_invariant: bool = False, *, head_dim: int) -> ForkAttentionConfig:
    """The production config for inputs of `dtype` and heads of `head_dim`; batch-invariant: tiles of one piece
    and no key splits, so a row's key blocks (from position 0 for its context, from its piece's start for its own
    keys) and their order do not depend on the round."""
    if head_dim > WIDE_HEAD_DIM:
        config = FORK_ATTENTION_FLOAT32_WIDE if dtype == torch.float32 else FORK_ATTENTION_WIDE
    else:
        config = FORK_ATTENTION_FLOAT32 if dtype == torch.float32 else FORK_ATTENTION
    return dataclasses.replace(config, piece_tiles=True, min_split_keys=NO_SPLIT) if batch_invariant else config


@dataclass(frozen=True)
class _Tiling:
    """A config resolved for one model's heads on one device."""

    heads_per_program: int
    block_tokens: int
    head_blocks: int
    extra_items: int


def _tiling(config: ForkAttentionConfig, heads: int, kv_heads: int, device: torch.device) -> _Tiling:
    group = heads // kv_heads
    per_program = config.heads_per_program
    if per_program is None:
        per_program = max(1 << p for p in range(config.max_heads_per_program.bit_length()) if group % (1 << p) == 0)
    if config.block_keys < 16 or PAGE % config.block_keys:
        raise ValueError(f"block_keys={config.block_keys} must be at least 16 and divide the page size {PAGE}")
    if group % per_program or per_program & (per_program - 1):
        raise ValueError(f"heads_per_program={per_program} must be a power of two dividing the group size {group}")
    head_blocks = heads // per_program
    extra_items = config.extra_items
    if extra_items is None:
        extra_items = max(1, SLOTS_PER_SM * multiprocessors(device) // head_blocks)
    return _Tiling(per_program, max(16, config.block_rows // per_program), head_blocks, extra_items)


def plan_tiles_reference(
    rows: torch.Tensor, region_of: torch.Tensor, regions: int, block_tokens: int, num_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The tile table of query `rows` (sorted stream indices): (tile_start, num_tiles, max_tiles), as
    `_plan_work_kernel` builds it on the device.

    Tiles hold at most `block_tokens` rows and never cross a region, of which there are at most `regions`; a
    region is identified by `region_of` of its rows: ctx_hi (a request's start for its trunk rows, its trunk
    end for its branch rows) or, with piece tiles, seg_lo (each trunk and each branch). Tile i covers
    rows[tile_start[i]:tile_start[i + 1]]; entries past the last tile hold len(rows). Rows at or past
    `num_tokens` ([1]) are padding (their own region, at the tail): their tiles are not counted in num_tiles.
    """
    count = rows.shape[0]
    max_tiles = max_tiles_of(count, regions, block_tokens)
    index = torch.arange(count, device=rows.device)
    region = region_of[rows]
    new_region = torch.ones_like(index, dtype=torch.bool)
    new_region[1:] = region[1:] != region[:-1]
    region_first = torch.cummax(torch.where(new_region, index, 0), dim=0).values
    is_start = (index - region_first) % block_tokens == 0
    tile_of = torch.cumsum(is_start, dim=0) - 1
    tile_start = torch.full((max_tiles + 3,), count, dtype=torch.int64, device=rows.device)
    tile_start.scatter_(0, torch.where(is_start, tile_of, max_tiles + 2), index)  # the last entry: a dump
    return tile_start[: max_tiles + 2], (is_start & (rows < num_tokens)).sum().reshape(1), max_tiles


def max_tiles_of(rows: int, regions: int, block_tokens: int) -> int:
    """A bound on the tiles of `rows` query rows in at most `regions` regions (a request's trunk and its
    branches: two; with piece tiles, one per trunk and branch): each adds a partial tile to the full ones."""
    return -(-rows // block_tokens) + regions


def tile_table(
    plan: AttentionPlan, query_rows: torch.Tensor | None, num_rows: int, block_tokens: int,
    min_split_keys: int = ForkAttentionConfig.min_split_keys, extra_items: int | None = None,
    questions: int | None = None,
) -> TileTable:
    """The `TileTable` of `query_rows` (None: all `num_rows` stream rows) for tiles of `block_tokens` rows, built
    on the device by one launch. `extra_items` (default: the device's program slots) bounds the work items past
    one per tile. With `questions` (a bound on the round's branches), tiles never cross a piece."""
    device = plan.ctx_hi.device
    extra_items = SLOTS_PER_SM * multiprocessors(device) if extra_items is None else extra_items
    if min_split_keys < 1 or min_split_keys % PAGE or extra_items < 1:
        raise ValueError(f"min_split_keys={min_split_keys} must be a positive multiple of {PAGE} and "
                         f"extra_items={extra_items} positive")
    rows = torch.arange(num_rows, device=device) if query_rows is None else query_rows
    requests = plan.history_len.shape[0]
    # piece tiles: a trunk and a branch per question, and the padding rows' region
    max_tiles = max_tiles_of(rows.shape[0], 2 * requests if questions is None else requests + questions + 1,
                             block_tokens)
    max_items, max_partials = max_tiles + extra_items, 2 * extra_items
    tile_start = torch.empty(max_tiles + 2, dtype=torch.int64, device=device)
    num_tiles = torch.empty(1, dtype=torch.int64, device=device)
    item_tile = torch.empty(max_items, dtype=torch.int64, device=device)
    item_split = torch.empty_like(item_tile)
    tile_splits = torch.empty(max_tiles, dtype=torch.int64, device=device)
    tile_piece = torch.empty_like(tile_splits)
    partial_slot = torch.empty_like(tile_splits)
    num_items = torch.empty(1, dtype=torch.int64, device=device)
    _plan_work_kernel[(1,)](
        rows, rows.shape[0], plan.num_tokens, block_tokens, tile_start, num_tiles,
        plan.request_of, plan.history_len, plan.key_lo, plan.ctx_hi, plan.seg_lo, _see_hi(plan),
        item_tile, item_split, tile_splits, tile_piece, partial_slot, num_items, max_tiles, extra_items,
        min_split_keys,
        ROW_BLOCK=PLAN_ROW_BLOCK, BLOCK=PLAN_BLOCK, PAGE_SIZE=PAGE, PIECES=questions is not None,
        SEE_HI=plan.see_hi is not None, num_warps=PLAN_WARPS,
    )
    return TileTable(query_rows, block_tokens, min_split_keys, extra_items, questions is not None,
                     plan.see_hi is not None, rows, tile_start, num_tiles, max_tiles,
                     item_tile, item_split, tile_splits, tile_piece, partial_slot, num_items, max_items, max_partials)


def _see_hi(plan: AttentionPlan) -> torch.Tensor:
    """The plan's per-token key bounds, or any int64 tensor for the kernels to ignore (SEE_HI off)."""
    return plan.positions if plan.see_hi is None else plan.see_hi


def attention_tiles(
    plan: AttentionPlan, readout_rows: torch.Tensor | None, heads: int, kv_heads: int, head_dim: int,
    dtype: torch.dtype, config: ForkAttentionConfig | None = None,
) -> AttentionPlan:
    """`plan` with the tile tables of the stream's rows and (given) of `readout_rows`, for queries of `heads`
    heads of `head_dim` over `kv_heads` key/value heads in `dtype` (`config`: None, the production config of
    `dtype` and `head_dim`). The
    model builds them once per forward pass, inside it (a captured graph must contain their build), and its
    attention layers share them."""
    config = config or fork_attention_config(dtype, head_dim=head_dim)
    tiling = _tiling(config, heads, kv_heads, plan.ctx_hi.device)
    num_rows = plan.key_lo.shape[0]
    # piece tiles: a round has at most one branch per readout row (with none: per stream row)
    questions = (num_rows if readout_rows is None else readout_rows.shape[0]) if config.piece_tiles else None

    def table(rows: torch.Tensor | None) -> TileTable:
        return tile_table(plan, rows, num_rows, tiling.block_tokens, config.min_split_keys, tiling.extra_items,
                          questions)

    return dataclasses.replace(plan, stream_tiles=table(None),
                               readout_tiles=None if readout_rows is None else table(readout_rows))


@triton.jit
def _tile_bounds(rows_ptr, tile_start_ptr, request_of_ptr, history_len_ptr, key_lo_ptr, ctx_hi_ptr, seg_lo_ptr,
                 see_hi_ptr, tile, ok, SEE_HI: tl.constexpr):
    """For tiles `tile` (where `ok`): (the end of the masked keys, the request, its cached history length,
    the first stream key, the end of the keys every row sees, the start of the masked keys). The masked keys
    end after the last row, or with SEE_HI after its see_hi (non-decreasing along a trunk: the tile's last)."""
    i0 = tl.load(tile_start_ptr + tile, mask=ok, other=0)
    i1 = tl.load(tile_start_ptr + tile + 1, mask=ok, other=1)
    first = tl.load(rows_ptr + i0, mask=ok, other=0)
    last = tl.load(rows_ptr + i1 - 1, mask=ok, other=0)
    request = tl.load(request_of_ptr + first, mask=ok, other=0)
    history = tl.load(history_len_ptr + request, mask=ok, other=0)
    key_lo = tl.load(key_lo_ptr + first, mask=ok, other=0)
    ctx_hi = tl.load(ctx_hi_ptr + first, mask=ok, other=0)
    branch_tile = ctx_hi > key_lo  # branch rows see their whole trunk; trunk rows the trunk before the tile
    full_hi = tl.where(branch_tile, ctx_hi, first)
    masked_lo = tl.where(branch_tile, tl.load(seg_lo_ptr + first, mask=ok, other=0), first)
    if SEE_HI:
        last = tl.load(see_hi_ptr + last, mask=ok, other=0)
    return last + 1, request, history, key_lo, full_hi, masked_lo


@triton.jit
def _later(a, b):
    """The combine of the planner's running maximum (`tl.associative_scan`): the later region start."""
    return tl.maximum(a, b)


@triton.jit
def _plan_work_kernel(
    rows_ptr, count, num_tokens_ptr, block_tokens, tile_start_ptr, num_tiles_ptr,
    request_of_ptr, history_len_ptr, key_lo_ptr, ctx_hi_ptr, seg_lo_ptr, see_hi_ptr,
    item_tile_ptr, item_split_ptr, tile_splits_ptr, tile_piece_ptr, partial_slot_ptr, num_items_ptr,
    max_tiles, extra_items, min_split_keys,
    ROW_BLOCK: tl.constexpr, BLOCK: tl.constexpr, PAGE_SIZE: tl.constexpr, PIECES: tl.constexpr,
    SEE_HI: tl.constexpr,
):
    """One program: the tile table of the `count` query rows (`plan_tiles_reference`), ROW_BLOCK rows at a
    time; then the tiles' key counts, each tile's splits, pieces and partial slots, and the work items in tile
    order (see `TileTable`), BLOCK tiles at a time. A row starts a tile when it is a multiple of block_tokens
    rows past the first row of its region (regions: runs of equal ctx_hi, or of seg_lo with PIECES)."""
    region_ptr = seg_lo_ptr if PIECES else ctx_hi_ptr
    num_tokens = tl.load(num_tokens_ptr)
    lane_rows = tl.arange(0, ROW_BLOCK)
    tiles = tl.zeros((), dtype=tl.int64)  # tiles started so far, padding rows' included
    real_tiles = tl.zeros((), dtype=tl.int64)
    region_first = tl.zeros((), dtype=tl.int64)  # the first row of the region of the block's row before
    for r0 in range(0, count, ROW_BLOCK):
        i = (r0 + lane_rows).to(tl.int64)
        ok = i < count
        row = tl.load(rows_ptr + i, mask=ok, other=0)
        before = tl.load(rows_ptr + i - 1, mask=ok & (i > 0), other=0)
        region = tl.load(region_ptr + row, mask=ok, other=0)
        region_before = tl.load(region_ptr + before, mask=ok & (i > 0), other=0)
        new_region = (i == 0) | (region != region_before)
        first = tl.associative_scan(tl.where(new_region, i, region_first), 0, _later)
        starts = ok & ((i - first) % block_tokens == 0)
        tile = tiles + tl.cumsum(starts.to(tl.int64), axis=0) - 1
        tl.store(tile_start_ptr + tile, i, mask=starts)
        tiles += tl.sum(starts.to(tl.int64), axis=0)
        real_tiles += tl.sum((starts & (row < num_tokens)).to(tl.int64), axis=0)
        region_first = tl.max(tl.where(ok, first, 0), axis=0)
    for t0 in range(0, max_tiles + 2, BLOCK):
        tile = t0 + tl.arange(0, BLOCK)
        tl.store(tile_start_ptr + tile, count + tl.zeros_like(tile), mask=(tile >= tiles) & (tile < max_tiles + 2))
    tl.store(num_tiles_ptr, real_tiles)
    tl.debug_barrier()  # the split plan below reads the tile table this program's threads wrote

    num_tiles = real_tiles
    lane = tl.arange(0, BLOCK)
    total = tl.zeros((), dtype=tl.int64)
    for t0 in range(0, max_tiles, BLOCK):
        keys = _tile_keys(rows_ptr, tile_start_ptr, request_of_ptr, history_len_ptr, key_lo_ptr, ctx_hi_ptr,
                          seg_lo_ptr, see_hi_ptr, t0 + lane, t0 + lane < num_tiles, SEE_HI)
        total += tl.sum(keys, axis=0)
    split_keys = tl.maximum(min_split_keys, (total + extra_items - 1) // extra_items)
    items = tl.zeros((), dtype=tl.int64)
    partials = tl.zeros((), dtype=tl.int64)
    for t0 in range(0, max_tiles, BLOCK):
        tile = t0 + lane
        ok = tile < num_tiles
        keys = _tile_keys(rows_ptr, tile_start_ptr, request_of_ptr, history_len_ptr, key_lo_ptr, ctx_hi_ptr,
                          seg_lo_ptr, see_hi_ptr, tile, ok, SEE_HI)
        splits = tl.where(ok, tl.maximum((keys + split_keys - 1) // split_keys, 1), 0)
        # equal pieces, whole pages (a history piece starts on a page): the last is the shortest
        piece = ((keys + splits - 1) // tl.maximum(splits, 1) + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE
        starts = items + tl.cumsum(splits, axis=0) - splits
        several = tl.where(splits > 1, splits, 0)
        slots = partials + tl.cumsum(several, axis=0) - several
        in_table = tile < max_tiles
        tl.store(tile_splits_ptr + tile, splits, mask=in_table)
        tl.store(tile_piece_ptr + tile, piece, mask=in_table)
        tl.store(partial_slot_ptr + tile, tl.where(splits > 1, slots, -1), mask=in_table)
        for split in range(tl.max(splits, axis=0)):
            has = split < splits
            tl.store(item_tile_ptr + starts + split, tile, mask=has)
            tl.store(item_split_ptr + starts + split, split + tl.zeros_like(tile), mask=has)
        items += tl.sum(splits, axis=0)
        partials += tl.sum(several, axis=0)
    tl.store(num_items_ptr, items)


@triton.jit
def _tile_keys(rows_ptr, tile_start_ptr, request_of_ptr, history_len_ptr, key_lo_ptr, ctx_hi_ptr, seg_lo_ptr,
               see_hi_ptr, tile, ok, SEE_HI: tl.constexpr):
    """Keys each of the tiles `tile` visits (0 where not `ok`): its history, full and masked ranges."""
    masked_hi, _, history, key_lo, full_hi, masked_lo = _tile_bounds(
        rows_ptr, tile_start_ptr, request_of_ptr, history_len_ptr, key_lo_ptr, ctx_hi_ptr, seg_lo_ptr, see_hi_ptr,
        tile, ok, SEE_HI)
    return tl.where(ok, history + (full_hi - key_lo) + (masked_hi - masked_lo), 0)


@triton.jit
def _attend_block(
    q, acc, m_i, l_i, k_ptrs, v_ptrs, key_ok, visible, scale_log2, IEEE: tl.constexpr
):
    """One key block of the online softmax; `key_ok` masks loads, `visible` (or None) masks scores."""
    k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
    v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = scores * scale_log2
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(scores - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _fork_attention_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, o_ptr, gate_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    rows_ptr, tile_start_ptr, item_tile_ptr, item_split_ptr, tile_splits_ptr, tile_piece_ptr, partial_slot_ptr,
    num_items_ptr, key_lo_ptr, ctx_hi_ptr, seg_lo_ptr, request_of_ptr, history_len_ptr, page_offset_ptr, pages_ptr,
    vis_end_ptr, positions_ptr, see_hi_ptr, stride_qm, stride_qh, stride_km, stride_kh, stride_cm, stride_ch, stride_om,
    stride_oh, stride_gm, stride_gh, scale_log2, window,
    GROUP: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
    IEEE: tl.constexpr, GATED: tl.constexpr, PAGE_SIZE: tl.constexpr, WINDOWED: tl.constexpr,
    SEE_HI: tl.constexpr,
):
    """One work item (`TileTable`; programs past the round's items return at once): BT query tokens x HEADS
    query heads sharing one key/value head (BT * HEADS rows) over one piece of the tile's keys. A tile of one
    piece stores its output (with GATED, multiplied by sigmoid(gate) before its one rounding to o's dtype);
    the items of a tile of several store partial sums for `_merge_splits_kernel`. WINDOWED: a row sees only
    the keys at positions above its own minus `window`; history blocks before the tile's earliest window are
    skipped (a history key's position is its index), stream blocks no row sees are skipped after reading their
    positions (a block no row sees adds nothing: skipping it keeps every bit). SEE_HI: a row's own keys run to
    its see_hi, not to itself."""
    item = tl.program_id(0)
    if item >= tl.load(num_items_ptr):
        return
    head_block = tl.program_id(1)
    BM: tl.constexpr = BT * HEADS
    kv_head = head_block * HEADS // GROUP
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BN)
    r = tl.arange(0, BM)
    everyone = tl.full((BM, BN), 1, tl.int1)
    tile = tl.load(item_tile_ptr + item)
    split = tl.load(item_split_ptr + item)
    piece = tl.load(tile_piece_ptr + tile)
    lo = split * piece  # this item's keys: [lo, lo + piece) of the tile's
    hi = lo + piece
    masked_hi, request, history, key_lo, full_hi, masked_lo = _tile_bounds(
        rows_ptr, tile_start_ptr, request_of_ptr, history_len_ptr, key_lo_ptr, ctx_hi_ptr, seg_lo_ptr, see_hi_ptr,
        tile, True, SEE_HI)
    i0 = tl.load(tile_start_ptr + tile)
    i1 = tl.load(tile_start_ptr + tile + 1)
    # row r of the program is token i0 + r // HEADS, query head head_block * HEADS + r % HEADS
    offs_i = i0 + r // HEADS
    heads = head_block * HEADS + r % HEADS
    row_ok = offs_i < i1
    rows = tl.load(rows_ptr + offs_i, mask=row_ok, other=0)
    seg_lo = tl.load(seg_lo_ptr + rows, mask=row_ok, other=0)
    own_hi = tl.load(see_hi_ptr + rows, mask=row_ok, other=0) if SEE_HI else rows  # the last own key a row sees
    earliest = tl.load(positions_ptr + rows, mask=row_ok, other=0) - window  # WINDOWED: positions no longer seen
    first_seen = tl.min(tl.where(row_ok, earliest, 1 << 30)) + 1 if WINDOWED else 0  # no row sees keys before
    q = tl.load(q_ptr + offs_i[:, None] * stride_qm + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, HEAD_DIM), tl.float32)

    # 1. cached history, keys [0, history) of the tile's: blocks of one pool page (or an aligned part of
    # one: a split starts on a page), visible to every row
    page_list = pages_ptr + tl.load(page_offset_ptr + request)
    history_hi = tl.minimum(hi, history)
    history_lo = tl.minimum(lo, history)
    if WINDOWED:  # from the block holding the first key any row sees (aligned as the split's start is)
        history_lo = tl.maximum(history_lo, history_lo + (first_seen - history_lo) // BN * BN)
    for start in range(history_lo, history_hi, BN):
        page = tl.load(page_list + start // PAGE_SIZE)
        key_ok = start + n < history_hi
        slots = page * PAGE_SIZE + start % PAGE_SIZE + n
        k_ptrs = kc_ptr + slots[:, None] * stride_cm + kv_head * stride_ch + d[None, :]
        v_ptrs = vc_ptr + slots[:, None] * stride_cm + kv_head * stride_ch + d[None, :]
        visible = key_ok[None, :] & everyone
        if WINDOWED:  # a history key's position is its index
            visible = visible & ((start + n)[None, :] > earliest[:, None])
        acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_ptrs, v_ptrs, key_ok, visible, scale_log2, IEEE)

    # 2. stream keys every row sees (the tile's keys history + [0, full_hi - key_lo)): the trunk (branch
    # tiles) or the trunk before the tile (trunk tiles)
    full_start = key_lo + tl.maximum(lo - history, 0)
    full_stop = tl.minimum(full_hi, key_lo + tl.maximum(hi - history, 0))
    for start in range(full_start, full_stop, BN):
        keys = start + n
        key_ok = keys < full_stop
        k_ptrs = k_ptr + keys[:, None] * stride_km + kv_head * stride_kh + d[None, :]
        v_ptrs = v_ptr + keys[:, None] * stride_km + kv_head * stride_kh + d[None, :]
        if WINDOWED:
            seen = tl.load(positions_ptr + keys, mask=key_ok, other=-1)
            if tl.max(seen) >= first_seen:
                visible = key_ok[None, :] & everyone & (seen[None, :] > earliest[:, None])
                acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_ptrs, v_ptrs, key_ok, visible, scale_log2, IEEE)
        else:
            acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_ptrs, v_ptrs, key_ok, key_ok[None, :] & everyone,
                                          scale_log2, IEEE)

    # 3. keys only some rows see (the tile's last ones): masked by each row's own range, causality and the
    # keys' subtrees
    before = history + (full_hi - key_lo)
    masked_start = masked_lo + tl.maximum(lo - before, 0)
    masked_stop = tl.minimum(masked_hi, masked_lo + tl.maximum(hi - before, 0))
    for start in range(masked_start, masked_stop, BN):
        keys = start + n
        key_ok = keys < masked_stop
        vis_end = tl.load(vis_end_ptr + keys, mask=key_ok, other=0)
        visible = ((keys[None, :] >= seg_lo[:, None]) & (keys[None, :] <= own_hi[:, None])
                   & (rows[:, None] < vis_end[None, :]) & key_ok[None, :])
        k_ptrs = k_ptr + keys[:, None] * stride_km + kv_head * stride_kh + d[None, :]
        v_ptrs = v_ptr + keys[:, None] * stride_km + kv_head * stride_kh + d[None, :]
        if WINDOWED:
            seen = tl.load(positions_ptr + keys, mask=key_ok, other=-1)
            if tl.max(seen) >= first_seen:
                visible = visible & (seen[None, :] > earliest[:, None])
                acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_ptrs, v_ptrs, key_ok, visible, scale_log2, IEEE)
        else:
            acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_ptrs, v_ptrs, key_ok, visible, scale_log2, IEEE)

    if tl.load(tile_splits_ptr + tile) == 1:
        _store_output(acc, l_i, o_ptr, gate_ptr, offs_i, heads, row_ok, d, stride_om, stride_oh, stride_gm,
                      stride_gh, GATED)
    else:
        slot = (tl.load(partial_slot_ptr + tile) + split) * tl.num_programs(1) + head_block
        tl.store(part_acc_ptr + slot * BM * HEAD_DIM + r[:, None] * HEAD_DIM + d[None, :], acc)
        tl.store(part_m_ptr + slot * BM + r, m_i)
        tl.store(part_l_ptr + slot * BM + r, l_i)


@triton.jit
def _store_output(acc, l_i, o_ptr, gate_ptr, offs_i, heads, row_ok, d, stride_om, stride_oh, stride_gm, stride_gh,
                  GATED: tl.constexpr):
    """The normalised output of a tile's rows (times sigmoid(gate) with GATED), rounded once to o's dtype."""
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if GATED:
        gate = tl.load(gate_ptr + offs_i[:, None] * stride_gm + heads[:, None] * stride_gh + d[None, :],
                       mask=row_ok[:, None], other=0.0).to(tl.float32)
        out = out * tl.sigmoid(gate)
    tl.store(o_ptr + offs_i[:, None] * stride_om + heads[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_splits_kernel(
    o_ptr, gate_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, tile_start_ptr, tile_splits_ptr, partial_slot_ptr,
    stride_om, stride_oh, stride_gm, stride_gh,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BT: tl.constexpr, GATED: tl.constexpr,
):
    """Per (tile, head block) of a tile of several splits: its items' partial sums combined (each rescaled to
    the largest running maximum) and stored as `_fork_attention_kernel` stores a tile of one split."""
    tile = tl.program_id(0)
    head_block = tl.program_id(1)
    splits = tl.load(tile_splits_ptr + tile)
    if splits > 1:
        BM: tl.constexpr = BT * HEADS
        r = tl.arange(0, BM)
        d = tl.arange(0, HEAD_DIM)
        first_slot = tl.load(partial_slot_ptr + tile)
        m_i = tl.full((BM,), float("-inf"), tl.float32)
        l_i = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, HEAD_DIM), tl.float32)
        for split in range(splits):
            slot = (first_slot + split) * tl.num_programs(1) + head_block
            m_s = tl.load(part_m_ptr + slot * BM + r)
            m_new = tl.maximum(m_i, m_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_safe)
            beta = tl.math.exp2(m_s - m_safe)
            l_i = l_i * alpha + tl.load(part_l_ptr + slot * BM + r) * beta
            acc = acc * alpha[:, None] + tl.load(part_acc_ptr + slot * BM * HEAD_DIM + r[:, None] * HEAD_DIM
                                                 + d[None, :]) * beta[:, None]
            m_i = m_new
        i0 = tl.load(tile_start_ptr + tile)
        i1 = tl.load(tile_start_ptr + tile + 1)
        offs_i = i0 + r // HEADS
        heads = head_block * HEADS + r % HEADS
        _store_output(acc, l_i, o_ptr, gate_ptr, offs_i, heads, offs_i < i1, d, stride_om, stride_oh, stride_gm,
                      stride_gh, GATED)


def fork_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: AttentionPlan,
    query_rows: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    gate: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    window: int | None = None,
    config: ForkAttentionConfig | None = None,
) -> torch.Tensor:
    """The Triton kernel behind the same contract as `fork_attention_reference` (no host synchronisation).

    `config` (None: the production config of q's dtype and head dim) holds the tuning constants. The work table is the
    plan's (`attention_tiles`) for its row set, which must have been built for this config; a plan without one
    gets a table built for this call.
    """
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    if k.stride() != v.stride() or k_cache.stride() != v_cache.stride():
        raise ValueError("keys and values (and their caches) must share a layout")
    config = config or fork_attention_config(q.dtype, head_dim=head_dim)
    tiling = _tiling(config, heads, kv_heads, q.device)
    table = plan.stream_tiles if query_rows is None else plan.readout_tiles
    if table is None:
        table = tile_table(plan, query_rows, k.shape[0], tiling.block_tokens, config.min_split_keys,
                           tiling.extra_items, k.shape[0] if config.piece_tiles else None)
    elif (table.query_rows is not query_rows or table.rows.shape[0] != q.shape[0]
          or (table.block_tokens, table.min_split_keys, table.extra_items, table.piece_tiles, table.see_hi)
          != (tiling.block_tokens, config.min_split_keys, tiling.extra_items, config.piece_tiles,
              plan.see_hi is not None)):
        raise ValueError("the plan's tile table was built for other query rows, another tiling or other key bounds")
    block_tokens, heads_per_program, head_blocks = tiling.block_tokens, tiling.heads_per_program, tiling.head_blocks
    warps = config.large_head_warps if config.large_head_warps is not None and head_dim >= 128 else config.warps
    out = torch.empty_like(q)
    gated = gate if gate is not None else q  # any tensor: not read unless GATED
    rows_per_program = block_tokens * heads_per_program
    part_m = torch.empty(table.max_partials, head_blocks, rows_per_program, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(*part_m.shape, head_dim, dtype=torch.float32, device=q.device)
    _fork_attention_kernel[(table.max_items, head_blocks)](
        q, k, v, k_cache, v_cache, out, gated, part_acc, part_m, part_l,
        table.rows, table.tile_start, table.item_tile, table.item_split, table.tile_splits, table.tile_piece,
        table.partial_slot, table.num_items,
        plan.key_lo, plan.ctx_hi, plan.seg_lo, plan.request_of, plan.history_len, plan.page_offset, plan.pages,
        plan.vis_end, plan.positions, _see_hi(plan), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1), gated.stride(0), gated.stride(1),
        (head_dim**-0.5 if scale is None else scale) * math.log2(math.e), 0 if window is None else window,
        GROUP=heads // kv_heads, HEADS=heads_per_program, HEAD_DIM=head_dim, BT=block_tokens, BN=config.block_keys,
        IEEE=q.dtype == torch.float32, GATED=gate is not None, PAGE_SIZE=PAGE, WINDOWED=window is not None,
        SEE_HI=plan.see_hi is not None, num_warps=warps,
        num_stages=config.stages,
    )
    _merge_splits_kernel[(table.max_tiles, head_blocks)](
        out, gated, part_acc, part_m, part_l, table.tile_start, table.tile_splits, table.partial_slot,
        out.stride(0), out.stride(1), gated.stride(0), gated.stride(1),
        HEADS=heads_per_program, HEAD_DIM=head_dim, BT=block_tokens, GATED=gate is not None, num_warps=MERGE_WARPS,
    )
    return out
