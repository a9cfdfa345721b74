"""The RMS-norm Triton kernels (interpreter on CPU) against their torch references."""

from __future__ import annotations

import pytest
import torch

from flide_sdk.kernels.reference import (
    add_rms_norm_reference,
    gated_rms_norm_reference,
    norm_add_reference,
    rms_norm_reference,
)
from flide_sdk.kernels.rms_norm import add_rms_norm_triton, gated_rms_norm_triton, norm_add_triton, rms_norm_triton

EPS = 1e-6
WIDTHS = [16, 64, 1000, 1024]  # 1000: a row narrower than its power-of-two block
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STEP = {torch.bfloat16: 2**-7, torch.float16: 2**-10}  # spacing of values relative to their size, at most


def inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale + 0.5).to(dtype)


def check(got: torch.Tensor, expected: torch.Tensor, roundings: int = 1) -> None:
    """float32: relative error <= 1e-5. 16-bit: each of the definition's `roundings` may land one step apart.

    Bit equality is not asked of bf16 outputs: Triton's interpreter rounds float32 -> bf16 casts toward zero
    (the GPU rounds to nearest even), up to one bf16 step (2^-7 relative) per cast. It rounds float16 casts to
    nearest, as torch does, so float16 outputs must be torch's bits, save ties moved by float32 noise in the
    sum of squares: that pins the cast order.
    """
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if expected.dtype == torch.float32:
        assert float((got - expected).norm() / expected.norm()) <= 1e-5
        return
    step = STEP[expected.dtype]
    if expected.dtype == torch.float16:
        assert float((got != expected).float().mean()) <= 1e-3
    got, expected = got.float(), expected.float()
    assert bool(((got - expected).abs() <= (roundings + 0.5) * step * expected.abs()).all())


