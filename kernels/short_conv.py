"""Indexed short causal convolution (depthwise, kernel K) followed by SiLU, over a round's flat stream.

Each token reads itself and its K-1 predecessors through `src`, rows of a table the caller builds as
[zero row, stream tokens, saved conv windows], instead of through its stream neighbours: so a branch's
first tokens read the last tokens of its trunk, a resumed trunk reads its checkpoint's window, and a
position before the start of a prompt reads the zero row. `indexed_conv_reference` is the definition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def indexed_conv_reference(table: torch.Tensor, weight: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """silu(sum_j weight[:, j] * table[src[t, j]]) for every token t.

    table: [rows, C]; weight: [C, K] (tap K-1 is the token itself); src: [T, K].
    Returns [T, C] in the table's dtype; the sum runs in weight's dtype.
    """
    gathered = table[src].to(weight.dtype)  # [T, K, C]
    mixed = (gathered * weight.t()[None]).sum(dim=1)
    return F.silu(mixed).to(table.dtype)
