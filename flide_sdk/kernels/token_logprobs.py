"""The readout of text-scored options: each read row's log-probability of its target token over the whole vocabulary.

A row's logits are float32 dot products of its hidden state with every head row; only their log-sum-exp and the
target's logit are kept. In torch that is a loop of products and reductions over vocabulary blocks (hundreds
of launches); here two: `_partial_kernel` takes a block of rows and a fixed slice of the vocabulary per
program (tensor-core products, a running max and sum), `_combine_kernel` adds each row's slices in order. A
captured graph holds read rows for any round: padded reads (target -1) cost their programs no products. A
row's value depends on its own hidden state alone, never on how many rows the round reads.
`token_logprobs_reference` is the definition.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 16  # rows a program reads (tl.dot's smallest tile)
BLOCK_VOCAB = 128  # head rows per product
BLOCK_HIDDEN = 64  # hidden channels per product
VOCAB_SLICE = 4096  # head rows a program covers: its partial maximum and sum


@triton.jit
def _partial_kernel(
    h_ptr, head_ptr, targets_ptr, peak_ptr, total_ptr, picked_ptr, rows, vocab, hidden, slices,
    stride_h, stride_head, softcap,
    BR: tl.constexpr, BV: tl.constexpr, BH: tl.constexpr, SLICE: tl.constexpr, IEEE: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    block, part = tl.program_id(0), tl.program_id(1)
    r = block * BR + tl.arange(0, BR)
    r_ok = r < rows
    target = tl.load(targets_ptr + r, mask=r_ok, other=-1)
    peak = tl.full((BR,), float("-inf"), tl.float32)
    total = tl.zeros((BR,), tl.float32)
    picked = tl.full((BR,), float("-inf"), tl.float32)
    first = part * SLICE
    last = tl.where(tl.max(target, axis=0) >= 0, tl.minimum(first + SLICE, vocab), first)  # padded reads: none
    for v0 in range(first, last, BV):
        v = v0 + tl.arange(0, BV)
        v_ok = v < vocab
        logits = tl.zeros((BR, BV), tl.float32)
        for c0 in range(0, hidden, BH):
            c = c0 + tl.arange(0, BH)
            c_ok = c < hidden
            x = tl.load(h_ptr + r[:, None].to(tl.int64) * stride_h + c[None, :], mask=r_ok[:, None] & c_ok[None, :],
                        other=0.0)
            w = tl.load(head_ptr + v[None, :].to(tl.int64) * stride_head + c[:, None],
                        mask=v_ok[None, :] & c_ok[:, None], other=0.0)
            if IEEE:
                logits += tl.dot(x, w, input_precision="ieee")
            else:
                logits += tl.dot(x, w)
        if SOFTCAP:  # softcap * tanh(logits / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1)
            logits = softcap * (1.0 - 2.0 / (tl.exp(2.0 * logits / softcap) + 1.0))
        logits = tl.where(v_ok[None, :], logits, float("-inf"))
        top = tl.maximum(peak, tl.max(logits, axis=1))
        total = total * tl.exp(peak - top) + tl.sum(tl.exp(logits - top[:, None]), axis=1)
        peak = top
        hit = v[None, :] == target[:, None]
        picked = tl.maximum(picked, tl.max(tl.where(hit, logits, float("-inf")), axis=1))
    at = r * slices + part
    tl.store(peak_ptr + at, peak, mask=r_ok)
    tl.store(total_ptr + at, total, mask=r_ok)
    tl.store(picked_ptr + at, picked, mask=r_ok)


@triton.jit
def _combine_kernel(peak_ptr, total_ptr, picked_ptr, out_ptr, slices, BS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BS)
    s_ok = s < slices
    peak = tl.load(peak_ptr + r * slices + s, mask=s_ok, other=float("-inf"))
    total = tl.load(total_ptr + r * slices + s, mask=s_ok, other=0.0)
    picked = tl.max(tl.load(picked_ptr + r * slices + s, mask=s_ok, other=float("-inf")), axis=0)
    top = tl.max(peak, axis=0)
    lse = top + tl.log(tl.sum(total * tl.exp(peak - top), axis=0))
    tl.store(out_ptr + r, picked - lse)


def token_logprobs_triton(h: torch.Tensor, head: torch.Tensor, targets: torch.Tensor,
                          softcap: float | None = None) -> torch.Tensor:
    """Two launches behind the contract of `token_logprobs_reference` (h and head of one dtype, rows contiguous)."""
    rows, hidden = h.shape
    vocab = head.shape[0]
    if head.shape[1] != hidden or targets.shape != (rows,) or h.dtype != head.dtype or h.stride(-1) != 1 \
            or head.stride(-1) != 1:
        raise ValueError(f"token_logprobs: h {tuple(h.shape)} {h.dtype}, head {tuple(head.shape)} {head.dtype}, "
                         f"targets {tuple(targets.shape)}")
    out = torch.empty(rows, dtype=torch.float32, device=h.device)
    if not rows:
        return out
    slices = triton.cdiv(vocab, VOCAB_SLICE)
    peak, total, picked = (torch.empty(rows, slices, dtype=torch.float32, device=h.device) for _ in range(3))
    _partial_kernel[(triton.cdiv(rows, BLOCK_ROWS), slices)](
        h, head, targets, peak, total, picked, rows, vocab, hidden, slices, h.stride(0), head.stride(0),
        1.0 if softcap is None else softcap,
        BR=BLOCK_ROWS, BV=BLOCK_VOCAB, BH=BLOCK_HIDDEN, SLICE=VOCAB_SLICE, IEEE=h.dtype == torch.float32,
        SOFTCAP=softcap is not None,
    )
    _combine_kernel[(rows,)](peak, total, picked, out, slices, BS=triton.next_power_of_2(slices))
    return out
