"""The op interface the model forward calls for its stream-structured operations and its fused norms.

The model never touches request structure itself: attention (with a sliding window where a layer has one), the
gated delta rule, the Gated DeltaNet's front (short convolution, gates, saved conv windows) and attention's
front (q/k norms with the rotary embedding, the keys and values saved into the pool) read it from the round's
metadata through the first four functions. The RMS norms (plain, with the residual add folded in, Gemma 4's
output norm with the add, its layer scalar and the next norm, the Gated DeltaNet's gated one, a query head's with
its rotary embedding), the MLP's SwiGLU (Qwen3.5) or GeGLU (Gemma 4), the readout's label log-softmax and its
token log-probabilities go through here too, so that each is one kernel on CUDA instead of a chain of
elementwise ops. Norms scale by (offset + w): offset 1 for Qwen3.5's zero-centred weights, 0 for Gemma 4's.
So do an MoE FFN's routed experts (`moe_experts`: grouped GEMMs on CUDA). The projections (`linear`) go
through here as well, so the batch-invariant mode can swap in its fixed-order GEMM.
An FP8 engine's table (`fp8_ops`) sends a projection whose weight is a `kernels.fp8.Fp8Weight` to the FP8 GEMM and
the routed experts' FP8 stacks through their dequantized form; every other op is its compute dtype's.
`reference_ops` binds the pure-torch definitions (CPU); `invariant_reference_ops` their fixed-order forms
(`kernels.fixed_order`); `kernel_ops()` the Triton kernels; another kernel set drops in by providing an `Ops`
with the same signatures.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from flide_sdk.kernels import fixed_order
from flide_sdk.kernels.fp8 import Fp8Weight, fp8_linear, moe_experts_fp8
from flide_sdk.kernels.plans import AttentionPlan, DeltaPlan
from flide_sdk.kernels.reference import (
    add_rms_norm_reference,
    attention_front_reference,
    fork_attention_reference,
    gated_delta_reference,
    gated_rms_norm_reference,
    gdn_front_reference,
    geglu_reference,
    label_log_softmax_reference,
    moe_experts_reference,
    norm_add_reference,
    rms_norm_reference,
    rms_norm_rotary_reference,
    swiglu_reference,
    token_logprobs_reference,
)


@dataclass(frozen=True)
class Ops:
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(x [T, K], weight [N, K]) -> x @ weight.T [T, N] in x's dtype: every projection of the model."""
    fork_attention: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, AttentionPlan, torch.Tensor | None, torch.Tensor, torch.Tensor,
         torch.Tensor | None],
        torch.Tensor,
    ]
    """(q, k, v, plan, query_rows, k_cache, v_cache, gate[, scale=, window=]) -> attention output [Tq, Hq, D] times
    sigmoid(gate) (no gate: as it is); scores scaled by `scale` (None: 1/sqrt(D)); a sliding `window` hides the
    keys at positions window or more before the query's (`kernels.reference.fork_attention_reference`)."""
    attention_tiles: Callable[[AttentionPlan, torch.Tensor | None, int, int, int, torch.dtype], AttentionPlan]
    """(plan, readout rows or None, query heads, key/value heads, head dim, q's dtype) -> the plan with what `fork_attention`
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
    positions [T], query rows [Tq] or None, k_cache, v_cache [pool positions, Hkv, D], slots [T][, offset=]) ->
    (q, k normalised and rotated, v) contiguous, k and v written into the caches at slots (`kernels.attention_front`)."""
    rms_norm_rotary: Callable[..., torch.Tensor]
    """(x [T, H, D], weight [D], eps, cos, sin [T, R][, offset=]) -> rms_norm(x) with its first R channels rotated:
    the queries of a layer that reads another's keys and values."""
    rms_norm: Callable[..., torch.Tensor]
    """(x [..., D], weight [D], eps[, offset=]) -> x / rms(x) * (offset + weight) in weight's dtype (x may be
    wider; offset 1 by default)."""
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    """(x, delta, weight, eps[, offset=]) -> (s = x + delta in x's dtype, rms_norm(s, weight, eps, offset))."""
    norm_add: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    """(x, delta, weight, eps[, offset=, scale=, next_weight=]) -> (s = (x + rms_norm(delta, weight)) * scale in x's
    dtype, rms_norm(s, next_weight) or None): a sublayer's output norm, the residual add, the layer scalar [1] and
    the next norm (Gemma 4's sandwich norms)."""
    gated_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    """(x [..., D], gate [..., D], weight [D], eps) -> weight * rmsnorm(x) * silu(gate) in x's dtype."""
    swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(gate [T, I], up [T, I]) -> silu(gate) * up in their dtype."""
    geglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(gate [T, I], up [T, I]) -> gelu_tanh(gate) * up in their dtype."""
    moe_experts: Callable[..., torch.Tensor]
    """(x [T, H], gate_up [E, 2I, H], down [E, H, I], experts [T, k], weights [T, k] float32[, glu]) -> the
    weighted sum of each token's experts' gated MLPs [T, H] in x's dtype, glu(gate, up) their activation (SwiGLU
    by default; `kernels.reference.moe_experts_reference`)."""
    label_log_softmax: Callable[..., torch.Tensor]
    """(h [R, hidden], head weight [vocab, hidden], label ids [R, L], -1 for none[, bias [rows], softcap]) ->
    float32 log_softmax over each row's label logits (float32 dot products, plus a decision head's bias,
    soft-capped) [R, L], -inf where a row has no label."""
    token_logprobs: Callable[..., torch.Tensor]
    """(h [X, hidden], head weight [vocab, hidden], target ids [X][, softcap]) -> float32 log-probability of each
    row's target under the softmax over the whole vocabulary (float32 logits, soft-capped when `softcap` is set)
    [X]; a row's value independent of the others."""


