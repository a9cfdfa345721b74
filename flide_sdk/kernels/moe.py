"""The routed experts of an MoE FFN as two grouped GEMMs (`torch._grouped_mm`), with no host sync.

The (token, expert) pairs are sorted by expert; each expert's rows are one group of the gate|up GEMM and of the
down GEMM, whose group ends are the running counts of pairs per expert (computed on the device). The outputs go
back to pair order and each token sums its k weighted rows in one batched product (float32 accumulation, slot
order), so the result does not depend on how pairs were grouped (no atomics) and no float32 copy of the rows is
made. `moe_experts_reference` is the definition.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flide_sdk.kernels.reference import swiglu_reference


def moe_experts_grouped(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
    glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = swiglu_reference,
) -> torch.Tensor:
    """`moe_experts_reference`'s contract: x [T, H], gate_up [E, 2I, H], down [E, H, I], experts [T, k],
    weights [T, k] float32, glu(gate, up) the experts' activation -> [T, H] in x's dtype."""
    tokens, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    ends = counts.cumsum(0, dtype=torch.int32)
    rows = x[order // k]
    gate, up = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    y = torch._grouped_mm(glu(gate, up), down.transpose(1, 2), offs=ends)
    pairs = torch.empty_like(y)
    pairs[order] = y
    # [T, 1, k] x [T, k, H]: each token's k rows weighted and summed in float32 inside the product, in slot order
    return torch.bmm(weights.to(x.dtype)[:, None, :], pairs.view(tokens, k, -1))[:, 0]
