"""ForkAttention's Triton kernel (run by the interpreter on CPU) against its torch reference."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from flide_sdk.kernels.fixed_order import fork_attention_fixed
from flide_sdk.kernels.fork_attention import (
    FORK_ATTENTION_FLOAT32,
    PLAN_ROW_BLOCK,
    attention_tiles,
    fork_attention_config,
    fork_attention_triton,
    plan_tiles_reference,
    tile_table,
)
from flide_sdk.kernels.reference import fork_attention_reference
from flide_sdk.plan.layout import PAGE, RequestSpec, Resume, plan_round
from flide_sdk.plan.requests import Branches


def round_with_history(seed: int, heads: int, kv_heads: int, dim: int):
    """Requests with trunks of 1..130 tokens, 1..4 branches of 1..40 tokens (branch regions of one request over
    more than one tile), some resuming after a paged history; two have a text-scored question too (a branch and
    2..6 option pieces of 1..30 tokens under it, which see their question but not each other)."""
    rng = np.random.default_rng(seed)
    pages_total = 12
    k_cache = torch.randn(pages_total * PAGE, kv_heads, dim)
    v_cache = torch.randn(pages_total * PAGE, kv_heads, dim)
    requests = []
    for trunk_len, history in [(1, 0), (63, 0), (64, 70), (65, 0), (130, 129), (5, 1)]:
        branches = [rng.integers(0, 50, rng.integers(1, 41)) for _ in range(rng.integers(1, 5))]
        labels = [np.array([1])] * len(branches)
        replies = [[] for _ in branches]
        if trunk_len in (63, 130):
            branches.append(rng.integers(0, 50, rng.integers(3, 41)))
            labels.append(np.zeros(0, np.int64))
            replies.append([rng.integers(0, 50, rng.integers(2, 32)) for _ in range(rng.integers(2, 7))])
        resume = None
        if history:
            pages = rng.choice(pages_total, size=-(-history // PAGE), replace=False)
            resume = Resume(slot=0, pages=pages)
        requests.append(RequestSpec(rng.integers(0, 50, trunk_len), Branches.of(branches, labels, replies),
                                    start=history, resume=resume))
    rnd = plan_round(requests, 4).to("cpu")
    total = rnd.ids.shape[0]
    q = torch.randn(total, heads, dim)
    k, v = torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    return rnd, q, k, v, k_cache, v_cache


def float32_config(**changes):
    """The float32 production config with some tuning constants changed."""
    return dataclasses.replace(FORK_ATTENTION_FLOAT32, **changes)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize(("seed", "heads", "kv_heads", "dim"), [(0, 4, 2, 16), (1, 2, 2, 32)])
def test_triton_matches_reference_on_every_row(seed, heads, kv_heads, dim):
    rnd, q, k, v, k_cache, v_cache = round_with_history(seed, heads, kv_heads, dim)
    expected = fork_attention_reference(q, k, v, rnd.attention, None, k_cache, v_cache)
    for per_program in sorted({1, heads // kv_heads}):  # one run when the group is one head
        got = fork_attention_triton(q, k, v, rnd.attention, None, k_cache, v_cache,
                                    config=float32_config(heads_per_program=per_program))
        assert relative_error(got, expected) <= 1e-5


def test_fixed_order_attention_matches_reference():
    """The batch-invariant mode's CPU attention: the same contract, options and all."""
    rnd, q, k, v, k_cache, v_cache = round_with_history(7, 4, 2, 16)
    rows = torch.sort(torch.cat([rnd.readout.rows, rnd.readout.text_rows])).values
    for query_rows in (None, rows):
        picked = slice(None) if query_rows is None else query_rows
        expected = fork_attention_reference(q[picked], k, v, rnd.attention, query_rows, k_cache, v_cache)
        got = fork_attention_fixed(q[picked], k, v, rnd.attention, query_rows, k_cache, v_cache)
        assert relative_error(got, expected) <= 1e-5