def _plan_itself(plan: AttentionPlan | DeltaPlan, *_: object) -> AttentionPlan | DeltaPlan:
    return plan


reference_ops = Ops(
    linear=F.linear,
    fork_attention=fork_attention_reference,
    attention_tiles=_plan_itself,
    gated_delta=gated_delta_reference,
    delta_workspace=_plan_itself,
    gdn_front=gdn_front_reference,
    attention_front=attention_front_reference,
    rms_norm_rotary=rms_norm_rotary_reference,
    rms_norm=rms_norm_reference,
    add_rms_norm=add_rms_norm_reference,
    norm_add=norm_add_reference,
    gated_rms_norm=gated_rms_norm_reference,
    swiglu=swiglu_reference,
    geglu=geglu_reference,
    moe_experts=moe_experts_reference,
    label_log_softmax=label_log_softmax_reference,
    token_logprobs=token_logprobs_reference,
)


# the batch-invariant mode on CPU: every reduction in a fixed order, pointwise functions independent of position
invariant_reference_ops = replace(
    reference_ops,
    linear=fixed_order.linear_fixed,
    fork_attention=fixed_order.fork_attention_fixed,
    gated_delta=fixed_order.gated_delta_fixed,
    gdn_front=fixed_order.gdn_front_fixed,
    attention_front=fixed_order.attention_front_fixed,
    rms_norm_rotary=fixed_order.rms_norm_rotary_fixed,
    rms_norm=fixed_order.rms_norm_fixed,
    add_rms_norm=fixed_order.add_rms_norm_fixed,
    norm_add=fixed_order.norm_add_fixed,
    gated_rms_norm=fixed_order.gated_rms_norm_fixed,
    swiglu=fixed_order.swiglu_fixed,
    geglu=fixed_order.geglu_fixed,
    label_log_softmax=fixed_order.label_log_softmax_fixed,
    token_logprobs=fixed_order.token_logprobs_fixed,
)


