"""Full attention's work between its projections and the attention itself, in one launch: the q and k head
norms with the partial rotary embedding, contiguous keys and values, and their copies in the pool's paged
arenas.

The rotation reads the model's cos/sin tables of every position (`Qwen35Model.rope_tables`) at each token's
position, so no per-round table is built (that took eight elementwise launches a round). Programs
[0, Q) normalise and rotate blocks of query head rows (at the readout rows' positions when the queries are
only there); the rest take blocks of key head rows: each normalises and rotates its keys into the stream's
contiguous keys and into the key arena at the token's pool position (`kv_slots`: the sink for tokens no
checkpoint saves; which of them lands there last does not matter, nothing reads the sink), and copies the
values alike. Separately these were four launches per layer (q and k rotary, the values' copy, and a store of
both into the arenas). The rotation is `rotary`'s tile (`_norm_rotary_rows`), so each output
is bit for bit what `rms_norm_rotary_triton` computes. `attention_front_reference` is the definition;
`attention_front_triton` the launch (grid from tensor shapes only: CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flide_sdk.kernels.rotary import _norm_rotary_rows, row_blocks


@triton.jit
def _attention_front_kernel(
    q_ptr, k_ptr, v_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, positions_ptr, query_rows_ptr,
    q_out_ptr, k_out_ptr, v_out_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    q_rows, k_rows, heads, kv_heads, width, rotary, eps, offset, q_programs,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_table, stride_ct, stride_ch,
    QUERY_ROWS: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, BROT: tl.constexpr,
):
    job = tl.program_id(0)
    if job < q_programs:
        row = (job * BR + tl.arange(0, BR)).to(tl.int64)  # row = query token * heads + head
        ok = row < q_rows
        token = row // heads
        stream = tl.load(query_rows_ptr + token, mask=ok, other=0) if QUERY_ROWS else token
        position = tl.load(positions_ptr + stream, mask=ok, other=0)
        q_out_rows = q_out_ptr + row * width
        _norm_rotary_rows(q_ptr + token * stride_qt + (row - token * heads) * stride_qh, q_out_rows, q_out_rows, ok,
                          cos_ptr + position * stride_table, sin_ptr + position * stride_table, q_weight_ptr,
                          width, rotary, eps, offset, BD, BROT, False)
    else:
        row = ((job - q_programs) * BR + tl.arange(0, BR)).to(tl.int64)  # row = token * kv_heads + head
        ok = row < k_rows
        token = row // kv_heads
        head = row - token * kv_heads
        position = tl.load(positions_ptr + token, mask=ok, other=0)
        cached = tl.load(slots_ptr + token, mask=ok, other=0) * stride_ct + head * stride_ch
        # the keys computed once, stored into the stream's keys and the arena
        _norm_rotary_rows(k_ptr + token * stride_kt + head * stride_kh, k_out_ptr + row * width, k_cache_ptr + cached,
                          ok, cos_ptr + position * stride_table, sin_ptr + position * stride_table, k_weight_ptr,
                          width, rotary, eps, offset, BD, BROT, True)
        col = tl.arange(0, BD)
        mask = ok[:, None] & (col < width)[None, :]
        values = tl.load(v_ptr + (token * stride_vt + head * stride_vh)[:, None] + col[None, :], mask=mask)
        tl.store(v_out_ptr + (row * width)[:, None] + col[None, :], values, mask=mask)
        tl.store(v_cache_ptr + cached[:, None] + col[None, :], values, mask=mask)


def attention_front_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
    cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor, query_rows: torch.Tensor | None,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, *, offset: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch behind the contract of `attention_front_reference` (x's rows may have any token and head
    strides, unit last stride)."""
    tokens, kv_heads, width = k.shape
    heads, rotary = q.shape[1], cos_table.shape[-1]
    dtype = q_weight.dtype
    if (v.shape != k.shape or q.shape[2] != width or q_weight.shape != (width,) or k_weight.shape != (width,)
            or k_weight.dtype != dtype or cos_table.dtype != dtype or sin_table.shape != cos_table.shape
            or sin_table.dtype != dtype or rotary % 2 or rotary > width):
        raise ValueError(f"attention_front: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, weights "
                         f"{tuple(q_weight.shape)} {tuple(k_weight.shape)}, tables {tuple(cos_table.shape)} "
                         f"{tuple(sin_table.shape)} {cos_table.dtype}")
    if k_cache.stride() != v_cache.stride() or k_cache.dtype != dtype or v.dtype != dtype or k_cache.stride(-1) != 1:
        raise ValueError("the caches must share a layout (unit last stride) and the values and caches the weights' dtype")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    cos_table, sin_table = cos_table.contiguous(), sin_table.contiguous()
    q_out = torch.empty(q.shape, dtype=dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=dtype, device=k.device)
    v_out = torch.empty(v.shape, dtype=dtype, device=v.device)
    block_r, block_d = row_blocks(width)
    q_rows, k_rows = q.shape[0] * heads, tokens * kv_heads
    q_programs = triton.cdiv(q_rows, block_r)
    programs = q_programs + triton.cdiv(k_rows, block_r)
    if programs and width:
        _attention_front_kernel[(programs,)](
            q, k, v, q_weight, k_weight, cos_table, sin_table, positions,
            positions if query_rows is None else query_rows,
            q_out, k_out, v_out, k_cache, v_cache, slots,
            q_rows, k_rows, heads, kv_heads, width, rotary, eps, offset, q_programs,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_table.stride(0),
            k_cache.stride(0), k_cache.stride(1),
            QUERY_ROWS=query_rows is not None, BR=block_r, BD=block_d, BROT=triton.next_power_of_2(max(rotary, 1)),
            num_warps=4,
        )
    return q_out, k_out, v_out
