"""Forked Gated DeltaNet: the chunked gated delta rule over the segments of a round, level by level.

Per head, with state S (Dk x Dv), decay g_t (log space) and rate beta_t, token t does
    S <- exp(g_t) * S;  S <- S + k_t (beta_t * (v_t - S^T k_t))^T;  o_t = S^T q_t
with q, k L2-normalised and q scaled by Dk^-1/2. Chunks of GDN_CHUNK tokens are computed with the
UT/WY form: inside a chunk, T = (I + tril(diag(beta) K K^T * Gamma, -1))^-1 turns the sequential updates
into matrix products, and one scan step per chunk carries S across chunks.

A level is a set of independent segments, each starting from the state-table row `init_row` and, unless
its `final_row` is DISCARD_ROW, writing its final state there. No final row of a level is an init row of
the same level (the pool never saves over a checkpoint a round reads; levels read what earlier levels wrote). Branches start from their trunk's final
state this way, which makes every branch compute exactly what it computes alone.
`gated_delta_reference` is the definition, used on CPU; it batches all chunks of a level for the
intra-chunk work and loops over scan steps (not tokens, not segments).

`gated_delta_triton` is the GPU version of the same contract, with grids that depend only on tensor shapes
(no host synchronisation, CUDA-graph safe) and are capped (programs loop over the rows past the cap).
Programs loop over real rows and segments only: each level's `sizes` (on the device) counts its real chunk
rows and segments, which come first in its tables, and a captured graph's tables are padding past them. A
round's three levels (the second chained to the first, as plan_round lays them out) take five launches: one
chunk-prep launch over the chunk rows of all levels (stacked), two for the trunks, the first two levels (a
trunk's remainder past its save point goes on from its first part's state in the same program,
`DeltaLevel.chain`: on the H200 at ac35af5, 18 launches fewer a round and the scans 0.94 -> 0.90 ms on a lone
2,000-token ask), of which a round runs one, one for the branches (they start from states the trunks wrote),
one output launch over the chunk rows the trunk scan did not take. Only the state recurrence is sequential:
- `_chunk_prep_kernel`, per (chunk row of any level, value head): gathers the chunk's tokens, builds Gamma,
  A = strictly-lower(diag(beta) K K^T * Gamma) and T = (I + A)^-1 by block forward substitution over
  16-row sub-blocks (through a float32 scratch), and stores W = T (beta K exp(cum)), U = T (beta V), the
  causal q-k block q K^T * Gamma (zero rows for padding), the raw key rows (and, in a fused round, the
  trunks' raw query rows: `_fused_steps`) and the per-row gate factors.
- `_state_scan_kernel`, per (value head, V split, segment), one launch per level or chained pair: keeps a
  [Dk, BV] slice of S in registers from `init_row` through the segment's chunks (chunk 0 is row `segment`,
  chunk j > 0 row `step_base[segment] + j`), computes v_new = U - W S_j, updates
  S <- exp(g_last) S + (K exp(g_last - cum))^T v_new, and writes the final slice to `final_row`. Per chunk it
  either stores (past the first chunk) S_j and v_new for the output kernel, skipping segments of at most one
  chunk and no final row, or (FUSED) computes the chunk's outputs itself. The trunk level has a launch of each
  kind, and a round runs the fused one when it has at most `fused_trunks` trunks (by default as many as its
  programs fill one wave with, 2 at 0.8B shapes; decided on the device from the level's real segment count).
  With one trunk, the fused launch's programs that find no segment prep the first branch rows on the
  multiprocessors the scan leaves idle, and the prep launch skips them (`_branch_rows_aside`: a lone
  2,000-token ask's 32 trunk rows then fill whole waves of the prep; `scan_helpers`).
- `_chunk_output_kernel`, per (chunk row of any level, value head, V tile), all in parallel: the chunk's
  outputs o = (q exp(cum)) S_j + (q K^T * Gamma) v_new; a segment's first chunk reads S_0 from its init
  row and computes its own v_new, so one-chunk branches skip the scan. Rows the fused scan took are skipped.
Why both kinds. A lone trunk's scan runs one program per head and V split (64 at 0.8B shapes) through 32
sequential steps while most multiprocessors idle: the output products ride along there for little more than
their loads, and the output kernel's pass over the trunk (and S_j, v_new through memory) goes. With many
trunks the machine is full and the fused scan's larger tiles (189 KB of shared memory at 3 stages: one program
per multiprocessor) cost more than they save. bench_gdn on the H200, per layer, padded as the engine replays
(`2026-12-01-bench_gdn-0.8B-fused-ab-*`, 0955d41 against ee304bd in one call): lone 2,000-token trunk + 1 / 4 /
16 branches 0.1261 / 0.1436 / 0.1564 -> 0.1227 / 0.1363 / 0.1526 ms; + 64 branches 0.2392 -> 0.2411, 32
requests 0.7114 -> 0.7223, a RACE passage 0.0524 -> 0.0532 (the launch a round does not run costs about 1 us).
Fusing every launch instead (35385fd, `2026-12-01-gdn-options-0.8B-all-fused-35385fd`): 0.1145 alone, but
0.311 with 64 branches and 0.898 for 32 requests. With 4-byte storage the fused tiles pass the H200's shared
memory, so only the unfused launches run.
Gram products of the raw inputs are taken in the inputs' dtype (exact for bf16); the state and every
accumulation are float32. For 16-bit inputs the products of float32 quantities inside a chunk use TF32,
and W, U, the q-k block, S_j and v_new are stored in the inputs' dtype (by default), so the products of the
scan and the output kernel take S and v_new in that dtype (as flash-linear-attention does); the state carried
by the scan and the update's v_new stay float32. The WY products W and U take TF32; `wy_low_precision` takes
them, with T and their scaled rows, in the 16-bit storage dtype (as flash-linear-attention does: relative
error 0.0035 against 0.0031, 6-10% faster), off because the engine's end-to-end fidelity with it fell behind
transformers' bf16. Float32 inputs keep float32 with IEEE products.
Timed slower on the H200 on 2026-11-30 (7117ef9, benchmarks/README.md) and removed: a chunk-pair scan
(half the sequential steps), the W and U products in a second launch, and capped prep registers; and (d3f5770)
a transposed scan step carrying S^T as the left operand of both products (mma.sync from registers): no
faster at 32 columns, 15% slower on 32 requests at 16. On 2026-12-01 (519134c, `2026-12-01-norm-fold-ab`):
the Gated DeltaNet's gated RMS norm folded into the output kernel: 2.7 and 2.3 us per layer less than the
output kernel and the separate norm kernel on a lone 2,000-token ask and a RACE passage, but 7 us more with 64
branches (8 output warps: slower still); not kept. Register caps on the prep (168 or 128 per thread, three or
four programs per multiprocessor instead of two) and the output kernel were no faster on any lone round
(`2026-12-01-gdn-register-caps`).
Tried on 2026-12-01 and removed: the branches' prep (level 2) as a launch of its own beside the trunk scans,
so that the trunks' prep fills whole waves (a lone 2,000-token ask's 32 trunk rows are 512 programs, two
waves at two per multiprocessor; its 4 branch rows make a third) and the branches' prep runs on the
multiprocessors the trunk scan leaves idle. On a side stream (96bf144) Q = 4's GDN went 0.1347 -> 0.1279 ms a
layer but Q = 1, Q = 16 and a RACE passage got slower (its programs took every multiprocessor's registers
before the scan's started); with the trunk scans on a stream of higher priority instead (d15d083) Q = 4
0.1374 -> 0.1275 and Q = 16 0.1528 -> 0.1468, but a RACE passage 0.0524 -> 0.0663 and 32 requests 0.712 ->
0.746, and in the engine Q = 4's replay stayed 7.74 ms and Q = 16's grew 9.02 -> 9.27
(`2026-12-01-gdn-options-0.8B-overlap-branch-prep-*`, `2026-12-01-questions_per_state-0.8B-nobaseline-*`).
The fused scan launch's idle programs do that work now, without a second stream (`scan_helpers`).
Tried on 2026-12-01 (2aeb4de) and removed: the fused trunk scan following the prep's rows as they are published
(a per-(row, head) flag set with release semantics, the scan a programmatic dependent launch that waits for its
rows a group at a time, a long lone trunk's prep on one program per multiprocessor so that the scan's fit beside
them). On the H200 the engine's forward got slower (Q = 4 7.48 -> 7.93 ms, Q = 64 14.54 -> 15.99): the prep took
87 us a layer on one program per multiprocessor against 49 on two, and the scan as long as alone (its programs,
apparently, did not start beside the prep's); its answers were not always those of the plain launches (not
diagnosed: most likely a group's pipelined loads were not ordered after its acquire). A prep item's time is about
40% its W and U products and 20% the block inverse (`2026-12-01-gdn-prep-scan-overlap-2aeb4de`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flide_sdk.kernels import multiprocessors
from flide_sdk.kernels.reference import L2_EPS
from flide_sdk.plan.layout import GDN_CHUNK, DeltaLevel, DeltaPlan


@triton.jit
def _unit_lower_inverse(n, SUB: tl.constexpr, LOG2_SUB: tl.constexpr, PREC: tl.constexpr):
    """(I + n)^-1 for a strictly lower-triangular [SUB, SUB] tile n, by exact block doubling.

    X_b, the inverse of the b x b diagonal blocks of I + n, gives X_2b = X_b - X_b E_b X_b, where E_b keeps
    the entries of n inside a 2b-block but outside its b-blocks ((X_b E_b)^2 = 0 there: this is exact).
    """
    i = tl.arange(0, SUB)
    # (row ^ col) >> s == 1 exactly when row and col share their 2^(s+1)-block but not their 2^s-block
    block_xor = i[:, None] ^ i[None, :]
    x = tl.where(block_xor == 0, 1.0, tl.where(block_xor == 1, -n, 0.0))
    for s in tl.static_range(1, LOG2_SUB):
        e = tl.where((block_xor >> s) == 1, n, 0.0)
        x = x - tl.dot(tl.dot(x, e, input_precision=PREC), x, input_precision=PREC)
    return x


@triton.jit
def _store_row_scaled_product(t, scale, rows_ptr, ok, out_ptr, WIDTH: tl.constexpr, COLS: tl.constexpr,
                              PREC: tl.constexpr, LOW: tl.constexpr):
    """out [L, WIDTH] (contiguous) = t @ (scale[:, None] * X), X's rows at `rows_ptr` [L] (zero where not
    `ok`), COLS columns at a time (bounds live registers); rows not `ok` are stored as zeros. With LOW, t
    comes in out's dtype and the scaled rows are rounded to it: a 16-bit product instead of TF32."""
    for c0 in tl.static_range(0, WIDTH, COLS):
        cols = c0 + tl.arange(0, COLS)
        x = tl.load(rows_ptr[:, None] + cols[None, :], mask=ok[:, None], other=0.0)
        operand = scale[:, None] * x.to(tl.float32)
        if LOW:
            product = tl.dot(t, operand.to(t.dtype))
        else:
            product = tl.dot(t, operand, input_precision=PREC)
        product = tl.where(ok[:, None], product, 0.0)
        rows = tl.arange(0, t.shape[0])
        tl.store(out_ptr + rows[:, None] * WIDTH + cols[None, :], product.to(out_ptr.dtype.element_ty))


