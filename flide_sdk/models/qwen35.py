"""Qwen3.5 text decoder (Gated DeltaNet + gated full attention, 3:1) over a round's flat stream; the MoE
models' FFN is routed experts plus a shared expert (`SparseMoE`, the experts through `ops.moe_experts`).

Parameter names mirror the Hugging Face checkpoints (`layers.N.linear_attn.in_proj_qkv.weight`, ...), so a
state dict loads by name. The forward reads request structure only through `RoundTensors` and the four
stream ops of `flide_sdk.models.ops`; everything else is per-token dense math, written to match
transformers' `Qwen3_5ForCausalLM` operation for operation. The RMS norms (q/k's with the rotary embedding,
in attention's front), the MLP's SwiGLU, the Gated DeltaNet's gates and the label softmax go through
`flide_sdk.models.ops` too (fused kernels on CUDA); the rotary cos/sin come from tables of every position, made
once (`rope_tables`). Each residual add is folded into the norm that reads its result: a layer returns its MLP
output still to be added, and the next layer's input norm (or the final norm) adds it as it reads it.
The hyper-parameters and their validation live in `flide_sdk.models.config`.
RMSNorm scales by (1 + w); attention queries carry an output gate (sigmoid) and q/k are RMS-normalised per
head before a partial rotary embedding; Gated DeltaNet runs a SiLU short convolution over q|k|v, decay
g = -exp(A_log) * softplus(a + dt_bias), rate beta = sigmoid(b), and a gated RMSNorm (w * norm(o) * silu(z)).
Selective readout: the last layer runs its token mixer's keys/values for every token but everything after
it only at the readout rows, and the head computes only the label rows (and, for options scored by their
text, the whole vocabulary at the rows that read their tokens).
Precision beyond the weights' dtype where it is cheap: the residual stream (the running sum of every
sublayer's output, one [T, hidden] tensor) is kept in `residual_dtype`, float32 by default, instead of being
rounded to bf16 at every add as transformers does; and the label logits are float32 dot products (a bf16
logit of magnitude 16 is rounded by up to 1/16, which moves an option's probability by up to ~3%).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from flide_sdk.kernels.fp8 import Fp8Weight, concatenated, stacked
from flide_sdk.models.config import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,  # noqa: F401  (device.pool imports it from here)
    Qwen35Config,
)
from flide_sdk.models.fp8 import hold
from flide_sdk.models.ops import Ops
from flide_sdk.plan.layout import RoundTensors

LayerCache = tuple[torch.Tensor, torch.Tensor]


class Readout(NamedTuple):
    """What a forward returns: each question's label log-probabilities [R, L] (float32, -inf past its labels; a
    text-scored question's row holds no answer) and the log-probability of each text read's token [X] (float32)."""

    label_logprobs: torch.Tensor
    text_logprobs: torch.Tensor
"""A layer's pool arenas: (keys, values) [pages * PAGE, Hkv, D], or (states [rows, Hv, Dk, Dv], windows [S, K-1, C]).
The state arena's rows are the pool's slots plus a zero row and scratch rows (`layout.StateRows`)."""


def rotary_tables(
    positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rotary_dim] for positions, frequencies computed in float32 and cast to `dtype`."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def mrope_tables(
    positions: torch.Tensor, axes: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rotary_dim] of M-RoPE positions [3, T]: frequency j turns by the position of axis `axes[j]`
    (a text token's three positions are equal: its rows are `rotary_tables`' to the bit)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    angles = positions.float()[axes].t() * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class Linear(nn.Module):
    """A bias-free linear layer whose weight is created uninitialised (checkpoints overwrite it)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        return ops.linear(x, self.weight)


class FusedProjections:
    """Bias-free projections of one input as a single GEMM: one weight matrix whose row blocks are the
    projections' weights (FP8 ones: their values and row scales, `kernels.fp8`). The projections' weights become
    views of it, so their names (checkpoint loading, state_dict) and their memory stay as they were."""

    def __init__(self, linears: Sequence[Linear]) -> None:
        self.sizes = [linear.weight.shape[0] for linear in linears]
        weights = [linear.weight for linear in linears]
        if isinstance(weights[0], Fp8Weight):
            self.weight: torch.Tensor | Fp8Weight = concatenated(weights)
            offset = 0
            for linear, size in zip(linears, self.sizes):
                hold(linear, "weight", self.weight.rows(offset, offset + size))
                offset += size
            return
        self.weight = torch.cat([weight.detach() for weight in weights])
        offset = 0
        for linear, size in zip(linears, self.sizes):
            linear.weight.data = self.weight[offset : offset + size]
            offset += size

    def __call__(self, x: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, ...]:
        return ops.linear(x, self.weight).split(self.sizes, dim=-1)


