"""Attention's fused front (q/k norm + rotary at each token's position, contiguous k/v, k/v into the pool) as
one Triton launch (interpreter on CPU) against its definition."""

from __future__ import annotations

import pytest
import torch

from flide_sdk.kernels.attention_front import attention_front_triton
from flide_sdk.kernels.reference import attention_front_reference
from flide_sdk.kernels.rotary import rms_norm_rotary_triton
from flide_sdk.models.qwen35 import rotary_tables

from .test_kernels_norm import EPS
from .test_kernels_rotary import check_rotary

POSITIONS = 5000  # rows of the cos/sin tables


def front_inputs(tokens: int, heads: int, kv_heads: int, dim: int, rotary: int, dtype: torch.dtype, seed: int):
    """q as the strided half of a q|gate projection, k and v as column blocks of one fused projection (the
    model's views), weights, the tables of every position, positions, pool slots (several on one sink)."""
    g = torch.Generator().manual_seed(seed)
    q_gate = torch.randn(tokens, heads, 2 * dim, generator=g).to(dtype)
    fused = torch.randn(tokens, 2 * kv_heads * dim + 3, generator=g).to(dtype)
    k = fused[:, : kv_heads * dim].view(tokens, kv_heads, dim)
    v = fused[:, kv_heads * dim : 2 * kv_heads * dim].view(tokens, kv_heads, dim)
    weights = [(0.1 * torch.randn(dim, generator=g)).to(dtype) for _ in range(2)]
    cos, sin = rotary_tables(torch.arange(POSITIONS), rotary, 10_000_000.0, dtype)
    positions = torch.randint(0, POSITIONS, (tokens,), generator=g)
    slots = torch.randperm(3 * tokens, generator=g)[:tokens]
    slots[::3] = 3 * tokens  # the sink
    return q_gate[..., :dim], k, v, weights, cos, sin, positions, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "rotary"), [(4, 2, 32, 8), (8, 2, 256, 64), (2, 1, 80, 20)])
@pytest.mark.parametrize("readout", [False, True])
def test_front_matches_its_definition(dtype, heads, kv_heads, dim, rotary, readout):
    tokens = 37
    q, k, v, (q_weight, k_weight), cos, sin, positions, slots = front_inputs(tokens, heads, kv_heads, dim, rotary,
                                                                             dtype, heads + dim)
    rows = torch.tensor([3, 10, 11, 36]) if readout else None
    if readout:
        q = q[rows]
    caches = [torch.zeros(3 * tokens + 1, kv_heads, dim, dtype=dtype) for _ in range(4)]
    expected = attention_front_reference(q, k, v, q_weight, k_weight, EPS, cos, sin, positions, rows, *caches[:2],
                                         slots)
    got = attention_front_triton(q, k, v, q_weight, k_weight, EPS, cos, sin, positions, rows, *caches[2:], slots)
    q_positions = positions if rows is None else positions[rows]
    for out, x, weight, at in ((got[0], q, q_weight, q_positions), (got[1], k, k_weight, positions)):
        check_rotary(out, x, weight, cos[at], sin[at])
        # the same tile as the standalone kernel: bit for bit
        assert torch.equal(out, rms_norm_rotary_triton(x, weight, EPS, cos[at], sin[at]))
    assert torch.equal(got[2], expected[2]) and got[2].is_contiguous()
    saved = slots != 3 * tokens
    assert torch.equal(caches[2][slots[saved]], got[1][saved]) and torch.equal(caches[3][slots[saved]], v[saved])
    untouched = torch.ones(3 * tokens + 1, dtype=torch.bool)
    untouched[slots] = False
    assert not caches[2][untouched].any() and not caches[3][untouched].any()


def test_front_refuses_mismatched_inputs():
    q, k, v, (q_weight, k_weight), cos, sin, positions, slots = front_inputs(5, 4, 2, 32, 8, torch.float32, 0)
    cache = torch.zeros(16, 2, 32)
    with pytest.raises(ValueError, match="attention_front"):
        attention_front_triton(q, k, v[:, :1], q_weight, k_weight, EPS, cos, sin, positions, None, cache,
                               cache.clone(), slots)
    with pytest.raises(ValueError, match="caches must share a layout"):
        attention_front_triton(q, k, v, q_weight, k_weight, EPS, cos, sin, positions, None, cache,
                               torch.zeros(16, 2, 32, 2)[..., 0], slots)
