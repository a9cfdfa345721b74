"""The kernels' inputs: the constants and named structs of device tensors that the stream ops read.

The round planner (`flide_sdk.plan`) fills these; the kernels and their references only read them, so
this package imports nothing else of flide_sdk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

GDN_CHUNK = 64  # tokens per chunk of the chunked gated delta rule
PAGE = 64  # tokens per key/value page of the checkpoint pool
DISCARD_ROW = -1  # a segment's `final_row` when its final state is not kept

# the rows of a round's per-token metadata block [7, T] (`kernels.round_metadata` expands it from the pieces)
TOKEN_ROWS = ("positions", "key_lo", "ctx_hi", "seg_lo", "request_of", "vis_end", "piece_lo")
# the rows of a Gated DeltaNet level's segment table [5, segments]
SEGMENT_ROWS = ("init_row", "final_row", "chunk_count", "step_base", "chain")
# the rows of a round's piece table [11, pieces] (`plan.tree.RoundPlan.piece_table`): a piece's stream start, what
# the conv taps of its first tokens read before it (`tap_d`: the source of position `position - d`, d = 1..3: a
# stream index (>= 0), a resumed conv window's entry w (encoded -2 - w) or ZERO_TAP), then the TOKEN_ROWS values of
# its tokens (the position's as position - stream index)
MAX_CONV_WINDOW = 3  # conv taps before a token: Qwen3.5's conv kernel is 4 wide
ZERO_TAP = -1
CONV_PIECE_ROWS = ("start", "tap_1", "tap_2", "tap_3")
PIECE_ROWS = CONV_PIECE_ROWS + TOKEN_ROWS


@dataclass
class AttentionPlan:
    key_lo: torch.Tensor  # [T] first stream index of the token's request
    ctx_hi: torch.Tensor  # [T] end of the fully visible range [key_lo, ctx_hi) (the trunk, for branch tokens)
    seg_lo: torch.Tensor  # [T] start of the token's own causal range (its piece, or its depth-1 ancestor)
    request_of: torch.Tensor  # [T] request index of each token
    vis_end: torch.Tensor  # [T] key k is visible to later tokens of [seg_lo, ...) before vis_end[k] only (the end
    # of its piece's subtree: a branch's options see their question, never each other)
    positions: torch.Tensor  # [T] each token's position in its standalone prompt (a sliding window's distances)
    history_len: torch.Tensor  # [R] cached positions [0, r) of each request (keys/values in pool pages)
    page_offset: torch.Tensor  # [R] where each request's pages start in `pages`
    pages: torch.Tensor  # [P] pool page of each cached PAGE-token block, requests one after the other
    num_tokens: torch.Tensor  # [1] real stream tokens (rows at or past it are padding)
    request_bounds: list[tuple[int, int]]  # host: stream [start, end) of each request (reference op)
    history: list[tuple[int, np.ndarray | None]]  # host: per request, cached length r and its pages
    # [T] or None: token q sees stream keys k <= see_hi[q] of its causal range instead of k <= q (an image's soft
    # tokens see the later ones of their image: Gemma 4's sliding layers); None on every other plan
    see_hi: torch.Tensor | None = None
    # the attention kernel's work tables of the stream's rows and of the readout rows, built on the device once
    # per forward pass by its caller (`kernels.fork_attention.attention_tiles`) and shared by its attention
    # layers; None: each call of the kernel builds its own
    stream_tiles: TileTable | None = field(default=None, repr=False)
    readout_tiles: TileTable | None = field(default=None, repr=False)


@dataclass(frozen=True)
class TileTable:
    """A round's attention work for one query-row set, planned on the device (`kernels.fork_attention`): the
    tiles (`plan_tiles_reference`) and their key splits. A tile's keys, in order (its cached history, the stream keys
    every row sees, the masked ones), are cut into ceil(keys / size) equal pieces of whole pages (a piece of
    the history starts on a page), where the size is the larger of the minimum asked for and the round's keys
    over `extra_items`; each (tile, piece) is a work item, the items of a tile consecutive. A tile of one
    piece is finished by its item; the items of a tile of several leave partial results (unnormalised sums,
    running maxima and weights) in its `partial_slot` onwards, which the merge kernel combines. The items
    number at most `max_tiles + extra_items` (ceil(keys / size) < keys / size + 1) and the partial slots at
    most twice `extra_items` (a tile of s > 1 pieces has s <= 2 (s - 1))."""

    query_rows: torch.Tensor | None  # the query-row set it was built for (None: every stream row)
    block_tokens: int  # the tiling it was built for: tokens per tile, fewest keys split, items past one a tile
    min_split_keys: int
    extra_items: int
    piece_tiles: bool  # whether its tiles are of one piece each (a trunk or one branch)
    see_hi: bool  # whether its tiles' masked keys run to the plan's `see_hi` (built from a plan with one)
    rows: torch.Tensor  # [Tq] the stream index of each query row
    tile_start: torch.Tensor  # [max_tiles + 2] tile i covers rows[tile_start[i]:tile_start[i + 1]]
    num_tiles: torch.Tensor  # [1]
    max_tiles: int
    item_tile: torch.Tensor  # [max_items] the tile of each work item
    item_split: torch.Tensor  # [max_items] its split within the tile
    tile_splits: torch.Tensor  # [max_tiles] splits of each tile (0 past num_tiles)
    tile_piece: torch.Tensor  # [max_tiles] keys per piece of each tile
    partial_slot: torch.Tensor  # [max_tiles] first partial slot of a tile of several splits (else -1)
    num_items: torch.Tensor  # [1]
    max_items: int
    max_partials: int


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
    # [T] the first stream index of each token's piece: a chunk row may pack short sibling pieces, each of which
    # starts from the segment's init state (a token sees the chunk's earlier tokens of its own piece only)
    piece_lo: torch.Tensor
    # the Gated DeltaNet kernels' work tables, one uint8 allocation made once per forward pass by its caller
    # (`kernels.gated_delta.delta_workspace`) and shared by its layers; None: each call allocates its own
    workspace: torch.Tensor | None = field(default=None, repr=False)


class RoundMetadata(NamedTuple):
    """A staged round's arrays (read) and the arrays `round_metadata` derives from them (written), all int64."""

    pieces: torch.Tensor  # [PIECE_ROWS, P]: the first piece_counts[0] columns real, in stream order, the first at 0
    piece_counts: torch.Tensor  # [2]: pieces, requests
    num_tokens: torch.Tensor  # [1]: real tokens
    chunk_spans: torch.Tensor  # [2, rows]: each chunk row's first stream index and its segment's end
    save_tokens: torch.Tensor  # [saves]: the stream index of the token before each save point
    token_rows: torch.Tensor  # [7, T] (written)
    conv_src: torch.Tensor  # [T, K] (written)
    chunk_tokens: torch.Tensor  # [rows, GDN_CHUNK] (written)
    save_window_src: torch.Tensor  # [saves, K - 1] (written)
