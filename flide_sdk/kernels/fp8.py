"""FP8 projections: weights in float8_e4m3fn with one float32 scale per output row, activations quantized per token
on the device (dynamic: no calibration, no host sync), products through `torch._scaled_mm` with row-wise scales.

`Fp8Weight` is what a quantized projection holds in place of its weight tensor; `fp8_linear` is the op (CPU and
sm90), `fp8_linear_reference` its definition in float32 arithmetic on the dequantized operands. On CUDA the
tokens' quantization is one kernel (`kernels.fp8_quantize`) in place of `quantize_rows`, its definition. The routed
experts of an MoE FFN are weight-only FP8 (`moe_experts_fp8`): no grouped FP8 GEMM runs on every device a round
may run on (`torch._scaled_grouped_mm` is CUDA-only and wants 16-row groups), so their weights are dequantized to
the compute dtype per call and go through the compute dtype's grouped GEMMs (docs/decisions/fp8-weights.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flide_sdk.kernels.reference import swiglu_reference

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
MIN_SCALE = 1e-12  # an all-zero row's scale (its values quantize to 0 whatever it is)


@dataclass(frozen=True)
class Fp8Weight:
    """A projection's weight [..., N, K] as float8_e4m3fn `values` and a float32 `scale` [..., N] per output row:
    the weight is values * scale[..., None]."""

    values: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def rows(self, start: int, stop: int) -> Fp8Weight:
        """Output rows start:stop (views: a fused projection's part)."""
        return Fp8Weight(self.values[..., start:stop, :], self.scale[..., start:stop])

    def expert(self, index: int) -> Fp8Weight:
        """The `index`th of stacked weights (an MoE's expert; views)."""
        return Fp8Weight(self.values[index], self.scale[index])

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """values * scale in float32, cast to `dtype`."""
        return (self.values.float() * self.scale[..., None]).to(dtype)


def quantize_rows(x: torch.Tensor) -> Fp8Weight:
    """Each row of x [..., K] (any float dtype) as float8_e4m3fn times a float32 scale: the row's largest |value|
    maps to 448, every value rounded to nearest in float32 arithmetic (all on x's device, no sync)."""
    wide = x.float()
    scale = (wide.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)
    values = (wide / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(values, scale)


def concatenated(weights: list[Fp8Weight]) -> Fp8Weight:
    """The weights' rows one after the other (a fused projection)."""
    return Fp8Weight(torch.cat([w.values for w in weights]), torch.cat([w.scale for w in weights]))


def stacked(weights: list[Fp8Weight]) -> Fp8Weight:
    """The weights stacked on a new first dimension (an MoE's experts)."""
    return Fp8Weight(torch.stack([w.values for w in weights]), torch.stack([w.scale for w in weights]))


def fp8_linear(x: torch.Tensor, weight: Fp8Weight,
               quantize: Callable[[torch.Tensor], Fp8Weight] = quantize_rows) -> torch.Tensor:
    """x [T, K] @ weight.T -> [T, N] in x's dtype: x quantized per token (`quantize`: `quantize_rows` or its
    kernel), one row-wise scaled GEMM (float32 accumulation) with the token and weight scales applied to its
    output."""
    tokens = quantize(x)
    return torch._scaled_mm(tokens.values, weight.values.t(), scale_a=tokens.scale[:, None],
                            scale_b=weight.scale[None, :], out_dtype=x.dtype)


def fp8_linear_reference(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """`fp8_linear`'s definition: the per-token quantized x and the weight, both dequantized to float32, multiplied
    in float32; the product in x's dtype."""
    return (quantize_rows(x).dequantized() @ weight.dequantized().t()).to(x.dtype)


def moe_experts_fp8(
    experts_op: Callable[..., torch.Tensor],
    x: torch.Tensor, gate_up: Fp8Weight, down: Fp8Weight, experts: torch.Tensor, weights: torch.Tensor,
    glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = swiglu_reference,
) -> torch.Tensor:
    """The routed experts with FP8 weights: both stacks dequantized in x's dtype (values times scales, no float32
    copy of the stacks), then `experts_op` (the compute dtype's `moe_experts`: the grouped GEMMs on CUDA, the
    reference elsewhere) on x as it is."""
    return experts_op(x, in_dtype(gate_up, x.dtype), in_dtype(down, x.dtype), experts, weights, glu)


def in_dtype(weight: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """values * scale computed in `dtype` (float8 values are exact in bfloat16; the scale is rounded to it)."""
    return weight.values.to(dtype) * weight.scale[..., None].to(dtype)
