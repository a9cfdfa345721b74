"""The kernels' inputs: the constants and named structs of device tensors that the stream ops read.

The round planner (`flide_sdk.plan.layout`) fills these; the kernels and their references only read them, so
this package imports nothing else of flide_sdk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

GDN_CHUNK = 64  # tokens per chunk of the chunked gated delta rule
PAGE = 64  # tokens per key/value page of the checkpoint pool
DISCARD_ROW = -1  # a segment's `final_row` when its final state is not kept


@dataclass
class AttentionPlan:
    key_lo: torch.Tensor  # [T] first stream index of the token's request
    ctx_hi: torch.Tensor  # [T] end of the fully visible range [key_lo, ctx_hi) (the trunk, for branch tokens)
    seg_lo: torch.Tensor  # [T] start of the token's own causal segment
    request_of: torch.Tensor  # [T] request index of each token
    history_len: torch.Tensor  # [R] cached positions [0, r) of each request (keys/values in pool pages)
    page_offset: torch.Tensor  # [R] where each request's pages start in `pages`
    pages: torch.Tensor  # [P] pool page of each cached PAGE-token block, requests one after the other
    num_tokens: torch.Tensor  # [1] real stream tokens (rows at or past it are padding)
    request_bounds: list[tuple[int, int]]  # host: stream [start, end) of each request (reference op)
    history: list[tuple[int, np.ndarray | None]]  # host: per request, cached length r and its pages
    # device tile tables derived from this plan, built by the first attention layer of a round that needs
    # one and reused by the others (kernels.fork_attention.tile_table); keyed by the kernel's tiling
    tile_tables: dict = field(default_factory=dict, repr=False)


@dataclass
class DeltaLevel:
    chunk_tokens: torch.Tensor  # [num_chunks, GDN_CHUNK] stream index per chunk position, T for padding
    active: list[int]  # host: active segments at scan step j (non-increasing)
    init_row: torch.Tensor  # [num_segments] state row each segment starts from
    final_row: torch.Tensor  # [num_segments] row its final state is written to (DISCARD_ROW: none)
    chunk_count: torch.Tensor  # [num_segments] chunks (scan steps) of each segment
    step_base: torch.Tensor  # [num_segments] segment s's chunk 0 is row s, its chunk j > 0 row step_base[s] + j
    chain: torch.Tensor  # [num_segments] the next level's segment that continues this one's final state (-1: none)
    sizes: torch.Tensor  # [2] the level's chunk rows and segments; a captured graph's tables are padded past them
    chained: bool = False  # host: every segment of this level continues one of the level before (its `chain`)


@dataclass
class DeltaPlan:
    levels: list[DeltaLevel]
    num_rows: int  # rows of the standalone state table the plan was made for (StateRows.num_rows)