def kernel_ops(batch_invariant: bool = False) -> Ops:
    """The Triton kernels (used on CUDA; on CPU they run only under TRITON_INTERPRET=1, for tests). Batch
    invariant: the fixed-tile GEMM (`kernels.matmul`) for every projection (an engine keeps cuBLAS for the
    shapes `matmul.plan_linear` shows to sum alike), and attention tiles of one piece without key splits
    (`fork_attention_config`); the other kernels reduce per token or per chunk in one order already."""
    from flide_sdk.kernels.attention_front import attention_front_triton
    from flide_sdk.kernels.fork_attention import attention_tiles, fork_attention_config, fork_attention_triton
    from flide_sdk.kernels.gated_delta import delta_workspace, gated_delta_triton
    from flide_sdk.kernels.gdn_front import gdn_front_triton
    from flide_sdk.kernels.label_softmax import label_log_softmax_triton
    from flide_sdk.kernels.matmul import linear_triton
    from flide_sdk.kernels.moe import moe_experts_grouped
    from flide_sdk.kernels.rms_norm import (
        add_rms_norm_triton,
        gated_rms_norm_triton,
        norm_add_triton,
        rms_norm_triton,
    )
    from flide_sdk.kernels.rotary import rms_norm_rotary_triton
    from flide_sdk.kernels.swiglu import geglu_triton, swiglu_triton
    from flide_sdk.kernels.token_logprobs import token_logprobs_triton

    tiles, attention = attention_tiles, fork_attention_triton
    if batch_invariant:
        def tiles(plan, readout_rows, heads, kv_heads, head_dim, dtype):
            return attention_tiles(plan, readout_rows, heads, kv_heads, head_dim, dtype,
                                   fork_attention_config(dtype, True, head_dim=head_dim))

        def attention(q, k, v, plan, query_rows, k_cache, v_cache, gate=None, *, scale=None, window=None):
            return fork_attention_triton(q, k, v, plan, query_rows, k_cache, v_cache, gate, scale=scale,
                                         window=window,
                                         config=fork_attention_config(q.dtype, True, head_dim=q.shape[2]))

    return Ops(
        linear=linear_triton if batch_invariant else F.linear,
        fork_attention=attention,
        attention_tiles=tiles,
        gated_delta=gated_delta_triton,
        delta_workspace=delta_workspace,
        gdn_front=gdn_front_triton,
        attention_front=attention_front_triton,
        rms_norm_rotary=rms_norm_rotary_triton,
        rms_norm=rms_norm_triton,
        add_rms_norm=add_rms_norm_triton,
        norm_add=norm_add_triton,
        gated_rms_norm=gated_rms_norm_triton,
        swiglu=swiglu_triton,
        geglu=geglu_triton,
        moe_experts=moe_experts_grouped,
        label_log_softmax=label_log_softmax_triton,
        token_logprobs=token_logprobs_triton,
    )


def fp8_ops(base: Ops, product: Callable[[torch.Tensor, Fp8Weight], torch.Tensor] = fp8_linear) -> Ops:
    """`base` for a model holding FP8 projections: a projection whose weight is an `Fp8Weight` goes to `product`
    (the row-wise scaled GEMM; `kernels.fp8.fp8_linear_reference` is its definition), any other to `base.linear`;
    the routed experts' FP8 stacks are dequantized for `base.moe_experts`."""

    def linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight) -> torch.Tensor:
        return product(x, weight) if isinstance(weight, Fp8Weight) else base.linear(x, weight)

    return replace(base, linear=linear, moe_experts=functools.partial(moe_experts_fp8, base.moe_experts))


def ops_for(device: torch.device, batch_invariant: bool = False, fp8: bool = False) -> Ops:
    """The op set the engine uses on `device`: kernels on CUDA, the torch references elsewhere; in the
    batch-invariant mode, their fixed-order forms; for a model with FP8 projections, `fp8_ops` of those."""
    if device.type == "cuda":
        from flide_sdk.kernels.fp8_quantize import quantize_rows_triton

        ops = kernel_ops(batch_invariant)
        product = functools.partial(fp8_linear, quantize=quantize_rows_triton)
    else:
        ops = invariant_reference_ops if batch_invariant else reference_ops
        product = fp8_linear
    return fp8_ops(ops, product) if fp8 else ops
