"""The definitions of the stream ops and fused pointwise ops, in plain torch: what the engine runs on CPU.

Each Triton kernel of this package computes the same contract on CUDA and is tested against the function
here. This module imports no Triton, so a CPU install needs none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from flide_sdk.kernels.plans import (
    CONV_PIECE_ROWS,
    MAX_CONV_WINDOW,
    PAGE,
    ZERO_TAP,
    AttentionPlan,
    DeltaPlan,
    RoundMetadata,
)

L2_EPS = 1e-6
QUERY_BLOCK = 256  # query rows attended at once by `fork_attention_reference`


class Pointwise(NamedTuple):
    """The pointwise functions the references call: torch's (`TORCH`), or forms of exp, log1p, sqrt and IEEE
    arithmetic whose value does not depend on where an element sits in its tensor (`FIXED`: torch's CPU rsqrt,
    sigmoid, silu, softplus and gelu take other code paths for a vector's tail or a lone element)."""

    rsqrt: Callable[[torch.Tensor], torch.Tensor]
    sigmoid: Callable[[torch.Tensor], torch.Tensor]
    silu: Callable[[torch.Tensor], torch.Tensor]
    softplus: Callable[[torch.Tensor], torch.Tensor]
    gelu_tanh: Callable[[torch.Tensor], torch.Tensor]


GELU_TANH_SCALE = (2.0 / np.pi) ** 0.5  # gelu's tanh approximation: 0.5 x (1 + tanh(scale (x + 0.044715 x^3)))
TORCH = Pointwise(torch.rsqrt, torch.sigmoid, F.silu, F.softplus, lambda x: F.gelu(x, approximate="tanh"))
FIXED = Pointwise(
    rsqrt=lambda x: 1.0 / torch.sqrt(x),
    sigmoid=lambda x: 1.0 / (1.0 + torch.exp(-x)),
    silu=lambda x: x / (1.0 + torch.exp(-x)),
    softplus=lambda x: torch.where(x > 20.0, x, torch.log1p(torch.exp(x))),  # torch's threshold
    # tanh(y) = 1 - 2 / (exp(2y) + 1)
    gelu_tanh=lambda x: x - x / (torch.exp(2.0 * GELU_TANH_SCALE * (x + 0.044715 * x * x * x)) + 1.0),
)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 1.0,
                       pointwise: Pointwise = TORCH) -> torch.Tensor:
    """RMSNorm x / rms(x) * (offset + w), computed in float32, in w's dtype: offset 1 for Qwen3.5's zero-centred
    weights, 0 for Gemma 4's."""
    xf = x.float()
    normed = xf * pointwise.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (offset + weight.float())).to(weight.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 1.0,
    pointwise: Pointwise = TORCH,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s)) with s = x + delta in x's dtype: a residual add and the norm that reads its result."""
    total = (x + delta).to(x.dtype)
    return total, rms_norm_reference(total, weight, eps, offset=offset, pointwise=pointwise)


