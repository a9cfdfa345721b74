"""The model's readout: each question's option log-probabilities from its readout row's final hidden state.

Only the label rows of the head are needed: question r's logits are the float32 dot products of its hidden
state h[r] with the head rows of its label ids (-1 pads a question with fewer labels: no logit), and its
log-probabilities their log_softmax (log-probabilities, so that a temperature applied on the host never meets a
probability that underflowed). In torch that is a clamp, a gather of the label rows, two casts, a batched
product, a mask and a log_softmax: seven launches (a decision head's rows add their bias and are soft-capped
first). `label_log_softmax_reference` is the definition;
`label_log_softmax_triton` one launch (a program per question; grid from tensor shapes only: CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_HIDDEN = 256  # hidden channels a program takes at a time
# label lanes of a program at least: a graph's label columns (`capacity.LABELS`), so a question's reductions
# take one shape whatever the round's widest question (batch invariance)
BLOCK_LABELS = 32


@triton.jit
def _label_log_softmax_kernel(
    h_ptr, head_ptr, ids_ptr, bias_ptr, out_ptr, hidden, labels, softcap, stride_h, stride_head, stride_ids,
    stride_out, BL: tl.constexpr, BH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BL)
    ids = tl.load(ids_ptr + r * stride_ids + lane, mask=lane < labels, other=-1)
    real = ids >= 0
    rows = head_ptr + tl.maximum(ids, 0).to(tl.int64) * stride_head
    logits = tl.zeros((BL,), tl.float32)
    for c0 in range(0, hidden, BH):
        c = c0 + tl.arange(0, BH)
        c_ok = c < hidden
        x = tl.load(h_ptr + r * stride_h + c, mask=c_ok, other=0.0).to(tl.float32)
        w = tl.load(rows[:, None] + c[None, :], mask=real[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        logits += tl.sum(w * x[None, :], axis=1)
    if HAS_BIAS:
        logits += tl.load(bias_ptr + tl.maximum(ids, 0), mask=real, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:  # softcap * tanh(x / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1)
        logits = softcap * (1.0 - 2.0 / (tl.exp(2.0 * logits / softcap) + 1.0))
    logits = tl.where(real, logits, float("-inf"))
    shifted = logits - tl.max(logits, axis=0)
    tl.store(out_ptr + r * stride_out + lane, shifted - tl.log(tl.sum(tl.exp(shifted), axis=0)), mask=lane < labels)


def label_log_softmax_triton(h: torch.Tensor, head: torch.Tensor, label_ids: torch.Tensor,
                             bias: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """One launch behind the contract of `label_log_softmax_reference` (a row without labels, as a graph's padding
    rows may be, gets NaN there as well)."""
    questions, labels = label_ids.shape
    hidden = h.shape[1]
    if head.shape[1] != hidden or h.shape[0] != questions or h.stride(-1) != 1 or head.stride(-1) != 1:
        raise ValueError(f"label_log_softmax: h {tuple(h.shape)}, head {tuple(head.shape)}, "
                         f"label ids {tuple(label_ids.shape)}")
    out = torch.empty(questions, labels, dtype=torch.float32, device=h.device)
    if questions and labels:
        _label_log_softmax_kernel[(questions,)](
            h, head, label_ids, head if bias is None else bias, out, hidden, labels, 1.0 if softcap is None else softcap,
            h.stride(0), head.stride(0), label_ids.stride(0), out.stride(0),
            BL=max(BLOCK_LABELS, triton.next_power_of_2(labels)),
            BH=min(BLOCK_HIDDEN, triton.next_power_of_2(hidden)),
            HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
        )
    return out
