"""The chunk prep of the forked gated delta rule: everything of a chunk that does not depend on the state.

Per (chunk row, value head): the gates, the causal q-k block, T = (I + A)^-1 by block forward substitution (or
exact doubling in registers) and the WY products W and U, which the state scan (`gated_delta`) and the output
kernel read. Also the row stepping the three kernels share: programs loop over the real chunk rows of up to
three levels at once (`real_row`), which rows a fused trunk scan takes (`fused_step_count`), and which branch rows
its idle programs prep instead of the prep launch (`branch_rows_aside`).
"""

import triton
import triton.language as tl


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
                              PREC: tl.constexpr):
    """out [L, WIDTH] (contiguous) = t @ (scale[:, None] * X), X's rows at `rows_ptr` [L] (zero where not
    `ok`), COLS columns at a time (bounds live registers); rows not `ok` are stored as zeros."""
    for c0 in tl.static_range(0, WIDTH, COLS):
        cols = c0 + tl.arange(0, COLS)
        x = tl.load(rows_ptr[:, None] + cols[None, :], mask=ok[:, None], other=0.0)
        operand = scale[:, None] * x.to(tl.float32)
        product = tl.dot(t, operand, input_precision=PREC)
        product = tl.where(ok[:, None], product, 0.0)
        rows = tl.arange(0, t.shape[0])
        tl.store(out_ptr + rows[:, None] * WIDTH + cols[None, :], product.to(out_ptr.dtype.element_ty))


@triton.jit
def real_row_ends(sizes0_ptr, sizes1_ptr, sizes2_ptr):
    """Where the real chunk rows of levels 0, 0-1 and 0-2 end in the steps `real_row` maps (each level's
    `sizes` counts its real rows, which come first in its table); loaded once per program."""
    end0 = tl.load(sizes0_ptr)
    end1 = end0 + tl.load(sizes1_ptr)
    return end0, end1, end1 + tl.load(sizes2_ptr)


@triton.jit
def real_row(step, end0, end1):
    """(the row within its level, the level) of loop step `step` over the real chunk rows of three levels: steps
    0 .. end0 - 1 are level 0's, then level 1's up to end1, then level 2's. The step is also the row of the
    stacked work tables, which hold the real rows only (`stacked_rows`): the padding rows of a captured
    graph's level tables cost neither time nor memory."""
    level = (step >= end0).to(tl.int32) + (step >= end1).to(tl.int32)
    return step - tl.where(level == 2, end1, tl.where(level == 1, end0, 0)), level


@triton.jit
def later_shift(level, sizes0_ptr, sizes1_ptr, sizes2_ptr):
    """What a later chunk's stacked row (a segment's chunk j > 0) less gives its row of the later-chunk tables
    (the chunk start states and v_new, which only later chunks have): the segments of the levels up to `level`
    (each level's first rows are its segments' first chunks, and the stacked tables are the levels one after
    the other)."""
    segments0 = tl.load(sizes0_ptr + 1)
    segments1 = segments0 + tl.load(sizes1_ptr + 1)
    return tl.where(level == 2, segments1 + tl.load(sizes2_ptr + 1), tl.where(level == 1, segments1, segments0))


@triton.jit
def of_level(level, first_ptr, second_ptr, third_ptr):
    """The pointer of `level` (0, 1 or 2) among three levels' pointers."""
    return tl.where(level == 2, third_ptr, tl.where(level == 1, second_ptr, first_ptr))


@triton.jit
def fused_round(trunk_sizes_ptr, fused_trunks):
    """Whether the trunk scan computes the outputs of its chunks itself this round (FUSED): when the round has at
    most `fused_trunks` trunks (level 0's real segments)."""
    return tl.load(trunk_sizes_ptr + 1) <= fused_trunks


@triton.jit
def fused_step_count(sizes0_ptr, fused_trunks, end0, end1, CHAIN: tl.constexpr):
    """How many of the first loop steps of the prep and output kernels (`real_row`) are rows the trunk scan takes
    the outputs of this round: level 0's, and level 1's with CHAIN (they are scanned with it), in a fused round;
    none otherwise."""
    scanned_end = end0
    if CHAIN:
        scanned_end = end1
    return tl.where(fused_round(sizes0_ptr, fused_trunks), scanned_end, 0)


