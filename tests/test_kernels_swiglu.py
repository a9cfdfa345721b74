"""The SwiGLU Triton kernel (interpreter on CPU) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from flide_sdk.kernels.reference import geglu_reference, swiglu_reference
from flide_sdk.kernels.swiglu import BLOCK_I, BLOCK_T, geglu_triton, swiglu_triton

from .test_kernels_norm import DTYPES, check, inputs


def gate_up(tokens: int, width: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up as the fused gate|up GEMM leaves them: column blocks of one [T, 2I] output."""
    gate, up = inputs((tokens, 2 * width), dtype, seed=seed).split(width, dim=-1)
    return gate, up


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [16, 300, 2 * BLOCK_I])  # 300: a partial column block
def test_swiglu_matches_reference_on_strided_halves(width: int, dtype: torch.dtype):
    tokens = 3 * BLOCK_T + 5  # a partial token block
    gate, up = gate_up(tokens, width, dtype, seed=width)
    assert not gate.is_contiguous() and not up.is_contiguous()
    got = swiglu_triton(gate, up)
    assert got.is_contiguous()
    check(got, swiglu_reference(gate, up), roundings=2)  # silu, then the product (float16: torch's bits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [16, 300])
def test_geglu_matches_reference_on_strided_halves(width: int, dtype: torch.dtype):
    """Gemma 4's GeGLU (gelu's tanh approximation) through the same kernel. Mutations caught: the exact (erf)
    gelu, the cubic's 0.044715 dropped, silu in its place."""
    gate, up = gate_up(3 * BLOCK_T + 5, width, dtype, seed=width + 1)
    gate = (gate * 3.0).clamp(-3.0, 3.0)  # the tanh's middle and its tails (deeper, torch's 1 + tanh(y) is noise)
    got = geglu_triton(gate, up)
    check(got, geglu_reference(gate, up), roundings=2)
    assert (got.float() - swiglu_reference(gate, up).float()).abs().max() > 1e-2


def test_swiglu_other_layouts_empty_rounds_and_mismatched_halves():
    gate = inputs((64, 24), torch.float32, seed=5).t()  # unit stride along tokens: copied to rows first
    up = inputs((24, 100), torch.float32, seed=6)[:, 10:74]  # a row stride of its own
    check(swiglu_triton(gate, up), swiglu_reference(gate, up))
    empty_gate, empty_up = gate_up(0, 300, torch.bfloat16, seed=7)
    got = swiglu_triton(empty_gate, empty_up)
    assert got.shape == (0, 300) and got.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        swiglu_triton(gate, up[:, :10])