def test_options_see_their_question_and_not_each_other():
    """The reference's visibility on a text-scored question: an option's rows attend to the trunk, the question
    and their own option only (an option's output is that of the same round without its siblings)."""
    rnd, q, k, v, k_cache, v_cache = round_with_history(8, 2, 2, 16)
    full = fork_attention_reference(q, k, v, rnd.attention, None, k_cache, v_cache)
    plan = rnd.attention
    option_rows = (plan.seg_lo < torch.arange(len(plan.seg_lo))) & (plan.vis_end < plan.vis_end[plan.seg_lo])
    assert option_rows.any(), "the round has option pieces"
    for row in option_rows.nonzero().squeeze(1).tolist():
        sibling_keys = (torch.arange(len(plan.seg_lo)) >= int(plan.seg_lo[row])) & (plan.vis_end <= row)
        if sibling_keys.any():
            noisy_k = k.clone()
            noisy_k[sibling_keys] = torch.randn_like(k[sibling_keys])
            again = fork_attention_reference(q, noisy_k, v, plan, None, k_cache, v_cache)
            assert torch.equal(again[row], full[row])
            break
    else:
        pytest.fail("no option has an earlier sibling")


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (12, 2)], ids=["group-4", "group-6"])
def test_16_bit_default_tiling_stays_within_its_rounding(heads, kv_heads):
    """The 16-bit default: 64 rows of the group's heads (4, or the largest power-of-two divisor of the group
    up to 4: 2 for a group of 6) x their tokens, 32-key blocks. float16 (the interpreter cannot run bfloat16
    through tl.dot)."""
    rnd, q, k, v, k_cache, v_cache = round_with_history(6, heads, kv_heads, 32)
    expected = fork_attention_reference(q, k, v, rnd.attention, None, k_cache, v_cache)
    half = [x.half() for x in (q, k, v, k_cache, v_cache)]
    got = fork_attention_triton(half[0], half[1], half[2], rnd.attention, None, half[3], half[4])
    assert got.dtype == torch.float16
    assert relative_error(got, expected) <= 2e-3


@pytest.mark.parametrize("block_keys", [16, pytest.param(32, marks=pytest.mark.slow)])
def test_triton_takes_keys_in_blocks_smaller_than_a_page(block_keys):
    """Key blocks of part of a page: history blocks at offsets inside their page, stream blocks as usual. (32-key
    blocks, two a page, are the 16-bit default's, over histories in `test_16_bit_default_tiling_...`.)"""
    rnd, q, k, v, k_cache, v_cache = round_with_history(5, 4, 2, 16)
    assert int(rnd.attention.history_len.max()) > block_keys, "the round resumes past one key block"
    expected = fork_attention_reference(q, k, v, rnd.attention, None, k_cache, v_cache)
    got = fork_attention_triton(q, k, v, rnd.attention, None, k_cache, v_cache, config=float32_config(block_keys=block_keys))
    assert relative_error(got, expected) <= 1e-5


def test_triton_refuses_key_blocks_that_cross_pages_and_head_counts_that_do_not_tile():
    rnd, q, k, v, k_cache, v_cache = round_with_history(5, 4, 2, 16)
    with pytest.raises(ValueError, match="block_keys"):
        fork_attention_triton(q, k, v, rnd.attention, None, k_cache, v_cache, config=float32_config(block_keys=48))
    rnd, q, k, v, k_cache, v_cache = round_with_history(5, 6, 2, 16)
    with pytest.raises(ValueError, match="heads_per_program"):
        fork_attention_triton(q, k, v, rnd.attention, None, k_cache, v_cache, config=float32_config(heads_per_program=3))


def test_triton_matches_reference_on_readout_rows():
    rnd, q, k, v, k_cache, v_cache = round_with_history(2, 4, 2, 16)
    rows = rnd.readout.rows
    expected = fork_attention_reference(q[rows], k, v, rnd.attention, rows, k_cache, v_cache)
    got = fork_attention_triton(q[rows], k, v, rnd.attention, rows, k_cache, v_cache)
    assert relative_error(got, expected) <= 1e-5


def test_tile_table_partitions_rows_by_region():
    rnd, *_ = round_with_history(3, 2, 2, 16)
    rows = torch.arange(rnd.ids.shape[0])
    tile_start, num_tiles, max_tiles = plan_tiles_reference(
        rows, rnd.attention.ctx_hi, 2 * rnd.attention.history_len.shape[0], 32, rnd.attention.num_tokens)
    starts = tile_start[: int(num_tiles) + 1].tolist()
    assert starts[0] == 0 and starts[-1] == len(rows) and int(num_tiles) <= max_tiles
    region = rnd.attention.ctx_hi
    for lo, hi in itertools.pairwise(starts):
        assert 0 < hi - lo <= 32
        assert bool((region[lo:hi] == region[lo]).all())
    assert (tile_start[int(num_tiles) + 1 : max_tiles + 1] == len(rows)).all()


