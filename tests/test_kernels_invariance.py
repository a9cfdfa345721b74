"""The Triton kernels in the batch-invariant mode (interpreter on CPU): a row, a branch or a segment has the same
bits alone as inside larger launches, and the default attention tiling shows it can be otherwise."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flide_sdk.kernels.attention_front import attention_front_triton
from flide_sdk.kernels.fork_attention import attention_tiles, fork_attention_config, fork_attention_triton
from flide_sdk.kernels.gated_delta import gated_delta_triton
from flide_sdk.kernels.gdn_front import gdn_front_triton
from flide_sdk.kernels.label_softmax import label_log_softmax_triton
from flide_sdk.kernels.matmul import MATMUL, MATMUL_FLOAT32, RowCountLinear, linear_triton
from flide_sdk.kernels.rms_norm import add_rms_norm_triton, gated_rms_norm_triton, rms_norm_triton
from flide_sdk.kernels.swiglu import swiglu_triton
from flide_sdk.models.qwen35 import rotary_tables
from flide_sdk.plan.layout import PAGE, RequestSpec, Resume, plan_round

from .test_kernels_gated_delta import random_inputs

SLICES = [(0, 1), (5, 6), (7, 40), (100, 229), (0, 300)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_linear_rows_alone_and_in_larger_launches(dtype):
    """Rows keep their bits whatever the launch's row count. The slices keep each row's place in its tile: the
    interpreter's numpy product depends on it, where the GPU's MMA computes every element alike (and the
    interpreter's bfloat16 products are wrong: bfloat16 runs on the GPU only, `benchmarks/invariance.py`)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 96, generator=gen).to(dtype)
    weight = torch.randn(80, 96, generator=gen).to(dtype)
    full = linear_triton(x, weight)
    block = (MATMUL_FLOAT32 if dtype == torch.float32 else MATMUL).block_rows
    for lo, hi in [(0, 1), (0, 37), (block, block + 1), (block, 300), (0, 300)]:
        assert torch.equal(linear_triton(x[lo:hi], weight), full[lo:hi]), (lo, hi)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(full.float(), F.linear(x.float(), weight.float()), rtol=tolerance, atol=tolerance * 10)


def test_per_token_kernels_rows_alone_and_in_larger_launches():
    gen = torch.Generator().manual_seed(1)
    x, delta, gate = (torch.randn(300, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    weight = torch.randn(64, generator=gen).to(torch.bfloat16)
    head = torch.randn(50, 64, generator=gen)
    labels = torch.randint(0, 50, (300, 5), generator=gen)
    labels[::3, 3:] = -1  # questions of fewer labels beside wider ones
    kernels = {
        "rms_norm": lambda s: rms_norm_triton(x[s], weight, 1e-6),
        "add_rms_norm": lambda s: add_rms_norm_triton(x[s].float(), delta[s], weight, 1e-6)[1],
        "gated_rms_norm": lambda s: gated_rms_norm_triton(x[s].view(-1, 4, 16), gate[s].view(-1, 4, 16),
                                                          weight[:16], 1e-6),
        "swiglu": lambda s: swiglu_triton(x[s], gate[s]),
        "label_softmax": lambda s: label_log_softmax_triton(x[s].float(), head, labels[s]),
        "label_softmax_narrow": lambda s: label_log_softmax_triton(x[s].float(), head, labels[s, :3]),
    }
    for name, run in kernels.items():
        full = run(slice(0, 300))
        for lo, hi in SLICES:
            assert torch.equal(run(slice(lo, hi)), full[lo:hi]), (name, lo, hi)
    # a question's probabilities do not depend on the round's label width
    wide = kernels["label_softmax"](slice(0, 300))[::3, :3]
    assert (labels[::3, 3:] == -1).all() and torch.equal(label_log_softmax_triton(x[::3].float(), head, labels[::3, :3]), wide)


def attention_round(branch_counts: list[int], seed: int = 0):
    """Request 0: a trunk of 150 tokens after a 128-token history and branches of 9..33 tokens (the first
    `branch_counts[0]`; its branch 0 always the same); further requests with other trunks."""
    rng = np.random.default_rng(seed)
    mine = [rng.integers(0, 50, n) for n in (17, 9, 33, 20, 12)]
    requests = [RequestSpec.of(rng.integers(0, 50, 150), mine[: branch_counts[0]], [np.array([1])] * branch_counts[0],
                               start=128, resume=Resume(0, np.array([3, 1])))]
    for count in branch_counts[1:]:
        branches = [rng.integers(0, 50, rng.integers(1, 40)) for _ in range(count)]
        requests.append(RequestSpec.of(rng.integers(0, 50, rng.integers(1, 200)), branches, [np.array([1])] * count))
    return plan_round(requests, 4).to("cpu")


def attention_rows_of_first_branch(rnd, config) -> torch.Tensor:
    """Attention of request 0's trunk and first branch, its keys and queries a function of position alone."""
    gen = torch.Generator().manual_seed(5)
    total = rnd.ids.shape[0]
    table = torch.randn(4096, 3, 32, generator=gen)  # per position: q (2 heads), k, v
    position = rnd.positions
    q, k, v = table[position, :2], table[position, 2:], table[position + 1, 2:]
    k_cache, v_cache = table[:PAGE * 4, 2:].clone(), table[1 : PAGE * 4 + 1, 2:].clone()
    plan = attention_tiles(rnd.attention, None, 2, 1, 32, torch.float32, config)
    out = fork_attention_triton(q, k, v, plan, None, k_cache, v_cache, config=config)
    start, end = rnd.attention.request_bounds[0]
    first_branch_end = start + 150 + 17
    assert end >= first_branch_end and total >= end
    return out[start:first_branch_end]


def test_attention_branch_alone_and_among_siblings_and_other_requests():
    """A trunk and its first branch: the same bits asked alone and forked with siblings in a round of other
    requests with piece tiles and unsplit keys; the default tiling (tiles across branches) differs."""
    invariant = fork_attention_config(torch.float32, batch_invariant=True, head_dim=32)
    default = fork_attention_config(torch.float32, head_dim=32)
    alone, crowded = attention_round([1]), attention_round([5, 3, 1, 4])
    assert torch.equal(attention_rows_of_first_branch(alone, invariant),
                       attention_rows_of_first_branch(crowded, invariant))
    tight = dataclasses.replace(default, min_split_keys=PAGE, extra_items=4)
    assert not torch.equal(attention_rows_of_first_branch(alone, tight),
                           attention_rows_of_first_branch(crowded, tight)), "guard: the default tiling differs"


def test_gated_delta_segment_alone_and_in_larger_rounds():
    """Request 0's trunk (two chunks and a part) and its first branch: the same output bits and final state
    alone (a fused round) and in a round of four requests with many branches (unfused)."""
    rng = np.random.default_rng(2)
    trunk, branch = rng.integers(0, 100, 150), rng.integers(0, 100, 30)

    def outputs(extra: int) -> torch.Tensor:
        requests = [RequestSpec.of(trunk, [branch] + [rng.integers(0, 100, 20)] * extra, [np.array([1])] * (1 + extra))]
        for _ in range(3 if extra else 0):
            requests.append(RequestSpec.of(rng.integers(0, 100, 70), [rng.integers(0, 100, 9)] * 5, [np.array([1])] * 5))
        rnd = plan_round(requests, 4).to("cpu")
        total = rnd.ids.shape[0]
        q, k, v, g, beta, _ = random_inputs(3, 4096, 1, 1, 16, 32)
        position = rnd.positions + torch.where(torch.arange(total) >= 150, 1000, 0)  # the branch's own inputs
        states = torch.zeros(rnd.delta.num_rows, 2, 16, 32)
        out = gated_delta_triton(q[position], k[position], v[position], g[position], beta[position], rnd.delta, states)
        return out[: 150 + 30]

    assert torch.equal(outputs(0), outputs(6))


def test_row_count_linear_runs_every_row_count_at_a_checked_one():
    """cuBLAS (here: torch's CPU product) only at the checked row counts: others padded up to the next one or
    cut into chunks of the largest, so a row's product is one of those; other shapes take the fixed-tile
    kernel."""
    gen = torch.Generator().manual_seed(4)
    x, weight, other = torch.randn(20, 48, generator=gen), torch.randn(24, 48, generator=gen), torch.randn(8, 48)
    linear = RowCountLinear((2, 4, 8), {(24, 48): 4})  # row counts from 4 only

    def at(rows: int, count: int) -> torch.Tensor:
        padded = torch.zeros(count, 48)
        padded[:rows] = x[:rows]
        return F.linear(padded, weight)[:rows]

    assert torch.equal(linear(x[:8], weight), F.linear(x[:8], weight))
    assert torch.equal(linear(x[:1], weight), at(1, 4)) and torch.equal(linear(x[:2], weight), at(2, 4))
    assert torch.equal(linear(x[:3], weight), at(3, 4)) and torch.equal(linear(x[:6], weight), at(6, 8))
    last = F.linear(torch.cat([x[16:20], torch.zeros(4, 48)]), weight)[:4]
    chunks = torch.cat([F.linear(x[0:8], weight), F.linear(x[8:16], weight), last])
    assert torch.equal(linear(x, weight), chunks)
    assert torch.equal(linear(x, other), linear_triton(x, other))


def rounds_with_and_without_others() -> tuple:
    """The same request (a 150-token trunk and two branches) alone and after three other requests."""
    rng = np.random.default_rng(6)
    mine = RequestSpec.of(rng.integers(0, 100, 150), [rng.integers(0, 100, 30), rng.integers(0, 100, 9)],
                          [np.array([1])] * 2)
    others = [RequestSpec.of(rng.integers(0, 100, n), [rng.integers(0, 100, 12)] * 3, [np.array([1])] * 3)
              for n in (70, 5, 130)]
    return plan_round([mine], 4).to("cpu"), plan_round(others + [mine], 4).to("cpu")


def per_token(rnd, width: int, seed: int) -> torch.Tensor:
    """Rows that depend only on each token's id and position (the request's rows are the same in both rounds)."""
    gen = torch.Generator().manual_seed(seed)
    by_id, by_position = torch.randn(100, width, generator=gen), torch.randn(4096, width, generator=gen)
    return by_id[rnd.ids] + by_position[rnd.positions]


def test_front_kernels_rows_of_a_request_alone_and_after_others():
    """The Gated DeltaNet front (conv, gates) and attention's front (norms, rotary) give the request's tokens
    the same bits alone and behind other requests."""
    alone, crowded = rounds_with_and_without_others()
    span = [slice(*rnd.attention.request_bounds[-1]) for rnd in (alone, crowded)]
    gen = torch.Generator().manual_seed(8)
    weight, A_log, dt_bias = torch.randn(64, 4, generator=gen), torch.randn(2, generator=gen), torch.randn(2)
    cos, sin = rotary_tables(torch.arange(4096), 8, 10000.0, torch.float32)
    norms = [torch.randn(32, generator=gen) * 0.1 for _ in range(2)]
    outputs = []
    for rnd in (alone, crowded):
        rows = per_token(rnd, 196, seed=9)  # conv inputs, a, b, then q (two heads), k and v (one head)
        tokens = rows.shape[0]
        qkv, a, b = rows[:, :64], rows[:, 64:66], rows[:, 66:68]
        q, k, v = rows[:, 68:132].view(tokens, 2, 32), rows[:, 132:164].view(tokens, 1, 32), rows[:, 164:].view(tokens, 1, 32)
        windows = torch.zeros(4, 3, 64)
        plan = rnd.checkpoint
        front = gdn_front_triton(qkv, a, b, weight, A_log, dt_bias, windows, plan.resume_slots, rnd.conv_src,
                                 plan.save_slots, plan.save_window_src)
        caches = torch.zeros(tokens + 1, 1, 32), torch.zeros(tokens + 1, 1, 32)  # every token to the sink row
        attention = attention_front_triton(q, k, v, *norms, 1e-6, cos, sin, rnd.positions, None, *caches,
                                           torch.full((tokens,), tokens))
        outputs.append([*front, *attention])
    for mine, theirs in zip(*outputs):
        assert torch.equal(mine[span[0]], theirs[span[1]])
