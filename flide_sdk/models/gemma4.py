"""Gemma 4 text decoder (sliding-window and full attention layers) over a round's flat stream, written to match
transformers' `Gemma4ForCausalLM` operation for operation; the sibling of `models.qwen35`, sharing its op table
(`models.ops`), its projections and the stream's metadata (`RoundTensors`).

Every layer attends. A layer is sandwiched by norms (input, post-attention, pre- and post-feedforward) that scale
by w (not 1 + w), an output norm running with its residual add (and the layer scalar, and the next norm) as one
op (`ops.norm_add`); attention has q/k norms, a scale-free value norm, scores scaled by 1, and its rotary embedding
(sliding layers: every channel pair turns; full layers: proportional RoPE, the first pairs turn and the rest stay).
A sliding layer sees only the keys of the last `sliding_window` positions. The last `kv_shared_layers` layers
compute no keys or values: they attend over those of the last earlier layer of their type (its stream keys and
its pool arenas). With `RoundTensors.sliding`, sliding layers read and write the pool through their own page
table and KV slots (their checkpoints keep only the window's pages). The MLP is GeGLU (gelu tanh); 26B-A4B adds routed experts (`ops.moe_experts`) to it. With
per-layer inputs (PLE) each layer ends with a gated projection of its own token embedding. Final logits are
soft-capped.
A round with images (`RoundTensors.images`) puts the tower's rows at the soft tokens (after the embedding's scaling,
the per-layer inputs looking up the pad id there) and, where the checkpoint lets an image's soft tokens see each
other, gives its sliding layers' plans their bound (`AttentionPlan.see_hi`).
Selective readout: from the first KV-shared layer on (else at the last layer) everything but the keys and
values runs at the readout rows only. The residual stream is kept in `residual_dtype` (float32), as in Qwen3.5.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flide_sdk.kernels.plans import AttentionPlan
from flide_sdk.models.config import Gemma4Config, GemmaAttention
from flide_sdk.models.ops import Ops
from flide_sdk.models.qwen35 import (
    DecisionHead,
    FusedProjections,
    LayerCache,
    Linear,
    Readout,
    Weight,
    project,
)
from flide_sdk.plan.layout import RoundTensors


class RMSNorm(Weight):
    """Gemma's RMSNorm: x / rms(x) * w (offset 0 in `ops.rms_norm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, offset=0.0)

    def add_to(self, x: torch.Tensor, delta: torch.Tensor, ops: Ops, scale: torch.Tensor | None = None,
               then: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """((x + this norm of delta) * scale, `then`'s norm of that or None) in one pass (`ops.norm_add`)."""
        return ops.norm_add(x, delta, self.weight, self.eps, offset=0.0, scale=scale,
                            next_weight=None if then is None else then.weight)


def unit_norm(x: torch.Tensor, ones: torch.Tensor, eps: float, ops: Ops) -> torch.Tensor:
    """x / rms(x) without a scale (the value norm, the router's norm): a norm by a weight of ones."""
    return ops.rms_norm(x, ones, eps, offset=0.0)


def rotary_angles(attention: GemmaAttention, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos/sin [T, head_dim] of `positions` for a layer type, as transformers computes them: float32 frequencies
    theta^(-2i / head_dim) / factor for the first `rotary_pairs` pairs and 0 for the rest (proportional RoPE: those
    channels stay), each pair i turning channels i and i + head_dim / 2."""
    dim = attention.head_dim
    turned = torch.arange(0, 2 * attention.rotary_pairs, 2, device=positions.device).float() / dim
    inv_freq = torch.cat([1.0 / attention.rope_theta**turned,
                          torch.zeros(dim // 2 - attention.rotary_pairs, device=positions.device)])
    inv_freq = inv_freq / attention.rope_factor
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class RoundRope:
    """A round's rotary tables per layer type, [T, head_dim] at the stream's tokens (made once per pass: a full
    layer's head is wide and positions run to 256k, too many for tables of every position)."""

    def __init__(self, config: Gemma4Config, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.tables = {kind: rotary_angles(config.attention(config.layer_types.index(kind)), positions, dtype)
                       for kind in set(config.layer_types)}
        self.stream = torch.arange(positions.shape[0], device=positions.device)  # a token's row in the tables


class MLP(nn.Module):
    def __init__(self, hidden_size: int, size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, size)
        self.up_proj = Linear(hidden_size, size)
        self.down_proj = Linear(size, hidden_size)
        self.fused: FusedProjections | None = None

    def fuse(self) -> None:
        self.fused = FusedProjections([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        gate, up = project(self.fused, [self.gate_proj, self.up_proj], x, ops)
        return self.down_proj(ops.geglu(gate, up), ops)


class Router(nn.Module):
    """The experts' router: top-k of the softmax of a projection of the unit-normed input (times `scale` and
    1/sqrt(hidden)), renormalised, each weight times its expert's `per_expert_scale`."""

    def __init__(self, config: Gemma4Config) -> None:
        super().__init__()
        self.top_k, self.eps, self.root = config.experts_per_token, config.rms_norm_eps, config.hidden_size**-0.5
        self.proj = Linear(config.hidden_size, config.num_experts)
        self.scale = nn.Parameter(torch.empty(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.empty(config.num_experts))

    def forward(self, x: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [T, k], weights [T, k] float32)."""
        normed = unit_norm(x, torch.ones_like(self.scale), self.eps, ops) * self.scale * self.root
        probabilities = torch.softmax(self.proj(normed, ops).float(), dim=-1)
        weights, experts = torch.topk(probabilities, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights * self.per_expert_scale[experts]


class Experts(nn.Module):
    """The routed experts' stacked weights, as the checkpoint stores them: gate|up [E, 2I, hidden], down
    [E, hidden, I]."""

    def __init__(self, config: Gemma4Config) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(config.num_experts, 2 * config.expert_size, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, config.expert_size))


class Attention(nn.Module):
    """A sliding or full attention layer; a KV-shared one has only its queries and output."""

    def __init__(self, config: Gemma4Config, layer: int) -> None:
        super().__init__()
        self.kind = config.layer_types[layer]
        self.shape = shape = config.attention(layer)
        self.heads, self.source = config.num_heads, config.kv_source(layer)
        self.shared = self.source != layer
        self.eps = config.rms_norm_eps
        self.q_proj = Linear(config.hidden_size, config.num_heads * shape.head_dim)
        self.q_norm = RMSNorm(shape.head_dim, config.rms_norm_eps)
        if not self.shared:
            self.k_proj = Linear(config.hidden_size, shape.kv_heads * shape.head_dim)
            if not shape.keys_are_values:
                self.v_proj = Linear(config.hidden_size, shape.kv_heads * shape.head_dim)
            self.k_norm = RMSNorm(shape.head_dim, config.rms_norm_eps)
        self.o_proj = Linear(config.num_heads * shape.head_dim, config.hidden_size)
        self.fused: FusedProjections | None = None

    @property
    def inputs(self) -> list[Linear]:
        """The projections of the layer's input, queries first."""
        if self.shared:
            return [self.q_proj]
        return [self.q_proj, self.k_proj] + ([] if self.shape.keys_are_values else [self.v_proj])

    def fuse(self) -> None:
        if len(self.inputs) > 1:
            self.fused = FusedProjections(self.inputs)

    def forward(self, h: torch.Tensor, rnd: RoundTensors, ops: Ops, rope: RoundRope, rows: torch.Tensor | None,
                at_rows: bool, cache: LayerCache, streams: dict[int, tuple[torch.Tensor, torch.Tensor]],
                plan: AttentionPlan) -> torch.Tensor:
        """The attention output at every token of h, or at `rows` (`at_rows`: h holds only those rows already).
        A layer that keeps its own keys and values leaves them in `streams` for the layers sharing them."""
        shape = self.shape
        cos, sin = rope.tables[self.kind]
        k_cache, v_cache = cache
        if self.shared:
            q = self.q_proj(h if rows is None or at_rows else h[rows], ops)
            q = q.view(q.shape[0], self.heads, shape.head_dim)
            where = rope.stream if rows is None else rows
            q = ops.rms_norm_rotary(q, self.q_norm.weight, self.eps, cos[where], sin[where], offset=0.0)
            k, v = streams[self.source]
        else:
            if rows is None:
                q, k, *v = project(self.fused, self.inputs, h, ops)
            else:
                q = self.q_proj(h[rows], ops)
                k, *v = (linear(h, ops) for linear in self.inputs[1:])
            q = q.view(q.shape[0], self.heads, shape.head_dim)
            k = k.view(h.shape[0], shape.kv_heads, shape.head_dim)
            values = k if shape.keys_are_values else v[0].view(h.shape[0], shape.kv_heads, shape.head_dim)
            values = unit_norm(values, torch.ones_like(self.k_norm.weight), self.eps, ops)
            slots = rnd.checkpoint.kv_slots if shape.window is None or rnd.sliding is None else rnd.sliding.kv_slots
            q, k, v = ops.attention_front(q, k, values, self.q_norm.weight, self.k_norm.weight, self.eps, cos, sin,
                                          rope.stream, rows, k_cache, v_cache, slots, offset=0.0)
            streams[self.source] = k, v
        out = ops.fork_attention(q, k, v, plan, rows, k_cache, v_cache, None, scale=1.0, window=shape.window)
        return self.o_proj(out.reshape(q.shape[0], -1), ops)


class DecoderLayer(nn.Module):
    def __init__(self, config: Gemma4Config, layer: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(hidden, config.mlp_size(layer))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.empty(1))
        self.is_moe = config.is_moe
        if config.is_moe:
            self.router = Router(config)
            self.experts = Experts(config)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        self.per_layer = config.per_layer_size > 0
        if self.per_layer:
            self.per_layer_input_gate = Linear(hidden, config.per_layer_size)
            self.per_layer_projection = Linear(config.per_layer_size, hidden)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, per_layer: torch.Tensor | None, rnd: RoundTensors, ops: Ops, rope: RoundRope,
                rows: torch.Tensor | None, at_rows: bool, cache: LayerCache,
                streams: dict[int, tuple[torch.Tensor, torch.Tensor]], plan: AttentionPlan) -> torch.Tensor:
        """The layer on the residual stream x; with `rows`, everything after the keys and values runs at those
        rows only (`at_rows`: x and per_layer hold only them already), so the result has one row per readout row."""
        h = self.input_layernorm(x, ops)
        mixed = self.self_attn(h, rnd, ops, rope, rows, at_rows, cache, streams, plan)
        if rows is not None and not at_rows:
            x = x[rows]
            per_layer = None if per_layer is None else per_layer[rows]
        x, h = self.post_attention_layernorm.add_to(x, mixed, ops, then=self.pre_feedforward_layernorm)
        out = self.mlp(h, ops)
        if self.is_moe:
            experts, weights = self.router(x, ops)
            routed = ops.moe_experts(self.pre_feedforward_layernorm_2(x, ops), self.experts.gate_up_proj,
                                     self.experts.down_proj, experts, weights, ops.geglu)
            out, _ = self.post_feedforward_layernorm_2.add_to(self.post_feedforward_layernorm_1(out, ops), routed, ops)
        # the layer scalar scales the layer's last residual add
        x, _ = self.post_feedforward_layernorm.add_to(x, out, ops, None if self.per_layer else self.layer_scalar)
        if self.per_layer:
            gated = ops.geglu(self.per_layer_input_gate(x.to(per_layer.dtype), ops), per_layer)
            x, _ = self.post_per_layer_input_norm.add_to(x, self.per_layer_projection(gated, ops), ops,
                                                         self.layer_scalar)
        return x


class Gemma4Model(nn.Module):
    """The decoder; `forward(rnd, ops, caches)` returns each question's option log-probabilities and its text
    reads' log-probabilities (`Readout`). `caches[i]` is layer i's view of the pool: its (keys, values) arenas, a
    KV-shared layer's those of the layer it reads."""

    def __init__(self, config: Gemma4Config, head: DecisionHead | None = None, lm_head: bool = True) -> None:
        super().__init__()
        self.config = config
        self.residual_dtype = torch.float32
        self.embed_tokens = Weight(config.vocab_size, config.hidden_size)
        if config.per_layer_size:
            width = config.num_layers * config.per_layer_size
            self.embed_tokens_per_layer = Weight(config.per_layer_vocab, width)
            self.per_layer_model_projection = Linear(config.hidden_size, width)
            self.per_layer_projection_norm = RMSNorm(config.per_layer_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if lm_head and not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.decision_head = head
        # from this layer on, everything but keys and values runs at the readout rows only
        self.selective_from = config.first_shared_layer if config.kv_shared_layers else config.num_layers - 1

    def fuse_projections(self) -> None:
        """Run the projections that read the same input as one GEMM each (after the weights are loaded)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def projection_shapes(self) -> set[tuple[int, int]]:
        """The weight shapes the forward passes to `ops.linear`, fused or not (not the head's)."""
        head = getattr(self, "lm_head", None)
        shapes = {tuple(m.weight.shape) for m in self.modules() if isinstance(m, Linear) and m is not head}
        for layer in self.layers:
            for part in (layer.self_attn, layer.mlp):
                if part.fused is not None:
                    shapes.add(tuple(part.fused.weight.shape))
        return shapes

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def label_logprobs(self, h: torch.Tensor, label_ids: torch.Tensor, ops: Ops) -> torch.Tensor:
        """Each readout row's option log-probabilities: the decision head's rows, or the soft-capped label logits."""
        head = self.decision_head
        if head is None:
            return ops.label_log_softmax(h, self.head_weight(), label_ids, None, self.config.final_logit_softcap)
        return ops.label_log_softmax(h, head.weight, label_ids, head.bias, head.softcap)

    def per_layer_inputs(self, ids: torch.Tensor, embedded: torch.Tensor, ops: Ops) -> torch.Tensor:
        """Each token's per-layer inputs [T, layers, per_layer_size]: its own per-layer embedding (scaled by
        sqrt(size)) averaged, over sqrt(2), with the normed projection of its input embedding."""
        c = self.config
        weight = self.embed_tokens_per_layer.weight
        own = F.embedding(ids, weight) * torch.tensor(c.per_layer_size**0.5, dtype=weight.dtype)
        projected = self.per_layer_model_projection(embedded, ops) * c.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.view(ids.shape[0], c.num_layers, c.per_layer_size), ops)
        return (projected + own.view_as(projected)) * 2.0**-0.5

    @torch.inference_mode()
    def forward(self, rnd: RoundTensors, ops: Ops, caches: Sequence[LayerCache]) -> Readout:
        c = self.config
        weight = self.embed_tokens.weight
        embedded = F.embedding(rnd.ids, weight) * torch.tensor(math.sqrt(c.hidden_size), dtype=weight.dtype)
        images, ids = rnd.images, rnd.ids
        if images is not None:  # soft tokens take the tower's rows as they are, and the pad's per-layer embedding
            embedded = embedded.index_copy(0, images.rows, images.embeds.to(embedded.dtype))
            ids = ids.index_fill(0, images.rows, c.pad_token_id)
        per_layer = self.per_layer_inputs(ids, embedded, ops) if c.per_layer_size else None
        readout, rows = rnd.readout, rnd.readout.rows
        if readout.text_rows.numel():  # the label rows and the text reads' rows, in stream order (query rows are)
            rows, order = torch.sort(torch.cat([readout.rows, readout.text_rows]))
            place = torch.empty_like(order)
            place[order] = torch.arange(order.shape[0], device=order.device)
        # what attention derives from the round's metadata, per layer type and query rows, built once per pass
        plans: dict[tuple[str, bool], AttentionPlan] = {}
        for index, kind in enumerate(c.layer_types):
            key = (kind, index >= self.selective_from)
            if key not in plans:
                shape = c.attention(index)
                plan = rnd.attention
                if shape.window is not None and images is not None and images.see_hi is not None:
                    plan = dataclasses.replace(plan, see_hi=images.see_hi)  # before tiling: the tiles' key ranges
                plan = ops.attention_tiles(plan, rows if key[1] else None, c.num_heads, shape.kv_heads,
                                           shape.head_dim, embedded.dtype)
                windowed = shape.window is not None and rnd.sliding is not None
                plans[key] = rnd.sliding.attention(plan) if windowed else plan
        rope = RoundRope(c, rnd.positions, embedded.dtype)
        x = embedded.to(self.residual_dtype)
        streams: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for index, (layer, cache) in enumerate(zip(self.layers, caches)):
            selective = index >= self.selective_from
            x = layer(x, None if per_layer is None else per_layer[:, index], rnd, ops, rope,
                      rows if selective else None, index > self.selective_from, cache, streams,
                      plans[c.layer_types[index], selective])
            if index == self.selective_from and per_layer is not None:
                per_layer = per_layer[rows]
        h = self.norm(x, ops)  # [R (+ X), hidden]
        if not readout.text_rows.numel():
            return Readout(self.label_logprobs(h, readout.label_ids, ops), h.new_zeros(0, dtype=torch.float32))
        questions = readout.rows.shape[0]
        logprobs = self.label_logprobs(h[place[:questions]], readout.label_ids, ops)
        return Readout(logprobs, ops.token_logprobs(h[place[questions:]], self.head_weight(), readout.text_targets,
                                                    c.final_logit_softcap))

