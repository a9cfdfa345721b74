"""Forked Gated DeltaNet: the chunked gated delta rule over the segments of a round, level by level.

Per head, with state S (Dk x Dv), decay g_t (log space) and rate beta_t, token t does
    S <- exp(g_t) * S;  S <- S + k_t (beta_t * (v_t - S^T k_t))^T;  o_t = S^T q_t
with q, k L2-normalised and q scaled by Dk^-1/2. Chunks of GDN_CHUNK tokens are computed with the
UT/WY form: inside a chunk, T = (I + tril(diag(beta) K K^T * Gamma, -1))^-1 turns the sequential updates
into matrix products, and one scan step per chunk carries S across chunks.

A level is a set of independent segments, each starting from the state-table row `init_row` and, unless
its `final_row` is DISCARD_ROW, writing its final state there. Branches start from their trunk's final
state this way, which makes every branch compute exactly what it computes alone.
`gated_delta_reference` is the definition, used on CPU; it batches all chunks of a level for the
intra-chunk work and loops over scan steps (not tokens, not segments).
"""

from __future__ import annotations

import torch

from flide_sdk.layout import DeltaPlan


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    plan: DeltaPlan,
    states: torch.Tensor,
) -> torch.Tensor:
    """Outputs [T, Hv, Dv] (v's dtype) of the gated delta rule over every segment of `plan`.

    q, k: [T, Hk, Dk] (raw: normalised here); v: [T, Hv, Dv]; g, beta: [T, Hv] (float32).
    states: [num_rows, Hv, Dk, Dv] float32 state table, read at init rows and written at final rows.
    """
    total, v_heads = v.shape[0], v.shape[1]
    group = v_heads // k.shape[1]
    scale = q.shape[-1] ** -0.5
    qf = (l2_normalize(q.float()) * scale).repeat_interleave(group, dim=1)
    kf = l2_normalize(k.float()).repeat_interleave(group, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    # one zero row at index T absorbs chunk padding: no decay, no update, no output
    qf, kf, vf = (torch.cat([x, x.new_zeros(1, *x.shape[1:])]) for x in (qf, kf, vf))
    gf, bf = (torch.cat([x, x.new_zeros(1, x.shape[1])]) for x in (gf, bf))
    out = vf.new_zeros(total + 1, v_heads, vf.shape[-1])
    for level in plan.levels:
        _run_level(qf, kf, vf, gf, bf, level, states, out)
    return out[:total].to(v.dtype)


def _run_level(qf, kf, vf, gf, bf, level, states, out) -> None:
    idx = level.chunk_tokens  # [C, L]
    # [C, H, L, D] per chunk and head
    q, k, v = (x[idx].permute(0, 2, 1, 3) for x in (qf, kf, vf))
    g, beta = (x[idx].permute(0, 2, 1) for x in (gf, bf))
    length = idx.shape[1]
    cum = g.cumsum(dim=-1)  # [C, H, L]
    diff = cum[..., :, None] - cum[..., None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=idx.device).tril()
    gamma = diff.masked_fill(~causal, float("-inf")).exp()  # [C, H, L, L]
    k_beta = k * beta[..., None]
    # I + strictly-lower part of (diag(beta) K K^T * Gamma): the unit-triangular solve ignores the diagonal
    system = (k_beta @ k.transpose(-1, -2)) * gamma
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * gamma
    q_decayed = q * cum.exp()[..., None]
    last = cum[..., -1:]  # [C, H, 1]
    k_to_end = k * (last - cum).exp()[..., None]
    chunk_decay = last.exp()[..., None]  # [C, H, 1, 1]

    state = states[level.init_row].clone()  # [S, H, Dk, Dv]
    outputs = torch.empty_like(u)
    row = 0
    for count in level.active:
        c = slice(row, row + count)
        s = state[:count]
        v_new = u[c] - w[c] @ s
        outputs[c] = q_decayed[c] @ s + intra[c] @ v_new
        state[:count] = s * chunk_decay[c] + k_to_end[c].transpose(-1, -2) @ v_new
        row += count
    keep = level.final_row >= 0
    states[level.final_row[keep]] = state[keep]
    out[idx.reshape(-1)] = outputs.permute(0, 2, 1, 3).reshape(-1, *out.shape[1:])