def is_rounding_of(got: torch.Tensor, exact: torch.Tensor) -> bool:
    """Whether `got` is the float32 values `exact` rounded to got's dtype (bf16: to nearest or toward zero)."""
    nearest = exact.to(got.dtype)
    if got.dtype != torch.bfloat16:
        return torch.equal(got, nearest)
    toward_zero = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32).to(got.dtype)  # exact in bf16
    return bool(((got == nearest) | (got == toward_zero)).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm_matches_reference(width: int, dtype: torch.dtype):
    x = inputs((37, width), dtype, seed=width)
    weight = inputs((width,), dtype, seed=width + 1, scale=0.1)
    check(rms_norm_triton(x, weight, EPS), rms_norm_reference(x, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", WIDTHS)
def test_add_rms_norm_matches_reference(width: int, dtype: torch.dtype):
    x = inputs((29, width), dtype, seed=width)
    delta = inputs((29, width), dtype, seed=width + 2, scale=1.0)
    weight = inputs((width,), dtype, seed=width + 1, scale=0.1)
    total, normed = add_rms_norm_triton(x, delta, weight, EPS)
    expected_total, expected = add_rms_norm_reference(x, delta, weight, EPS)
    assert total.dtype == expected_total.dtype == dtype
    assert is_rounding_of(total, x.float() + delta.float())  # the residual stream: one float32 add, one rounding
    check(normed, expected, roundings=2)  # the sum, then the norm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", WIDTHS)
def test_gated_rms_norm_matches_reference(width: int, dtype: torch.dtype):
    x = inputs((3, 11, width), dtype, seed=width)  # [T, heads, Dv] as GatedDeltaNet calls it
    gate = inputs((3, 11, width), dtype, seed=width + 2, scale=2.0)
    weight = inputs((width,), dtype, seed=width + 1, scale=0.1) + 1.0
    check(gated_rms_norm_triton(x, gate, weight, EPS), gated_rms_norm_reference(x, gate, weight, EPS), roundings=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_rms_norm_reads_strided_heads_in_place(dtype: torch.dtype):
    """The gate as the Gated DeltaNet passes it: a column block of the fused projection viewed as [T, H, D]
    (token stride 3 H D, head stride D), which no [T * H, D] view can describe; x with a padded head stride."""
    tokens, heads, width = 7, 4, 64
    projection = inputs((tokens, 3 * heads * width), dtype, seed=31)
    gate = projection[:, heads * width : 2 * heads * width].view(tokens, heads, width)
    x = inputs((tokens, heads, 2 * width), dtype, seed=32)[..., :width]
    assert gate.stride() == (3 * heads * width, width, 1) and x.stride() == (2 * heads * width, 2 * width, 1)
    weight = inputs((width,), dtype, seed=33, scale=0.1) + 1.0
    got = gated_rms_norm_triton(x, gate, weight, EPS)
    assert got.is_contiguous()
    check(got, gated_rms_norm_reference(x, gate, weight, EPS), roundings=3)


def test_gated_rms_norm_float32_weight_on_bf16_rows():
    """A float32 weight makes torch keep w * normed in float32: one rounding fewer than with a bf16 weight."""
    x, gate = inputs((9, 128), torch.bfloat16, seed=1), inputs((9, 128), torch.bfloat16, seed=2)
    weight = inputs((128,), torch.float32, seed=3, scale=0.1) + 1.0
    check(gated_rms_norm_triton(x, gate, weight, EPS), gated_rms_norm_reference(x, gate, weight, EPS), roundings=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_on_strided_head_views(dtype: torch.dtype):
    """q/k norms: rows are the heads of a [T, H, D] view, here the q half of attention's q|gate projection."""
    heads, dim = 4, 64
    projected = inputs((13, heads, 2 * dim), dtype, seed=7)
    q, _ = projected.chunk(2, dim=-1)
    assert not q.is_contiguous()
    weight = inputs((dim,), dtype, seed=8, scale=0.1)
    got = rms_norm_triton(q, weight, EPS)
    assert got.shape == q.shape
    check(got, rms_norm_reference(q, weight, EPS))


def test_wide_rows_and_empty_inputs():
    x = inputs((5, 5120), torch.float32, seed=11)  # the widest hidden size: one row per program
    delta = inputs((5, 5120), torch.float32, seed=12)
    weight = inputs((5120,), torch.float32, seed=13, scale=0.1)
    check(rms_norm_triton(x, weight, EPS), rms_norm_reference(x, weight, EPS))
    total, normed = add_rms_norm_triton(x, delta, weight, EPS)
    assert torch.equal(total, x + delta)
    check(normed, rms_norm_reference(x + delta, weight, EPS))
    empty = x[:0]
    assert rms_norm_triton(empty, weight, EPS).shape == (0, 5120)
    assert add_rms_norm_triton(empty, empty, weight, EPS)[1].shape == (0, 5120)
    assert gated_rms_norm_triton(empty, empty, weight, EPS).shape == (0, 5120)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_float32_residual_stream_with_16_bit_delta_and_weight(dtype: torch.dtype):
    """The decoder's float32 residual stream: the sum stays float32 (no rounding to the 16-bit delta), the
    normed output comes out in the weight's (compute) dtype."""
    x = inputs((9, 1024), torch.float32, seed=21)
    delta = inputs((9, 1024), dtype, seed=22)
    weight = inputs((1024,), dtype, seed=23, scale=0.1)
    total, normed = add_rms_norm_triton(x, delta, weight, EPS)
    expected_total, expected = add_rms_norm_reference(x, delta, weight, EPS)
    assert total.dtype == torch.float32 and torch.equal(total, x + delta.float())
    assert torch.equal(expected_total, total)
    check(normed, expected)
    alone = rms_norm_triton(x, weight, EPS)
    assert alone.dtype == dtype
    check(alone, rms_norm_reference(x, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("then_norm", [False, True], ids=["alone", "then-norm"])
def test_norm_add_matches_reference(dtype: torch.dtype, scaled: bool, then_norm: bool):
    """Gemma 4's sandwich: the float32 residual stream plus a sublayer's output normed in the compute dtype, times
    the layer scalar, then the next sublayer's norm. The sum may differ from the reference only by the normed
    delta's rounding (the interpreter's bf16 casts round toward zero), never by a rounding of the stream."""
    width = 1000
    x = inputs((21, width), torch.float32, seed=41)
    delta = inputs((21, width), dtype, seed=42)
    weight = inputs((width,), dtype, seed=43, scale=0.1) + 1.0
    scale = inputs((1,), dtype, seed=44, scale=0.3) if scaled else None
    following = inputs((width,), dtype, seed=45, scale=0.1) + 1.0 if then_norm else None
    total, normed = norm_add_triton(x, delta, weight, EPS, offset=0.0, scale=scale, next_weight=following)
    expected_total, expected = norm_add_reference(x, delta, weight, EPS, offset=0.0, scale=scale,
                                                  next_weight=following)
    assert total.dtype == expected_total.dtype == torch.float32
    normed_delta = rms_norm_reference(delta, weight, EPS, offset=0.0).float().abs()
    factor = 1.0 if scale is None else float(scale.float().abs())
    step = STEP.get(dtype, 0.0)
    bound = factor * (1.5 * step * normed_delta + 1e-6 * (x.abs() + normed_delta))
    assert bool(((total - expected_total).abs() <= bound).all())
    if dtype == torch.float16:  # rounded to nearest, as torch rounds: its bits, save ties moved by float32 noise
        assert float((total != expected_total).float().mean()) <= 1e-3
    if following is None:
        assert normed is None and expected is None
    else:
        assert expected is not None and normed.dtype == dtype
        check(normed, rms_norm_reference(total, following, EPS, offset=0.0))  # the next norm of the sum returned


def test_norm_add_of_two_16_bit_terms():
    """Two sublayer outputs summed in the compute dtype (a routed-experts block's dense and routed halves): the
    sum is rounded to bf16 once, as torch rounds a bf16 add."""
    x = inputs((9, 256), torch.bfloat16, seed=51)
    delta = inputs((9, 256), torch.bfloat16, seed=52)
    weight = inputs((256,), torch.bfloat16, seed=53, scale=0.1) + 1.0
    total, normed = norm_add_triton(x, delta, weight, EPS, offset=0.0)
    expected_total, _ = norm_add_reference(x, delta, weight, EPS, offset=0.0)
    assert normed is None and total.dtype == torch.bfloat16
    step = STEP[torch.bfloat16]  # the normed delta's rounding, then the sum's
    normed_delta = rms_norm_reference(delta, weight, EPS, offset=0.0).float().abs()
    gap = (total.float() - expected_total.float()).abs()
    assert bool((gap <= 1.5 * step * (normed_delta + expected_total.float().abs())).all())
    empty = x[:0]
    assert norm_add_triton(empty, empty, weight, EPS, next_weight=weight)[1].shape == (0, 256)