@triton.jit
def branch_rows_aside(sizes0_ptr, fused_trunks, end1, end2, helpers, helper_steps, heads):
    """How many of the branches' chunk rows (the first ones of level 2) the idle programs of the fused trunk scan
    prep (`_state_scan_kernel`'s helpers) instead of the prep launch: in a fused round of one trunk, as many as
    `helpers` programs do at one row-head item per `helper_steps` of the trunk's chunk rows (an item takes about
    as long as that many scan steps, so they finish within the scan); none otherwise (helpers = 0: never)."""
    one_trunk = fused_round(sizes0_ptr, fused_trunks) & (tl.load(sizes0_ptr + 1) == 1)
    return tl.where(one_trunk, tl.minimum(end2 - end1, (helpers * (end1 // helper_steps)) // heads), 0)


@triton.jit
def prep_row(
    step, head, heads, end0, end1, fused_steps,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, piece_lo_ptr, tokens0_ptr, tokens1_ptr, tokens2_ptr,
    w_ptr, u_ptr, a_ptr, q_rows_ptr, k_rows_ptr, q_gate_ptr, k_gate_ptr, decay_ptr, scratch,
    total, scale, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, L: tl.constexpr,
    SUB: tl.constexpr, LOG2_SUB: tl.constexpr, COLS: tl.constexpr, PREC: tl.constexpr,
):
    """Everything of one (chunk row, value head) that does not depend on the state (`chunk_prep_kernel`).

    The system A goes through the program's [L, L] float32 scratch `scratch`: its lower SUB x SUB
    blocks are read back (tuples indexed b * (b + 1) // 2 + c, block row b >= block column c) so that
    T = (I + A)^-1 costs only the block products it needs; T is written over A and read back whole.
    The barriers order the scratch's writes and reads between the program's threads, also across the items
    a program takes one after the other.
    """
    NSUB: tl.constexpr = L // SUB
    i = tl.arange(0, L)
    dk = tl.arange(0, DK)
    row, col = i[:, None], i[None, :]
    local, level = real_row(step, end0, end1)
    row_ptr = of_level(level, tokens0_ptr, tokens1_ptr, tokens2_ptr) + local * L
    base = step * heads + head
    tok = tl.load(row_ptr + i)
    ok = tok < total
    key_head = head // GROUP

    # gates: cumulative log decay, Gamma, and the per-row factors the scan applies. A chunk row may pack sibling
    # pieces (`DeltaPlan.piece_lo`): a token sees the earlier tokens of its own piece, and its decay from the
    # segment's state counts from its piece's first token (`from_piece`; all of the chunk in an unpacked row)
    g = tl.load(g_ptr + tok * stride_gt + head * stride_gh, mask=ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + tok * stride_bt + head * stride_bh, mask=ok, other=0.0).to(tl.float32)
    chunk_start = tl.sum(tl.where(i == 0, tok, 0), axis=0)
    first = tl.maximum(tl.load(piece_lo_ptr + tok, mask=ok, other=total) - chunk_start, 0)  # its piece's row
    cum = tl.cumsum(g, axis=0)
    last = tl.sum(tl.where(i == L - 1, cum, 0.0), axis=0)
    from_piece = cum - tl.sum(tl.where(col < first[:, None], g[None, :], 0.0), axis=1)
    gamma = tl.exp(tl.where((row >= col) & (col >= first[:, None]), cum[:, None] - cum[None, :], float("-inf")))
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
    tl.store(q_gate_ptr + base * L + i, q_rnorm * tl.exp(from_piece))
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
        tl.debug_barrier()  # the scratch is the program's: every thread has read back its previous item's T
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

    # WY form: U = T (beta V), W = T (beta K exp(from_piece)), COLS columns at a time (bounds live registers);
    # padding rows are stored as zeros, so the scan reads whole chunks without masks
    _store_row_scaled_product(t, beta, v_ptr + tok * stride_vt + head * stride_vh, ok,
                              u_ptr + base * L * DV, DV, COLS, PREC)
    _store_row_scaled_product(t, beta * k_rnorm * tl.exp(from_piece), k_ptr + tok * stride_kt + key_head * stride_kh,
                              ok, w_ptr + base * L * DK, DK, COLS, PREC)


@triton.jit
def chunk_prep_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, piece_lo_ptr, tokens0_ptr, tokens1_ptr, tokens2_ptr,
    sizes0_ptr, sizes1_ptr, sizes2_ptr,
    w_ptr, u_ptr, a_ptr, q_rows_ptr, k_rows_ptr, q_gate_ptr, k_gate_ptr, decay_ptr, system_ptr,
    total, scale, eps, fused_trunks, helpers, helper_steps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, L: tl.constexpr,
    SUB: tl.constexpr, LOG2_SUB: tl.constexpr, COLS: tl.constexpr, PREC: tl.constexpr, CHAIN: tl.constexpr,
):
    """Per (value head, chunk) everything of the chunk that does not depend on the state (`prep_row`), for the
    real chunk rows of up to three levels at once, less the branch rows the fused trunk scan's idle programs
    take (`branch_rows_aside`); a program takes loop steps pid, pid + P, ... of its head (P programs: a capped
    grid), each step a real row (`real_row`); each program has an [L, L] float32 scratch of its own.
    """
    head = tl.program_id(0)
    heads = tl.num_programs(0)
    end0, end1, end2 = real_row_ends(sizes0_ptr, sizes1_ptr, sizes2_ptr)
    fused_steps = fused_step_count(sizes0_ptr, fused_trunks, end0, end1, CHAIN)  # whose query rows the scan reads
    aside = branch_rows_aside(sizes0_ptr, fused_trunks, end1, end2, helpers, helper_steps, heads)
    for index in range(tl.program_id(1), end2 - aside, tl.num_programs(1)):
        step = tl.where(index < end1, index, index + aside)
        prep_row(step, head, heads, end0, end1, fused_steps,
                  q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, piece_lo_ptr, tokens0_ptr, tokens1_ptr, tokens2_ptr,
                  w_ptr, u_ptr, a_ptr, q_rows_ptr, k_rows_ptr, q_gate_ptr, k_gate_ptr, decay_ptr,
                  system_ptr + (tl.program_id(1) * heads + head) * L * L,
                  total, scale, eps,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh,
                  stride_bt, stride_bh, GROUP, DK, DV, L, SUB, LOG2_SUB, COLS, PREC)
