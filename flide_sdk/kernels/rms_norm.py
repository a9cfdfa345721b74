"""The RMS norms of the decoders, row-wise over the last dimension, each fused into one pass.

- `rms_norm`: RMSNorm, x / sqrt(mean(x^2) + eps) * (offset + w) (offset 1: Qwen3.5's zero-centred weights; 0:
  Gemma 4's), computed in float32 and cast to w's dtype, the compute dtype (the decoder layers' norms, the final norm, and attention's per-head q/k
  norms with the head dimension as the row). x may be wider: the decoder keeps its residual stream in float32.
- `add_rms_norm`: the residual add folded into the norm after it: s = x + delta in x's dtype (delta may be
  narrower), and rms_norm(s). Returns (s, normed), so the residual stream and the next sublayer's input come
  out of one read of x and delta.
- `norm_add`: a sublayer's output normed before the residual add (Gemma 4's sandwich norms): s = (x +
  rms_norm(delta)) * scale in x's dtype, the norm rounded to its weight's dtype first as `rms_norm` rounds it, and
  optionally the next norm of s. Returns (s, normed or None): the norm, the add, the layer scalar and the next
  norm in one pass.
- `gated_rms_norm`: the Gated DeltaNet output norm, w * rmsnorm(x) * silu(gate), with the casts of
  transformers' version: normalise in float32, cast to x's dtype, multiply by w (rounded to the product's
  dtype), multiply by silu(gate) in float32, cast to x's dtype.

`*_reference` are the definitions (torch, used on CPU); `*_triton` the kernels behind the same contracts.
A program normalises a block of whole rows held in registers (rows up to a few thousand wide, the
hidden size included), accumulating in float32. Launch shapes depend on tensor shapes only, so the
kernels are CUDA-graph safe. Leading dimensions are flattened into rows; the last one must be the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096  # elements a program holds: a block of rows of the padded width (at least one row)


@triton.jit
def _normalise(x, width, eps):
    """x [BR, BN] float32, zero outside the row, times the reciprocal RMS of its row."""
    mean_square = tl.sum(x * x, axis=1) / width
    return x * tl.rsqrt(mean_square + eps)[:, None]


@triton.jit
def _rms_norm_kernel(
    x_ptr, delta_ptr, weight_ptr, sum_ptr, out_ptr, rows, width, eps, offset,
    stride_x, stride_delta, stride_sum, stride_out,
    HAS_DELTA: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
):
    row = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    col = tl.arange(0, BN)
    col_ok = col < width
    ok = (row < rows)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + row[:, None] * stride_x + col[None, :], mask=ok, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row[:, None] * stride_delta + col[None, :], mask=ok, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(sum_ptr.dtype.element_ty)  # the sum, rounded as stored
        tl.store(sum_ptr + row[:, None] * stride_sum + col[None, :], x, mask=ok)
    normed = _normalise(x.to(tl.float32), width, eps)
    weight = tl.load(weight_ptr + col, mask=col_ok, other=0.0).to(tl.float32)
    out = normed * (offset + weight)[None, :]
    tl.store(out_ptr + row[:, None] * stride_out + col[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _norm_add_kernel(
    x_ptr, delta_ptr, weight_ptr, scale_ptr, next_weight_ptr, sum_ptr, out_ptr, rows, width, eps, offset,
    stride_x, stride_delta, stride_sum, stride_out,
    HAS_SCALE: tl.constexpr, HAS_NEXT: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
):
    row = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    col = tl.arange(0, BN)
    col_ok = col < width
    ok = (row < rows)[:, None] & col_ok[None, :]
    delta = tl.load(delta_ptr + row[:, None] * stride_delta + col[None, :], mask=ok, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + col, mask=col_ok, other=0.0).to(tl.float32)
    normed = (_normalise(delta, width, eps) * (offset + weight)[None, :]).to(weight_ptr.dtype.element_ty)
    x = tl.load(x_ptr + row[:, None] * stride_x + col[None, :], mask=ok, other=0.0)
    total = (x.to(tl.float32) + normed.to(tl.float32)).to(sum_ptr.dtype.element_ty)  # rounded as stored
    if HAS_SCALE:
        total = (total.to(tl.float32) * tl.load(scale_ptr).to(tl.float32)).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row[:, None] * stride_sum + col[None, :], total, mask=ok)
    if HAS_NEXT:
        next_weight = tl.load(next_weight_ptr + col, mask=col_ok, other=0.0).to(tl.float32)
        out = _normalise(total.to(tl.float32), width, eps) * (offset + next_weight)[None, :]
        tl.store(out_ptr + row[:, None] * stride_out + col[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, gate_ptr, weight_ptr, out_ptr, rows, width, eps, heads,
    stride_x, stride_x_head, stride_gate, stride_gate_head, stride_out,
    ROUND_PRODUCT: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
):
    """Row r = token * heads + head of x and gate starts at token * stride + head * head_stride."""
    row = tl.program_id(0) * BR + tl.arange(0, BR)
    token = row // heads
    head = row - token * heads
    col = tl.arange(0, BN)
    col_ok = col < width
    ok = (row < rows)[:, None] & col_ok[None, :]
    dtype = out_ptr.dtype.element_ty
    x_start = token.to(tl.int64) * stride_x + head * stride_x_head
    x = tl.load(x_ptr + x_start[:, None] + col[None, :], mask=ok, other=0.0).to(tl.float32)
    normed = _normalise(x, width, eps).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + col, mask=col_ok, other=0.0).to(tl.float32)
    scaled = weight[None, :] * normed
    if ROUND_PRODUCT:  # w and x share a 16-bit dtype: torch rounds w * normed to it
        scaled = scaled.to(dtype).to(tl.float32)
    gate_start = token.to(tl.int64) * stride_gate + head * stride_gate_head
    gate = tl.load(gate_ptr + gate_start[:, None] + col[None, :], mask=ok, other=0.0).to(tl.float32)
    out = scaled * (gate * tl.sigmoid(gate))
    tl.store(out_ptr + row.to(tl.int64)[:, None] * stride_out + col[None, :], out.to(dtype), mask=ok)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, width] with unit column stride (a view where the layout allows, e.g. q's chunk of q|gate)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(rows: int, width: int) -> tuple[tuple[int], dict[str, int]]:
    """Grid and block sizes: BR whole rows of padded width BN per program."""
    block_n = triton.next_power_of_2(width)
    block_r = max(1, TILE // block_n)
    warps = 8 if block_r * block_n >= 8192 else 4
    return (triton.cdiv(rows, block_r),), {"BR": block_r, "BN": block_n, "num_warps": warps}


def _norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor | None, torch.Tensor]:
    width = x.shape[-1]
    xs = _as_rows(x)
    out = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if delta is not None else None
    if xs.shape[0]:
        ds = _as_rows(delta) if delta is not None else xs
        sums = total.view(-1, width) if total is not None else xs  # never written without a delta
        outs = out.view(-1, width)
        grid, blocks = _launch(xs.shape[0], width)
        _rms_norm_kernel[grid](
            xs, ds, weight.contiguous(), sums, outs, xs.shape[0], width, eps, offset,
            xs.stride(0), ds.stride(0), sums.stride(0), outs.stride(0),
            HAS_DELTA=delta is not None, **blocks,
        )
    return total, out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 1.0) -> torch.Tensor:
    """The Triton kernel behind the contract of `rms_norm_reference` (x [..., width], weight [width])."""
    return _norm(x, None, weight, eps, offset)[1]


def add_rms_norm_triton(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel behind the contract of `add_rms_norm_reference` (x and delta of one shape)."""
    if delta.shape != x.shape:
        raise ValueError(f"add_rms_norm: delta {tuple(delta.shape)} {delta.dtype} vs x {tuple(x.shape)} {x.dtype}")
    return _norm(x, delta, weight, eps, offset)


