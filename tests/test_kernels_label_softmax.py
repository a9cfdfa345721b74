"""The readout's label softmax as one Triton launch (interpreter on CPU) against its torch definition."""

from __future__ import annotations

import pytest
import torch

from flide_sdk.kernels.label_softmax import label_softmax_triton
from flide_sdk.kernels.reference import label_softmax_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("hidden", "labels"), [(64, 2), (1024, 5), (300, 26)])
def test_label_softmax_matches_its_definition(dtype, hidden, labels):
    g = torch.Generator().manual_seed(hidden + labels)
    h = torch.randn(7, hidden, generator=g).to(dtype)
    head = (torch.randn(500, hidden, generator=g) / hidden**0.5).to(dtype)
    label_ids = torch.randint(0, 500, (7, labels), generator=g)
    label_ids[1, 1:] = -1  # a question with one label
    label_ids[2, labels // 2 + 1 :] = -1
    got = label_softmax_triton(h, head, label_ids)
    expected = label_softmax_reference(h, head, label_ids)
    assert got.dtype == torch.float32 and got.shape == (7, labels)
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-5)
    assert (got[label_ids < 0] == 0).all() and torch.equal(got[1, 0], torch.tensor(1.0))
    assert torch.allclose(got.sum(dim=1), torch.ones(7))


def test_label_softmax_rows_without_labels_are_nan_like_the_definition():
    h, head = torch.randn(2, 32), torch.randn(10, 32)
    label_ids = torch.tensor([[3, -1], [-1, -1]])
    got, expected = label_softmax_triton(h, head, label_ids), label_softmax_reference(h, head, label_ids)
    assert got[1].isnan().all() and expected[1].isnan().all() and torch.equal(got[0], expected[0])
