"""The fused q/k RMS norm + partial rotary Triton kernel (interpreter on CPU) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from flide_sdk.kernels.reference import rms_norm_reference, rms_norm_rotary_reference
from flide_sdk.kernels.rotary import rms_norm_rotary_triton
from flide_sdk.models.qwen35 import rotary_tables

from .test_kernels_norm import DTYPES, EPS, STEP, check, inputs

SHAPES = [(4, 32, 8), (2, 256, 64), (3, 80, 20), (2, 64, 64)]  # (heads, D, R): tiny, 0.8B, padded, full rotary


def tables(tokens: int, rotary: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 40_000, (tokens,), generator=torch.Generator().manual_seed(seed))
    return rotary_tables(positions, rotary, 10_000_000.0, dtype)


def check_rotary(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """float32: relative error <= 1e-5. 16-bit: the definition rounds the norm, both products and their sum.

    Each rounding may land one step apart (the interpreter rounds bf16 toward zero), so a rotated channel is
    bounded by steps of its two terms' magnitudes: their sum may cancel, which bounds relative to the result
    could not allow. float16 (rounded to nearest, as by torch) must be torch's bits but for rare ties.
    """
    expected = rms_norm_rotary_reference(x, weight, EPS, cos, sin)
    assert got.dtype == expected.dtype == weight.dtype and got.shape == expected.shape and got.is_contiguous()
    if expected.dtype == torch.float32:
        check(got, expected)
        return
    if expected.dtype == torch.float16:
        assert float((got != expected).float().mean()) <= 1e-3
    rot, half = cos.shape[-1], cos.shape[-1] // 2
    normed = rms_norm_reference(x, weight, EPS).float()
    scale = normed.abs()
    partner = torch.cat([normed[..., half:rot], normed[..., :half]], dim=-1)
    scale[..., :rot] = (normed[..., :rot] * cos.float()[:, None]).abs() + (partner * sin.float()[:, None]).abs()
    assert bool(((got.float() - expected.float()).abs() <= 3.5 * STEP[expected.dtype] * scale).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "dim", "rotary"), SHAPES)
def test_queries_from_the_q_gate_projection(heads: int, dim: int, rotary: int, dtype: torch.dtype):
    """q: the first half of each head's q|gate columns, a [T, H, D] view with a head stride of 2D."""
    tokens = 13
    q, _ = inputs((tokens, heads, 2 * dim), dtype, seed=dim).chunk(2, dim=-1)
    assert not q.is_contiguous()
    weight = inputs((dim,), dtype, seed=dim + 1, scale=0.1)
    cos, sin = tables(tokens, rotary, dtype, seed=dim + 2)
    check_rotary(rms_norm_rotary_triton(q, weight, EPS, cos, sin), q, weight, cos, sin)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_keys_from_the_fused_qkv_projection(dtype: torch.dtype):
    """k: a column block of the fused q|k|v output viewed as heads, a [T, H, D] view with a wide token stride."""
    tokens, heads, dim, rotary = 29, 2, 256, 64
    _, k, _ = inputs((tokens, 5 * heads * dim), dtype, seed=3).split([3 * heads * dim, heads * dim, heads * dim], -1)
    k = k.view(tokens, heads, dim)
    weight = inputs((dim,), dtype, seed=4, scale=0.1)
    cos, sin = tables(tokens, rotary, dtype, seed=5)
    check_rotary(rms_norm_rotary_triton(k, weight, EPS, cos, sin), k, weight, cos, sin)


def test_reference_is_transformers_rotary_bit_for_bit():
    """The definition, rounding for rounding, is transformers' apply_rotary_pos_emb on the normed heads."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    tokens, heads, dim, rotary = 11, 3, 256, 64
    x = inputs((tokens, heads, dim), torch.bfloat16, seed=6)
    weight = inputs((dim,), torch.bfloat16, seed=7, scale=0.1)
    cos, sin = tables(tokens, rotary, torch.bfloat16, seed=8)
    normed = rms_norm_reference(x, weight, EPS).transpose(0, 1)[None]  # [1, H, T, D]
    theirs, _ = apply_rotary_pos_emb(normed, normed, cos[None], sin[None])
    assert torch.equal(rms_norm_rotary_reference(x, weight, EPS, cos, sin), theirs[0].transpose(0, 1))


def test_empty_rounds_and_mismatched_tables():
    weight = inputs((64,), torch.bfloat16, seed=9, scale=0.1)
    cos, sin = tables(0, 16, torch.bfloat16, seed=10)
    got = rms_norm_rotary_triton(torch.zeros(0, 4, 64, dtype=torch.bfloat16), weight, EPS, cos, sin)
    assert got.shape == (0, 4, 64) and got.dtype == torch.bfloat16
    x = inputs((5, 4, 64), torch.bfloat16, seed=11)
    cos, sin = tables(5, 16, torch.float32, seed=12)
    with pytest.raises(ValueError):
        rms_norm_rotary_triton(x, weight, EPS, cos, sin)
