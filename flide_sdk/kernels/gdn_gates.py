"""The Gated DeltaNet's per-token, per-head gates, both in one pass: the decay g and the write rate beta.

    beta = sigmoid(b)                                     (in b's dtype, then float32, as torch rounds it)
    g    = -exp(A_log) * softplus(a + dt_bias)            (float32)

a and b are [T, H] column blocks of the fused input projection (strided rows); A_log and dt_bias are [H].
In torch these are about six tiny launches per layer (sigmoid, casts, exp, add, softplus, products); here
they are one. torch's softplus (beta 1, threshold 20) returns x for x > 20 and log1p(exp(x)) otherwise;
the kernel computes max(x, 0) + log1p(exp(-|x|)), which never overflows and already rounds to x in
float32 for x > 15, so it meets the threshold branch without one. `gdn_gates_reference` is the
definition; `gdn_gates_triton` the kernel. Launch shapes depend on tensor shapes only (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flide_sdk.kernels import TileLaunch

TILE = 1024  # elements a program holds: a block of tokens times the padded head count


@triton.jit
def _log1p(y):
    """log(1 + y) for y in [0, 1], accurate where u = 1 + y rounds away y's low bits: log(u) * y / (u - 1)
    cancels that rounding."""
    u = 1.0 + y
    exact = u == 1.0
    return tl.where(exact, y, tl.log(u) * y / tl.where(exact, 1.0, u - 1.0))


@triton.jit
def _gates_tile(
    a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, tokens, heads, stride_a, stride_b, token_block,
    BT: tl.constexpr, BH: tl.constexpr,
):
    """g and beta of the BT tokens of one block, all heads (BH: the head count padded to a power of two)."""
    row = (token_block * BT + tl.arange(0, BT)).to(tl.int64)
    head = tl.arange(0, BH)
    head_ok = head < heads
    ok = (row < tokens)[:, None] & head_ok[None, :]
    b = tl.load(b_ptr + row[:, None] * stride_b + head[None, :], mask=ok, other=0.0)
    beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)  # rounded to b's dtype, as torch does
    a = tl.load(a_ptr + row[:, None] * stride_a + head[None, :], mask=ok, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + head, mask=head_ok, other=0.0).to(tl.float32)
    decay_rate = tl.exp(tl.load(a_log_ptr + head, mask=head_ok, other=0.0).to(tl.float32))
    x = a + dt_bias[None, :]
    softplus = tl.maximum(x, 0.0) + _log1p(tl.exp(-tl.abs(x)))
    out = row[:, None] * heads + head[None, :]
    tl.store(g_ptr + out, -decay_rate[None, :] * softplus, mask=ok)
    tl.store(beta_ptr + out, beta, mask=ok)


@triton.jit
def _gdn_gates_kernel(
    a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, tokens, heads, stride_a, stride_b,
    BT: tl.constexpr, BH: tl.constexpr,
):
    _gates_tile(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, tokens, heads, stride_a, stride_b,
                tl.program_id(0), BT, BH)


def gates_launch(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> TileLaunch:
    """Checks the shapes; `_gates_tile`'s launch over token blocks (none without heads), g and beta new."""
    heads = A_log.shape[0]
    if a.shape != b.shape or a.dim() != 2 or a.shape[1] != heads or dt_bias.shape != A_log.shape:
        raise ValueError(f"gdn_gates: a {tuple(a.shape)}, b {tuple(b.shape)}, A_log {tuple(A_log.shape)}, "
                         f"dt_bias {tuple(dt_bias.shape)}")
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    tokens = a.shape[0]
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    block_h = triton.next_power_of_2(max(heads, 1))
    block_t = max(1, TILE // block_h)
    arguments = (a, b, A_log.contiguous(), dt_bias.contiguous(), g, beta, tokens, heads, a.stride(0), b.stride(0))
    blocks = triton.cdiv(tokens, block_t) if heads else 0
    return TileLaunch(arguments, {"BT": block_t, "BH": block_h}, (blocks,), (g, beta))


def gdn_gates_triton(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel behind the contract of `gdn_gates_reference` (a, b [T, H]; A_log, dt_bias [H])."""
    gates = gates_launch(a, b, A_log, dt_bias)
    if gates.grid[0]:
        _gdn_gates_kernel[gates.grid](*gates.arguments, **gates.constants)
    return gates.outputs