@triton.jit
def _real_row_ends(sizes0_ptr, sizes1_ptr, sizes2_ptr):
    """Where the real chunk rows of levels 0, 0-1 and 0-2 end in the steps `_real_row` maps (each level's
    `sizes` counts its real rows, which come first in its table); loaded once per program."""
    end0 = tl.load(sizes0_ptr)
    end1 = end0 + tl.load(sizes1_ptr)
    return end0, end1, end1 + tl.load(sizes2_ptr)


@triton.jit
def _real_row(step, end0, end1, start1, start2):
    """(the stacked chunk row, the row within its level, the level) of loop step `step` over the real chunk
    rows of three levels: steps 0 .. end0 - 1 are level 0's, then level 1's up to end1, then level 2's (level
    1's stacked rows start at start1, level 2's at start2). Programs loop over these steps only, so the
    padding rows of a captured graph's tables cost nothing."""
    level = (step >= end0).to(tl.int32) + (step >= end1).to(tl.int32)
    local = step - tl.where(level == 2, end1, tl.where(level == 1, end0, 0))
    return tl.where(level == 2, start2, tl.where(level == 1, start1, 0)) + local, local, level


@triton.jit
def _of_level(level, first_ptr, second_ptr, third_ptr):
    """The pointer of `level` (0, 1 or 2) among three levels' pointers."""
    return tl.where(level == 2, third_ptr, tl.where(level == 1, second_ptr, first_ptr))


