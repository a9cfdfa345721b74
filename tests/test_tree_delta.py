"""The tree WY transform of the gated delta rule (`tree_delta_reference`): every token of a chunk whose tokens
form a tree, from one triangular solve, against the per-token recurrence along each token's own path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flide_sdk.kernels.plans import DeltaLevel, DeltaPlan
from flide_sdk.kernels.reference import gated_delta_reference, l2_normalize, tree_delta_reference, tree_state_reference

HEADS, DK, DV = 2, 16, 8


def random_tree(rng: np.random.Generator, depth: int, fan_out: int, limit: int = 64) -> np.ndarray:
    """Parents in DFS pre-order of a random tree of at most `limit` tokens, paths of at most `depth` tokens
    and up to `fan_out` children a token (the start state's children included)."""
    parents: list[int] = []

    def grow(node: int, level: int) -> None:
        for _ in range(rng.integers(1, fan_out + 1)):
            if len(parents) >= limit or level >= depth:
                return
            parents.append(node)
            grow(len(parents) - 1, level + 1)

    grow(-1, 0)
    return np.array(parents, dtype=np.int64)


def chunk_inputs(n: int, seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(n, HEADS, DK, generator=gen, dtype=torch.float64)) * DK**-0.5
    k = l2_normalize(torch.randn(n, HEADS, DK, generator=gen, dtype=torch.float64))
    v = torch.randn(n, HEADS, DV, generator=gen, dtype=torch.float64)
    g = -torch.rand(n, HEADS, generator=gen, dtype=torch.float64) * 0.5
    beta = torch.rand(n, HEADS, generator=gen, dtype=torch.float64)
    state = torch.randn(HEADS, DK, DV, generator=gen, dtype=torch.float64) * 0.5
    return tuple(x.to(dtype) for x in (q, k, v, g, beta, state))


def recurrence(q, k, v, g, beta, parent, state):
    """Token by token along each path: S = exp(g) S_parent; S += k (beta (v - S^T k))^T; o = S^T q."""
    outputs, states = [], []
    for t in range(len(parent)):
        s = (state if parent[t] < 0 else states[parent[t]]) * g[t].exp()[:, None, None]
        corrected = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, k[t]))
        s = s + k[t][:, :, None] * corrected[:, None, :]
        states.append(s)
        outputs.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(outputs), states


TREES = [(depth, fan_out, seed) for seed, (depth, fan_out) in enumerate(
    [(1, 1), (1, 16), (2, 4), (3, 3), (4, 2), (6, 1), (6, 2), (5, 16), (6, 16), (2, 16)])]


@pytest.mark.parametrize(("depth", "fan_out", "seed"), TREES)
def test_tree_solve_equals_the_recurrence_along_each_path(depth, fan_out, seed):
    rng = np.random.default_rng(seed)
    parent = torch.as_tensor(random_tree(rng, depth, fan_out))
    inputs = chunk_inputs(len(parent), seed, torch.float64)
    expected, states = recurrence(*inputs[:5], parent, inputs[5])
    got, pseudo = tree_delta_reference(*inputs[:5], parent, inputs[5])
    assert (got - expected).abs().max() <= 1e-12
    k, g = inputs[1], inputs[3]
    for node in rng.choice(len(parent), size=min(5, len(parent)), replace=False):  # states rebuilt on demand
        assert (tree_state_reference(k, g, parent, pseudo, inputs[5], int(node)) - states[node]).abs().max() <= 1e-12
    inputs32 = chunk_inputs(len(parent), seed, torch.float32)
    chained, _ = recurrence(*inputs32[:5], parent, inputs32[5])
    solved, _ = tree_delta_reference(*inputs32[:5], parent, inputs32[5])
    assert (solved - chained).abs().max() <= 1e-6 * chained.abs().max()


def test_a_chain_is_the_chunked_rule():
    """A tree without forks is one segment of the chunked gated delta rule (`gated_delta_reference`)."""
    n = 40
    parent = torch.arange(-1, n - 1)
    q, k, v, g, beta, state = chunk_inputs(n, 3, torch.float64)
    got, _ = tree_delta_reference(q, k, v, g, beta, parent, state)
    tokens = torch.cat([torch.arange(n), torch.full((64 - n,), n)])[None]
    level = DeltaLevel(tokens, [1], torch.tensor([0]), torch.tensor([-1]), torch.tensor([1]), torch.tensor([0]),
                       torch.tensor([-1]), torch.tensor([1, 1]))
    states = state[None].clone()
    # the chunked rule normalises and scales q itself
    expected = gated_delta_reference(q.float() * DK**0.5, k.float(), v.float(), g.float(), beta.float(),
                                     DeltaPlan([level], 1, torch.zeros(n, dtype=torch.int64)), states.float())
    assert (got.float() - expected).abs().max() <= 1e-5


def test_siblings_do_not_see_each_other():
    """Mutation guard: reading the DFS order as one chain (a causal mask instead of the ancestor mask) changes
    the tokens after the first fork, so the tests above tell the two apart."""
    parent = torch.tensor([-1, 0, 1, 1, 0, 4, -1])  # two forks and a second root
    inputs = chunk_inputs(len(parent), 11, torch.float64)
    tree, _ = tree_delta_reference(*inputs[:5], parent, inputs[5])
    chain, _ = tree_delta_reference(*inputs[:5], torch.arange(-1, len(parent) - 1), inputs[5])
    assert (tree[:3] - chain[:3]).abs().max() <= 1e-12  # a path from the start: the same tokens before the fork
    assert (tree[3:] - chain[3:]).abs().max() > 1e-3
