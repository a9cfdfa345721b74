"""ForkAttention: causal grouped-query attention over a round's flat stream, following each request's tree.

Token t sees its request's cached history (keys/values of positions before the resume point, in pool
pages), the stream keys [key_lo[t], ctx_hi[t]) (its request's trunk, for branch tokens) and
[seg_lo[t], t] (its own segment up to itself), and nothing else: never another branch, never another
request. `fork_attention_reference` is the definition: it runs one dense masked attention per request,
which is exact and simple and is what the engine uses on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flide_sdk.layout import PAGE, AttentionPlan


def fork_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: AttentionPlan,
    query_rows: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """Attention output for every stream token, or only for `query_rows` (then q holds just those rows).

    q: [Tq, Hq, D]; k, v: [T, Hkv, D]; k_cache, v_cache: [pages * PAGE, Hkv, D] pool arenas of this layer.
    Returns [Tq, Hq, D] in q's dtype. Scale 1/sqrt(D).
    """
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    rows = torch.arange(k.shape[0], device=q.device) if query_rows is None else query_rows
    out = torch.empty_like(q)
    for (start, end), (cached, pages) in zip(plan.request_bounds, plan.history):
        mine = ((rows >= start) & (rows < end)).nonzero().squeeze(1)
        if mine.numel() == 0:
            continue
        token = rows[mine]
        keys = torch.arange(start, end, device=q.device)
        visible = (keys[None, :] < plan.ctx_hi[token, None]) | (
            (keys[None, :] >= plan.seg_lo[token, None]) & (keys[None, :] <= token[:, None])
        )
        k_req, v_req = k[start:end], v[start:end]
        if cached:
            slots = (pages[:, None] * PAGE + torch.arange(PAGE, device=q.device)).reshape(-1)[:cached]
            k_req, v_req = torch.cat([k_cache[slots], k_req]), torch.cat([v_cache[slots], v_req])
            visible = torch.cat([visible.new_ones(len(token), cached), visible], dim=1)
        qh = q[mine].transpose(0, 1)
        kh = k_req.transpose(0, 1).repeat_interleave(group, dim=0)
        vh = v_req.transpose(0, 1).repeat_interleave(group, dim=0)
        attended = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, scale=head_dim**-0.5)
        out[mine] = attended.transpose(0, 1)
    return out
