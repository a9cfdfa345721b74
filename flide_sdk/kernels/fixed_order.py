"""The stream ops in fixed summation orders: the CPU definitions of the batch-invariant mode.

Torch's CPU matrix products pick their blocking by shape (a GEMM of a few rows goes another way than one of
many) and its attention splits keys by sequence length, so a token's last bits depend on what shares its round.
Here every contraction materialises its products with the summed axis last and contiguous and sums that axis
(`fixed_matmul`: torch's inner-dimension sum, whose order depends on the summed length alone), attention runs
per piece over key blocks of KEY_BLOCK at fixed places (the context from position 0, the piece's own keys from
its start), the label softmax runs over each question's own labels, and the pointwise functions are the
`reference.FIXED` forms. A token's value is then a function of its own inputs and the round's tree alone: the
same bits alone, forked, resumed and under any load.
"""

from __future__ import annotations

import functools
import math

import torch

from flide_sdk.kernels.plans import AttentionPlan
from flide_sdk.kernels.reference import (
    FIXED,
    add_rms_norm_reference,
    attention_front_reference,
    gated_delta_reference,
    gated_rms_norm_reference,
    gdn_front_reference,
    geglu_reference,
    head_logits,
    history_slots,
    norm_add_reference,
    rms_norm_reference,
    rms_norm_rotary_reference,
    swiglu_reference,
    token_logprobs_reference,
)

KEY_BLOCK = 64  # keys per online-softmax block
PRODUCT_ELEMENTS = 1 << 22  # products materialised at once by `fixed_matmul`


def fixed_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b ([..., M, K] @ [..., K, N], batch dims broadcast) with every element summed over K in one order,
    whatever M, N or the batch: the products are written into a contiguous [..., m, N, K] buffer (a broadcast
    product left to torch may get another memory order, and so another summation order) and summed over their
    last axis, a few rows at a time (the rows never meet)."""
    bt = b.transpose(-1, -2).unsqueeze(-3)  # [..., 1, N, K]
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    rows, depth, cols = a.shape[-2], a.shape[-1], b.shape[-1]
    step = max(1, PRODUCT_ELEMENTS // max(1, math.prod(batch) * cols * depth))
    result = torch.promote_types(a.dtype, b.dtype)
    dtype = torch.promote_types(result, torch.float32)  # 16-bit inputs: float32 products and sums, as a GEMM
    a, bt = a.to(dtype), bt.to(dtype)
    parts = []
    for i in range(0, max(rows, 1), step):
        chunk = a[..., i : i + step, None, :]
        products = torch.empty(*batch, chunk.shape[-3], cols, depth, dtype=dtype, device=a.device)
        torch.mul(chunk, bt, out=products)
        parts.append(products.sum(-1))
    return (torch.cat(parts, dim=-2) if len(parts) > 1 else parts[0]).to(result)


def linear_fixed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T ([T, K] x [N, K]) in a fixed order per element."""
    return fixed_matmul(x, weight.t())