def norm_add_reference(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 1.0,
    scale: torch.Tensor | None = None, next_weight: torch.Tensor | None = None, pointwise: Pointwise = TORCH,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(s, rms_norm(s, next_weight) or None) with s = (x + rms_norm(delta, weight)) * scale in x's dtype: a
    sublayer's output norm, the residual add, the layer's scalar (`scale` [1]) and the next norm, each rounded
    as the separate ops round."""
    total = (x + rms_norm_reference(delta, weight, eps, offset=offset, pointwise=pointwise)).to(x.dtype)
    if scale is not None:
        total = (total * scale).to(x.dtype)
    if next_weight is None:
        return total, None
    return total, rms_norm_reference(total, next_weight, eps, offset=offset, pointwise=pointwise)


def gated_rms_norm_reference(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *, pointwise: Pointwise = TORCH
) -> torch.Tensor:
    """w * rmsnorm(x) * silu(gate), as the Gated DeltaNet output norm."""
    xf = x.float()
    normed = (xf * pointwise.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * pointwise.silu(gate.float())).to(x.dtype)


def rms_norm_rotary_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, *, offset: float = 1.0,
    pointwise: Pointwise = TORCH,
) -> torch.Tensor:
    """rms_norm(x, weight, eps, offset) [T, H, D] with its first R channels rotated by cos/sin [T, R], channel i
    paired with i + R/2 (the definition)."""
    normed = rms_norm_reference(x, weight, eps, offset=offset, pointwise=pointwise)
    rot = cos.shape[-1]
    half = rot // 2
    x_rot, x_pass = normed[..., :rot], normed[..., rot:]
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    x_rot = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([x_rot, x_pass], dim=-1)


def attention_front_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
    cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor, query_rows: torch.Tensor | None,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, *, offset: float = 1.0,
    pointwise: Pointwise = TORCH,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k normalised and rotated, v) contiguous, and k and v written into the caches at `slots`.

    q [Tq, H, D] (Tq = T, or the readout rows `query_rows` of the stream); k, v [T, Hkv, D]; q_weight and
    k_weight the head norms' weights [D] (scaling by offset + w, `rms_norm_reference`); cos_table and sin_table
    [positions, R] in the weights' dtype; positions [T] each token's; caches [pool positions, Hkv, D]; slots [T].
    """
    q_positions = positions if query_rows is None else positions[query_rows]
    q = rms_norm_rotary_reference(q, q_weight, eps, cos_table[q_positions], sin_table[q_positions], offset=offset,
                                  pointwise=pointwise)
    k = rms_norm_rotary_reference(k, k_weight, eps, cos_table[positions], sin_table[positions], offset=offset,
                                  pointwise=pointwise)
    v = v.contiguous()
    k_cache[slots] = k
    v_cache[slots] = v
    return q, k, v


def history_slots(pages: np.ndarray, cached: int, device: torch.device) -> torch.Tensor:
    """The pool positions of a request's cached keys/values [0, cached), from its pages."""
    pages = torch.as_tensor(pages, device=device)
    return (pages[:, None] * PAGE + torch.arange(PAGE, device=device)).reshape(-1)[:cached]


def fork_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: AttentionPlan,
    query_rows: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    gate: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention output for every stream token, or only for `query_rows` (then q holds just those rows).

    q: [Tq, Hq, D]; k, v: [T, Hkv, D]; k_cache, v_cache: [pages * PAGE, Hkv, D] pool arenas of this layer.
    gate: [Tq, Hq, D] or None: the output is multiplied by sigmoid(gate) (Qwen3.5's output gate).
    scale: of the scores (None: 1/sqrt(D)); window: a sliding window, a query at position p sees only the keys
    at positions above p - window (None: every key its tree shows it).
    Returns [Tq, Hq, D] in q's dtype. A request's queries run QUERY_BLOCK rows at a time over the keys up to
    the block's last row, so memory grows with its keys times the block, never with the square of its length.
    """
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    rows = torch.arange(k.shape[0], device=q.device) if query_rows is None else query_rows
    out = torch.empty_like(q)
    for (start, end), (cached, pages) in zip(plan.request_bounds, plan.history):
        mine = ((rows >= start) & (rows < end)).nonzero().squeeze(1)
        if mine.numel() == 0:
            continue
        k_req, v_req = k[start:end], v[start:end]
        key_positions = torch.cat([torch.arange(cached, device=q.device), plan.positions[start:end]])
        if cached:
            slots = history_slots(pages, cached, q.device)
            k_req, v_req = torch.cat([k_cache[slots], k_req]), torch.cat([v_cache[slots], v_req])
        kh = k_req.transpose(0, 1).repeat_interleave(group, dim=0)
        vh = v_req.transpose(0, 1).repeat_interleave(group, dim=0)
        for block in mine.split(QUERY_BLOCK):
            token = rows[block]
            bound = token if plan.see_hi is None else plan.see_hi[token]  # the last key each token may see
            seen = int(bound.max()) + 1
            keys = torch.arange(start, seen, device=q.device)
            visible = (keys[None, :] < plan.ctx_hi[token, None]) | (
                (keys[None, :] >= plan.seg_lo[token, None]) & (keys[None, :] <= bound[:, None])
                & (token[:, None] < plan.vis_end[keys][None, :])
            )
            if cached:
                visible = torch.cat([visible.new_ones(len(token), cached), visible], dim=1)
            width = cached + seen - start
            if window is not None:
                visible &= key_positions[None, :width] > plan.positions[token, None] - window
            qh = q[block].transpose(0, 1)
            attended = F.scaled_dot_product_attention(qh, kh[:, :width], vh[:, :width], attn_mask=visible,
                                                      scale=head_dim**-0.5 if scale is None else scale)
            out[block] = attended.transpose(0, 1)
    return out if gate is None else out * torch.sigmoid(gate)


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS, pointwise: Pointwise = TORCH) -> torch.Tensor:
    return x * pointwise.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    plan: DeltaPlan,
    states: torch.Tensor,
    *,
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.matmul,
    pointwise: Pointwise = TORCH,
) -> torch.Tensor:
    """Outputs [T, Hv, Dv] (v's dtype) of the gated delta rule over every segment of `plan`.

    q, k: [T, Hk, Dk] (raw: normalised here); v: [T, Hv, Dv]; g, beta: [T, Hv] (float32).
    states: [num_rows, Hv, Dk, Dv] float32 state table, read at init rows and written at final rows.
    `matmul` computes every product and `pointwise` the L2 norms (the batch-invariant mode's: `fixed_order`).
    """
    total, v_heads = v.shape[0], v.shape[1]
    group = v_heads // k.shape[1]
    scale = q.shape[-1] ** -0.5
    qf = (l2_normalize(q.float(), pointwise=pointwise) * scale).repeat_interleave(group, dim=1)
    kf = l2_normalize(k.float(), pointwise=pointwise).repeat_interleave(group, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    # one zero row at index T absorbs chunk padding: no decay, no update, no output
    qf, kf, vf = (torch.cat([x, x.new_zeros(1, *x.shape[1:])]) for x in (qf, kf, vf))
    gf, bf = (torch.cat([x, x.new_zeros(1, x.shape[1])]) for x in (gf, bf))
    out = vf.new_zeros(total + 1, v_heads, vf.shape[-1])
    piece_lo = torch.cat([plan.piece_lo, plan.piece_lo.new_full((1,), total)])  # padding: a piece past the chunk
    for level in plan.levels:
        _run_level(qf, kf, vf, gf, bf, level, piece_lo, states, out, matmul)
    return out[:total].to(v.dtype)


def _run_level(qf, kf, vf, gf, bf, level, piece_lo, states, out, matmul) -> None:
    idx = level.chunk_tokens  # [C, L]
    # [C, H, L, D] per chunk and head
    q, k, v = (x[idx].permute(0, 2, 1, 3) for x in (qf, kf, vf))
    g, beta = (x[idx].permute(0, 2, 1) for x in (gf, bf))
    length = idx.shape[1]
    cum = g.cumsum(dim=-1)  # [C, H, L]
    diff = cum[..., :, None] - cum[..., None, :]
    # a token sees the chunk's earlier tokens of its own piece (a chunk row may pack sibling pieces), and its
    # piece starts from the segment's state: decays count from the piece's first token
    first = (piece_lo[idx] - idx[:, :1]).clamp(min=0)  # [C, L] the chunk position where each token's piece starts
    positions = torch.arange(length, device=idx.device)
    causal = torch.ones(length, length, dtype=torch.bool, device=idx.device).tril()
    visible = causal & (positions[None, None, :] >= first[:, :, None])  # [C, L, L]
    gamma = diff.masked_fill(~visible[:, None], float("-inf")).exp()  # [C, H, L, L]
    before = cum.gather(-1, (first - 1).clamp(0, length - 1)[:, None].expand_as(cum))
    from_piece = (cum - torch.where(first[:, None] > 0, before, torch.zeros_like(before))).exp()  # [C, H, L]
    k_beta = k * beta[..., None]
    # I + strictly-lower part of (diag(beta) K K^T * Gamma): the unit-triangular solve ignores the diagonal
    system = matmul(k_beta, k.transpose(-1, -2)) * gamma
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * from_piece[..., None], upper=False, unitriangular=True)
    intra = matmul(q, k.transpose(-1, -2)) * gamma
    q_decayed = q * from_piece[..., None]
    last = cum[..., -1:]  # [C, H, 1]
    k_to_end = k * (last - cum).exp()[..., None]
    chunk_decay = last.exp()[..., None]  # [C, H, 1, 1]

    state = states[level.init_row].clone()  # [S, H, Dk, Dv]
    outputs = torch.empty_like(u)
    for step, count in enumerate(level.active):
        # the rows of the active segments' chunk `step`: their first chunks are rows 0.., later ones step_base + step
        c = level.step_base[:count] + step if step else torch.arange(count, device=idx.device)
        s = state[:count]
        v_new = u[c] - matmul(w[c], s)
        outputs[c] = matmul(q_decayed[c], s) + matmul(intra[c], v_new)
        state[:count] = s * chunk_decay[c] + matmul(k_to_end[c].transpose(-1, -2), v_new)
    keep = level.final_row >= 0
    states[level.final_row[keep]] = state[keep]
    out[idx.reshape(-1)] = outputs.permute(0, 2, 1, 3).reshape(-1, *out.shape[1:])


def tree_paths(parent: torch.Tensor) -> torch.Tensor:
    """[N, N] bool: row t marks t and its ancestors, for tokens in DFS pre-order (parent[t] < t; -1: none)."""
    n = parent.shape[0]
    step = torch.zeros(n, n, dtype=torch.float64, device=parent.device)
    has = parent >= 0
    step[torch.arange(n, device=parent.device)[has], parent[has]] = 1.0
    reach = torch.eye(n, dtype=torch.float64, device=parent.device) + step
    for _ in range(max(1, n.bit_length())):  # doubling: paths of up to 2^j steps
        reach = ((reach + reach @ reach) > 0).to(torch.float64)
    return reach > 0


def tree_delta_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, parent: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one chunk whose tokens form a tree (the tree WY transform), every token from
    the chunk's start state `state` along its own path: (outputs [N, H, Dv], pseudo-values [N, H, Dv]).

    Tokens in DFS pre-order, parent[t] < t the token before t on its path (-1: the start state). With c_t the
    log decay summed along the path to t, the pseudo-values V~ solve (I + diag(beta) G) V~ = R, G[t, i] =
    exp(c_t - c_i) k_t.k_i for strict ancestors i of t, R[t] = beta_t (v_t - exp(c_t) S0^T k_t); then
    o_t = exp(c_t) S0^T q_t + sum over i on the path to t (t included) of exp(c_t - c_i) (q_t.k_i) v~_i.
    q, k [N, H, Dk] (normalised and scaled as the kernel takes them), v [N, H, Dv], g, beta [N, H],
    parent [N] int64, state [H, Dk, Dv]; computed in the dtype of v.
    """
    path = tree_paths(parent)  # [N, N]
    strict = path & ~torch.eye(path.shape[0], dtype=torch.bool, device=path.device)
    qh, kh, vh = (x.transpose(0, 1) for x in (q, k, v))  # [H, N, D]
    gh, bh = g.transpose(0, 1).to(v.dtype), beta.transpose(0, 1).to(v.dtype)  # [H, N]
    cum = gh @ path.to(v.dtype).T  # [H, N]: c_t
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~path, float("-inf")).exp()  # [H, N, N]
    system = (kh @ kh.transpose(-1, -2)) * decay * strict * bh[..., None]
    start = cum.exp()[..., None]  # [H, N, 1]
    rhs = bh[..., None] * (vh - start * (kh @ state))
    eye = torch.eye(path.shape[0], dtype=v.dtype, device=v.device)
    pseudo = torch.linalg.solve_triangular(eye + system, rhs, upper=False)
    out = start * (qh @ state) + ((qh @ kh.transpose(-1, -2)) * decay) @ pseudo
    return out.transpose(0, 1), pseudo.transpose(0, 1)


def tree_state_reference(
    k: torch.Tensor, g: torch.Tensor, parent: torch.Tensor, pseudo: torch.Tensor, state: torch.Tensor, node: int
) -> torch.Tensor:
    """The state after token `node` rebuilt from the pseudo-values (`tree_delta_reference`): exp(c_a) S0 plus,
    over the path to a, exp(c_a - c_i) k_i v~_i^T ([H, Dk, Dv])."""
    on_path = tree_paths(parent)[node]
    gh = g.transpose(0, 1).to(state.dtype)[:, on_path]  # [H, n]
    cum = gh.sum(-1)  # c_a
    weights = (cum[:, None] - gh.cumsum(-1)).exp()  # exp(c_a - c_i), i on the path
    kh, vh = k.transpose(0, 1)[:, on_path], pseudo.transpose(0, 1)[:, on_path]  # [H, n, D]
    return cum.exp()[:, None, None] * state + (kh * weights[..., None]).transpose(-1, -2) @ vh


def conv_rows(x: torch.Tensor, window_cache: torch.Tensor, resume_slots: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of the virtual table [zero row, x, resumed windows] at `index` (any shape), as [*index.shape, C]."""
    total = x.shape[0]
    windows = window_cache[resume_slots].reshape(-1, x.shape[1])
    from_stream = x[(index - 1).clamp(0, max(total - 1, 0))] if total else x.new_zeros(*index.shape, x.shape[1])
    from_window = windows[(index - 1 - total).clamp(min=0)] if windows.shape[0] else torch.zeros_like(from_stream)
    rows = torch.where((index > total)[..., None], from_window, from_stream)
    return torch.where((index == 0)[..., None], torch.zeros_like(rows), rows)


def indexed_conv_reference(
    x: torch.Tensor, window_cache: torch.Tensor, resume_slots: torch.Tensor, weight: torch.Tensor, src: torch.Tensor,
    *, pointwise: Pointwise = TORCH,
) -> torch.Tensor:
    """silu(sum_j weight[:, j] * table[src[t, j]]) for every token t.

    x: [T, C] stream rows; window_cache: [S, K-1, C] the layer's window arena; resume_slots: [n] its slots
    the table's window rows come from; weight: [C, K] (tap K-1 is the token itself); src: [T, K].
    Returns [T, C] in x's dtype; the sum runs in weight's dtype.
    """
    gathered = conv_rows(x, window_cache, resume_slots, src).to(weight.dtype)  # [T, K, C]
    mixed = gathered[:, 0] * weight[:, 0]
    for tap in range(1, weight.shape[1]):  # tap by tap: one order of the sum, whatever the round
        mixed = mixed + gathered[:, tap] * weight[:, tap]
    return pointwise.silu(mixed).to(x.dtype)


def save_windows_reference(
    x: torch.Tensor, window_cache: torch.Tensor, resume_slots: torch.Tensor, save_slots: torch.Tensor,
    save_src: torch.Tensor,
) -> None:
    """window_cache[save_slots[r]] = table rows save_src[r] ([n_save, K-1]), in place."""
    window_cache[save_slots] = conv_rows(x, window_cache, resume_slots, save_src).to(window_cache.dtype)


def gdn_gates_reference(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *, pointwise: Pointwise = TORCH
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta), both float32 [T, H]: the definition, as transformers computes it."""
    beta = pointwise.sigmoid(b).float()
    g = -A_log.float().exp() * pointwise.softplus(a.float() + dt_bias.float())
    return g, beta


def gdn_front_reference(
    qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, window_cache: torch.Tensor, resume_slots: torch.Tensor, conv_src: torch.Tensor,
    save_slots: torch.Tensor, save_src: torch.Tensor, *, pointwise: Pointwise = TORCH,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(silu(indexed conv of qkv) [T, C], g [T, H], beta [T, H]), and the saved windows written into
    `window_cache` in place: `indexed_conv_reference`, `gdn_gates_reference` and `save_windows_reference`."""
    mixed = indexed_conv_reference(qkv, window_cache, resume_slots, conv_weight, conv_src, pointwise=pointwise)
    g, beta = gdn_gates_reference(a, b, A_log, dt_bias, pointwise=pointwise)
    save_windows_reference(qkv, window_cache, resume_slots, save_slots, save_src)
    return mixed, g, beta


def head_logits(logits: torch.Tensor, label_ids: torch.Tensor, bias: torch.Tensor | None,
                softcap: float | None) -> torch.Tensor:
    """A decision head's scores from its rows' dot products [R, L]: plus the rows' bias, soft-capped."""
    if bias is not None:
        logits = logits + bias.float()[label_ids.clamp(min=0)]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def label_log_softmax_reference(h: torch.Tensor, head: torch.Tensor, label_ids: torch.Tensor,
                                bias: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """log_softmax over each row's labels of h[r] . head[label_ids[r, l]] in float32 ([R, L]; -inf where l is
    -1); a decision head's rows add `bias` and are soft-capped (`softcap * tanh(x / softcap)`) first.
    Log-probabilities, not probabilities: an option far below the best keeps its value (its probability
    underflows in float32), so a temperature applied on the host (`executor.tempered`) stays exact.

    h [R, hidden]; head [vocab or head rows, hidden]; label_ids [R, L] (-1: no label); bias [rows] or None."""
    label_rows = head[label_ids.clamp(min=0)]  # [R, L, hidden]
    logits = head_logits(torch.einsum("rh,rlh->rl", h.float(), label_rows.float()), label_ids, bias, softcap)
    return torch.log_softmax(logits.masked_fill(label_ids < 0, float("-inf")), dim=-1)


TEXT_ROW_BLOCK = 64  # rows whose logits one product computes (the last block padded)
VOCAB_BLOCK = 16384  # vocabulary rows per product


def token_logprobs_reference(h: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, softcap: float | None = None,
                             linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear) -> torch.Tensor:
    """log_softmax(h[r] . head.T)[targets[r]] per row over the whole vocabulary, float32 logits ([X] float32;
    a row whose target is -1, a padded read, gets no meaningful value), each logit soft-capped first when
    `softcap` is set (softcap * tanh(logit / softcap): Gemma 4's final logits).

    The logits come a vocabulary block at a time (`linear` of float32 operands) for TEXT_ROW_BLOCK rows at a
    time, the last block padded, with a running log-sum-exp: every product has one shape whatever the number of
    rows, so a row's value does not depend on the others, and no [X, vocab] tensor is ever held."""
    rows = h.shape[0]
    padded = -(-rows // TEXT_ROW_BLOCK) * TEXT_ROW_BLOCK
    x = torch.zeros(padded, h.shape[1], dtype=torch.float32, device=h.device)
    x[:rows] = h
    target = torch.zeros(padded, dtype=torch.long, device=h.device)
    target[:rows] = targets
    peak = torch.full((padded,), float("-inf"), device=h.device)
    total = torch.zeros(padded, device=h.device)
    picked = torch.zeros(padded, device=h.device)
    for first in range(0, head.shape[0], VOCAB_BLOCK):
        block = head[first : first + VOCAB_BLOCK].float()
        inside = (target >= first) & (target < first + block.shape[0])
        column = (target - first).clamp(0, block.shape[0] - 1)
        for at in range(0, padded, TEXT_ROW_BLOCK):
            logits = linear(x[at : at + TEXT_ROW_BLOCK], block)  # [TEXT_ROW_BLOCK, block]
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            part = slice(at, at + TEXT_ROW_BLOCK)
            picked[part] = torch.where(inside[part], logits.gather(1, column[part, None])[:, 0], picked[part])
            top = torch.maximum(peak[part], logits.amax(-1))
            total[part] = total[part] * torch.exp(peak[part] - top) + torch.exp(logits - top[:, None]).sum(-1)
            peak[part] = top
    return (picked - peak - torch.log(total))[:rows]


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, *, pointwise: Pointwise = TORCH) -> torch.Tensor:
    """silu(gate) * up, as torch computes it (the definition)."""
    return pointwise.silu(gate) * up


def geglu_reference(gate: torch.Tensor, up: torch.Tensor, *, pointwise: Pointwise = TORCH) -> torch.Tensor:
    """gelu(gate) * up with gelu's tanh approximation (`gelu_pytorch_tanh`), as torch computes it: Gemma 4's MLP
    and per-layer input gate."""
    return pointwise.gelu_tanh(gate) * up


def expand_round_reference(arrays: RoundMetadata) -> None:
    """A round's per-token and per-chunk-position metadata from its staged form, in place (the definition of
    `round_metadata.expand_round_triton`, which says what each array holds)."""
    pieces, piece_counts, num_tokens, chunk_spans, _, token_rows, conv_src, chunk_tokens, _ = arrays
    total, kernel = conv_src.shape
    window = kernel - 1
    count, requests = (int(value) for value in piece_counts)
    real = int(num_tokens[0])
    t = torch.arange(real, device=pieces.device)
    piece = torch.searchsorted(pieces[0, :count].contiguous(), t, right=True) - 1
    start, *taps = pieces[: len(CONV_PIECE_ROWS), piece]
    offset, *rows = pieces[len(CONV_PIECE_ROWS) :, piece]
    token_rows[:, :real] = torch.stack([offset + t, *rows])
    token_rows[:, real:] = torch.tensor([0, real, real, real, requests, total, real], device=pieces.device)[:, None]
    back = torch.arange(window, -1, -1, device=pieces.device)  # tap j reads the token K - 1 - j back
    lead = (t - start)[:, None]
    # a tap before the piece reads its source `tap_d`, d = back - lead positions before the piece's first token
    source = torch.stack(taps, 1).gather(1, (back - lead - 1).clamp(0, MAX_CONV_WINDOW - 1))
    before = torch.where(source >= 0, source + 1, torch.where(source == ZERO_TAP, 0, 1 + total - 2 - source))
    conv_src[:real] = torch.where(back <= lead, t[:, None] + 1 - back, before)
    conv_src[real:] = 0
    positions = chunk_spans[0][:, None] + torch.arange(chunk_tokens.shape[1], device=pieces.device)
    chunk_tokens.copy_(torch.where(positions < chunk_spans[1][:, None], positions, total))
    gather_save_windows(arrays)


def gather_save_windows(arrays: RoundMetadata) -> None:
    """The conv inputs before each save point: the taps of the token before it, less the oldest."""
    arrays.save_window_src.copy_(arrays.conv_src.index_select(0, arrays.save_tokens)[:, 1:])


def moe_experts_reference(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
    glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = swiglu_reference,
) -> torch.Tensor:
    """The routed experts' weighted sum (the definition): token t's output is sum_j weights[t, j] *
    down_e(glu(gate_e(x_t), up_e(x_t))) over its experts e = experts[t, j] (glu: silu(gate) * up, or Gemma 4's
    gelu), each expert's projections and the weights in x's dtype, the sum in float32; returned in x's dtype.
    x [T, H], gate_up [E, 2I, H], down [E, H, I], experts [T, k] (int64), weights [T, k] (float32)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    size = down.shape[-1]
    for expert in experts.unique().tolist():
        tokens, slots = torch.where(experts == expert)
        gate, up = F.linear(x[tokens], gate_up[expert]).split(size, dim=-1)
        y = F.linear(glu(gate, up), down[expert])
        out.index_add_(0, tokens, y.float() * weights[tokens, slots, None].to(x.dtype).float())
    return out.to(x.dtype)
