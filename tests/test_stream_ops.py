"""The flat-stream layout and the three reference stream ops, checked against per-prompt definitions.

For random rounds (trunks of 1, 63, 64, 65, 130 tokens; 1 to 16 branches), every op's output at a token
must equal the plain sequential computation on that token's standalone prompt (trunk + its branch).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flide_sdk.kernels.reference import (
    fork_attention_reference,
    gated_delta_reference,
    indexed_conv_reference,
    l2_normalize,
)
from flide_sdk.plan.layout import GDN_CHUNK, RequestSpec, plan_round

CONV = 4


def make_round(seed: int, trunk_lengths=(1, 63, 64, 65, 130), max_branches=16):
    rng = np.random.default_rng(seed)
    requests = []
    for trunk_len in trunk_lengths:
        branches = [rng.integers(0, 100, rng.integers(1, 70)) for _ in range(rng.integers(1, max_branches + 1))]
        requests.append(RequestSpec.of(rng.integers(0, 100, trunk_len), branches, [np.array([1, 2])] * len(branches)))
    return requests, plan_round(requests, CONV)


def prompts(requests, host):
    """(stream indices of trunk + branch) of every standalone prompt of the round."""
    out = []
    for request, (start, _) in zip(requests, host.plan.request_bounds):
        trunk = np.arange(start, start + len(request.trunk))
        cursor = trunk[-1] + 1
        for length in request.branches.lengths:
            out.append(np.concatenate([trunk, np.arange(cursor, cursor + length)]))
            cursor += length
    return out


def test_layout_metadata_matches_the_tree():
    requests, host = make_round(0)
    total = sum(r.num_tokens for r in requests)
    assert host.num_tokens == total
    visible = np.zeros((total, total), dtype=bool)
    for prompt in prompts(requests, host):
        for i, token in enumerate(prompt):
            visible[token, prompt[: i + 1]] = True
            assert host.positions[token] == i
            expected_src = [prompt[i - j] + 1 if i - j >= 0 else 0 for j in range(CONV - 1, -1, -1)]
            assert host.conv_src[token].tolist() == expected_src
    keys = np.arange(total)
    implied = (keys[None, :] >= host.key_lo[:, None]) & (keys[None, :] < host.ctx_hi[:, None]) | (
        (keys[None, :] >= host.seg_lo[:, None]) & (keys[None, :] <= keys[:, None])
    )
    assert np.array_equal(implied, visible)
    assert host.readout_rows.tolist() == [p[-1] for p in prompts(requests, host)]
    trunks, _, branches = host.levels
    for level in host.levels:
        assert all(a >= b for a, b in zip(level.active, level.active[1:]))
        assert level.chunk_tokens.shape == (sum(level.active), GDN_CHUNK)
    covered = np.concatenate([level.chunk_tokens.ravel() for level in host.levels])
    assert sorted(covered[covered < total].tolist()) == list(range(total))
    assert set(branches.init_row.tolist()) <= set(trunks.final_row.tolist())
    assert (branches.final_row == -1).all()


def _sequential_delta(q, k, v, g, beta):
    """Token-by-token gated delta rule in float64 (the definition)."""
    q = l2_normalize(q.double()) * q.shape[-1] ** -0.5
    k = l2_normalize(k.double())
    group = v.shape[1] // k.shape[1]
    q, k = q.repeat_interleave(group, 1), k.repeat_interleave(group, 1)
    state = torch.zeros(v.shape[1], k.shape[-1], v.shape[-1], dtype=torch.float64)
    out = torch.empty(v.shape, dtype=torch.float64)
    for t in range(v.shape[0]):
        state = state * g[t].double().exp()[:, None, None]
        delta = (v[t].double() - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t].double()[:, None]
        state = state + torch.einsum("hk,hv->hkv", k[t], delta)
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out, state


@pytest.mark.parametrize("seed", [0, 1])
def test_gated_delta_reference_forks_exactly(seed):
    requests, host = make_round(seed)
    rnd = host.to("cpu")
    gen = torch.Generator().manual_seed(seed)
    total, hk, hv, dk, dv = host.num_tokens, 2, 4, 16, 8
    q, k = torch.randn(total, hk, dk, generator=gen), torch.randn(total, hk, dk, generator=gen)
    v = torch.randn(total, hv, dv, generator=gen)
    g = -torch.rand(total, hv, generator=gen) * 0.3
    beta = torch.rand(total, hv, generator=gen)
    states = torch.zeros(rnd.delta.num_rows, hv, dk, dv)
    out = gated_delta_reference(q, k, v, g, beta, rnd.delta, states)
    for prompt in prompts(requests, host):
        expected, _ = _sequential_delta(q[prompt], k[prompt], v[prompt], g[prompt], beta[prompt])
        torch.testing.assert_close(out[prompt].double(), expected, rtol=1e-5, atol=1e-5)
    # each trunk's final state is in its slot
    for slot, (request, (start, _)) in enumerate(zip(requests, host.plan.request_bounds), start=1):
        trunk = slice(start, start + len(request.trunk))
        _, final = _sequential_delta(q[trunk], k[trunk], v[trunk], g[trunk], beta[trunk])
        torch.testing.assert_close(states[slot].double(), final, rtol=1e-5, atol=1e-5)


def test_indexed_conv_reference_matches_conv1d():
    requests, host = make_round(2)
    rnd = host.to("cpu")
    x = torch.randn(host.num_tokens, 12)
    weight = torch.randn(12, CONV)
    out = indexed_conv_reference(x, x.new_zeros(0, CONV - 1, 12), rnd.checkpoint.resume_slots, weight, rnd.conv_src)
    for prompt in prompts(requests, host):
        seq = x[prompt].t()[None]
        expected = F.silu(F.conv1d(seq, weight[:, None, :], padding=CONV - 1, groups=12)[..., : len(prompt)])[0].t()
        torch.testing.assert_close(out[prompt], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows_only", [False, True])
def test_fork_attention_reference_matches_causal_attention(rows_only):
    requests, host = make_round(3)
    rnd = host.to("cpu")
    total, heads, kv_heads, dim = host.num_tokens, 4, 2, 16
    q, k, v = torch.randn(total, heads, dim), torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    rows = rnd.readout.rows if rows_only else None
    empty = k.new_zeros(0, kv_heads, dim)
    out = fork_attention_reference(q[rows] if rows_only else q, k, v, rnd.attention, rows, empty, empty)
    position = {int(r): i for i, r in enumerate(rnd.readout.rows)} if rows_only else None
    for prompt in prompts(requests, host):
        kh = k[prompt].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        vh = v[prompt].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        expected = F.scaled_dot_product_attention(q[prompt].transpose(0, 1), kh, vh, is_causal=True).transpose(0, 1)
        if rows_only:
            torch.testing.assert_close(out[position[int(prompt[-1])]], expected[-1], rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(out[prompt], expected, rtol=1e-5, atol=1e-5)
