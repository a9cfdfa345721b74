"""What a checkpoint holds for each layer of a model (`StateLayout`), whatever the family: the checkpoint pool
sizes its arenas from it and gives each layer its views, and the round planner reads from it whether the model
has recurrent (Gated DeltaNet) layers at all. A layer keeps a recurrent state and a conv window (Qwen3.5's
Gated DeltaNet), or its keys and values (attention), or nothing of its own: it reads another layer's keys and
values (Gemma 4's KV-shared layers). An attention layer with a sliding window keeps only the pages its window can
still see (`StateLayout.sliding_from`), so a long history costs its full layers' bytes per token and a bounded
amount for the sliding ones (`StateLayout.checkpoint_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from flide_sdk.kernels.plans import PAGE


class RecurrentShape(NamedTuple):
    """A Gated DeltaNet layer's checkpoint: a float32 state [heads, key_dim, value_dim] and the conv window, the
    conv_kernel - 1 inputs of conv_dim channels before the checkpoint's position."""

    heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    conv_dim: int


class KeyValueShape(NamedTuple):
    """An attention layer that keeps its keys and values: `heads` of `head_dim` each per token; `window`: it sees
    only the last `window` positions (None: full attention)."""

    layer: int
    heads: int
    head_dim: int
    window: int | None = None


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

    def token_bytes(self, dtype: torch.dtype, sliding: bool | None = None) -> int:
        """Key/value bytes one token takes in a checkpoint (every layer that keeps its own; with `sliding` True or
        False, those of the sliding-window layers or of the full ones only)."""
        return sum(2 * kv.heads * kv.head_dim for kv in self.key_values
                   if sliding is None or (kv.window is not None) == sliding) * dtype.itemsize

    @property
    def sliding_window(self) -> int | None:
        """The widest window of the sliding layers keeping keys and values (None: there are none)."""
        return max((kv.window for kv in self.key_values if kv.window is not None), default=None)

    def sliding_from(self, length: int) -> int:
        """The first page a checkpoint of `length` tokens keeps for its sliding layers: the page of the first
        position a query at `length` or later can see (earlier pages are never read again)."""
        window = self.sliding_window
        return 0 if window is None else max(0, length - window) // PAGE

    def checkpoint_bytes(self, length: int, dtype: torch.dtype) -> int:
        """Pool bytes a checkpoint of `length` tokens holds on its own (no page shared): the full layers' pages of
        the whole history, the sliding layers' pages of the window's, and the state slot."""
        pages = -(-length // PAGE)
        return (PAGE * pages * self.token_bytes(dtype, sliding=False)
                + PAGE * (pages - self.sliding_from(length)) * self.token_bytes(dtype, sliding=True)
                + self.slot_bytes(dtype))

    def slot_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of a checkpoint's state slot: every recurrent layer's float32 state and conv window (0 without
        recurrent layers)."""
        shape = self.recurrent
        if shape is None:
            return 0
        state = shape.heads * shape.key_dim * shape.value_dim * 4
        window = (shape.conv_kernel - 1) * shape.conv_dim * dtype.itemsize
        return len(self.recurrent_layers) * (state + window)