def norm_add_triton(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 1.0,
    scale: torch.Tensor | None = None, next_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Triton kernel behind the contract of `norm_add_reference` (x and delta of one shape, scale [1])."""
    if delta.shape != x.shape:
        raise ValueError(f"norm_add: delta {tuple(delta.shape)} {delta.dtype} vs x {tuple(x.shape)} {x.dtype}")
    width = x.shape[-1]
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = None if next_weight is None else torch.empty(x.shape, dtype=next_weight.dtype, device=x.device)
    rows = total.numel() // max(width, 1)
    if rows:
        xs, ds, sums = _as_rows(x), _as_rows(delta), total.view(-1, width)
        outs = sums if out is None else out.view(-1, width)  # never written without a next norm
        grid, blocks = _launch(rows, width)
        _norm_add_kernel[grid](
            xs, ds, weight.contiguous(), weight if scale is None else scale,
            weight if next_weight is None else next_weight.contiguous(), sums, outs, rows, width, eps, offset,
            xs.stride(0), ds.stride(0), sums.stride(0), outs.stride(0),
            HAS_SCALE=scale is not None, HAS_NEXT=next_weight is not None, **blocks,
        )
    return total, out


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton kernel behind the contract of `gated_rms_norm_reference` (x and gate [..., width]).

    [T, H, D] inputs with unit last stride are read in place whatever their token and head strides (the Gated
    DeltaNet's z is a column block of the fused input projection: a reshape to [T * H, D] would copy it).
    """
    if gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm: gate {tuple(gate.shape)} vs x {tuple(x.shape)}")
    width = x.shape[-1]
    if x.dim() == 3 and x.stride(-1) == 1 and gate.stride(-1) == 1:
        heads, xs, gs = x.shape[1], x, gate
        strides = (x.stride(0), x.stride(1), gate.stride(0), gate.stride(1))
    else:
        heads, xs, gs = 1, _as_rows(x), _as_rows(gate)
        strides = (xs.stride(0), 0, gs.stride(0), 0)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = out.numel() // max(width, 1)
    if rows:
        outs = out.view(-1, width)
        grid, blocks = _launch(rows, width)
        _gated_rms_norm_kernel[grid](
            xs, gs, weight.contiguous(), outs, rows, width, eps, heads, *strides, outs.stride(0),
            ROUND_PRODUCT=weight.dtype == x.dtype, **blocks,
        )
    return out