class ProjectionGroups:
    """Projections of one input whose weights are not alike (FP8 next to the compute dtype's): one GEMM per run of
    alike neighbours, the outputs in the projections' order."""

    def __init__(self, groups: Sequence[FusedProjections]) -> None:
        self.groups = list(groups)

    def __call__(self, x: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, ...]:
        return tuple(part for group in self.groups for part in group(x, ops))


def fuse(linears: Sequence[Linear]) -> FusedProjections | ProjectionGroups:
    """The projections as one GEMM (`FusedProjections`), or one per run of neighbours that are all FP8 or all not."""
    runs = [list(run) for _, run in itertools.groupby(linears, key=lambda linear: isinstance(linear.weight, Fp8Weight))]
    return FusedProjections(linears) if len(runs) == 1 else ProjectionGroups([FusedProjections(run) for run in runs])


def project(
    fused: FusedProjections | ProjectionGroups | None, linears: Sequence[Linear], x: torch.Tensor, ops: Ops
) -> tuple[torch.Tensor, ...]:
    """The projections of x: one GEMM when fused (`Qwen35Model.fuse_projections`), else one per projection."""
    return fused(x, ops) if fused is not None else tuple(linear(x, ops) for linear in linears)


class Weight(nn.Module):
    """A module holding one uninitialised `weight`, for checkpoint names such as `conv1d.weight`."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))


class DecisionHead(nn.Module):
    """A decision model's linear head over the final hidden state (`rows` scores, with bias), soft-capped when
    `softcap` is set; the label softmax reads only its rows of each question's options."""

    def __init__(self, hidden_size: int, rows: int, softcap: float | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.bias = nn.Parameter(torch.empty(rows))
        self.softcap = softcap


class RMSNorm(Weight):
    """Zero-centred RMSNorm (`flide_sdk.kernels.rms_norm`) over the last dimension, through the op set."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, delta: torch.Tensor | None, ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm) in one pass; with no delta, (x, norm of x)."""
        if delta is None:
            return x, self(x, ops)
        return ops.add_rms_norm(x, delta, self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, config: Qwen35Config, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = Linear(config.hidden_size, size)
        self.up_proj = Linear(config.hidden_size, size)
        self.down_proj = Linear(size, config.hidden_size)
        self.fused: FusedProjections | None = None

    def fuse(self) -> None:
        self.fused = FusedProjections([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        gate, up = project(self.fused, [self.gate_proj, self.up_proj], x, ops)
        return self.down_proj(ops.swiglu(gate, up), ops)


class SparseMoE(nn.Module):
    """Qwen3.5-MoE's FFN: top-k of the router's softmax, renormalised, weighting the chosen experts' SwiGLU MLPs,
    plus a shared expert scaled by a sigmoid gate. The experts keep the checkpoint's names
    (`experts.N.gate_proj.weight`, ...); `fuse` stacks them into gate|up [E, 2I, hidden] and down [E, hidden, I]
    for `ops.moe_experts` (their parameters become views), and runs the router, the shared expert's gate and its
    gate|up, which read the same input, as one GEMM."""

    def __init__(self, config: Qwen35Config) -> None:
        super().__init__()
        self.top_k = config.experts_per_token
        self.gate = Linear(config.hidden_size, config.num_experts)
        self.experts = nn.ModuleList(MLP(config, config.expert_size) for _ in range(config.num_experts))
        self.shared_expert = MLP(config)
        self.shared_expert_gate = Linear(config.hidden_size, 1)
        self.fused: FusedProjections | ProjectionGroups | None = None
        self.gate_up: torch.Tensor | Fp8Weight | None = None
        self.down: torch.Tensor | Fp8Weight | None = None

    @property
    def inputs(self) -> list[Linear]:
        return [self.gate, self.shared_expert_gate, self.shared_expert.gate_proj, self.shared_expert.up_proj]

    def fuse(self) -> None:
        self.fused = fuse(self.inputs)
        size = self.experts[0].gate_proj.weight.shape[0]
        if isinstance(self.experts[0].gate_proj.weight, Fp8Weight):
            self.gate_up = stacked([concatenated([e.gate_proj.weight, e.up_proj.weight]) for e in self.experts])
            self.down = stacked([e.down_proj.weight for e in self.experts])
            for index, expert in enumerate(self.experts):
                gate_up = self.gate_up.expert(index)
                hold(expert.gate_proj, "weight", gate_up.rows(0, size))
                hold(expert.up_proj, "weight", gate_up.rows(size, 2 * size))
                hold(expert.down_proj, "weight", self.down.expert(index))
            return
        self.gate_up = torch.stack([torch.cat([e.gate_proj.weight.detach(), e.up_proj.weight.detach()])
                                    for e in self.experts])
        self.down = torch.stack([e.down_proj.weight.detach() for e in self.experts])
        for index, expert in enumerate(self.experts):
            expert.gate_proj.weight.data = self.gate_up[index, :size]
            expert.up_proj.weight.data = self.gate_up[index, size:]
            expert.down_proj.weight.data = self.down[index]

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        router, shared_gate, gate, up = project(self.fused, self.inputs, x, ops)
        probabilities = torch.softmax(router.float(), dim=-1)
        weights, experts = torch.topk(probabilities, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        routed = ops.moe_experts(x, self.gate_up, self.down, experts, weights)
        shared = self.shared_expert.down_proj(ops.swiglu(gate, up), ops)
        return routed + torch.sigmoid(shared_gate) * shared


class GatedAttention(nn.Module):
    """Full attention with an output gate; queries only at `rows` when given (selective readout)."""

    def __init__(self, config: Qwen35Config) -> None:
        super().__init__()
        self.config = config
        c = config
        self.q_proj = Linear(c.hidden_size, c.num_heads * c.head_dim * 2)
        self.k_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim)
        self.v_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.fused: FusedProjections | None = None

    def fuse(self) -> None:
        self.fused = FusedProjections([self.q_proj, self.k_proj, self.v_proj])

    def forward(
        self, h: torch.Tensor, rnd: RoundTensors, ops: Ops, rope: tuple, rows: torch.Tensor | None, cache: LayerCache
    ) -> torch.Tensor:
        c = self.config
        cos_table, sin_table = rope
        if rows is None:  # queries at every token: one GEMM for q|gate, k and v
            q_gate, k, v = project(self.fused, [self.q_proj, self.k_proj, self.v_proj], h, ops)
        else:  # selective readout: queries at the readout rows only
            q_gate = self.q_proj(h[rows], ops)
            k, v = self.k_proj(h, ops), self.v_proj(h, ops)
        q, gate = q_gate.view(q_gate.shape[0], c.num_heads, 2 * c.head_dim).chunk(2, dim=-1)
        k = k.view(h.shape[0], c.num_kv_heads, c.head_dim)
        v = v.view(h.shape[0], c.num_kv_heads, c.head_dim)
        k_cache, v_cache = cache
        # q and k normalised and rotated, k and v contiguous (they share a layout) and saved into the pool (tokens
        # not saved go to its sink)
        q, k, v = ops.attention_front(q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos_table,
                                      sin_table, rnd.positions, rows, k_cache, v_cache, rnd.checkpoint.kv_slots)
        # the output gate is applied inside attention, on the view of q_gate (no copy of it)
        out = ops.fork_attention(q, k, v, rnd.attention, rows, k_cache, v_cache, gate).reshape(q_gate.shape[0], -1)
        return self.o_proj(out, ops)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer; its recurrent states of the round live in a per-round state table."""

    def __init__(self, config: Qwen35Config) -> None:
        super().__init__()
        self.config = config
        c = config
        key_dim = c.gdn_key_heads * c.gdn_key_dim
        value_dim = c.gdn_value_heads * c.gdn_value_dim
        self.in_proj_qkv = Linear(c.hidden_size, 2 * key_dim + value_dim)
        self.in_proj_z = Linear(c.hidden_size, value_dim)
        self.in_proj_b = Linear(c.hidden_size, c.gdn_value_heads)
        self.in_proj_a = Linear(c.hidden_size, c.gdn_value_heads)
        self.conv1d = Weight(c.conv_dim, 1, c.conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(c.gdn_value_heads))
        self.A_log = nn.Parameter(torch.empty(c.gdn_value_heads))
        self.norm = Weight(c.gdn_value_dim)
        self.out_proj = Linear(value_dim, c.hidden_size)
        self.fused: FusedProjections | ProjectionGroups | None = None
        self.conv_taps: torch.Tensor | None = None

    def fuse(self) -> None:
        self.fused = fuse([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])
        # the conv weights in float32, stored tap by tap ([K, C]; used as their [C, K] transpose): a kernel loads
        # a tap's channels 16 bytes at a time and multiplies without converting them (the same values: the conv
        # already summed in float32)
        self.conv_taps = self.conv1d.weight[:, 0, :].t().float().contiguous()

    def conv_weight(self) -> torch.Tensor:
        """The conv weights [C, K]: the float32 tap-major copy once fused."""
        return self.conv1d.weight[:, 0, :] if self.conv_taps is None else self.conv_taps.t()

    def forward(
        self, h: torch.Tensor, rnd: RoundTensors, ops: Ops, rope: tuple, rows: torch.Tensor | None, cache: LayerCache
    ) -> torch.Tensor:
        c = self.config
        tokens = h.shape[0]
        key_dim = c.gdn_key_heads * c.gdn_key_dim
        state_cache, window_cache = cache
        plan = rnd.checkpoint
        qkv, z, b, a = project(self.fused, [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a], h, ops)
        # resumed trunks read their checkpoints' conv windows straight from the arena (see layout); the
        # windows this round saves are written there in the same pass
        mixed, g, beta = ops.gdn_front(qkv, a, b, self.conv_weight(), self.A_log, self.dt_bias, window_cache,
                                       plan.resume_slots, rnd.conv_src, plan.save_slots, plan.save_window_src)
        q, k, v = mixed.split([key_dim, key_dim, c.gdn_value_heads * c.gdn_value_dim], dim=-1)
        q = q.view(tokens, c.gdn_key_heads, c.gdn_key_dim)
        k = k.view(tokens, c.gdn_key_heads, c.gdn_key_dim)
        v = v.view(tokens, c.gdn_value_heads, c.gdn_value_dim)
        core = ops.gated_delta(q, k, v, g, beta, rnd.delta, state_cache)  # states are read and saved in place
        if rows is not None:
            core, z = core[rows], z[rows]
        out = ops.gated_rms_norm(core, z.view(-1, c.gdn_value_heads, c.gdn_value_dim), self.norm.weight, c.rms_norm_eps)
        return self.out_proj(out.reshape(out.shape[0], -1), ops)


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen35Config, layer_type: str) -> None:
        super().__init__()
        self.is_attention = layer_type == FULL_ATTENTION
        if self.is_attention:
            self.self_attn = GatedAttention(config)
        else:
            self.linear_attn = GatedDeltaNet(config)
        self.mlp = SparseMoE(config) if config.is_moe else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        rnd: RoundTensors,
        ops: Ops,
        rope: tuple,
        rows: torch.Tensor | None,
        cache: LayerCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the residual stream x + delta (no delta: x alone); returns (x, delta) the same way.

        The returned delta is the MLP's output, left for the next norm to add. With `rows`, everything after
        the token mixer runs at those rows only, so the returned pair has one row per readout row.
        """
        mixer = self.self_attn if self.is_attention else self.linear_attn
        x, h = self.input_layernorm.add(x, delta, ops)
        mixed = mixer(h, rnd, ops, rope, rows, cache)
        x, h = self.post_attention_layernorm.add(x if rows is None else x[rows], mixed, ops)
        return x, self.mlp(h, ops)


class Qwen35Model(nn.Module):
    """The decoder; `forward(rnd, ops, caches)` returns each question's option log-probabilities [R, L] (float32) and
    the log-probabilities of its text reads (`Readout`).

    `caches[i]` is layer i's view of the checkpoint pool: (keys, values) arenas for an attention layer,
    (recurrent states, conv windows) arenas for a Gated DeltaNet layer.
    """

    def __init__(self, config: Qwen35Config, head: DecisionHead | None = None, lm_head: bool = True) -> None:
        super().__init__()
        self.config = config
        self.residual_dtype = torch.float32  # the residual stream's dtype (module docstring)
        self.embed_tokens = Weight(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, kind) for kind in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if lm_head and not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.decision_head = head  # when set, questions are read from its rows instead of label tokens'
        self._rope: tuple | None = None  # ((dtype, device), (cos, sin)): `rope_tables`

    def fuse_projections(self) -> None:
        """Run the projections that read the same input as one GEMM each, and lay the conv weights out tap by tap
        (after the weights are loaded)."""
        for layer in self.layers:
            (layer.self_attn if layer.is_attention else layer.linear_attn).fuse()
            layer.mlp.fuse()

    def projection_shapes(self) -> set[tuple[int, int]]:
        """The weight shapes the forward passes to `ops.linear`: every projection's, fused or not (not the head's:
        the label softmax reads its rows)."""
        head = getattr(self, "lm_head", None)
        experts = {m for layer in self.layers if isinstance(layer.mlp, SparseMoE) for m in layer.mlp.experts.modules()}
        shapes = {tuple(m.weight.shape) for m in self.modules()
                  if isinstance(m, Linear) and m is not head and m not in experts}
        for layer in self.layers:
            for part in (layer.self_attn if layer.is_attention else layer.linear_attn, layer.mlp):
                if part.fused is not None:
                    shapes.add(tuple(part.fused.weight.shape))
        return shapes

    def rope_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [max positions, rotary_dim] of every position (`rotary_tables`), in `dtype` on the weights'
        device; made on the first call (a pass outside a graph: capture warms up first) and kept."""
        key = (dtype, self.embed_tokens.weight.device)
        if self._rope is None or self._rope[0] != key:
            c = self.config
            positions = torch.arange(c.max_position_embeddings, device=key[1])
            self._rope = key, rotary_tables(positions, c.rotary_dim, c.rope_theta, dtype)
        return self._rope[1]

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def label_logprobs(self, h: torch.Tensor, label_ids: torch.Tensor, ops: Ops) -> torch.Tensor:
        """Each readout row's option log-probabilities: the decision head's rows, or the label tokens' logits."""
        head = self.decision_head
        if head is None:
            return ops.label_log_softmax(h, self.head_weight(), label_ids)
        return ops.label_log_softmax(h, head.weight, label_ids, head.bias, head.softcap)

    @torch.inference_mode()
    def forward(self, rnd: RoundTensors, ops: Ops, caches: Sequence[LayerCache]) -> Readout:
        embedded = F.embedding(rnd.ids, self.embed_tokens.weight)
        rope = None
        if rnd.images is not None:  # image pads take the tower's rows; rotary tables of the round's own positions
            images, c = rnd.images, self.config
            embedded = embedded.index_copy(0, images.rows, images.embeds.to(embedded.dtype))
            rope = mrope_tables(images.positions, images.axes, c.rotary_dim, c.rope_theta, embedded.dtype)
            rnd = dataclasses.replace(rnd, positions=torch.arange(embedded.shape[0], device=embedded.device))
        readout, rows = rnd.readout, rnd.readout.rows
        if readout.text_rows.numel():  # the label rows and the text reads' rows, in stream order (query rows are)
            rows, order = torch.sort(torch.cat([readout.rows, readout.text_rows]))
            place = torch.empty_like(order)
            place[order] = torch.arange(order.shape[0], device=order.device)
        # what attention derives from the round's metadata is built once per pass, inside it: a graph captured
        # after a warm-up pass on the same round tensors must contain its build
        if any(layer.is_attention for layer in self.layers):
            c = self.config
            attention = ops.attention_tiles(rnd.attention, rows if self.layers[-1].is_attention else None,
                                            c.num_heads, c.num_kv_heads, c.head_dim, embedded.dtype)
            rnd = dataclasses.replace(rnd, attention=attention)
        if not all(layer.is_attention for layer in self.layers):
            c = self.config
            delta = ops.delta_workspace(rnd.delta, embedded.shape[0], c.gdn_value_heads, c.gdn_key_dim,
                                        c.gdn_value_dim, embedded.dtype, embedded.device)
            rnd = dataclasses.replace(rnd, delta=delta)
        rope = rope or self.rope_tables(embedded.dtype)
        x = embedded.to(self.residual_dtype)
        last = len(self.layers) - 1
        delta = None  # each layer's MLP output, added to the stream by the next norm
        for index, (layer, cache) in enumerate(zip(self.layers, caches)):
            x, delta = layer(x, delta, rnd, ops, rope, rows if index == last else None, cache)
        _, h = self.norm.add(x, delta, ops)  # [R (+ X), hidden]
        if not readout.text_rows.numel():
            # [R, L]; label ids -1 where a question has fewer labels
            logprobs = self.label_logprobs(h, readout.label_ids, ops)
            return Readout(logprobs, h.new_zeros(0, dtype=torch.float32))
        questions = readout.rows.shape[0]
        logprobs = self.label_logprobs(h[place[:questions]], readout.label_ids, ops)
        return Readout(logprobs, ops.token_logprobs(h[place[questions:]], self.head_weight(), readout.text_targets))
