"""A round's arrays on the host and the device structs the model reads (DESIGN.md §5).

A round's metadata is derived once: the host stages the round (`tree.RoundPlan.stage`), and every per-token and
per-chunk-position array comes from that staged form through `kernels.round_metadata`: on the device inside a
captured graph (the kernel), or here on the host for an eager round and the tests (its torch reference).
`HostRound` holds both halves at a shape (the round's own, or a graph capacity's, padded at the tail);
`to(device)` copies them and `round_tensors` views named device arrays as the model's `RoundTensors`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flide_sdk.kernels.plans import (  # noqa: F401 (callers import the kernels' constants here too)
    DISCARD_ROW,
    GDN_CHUNK,
    PAGE,
    SEGMENT_ROWS,
    TOKEN_ROWS,
    AttentionPlan,
    DeltaLevel,
    DeltaPlan,
    RoundMetadata,
)
from flide_sdk.kernels.reference import expand_round_reference
from flide_sdk.plan.requests import (  # noqa: F401 (callers import them here)
    Branches,
    RequestSpec,
    Resume,
    Save,
    StateRows,
    TextReads,
)
from flide_sdk.plan.shape import RoundShape
from flide_sdk.plan.tree import RoundPlan


@dataclass
class CheckpointPlan:
    """Pool traffic of a round besides the states (which levels read and write in place)."""

    resume_slots: torch.Tensor  # [n_resume] pool slots whose conv windows are read
    save_slots: torch.Tensor  # [n_save] pool slots whose conv windows are written
    save_window_src: torch.Tensor  # [n_save, K-1] conv-table rows of the conv inputs before each save point
    kv_slots: torch.Tensor  # [T] flat pool position of each token's keys/values (the sink if not saved)


@dataclass
class SlidingTables:
    """The sliding-window layers' pool tables (their pages are their own): the page of each cached block (the
    sink's before a request's window) at the full layers' offsets, and each token's flat pool position."""

    pages: torch.Tensor  # [P]
    history: list[tuple[int, np.ndarray | None]]  # host: per request, cached length r and its sliding pages
    kv_slots: torch.Tensor  # [T]

    def attention(self, plan: AttentionPlan) -> AttentionPlan:
        """`plan` (with its tile tables) reading these pages."""
        return dataclasses.replace(plan, pages=self.pages, history=self.history)


@dataclass
class ReadoutPlan:
    rows: torch.Tensor  # [R] stream index of each question's last token
    label_ids: torch.Tensor  # [R, L] label token ids, padded with -1
    text_rows: torch.Tensor  # [X] stream index of each token read of a text-scored option
    text_targets: torch.Tensor  # [X] the token it reads


@dataclass
class RoundImages:
    """A round's images, on the device (rounds without images have none): the stream rows of their image pads
    and the tower's rows for them [P, hidden]. Qwen3.5: each stream token's M-RoPE (t, h, w) positions [3, T] and
    which axis each rotary frequency reads [rotary_dim / 2] (`models.qwen35_vision.mrope_axes`). Gemma 4 (plain
    positions): with image tokens attending both ways, the last stream key each token sees on sliding layers
    [T] (`AttentionPlan.see_hi`)."""

    rows: torch.Tensor
    embeds: torch.Tensor
    positions: torch.Tensor | None = None
    axes: torch.Tensor | None = None
    see_hi: torch.Tensor | None = None


@dataclass
class RoundTensors:
    """Everything the forward of one round reads, on the device."""

    ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] position of each token in its standalone prompt
    attention: AttentionPlan
    delta: DeltaPlan
    conv_src: torch.Tensor  # [T, K] rows of the conv table feeding each conv tap, oldest first
    checkpoint: CheckpointPlan
    readout: ReadoutPlan
    images: RoundImages | None = None
    sliding: SlidingTables | None = None  # None: the model's layers share one page table


@dataclass
class HostLevel:
    """One Gated DeltaNet level of a host round (views of the round's single tables); each of its segment rows
    is also an attribute, by its name in SEGMENT_ROWS (`level.init_row`, `level.chunk_count`, ...)."""

    chunk_tokens: np.ndarray  # [chunks, GDN_CHUNK] stream index per chunk position (padding: the round's tokens)
    segment_rows: np.ndarray  # [SEGMENT_ROWS, segments]
    sizes: np.ndarray  # [2]: the real chunk rows and segments (a padded table keeps them)
    active: list[int]  # host: active segments at scan step j (non-increasing)
    chained: bool

    def __getattr__(self, name: str) -> np.ndarray:
        if name in SEGMENT_ROWS:
            return self.__dict__["segment_rows"][SEGMENT_ROWS.index(name)]
        raise AttributeError(name)


@dataclass
class HostRound:
    """A round's arrays at `shape`, by name (`RoundShape.staged_shapes` and `expanded_shapes`); each is also an
    attribute (`host.conv_src`), as are the token rows (`host.positions`, ...)."""

    plan: RoundPlan
    shape: RoundShape
    named: dict[str, np.ndarray]

    @classmethod
    def of(cls, plan: RoundPlan, shape: RoundShape | None = None, window_sink: int = -1) -> HostRound:
        """The round staged at `shape` (default: its own) and expanded by the reference."""
        shape = shape or plan.shape
        staged = {name: np.empty(size, dtype=np.int64) for name, size in shape.staged_shapes().items()}
        plan.stage(staged, shape, window_sink)
        expanded = {name: np.empty(size, dtype=np.int64) for name, size in shape.expanded_shapes().items()}
        views = {name: torch.from_numpy(array) for name, array in {**staged, **expanded}.items()}
        expand_round_reference(RoundMetadata(**{name: views[name] for name in RoundMetadata._fields}))
        return cls(plan, shape, {**staged, **expanded})

    def __getattr__(self, name: str) -> np.ndarray:
        named = self.__dict__.get("named", {})
        if name in named:
            return named[name]
        if name in TOKEN_ROWS:
            return named["token_rows"][TOKEN_ROWS.index(name)]
        raise AttributeError(name)

    @property
    def levels(self) -> list[HostLevel]:
        return [HostLevel(*self.shape.level(self.named, index), level.active(), level.chained)
                for index, level in enumerate(self.plan.levels)]

    @property
    def num_real(self) -> int:
        return self.plan.num_real

    @property
    def num_tokens(self) -> int:
        return self.shape.tokens

    @property
    def num_questions(self) -> int:
        return self.plan.num_questions

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array of the round, by name."""
        return self.named

    def to(self, device: torch.device | str) -> RoundTensors:
        arrays = {name: torch.from_numpy(a).to(device, non_blocking=True) for name, a in self.named.items()}
        return round_tensors(self.plan, self.shape, arrays)


def round_tensors(plan: RoundPlan, shape: RoundShape, t: dict[str, torch.Tensor]) -> RoundTensors:
    """The `RoundTensors` view of device arrays at `shape`, named as in `HostRound.arrays()` (a graph's arrays
    hold any round that fits; the host lists, read by the references only, come from `plan`)."""
    levels = []
    for index, level in enumerate(plan.levels):
        chunk_tokens, segment_rows, sizes = shape.level(t, index)
        init_row, final_row, chunk_count, step_base, chain = segment_rows
        levels.append(DeltaLevel(chunk_tokens, level.active(), init_row, final_row, chunk_count, step_base, chain,
                                 sizes, level.chained))
    positions, key_lo, ctx_hi, seg_lo, request_of, vis_end, piece_lo = t["token_rows"]
    history = [(r.start, r.resume.pages if r.resume else None) for r in plan.requests]
    attention = AttentionPlan(key_lo, ctx_hi, seg_lo, request_of, vis_end, positions, t["history_len"],
                              t["page_offset"], t["pages"], t["num_tokens"], plan.request_bounds, history)
    return RoundTensors(
        ids=t["ids"],
        positions=positions,
        attention=attention,
        delta=DeltaPlan(levels, plan.rows.num_rows, piece_lo),
        conv_src=t["conv_src"],
        checkpoint=CheckpointPlan(t["resume_slots"], t["save_slots"], t["save_window_src"], t["kv_slots"]),
        readout=ReadoutPlan(t["readout_rows"], t["label_ids"], t["text_rows"], t["text_targets"]),
        sliding=SlidingTables(t["sliding_pages"], [(r.start, r.resume.sliding_pages if r.resume else None)
                                                   for r in plan.requests], t["sliding_kv_slots"])
        if plan.sliding else None,
    )


def plan_round(
    requests: Sequence[RequestSpec], conv_kernel: int, rows: StateRows | None = None, kv_sink: int = -1,
    pack: bool = True, sliding: bool = False,
) -> HostRound:
    """Lay out `requests` as one flat stream and build all metadata, unpadded."""
    return HostRound.of(RoundPlan(requests, conv_kernel, rows, kv_sink, pack, sliding))
