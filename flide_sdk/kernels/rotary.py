"""Attention's per-head q/k RMS norm and partial rotary embedding, fused into one pass.

Qwen3.5 normalises each query and key head (the head dimension is the norm's row, `rms_norm`'s zero-centred
RMSNorm) and then rotates its first R channels by the token's position, half-split convention: with
r = normed[:R] and halves r1, r2, the rotated channels are r * cos + cat(-r2, r1) * sin; channels R.. pass
through. In torch that is a norm kernel followed by slices, a negation, two concatenations and four
elementwise ops. Here one program normalises a block of whole head rows and writes them rotated, keeping
the definition's roundings for 16-bit dtypes: the norm's output is rounded to the weight's dtype, each of
the two products is rounded, and so is their sum.

`rms_norm_rotary_reference` is the definition; `_norm_rotary_rows` the kernel's tile, which the engine runs
inside attention's front (`attention_front`, at each token's position in tables of every position);
`rms_norm_rotary_triton` runs it alone on per-token cos/sin, for its tests. x is [T, H, D] with unit last
stride and any token and head strides (q is a column block of attention's q|gate projection); the result is
contiguous. Launch shapes depend on tensor shapes only, so the kernel is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements a program holds: a block of head rows of the padded head dimension, at least one row. At 4 warps,
# 4 rows of 256 give a thread 8 contiguous elements a row (16 rows took ~200 registers a thread on sm_90).
TILE = 1024


@triton.jit
def _normed(x_rows, weight_ptr, offset, col, col_ok, row_ok, rstd, dtype: tl.constexpr):
    """The norm's output at columns `col` of each row (x_rows: the rows' pointers), rounded to dtype."""
    x = tl.load(x_rows[:, None] + col[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    weight = tl.load(weight_ptr + col, mask=col_ok, other=0.0).to(tl.float32)
    return (x.to(tl.float32) * rstd[:, None] * (offset + weight)[None, :]).to(dtype).to(tl.float32)


@triton.jit
def _norm_rotary_rows(
    x_rows, out_rows, copy_rows, row_ok, cos_rows, sin_rows, weight_ptr, width, rotary, eps, offset,
    BD: tl.constexpr, BROT: tl.constexpr, COPY: tl.constexpr,
):
    """rms_norm of the head rows at `x_rows` (pointers, [BR]) with their first `rotary` channels rotated by
    the cos/sin rows at `cos_rows`/`sin_rows`, stored at `out_rows` and, with COPY, at `copy_rows` too
    (where `row_ok`)."""
    dtype = out_rows.dtype.element_ty
    col = tl.arange(0, BD)
    col_ok = col < width
    x = tl.load(x_rows[:, None] + col[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / width + eps)
    weight = tl.load(weight_ptr + col, mask=col_ok, other=0.0).to(tl.float32)
    normed = x * rstd[:, None] * (offset + weight)[None, :]
    passing = col_ok & (col >= rotary)  # the channels the rotation leaves alone
    _store_rows(out_rows, copy_rows, col, normed.to(dtype), row_ok[:, None] & passing[None, :], COPY)

    # the rotated channels: each reads its partner half channels away, both through the norm again (cached)
    rc = tl.arange(0, BROT)
    rc_ok = rc < rotary
    half = rotary // 2
    first = rc < half
    own = _normed(x_rows, weight_ptr, offset, rc, rc_ok, row_ok, rstd, dtype)
    partner = _normed(x_rows, weight_ptr, offset, tl.where(first, rc + half, rc - half), rc_ok, row_ok, rstd, dtype)
    partner = tl.where(first[None, :], -partner, partner)
    ok = row_ok[:, None] & rc_ok[None, :]
    cos = tl.load(cos_rows[:, None] + rc[None, :], mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_rows[:, None] + rc[None, :], mask=ok, other=0.0).to(tl.float32)
    turned = (own * cos).to(dtype).to(tl.float32) + (partner * sin).to(dtype).to(tl.float32)
    _store_rows(out_rows, copy_rows, rc, turned.to(dtype), ok, COPY)


@triton.jit
def _store_rows(out_rows, copy_rows, col, values, mask, COPY: tl.constexpr):
    """values [BR, len(col)] at columns `col` of the rows at `out_rows` and, with COPY, of `copy_rows`."""
    tl.store(out_rows[:, None] + col[None, :], values, mask=mask)
    if COPY:
        tl.store(copy_rows[:, None] + col[None, :], values, mask=mask)


@triton.jit
def _rms_norm_rotary_kernel(
    x_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr, rows, heads, width, rotary, eps, offset,
    stride_token, stride_head, stride_cos, stride_sin,
    BR: tl.constexpr, BD: tl.constexpr, BROT: tl.constexpr,
):
    row = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)  # row = token * heads + head
    token = row // heads
    out_rows = out_ptr + row * width
    _norm_rotary_rows(x_ptr + token * stride_token + (row - token * heads) * stride_head, out_rows, out_rows,
                      row < rows, cos_ptr + token * stride_cos, sin_ptr + token * stride_sin, weight_ptr, width,
                      rotary, eps, offset, BD, BROT, False)


def row_blocks(width: int) -> tuple[int, int]:
    """(head rows per program, padded head dimension) of the rotary tiles for heads of `width` channels."""
    block_d = triton.next_power_of_2(width)
    return max(1, TILE // block_d), block_d


def rms_norm_rotary_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, *, offset: float = 1.0
) -> torch.Tensor:
    """The Triton kernel behind the contract of `rms_norm_rotary_reference`.

    x [T, H, D], weight [D], cos and sin [T, R] in weight's dtype with R even and at most D.
    """
    tokens, heads, width = x.shape
    rotary = cos.shape[-1]
    if (weight.shape != (width,) or cos.shape != (tokens, rotary) or sin.shape != cos.shape
            or rotary % 2 or rotary > width or cos.dtype != weight.dtype or sin.dtype != weight.dtype):
        raise ValueError(f"rms_norm_rotary: x {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, "
                         f"cos {tuple(cos.shape)} {cos.dtype}, sin {tuple(sin.shape)} {sin.dtype}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    out = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
    rows = tokens * heads
    if rows and width:
        block_r, block_d = row_blocks(width)
        _rms_norm_rotary_kernel[(triton.cdiv(rows, block_r),)](
            x, weight.contiguous(), cos, sin, out, rows, heads, width, rotary, eps, offset,
            x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            BR=block_r, BD=block_d, BROT=triton.next_power_of_2(max(rotary, 1)), num_warps=4,
        )
    return out