def _blocks(length: int) -> range:
    return range(0, length, KEY_BLOCK)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, state: list) -> None:
    """One key block of the online softmax for rows q [H, n, D] over keys/values [H, KEY_BLOCK, D] (zero-padded),
    `visible` [n, KEY_BLOCK]; `state` is [m, l, acc], updated in place. Every reduction is over KEY_BLOCK or D."""
    m, l, acc = state
    scores = fixed_matmul(q, keys.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    m_new = torch.maximum(m, scores.amax(-1))
    m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
    p = torch.exp(scores - m_safe[..., None])
    alpha = torch.exp(m - m_safe)
    state[0] = m_new
    state[1] = l * alpha + p.sum(-1)
    state[2] = acc * alpha[..., None] + fixed_matmul(p, values)


def _padded_block(x: torch.Tensor, start: int) -> torch.Tensor:
    """x[:, start:start + KEY_BLOCK] ([H, len, D]) zero-padded to KEY_BLOCK keys."""
    block = x[:, start : start + KEY_BLOCK]
    if block.shape[1] < KEY_BLOCK:
        block = torch.cat([block, block.new_zeros(block.shape[0], KEY_BLOCK - block.shape[1], block.shape[2])], 1)
    return block


def fork_attention_fixed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, query_rows: torch.Tensor | None,
    k_cache: torch.Tensor, v_cache: torch.Tensor, gate: torch.Tensor | None = None, *, scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """`fork_attention_reference`'s contract with a fixed order per query: a piece's rows (a trunk or a branch)
    attend first to their context (the cached history, then the trunk for a branch) in blocks from position 0,
    then to their piece's own keys in blocks from the piece's start (a branch: its fork); a sliding window masks
    keys inside those blocks by position."""
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    rows = torch.arange(k.shape[0], device=q.device) if query_rows is None else query_rows
    out = torch.zeros_like(q)
    seg_lo, ctx_hi = plan.seg_lo[rows], plan.ctx_hi[rows]
    for (start, end), (cached, pages) in zip(plan.request_bounds, plan.history):
        mine = ((rows >= start) & (rows < end)).nonzero().squeeze(1)
        if mine.numel() == 0:
            continue
        history_k = history_v = k.new_zeros(0, kv_heads, head_dim)
        history_positions = torch.arange(cached, device=q.device)
        if cached:
            slots = history_slots(pages, cached, q.device)
            history_k, history_v = k_cache[slots], v_cache[slots]
        for piece_start in torch.unique(seg_lo[mine]).tolist():
            index = mine[seg_lo[mine] == piece_start]
            token = rows[index]
            trunk_end = int(ctx_hi[index[0]])  # branch rows: their trunk [start, trunk_end); trunk rows: start
            context_k = torch.cat([history_k, k[start:trunk_end]]).transpose(0, 1).repeat_interleave(group, 0)
            context_v = torch.cat([history_v, v[start:trunk_end]]).transpose(0, 1).repeat_interleave(group, 0)
            context_positions = torch.cat([history_positions, plan.positions[start:trunk_end]])
            # the latest position each row no longer sees (-1: none)
            earliest = token.new_full(token.shape, -1) if window is None else plan.positions[token] - window
            bound = token if plan.see_hi is None else plan.see_hi[token]  # the last own key each row sees
            own = int(bound.max()) + 1
            own_k = k[piece_start:own].transpose(0, 1).repeat_interleave(group, 0)
            own_v = v[piece_start:own].transpose(0, 1).repeat_interleave(group, 0)
            qh = q[index].transpose(0, 1).float() * scale
            n = len(index)
            state = [qh.new_full((heads, n), float("-inf")), qh.new_zeros(heads, n), qh.new_zeros(heads, n, head_dim)]
            everyone = torch.ones(n, KEY_BLOCK, dtype=torch.bool, device=q.device)
            offsets = torch.arange(KEY_BLOCK, device=q.device)
            for block in _blocks(context_k.shape[1]):
                inside = block + offsets < context_k.shape[1]
                seen = context_positions[(block + offsets).clamp(max=max(context_k.shape[1] - 1, 0))]
                visible = everyone & inside & (seen[None, :] > earliest[:, None])
                _attend(qh, _padded_block(context_k, block), _padded_block(context_v, block), visible, state)
            relative = bound - piece_start
            for block in _blocks(own - piece_start):
                later = (relative >= block).nonzero().squeeze(1)  # rows before the block see none of it
                sub = [x[:, later] for x in state]
                keys = (piece_start + block + offsets).clamp(max=plan.vis_end.shape[0] - 1)
                visible = ((block + offsets)[None, :] <= relative[later, None]) & (
                    token[later, None] < plan.vis_end[keys][None, :]) & (
                    plan.positions[keys][None, :] > earliest[later, None])
                _attend(qh[:, later], _padded_block(own_k, block), _padded_block(own_v, block), visible, sub)
                for x, y in zip(state, sub):
                    x[:, later] = y
            m, l, acc = state
            out[index] = (acc / torch.where(l > 0, l, torch.ones_like(l))[..., None]).transpose(0, 1).to(q.dtype)
    return out if gate is None else out * FIXED.sigmoid(gate)


# the references with fixed-order products and position-independent pointwise functions
gated_delta_fixed = functools.partial(gated_delta_reference, matmul=fixed_matmul, pointwise=FIXED)
rms_norm_fixed = functools.partial(rms_norm_reference, pointwise=FIXED)
add_rms_norm_fixed = functools.partial(add_rms_norm_reference, pointwise=FIXED)
norm_add_fixed = functools.partial(norm_add_reference, pointwise=FIXED)
gated_rms_norm_fixed = functools.partial(gated_rms_norm_reference, pointwise=FIXED)
attention_front_fixed = functools.partial(attention_front_reference, pointwise=FIXED)
gdn_front_fixed = functools.partial(gdn_front_reference, pointwise=FIXED)
swiglu_fixed = functools.partial(swiglu_reference, pointwise=FIXED)
geglu_fixed = functools.partial(geglu_reference, pointwise=FIXED)
rms_norm_rotary_fixed = functools.partial(rms_norm_rotary_reference, pointwise=FIXED)


def label_log_softmax_fixed(h: torch.Tensor, head: torch.Tensor, label_ids: torch.Tensor,
                            bias: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """`label_log_softmax_reference`'s contract, each row's logits fixed-order dot products and its log_softmax
    over its own labels only (not over the round's label width)."""
    label_rows = head[label_ids.clamp(min=0)].float()  # [R, L, hidden]
    logits = fixed_matmul(h.float()[:, None, :], label_rows.transpose(-1, -2))[:, 0]  # [R, L]
    logits = head_logits(logits, label_ids, bias, softcap)
    out = torch.full_like(logits, float("-inf"))
    counts = (label_ids >= 0).sum(-1)
    for count in torch.unique(counts).tolist():
        rows = (counts == count).nonzero().squeeze(1)
        out[rows, :count] = torch.log_softmax(logits[rows, :count], dim=-1)
    return out


token_logprobs_fixed = functools.partial(token_logprobs_reference, linear=linear_fixed)
"""`token_logprobs_reference` with its products in a fixed order."""
