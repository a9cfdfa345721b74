"""Writing keys and values into the paged pool arenas: the Triton kernel (interpreter on CPU) against its
torch reference."""

from __future__ import annotations

import pytest
import torch

from flide_sdk.kernels.kv_store import store_kv_reference, store_kv_triton

SINK = 40  # the pool's sink position: every token that is not saved writes there


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("total", [0, 1, 37])
def test_store_kv_matches_reference(total: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(total)
    heads, dim = 2, 32
    k = torch.randn(total, heads, dim, generator=gen).to(dtype)
    qkv = torch.randn(total, heads, 3 * dim, generator=gen).to(dtype)
    v = qkv[..., dim : 2 * dim]  # a strided view, as the projection leaves values
    saved = torch.randperm(SINK, generator=gen)[:total]
    slots = torch.where(torch.rand(total, generator=gen) < 0.7, saved, torch.full_like(saved, SINK))
    caches = [torch.randn(SINK + 1, heads, dim, generator=gen).to(dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    store_kv_reference(k, v, *expected, slots)
    store_kv_triton(k, v, *caches, slots)
    real = torch.arange(SINK)  # the sink's content is unspecified (several tokens write it)
    assert torch.equal(caches[0][real], expected[0][real]) and torch.equal(caches[1][real], expected[1][real])
    if total:
        written = slots[slots < SINK]
        assert torch.equal(caches[0][written], k[slots < SINK])
        assert torch.equal(caches[1][written], v[slots < SINK])


def test_store_kv_rejects_mismatched_layouts():
    k = torch.randn(3, 2, 16)
    cache = torch.zeros(8, 2, 16)
    with pytest.raises(ValueError, match="share"):
        store_kv_triton(k, torch.randn(3, 2, 8), cache, cache.clone(), torch.arange(3))
