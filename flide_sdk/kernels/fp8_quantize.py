"""The per-token FP8 quantization of a projection's input as one kernel: `kernels.fp8.quantize_rows` (its definition)
costs torch six passes over a float32 copy of the tokens; here a program per token reads its row for the largest
|value|, then again (from L2) for the float8 values, and writes them with the row's scale. Bit-equal to the
definition: float32 arithmetic with correctly rounded divisions, round-to-nearest-even to float8_e4m3fn.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flide_sdk.kernels.fp8 import FP8, FP8_MAX, MIN_SCALE, Fp8Weight

QUANTIZE_BLOCK = 1024  # columns a program reads at a time (4 warps: 8 a thread)


@triton.jit
def _quantize_rows_kernel(x_ptr, values_ptr, scale_ptr, width, stride_x, FP8_MAX: tl.constexpr,
                          MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    largest = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < width, other=0.0).to(tl.float32)
        largest = tl.maximum(largest, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(largest, axis=0), FP8_MAX), MIN_SCALE)  # torch's rounding
    tl.store(scale_ptr + row, scale)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < width, other=0.0).to(tl.float32)
        scaled = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(values_ptr + row * width + cols, _on_e4m3_grid(scaled).to(values_ptr.dtype.element_ty),
                 mask=cols < width)


@triton.jit
def _on_e4m3_grid(v):
    """v (float32, |v| <= 448) rounded to nearest even at float8_e4m3fn's spacing, still float32: the cast that
    follows is exact. (Triton's interpreter rounds a cast that carries into the next power of two down.)"""
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    spacing_bits = (tl.maximum(exponent, -6) - 3 + 127) << 23  # 3 mantissa bits; subnormals below 2^-6
    magic = 1.5 * 8388608.0 * spacing_bits.to(tl.float32, bitcast=True)  # 1.5 * 2^23 spacings: adding rounds there
    rounded = (v + magic) - magic
    return tl.where(rounded == 0.0, v * 0.0, rounded)  # a zero keeps v's sign, as the cast does


def quantize_rows_triton(x: torch.Tensor) -> Fp8Weight:
    """`kernels.fp8.quantize_rows` of x [T, K] as one kernel, a program per row; bit-equal to it."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows_triton takes [T, K] tokens, got {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    tokens, width = x.shape
    values = torch.empty((tokens, width), dtype=FP8, device=x.device)
    scale = torch.empty(tokens, dtype=torch.float32, device=x.device)
    if tokens and width:
        _quantize_rows_kernel[(tokens,)](x, values, scale, width, x.stride(0), FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
                                          BLOCK=QUANTIZE_BLOCK)
    return Fp8Weight(values, scale)
