"""The MLP's gated activations, SwiGLU silu(gate) * up (Qwen3.5) and GeGLU gelu_tanh(gate) * up (Gemma 4), as
one pass over the two halves of the gate|up projection.

Unfused, torch runs each as two kernels (the activation, then the product) with a [T, I] intermediate between
them.
The kernel reads gate and up where the fused gate|up GEMM left them (column blocks of one [T, 2I] output:
strided rows, unit column stride) and writes the product once. It keeps torch's roundings for 16-bit
inputs: the activation is computed in float32 and rounded to the inputs' dtype, then the product of the two 16-bit
tensors is computed in float32 and rounded. `swiglu_reference` and `geglu_reference` are the
definitions; `swiglu_triton` and `geglu_triton` the kernel. Launch shapes depend on tensor shapes only, so the kernel is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A program's tile, 8 tokens x 256 channels at 4 warps: 16 elements a thread per tensor (a 16 x 256 tile
# took 112 registers a thread on sm_90, this one about 60).
BLOCK_T = 8
BLOCK_I = 256


@triton.jit
def _gated_kernel(
    gate_ptr, up_ptr, out_ptr, tokens, width, stride_gate, stride_up, stride_out,
    BT: tl.constexpr, BI: tl.constexpr, GELU: tl.constexpr,
):
    row = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    col = tl.program_id(1) * BI + tl.arange(0, BI)
    ok = (row < tokens)[:, None] & (col < width)[None, :]
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + row[:, None] * stride_gate + col[None, :], mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row[:, None] * stride_up + col[None, :], mask=ok, other=0.0).to(tl.float32)
    if GELU:  # 0.5 x (1 + tanh(y)) = x sigmoid(2y), y = sqrt(2 / pi) (x + 0.044715 x^3); 2 sqrt(2 / pi):
        active = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate))
    else:
        active = gate * tl.sigmoid(gate)
    active = active.to(dtype).to(tl.float32)  # torch's activation result, rounded as stored
    tl.store(out_ptr + row[:, None] * stride_out + col[None, :], (active * up).to(dtype), mask=ok)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The Triton kernel behind the contract of `swiglu_reference` (gate and up [T, I] of one dtype)."""
    return _gated(gate, up, gelu=False)


def geglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The Triton kernel behind the contract of `geglu_reference` (gate and up [T, I] of one dtype)."""
    return _gated(gate, up, gelu=True)


def _gated(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dim() != 2:
        raise ValueError(f"gated activation: gate {tuple(gate.shape)} {gate.dtype} vs up {tuple(up.shape)} {up.dtype}")
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    up = up if up.stride(-1) == 1 else up.contiguous()
    tokens, width = gate.shape
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if tokens and width:
        grid = (triton.cdiv(tokens, BLOCK_T), triton.cdiv(width, BLOCK_I))
        _gated_kernel[grid](
            gate, up, out, tokens, width, gate.stride(0), up.stride(0), out.stride(0), BT=BLOCK_T, BI=BLOCK_I,
            GELU=gelu,
        )
    return out