@pytest.mark.parametrize("readout", [False, True])
def test_triton_applies_the_output_gate_like_the_reference(readout):
    """The gate is a strided view (q|gate interleaved per head, as the model's projection leaves it)."""
    rnd, q, k, v, k_cache, v_cache = round_with_history(4, 4, 2, 16)
    q_gate = torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2])
    q, gate = q_gate.chunk(2, dim=-1)
    rows = rnd.readout.rows if readout else None
    if readout:
        q, gate = q[rows], gate[rows]
    expected = fork_attention_reference(q, k, v, rnd.attention, rows, k_cache, v_cache, gate)
    ungated = fork_attention_reference(q, k, v, rnd.attention, rows, k_cache, v_cache)
    assert torch.allclose(expected, ungated * torch.sigmoid(gate))
    got = fork_attention_triton(q, k, v, rnd.attention, rows, k_cache, v_cache, gate)
    assert relative_error(got, expected) <= 1e-5


def test_attention_tiles_builds_the_stream_and_readout_tables_the_kernel_reads():
    rnd, q, k, v, k_cache, v_cache = round_with_history(5, 2, 2, 16)
    plan, rows = rnd.attention, rnd.readout.rows
    tiled = attention_tiles(plan, rows, 2, 2, 16, torch.float32)
    every, readout = tiled.stream_tiles, tiled.readout_tiles
    assert every.query_rows is None and readout.query_rows is rows and readout.rows is rows
    assert readout.tile_start is not every.tile_start
    expected = plan_tiles_reference(rows, plan.ctx_hi, 2 * plan.history_len.shape[0], 64, plan.num_tokens)
    assert torch.equal(readout.tile_start, expected[0]) and torch.equal(readout.num_tiles, expected[1])
    assert readout.max_tiles == expected[2]
    for query_rows, picked in ((None, slice(None)), (rows, rows)):
        reference = fork_attention_reference(q[picked], k, v, plan, query_rows, k_cache, v_cache)
        got = fork_attention_triton(q[picked], k, v, tiled, query_rows, k_cache, v_cache)
        assert relative_error(got, reference) <= 1e-5
    with pytest.raises(ValueError, match="tile table"):  # a table is only read by the tiling it was built for
        fork_attention_triton(q, k, v, tiled, None, k_cache, v_cache, config=float32_config(block_rows=16))
    with pytest.raises(ValueError, match="tile table"):
        fork_attention_triton(q[rows], k, v, tiled, rows.clone(), k_cache, v_cache)


@pytest.mark.parametrize("pieces", [False, True], ids=["regions", "pieces"])
@pytest.mark.parametrize("block_tokens", [16, 64])
def test_device_tile_table_matches_the_reference_over_row_blocks_and_padding(block_tokens, pieces):
    """More query rows than the planner takes in one block (regions that cross its blocks), padded to a
    capacity as a graph's round is: the kernel's tile table and tile count equal `plan_tiles_reference`'s;
    with piece tiles no tile crosses a branch."""
    from flide_sdk.plan.capacity import capacity_ladder, choose, pad_round

    rng = np.random.default_rng(3)
    requests = [RequestSpec.of(rng.integers(0, 50, n), [rng.integers(0, 50, rng.integers(1, 90)) for _ in range(b)],
                               [np.array([1])] * b) for n, b in [(1500, 3), (2100, 40), (7, 1), (900, 2)]]
    host = plan_round(requests, 4)
    capacity = choose(capacity_ladder(4, 16384, 8, 32768), host)
    padded = pad_round(host, capacity, 0)
    assert padded.num_tokens > PLAN_ROW_BLOCK and int(padded.num_real) < padded.num_tokens
    plan = padded.to("cpu").attention
    requests, questions = plan.history_len.shape[0], len(padded.readout_rows)
    region_of, regions = (plan.seg_lo, requests + questions + 1) if pieces else (plan.ctx_hi, 2 * requests)
    for query_rows in (None, torch.as_tensor(padded.readout_rows)):
        table = tile_table(plan, query_rows, padded.num_tokens, block_tokens, questions=questions if pieces else None)
        expected = plan_tiles_reference(table.rows, region_of, regions, block_tokens, plan.num_tokens)
        assert torch.equal(table.tile_start, expected[0]) and torch.equal(table.num_tiles, expected[1])
        assert table.max_tiles == expected[2]
        starts = table.tile_start[: int(table.num_tiles) + 1].tolist()
        crossing = [lo for lo, hi in itertools.pairwise(starts) if len(set(plan.seg_lo[table.rows[lo:hi]].tolist())) > 1]
        assert not crossing if pieces else crossing, "tiles cross branches only without piece tiles"


