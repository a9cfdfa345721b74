"""The fused Gated DeltaNet front (conv + gates + saved windows in one launch; interpreter on CPU) against
its three kernels run one by one and against its reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flide_sdk.kernels.gdn_front import gdn_front_triton
from flide_sdk.kernels.gdn_gates import gdn_gates_triton
from flide_sdk.kernels.reference import gdn_front_reference
from flide_sdk.kernels.short_conv import indexed_conv_triton, save_windows_triton
from flide_sdk.plan.layout import RequestSpec, plan_round

from .test_kernels_conv import CHANNELS, resumed_round


def front_inputs(tokens: int, heads: int, dtype: torch.dtype, seed: int):
    """qkv, a and b as column blocks of one projection output (strided rows, as the fused GEMM leaves
    them), the conv weight, the gate parameters and a window arena of 5 slots."""
    generator = torch.Generator().manual_seed(seed)
    projected = torch.randn(tokens, CHANNELS + 2 * heads + 3, generator=generator).to(dtype)
    qkv, b, a = projected[:, :CHANNELS], projected[:, CHANNELS : CHANNELS + heads], projected[:, CHANNELS + heads : -3]
    weight = torch.randn(CHANNELS, 4, generator=generator).to(dtype)
    A_log, dt_bias = torch.randn(heads, generator=generator), torch.randn(heads, generator=generator)
    arena = torch.randn(5, 3, CHANNELS, generator=generator).to(dtype)
    return qkv, a, b, weight, A_log, dt_bias, arena


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [4, 5])  # 5: a padded head block
def test_fused_front_equals_its_kernels_one_by_one(dtype: torch.dtype, heads: int):
    rnd = resumed_round()
    plan = rnd.checkpoint
    assert plan.save_slots.numel() == 2 and plan.resume_slots.numel() == 2  # every part has work
    qkv, a, b, weight, A_log, dt_bias, arena = front_inputs(rnd.ids.shape[0], heads, dtype, seed=heads)
    fused_arena, separate_arena = arena.clone(), arena.clone()
    mixed, g, beta = gdn_front_triton(qkv, a, b, weight, A_log, dt_bias, fused_arena, plan.resume_slots,
                                      rnd.conv_src, plan.save_slots, plan.save_window_src)
    assert torch.equal(mixed, indexed_conv_triton(qkv, separate_arena, plan.resume_slots, weight, rnd.conv_src))
    expected_g, expected_beta = gdn_gates_triton(a, b, A_log, dt_bias)
    assert torch.equal(g, expected_g) and torch.equal(beta, expected_beta)
    save_windows_triton(qkv, separate_arena, plan.resume_slots, plan.save_slots, plan.save_window_src)
    assert torch.equal(fused_arena, separate_arena)
    assert not torch.equal(fused_arena, arena)  # the saves were written


def test_fused_front_matches_reference():
    rnd = resumed_round()
    plan = rnd.checkpoint
    qkv, a, b, weight, A_log, dt_bias, arena = front_inputs(rnd.ids.shape[0], 4, torch.float32, seed=7)
    got_arena, expected_arena = arena.clone(), arena.clone()
    got = gdn_front_triton(qkv, a, b, weight, A_log, dt_bias, got_arena, plan.resume_slots, rnd.conv_src,
                           plan.save_slots, plan.save_window_src)
    expected = gdn_front_reference(qkv, a, b, weight, A_log, dt_bias, expected_arena, plan.resume_slots,
                                   rnd.conv_src, plan.save_slots, plan.save_window_src)
    for ours, theirs in zip(got, expected):
        assert ours.shape == theirs.shape and float((ours - theirs).norm() / theirs.norm()) <= 1e-5
    assert torch.equal(got_arena, expected_arena)


def test_fused_front_without_saves_or_resumes_leaves_the_arena():
    rnd = plan_round([RequestSpec.of(np.arange(9), [np.arange(3)], [np.array([1])])], 4).to("cpu")
    plan = rnd.checkpoint
    assert plan.save_slots.numel() == 0
    qkv, a, b, weight, A_log, dt_bias, arena = front_inputs(rnd.ids.shape[0], 4, torch.float32, seed=3)
    before = arena.clone()
    mixed, g, _ = gdn_front_triton(qkv, a, b, weight, A_log, dt_bias, arena, plan.resume_slots, rnd.conv_src,
                                   plan.save_slots, plan.save_window_src)
    expected, expected_g, _ = gdn_front_reference(qkv, a, b, weight, A_log, dt_bias, before.clone(),
                                                  plan.resume_slots, rnd.conv_src, plan.save_slots,
                                                  plan.save_window_src)
    assert torch.equal(arena, before)
    assert float((mixed - expected).norm() / expected.norm()) <= 1e-5
    assert float((g - expected_g).norm() / expected_g.norm()) <= 1e-5
