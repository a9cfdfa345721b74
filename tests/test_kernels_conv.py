"""The indexed short convolution's Triton kernel (interpreter on CPU) against its torch reference."""

from __future__ import annotations

import numpy as np
import torch

from flide_sdk.kernels.short_conv import conv_rows, indexed_conv_reference, indexed_conv_triton
from flide_sdk.layout import RequestSpec, Resume, plan_round


def test_triton_conv_matches_reference_with_resumed_windows():
    rng = np.random.default_rng(0)
    requests = [
        RequestSpec.of(rng.integers(0, 9, 70), [rng.integers(0, 9, 3), rng.integers(0, 9, 1)], [np.array([1])] * 2,
                    start=40, resume=Resume(0, np.array([0]))),
        RequestSpec.of(rng.integers(0, 9, 2), [rng.integers(0, 9, 5)], [np.array([1])]),
        RequestSpec.of(rng.integers(0, 9, 1), [rng.integers(0, 9, 2)] * 3, [np.array([1])] * 3,
                    start=2, resume=Resume(1, np.array([1]))),
    ]
    rnd = plan_round(requests, 4).to("cpu")
    channels = 200  # not a multiple of the channel block
    x = torch.randn(rnd.ids.shape[0], channels)
    windows = torch.randn(2 * 3, channels)
    weight = torch.randn(channels, 4)
    expected = indexed_conv_reference(x, windows, weight, rnd.conv_src)
    got = indexed_conv_triton(x, windows, weight, rnd.conv_src)
    assert float((got - expected).norm() / expected.norm()) <= 1e-5
    # the window rows are really read: changing them changes exactly the resumed trunks' first tokens
    changed = indexed_conv_triton(x, windows + 1.0, weight, rnd.conv_src)
    touched = (changed - got).abs().amax(dim=1) > 0
    assert touched.any() and bool((touched == (rnd.conv_src > x.shape[0]).any(dim=1)).all())


def test_conv_rows_resolves_the_virtual_table():
    x, windows = torch.randn(5, 3), torch.randn(4, 3)
    index = torch.tensor([[0, 1, 5], [6, 9, 2]])
    table = torch.cat([torch.zeros(1, 3), x, windows])
    assert torch.equal(conv_rows(x, windows, index), table[index])