def tile_keys(plan, table, tile: int) -> int:
    """Keys tile `tile` visits, from the host side of the metadata: its history, full and masked ranges."""
    rows = table.rows[int(table.tile_start[tile]) : int(table.tile_start[tile + 1])]
    first, last = int(rows[0]), int(rows[-1])
    key_lo, ctx_hi = int(plan.key_lo[first]), int(plan.ctx_hi[first])
    branch = ctx_hi > key_lo
    full_hi, masked_lo = (ctx_hi, int(plan.seg_lo[first])) if branch else (first, first)
    return int(plan.history_len[int(plan.request_of[first])]) + full_hi - key_lo + last + 1 - masked_lo


@pytest.mark.parametrize(("min_split_keys", "extra_items"), [(64, 10_000), (64, 3), (512, 2)])
def test_split_plan_covers_each_tiles_keys_in_order(min_split_keys, extra_items):
    rnd, *_ = round_with_history(3, 2, 2, 16)
    plan, total = rnd.attention, rnd.ids.shape[0]
    table = tile_table(plan, None, total, 16, min_split_keys, extra_items)
    tiles = int(table.num_tiles)
    keys = np.array([tile_keys(plan, table, t) for t in range(tiles)])
    split_keys = max(min_split_keys, -(-int(keys.sum()) // extra_items))
    splits = np.maximum(-(-keys // split_keys), 1)
    items = int(table.num_items)
    assert table.tile_splits[:tiles].tolist() == splits.tolist() and (table.tile_splits[tiles:] == 0).all()
    assert items == splits.sum() <= table.max_items
    piece = table.tile_piece[:tiles].numpy()
    assert (piece % PAGE == 0).all() and (splits * piece >= keys).all() and ((splits - 1) * piece < keys).all()
    assert table.item_tile[:items].tolist() == np.repeat(np.arange(tiles), splits).tolist()
    assert table.item_split[:items].tolist() == [s for n in splits for s in range(n)]
    slots = table.partial_slot[:tiles].numpy()
    several = splits > 1
    assert (slots[~several] == -1).all()
    assert slots[several].tolist() == (np.cumsum(splits[several]) - splits[several]).tolist()
    assert splits[several].sum() <= table.max_partials
    if min_split_keys == 64 and extra_items > 1000:
        assert several.sum() > 3, "the round has tiles long enough to split"


@pytest.mark.parametrize(("seed", "heads", "kv_heads", "min_split_keys", "extra_items"),
                         [(0, 4, 2, 64, 64), (1, 2, 2, 64, 5), (4, 4, 1, 128, 64)])
def test_split_tiles_match_reference(seed, heads, kv_heads, min_split_keys, extra_items):
    """64 extra items: every long tile split into pieces of the minimum (the round has fewer than 64 x
    min_split_keys keys; a grid of 64 items past one per tile); 5: pieces of a fifth of the round's keys."""
    rnd, q, k, v, k_cache, v_cache = round_with_history(seed, heads, kv_heads, 16)
    plan, rows = rnd.attention, rnd.readout.rows
    gate = torch.randn_like(q)
    for query_rows in (None, rows):
        picked = slice(None) if query_rows is None else query_rows
        expected = fork_attention_reference(q[picked], k, v, plan, query_rows, k_cache, v_cache, gate[picked])
        config = float32_config(min_split_keys=min_split_keys, extra_items=extra_items)
        got = fork_attention_triton(q[picked], k, v, plan, query_rows, k_cache, v_cache, gate[picked], config=config)
        assert relative_error(got, expected) < 1e-5
    tiled = attention_tiles(plan, rows, heads, kv_heads, q.shape[2], q.dtype, config)
    split_tables = [t for t in (tiled.stream_tiles, tiled.readout_tiles) if int(t.tile_splits.max()) > 1]
    assert split_tables, "some tile of the round was split"
    for table in split_tables:
        tiles = int(table.num_tiles)
        pieces = table.tile_piece[:tiles][table.tile_splits[:tiles] > 1]
        if extra_items == 64:
            assert (pieces <= min_split_keys).all(), "pieces of the minimum, as with unbounded items"
        else:
            assert (pieces > min_split_keys).all(), "pieces of the round's share"


def test_split_settings_are_checked():
    rnd, q, k, v, k_cache, v_cache = round_with_history(6, 2, 2, 16)
    for knobs in ({"min_split_keys": 100}, {"min_split_keys": 0}, {"extra_items": -1}):
        with pytest.raises(ValueError, match="min_split_keys"):
            fork_attention_triton(q, k, v, rnd.attention, None, k_cache, v_cache, config=float32_config(**knobs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_wide_heads_take_a_tiling_of_fewer_rows(dtype):
    """Gemma 4's full layers' heads of 512: the production config for them holds 16 (float32) or 32 (16-bit, two
    heads of 16 tokens) rows a program, and matches the reference with a sliding window (float16: the
    interpreter cannot run bfloat16 through tl.dot). Mutation caught: wide heads given the 64-row tiling of
    narrower ones (on the GPU, a 64 x 512 float32 accumulator a program: far past its registers)."""
    window = 40
    rnd, q, k, v, k_cache, v_cache = round_with_history(2, 4, 1, 512)
    q, k, v, k_cache, v_cache = (x.to(dtype) for x in (q, k, v, k_cache, v_cache))
    plan, rows = rnd.attention, rnd.readout.rows
    tiled = attention_tiles(plan, rows, 4, 1, 512, dtype)
    rows_per_program = 16 if dtype == torch.float32 else 32
    assert tiled.stream_tiles.block_tokens == 16 and fork_attention_config(dtype, head_dim=512).block_rows == \
        rows_per_program
    for query_rows in (None, rows):
        picked = slice(None) if query_rows is None else query_rows
        expected = fork_attention_reference(q[picked].float(), k.float(), v.float(), plan, query_rows,
                                            k_cache.float(), v_cache.float(), scale=1 / 64, window=window)
        got = fork_attention_triton(q[picked], k, v, tiled, query_rows, k_cache, v_cache, scale=1 / 64,
                                    window=window)
        assert relative_error(got, expected) <= (1e-5 if dtype == torch.float32 else 2e-3)


def with_image_spans(plan):
    """`plan` with `see_hi`: two image spans in the 130-token trunk resuming at 129 (its rows 5..29, and 40..129
    to its end, across tile starts at 64, or 64 and 96: a tile's keys past a page more than without the bounds)
    and one in the 65-token trunk (rows 3..63): their soft tokens see the later ones of their image, every other
    token itself."""
    see_hi = torch.arange(plan.key_lo.shape[0])
    trunk_start = {int((plan.ctx_hi[start:end] == start).sum()): start for start, end in plan.request_bounds}
    for trunk, spans in ((130, [(5, 30), (40, 130)]), (65, [(3, 64)])):
        start = trunk_start[trunk]
        for lo, hi in spans:
            see_hi[start + lo : start + hi] = start + hi - 1
    return dataclasses.replace(plan, see_hi=see_hi)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_triton_lets_image_tokens_see_their_whole_image(dtype):
    """`see_hi` (Gemma 4's sliding layers over images): the kernel matches the reference with a window shorter
    than a span, on the stream's and the readout rows, with the production tiling (float16: 32-token tiles of two
    heads) and (float32) with tiles split into 64-key pieces; a tile table built without the bounds is refused.
    Mutations caught: the tile's masked key range not extended past its last row (kernel or planner: the split
    plan's key counts); a row's own keys bounded by itself, not its see_hi; a table's bounds not checked."""
    window = 24
    rnd, q, k, v, k_cache, v_cache = round_with_history(9, 4, 2, 16)
    plan, rows = with_image_spans(rnd.attention), rnd.readout.rows
    q, k, v, k_cache, v_cache = (x.to(dtype) for x in (q, k, v, k_cache, v_cache))
    causal = fork_attention_reference(q.float(), k.float(), v.float(), rnd.attention, None, k_cache.float(),
                                      v_cache.float(), window=window)
    configs = [None] + ([float32_config(min_split_keys=64, extra_items=64)] if dtype == torch.float32 else [])
    for config, query_rows in itertools.product(configs, (None, rows)):
        picked = slice(None) if query_rows is None else query_rows
        expected = fork_attention_reference(q[picked].float(), k.float(), v.float(), plan, query_rows,
                                            k_cache.float(), v_cache.float(), window=window)
        if query_rows is None:
            assert relative_error(expected, causal) > 0.1, "the spans change the soft tokens' outputs"
        tiled = attention_tiles(plan, rows, 4, 2, 16, dtype, config)
        got = fork_attention_triton(q[picked], k, v, tiled, query_rows, k_cache, v_cache, window=window,
                                    config=config)
        assert relative_error(got, expected) <= (1e-5 if dtype == torch.float32 else 2e-3)
    with pytest.raises(ValueError, match="key bounds"):
        fork_attention_triton(q, k, v, dataclasses.replace(attention_tiles(rnd.attention, rows, 4, 2, 16, dtype),
                                                           see_hi=plan.see_hi), None, k_cache, v_cache, window=window)
