"""Indexed short causal convolution (depthwise, kernel K) followed by SiLU, over a round's flat stream, and
the conv windows a round saves for its checkpoints.

Each token reads itself and its K-1 predecessors through `src` instead of through its stream neighbours.
An index names a row of the virtual table [zero row, stream rows x, resumed window rows]: 0 is the zero
row, 1 + t is stream token t, 1 + T + j is row j % (K-1) of the saved window in pool slot
resume_slots[j // (K-1)]. So a branch's first tokens read the last tokens of its trunk, a resumed trunk
reads its checkpoint's window, and a position before the start of a prompt reads zeros. The table is never
materialised: the kernels resolve indices while they load, reading the windows straight from the pool's
window arena [slots, K-1, C] of the layer.
A checkpoint's window is the K-1 conv inputs before its save point: `save_windows` writes, for each save
r, the table rows save_src[r] into the arena's slot save_slots[r] (one launch on CUDA). A round never saves
into a slot it resumes from, so the reads and writes of one launch never meet.
`*_reference` are the definitions (torch); `*_triton` the kernels (one pass each, SiLU fused in the conv).
How its loads are addressed, and what was measured: docs/decisions/short-conv-kernel.md.
The engine runs the conv and the window saves inside `gdn_front`'s single launch; the launchers here run
each part alone (its tests, `benchmarks/bench_conv.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flide_sdk.kernels import TileLaunch

BLOCK_T = 16  # 16 x 128 at 4 warps: no register spills on sm_90 (32 x 128 spilled)
BLOCK_C = 128


@triton.jit
def _table_row_offsets(resume_ptr, index, ok, total, window_base, stride_x, stride_cs, stride_ck,
                       WINDOW: tl.constexpr):
    """Where rows `index` (any shape) of the virtual table start, in elements from the stream's first row (a
    window row: `window_base`, the arena's offset from it, onwards), and whether each is read (not the zero
    row, and `ok`). The caller adds the channels and loads every row at once: one integer select per row
    keeps the rows' alignment visible to the compiler (each row starts on 16 elements when the strides and
    `window_base` do), so a row loads 16 bytes at a time, where a select between two pointers loaded 2."""
    in_window = (index > total) & ok
    j = tl.where(in_window, index - 1 - total, 0)
    slot = tl.load(resume_ptr + j // WINDOW, mask=in_window, other=0)
    row = tl.where(in_window, window_base + slot * stride_cs + (j % WINDOW) * stride_ck,
                   tl.maximum(index - 1, 0) * stride_x)
    return row, (index >= 1) & ok


@triton.jit
def _conv_tile(
    x_ptr, window_base, resume_ptr, weight_ptr, src_ptr, out_ptr, total, channels,
    stride_x, stride_cs, stride_ck, stride_weight, stride_tap, stride_src, stride_out, token_block, channel_block,
    TAPS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, EVEN_C: tl.constexpr,
):
    """silu(sum over taps of weight * table row src[t, tap]) for the BT tokens x BC channels of one tile
    (EVEN_C: the channels are a multiple of BC, no channel masks).

    A tile whose every tap reads its own token's stream predecessor (src[t, tap] = 1 + t - (TAPS - 1) + tap:
    the inside of a segment, most tiles) loads those rows at addresses arithmetic in t; only the other tiles
    (a segment's first tokens, padding) resolve each token's indices. Both paths add the same rows in the same
    order. Compiled for sm_90 (Triton 3.6), resolving every tap's indices moved them between threads through
    shared memory (two barriers a tap), and so did a weight row loaded as [1, BC]; the weights are loaded as
    [BT, BC] tiles (one row for every token), in the rows' own layout."""
    tokens = token_block * BT + tl.arange(0, BT)
    chans = channel_block * BC + tl.arange(0, BC)
    token_ok = tokens < total
    if EVEN_C:
        chan_ok = tl.full((BC,), 1, tl.int1)
    else:
        chan_ok = chans < channels
    other = ~token_ok | (tokens < TAPS - 1)  # a token whose taps are not all stream rows before it
    for tap in tl.static_range(TAPS):
        index = tl.load(src_ptr + tokens * stride_src + tap, mask=token_ok, other=0)
        other |= index != tokens + 1 - (TAPS - 1) + tap
    plain = tl.sum(other.to(tl.int32)) == 0
    weight_rows = weight_ptr + tokens[:, None] * 0 + chans[None, :] * stride_weight
    acc = tl.zeros((BT, BC), tl.float32)
    if plain:
        for tap in tl.static_range(TAPS):
            rows = tl.load(x_ptr + (tokens[:, None] - (TAPS - 1 - tap)) * stride_x + chans[None, :],
                           mask=chan_ok[None, :], other=0.0)
            weight = tl.load(weight_rows + tap * stride_tap, mask=chan_ok[None, :], other=0.0)
            acc += rows.to(tl.float32) * weight.to(tl.float32)
    else:
        for tap in tl.static_range(TAPS):
            index = tl.load(src_ptr + tokens * stride_src + tap, mask=token_ok, other=0)
            row, read = _table_row_offsets(resume_ptr, index, token_ok, total, window_base, stride_x, stride_cs,
                                           stride_ck, TAPS - 1)
            rows = tl.load(x_ptr + row[:, None] + chans[None, :], mask=read[:, None] & chan_ok[None, :], other=0.0)
            weight = tl.load(weight_rows + tap * stride_tap, mask=chan_ok[None, :], other=0.0)
            acc += rows.to(tl.float32) * weight.to(tl.float32)
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + tokens[:, None] * stride_out + chans[None, :], out.to(out_ptr.dtype.element_ty),
             mask=token_ok[:, None] & chan_ok[None, :])


