"""The Gated DeltaNet gates Triton kernel (interpreter on CPU) against its torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flide_sdk.kernels.gdn_gates import gdn_gates_triton
from flide_sdk.kernels.reference import gdn_gates_reference

from .test_kernels_norm import DTYPES, check, inputs


def projections(tokens: int, heads: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """b and a as the fused input projection leaves them: column blocks of one wider output."""
    projected = inputs((tokens, 3 * heads + 7), dtype, seed=seed)
    return projected[:, 5 : 5 + heads], projected[:, 5 + heads : 5 + 2 * heads]


def head_parameters(heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A_log and dt_bias, kept in float32 as the checkpoint loader keeps them."""
    return inputs((heads,), torch.float32, seed=seed, scale=1.0), inputs((heads,), torch.float32, seed=seed + 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [4, 5, 32])  # 5: a padded head block
def test_gdn_gates_match_reference(heads: int, dtype: torch.dtype):
    b, a = projections(301, heads, dtype, seed=heads)  # 301 tokens: a partial token block
    A_log, dt_bias = head_parameters(heads, seed=heads + 1)
    g, beta = gdn_gates_triton(a, b, A_log, dt_bias)
    expected_g, expected_beta = gdn_gates_reference(a, b, A_log, dt_bias)
    assert g.dtype == beta.dtype == torch.float32 and g.shape == beta.shape == (301, heads)
    check(g, expected_g)
    if dtype == torch.float32:
        check(beta, expected_beta)
    else:  # sigmoid in b's dtype: the values are that dtype's, one rounding of the float32 sigmoid
        assert torch.equal(beta, beta.to(dtype).float())
        check(beta.to(dtype), expected_beta.to(dtype))


def test_softplus_over_its_whole_range_and_threshold():
    """softplus(x) to float32 precision: far below zero (where 1 + e^x rounds e^x away), above torch's
    threshold of 20 (x itself, where e^x overflows past 88) and around the threshold."""
    x = torch.cat([torch.linspace(-60, -5, 56), torch.linspace(-5, 5, 41), torch.linspace(19, 21, 41),
                   torch.tensor([30.0, 88.0, 89.0, 100.0, 1e4])])
    a = x[:, None].repeat(1, 3)
    A_log = torch.tensor([-1.0, 0.0, 1.5])
    dt_bias = torch.zeros(3)
    g, _ = gdn_gates_triton(a, torch.zeros_like(a), A_log, dt_bias)
    expected, _ = gdn_gates_reference(a, torch.zeros_like(a), A_log, dt_bias)
    assert torch.allclose(g, expected, rtol=1e-5, atol=0)
    above = x > 20
    assert torch.equal(F.softplus(x)[above], x[above])  # torch's threshold branch, which the kernel must meet
    assert torch.allclose(g[above], -A_log.exp() * a[above], rtol=1e-6, atol=0)


def test_gdn_gates_of_an_empty_round():
    b, a = projections(0, 4, torch.bfloat16, seed=1)
    g, beta = gdn_gates_triton(a, b, *head_parameters(4, seed=2))
    assert g.shape == beta.shape == (0, 4) and g.dtype == beta.dtype == torch.float32
