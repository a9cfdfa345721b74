"""Forked Gated DeltaNet: the chunked gated delta rule over the segments of a round, level by level.

Per head, with state S (Dk x Dv), decay g_t (log space) and rate beta_t, token t does
    S <- exp(g_t) * S;  S <- S + k_t (beta_t * (v_t - S^T k_t))^T;  o_t = S^T q_t
with q, k L2-normalised and q scaled by Dk^-1/2, in chunks of GDN_CHUNK tokens (the UT/WY form). A level is a set
of independent segments, each starting from the state row `init_row` and, unless its `final_row` is DISCARD_ROW,
writing its final state there; branches start from their trunk's final state, so each computes exactly what it
computes alone. `gated_delta_reference` is the definition; `gated_delta_triton` the kernels (grids that depend
only on tensor shapes: CUDA-graph safe): the chunk prep (`gated_delta_prep`), the state scan (a trunk level's
fused with its outputs in rounds of few trunks), and the output kernel. Tuning constants: one frozen
`GatedDeltaConfig`; the design and what was measured: docs/decisions/gated-delta-kernel.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from flide_sdk.kernels import multiprocessors
from flide_sdk.kernels.gated_delta_prep import (
    branch_rows_aside,
    chunk_prep_kernel,
    fused_round,
    fused_step_count,
    later_shift,
    of_level,
    prep_row,
    real_row,
    real_row_ends,
)
from flide_sdk.kernels.plans import GDN_CHUNK, DeltaLevel, DeltaPlan
from flide_sdk.kernels.reference import L2_EPS


@triton.jit
def _scan_tiles(base, k_rows_ptr, w_ptr, u_ptr, k_gate_ptr, decay_ptr, cols,
                DK: tl.constexpr, DV: tl.constexpr, L: tl.constexpr):
    """What one chunk (row `base` of the [chunk * head] tables) of the scan reads for the recurrence: K, W,
    the U tile, the k gates and the chunk's decay."""
    i = tl.arange(0, L)
    dk = tl.arange(0, DK)
    k = tl.load(k_rows_ptr + base * L * DK + i[:, None] * DK + dk[None, :])
    w = tl.load(w_ptr + base * L * DK + i[:, None] * DK + dk[None, :])
    u = tl.load(u_ptr + base * L * DV + i[:, None] * DV + cols[None, :])
    k_gate = tl.load(k_gate_ptr + base * L + i)
    decay = tl.load(decay_ptr + base)
    return k, w, u, k_gate, decay


@triton.jit
def _output_tiles(base, tokens_ptr, q_rows_ptr, a_ptr, q_gate_ptr, DK: tl.constexpr, L: tl.constexpr):
    """What one chunk of the scan reads for its outputs (FUSED): its stream rows (at `tokens_ptr`), the query
    rows, the causal q-k block and the q gates."""
    i = tl.arange(0, L)
    dk = tl.arange(0, DK)
    tok = tl.load(tokens_ptr + i)
    q = tl.load(q_rows_ptr + base * L * DK + i[:, None] * DK + dk[None, :])
    a = tl.load(a_ptr + base * L * L + i[:, None] * L + i[None, :])
    q_gate = tl.load(q_gate_ptr + base * L + i)
    return tok, q, a, q_gate


@triton.jit
def _scan_step(state, v_new, k, w, k_gate, decay, PREC: tl.constexpr):
    """The state at the end of a chunk from the state at its start and the chunk's v_new = U - W S."""
    update = (k_gate[:, None] * v_new).to(w.dtype)
    return state * decay + tl.dot(tl.trans(k.to(w.dtype)), update, input_precision=PREC)