@triton.jit
def _fused_round(trunk_sizes_ptr, fused_trunks):
    """Whether the trunk scan computes the outputs of its chunks itself this round (FUSED): when the round has at
    most `fused_trunks` trunks (level 0's real segments)."""
    return tl.load(trunk_sizes_ptr + 1) <= fused_trunks


@triton.jit
def _fused_steps(sizes0_ptr, fused_trunks, end0, end1, CHAIN: tl.constexpr):
    """How many of the first loop steps of the prep and output kernels (`_real_row`) are rows the trunk scan takes
    the outputs of this round: level 0's, and level 1's with CHAIN (they are scanned with it), in a fused round;
    none otherwise."""
    scanned_end = end0
    if CHAIN:
        scanned_end = end1
    return tl.where(_fused_round(sizes0_ptr, fused_trunks), scanned_end, 0)


@triton.jit
def _branch_rows_aside(sizes0_ptr, fused_trunks, end1, end2, helpers, helper_steps, heads):
    """How many of the branches' chunk rows (the first ones of level 2) the idle programs of the fused trunk scan
    prep (`_state_scan_kernel`'s helpers) instead of the prep launch: in a fused round of one trunk, as many as
    `helpers` programs do at one row-head item per `helper_steps` of the trunk's chunk rows (an item takes about
    as long as that many scan steps, so they finish within the scan); none otherwise (helpers = 0: never)."""
    one_trunk = _fused_round(sizes0_ptr, fused_trunks) & (tl.load(sizes0_ptr + 1) == 1)
    return tl.where(one_trunk, tl.minimum(end2 - end1, (helpers * (end1 // helper_steps)) // heads), 0)


@triton.jit
def _prep_row(
    step, head, heads, end0, end1, start1, start2, fused_steps,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tokens0_ptr, tokens1_ptr, tokens2_ptr,
    w_ptr, u_ptr, a_ptr, q_rows_ptr, k_rows_ptr, q_gate_ptr, k_gate_ptr, decay_ptr, system_ptr,
    total, scale, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, L: tl.constexpr,
    SUB: tl.constexpr, LOG2_SUB: tl.constexpr, COLS: tl.constexpr, PREC: tl.constexpr, WY_LOW: tl.constexpr,
):
    """Everything of one (chunk row, value head) that does not depend on the state (`_chunk_prep_kernel`).

    The system A goes through this item's [L, L] float32 scratch `system_ptr`: its lower SUB x SUB
    blocks are read back (tuples indexed b * (b + 1) // 2 + c, block row b >= block column c) so that
    T = (I + A)^-1 costs only the block products it needs; T is written over A and read back whole.
    The barriers order the scratch's writes and reads between the program's threads. With WY_LOW (16-bit
    storage), T and the scaled rows of the W and U products are rounded to the storage dtype.
    """
    NSUB: tl.constexpr = L // SUB
    i = tl.arange(0, L)
    dk = tl.arange(0, DK)
    row, col = i[:, None], i[None, :]
    chunk, local, level = _real_row(step, end0, end1, start1, start2)
    row_ptr = _of_level(level, tokens0_ptr, tokens1_ptr, tokens2_ptr) + local * L
    base = chunk * heads + head
    scratch = system_ptr + base * L * L
    tok = tl.load(row_ptr + i)
    ok = tok < total
    key_head = head // GROUP

    # gates: cumulative log decay, Gamma, and the per-row factors the scan applies
    g = tl.load(g_ptr + tok * stride_gt + head * stride_gh, mask=ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + tok * stride_bt + head * stride_bh, mask=ok, other=0.0).to(tl.float32)
    cum = tl.cumsum(g, axis=0)
    last = tl.sum(tl.where(i == L - 1, cum, 0.0), axis=0)
    gamma = tl.exp(tl.where(row >= col, cum[:, None] - cum[None, :], float("-inf")))
    q = tl.load(q_ptr + tok[:, None] * stride_qt + key_head * stride_qh + dk[None, :], mask=ok[:, None], other=0.0)
    k = tl.load(k_ptr + tok[:, None] * stride_kt + key_head * stride_kh + dk[None, :], mask=ok[:, None], other=0.0)
    # the chunk's raw key rows (and, for a fused scan, query rows), contiguous and zero on padding rows, for the
    # scan's products
    # (a store masked whole, not a branch: the branch cost the prep 96 bytes of register spills)
    tl.store(q_rows_ptr + base * L * DK + row * DK + dk[None, :], q, mask=row < tl.where(step < fused_steps, L, 0))
    tl.store(k_rows_ptr + base * L * DK + row * DK + dk[None, :], k)
    q32 = q.to(tl.float32)
    k32 = k.to(tl.float32)
    q_rnorm = tl.math.rsqrt(tl.sum(q32 * q32, axis=1) + eps) * scale
    k_rnorm = tl.math.rsqrt(tl.sum(k32 * k32, axis=1) + eps)
    tl.store(q_gate_ptr + base * L + i, q_rnorm * tl.exp(cum))
    tl.store(k_gate_ptr + base * L + i, k_rnorm * tl.exp(last - cum))
    tl.store(decay_ptr + base, tl.exp(last))

    # causal q-k block (stored) and the system A = strictly-lower(diag(beta) K K^T * Gamma) (to scratch);
    # the Gram products come from the raw rows (exact for 16-bit inputs) and are normalised afterwards
    a = q_rnorm[:, None] * k_rnorm[None, :] * tl.dot(q, tl.trans(k), input_precision=PREC) * gamma
    tl.store(a_ptr + base * L * L + row * L + col, tl.where(ok[:, None], a, 0.0).to(a_ptr.dtype.element_ty))
    system = (beta * k_rnorm)[:, None] * k_rnorm[None, :] * tl.dot(k, tl.trans(k), input_precision=PREC) * gamma
    if SUB == L:  # T by doubling over the whole chunk, in registers (no scratch)
        t = _unit_lower_inverse(tl.where(row > col, system, 0.0), L, LOG2_SUB, PREC)
    else:
        tl.store(scratch + row * L + col, tl.where(row > col, system, 0.0))
        tl.debug_barrier()

        # T = (I + A)^-1 by block forward substitution: T_bb = (I + A_bb)^-1, T_bc = -T_bb sum_m A_bm T_mc
        r = tl.arange(0, SUB)
        blocks = ()
        for b in tl.static_range(NSUB):
            for c in tl.static_range(b + 1):
                blocks += (tl.load(scratch + (b * SUB + r)[:, None] * L + (c * SUB + r)[None, :]),)
        tl.debug_barrier()
        inverse = ()
        for b in tl.static_range(NSUB):
            diagonal = _unit_lower_inverse(blocks[b * (b + 1) // 2 + b], SUB, LOG2_SUB, PREC)
            for c in tl.static_range(b):
                acc = tl.dot(blocks[b * (b + 1) // 2 + c], inverse[c * (c + 1) // 2 + c], input_precision=PREC)
                for m in tl.static_range(c + 1, b):
                    acc += tl.dot(blocks[b * (b + 1) // 2 + m], inverse[m * (m + 1) // 2 + c], input_precision=PREC)
                inverse += (-tl.dot(diagonal, acc, input_precision=PREC),)
            inverse += (diagonal,)
        for b in tl.static_range(NSUB):
            for c in tl.static_range(b + 1):
                tl.store(scratch + (b * SUB + r)[:, None] * L + (c * SUB + r)[None, :], inverse[b * (b + 1) // 2 + c])
        tl.debug_barrier()
        t = tl.load(scratch + row * L + col, mask=row // SUB >= col // SUB, other=0.0)

    # WY form: U = T (beta V), W = T (beta K exp(cum)), COLS columns at a time (bounds live registers);
    # padding rows are stored as zeros, so the scan reads whole chunks without masks
    if WY_LOW:  # T rounded to the storage dtype once, for 16-bit products
        t = t.to(w_ptr.dtype.element_ty)
    _store_row_scaled_product(t, beta, v_ptr + tok * stride_vt + head * stride_vh, ok,
                              u_ptr + base * L * DV, DV, COLS, PREC, WY_LOW)
    _store_row_scaled_product(t, beta * k_rnorm * tl.exp(cum), k_ptr + tok * stride_kt + key_head * stride_kh,
                              ok, w_ptr + base * L * DK, DK, COLS, PREC, WY_LOW)


@triton.jit
def _chunk_prep_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tokens0_ptr, tokens1_ptr, tokens2_ptr, sizes0_ptr, sizes1_ptr, sizes2_ptr,
    w_ptr, u_ptr, a_ptr, q_rows_ptr, k_rows_ptr, q_gate_ptr, k_gate_ptr, decay_ptr, system_ptr,
    total, start1, start2, scale, eps, fused_trunks, helpers, helper_steps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, L: tl.constexpr,
    SUB: tl.constexpr, LOG2_SUB: tl.constexpr, COLS: tl.constexpr, PREC: tl.constexpr, WY_LOW: tl.constexpr,
    CHAIN: tl.constexpr,
):
    """Per (value head, chunk) everything of the chunk that does not depend on the state (`_prep_row`), for the
    real chunk rows of up to three levels at once, less the branch rows the fused trunk scan's idle programs
    take (`_branch_rows_aside`); a program takes loop steps pid, pid + P, ... of its head (P programs: a capped
    grid), each step a real row (`_real_row`).
    """
    head = tl.program_id(0)
    heads = tl.num_programs(0)
    end0, end1, end2 = _real_row_ends(sizes0_ptr, sizes1_ptr, sizes2_ptr)
    fused_steps = _fused_steps(sizes0_ptr, fused_trunks, end0, end1, CHAIN)  # whose query rows the scan reads
    aside = _branch_rows_aside(sizes0_ptr, fused_trunks, end1, end2, helpers, helper_steps, heads)
    for index in range(tl.program_id(1), end2 - aside, tl.num_programs(1)):
        step = tl.where(index < end1, index, index + aside)
        _prep_row(step, head, heads, end0, end1, start1, start2, fused_steps,
                  q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tokens0_ptr, tokens1_ptr, tokens2_ptr,
                  w_ptr, u_ptr, a_ptr, q_rows_ptr, k_rows_ptr, q_gate_ptr, k_gate_ptr, decay_ptr, system_ptr,
                  total, scale, eps,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh,
                  stride_bt, stride_bh, GROUP, DK, DV, L, SUB, LOG2_SUB, COLS, PREC, WY_LOW)


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
                 v_new_ptr, h_ptr, tokens_ptr, level_start, q_rows_ptr, a_ptr, q_gate_ptr, out_ptr, total, stride_ot,
                 stride_oh, cols, DK: tl.constexpr, DV: tl.constexpr, L: tl.constexpr, PREC: tl.constexpr,
                 FUSED: tl.constexpr):
    """The state slice moved through a segment's `steps` chunks: chunk 0 at table row `first_row`, chunk
    j > 0 at `later_base + j` (arithmetic in j, so the pipeline issues a step's tile loads ahead). Per chunk,
    with FUSED, its outputs o = (q exp(cum)) S + (q K^T * Gamma) v_new are stored (a row's tokens are row -
    `level_start` of the level's table at `tokens_ptr`); otherwise, past chunk 0, the state at its start S and
    v_new = U - W S, for `_chunk_output_kernel`. S and v_new enter the products in the storage dtype of W and
    U, rounded as the output kernel reads them, so both ways give the same outputs."""
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
            tl.store(h_ptr + base * DK * DV + dk[:, None] * DV + cols[None, :], low.to(h_ptr.dtype.element_ty))
            tl.store(v_new_ptr + base * L * DV + i[:, None] * DV + cols[None, :], v_new.to(v_new_ptr.dtype.element_ty))
        state = _scan_step(state, v_new, k, w, k_gate, decay, PREC)
    return state


@triton.jit
def _state_scan_kernel(
    k_rows_ptr, w_ptr, u_ptr, k_gate_ptr, decay_ptr, v_new_ptr, h_ptr, states_ptr,
    chunk_count_ptr, step_base_ptr, init_row_ptr, final_row_ptr, sizes_ptr,
    chain_ptr, next_count_ptr, next_step_base_ptr, next_final_row_ptr, next_rows,
    tokens_ptr, next_tokens_ptr, q_rows_ptr, a_ptr, q_gate_ptr, out_ptr, total, trunk_sizes_ptr, fused_trunks,
    stride_sr, stride_sh, stride_sk, stride_ot, stride_oh,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tokens0_ptr, tokens1_ptr, tokens2_ptr, sizes0_ptr, sizes1_ptr, sizes2_ptr,
    all_w_ptr, all_u_ptr, all_a_ptr, all_q_rows_ptr, all_k_rows_ptr, all_q_gate_ptr, all_k_gate_ptr, all_decay_ptr,
    system_ptr, start1, start2, scale, eps, helpers, helper_steps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, TILES: tl.constexpr,
    L: tl.constexpr, PREC: tl.constexpr, CHAIN: tl.constexpr, FUSED: tl.constexpr, GATED: tl.constexpr,
    HELP: tl.constexpr, GROUP: tl.constexpr, SUB: tl.constexpr, LOG2_SUB: tl.constexpr, COLS: tl.constexpr,
    WY_LOW: tl.constexpr,
):
    """Per (value head, V split, segment): TILES V tiles of BV columns, one after the other; a program
    takes segments pid, pid + P, ... of the level's real segments (`sizes[1]`; sorted longest first, so the
    first P run in parallel). The segment axis is the grid's last, so the programs of the first segments
    start first: a graph's grid is sized for its capacity, and most of a lone ask's programs find no segment.

    Per tile the [DK, BV] slice of the state lives in registers from the segment's init row through all its
    chunks (`_scan_chunks`): only the two products the recurrence needs are sequential. With FUSED the output
    products ride along each step, so nothing else goes through memory; the launch runs only in rounds with at
    most `fused_trunks` trunks (`_fused_round`). Otherwise (with GATED, only in the other rounds) each step past
    the first stores the state at the chunk's start and v_new, and `_chunk_output_kernel`, which computes a first
    chunk's v_new from the init row itself, takes the outputs in parallel: a segment of one chunk whose final
    state is discarded (a short branch) needs nothing from this scan and is skipped.
    Everything a step reads is contiguous per (chunk, head), zero on padding rows: no gathers, no masks.
    A segment's chunk j is row `segment` for j = 0 and `step_base[segment] + j` after it: the addresses are
    arithmetic in j (no load in the loop decides them), so the compiler's pipeline issues a step's tile loads
    (num_stages - 1) steps ahead.
    With CHAIN, a segment whose `chain` entry names a segment of the next level (a trunk's remainder past its
    save point) goes on into it from the state in registers, its rows `next_rows` on in the tables: the next
    level needs no launch of its own.
    With HELP (the fused launch), the programs that find no segment prep the first branch rows the prep launch
    left to them (`_branch_rows_aside`: only in a fused round of one trunk), one (row, head) item each in the
    order they start, with the prep's arguments (the `all_` tables are the prep's, whole): the trunk scan keeps
    a few dozen multiprocessors busy for a few dozen steps, and these programs (as large as the scan's, one per
    multiprocessor) run on the others, which the prep launch would otherwise have left a partial wave for.
    """
    head = tl.program_id(0)
    heads = tl.num_programs(0)
    dk = tl.arange(0, DK)
    segments = tl.load(sizes_ptr + 1)
    if FUSED:
        segments = tl.where(_fused_round(trunk_sizes_ptr, fused_trunks), segments, 0)
    elif GATED:
        segments = tl.where(_fused_round(trunk_sizes_ptr, fused_trunks), 0, segments)
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
                state = _scan_chunks(state, segment, step_base, steps, head, heads, k_rows_ptr, w_ptr, u_ptr,
                                     k_gate_ptr, decay_ptr, v_new_ptr, h_ptr, tokens_ptr, 0, q_rows_ptr, a_ptr,
                                     q_gate_ptr, out_ptr, total, stride_ot, stride_oh, cols, DK, DV, L, PREC, FUSED)
                if final_row >= 0:
                    tl.store(state_ptrs + final_row * stride_sr, state)
                if follow >= 0:  # only with CHAIN
                    later_base = next_rows + tl.load(next_step_base_ptr + follow)
                    state = _scan_chunks(state, next_rows + follow, later_base, tl.load(next_count_ptr + follow),
                                         head, heads, k_rows_ptr, w_ptr, u_ptr, k_gate_ptr, decay_ptr, v_new_ptr,
                                         h_ptr, next_tokens_ptr, next_rows, q_rows_ptr, a_ptr, q_gate_ptr, out_ptr,
                                         total, stride_ot, stride_oh, cols, DK, DV, L, PREC, FUSED)
                    next_final = tl.load(next_final_row_ptr + follow)
                    if next_final >= 0:
                        tl.store(state_ptrs + next_final * stride_sr, state)
    if HELP:
        end0, end1, end2 = _real_row_ends(sizes0_ptr, sizes1_ptr, sizes2_ptr)
        aside = _branch_rows_aside(sizes0_ptr, fused_trunks, end1, end2, helpers, helper_steps, heads)
        per_slot = tl.num_programs(1) * heads
        helper = (tl.program_id(2) - segments) * per_slot + tl.program_id(1) * heads + head
        if helper >= 0:
            fused_steps = _fused_steps(sizes0_ptr, fused_trunks, end0, end1, CHAIN)
            for item in range(helper, aside * heads, (tl.num_programs(2) - segments) * per_slot):
                _prep_row(end1 + item // heads, item % heads, heads, end0, end1, start1, start2, fused_steps,
                          q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tokens0_ptr, tokens1_ptr, tokens2_ptr,
                          all_w_ptr, all_u_ptr, all_a_ptr, all_q_rows_ptr, all_k_rows_ptr, all_q_gate_ptr,
                          all_k_gate_ptr, all_decay_ptr, system_ptr, total, scale, eps,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh,
                          stride_bt, stride_bh, GROUP, DK, DV, L, SUB, LOG2_SUB, COLS, PREC, WY_LOW)


@triton.jit
def _chunk_output_kernel(
    q_ptr, a_ptr, q_gate_ptr, w_ptr, u_ptr, v_new_ptr, h_ptr, states_ptr, out_ptr,
    tokens0_ptr, tokens1_ptr, tokens2_ptr, count0_ptr, count1_ptr, count2_ptr, init0_ptr, init1_ptr, init2_ptr,
    sizes0_ptr, sizes1_ptr, sizes2_ptr, total, start1, start2, fused_trunks,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_sr, stride_sh, stride_sk,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, L: tl.constexpr,
    PREC: tl.constexpr, CHAIN: tl.constexpr,
):
    """Per (value head, chunk, V tile) o = (q exp(cum)) S_j + (q K^T * Gamma) v_new for the chunk's tokens,
    for the real chunk rows of up to three levels at once; a program takes loop steps pid, pid + P, ... of
    its head and V tile, each step a real row (`_real_row`, as in the prep). In a round whose trunk scan took
    its outputs (`_fused_round`), the rows of level 0 (and of level 1 with CHAIN: they were scanned with it)
    are skipped.

    S_j is the state at the chunk's start and v_new = U - W S_j the chunk's corrected values, both left by
    the scan for a segment's later chunks. A segment's first chunk (row s of its level with s < segments and
    chunk_count[s] > 0: step 0 holds a level's rows 0..) reads S_0 from the segment's init row of the state table,
    which no segment of the level writes, and computes its v_new here, exactly as the scan does (the same
    products and roundings).
    """
    head = tl.program_id(0)
    i = tl.arange(0, L)
    dk = tl.arange(0, DK)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    end0, end1, end2 = _real_row_ends(sizes0_ptr, sizes1_ptr, sizes2_ptr)
    for step in range(_fused_steps(sizes0_ptr, fused_trunks, end0, end1, CHAIN) + tl.program_id(1), end2,
                      tl.num_programs(1)):
        chunk, local, level = _real_row(step, end0, end1, start1, start2)
        row_ptr = _of_level(level, tokens0_ptr, tokens1_ptr, tokens2_ptr) + local * L
        base = chunk * tl.num_programs(0) + head
        tok = tl.load(row_ptr + i)
        ok = tok < total
        q = tl.load(q_ptr + tok[:, None] * stride_qt + (head // GROUP) * stride_qh + dk[None, :],
                    mask=ok[:, None], other=0.0)
        segments = tl.load(_of_level(level, sizes0_ptr, sizes1_ptr, sizes2_ptr) + 1)
        first = tl.load(_of_level(level, count0_ptr, count1_ptr, count2_ptr) + local, mask=local < segments, other=0) > 0
        if first:
            init_row = tl.load(_of_level(level, init0_ptr, init1_ptr, init2_ptr) + local)
            h = tl.load(states_ptr + init_row * stride_sr + head * stride_sh + dk[:, None] * stride_sk
                        + cols[None, :]).to(h_ptr.dtype.element_ty)
            w = tl.load(w_ptr + base * L * DK + i[:, None] * DK + dk[None, :])
            u = tl.load(u_ptr + base * L * DV + i[:, None] * DV + cols[None, :])
            v_new = (u.to(tl.float32) - tl.dot(w, h, input_precision=PREC)).to(v_new_ptr.dtype.element_ty)
        else:
            h = tl.load(h_ptr + base * DK * DV + dk[:, None] * DV + cols[None, :])
            v_new = tl.load(v_new_ptr + base * L * DV + i[:, None] * DV + cols[None, :])
        q_gate = tl.load(q_gate_ptr + base * L + i)
        # the prep stored the causal block with zeros above the diagonal (Gamma is 0 there) and on padding rows
        a = tl.load(a_ptr + base * L * L + i[:, None] * L + i[None, :])
        out = q_gate[:, None] * tl.dot(q.to(h.dtype), h, input_precision=PREC)
        out += tl.dot(a, v_new, input_precision=PREC)
        tl.store(out_ptr + tok[:, None] * stride_ot + head * stride_oh + cols[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=ok[:, None])


PROGRAMS_PER_SM = 4  # the default cap of a launch's programs, per multiprocessor


class _ScanLaunch(NamedTuple):
    """One launch of the state scan: its level, the level it carries on into (None: none, `DeltaLevel.chain`),
    the level's rows in the stacked chunk tables (and the next level's, when it carries on), its segments, whether
    it computes its chunks' outputs (FUSED) and whether it runs only in rounds that do not fuse (GATED)."""

    level: DeltaLevel
    following: DeltaLevel | None
    rows: slice
    segments: int
    fused: bool = False
    gated: bool = False


LEVELS_PER_LAUNCH = 3  # a round's levels (layout.plan_round): one prep and one output launch for all of them


def _level_groups(levels: list[DeltaLevel]) -> list[list[DeltaLevel]]:
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


def gated_delta_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    plan: DeltaPlan,
    states: torch.Tensor,
    *,
    block_v: int = 32,
    split_v: int | None = None,
    sub_block: int = 16,
    prep_warps: int = 4,
    scan_warps: int = 4,
    scan_stages: int = 3,
    out_block_v: int = 128,
    out_warps: int = 4,
    fused_trunks: int | None = None,
    store_dtype: torch.dtype | None = None,
    wy_low_precision: bool = False,
    chunk_programs: int | None = None,
    scan_programs: int | None = None,
    scan_helpers: int | None = None,
    helper_steps: int = 12,
) -> torch.Tensor:
    """The Triton kernels behind the same contract as `gated_delta_reference` (no host synchronisation).

    Only stream tokens that belong to a segment of `plan` get an output row (plan_round covers all).
    Dk and Dv must be powers of two >= 16. The keyword arguments are tuning knobs for benchmarks: the
    scan's V tile (`block_v` columns) and V split (`split_v` programs per segment and head, each doing
    Dv / block_v / split_v tiles in turn; default: one tile per program), the prep kernel's sub-block rows
    (16 or 32: block forward substitution through a float32 scratch; 64: exact doubling over the whole
    chunk in registers, no scratch), the warps of the three kernels, the scan's pipeline depth (`scan_stages`:
    its tile loads are issued scan_stages - 1 steps ahead; 3: on the H200 the scan took 0.050 ms per layer on
    a lone 2,000-token trunk, against 0.061 when its chunk rows came from a table and no load went ahead,
    bench_gdn at cb0e20c and cca1c70; 2 and 4 were slower in gdn-options at e5e9f41), and the output
    kernel's V tile (`out_block_v`; default 128, the releases' whole Dv: on the H200 3-6% faster than 64 in
    rounds a and b, equal alone). `fused_trunks`: rounds with at most this many trunks take their trunks'
    outputs in the scan (module docstring; default: multiprocessors // (value heads * V split), 0: never).
    `store_dtype` (default: the inputs'
    dtype) is the dtype of the stored W, U, q-k block, per-chunk start states and v_new, and so of the
    product operands of the scan, the output kernel and (16-bit storage) the prep's W = T (beta K exp(cum))
    and U = T (beta V): float32 trades time (TF32 products, twice the traffic) for accuracy with 16-bit
    inputs. `wy_low_precision` (16-bit storage only) takes the prep's W and U products in the storage dtype (T
    rounded to it) instead of TF32: 6-10% faster GDN on the H200 (gdn-options at 7117ef9), but with it on by
    default the 0.8B engine's mean total variation to float32 (0.0256) was worse than transformers' bf16
    (0.0245) (fidelity at 0f00d29), so it is off.
    `scan_helpers` and `helper_steps`: in a fused round of one trunk, the fused scan's programs that find no
    segment (its launch has a segment slot per possible trunk) prep the first branch rows, up to `scan_helpers`
    programs (default: the multiprocessors the trunk scan leaves idle, 68 at 0.8B shapes; 0: never) at one
    (row, head) item per `helper_steps` of the trunk's chunk rows, and the prep launch skips those rows
    (`_branch_rows_aside`). On the H200 an item took about 22 us on a multiprocessor of its own and a scan step
    about 1.8 (6a45ec6, `2026-12-01-gdn-scan-helpers-check-6a45ec6`, the engine's forward on rounds padded as
    graphs replay them, answers identical with and without): with one item per 8 chunk rows, Q = 4's prep went
    1.117 -> 0.899 ms a round and its forward 7.52 -> 7.33, but Q = 16's and Q = 64's 16 helper rows made the scan
    launch 0.5 ms longer than the prep saved; one per 12 keeps every helper within the scan (two items at 32
    rows) and leaves RACE passages and resumed agent steps (trunks of fewer than 12 rows) as they were.
    `chunk_programs` and `scan_programs` cap the programs of each launch of the chunk kernels and of the scan
    (default: PROGRAMS_PER_SM per multiprocessor; at least one per head and V split or tile): programs loop
    over the real rows and segments past the cap. Padding rows are not visited at all: when programs
    stepped over them (one dependent load each), a lone 2,000-token ask padded as the engine replays it
    took 1.35x the unpadded GDN time on the H200, whatever the caps (bench_gdn at e139c25 and fd37cde).
    The scan's grid puts segments last, so a graph's programs with a segment to scan start first: a lone
    2,000-token ask padded as the engine replays it took 0.145 ms per layer with it, 0.155 without
    (gdn-options at ddb9232 and 9b251a9).
    On CUDA the V tiles must be at least 32 columns: compiled for the H200 with 16-column tiles, the scan
    returned non-finite values (benchmarks/results, check-gdn-bf16); the interpreter is not affected.
    """
    total, v_heads, dv = v.shape
    k_heads, dk = k.shape[1], k.shape[2]
    for name, dim in (("Dk", dk), ("Dv", dv)):
        if dim < 16 or dim & (dim - 1):
            raise ValueError(f"{name} = {dim} must be a power of two >= 16")
    if states.dtype != torch.float32 or states.stride(-1) != 1:
        raise ValueError("the state table must be float32 with a unit last stride")
    default_programs = PROGRAMS_PER_SM * multiprocessors(q.device)
    chunk_programs = default_programs if chunk_programs is None else chunk_programs
    scan_programs = default_programs if scan_programs is None else scan_programs
    if chunk_programs < 1 or scan_programs < 1:
        raise ValueError("chunk_programs and scan_programs must be positive")
    if sub_block < 16 or sub_block & (sub_block - 1) or GDN_CHUNK % sub_block:
        raise ValueError(f"sub_block = {sub_block} must be a power of two in [16, {GDN_CHUNK}]")
    min_tile = 32 if q.is_cuda else 16
    bv = min(block_v, dv)
    split = min(split_v or dv, dv // max(bv, 1))
    if bv < min_tile or bv & (bv - 1) or split < 1 or dv % (bv * split):
        raise ValueError(f"block_v = {bv} and split_v = {split} do not tile Dv = {dv}")
    obv = min(out_block_v, dv)
    if obv < min_tile or obv & (obv - 1):
        raise ValueError(f"out_block_v = {obv} does not tile Dv = {dv}")
    store = store_dtype or q.dtype
    if fused_trunks is None:  # as many trunks as the fused scan runs in one wave of programs (one per multiprocessor)
        fused_trunks = multiprocessors(q.device) // (v_heads * split)
    # with 4-byte storage the fused scan's tiles pass the H200's shared memory (238 KB of 227 at 3 stages)
    fusing = fused_trunks > 0 and (store.itemsize <= 2 or not q.is_cuda)
    fused_trunks = fused_trunks if fusing else -1  # -1: no round is fused (`_fused_round`)
    # programs of the fused trunk scan that may prep branch rows beside a lone trunk: the multiprocessors it leaves
    helpers = max(0, multiprocessors(q.device) - v_heads * split) if scan_helpers is None else scan_helpers
    if helpers < 0 or helper_steps < 1:
        raise ValueError("scan_helpers must be >= 0 and helper_steps >= 1")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    chunk = GDN_CHUNK
    group = v_heads // k_heads
    for levels in _level_groups(plan.levels):
        table_rows = [level.chunk_tokens.shape[0] for level in levels]  # real rows first, then any padding
        table_segments = [level.init_row.shape[0] for level in levels]
        start1, start2 = table_rows[0], table_rows[0] + table_rows[1]
        chunks = sum(table_rows)  # the three levels' chunk rows, stacked
        sizes = [level.sizes for level in levels]
        if chunks == 0:
            continue
        w = torch.empty(chunks, v_heads, chunk, dk, dtype=store, device=q.device)
        u = torch.empty(chunks, v_heads, chunk, dv, dtype=store, device=q.device)
        a = torch.empty(chunks, v_heads, chunk, chunk, dtype=store, device=q.device)
        k_rows = torch.empty(chunks, v_heads, chunk, dk, dtype=k.dtype, device=q.device)
        # the query rows only a fused scan reads (unfused: the prep's masked store never writes them)
        q_rows = torch.empty(chunks, v_heads, chunk, dk, dtype=q.dtype, device=q.device) if fusing else k_rows
        q_gate = torch.empty(chunks, v_heads, chunk, dtype=torch.float32, device=q.device)
        k_gate = torch.empty_like(q_gate)
        decay = torch.empty(chunks, v_heads, dtype=torch.float32, device=q.device)
        system = torch.empty(chunks, v_heads, chunk, chunk, dtype=torch.float32, device=q.device)
        tokens = [level.chunk_tokens for level in levels]
        chained = levels[1].chained
        # the fused trunk scan's programs past a lone trunk's prep branch rows (`_branch_rows_aside`); none unless
        # it has some (its segment slots past the first) and the trunk leaves multiprocessors idle
        trunk_slots = min(table_segments[0], max(1, scan_programs // (v_heads * split)))
        helping = fusing and trunk_slots > 1 and helpers > 0
        prep_constants = {"GROUP": group, "SUB": sub_block, "LOG2_SUB": sub_block.bit_length() - 1,
                          "COLS": min(dk, dv, 64), "WY_LOW": wy_low_precision and store.itemsize == 2}
        prep_strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1))
        helper_args = (helpers if helping else 0, helper_steps)  # the kernels' `helpers`, `helper_steps`
        _chunk_prep_kernel[(v_heads, min(chunks, max(1, chunk_programs // v_heads)))](
            q, k, v, g, beta, *tokens, *sizes,
            w, u, a, q_rows, k_rows, q_gate, k_gate, decay, system,
            total, start1, start2, dk**-0.5, L2_EPS, fused_trunks, *helper_args, *prep_strides,
            DK=dk, DV=dv, L=chunk, PREC=prec, CHAIN=chained, num_warps=prep_warps, **prep_constants,
        )
        # written by the unfused scan for every chunk of a segment past its first: the state at the chunk's start
        # and v_new = U - W S; one level after the other (a level starts from states the previous ones wrote)
        h = torch.empty(chunks, v_heads, dk, dv, dtype=store, device=q.device)
        v_new = torch.empty(chunks, v_heads, chunk, dv, dtype=store, device=q.device)
        # a level all of whose segments continue the one before (`DeltaLevel.chained`: a plan's trunk
        # remainders) is scanned by the launch of the level before; any other level has a launch of its own.
        # The trunk level has two: the fused and the unfused scan, of which a round runs one (`_fused_round`)
        scans = [_ScanLaunch(level, None, slice(first, first + size), count)
                 for level, first, size, count in zip(levels, (0, start1, start2), table_rows, table_segments)]
        if chained:
            scans = [_ScanLaunch(levels[0], levels[1], slice(0, start2), table_segments[0]), scans[2]]
        if fusing:
            scans = [scans[0]._replace(fused=True), scans[0]._replace(gated=True), *scans[1:]]
        for scan in scans:
            rows = scan.rows
            carried = scan.following or scan.level  # the next level's tables (read only with CHAIN)
            _state_scan_kernel[(v_heads, split, min(scan.segments, max(1, scan_programs // (v_heads * split))))](
                k_rows[rows], w[rows], u[rows], k_gate[rows], decay[rows], v_new[rows], h[rows], states,
                scan.level.chunk_count, scan.level.step_base, scan.level.init_row, scan.level.final_row,
                scan.level.sizes, scan.level.chain, carried.chunk_count, carried.step_base, carried.final_row, start1,
                scan.level.chunk_tokens, carried.chunk_tokens, q_rows[rows], a[rows], q_gate[rows], out, total,
                levels[0].sizes, fused_trunks,
                states.stride(0), states.stride(1), states.stride(2), out.stride(0), out.stride(1),
                q, k, v, g, beta, *tokens, *sizes, w, u, a, q_rows, k_rows, q_gate, k_gate, decay, system,
                start1, start2, dk**-0.5, L2_EPS, *helper_args, *prep_strides,
                DK=dk, DV=dv, BV=bv, TILES=dv // bv // split, L=chunk, PREC=prec, CHAIN=scan.following is not None,
                FUSED=scan.fused, GATED=scan.gated, HELP=helping and scan.fused, num_warps=scan_warps,
                num_stages=scan_stages, **prep_constants,
            )
        _chunk_output_kernel[(v_heads, min(chunks, max(1, chunk_programs // (v_heads * (dv // obv)))), dv // obv)](
            q, a, q_gate, w, u, v_new, h, states, out, *tokens,
            *(level.chunk_count for level in levels), *(level.init_row for level in levels), *sizes,
            total, start1, start2, fused_trunks,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), states.stride(0), states.stride(1), states.stride(2),
            GROUP=group, DK=dk, DV=dv, BV=obv, L=chunk, PREC=prec, CHAIN=chained, num_warps=out_warps,
        )
    return out
