"""The indexed short convolution and window-saving Triton kernels (interpreter on CPU) against their torch
references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flide_sdk.kernels.reference import conv_rows, indexed_conv_reference, save_windows_reference
from flide_sdk.kernels.short_conv import BLOCK_C, BLOCK_T, indexed_conv_triton, save_windows_triton
from flide_sdk.plan.layout import RequestSpec, Resume, Save, plan_round

CHANNELS = 200  # not a multiple of the channel block


def resumed_round():
    """Three requests: two resume from pool slots 3 and 1 (windows in the arena), two save into slots 0 and 4."""
    rng = np.random.default_rng(0)
    requests = [
        RequestSpec.of(rng.integers(0, 9, 70), [rng.integers(0, 9, 3), rng.integers(0, 9, 1)], [np.array([1])] * 2,
                    start=40, resume=Resume(3, np.array([0])), save=Save(60, 0, np.arange(20))),
        RequestSpec.of(rng.integers(0, 9, 2), [rng.integers(0, 9, 5)], [np.array([1])]),
        RequestSpec.of(rng.integers(0, 9, 1), [rng.integers(0, 9, 2)] * 3, [np.array([1])] * 3,
                    start=2, resume=Resume(1, np.array([1])), save=Save(3, 4, np.arange(1))),
    ]
    return plan_round(requests, 4).to("cpu")


def test_triton_conv_matches_reference_with_resumed_windows():
    rnd = resumed_round()
    assert rnd.checkpoint.resume_slots.tolist() == [3, 1]
    x = torch.randn(rnd.ids.shape[0], CHANNELS)
    arena = torch.randn(5, 3, CHANNELS)
    weight = torch.randn(CHANNELS, 4)
    resume = rnd.checkpoint.resume_slots
    expected = indexed_conv_reference(x, arena, resume, weight, rnd.conv_src)
    got = indexed_conv_triton(x, arena, resume, weight, rnd.conv_src)
    assert float((got - expected).norm() / expected.norm()) <= 1e-5
    # the resumed slots' windows are really read: changing them changes exactly the resumed trunks' first
    # tokens; changing any other slot changes nothing
    changed_arena = arena.clone()
    changed_arena[resume] += 1.0
    changed = indexed_conv_triton(x, changed_arena, resume, weight, rnd.conv_src)
    touched = (changed - got).abs().amax(dim=1) > 0
    assert touched.any() and bool((touched == (rnd.conv_src > x.shape[0]).any(dim=1)).all())
    other = arena.clone()
    other[[0, 2, 4]] += 1.0
    assert torch.equal(indexed_conv_triton(x, other, resume, weight, rnd.conv_src), got)


@pytest.mark.parametrize("taps", [4, 3])
def test_triton_conv_without_resumes_reads_no_window(taps):
    rnd = plan_round([RequestSpec.of(np.arange(9), [np.arange(3)], [np.array([1])])], taps).to("cpu")
    x, weight = torch.randn(rnd.ids.shape[0], CHANNELS), torch.randn(CHANNELS, taps)
    empty = torch.zeros(0, dtype=torch.int64)
    arena = torch.zeros(0, taps - 1, CHANNELS)
    expected = indexed_conv_reference(x, arena, empty, weight, rnd.conv_src)
    got = indexed_conv_triton(x, arena, empty, weight, rnd.conv_src)
    assert float((got - expected).norm() / expected.norm()) <= 1e-5


def plain_tiles(src: torch.Tensor, block: int) -> list[bool]:
    """Per block of `block` tokens: whether every tap of every token is its stream predecessor (the tiles the
    kernel addresses arithmetically)."""
    taps = src.shape[1]
    tokens = torch.arange(src.shape[0])[:, None]
    ours = (src == tokens + 1 - (taps - 1) + torch.arange(taps)) & (tokens >= taps - 1)
    return [bool(ours[start : start + block].all()) and start + block <= src.shape[0]
            for start in range(0, src.shape[0], block)]


@pytest.mark.parametrize("channels", [2 * BLOCK_C, CHANNELS])
def test_triton_conv_plain_and_indexed_tiles_match_reference(channels):
    """Long segments (tiles read at arithmetic addresses) next to branches and a resumed trunk (tiles that
    resolve their indices), with the engine's weights (float32, tap-major) and without channel padding."""
    rng = np.random.default_rng(1)
    requests = [
        RequestSpec.of(rng.integers(0, 9, 120), [rng.integers(0, 9, 20), rng.integers(0, 9, 37)], [np.array([1])] * 2),
        RequestSpec.of(rng.integers(0, 9, 90), [rng.integers(0, 9, 5)], [np.array([1])],
                       start=50, resume=Resume(2, np.array([0]))),
    ]
    rnd = plan_round(requests, 4).to("cpu")
    kinds = plain_tiles(rnd.conv_src, BLOCK_T)
    assert any(kinds) and not all(kinds)
    x = torch.randn(rnd.ids.shape[0], channels).to(torch.bfloat16)
    arena = torch.randn(3, 3, channels).to(torch.bfloat16)
    weight = torch.randn(4, channels).t()  # [C, K] over tap-major storage, as `GatedDeltaNet.conv_weight`
    resume = rnd.checkpoint.resume_slots
    expected = indexed_conv_reference(x, arena, resume, weight, rnd.conv_src).float()
    got = indexed_conv_triton(x, arena, resume, weight, rnd.conv_src).float()
    assert float((got - expected).abs().max()) <= 2 ** -7 * float(expected.abs().max())  # bf16 rounding


def test_triton_save_windows_matches_reference():
    rnd = resumed_round()
    plan = rnd.checkpoint
    assert plan.save_slots.tolist() == [0, 4]
    x = torch.randn(rnd.ids.shape[0], CHANNELS)
    arena = torch.randn(5, 3, CHANNELS)
    expected, got = arena.clone(), arena.clone()
    save_windows_reference(x, expected, plan.resume_slots, plan.save_slots, plan.save_window_src)
    save_windows_triton(x, got, plan.resume_slots, plan.save_slots, plan.save_window_src)
    assert torch.equal(got, expected)
    assert torch.equal(got[[1, 2, 3]], arena[[1, 2, 3]])  # only the save slots are written
    # the second save (3 tokens, resumed at 2) keeps two rows of its resumed window (slot 1) and one token
    assert torch.equal(got[4, :2], arena[1, 1:])
    assert not torch.equal(got[0], arena[0])


def test_conv_rows_resolves_the_virtual_table():
    x, arena = torch.randn(5, 3), torch.randn(4, 2, 3)
    resume = torch.tensor([2, 0])
    index = torch.tensor([[0, 1, 5], [6, 9, 2], [7, 8, 0]])
    table = torch.cat([torch.zeros(1, 3), x, arena[2], arena[0]])
    assert torch.equal(conv_rows(x, arena, resume, index), table[index])
