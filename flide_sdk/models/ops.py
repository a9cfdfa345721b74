"""The op interface the model forward calls for its stream-structured operations and its fused norms.

The model never touches request structure itself: attention, the gated delta rule, the Gated DeltaNet's
front (short convolution, gates, saved conv windows) and attention's front (q/k norms with the rotary
embedding, the keys and values saved into the pool) read it from the round's metadata through the first four
functions. The RMS norms (plain, with the residual add folded in, the Gated DeltaNet's gated one), the MLP's
SwiGLU and the readout's label softmax go through here too, so that each is one kernel on CUDA instead of a
chain of elementwise ops.
`reference_ops` binds the pure-torch definitions (CPU); `kernel_ops()` the Triton kernels; another kernel
set drops in by providing an `Ops` with the same signatures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flide_sdk.kernels.plans import AttentionPlan, DeltaPlan
from flide_sdk.kernels.reference import (
    add_rms_norm_reference,
    attention_front_reference,
    fork_attention_reference,
    gated_delta_reference,
    gated_rms_norm_reference,
    gdn_front_reference,
    label_softmax_reference,
    rms_norm_reference,
    swiglu_reference,
)


@dataclass(frozen=True)
class Ops:
    fork_attention: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, AttentionPlan, torch.Tensor | None, torch.Tensor, torch.Tensor,
         torch.Tensor | None],
        torch.Tensor,
    ]
    """(q, k, v, plan, query_rows, k_cache, v_cache, gate) -> attention output [Tq, Hq, D] times sigmoid(gate)."""
    attention_tiles: Callable[[AttentionPlan, torch.Tensor | None, int, int, torch.dtype], AttentionPlan]
    """(plan, readout rows or None, query heads, key/value heads, q's dtype) -> the plan with what `fork_attention`
    derives from it once per forward pass (the kernel's tile tables; the reference needs none: the plan itself)."""
    gated_delta: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, DeltaPlan, torch.Tensor], torch.Tensor
    ]
    delta_workspace: Callable[[DeltaPlan, int, int, int, int, torch.dtype, torch.device], DeltaPlan]
    """(plan, stream tokens, value heads, key dim, value dim, q/k/v dtype, device) -> the plan with what
    `gated_delta` needs once per forward pass (the kernel's work tables in one allocation; the reference needs
    none: the plan itself)."""
    gdn_front: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """(qkv [T, C], a, b [T, H], conv weight [C, K], A_log, dt_bias [H], window arena [S, K-1, C], resume_slots,
    conv src [T, K], save_slots, save src [n, K-1]) -> (silu(indexed conv) [T, C], g, beta float32 [T, H]),
    the saved windows written into the arena in place (`kernels.gdn_front`)."""
    attention_front: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """(q [Tq, H, D], k, v [T, Hkv, D], q norm weight, k norm weight [D], eps, cos/sin tables [positions, R],
    positions [T], query rows [Tq] or None, k_cache, v_cache [pool positions, Hkv, D], slots [T]) -> (q, k
    normalised and rotated, v) contiguous, k and v written into the caches at slots (`kernels.attention_front`)."""
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    """(x [..., D], weight [D], eps) -> x / rms(x) * (1 + weight) in weight's dtype (x may be wider)."""
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    """(x, delta, weight, eps) -> (s = x + delta in x's dtype, rms_norm(s, weight, eps))."""
    gated_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    """(x [..., D], gate [..., D], weight [D], eps) -> weight * rmsnorm(x) * silu(gate) in x's dtype."""
    swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(gate [T, I], up [T, I]) -> silu(gate) * up in their dtype."""
    label_softmax: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    """(h [R, hidden], head weight [vocab, hidden], label ids [R, L], -1 for none) -> float32 softmax over each
    row's label logits (float32 dot products) [R, L]."""


def _plan_itself(plan: AttentionPlan | DeltaPlan, *_: object) -> AttentionPlan | DeltaPlan:
    return plan


reference_ops = Ops(
    fork_attention=fork_attention_reference,
    attention_tiles=_plan_itself,
    gated_delta=gated_delta_reference,
    delta_workspace=_plan_itself,
    gdn_front=gdn_front_reference,
    attention_front=attention_front_reference,
    rms_norm=rms_norm_reference,
    add_rms_norm=add_rms_norm_reference,
    gated_rms_norm=gated_rms_norm_reference,
    swiglu=swiglu_reference,
    label_softmax=label_softmax_reference,
)


def kernel_ops() -> Ops:
    """The Triton kernels (used on CUDA; on CPU they run only under TRITON_INTERPRET=1, for tests)."""
    from flide_sdk.kernels.attention_front import attention_front_triton
    from flide_sdk.kernels.fork_attention import attention_tiles, fork_attention_triton
    from flide_sdk.kernels.gated_delta import delta_workspace, gated_delta_triton
    from flide_sdk.kernels.gdn_front import gdn_front_triton
    from flide_sdk.kernels.label_softmax import label_softmax_triton
    from flide_sdk.kernels.rms_norm import (
        add_rms_norm_triton,
        gated_rms_norm_triton,
        rms_norm_triton,
    )
    from flide_sdk.kernels.swiglu import swiglu_triton

    return Ops(
        fork_attention=fork_attention_triton,
        attention_tiles=attention_tiles,
        gated_delta=gated_delta_triton,
        delta_workspace=delta_workspace,
        gdn_front=gdn_front_triton,
        attention_front=attention_front_triton,
        rms_norm=rms_norm_triton,
        add_rms_norm=add_rms_norm_triton,
        gated_rms_norm=gated_rms_norm_triton,
        swiglu=swiglu_triton,
        label_softmax=label_softmax_triton,
    )


def ops_for(device: torch.device) -> Ops:
    """The op set the engine uses on `device`: kernels on CUDA, the torch references elsewhere."""
    return kernel_ops() if device.type == "cuda" else reference_ops
