"""Indexed short causal convolution (depthwise, kernel K) followed by SiLU, over a round's flat stream.

Each token reads its K-1 predecessors through `src` instead of through its stream neighbours, so a
branch's first tokens read the last tokens of its trunk, and a position before the start of a prompt
reads a zero row. Row 0 of the gathered table is that zero row and row 1 + t is stream token t.
`indexed_conv_reference` is the definition, used on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def indexed_conv_reference(x: torch.Tensor, weight: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """silu(sum_j weight[:, j] * rows[src[t, j]]) for every token t.

    x: [T, C]; weight: [C, K] (tap K-1 is the token itself); src: [T, K] rows of cat(zero row, x).
    Returns [T, C] in x's dtype; the sum runs in weight's dtype.
    """
    rows = torch.cat([x.new_zeros(1, x.shape[1]), x]).to(weight.dtype)
    gathered = rows[src]  # [T, K, C]
    mixed = (gathered * weight.t()[None]).sum(dim=1)
    return F.silu(mixed).to(x.dtype)
