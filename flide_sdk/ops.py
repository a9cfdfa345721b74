"""The op interface the model forward calls for its stream-structured operations and its fused norms.

The model never touches request structure itself: attention, the gated delta rule and the Gated DeltaNet's
front (short convolution, gates, saved conv windows) read it from the round's metadata through the first
three functions. The RMS norms (plain, with the residual add folded in, the Gated DeltaNet's gated one, and
attention's q/k norm with the rotary embedding folded in) and the MLP's SwiGLU go through here too, so that
each is one kernel on CUDA instead of a chain of elementwise ops.
`reference_ops` binds the pure-torch definitions (CPU); `kernel_ops()` the Triton kernels; another kernel
set drops in by providing an `Ops` with the same signatures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flide_sdk.kernels.fork_attention import fork_attention_reference
from flide_sdk.kernels.gated_delta import gated_delta_reference
from flide_sdk.kernels.gdn_front import gdn_front_reference
from flide_sdk.kernels.kv_store import store_kv_reference
from flide_sdk.kernels.rms_norm import (
    add_rms_norm_reference,
    gated_rms_norm_reference,
    rms_norm_reference,
)
from flide_sdk.kernels.rotary import rms_norm_rotary_reference
from flide_sdk.kernels.swiglu import swiglu_reference
from flide_sdk.layout import AttentionPlan, DeltaPlan


@dataclass(frozen=True)
class Ops:
    fork_attention: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, AttentionPlan, torch.Tensor | None, torch.Tensor, torch.Tensor,
         torch.Tensor | None],
        torch.Tensor,
    ]
    """(q, k, v, plan, query_rows, k_cache, v_cache, gate) -> attention output [Tq, Hq, D] times sigmoid(gate)."""
    gated_delta: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, DeltaPlan, torch.Tensor], torch.Tensor
    ]
    gdn_front: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """(qkv [T, C], a, b [T, H], conv weight [C, K], A_log, dt_bias [H], window arena [S, K-1, C], resume_slots,
    conv src [T, K], save_slots, save src [n, K-1]) -> (silu(indexed conv) [T, C], g, beta float32 [T, H]),
    the saved windows written into the arena in place (`kernels.gdn_front`)."""
    store_kv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    """(k, v [T, Hkv, D], k_cache, v_cache [positions, Hkv, D], slots [T]): caches[slots] = k, v in place."""
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    """(x [..., D], weight [D], eps) -> x / rms(x) * (1 + weight) in weight's dtype (x may be wider)."""
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    """(x, delta, weight, eps) -> (s = x + delta in x's dtype, rms_norm(s, weight, eps))."""
    gated_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    """(x [..., D], gate [..., D], weight [D], eps) -> weight * rmsnorm(x) * silu(gate) in x's dtype."""
    rms_norm_rotary: Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor, torch.Tensor], torch.Tensor]
    """(x [T, H, D], weight [D], eps, cos [T, R], sin [T, R]) -> rms_norm(x) with its first R channels rotated
    (half-split), [T, H, D] contiguous in weight's dtype; cos and sin in weight's dtype."""
    swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(gate [T, I], up [T, I]) -> silu(gate) * up in their dtype."""


reference_ops = Ops(
    fork_attention=fork_attention_reference,
    gated_delta=gated_delta_reference,
    gdn_front=gdn_front_reference,
    store_kv=store_kv_reference,
    rms_norm=rms_norm_reference,
    add_rms_norm=add_rms_norm_reference,
    gated_rms_norm=gated_rms_norm_reference,
    rms_norm_rotary=rms_norm_rotary_reference,
    swiglu=swiglu_reference,
)


def kernel_ops() -> Ops:
    """The Triton kernels (used on CUDA; on CPU they run only under TRITON_INTERPRET=1, for tests)."""
    from flide_sdk.kernels.fork_attention import fork_attention_triton
    from flide_sdk.kernels.gated_delta import gated_delta_triton
    from flide_sdk.kernels.gdn_front import gdn_front_triton
    from flide_sdk.kernels.kv_store import store_kv_triton
    from flide_sdk.kernels.rms_norm import (
        add_rms_norm_triton,
        gated_rms_norm_triton,
        rms_norm_triton,
    )
    from flide_sdk.kernels.rotary import rms_norm_rotary_triton
    from flide_sdk.kernels.swiglu import swiglu_triton

    return Ops(
        fork_attention=fork_attention_triton,
        gated_delta=gated_delta_triton,
        gdn_front=gdn_front_triton,
        store_kv=store_kv_triton,
        rms_norm=rms_norm_triton,
        add_rms_norm=add_rms_norm_triton,
        gated_rms_norm=gated_rms_norm_triton,
        rms_norm_rotary=rms_norm_rotary_triton,
        swiglu=swiglu_triton,
    )


def ops_for(device: torch.device) -> Ops:
    """The op set the engine uses on `device`: kernels on CUDA, the torch references elsewhere."""
    return kernel_ops() if device.type == "cuda" else reference_ops
