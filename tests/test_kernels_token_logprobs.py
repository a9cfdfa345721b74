"""The text reads' log-probabilities as two Triton launches (interpreter on CPU) against their torch definition."""

from __future__ import annotations

import pytest
import torch

from flide_sdk.kernels.reference import token_logprobs_reference
from flide_sdk.kernels.token_logprobs import token_logprobs_triton


@pytest.mark.parametrize(("rows", "vocab", "hidden"), [(1, 300, 64), (21, 9000, 100), (40, 4096, 32)])
def test_token_logprobs_match_their_definition(rows, vocab, hidden):
    g = torch.Generator().manual_seed(rows + vocab)
    h = torch.randn(rows, hidden, generator=g)
    head = torch.randn(vocab, hidden, generator=g) / hidden**0.25  # logits of a few units: a peaked softmax
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[0] = vocab - 1  # the last head row, in the last (partial) slice
    got = token_logprobs_triton(h, head, targets)
    expected = token_logprobs_reference(h, head, targets)
    assert got.shape == (rows,) and got.dtype == torch.float32
    assert torch.allclose(got, expected, atol=2e-5, rtol=1e-6), (got - expected).abs().max()
    assert (got < 0).all()


def test_a_rows_value_does_not_depend_on_the_other_rows():
    g = torch.Generator().manual_seed(1)
    h, head = torch.randn(37, 48, generator=g), torch.randn(5000, 48, generator=g)
    targets = torch.randint(0, 5000, (37,), generator=g)
    together = token_logprobs_triton(h, head, targets)
    for row in (0, 17, 36):
        alone = token_logprobs_triton(h[row : row + 1].contiguous(), head, targets[row : row + 1])
        assert torch.equal(alone[0], together[row])
    with pytest.raises(ValueError, match="token_logprobs"):
        token_logprobs_triton(h, head.double(), targets)


def test_padded_reads_leave_the_real_ones_alone():
    """A graph's read rows past the round's are padding (target -1): the real rows keep their values."""
    g = torch.Generator().manual_seed(2)
    h, head = torch.randn(40, 32, generator=g), torch.randn(6000, 32, generator=g)
    targets = torch.randint(0, 6000, (40,), generator=g)
    padded = targets.clone()
    padded[5:] = -1  # two blocks of 16 rows hold no real read at all
    real = token_logprobs_triton(h[:5].contiguous(), head, targets[:5])
    assert torch.equal(token_logprobs_triton(h, head, padded)[:5], real)
    assert torch.allclose(real, token_logprobs_reference(h, head, padded)[:5], atol=2e-5, rtol=1e-6)
