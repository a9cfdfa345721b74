"""Writing a round's attention keys and values into the checkpoint pool's paged arenas, both in one pass.

Every stream token t has a flat pool position slots[t] (its page * PAGE + offset when a checkpoint saves it,
the pool's sink position otherwise: layout's `kv_slots`), and its keys and values [Hkv, D] are written there.
`store_kv_reference` is the definition (two indexed assignments); `store_kv_triton` does both arenas in one
launch of whole-row copies (torch's indexed assignment is a generic scatter, two launches per layer).
Tokens that are not saved all write the sink position: which of them lands there last does not matter,
nothing reads the sink.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16


def store_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """k_cache[slots] = k and v_cache[slots] = v (k, v: [T, Hkv, D]; caches: [positions, Hkv, D])."""
    k_cache[slots] = k
    v_cache[slots] = v


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, total,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_ch,
    DIM: tl.constexpr, BT: tl.constexpr,
):
    tokens = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = tokens < total
    head = tl.program_id(1)
    d = tl.arange(0, DIM)
    slot = tl.load(slots_ptr + tokens, mask=ok, other=0)
    k = tl.load(k_ptr + tokens[:, None] * stride_kt + head * stride_kh + d[None, :], mask=ok[:, None])
    v = tl.load(v_ptr + tokens[:, None] * stride_vt + head * stride_vh + d[None, :], mask=ok[:, None])
    target = slot[:, None] * stride_ct + head * stride_ch + d[None, :]
    tl.store(kc_ptr + target, k, mask=ok[:, None])
    tl.store(vc_ptr + target, v, mask=ok[:, None])


def store_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """The Triton kernel behind the contract of `store_kv_reference` (the caches share a layout; D a power of 2)."""
    total, heads, dim = k.shape
    if v.shape != k.shape or k_cache.stride() != v_cache.stride() or k_cache.dtype != k.dtype:
        raise ValueError("keys and values must share a shape, their caches a layout and the keys' dtype")
    if dim & (dim - 1) or k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError(f"head dim {dim} must be a power of two with unit stride")
    if total == 0:
        return
    _store_kv_kernel[(triton.cdiv(total, BLOCK_T), heads)](
        k, v, k_cache, v_cache, slots, total,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        DIM=dim, BT=BLOCK_T,
    )
