"""Indexed short causal convolution (depthwise, kernel K) followed by SiLU, over a round's flat stream.

Each token reads itself and its K-1 predecessors through `src` instead of through its stream neighbours.
An index names a row of the virtual table [zero row, stream rows x, saved conv windows]: 0 is the zero
row, 1 + t is stream token t, 1 + T + j is saved window row j. So a branch's first tokens read the last
tokens of its trunk, a resumed trunk reads its checkpoint's window, and a position before the start of a
prompt reads zeros. The table is never materialised: `conv_rows` resolves indices for small gathers (the
windows a checkpoint saves) and the kernel resolves them while it loads.
`indexed_conv_reference` is the definition; `indexed_conv_triton` the kernel (one pass, SiLU fused).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_T = 32
BLOCK_C = 128


def conv_rows(x: torch.Tensor, windows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of the virtual table [zero row, x, windows] at `index` (any shape), as [*index.shape, C]."""
    total = x.shape[0]
    from_stream = x[(index - 1).clamp(0, max(total - 1, 0))] if total else x.new_zeros(*index.shape, x.shape[1])
    from_window = windows[(index - 1 - total).clamp(min=0)] if windows.shape[0] else torch.zeros_like(from_stream)
    rows = torch.where((index > total)[..., None], from_window, from_stream)
    return torch.where((index == 0)[..., None], torch.zeros_like(rows), rows)


def indexed_conv_reference(x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """silu(sum_j weight[:, j] * table[src[t, j]]) for every token t.

    x: [T, C] stream rows; windows: [W, C] saved window rows; weight: [C, K] (tap K-1 is the token itself);
    src: [T, K]. Returns [T, C] in x's dtype; the sum runs in weight's dtype.
    """
    gathered = conv_rows(x, windows, src).to(weight.dtype)  # [T, K, C]
    mixed = (gathered * weight.t()[None]).sum(dim=1)
    return F.silu(mixed).to(x.dtype)


@triton.jit
def _indexed_conv_kernel(
    x_ptr, windows_ptr, weight_ptr, src_ptr, out_ptr, total, channels,
    stride_x, stride_w, stride_weight, stride_src, stride_out,
    TAPS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    tokens = tl.program_id(0) * BT + tl.arange(0, BT)
    chans = tl.program_id(1) * BC + tl.arange(0, BC)
    token_ok = tokens < total
    chan_ok = chans < channels
    acc = tl.zeros((BT, BC), tl.float32)
    for tap in tl.static_range(TAPS):
        index = tl.load(src_ptr + tokens * stride_src + tap, mask=token_ok, other=0)
        in_stream = (index >= 1) & (index <= total)
        in_window = index > total
        both = chan_ok[None, :]
        from_stream = tl.load(x_ptr + (index - 1)[:, None] * stride_x + chans[None, :],
                              mask=(in_stream & token_ok)[:, None] & both, other=0.0)
        from_window = tl.load(windows_ptr + (index - 1 - total)[:, None] * stride_w + chans[None, :],
                              mask=(in_window & token_ok)[:, None] & both, other=0.0)
        weight = tl.load(weight_ptr + chans * stride_weight + tap, mask=chan_ok, other=0.0).to(tl.float32)
        acc += (from_stream.to(tl.float32) + from_window.to(tl.float32)) * weight[None, :]
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + tokens[:, None] * stride_out + chans[None, :], out.to(out_ptr.dtype.element_ty),
             mask=token_ok[:, None] & chan_ok[None, :])


def indexed_conv_triton(x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """The Triton kernel behind the same contract as `indexed_conv_reference` (sum in float32)."""
    total, channels = x.shape
    out = torch.empty_like(x)
    windows = windows if windows.shape[0] else x[:1]  # never read when no window rows exist
    grid = (triton.cdiv(total, BLOCK_T), triton.cdiv(channels, BLOCK_C))
    _indexed_conv_kernel[grid](
        x, windows, weight, src, out, total, channels,
        x.stride(0), windows.stride(0), weight.stride(0), src.stride(0), out.stride(0),
        TAPS=src.shape[1], BT=BLOCK_T, BC=BLOCK_C,
    )
    return out
