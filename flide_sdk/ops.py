"""The op interface the model forward calls for its three stream-structured operations.

The model never touches request structure itself: attention, the gated delta rule and the short
convolution read it from the round's metadata through these three functions. `reference_ops` binds the
pure-torch definitions (CPU, and CUDA until the Triton kernels replace them); a kernel set drops in by
providing another `Ops` with the same signatures.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flide_sdk.kernels.fork_attention import fork_attention_reference
from flide_sdk.kernels.gated_delta import gated_delta_reference
from flide_sdk.kernels.short_conv import indexed_conv_reference
from flide_sdk.layout import AttentionPlan, DeltaPlan


@dataclass(frozen=True)
class Ops:
    fork_attention: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, AttentionPlan, torch.Tensor | None, torch.Tensor, torch.Tensor],
        torch.Tensor,
    ]
    gated_delta: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, DeltaPlan, torch.Tensor], torch.Tensor
    ]
    indexed_conv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


reference_ops = Ops(
    fork_attention=fork_attention_reference,
    gated_delta=gated_delta_reference,
    indexed_conv=indexed_conv_reference,
)



def kernel_ops() -> Ops:
    """The Triton kernels (used on CUDA; on CPU they run only under TRITON_INTERPRET=1, for tests)."""
    from flide_sdk.kernels.fork_attention import fork_attention_triton
    from flide_sdk.kernels.gated_delta import gated_delta_triton
    from flide_sdk.kernels.short_conv import indexed_conv_triton

    # float32 W/U/q-k blocks in the Gated DeltaNet scan: with 16-bit storage the bf16 engine's answers drifted
    # further from float32 than transformers' own bf16 (benchmarks/results, fidelity); exactness first
    gated_delta = functools.partial(gated_delta_triton, store_dtype=torch.float32, scan_warps=8)
    return Ops(fork_attention=fork_attention_triton, gated_delta=gated_delta, indexed_conv=indexed_conv_triton)


def ops_for(device: torch.device) -> Ops:
    """The op set the engine uses on `device`: kernels on CUDA, the torch references elsewhere."""
    return kernel_ops() if device.type == "cuda" else reference_ops
