"""The readout's label log-softmax as one Triton launch (interpreter on CPU) against its torch definition."""

from __future__ import annotations

import pytest
import torch

from flide_sdk.kernels.label_softmax import label_log_softmax_triton
from flide_sdk.kernels.reference import label_log_softmax_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("hidden", "labels"), [(64, 2), (1024, 5), (300, 26)])
def test_label_log_softmax_matches_its_definition(dtype, hidden, labels):
    g = torch.Generator().manual_seed(hidden + labels)
    h = torch.randn(7, hidden, generator=g).to(dtype)
    head = (torch.randn(500, hidden, generator=g) / hidden**0.5).to(dtype)
    label_ids = torch.randint(0, 500, (7, labels), generator=g)
    label_ids[1, 1:] = -1  # a question with one label
    label_ids[2, labels // 2 + 1 :] = -1
    got = label_log_softmax_triton(h, head, label_ids)
    expected = label_log_softmax_reference(h, head, label_ids)
    assert got.dtype == torch.float32 and got.shape == (7, labels)
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-5)
    assert (got[label_ids < 0] == float("-inf")).all() and torch.equal(got[1, 0], torch.tensor(0.0))
    assert torch.allclose(got.exp().sum(dim=1), torch.ones(7))


def test_label_log_softmax_rows_without_labels_are_nan_like_the_definition():
    h, head = torch.randn(2, 32), torch.randn(10, 32)
    label_ids = torch.tensor([[3, -1], [-1, -1]])
    got, expected = label_log_softmax_triton(h, head, label_ids), label_log_softmax_reference(h, head, label_ids)
    assert got[1].isnan().all() and expected[1].isnan().all() and torch.equal(got[0], expected[0])


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_a_decision_heads_bias_and_softcap_match_the_definition(softcap):
    # mutation: the kernel's bias loaded at the lane instead of the row id, or tanh's sign flipped -> fails
    g = torch.Generator().manual_seed(7)
    h, head = torch.randn(5, 96, generator=g), torch.randn(24, 96, generator=g)
    bias = torch.randn(24, generator=g) * 3
    label_ids = torch.tensor([[0, 1, -1], [8, 9, 10], [2, 3, 4], [23, 8, -1], [5, -1, -1]])
    got = label_log_softmax_triton(h, head, label_ids, bias, softcap)
    expected = label_log_softmax_reference(h, head, label_ids, bias, softcap)
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-5)
    logits = h[1] @ head[[8, 9, 10]].T + bias[[8, 9, 10]]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    assert torch.allclose(expected[1], torch.log_softmax(logits, -1), atol=1e-6)


def test_options_far_below_the_best_keep_their_log_probabilities():
    # why the readout gives log-probabilities: at 200 below the best an option's float32 probability is 0, and a
    # temperature T > 1 applied to it on the host stayed 0 (softmax(z / 50) gives it e^-4).
    # mutation: the kernel storing exp(log-probabilities) (probabilities) -> -inf / 0 there -> fails
    h = torch.ones(1, 4)
    head = torch.tensor([[50.0] * 4, [0.0] * 4, [-10.0] * 4])  # logits 200, 0, -40
    label_ids = torch.tensor([[0, 1, 2]])
    want = torch.tensor([[0.0, -200.0, -240.0]])
    for got in (label_log_softmax_triton(h, head, label_ids), label_log_softmax_reference(h, head, label_ids)):
        assert torch.allclose(got, want, atol=1e-4), got