@triton.jit
def _indexed_conv_kernel(
    x_ptr, window_base, resume_ptr, weight_ptr, src_ptr, out_ptr, total, channels,
    stride_x, stride_cs, stride_ck, stride_weight, stride_tap, stride_src, stride_out,
    TAPS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, EVEN_C: tl.constexpr,
):
    _conv_tile(x_ptr, window_base, resume_ptr, weight_ptr, src_ptr, out_ptr, total, channels,
               stride_x, stride_cs, stride_ck, stride_weight, stride_tap, stride_src, stride_out,
               tl.program_id(0), tl.program_id(1), TAPS, BT, BC, EVEN_C)


@triton.jit
def _save_window(
    x_ptr, cache_ptr, window_base, resume_ptr, save_slots_ptr, src_ptr, total, channels,
    stride_x, stride_cs, stride_ck, stride_src, save, channel_block,
    WINDOW: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr,
):
    """Table rows src[save] into the arena's slot save_slots[save], BC channels of them."""
    chans = channel_block * BC + tl.arange(0, BC)
    chan_ok = chans < channels
    taps = tl.arange(0, BW)
    tap_ok = taps < WINDOW
    index = tl.load(src_ptr + save * stride_src + taps, mask=tap_ok, other=0)
    row, read = _table_row_offsets(resume_ptr, index, tap_ok, total, window_base, stride_x, stride_cs, stride_ck,
                                   WINDOW)
    rows = tl.load(x_ptr + row[:, None] + chans[None, :], mask=read[:, None] & chan_ok[None, :], other=0.0)
    slot = tl.load(save_slots_ptr + save)
    tl.store(cache_ptr + slot * stride_cs + taps[:, None] * stride_ck + chans[None, :],
             rows.to(cache_ptr.dtype.element_ty), mask=tap_ok[:, None] & chan_ok[None, :])


@triton.jit
def _save_windows_kernel(
    x_ptr, cache_ptr, window_base, resume_ptr, save_slots_ptr, src_ptr, total, channels,
    stride_x, stride_cs, stride_ck, stride_src,
    WINDOW: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr,
):
    _save_window(x_ptr, cache_ptr, window_base, resume_ptr, save_slots_ptr, src_ptr, total, channels,
                 stride_x, stride_cs, stride_ck, stride_src, tl.program_id(0), tl.program_id(1), WINDOW, BW, BC)


