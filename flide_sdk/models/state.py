"""What a checkpoint holds for each layer of a model (`StateLayout`), whatever the family: the checkpoint pool
sizes its arenas from it and gives each layer its views, and the round planner reads from it whether the model
has recurrent (Gated DeltaNet) layers at all. A layer keeps a recurrent state and a conv window (Qwen3.5's
Gated DeltaNet), or its keys and values (attention), or nothing of its own: it reads another layer's keys and
values (Gemma 4's KV-shared layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class RecurrentShape(NamedTuple):
    """A Gated DeltaNet layer's checkpoint: a float32 state [heads, key_dim, value_dim] and the conv window, the
    conv_kernel - 1 inputs of conv_dim channels before the checkpoint's position."""

    heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    conv_dim: int


class KeyValueShape(NamedTuple):
    """An attention layer that keeps its keys and values: `heads` of `head_dim` each per token."""

    layer: int
    heads: int
    head_dim: int


@dataclass(frozen=True)
class StateLayout:
    """Per layer of a model, what its checkpoints hold: the recurrent layers' states (all of one shape), the
    keys and values of the attention layers that compute their own, and for every layer the layer whose pool
    arenas it reads (`sources`: itself, or the earlier layer whose keys and values it reuses)."""

    recurrent: RecurrentShape | None  # None: the model has no recurrent layers (no state slots, no GDN levels)
    recurrent_layers: tuple[int, ...]
    key_values: tuple[KeyValueShape, ...]  # in layer order
    sources: tuple[int, ...]

    @property
    def conv_kernel(self) -> int:
        """The recurrent layers' conv width, what the round planner lays conv taps out for: 1 without recurrent
        layers (a window of no tokens before each position; the planner's Gated DeltaNet tables go unread)."""
        return 1 if self.recurrent is None else self.recurrent.conv_kernel

    def token_bytes(self, dtype: torch.dtype) -> int:
        """Key/value bytes one token takes in a checkpoint (every layer that keeps its own)."""
        return sum(2 * kv.heads * kv.head_dim for kv in self.key_values) * dtype.itemsize

    def slot_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of a checkpoint's state slot: every recurrent layer's float32 state and conv window (0 without
        recurrent layers)."""
        shape = self.recurrent
        if shape is None:
            return 0
        state = shape.heads * shape.key_dim * shape.value_dim * 4
        window = (shape.conv_kernel - 1) * shape.conv_dim * dtype.itemsize
        return len(self.recurrent_layers) * (state + window)