@triton.jit
def _scan_chunks(state, first_row, later_base, steps, head, heads, k_rows_ptr, w_ptr, u_ptr, k_gate_ptr, decay_ptr,
                 v_new_ptr, h_ptr, shift, tokens_ptr, level_start, q_rows_ptr, a_ptr, q_gate_ptr, out_ptr, total,
                 stride_ot, stride_oh, cols, DK: tl.constexpr, DV: tl.constexpr, L: tl.constexpr, PREC: tl.constexpr,
                 FUSED: tl.constexpr):
    """The state slice moved through a segment's `steps` chunks: chunk 0 at stacked row `first_row`, chunk j > 0 at
    `later_base + j` (arithmetic in j, so the pipeline issues a step's tile loads ahead). Per chunk, with FUSED, its
    outputs o = (q exp(cum)) S + (q K^T * Gamma) v_new are stored (a row's tokens are row - `level_start` of the
    level's table at `tokens_ptr`); otherwise, past chunk 0, the state at its start S and v_new = U - W S, at row -
    `shift` of the later-chunk tables (`later_shift`), for `_chunk_output_kernel`. S and v_new enter the products in
    the storage dtype of W and U, rounded as the output kernel reads them, so both ways give the same outputs."""
    i = tl.arange(0, L)
    dk = tl.arange(0, DK)
    for j in range(steps):
        chunk = tl.where(j == 0, first_row, later_base + j)
        base = chunk * heads + head
        k, w, u, k_gate, decay = _scan_tiles(base, k_rows_ptr, w_ptr, u_ptr, k_gate_ptr, decay_ptr, cols, DK, DV, L)
        low = state.to(w.dtype)
        v_new = u.to(tl.float32) - tl.dot(w, low, input_precision=PREC)
        if FUSED:
            tok, q, a, q_gate = _output_tiles(base, tokens_ptr + (chunk - level_start) * L, q_rows_ptr, a_ptr,
                                              q_gate_ptr, DK, L)
            out = q_gate[:, None] * tl.dot(q.to(w.dtype), low, input_precision=PREC)
            out += tl.dot(a, v_new.to(w.dtype), input_precision=PREC)
            tl.store(out_ptr + tok[:, None] * stride_ot + head * stride_oh + cols[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=(tok < total)[:, None])
        elif j > 0:  # the output kernel starts a segment's first chunk from its init row itself
            later = (chunk - shift) * heads + head
            tl.store(h_ptr + later * DK * DV + dk[:, None] * DV + cols[None, :], low.to(h_ptr.dtype.element_ty))
            tl.store(v_new_ptr + later * L * DV + i[:, None] * DV + cols[None, :],
                     v_new.to(v_new_ptr.dtype.element_ty))
        state = _scan_step(state, v_new, k, w, k_gate, decay, PREC)
    return state


@triton.jit
def _state_scan_kernel(
    k_rows_ptr, w_ptr, u_ptr, k_gate_ptr, decay_ptr, v_new_ptr, h_ptr, states_ptr,
    chunk_count_ptr, step_base_ptr, init_row_ptr, final_row_ptr, sizes_ptr,
    chain_ptr, next_count_ptr, next_step_base_ptr, next_final_row_ptr,
    tokens_ptr, next_tokens_ptr, q_rows_ptr, a_ptr, q_gate_ptr, out_ptr, total, trunk_sizes_ptr, fused_trunks,
    stride_sr, stride_sh, stride_sk, stride_ot, stride_oh,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, piece_lo_ptr, tokens0_ptr, tokens1_ptr, tokens2_ptr,
    sizes0_ptr, sizes1_ptr, sizes2_ptr,
    system_ptr, scale, eps, helpers, helper_steps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, TILES: tl.constexpr,
    L: tl.constexpr, PREC: tl.constexpr, LEVEL: tl.constexpr, CHAIN: tl.constexpr, FUSED: tl.constexpr,
    GATED: tl.constexpr, HELP: tl.constexpr, GROUP: tl.constexpr, SUB: tl.constexpr, LOG2_SUB: tl.constexpr,
    COLS: tl.constexpr,
):
    """Per (value head, V split, segment): TILES V tiles of BV columns, one after the other; a program
    takes segments pid, pid + P, ... of level LEVEL's real segments (`sizes[1]`; sorted longest first, so the
    first P run in parallel). The segment axis is the grid's last, so the programs of the first segments
    start first: a graph's grid is sized for its capacity, and most of a lone ask's programs find no segment.

    Per tile the [DK, BV] slice of the state lives in registers from the segment's init row through all its
    chunks (`_scan_chunks`): only the two products the recurrence needs are sequential. With FUSED the output
    products ride along each step, so nothing else goes through memory; the launch runs only in rounds with at
    most `fused_trunks` trunks (`fused_round`). Otherwise (with GATED, only in the other rounds) each step past
    the first stores the state at the chunk's start and v_new, and `_chunk_output_kernel`, which computes a first
    chunk's v_new from the init row itself, takes the outputs in parallel: a segment of one chunk whose final
    state is discarded (a short branch) needs nothing from this scan and is skipped.
    Everything a step reads is contiguous per (chunk, head), zero on padding rows: no gathers, no masks.
    A segment's chunk j is row `segment` for j = 0 and `step_base[segment] + j` after it: the addresses are
    arithmetic in j (no load in the loop decides them), so the compiler's pipeline issues a step's tile loads
    (num_stages - 1) steps ahead.
    With CHAIN, a segment whose `chain` entry names a segment of the next level (a trunk's remainder past its
    save point) goes on into it from the state in registers: the next level needs no launch of its own.
    The work tables are stacked (`stacked_rows`): a level's rows start where the real rows of the levels before
    it end.
    With HELP (the fused launch), the programs that find no segment prep the first branch rows the prep launch
    left to them (`branch_rows_aside`: only in a fused round of one trunk), one (row, head) item each in the
    order they start, with the prep's arguments and an [L, L] scratch each: the trunk scan keeps
    a few dozen multiprocessors busy for a few dozen steps, and these programs (as large as the scan's, one per
    multiprocessor) run on the others, which the prep launch would otherwise have left a partial wave for.
    """
    head = tl.program_id(0)
    heads = tl.num_programs(0)
    dk = tl.arange(0, DK)
    # where the level's rows start in the stacked tables and its later chunks' rows' shift (`later_shift`), and
    # the next level's with CHAIN; loaded only where used (a lone ask's scan takes microseconds)
    level_start = 0
    if LEVEL == 1:
        level_start = tl.load(sizes0_ptr)
    if LEVEL == 2:
        level_start = tl.load(sizes0_ptr) + tl.load(sizes1_ptr)
    next_start = 0
    shift = 0
    next_shift = 0
    if CHAIN:
        next_start = level_start + tl.load(sizes_ptr)
    if not FUSED:
        shift = later_shift(LEVEL, sizes0_ptr, sizes1_ptr, sizes2_ptr)
        if CHAIN:
            next_shift = later_shift(LEVEL + 1, sizes0_ptr, sizes1_ptr, sizes2_ptr)
    segments = tl.load(sizes_ptr + 1)
    if FUSED:
        segments = tl.where(fused_round(trunk_sizes_ptr, fused_trunks), segments, 0)
    elif GATED:
        segments = tl.where(fused_round(trunk_sizes_ptr, fused_trunks), 0, segments)
    for segment in range(tl.program_id(2), segments, tl.num_programs(2)):
        steps = tl.load(chunk_count_ptr + segment)
        final_row = tl.load(final_row_ptr + segment)
        follow = -1
        if CHAIN:
            follow = tl.load(chain_ptr + segment)
        needed = (final_row >= 0) | (follow >= 0)
        if FUSED:  # every chunk has outputs to compute
            needed = needed | (steps > 0)
        else:  # a first chunk's outputs are the output kernel's
            needed = needed | (steps > 1)
        if needed:
            init_row = tl.load(init_row_ptr + segment)
            step_base = tl.load(step_base_ptr + segment)
            for tile in range(TILES):
                cols = (tl.program_id(1) * TILES + tile) * BV + tl.arange(0, BV)
                state_ptrs = states_ptr + head * stride_sh + dk[:, None] * stride_sk + cols[None, :]
                state = tl.load(state_ptrs + init_row * stride_sr)
                state = _scan_chunks(state, level_start + segment, level_start + step_base, steps, head, heads,
                                     k_rows_ptr, w_ptr, u_ptr, k_gate_ptr, decay_ptr, v_new_ptr, h_ptr, shift,
                                     tokens_ptr, level_start, q_rows_ptr, a_ptr, q_gate_ptr, out_ptr, total,
                                     stride_ot, stride_oh, cols, DK, DV, L, PREC, FUSED)
                if final_row >= 0:
                    tl.store(state_ptrs + final_row * stride_sr, state)
                if follow >= 0:  # only with CHAIN
                    later_base = next_start + tl.load(next_step_base_ptr + follow)
                    state = _scan_chunks(state, next_start + follow, later_base, tl.load(next_count_ptr + follow),
                                         head, heads, k_rows_ptr, w_ptr, u_ptr, k_gate_ptr, decay_ptr, v_new_ptr,
                                         h_ptr, next_shift, next_tokens_ptr, next_start, q_rows_ptr, a_ptr,
                                         q_gate_ptr, out_ptr, total, stride_ot, stride_oh, cols, DK, DV, L, PREC,
                                         FUSED)
                    next_final = tl.load(next_final_row_ptr + follow)
                    if next_final >= 0:
                        tl.store(state_ptrs + next_final * stride_sr, state)
    if HELP:
        end0, end1, end2 = real_row_ends(sizes0_ptr, sizes1_ptr, sizes2_ptr)
        aside = branch_rows_aside(sizes0_ptr, fused_trunks, end1, end2, helpers, helper_steps, heads)
        per_slot = tl.num_programs(1) * heads
        helper = (tl.program_id(2) - segments) * per_slot + tl.program_id(1) * heads + head
        if helper >= 0:
            fused_steps = fused_step_count(sizes0_ptr, fused_trunks, end0, end1, CHAIN)
            for item in range(helper, aside * heads, (tl.num_programs(2) - segments) * per_slot):
                prep_row(end1 + item // heads, item % heads, heads, end0, end1, fused_steps,
                          q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, piece_lo_ptr, tokens0_ptr, tokens1_ptr, tokens2_ptr,
                          w_ptr, u_ptr, a_ptr, q_rows_ptr, k_rows_ptr, q_gate_ptr, k_gate_ptr, decay_ptr,
                          system_ptr + helper * L * L, total, scale, eps,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh,
                          stride_bt, stride_bh, GROUP, DK, DV, L, SUB, LOG2_SUB, COLS, PREC)


@triton.jit
def _chunk_output_kernel(
    q_ptr, a_ptr, q_gate_ptr, w_ptr, u_ptr, v_new_ptr, h_ptr, states_ptr, out_ptr,
    tokens0_ptr, tokens1_ptr, tokens2_ptr, init0_ptr, init1_ptr, init2_ptr,
    sizes0_ptr, sizes1_ptr, sizes2_ptr, total, fused_trunks,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_sr, stride_sh, stride_sk,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, L: tl.constexpr,
    PREC: tl.constexpr, CHAIN: tl.constexpr,
):
    """Per (value head, chunk, V tile) o = (q exp(cum)) S_j + (q K^T * Gamma) v_new for the chunk's tokens,
    for the real chunk rows of up to three levels at once; a program takes loop steps pid, pid + P, ... of
    its head and V tile, each step a real row (`real_row`, as in the prep). In a round whose trunk scan took
    its outputs (`fused_round`), the rows of level 0 (and of level 1 with CHAIN: they were scanned with it)
    are skipped.

    S_j is the state at the chunk's start and v_new = U - W S_j the chunk's corrected values, both left by
    the scan for a segment's later chunks (in the later-chunk tables, `later_shift`). A segment's first chunk
    (row s of its level with s < segments) reads S_0 from the segment's init row of the state table, which no
    segment of the level writes, and computes its v_new here, exactly as the scan does (the same products and
    roundings); an empty segment's row has only padding tokens, whose outputs are not stored.
    """
    head = tl.program_id(0)
    i = tl.arange(0, L)
    dk = tl.arange(0, DK)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    end0, end1, end2 = real_row_ends(sizes0_ptr, sizes1_ptr, sizes2_ptr)
    for step in range(fused_step_count(sizes0_ptr, fused_trunks, end0, end1, CHAIN) + tl.program_id(1), end2,
                      tl.num_programs(1)):
        local, level = real_row(step, end0, end1)
        row_ptr = of_level(level, tokens0_ptr, tokens1_ptr, tokens2_ptr) + local * L
        base = step * tl.num_programs(0) + head
        tok = tl.load(row_ptr + i)
        ok = tok < total
        q = tl.load(q_ptr + tok[:, None] * stride_qt + (head // GROUP) * stride_qh + dk[None, :],
                    mask=ok[:, None], other=0.0)
        if local < tl.load(of_level(level, sizes0_ptr, sizes1_ptr, sizes2_ptr) + 1):  # a segment's first chunk
            init_row = tl.load(of_level(level, init0_ptr, init1_ptr, init2_ptr) + local)
            h = tl.load(states_ptr + init_row * stride_sr + head * stride_sh + dk[:, None] * stride_sk
                        + cols[None, :]).to(h_ptr.dtype.element_ty)
            w = tl.load(w_ptr + base * L * DK + i[:, None] * DK + dk[None, :])
            u = tl.load(u_ptr + base * L * DV + i[:, None] * DV + cols[None, :])
            v_new = (u.to(tl.float32) - tl.dot(w, h, input_precision=PREC)).to(v_new_ptr.dtype.element_ty)
        else:
            later = (step - later_shift(level, sizes0_ptr, sizes1_ptr, sizes2_ptr)) * tl.num_programs(0) + head
            h = tl.load(h_ptr + later * DK * DV + dk[:, None] * DV + cols[None, :])
            v_new = tl.load(v_new_ptr + later * L * DV + i[:, None] * DV + cols[None, :])
        q_gate = tl.load(q_gate_ptr + base * L + i)
        # the prep stored the causal block with zeros above the diagonal (Gamma is 0 there) and on padding rows
        a = tl.load(a_ptr + base * L * L + i[:, None] * L + i[None, :])
        out = q_gate[:, None] * tl.dot(q.to(h.dtype), h, input_precision=PREC)
        out += tl.dot(a, v_new, input_precision=PREC)
        tl.store(out_ptr + tok[:, None] * stride_ot + head * stride_oh + cols[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=ok[:, None])


PROGRAMS_PER_SM = 4  # the default cap of a launch's programs, per multiprocessor


@dataclass(frozen=True)
class GatedDeltaConfig:
    """The kernels' tuning constants (docs/decisions/gated-delta-kernel.md).

    The scan's V tile (`block_v` columns) and V split (`split_v` programs per segment and head, each doing
    Dv / block_v / split_v tiles in turn; None: one tile per program); the prep's sub-block rows (16 or 32: block
    forward substitution through a float32 scratch; 64: exact doubling over the whole chunk in registers); the
    warps of the three kernels; the scan's pipeline depth (its tile loads go scan_stages - 1 steps ahead); the
    output kernel's V tile. `fused_trunks`: rounds with at most this many trunks take their outputs in the scan
    (None: multiprocessors // (value heads * V split); 0: never). `store_dtype` (None: the inputs') is the dtype
    of the stored W, U, q-k block, chunk start states and v_new, and so of the scan's and output kernel's product
    operands. `chunk_programs` / `scan_programs` cap each launch's programs (None: PROGRAMS_PER_SM per
    multiprocessor); programs loop over the rows and segments past the cap. In a fused round of one trunk, up to
    `scan_helpers` idle programs of the scan (None: the multiprocessors the trunk leaves idle; 0: never) prep
    the first branch rows, one (row, head) item per `helper_steps` of the trunk's chunk rows.
    On CUDA the V tiles must be at least 32 columns (16-column tiles gave non-finite values on the H200).
    """

    block_v: int = 32
    split_v: int | None = None
    sub_block: int = 16
    prep_warps: int = 4
    scan_warps: int = 4
    scan_stages: int = 3
    out_block_v: int = 128
    out_warps: int = 4
    fused_trunks: int | None = None
    store_dtype: torch.dtype | None = None
    chunk_programs: int | None = None
    scan_programs: int | None = None
    scan_helpers: int | None = None
    helper_steps: int = 12


GATED_DELTA = GatedDeltaConfig()  # production


@dataclass(frozen=True)
class _ScanLaunch:
    """One launch of the state scan: its level and the level's index in its group, the level it carries on into
    (None: none, `DeltaLevel.chain`), its segments, whether it computes its chunks' outputs (FUSED) and whether it
    runs only in rounds that do not fuse (GATED)."""

    level: DeltaLevel
    index: int
    following: DeltaLevel | None
    segments: int
    fused: bool = False
    gated: bool = False


LEVELS_PER_LAUNCH = 3  # a round's levels (plan.shape.LEVELS): one prep and one output launch for all of them


@dataclass(frozen=True)
class StackedRows:
    """The rows of the work tables of a group of levels, stacked: the levels' real chunk rows one after the other
    (`rows`), of which the first two levels' (`trunk_rows`: the query rows a fused trunk scan reads) and the
    segments' later chunks (`later_rows`: the chunk start states and v_new only those have)."""

    rows: int
    trunk_rows: int
    later_rows: int


def stacked_rows(tokens: int, table_rows: list[int], table_segments: list[int]) -> StackedRows:
    """The stacked rows a round of `tokens` stream tokens needs, for levels whose tables (padded or not) have
    these rows and segments. A segment of n tokens has ceil(n / GDN_CHUNK) rows: its first (empty segments have
    one too) and (n - 1) // GDN_CHUNK later ones; the levels' segments hold disjoint stream tokens, so a round has
    at most tokens // GDN_CHUNK later rows in all, not one level's padded table each."""
    full = tokens // GDN_CHUNK
    return StackedRows(
        rows=min(sum(table_rows), sum(table_segments) + full),
        trunk_rows=min(sum(table_rows[:2]), sum(table_segments[:2]) + full),
        later_rows=min(sum(table_rows), full),
    )


def level_groups(levels: list[DeltaLevel]) -> list[list[DeltaLevel]]:
    """The levels in groups of LEVELS_PER_LAUNCH, the last group completed with empty levels (no chunk
    rows, no segments; made only when needed: their zero sizes are a device fill, a graph node of its own)."""
    groups = []
    for first in range(0, len(levels), LEVELS_PER_LAUNCH):
        group = levels[first : first + LEVELS_PER_LAUNCH]
        if len(group) < LEVELS_PER_LAUNCH:
            empty = DeltaLevel(group[0].chunk_tokens[:0], [], group[0].init_row[:0], group[0].final_row[:0],
                               group[0].chunk_count[:0], group[0].step_base[:0], group[0].chain[:0],
                               torch.zeros_like(group[0].sizes))
            group = group + [empty] * (LEVELS_PER_LAUNCH - len(group))
        groups.append(group)
    return groups


TABLE_ALIGN = 256  # bytes: where each work table starts in their one allocation
Tables = list[tuple[tuple[int, ...], torch.dtype]]  # shapes and dtypes of work tables


def _table_starts(tables: Tables) -> list[int]:
    """Each table's byte offset in one allocation (each TABLE_ALIGN-aligned), and the allocation's size last."""
    starts = [0]
    for shape, dtype in tables:
        starts.append(starts[-1] + -(-math.prod(shape) * dtype.itemsize // TABLE_ALIGN) * TABLE_ALIGN)
    return starts


def carve(flat: torch.Tensor, tables: Tables) -> list[torch.Tensor]:
    """Empty tensors of these shapes and dtypes, views of the uint8 buffer `flat` (at least their size)."""
    starts = _table_starts(tables)
    if flat.numel() < starts[-1]:
        raise ValueError(f"a workspace of {flat.numel()} bytes is smaller than the {starts[-1]} the tables take")
    return [flat[start : start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for (shape, dtype), start in zip(tables, starts)]


@dataclass(frozen=True)
class _Settings:
    """A config resolved for a device and head dimensions (`_settings`)."""

    chunk_programs: int
    scan_programs: int
    sub_block: int
    bv: int  # the scan's V tile and split
    split: int
    obv: int  # the output kernel's V tile
    store: torch.dtype
    fused_trunks: int  # -1: no round is fused (`fused_round`)
    helpers: int


def _settings(c: GatedDeltaConfig, device: torch.device, dtype: torch.dtype, v_heads: int, dk: int,
              dv: int) -> _Settings:
    for name, dim in (("Dk", dk), ("Dv", dv)):
        if dim < 16 or dim & (dim - 1):
            raise ValueError(f"{name} = {dim} must be a power of two >= 16")
    default_programs = PROGRAMS_PER_SM * multiprocessors(device)
    chunk_programs = default_programs if c.chunk_programs is None else c.chunk_programs
    scan_programs = default_programs if c.scan_programs is None else c.scan_programs
    if chunk_programs < 1 or scan_programs < 1:
        raise ValueError("chunk_programs and scan_programs must be positive")
    sub_block = c.sub_block
    if sub_block < 16 or sub_block & (sub_block - 1) or GDN_CHUNK % sub_block:
        raise ValueError(f"sub_block = {sub_block} must be a power of two in [16, {GDN_CHUNK}]")
    min_tile = 32 if device.type == "cuda" else 16
    bv = min(c.block_v, dv)
    split = min(c.split_v or dv, dv // max(bv, 1))
    if bv < min_tile or bv & (bv - 1) or split < 1 or dv % (bv * split):
        raise ValueError(f"block_v = {bv} and split_v = {split} do not tile Dv = {dv}")
    obv = min(c.out_block_v, dv)
    if obv < min_tile or obv & (obv - 1):
        raise ValueError(f"out_block_v = {obv} does not tile Dv = {dv}")
    store = c.store_dtype or dtype
    fused_trunks = c.fused_trunks
    if fused_trunks is None:  # as many trunks as the fused scan runs in one wave of programs (one per multiprocessor)
        fused_trunks = multiprocessors(device) // (v_heads * split)
    # with 4-byte storage the fused scan's tiles pass the H200's shared memory (238 KB of 227 at 3 stages)
    fusing = fused_trunks > 0 and (store.itemsize <= 2 or device.type != "cuda")
    # programs of the fused trunk scan that may prep branch rows beside a lone trunk: the multiprocessors it leaves
    helpers = max(0, multiprocessors(device) - v_heads * split) if c.scan_helpers is None else c.scan_helpers
    if helpers < 0 or c.helper_steps < 1:
        raise ValueError("scan_helpers must be >= 0 and helper_steps >= 1")
    return _Settings(chunk_programs, scan_programs, sub_block, bv, split, obv, store, fused_trunks if fusing else -1,
                     helpers)


@dataclass(frozen=True)
class _WorkTables:
    """The work tables of one group of levels (`level_groups`) and the launch sizes they follow from."""

    stacked: StackedRows
    prep_programs: int
    helping: bool  # whether the fused trunk scan's spare programs prep branch rows (`branch_rows_aside`)
    tables: Tables  # w, u, a, k_rows, q_rows, q_gate, k_gate, decay, system, h, v_new


def _work_tables(s: _Settings, levels: list[DeltaLevel], total: int, v_heads: int, dk: int, dv: int,
                 dtype: torch.dtype) -> _WorkTables:
    table_segments = [level.init_row.shape[0] for level in levels]
    stacked = stacked_rows(total, [level.chunk_tokens.shape[0] for level in levels], table_segments)
    chunks, chunk = stacked.rows, GDN_CHUNK
    fusing = s.fused_trunks > 0
    # the fused trunk scan's programs past a lone trunk's prep branch rows (`branch_rows_aside`); none unless
    # it has some (its segment slots past the first) and the trunk leaves multiprocessors idle
    trunk_slots = min(table_segments[0], max(1, s.scan_programs // (v_heads * s.split)))
    helping = fusing and trunk_slots > 1 and s.helpers > 0
    prep_programs = min(chunks, max(1, s.chunk_programs // v_heads))
    # the prep's [L, L] float32 scratch per program (whole-chunk doubling needs none), the scan's helpers' too
    scratch = max(prep_programs, s.split * trunk_slots if helping else 0) * v_heads if s.sub_block < chunk else 1
    later = max(1, stacked.later_rows)
    f32 = torch.float32
    return _WorkTables(stacked, prep_programs, helping, [
        ((chunks, v_heads, chunk, dk), s.store), ((chunks, v_heads, chunk, dv), s.store),
        ((chunks, v_heads, chunk, chunk), s.store), ((chunks, v_heads, chunk, dk), dtype),
        # the query rows only a fused scan reads (unfused: the prep's masked store never writes them)
        ((max(1, stacked.trunk_rows) if fusing else 0, v_heads, chunk, dk), dtype),
        ((chunks, v_heads, chunk), f32), ((chunks, v_heads, chunk), f32), ((chunks, v_heads), f32),
        ((scratch, chunk, chunk), f32),
        # written by the unfused scan for every chunk of a segment past its first: the state at the chunk's
        # start and v_new = U - W S; one level after the other (a level starts from states the previous wrote)
        ((later, v_heads, dk, dv), s.store), ((later, v_heads, chunk, dv), s.store)])


def delta_workspace(plan: DeltaPlan, tokens: int, v_heads: int, dk: int, dv: int, dtype: torch.dtype,
                    device: torch.device, *, config: GatedDeltaConfig = GATED_DELTA) -> DeltaPlan:
    """The plan with the work tables of every `gated_delta_triton` call over it (a forward's layers, one after the
    other) in one allocation, made once: a layer's tables then never take a block another layer's activations
    were put in, so a captured graph's pool holds them once."""
    s = _settings(config, device, dtype, v_heads, dk, dv)
    size = max((_table_starts(_work_tables(s, levels, tokens, v_heads, dk, dv, dtype).tables)[-1]
                for levels in level_groups(plan.levels)), default=0)
    return replace(plan, workspace=torch.empty(size, dtype=torch.uint8, device=device))


def gated_delta_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    plan: DeltaPlan,
    states: torch.Tensor,
    *,
    config: GatedDeltaConfig = GATED_DELTA,
) -> torch.Tensor:
    """The Triton kernels behind the same contract as `gated_delta_reference` (no host synchronisation).

    Only stream tokens that belong to a segment of `plan` get an output row (plan_round covers all). Dk and Dv
    must be powers of two >= 16. A round's three levels take one prep launch (all levels' chunk rows, stacked),
    the trunk scans (a fused and an unfused launch, of which a round runs one; the trunk remainders chained to
    them), one branch scan and one output launch.
    """
    c = config
    total, v_heads, dv = v.shape
    k_heads, dk = k.shape[1], k.shape[2]
    if states.dtype != torch.float32 or states.stride(-1) != 1:
        raise ValueError("the state table must be float32 with a unit last stride")
    settings = _settings(c, q.device, q.dtype, v_heads, dk, dv)
    bv, split, obv, fused_trunks = settings.bv, settings.split, settings.obv, settings.fused_trunks
    fusing, helpers, sub_block = fused_trunks > 0, settings.helpers, settings.sub_block
    scan_programs, chunk_programs = settings.scan_programs, settings.chunk_programs
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    chunk = GDN_CHUNK
    group = v_heads // k_heads
    for levels in level_groups(plan.levels):
        work = _work_tables(settings, levels, total, v_heads, dk, dv, q.dtype)
        table_segments = [level.init_row.shape[0] for level in levels]
        chunks = work.stacked.rows
        sizes = [level.sizes for level in levels]
        if chunks == 0:
            continue
        tokens = [level.chunk_tokens for level in levels]
        chained = levels[1].chained
        helping, prep_programs = work.helping, work.prep_programs
        flat = plan.workspace
        if flat is None:  # a call outside a forward (`delta_workspace`): tables of its own
            flat = torch.empty(_table_starts(work.tables)[-1], dtype=torch.uint8, device=q.device)
        w, u, a, k_rows, q_rows, q_gate, k_gate, decay, system, h, v_new = carve(flat, work.tables)
        q_rows = q_rows if fusing else k_rows
        prep_constants = {"GROUP": group, "SUB": sub_block, "LOG2_SUB": sub_block.bit_length() - 1,
                          "COLS": min(dk, dv, 64)}
        prep_strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1))
        helper_args = (helpers if helping else 0, c.helper_steps)  # the kernels' `helpers`, `helper_steps`
        chunk_prep_kernel[(v_heads, prep_programs)](
            q, k, v, g, beta, plan.piece_lo, *tokens, *sizes,
            w, u, a, q_rows, k_rows, q_gate, k_gate, decay, system,
            total, dk**-0.5, L2_EPS, fused_trunks, *helper_args, *prep_strides,
            DK=dk, DV=dv, L=chunk, PREC=prec, CHAIN=chained, num_warps=c.prep_warps, **prep_constants,
        )
        # a level all of whose segments continue the one before (`DeltaLevel.chained`: a plan's trunk
        # remainders) is scanned by the launch of the level before; any other level has a launch of its own.
        # The trunk level has two: the fused and the unfused scan, of which a round runs one (`fused_round`)
        scans = [_ScanLaunch(level, index, None, count)
                 for index, (level, count) in enumerate(zip(levels, table_segments, strict=True))]
        if chained:
            scans = [replace(scans[0], following=levels[1]), scans[2]]
        if fusing:
            scans = [replace(scans[0], fused=True), replace(scans[0], gated=True), *scans[1:]]
        for scan in scans:
            carried = scan.following or scan.level  # the next level's tables (read only with CHAIN)
            _state_scan_kernel[(v_heads, split, min(scan.segments, max(1, scan_programs // (v_heads * split))))](
                k_rows, w, u, k_gate, decay, v_new, h, states,
                scan.level.chunk_count, scan.level.step_base, scan.level.init_row, scan.level.final_row,
                scan.level.sizes, scan.level.chain, carried.chunk_count, carried.step_base,
                carried.final_row, scan.level.chunk_tokens, carried.chunk_tokens, q_rows, a, q_gate, out, total,
                levels[0].sizes, fused_trunks,
                states.stride(0), states.stride(1), states.stride(2), out.stride(0), out.stride(1),
                q, k, v, g, beta, plan.piece_lo, *tokens, *sizes, system, dk**-0.5, L2_EPS, *helper_args, *prep_strides,
                DK=dk, DV=dv, BV=bv, TILES=dv // bv // split, L=chunk, PREC=prec, LEVEL=scan.index,
                CHAIN=scan.following is not None,
                FUSED=scan.fused, GATED=scan.gated, HELP=helping and scan.fused, num_warps=c.scan_warps,
                num_stages=c.scan_stages, **prep_constants,
            )
        _chunk_output_kernel[(v_heads, min(chunks, max(1, chunk_programs // (v_heads * (dv // obv)))), dv // obv)](
            q, a, q_gate, w, u, v_new, h, states, out, *tokens, *(level.init_row for level in levels), *sizes,
            total, fused_trunks,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *states.stride()[:3],
            GROUP=group, DK=dk, DV=dv, BV=obv, L=chunk, PREC=prec, CHAIN=chained, num_warps=c.out_warps,
        )
    return out