def _arena_slots(x: torch.Tensor, window_cache: torch.Tensor, resume_slots: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Checks the window arena's layout; the resume slots as a kernel argument (a dummy slot when there are
    none: the kernels never read it then) and the arena's offset from x in elements (`_table_row_offsets`)."""
    if window_cache.dim() != 3 or window_cache.shape[-1] != x.shape[1] or window_cache.stride(-1) != 1:
        raise ValueError(f"window arena {tuple(window_cache.shape)} must be [slots, K-1, {x.shape[1]}], unit last stride")
    if window_cache.dtype != x.dtype or window_cache.device != x.device:
        raise ValueError(f"window arena {window_cache.dtype} on {window_cache.device} must match x's {x.dtype} on {x.device}")
    window_base, rest = divmod(window_cache.data_ptr() - x.data_ptr(), x.element_size())
    if rest:
        raise ValueError("the window arena and x must be aligned to their element size")
    return (resume_slots if resume_slots.numel() else resume_slots.new_zeros(1)), window_base


def conv_launch(
    x: torch.Tensor, window_cache: torch.Tensor, resume_slots: torch.Tensor, weight: torch.Tensor, src: torch.Tensor,
    block_t: int = BLOCK_T, block_c: int = BLOCK_C,
) -> TileLaunch:
    """Checks the arena; `_conv_tile`'s launch over (token blocks, channel blocks), its output new."""
    resume_slots, window_base = _arena_slots(x, window_cache, resume_slots)
    total, channels = x.shape
    out = torch.empty_like(x)
    arguments = (x, window_base, resume_slots, weight, src, out, total, channels, x.stride(0),
                 window_cache.stride(0), window_cache.stride(1), weight.stride(0), weight.stride(1), src.stride(0),
                 out.stride(0))
    constants = {"TAPS": src.shape[1], "BT": block_t, "BC": block_c, "EVEN_C": channels % block_c == 0}
    return TileLaunch(arguments, constants, (triton.cdiv(total, block_t), triton.cdiv(channels, block_c)), (out,))


def indexed_conv_triton(
    x: torch.Tensor, window_cache: torch.Tensor, resume_slots: torch.Tensor, weight: torch.Tensor, src: torch.Tensor,
    *, block_t: int = BLOCK_T, block_c: int = BLOCK_C, num_warps: int = 4,
) -> torch.Tensor:
    """The Triton kernel behind the same contract as `indexed_conv_reference` (sum in float32).

    The keyword arguments are tuning knobs (tokens and channels per program, powers of two; warps)."""
    conv = conv_launch(x, window_cache, resume_slots, weight, src, block_t, block_c)
    _indexed_conv_kernel[conv.grid](*conv.arguments, **conv.constants, num_warps=num_warps)
    return conv.outputs[0]


def save_launch(
    x: torch.Tensor, window_cache: torch.Tensor, resume_slots: torch.Tensor, save_slots: torch.Tensor,
    save_src: torch.Tensor,
) -> TileLaunch:
    """Checks the arena; `_save_window`'s launch over (saves, channel blocks); it writes the arena in place."""
    resume_slots, window_base = _arena_slots(x, window_cache, resume_slots)
    saves, window = save_src.shape
    total, channels = x.shape
    arguments = (x, window_cache, window_base, resume_slots, save_slots, save_src, total, channels,
                 x.stride(0), window_cache.stride(0), window_cache.stride(1), save_src.stride(0))
    constants = {"WINDOW": window, "BW": triton.next_power_of_2(window), "BC": BLOCK_C}
    return TileLaunch(arguments, constants, (saves, triton.cdiv(channels, BLOCK_C)), ())


def save_windows_triton(
    x: torch.Tensor, window_cache: torch.Tensor, resume_slots: torch.Tensor, save_slots: torch.Tensor,
    save_src: torch.Tensor,
) -> None:
    """The Triton kernel behind the same contract as `save_windows_reference` (one launch)."""
    save = save_launch(x, window_cache, resume_slots, save_slots, save_src)
    if save.grid[0]:
        _save_windows_kernel[save.grid](*save.arguments, **save.constants)
