"""A round's per-token and per-chunk-position metadata, derived on the device from its staged form.

The host stages, for the arrays that grow with the stream, only what they are made of (`plan.tree.RoundPlan.stage`):
a piece table (`plans.PIECE_ROWS`: each trunk and branch of the round, with its stream start, its tokens'
token-row values and what its first tokens' conv taps before it read), each Gated DeltaNet chunk row's span (its
first stream index and its segment's end) and the token before each save point. This module derives, for a
stream of T tokens:
- token_rows [7, T] (`plans.TOKEN_ROWS`): a real token's values are its piece's (the position's as position -
  stream index, plus t); padding tokens get (0, real, real, real, requests, T, real);
- conv_src [T, K]: token t's tap j reads conv-table row t + 1 - (K - 1 - j) when that token lies in its piece,
  else the row of the source its piece names for that position (`plans.CONV_PIECE_ROWS`): an ancestor's stream
  row, its resumed window's row (after the T + 1 stream rows) or the zero row; padding tokens read the zero row;
- chunk_tokens [rows, GDN_CHUNK]: start + j while inside the span, T past it (padding rows have empty spans);
- save_window_src [saves, K - 1]: the conv inputs before each save point, the last K - 1 taps of the token before it.
A token finds its piece by binary search over the pieces' starts. `reference.expand_round_reference` is the
definition (torch: the host rounds of the eager path and the tests); `expand_round_triton` one launch (a program
per block of tokens or of chunk rows; grid from tensor shapes only: CUDA-graph safe), the first of a captured
round, then the save windows' gather.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flide_sdk.kernels.plans import CONV_PIECE_ROWS, PIECE_ROWS, TOKEN_ROWS, ZERO_TAP, RoundMetadata
from flide_sdk.kernels.reference import gather_save_windows

ZERO = tl.constexpr(ZERO_TAP)
BLOCK_TOKENS = 256  # tokens a program expands
BLOCK_ROWS = 16  # chunk rows a program expands
# the kernel reads the piece table's rows at these indices
assert PIECE_ROWS[:4] == ("start", "tap_1", "tap_2", "tap_3") and len(PIECE_ROWS) == 11
assert PIECE_ROWS[len(CONV_PIECE_ROWS) :] == TOKEN_ROWS


@triton.jit
def _expand_round_kernel(
    pieces_ptr, counts_ptr, num_tokens_ptr, spans_ptr, rows_ptr, conv_ptr, chunks_ptr,
    total, piece_capacity, chunk_rows, token_programs,
    K: tl.constexpr, CHUNK: tl.constexpr, SEARCH_STEPS: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < token_programs:
        t = pid * BT + tl.arange(0, BT).to(tl.int64)
        inside = t < total
        real = tl.load(num_tokens_ptr)
        requests = tl.load(counts_ptr + 1)
        # the last piece starting at or before t: the pieces' starts are increasing, the first is 0
        lo = tl.zeros((BT,), tl.int64)
        hi = lo + tl.load(counts_ptr) - 1
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi + 1) // 2
            found = tl.load(pieces_ptr + mid, mask=inside, other=0) <= t
            lo = tl.where(found, mid, lo)
            hi = tl.where(found, hi, mid - 1)
        is_real = t < real
        field = pieces_ptr + lo
        start = tl.load(field, mask=is_real, other=0)
        tap_1 = tl.load(field + piece_capacity, mask=is_real, other=0)
        tap_2 = tl.load(field + 2 * piece_capacity, mask=is_real, other=0)
        tap_3 = tl.load(field + 3 * piece_capacity, mask=is_real, other=0)
        offset = tl.load(field + 4 * piece_capacity, mask=is_real, other=0)
        key_lo = tl.load(field + 5 * piece_capacity, mask=is_real, other=0)
        ctx_hi = tl.load(field + 6 * piece_capacity, mask=is_real, other=0)
        seg_lo = tl.load(field + 7 * piece_capacity, mask=is_real, other=0)
        request = tl.load(field + 8 * piece_capacity, mask=is_real, other=0)
        vis_end = tl.load(field + 9 * piece_capacity, mask=is_real, other=0)
        piece_lo = tl.load(field + 10 * piece_capacity, mask=is_real, other=0)
        tl.store(rows_ptr + t, tl.where(is_real, offset + t, 0), mask=inside)
        tl.store(rows_ptr + total + t, tl.where(is_real, key_lo, real), mask=inside)
        tl.store(rows_ptr + 2 * total + t, tl.where(is_real, ctx_hi, real), mask=inside)
        tl.store(rows_ptr + 3 * total + t, tl.where(is_real, seg_lo, real), mask=inside)
        tl.store(rows_ptr + 4 * total + t, tl.where(is_real, request, requests), mask=inside)
        tl.store(rows_ptr + 5 * total + t, tl.where(is_real, vis_end, total), mask=inside)
        tl.store(rows_ptr + 6 * total + t, tl.where(is_real, piece_lo, real), mask=inside)
        lead = t - start
        for j in tl.static_range(K):
            back = K - 1 - j
            tap = tl.where(back - lead == 1, tap_1, tl.where(back - lead == 2, tap_2, tap_3))
            before = tl.where(tap >= 0, tap + 1, tl.where(tap == ZERO, 0, 1 + total - 2 - tap))
            source = tl.where(back <= lead, t + 1 - back, before)
            tl.store(conv_ptr + t * K + j, tl.where(is_real, source, 0), mask=inside)
    else:
        row = (pid - token_programs) * BR + tl.arange(0, BR).to(tl.int64)
        row_ok = row < chunk_rows  # names differ from the other branch's: Triton merges same-named values
        span_start = tl.load(spans_ptr + row, mask=row_ok, other=0)
        span_end = tl.load(spans_ptr + chunk_rows + row, mask=row_ok, other=0)
        positions = span_start[:, None] + tl.arange(0, CHUNK)[None, :]
        tl.store(chunks_ptr + row[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :],
                 tl.where(positions < span_end[:, None], positions, total), mask=row_ok[:, None])


def expand_round_triton(arrays: RoundMetadata) -> None:
    """One launch behind the contract of `expand_round_reference` (int64 tensors, contiguous)."""
    pieces, token_rows, chunk_spans = arrays.pieces, arrays.token_rows, arrays.chunk_spans
    total, kernel = arrays.conv_src.shape
    rows, chunk = arrays.chunk_tokens.shape
    well_formed = all(x.is_contiguous() and x.dtype == torch.int64 for x in arrays)
    if (pieces.shape[0] != len(PIECE_ROWS) or token_rows.shape != (len(TOKEN_ROWS), total)
            or chunk_spans.shape != (2, rows) or not well_formed):
        shapes = ", ".join(f"{name} {tuple(x.shape)}" for name, x in arrays._asdict().items())
        raise ValueError(f"expand_round: {shapes} (int64, contiguous)")
    token_programs = triton.cdiv(total, BLOCK_TOKENS)
    _expand_round_kernel[(token_programs + triton.cdiv(rows, BLOCK_ROWS),)](
        pieces, arrays.piece_counts, arrays.num_tokens, chunk_spans, token_rows, arrays.conv_src, arrays.chunk_tokens,
        total, pieces.shape[1], rows, token_programs,
        K=kernel, CHUNK=chunk, SEARCH_STEPS=max(1, (pieces.shape[1] - 1).bit_length()), BT=BLOCK_TOKENS,
        BR=BLOCK_ROWS,
    )
    gather_save_windows(arrays)
