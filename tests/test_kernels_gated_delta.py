"""The forked Gated DeltaNet Triton kernels (run by the interpreter on CPU) against their torch reference.

Rounds come from `plan_round`: trunks of 1, 63, 64, 65 and 130 tokens with 1..3 branches, GQA with Hv = 2 Hk,
requests resuming from nonzero state rows, trunks split at a save point, and levels padded to a larger
capacity (rows past each level's sizes holding garbage). Outputs and the whole state table must match in
float32 (relative error <= 1e-5), and within 16-bit rounding when W, U, the q-k block, the chunk start states
and v_new are stored in float16 (the interpreter cannot run bfloat16 tensors through tl.dot, so the 16-bit
storage path is checked in float16).
With 16-bit storage the prep's W and U products are TF32, from T through the scratch (16-row blocks) and from
T in registers (whole-chunk doubling).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from flide_sdk.kernels.gated_delta import (
    GATED_DELTA,
    GatedDeltaConfig,
    delta_workspace,
    gated_delta_triton,
    level_groups,
    stacked_rows,
)
from flide_sdk.kernels.reference import gated_delta_reference
from flide_sdk.plan.capacity import capacity_ladder, choose
from flide_sdk.plan.layout import (
    GDN_CHUNK,
    DeltaLevel,
    DeltaPlan,
    RequestSpec,
    Resume,
    Save,
    plan_round,
)

TOLERANCE = 1e-5
# the trunk scan with and without the output products (`fused_trunks`: rounds of at most that many trunks fuse them)
FUSING = pytest.mark.parametrize("fusing", [{"fused_trunks": 0}, {"fused_trunks": 64}], ids=["unfused", "fused"])
ALL_TRUNKS = [(1, 0, None), (63, 0, None), (64, 0, None), (65, 0, None), (130, 0, None)]


def make_requests(seed: int, trunks: list[tuple[int, int, int | None]], max_branches: int = 16) -> list[RequestSpec]:
    """One request per (trunk length, resume start, save point or None), with 1..max_branches branches.

    Request i resumes from slot i and saves to slot len(trunks) + i: as in the pool, a round never saves over
    a checkpoint it reads (a level's final rows are never its init rows).
    """
    rng = np.random.default_rng(seed)
    requests = []
    for slot, (length, start, save_at) in enumerate(trunks):
        branches = [rng.integers(0, 100, rng.integers(1, 70)) for _ in range(rng.integers(1, max_branches + 1))]
        resume = Resume(slot, np.arange(-(-start // 64))) if start else None
        save = Save(save_at, len(trunks) + slot, np.arange(save_at - start)) if save_at is not None else None
        requests.append(RequestSpec.of(rng.integers(0, 100, length), branches, [np.array([1, 2])] * len(branches),
                                    start=start, resume=resume, save=save))
    return requests


def random_inputs(seed: int, total: int, rows: int, k_heads: int, dk: int, dv: int):
    """q, k, v, g, beta of a round (Hv = 2 Hk) and a state table with random rows (row 0 is the zero row)."""
    gen = torch.Generator().manual_seed(seed)
    v_heads = 2 * k_heads
    q, k = torch.randn(total, k_heads, dk, generator=gen), torch.randn(total, k_heads, dk, generator=gen)
    v = torch.randn(total, v_heads, dv, generator=gen)
    g = -torch.rand(total, v_heads, generator=gen) * 0.3
    beta = torch.rand(total, v_heads, generator=gen)
    states = torch.randn(rows, v_heads, dk, dv, generator=gen) * 0.5
    states[0] = 0
    return q, k, v, g, beta, states


def tuned(**knobs) -> GatedDeltaConfig:
    """The production config with some tuning constants changed."""
    return dataclasses.replace(GATED_DELTA, **knobs)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).norm() / expected.double().norm())


def check_against_reference(plan: DeltaPlan, total: int, seed: int, k_heads: int, dk: int, dv: int,
                            run_plan: DeltaPlan | None = None, tolerance: float = TOLERANCE, **knobs) -> None:
    """The kernel on `run_plan` (default: `plan`) against the reference on `plan`: outputs and state table."""
    q, k, v, g, beta, states = random_inputs(seed, total, plan.num_rows, k_heads, dk, dv)
    expected_states = states.clone()
    expected = gated_delta_reference(q, k, v, g, beta, plan, expected_states)
    got = gated_delta_triton(q, k, v, g, beta, run_plan or plan, states, config=tuned(**knobs))
    assert got.dtype == v.dtype and got.shape == v.shape
    assert relative_error(got, expected) <= tolerance
    assert relative_error(states, expected_states) <= tolerance


def test_level_metadata_indexes_every_chunk():
    host = plan_round(make_requests(0, [(130, 0, None), (1, 0, None), (65, 0, 40)]), 4)
    for level in host.levels:
        assert level.active == [int((level.chunk_count > j).sum()) for j in range(len(level.active))]
        later_rows = []
        for segment, count in enumerate(level.chunk_count):
            rows = [segment] + [level.step_base[segment] + j for j in range(1, count)]
            firsts = [level.chunk_tokens[row, 0] for row in rows]
            assert np.array_equal(np.diff(firsts), np.full(count - 1, GDN_CHUNK))
            later_rows += rows[1:]
        # the first chunks are rows 0..active[0] - 1, the later ones every other row once, a segment's in order
        assert later_rows == list(range(level.active[0] if level.active else 0, len(level.chunk_tokens)))


def test_stacked_tables_hold_every_real_row_of_a_capacity():
    """The work tables are sized from a capacity's padded level tables and tokens (`stacked_rows`): every real row
    of a round that fits it has its place, for rounds of many one-chunk branches and of trunks cut at chunk
    boundaries (the most rows per token), and random ones."""
    rng = np.random.default_rng(7)
    ladder = capacity_ladder(4)
    rounds = [[RequestSpec.of(rng.integers(0, 99, 64 * n + 1), [rng.integers(0, 99, 1)] * 15, [np.array([1, 2])] * 15)
               for n in range(1, 9)],
              [RequestSpec.of(rng.integers(0, 99, 1), [rng.integers(0, 99, 1)] * 250, [np.array([1, 2])] * 250)]]
    rounds += [make_requests(seed, [(int(n), 0, int(n) // 2 or None) for n in rng.integers(1, 400, 6)])
               for seed in range(20)]
    for requests in rounds:
        host = plan_round(requests, 4)
        capacity = choose(ladder, host)
        assert capacity is not None
        rows = [int(level.sizes[0]) for level in host.levels]
        later = [int(level.sizes[0] - level.sizes[1]) for level in host.levels]
        bound = stacked_rows(capacity.tokens, list(capacity.chunks), list(capacity.segments))
        assert sum(rows) <= bound.rows and sum(rows[:2]) <= bound.trunk_rows and sum(later) <= bound.later_rows


@FUSING
def test_triton_matches_reference_on_a_random_round(fusing):
    """Dk = 32, Dv = 16: the products' column blocks (16 wide) split W in two."""
    host = plan_round(make_requests(1, ALL_TRUNKS, max_branches=3), 4)
    check_against_reference(host.to("cpu").delta, host.num_tokens, 1, 1, 32, 16, **fusing)


@pytest.mark.parametrize("fused_trunks", [1, 2, pytest.param(3, marks=pytest.mark.slow)])  # 3: fused, as 2
def test_a_round_fuses_its_outputs_by_its_real_trunk_count(fused_trunks):
    """Two trunks: fused when at most `fused_trunks` trunks fuse, unfused otherwise (the other launch of the
    trunk level does nothing); every output is written either way."""
    host = plan_round(make_requests(10, [(130, 0, 100), (65, 0, None)], max_branches=3), 4)
    assert int(host.levels[0].sizes[1]) == 2
    check_against_reference(host.to("cpu").delta, host.num_tokens, 10, 1, 16, 16, fused_trunks=fused_trunks)


@pytest.mark.parametrize(
    "knobs",
    [{"block_v": 16, "split_v": 1}, {"block_v": 16}, {"out_block_v": 16}, {"sub_block": 32}, {"sub_block": 64},
     # the scan's pipeline depth is the compiler's (num_stages): the interpreter runs it as the default
     pytest.param({"scan_stages": 2}, marks=pytest.mark.slow), {"block_v": 16, "split_v": 1, "fused_trunks": 64}],
    ids=["two-tiles-per-program", "two-programs", "two-output-tiles", "sub-block-32", "sub-block-64",
         "scan-two-stages", "fused-two-tiles-per-program"],
)
def test_triton_matches_reference_with_gqa_and_tiling(knobs):
    host = plan_round(make_requests(2, [(64, 0, None), (130, 0, None)], max_branches=1), 4)
    check_against_reference(host.to("cpu").delta, host.num_tokens, 2, 2, 16, 32, **knobs)


@pytest.mark.parametrize(
    ("knobs", "fusing"),
    [({}, {"fused_trunks": 0}), ({}, {"fused_trunks": 64}), ({"sub_block": 64}, {"fused_trunks": 64}),
     # the prep's products (the knobs) do not depend on the scan: each knob with the other scan is a sweep
     pytest.param({"sub_block": 64}, {"fused_trunks": 0}, marks=pytest.mark.slow)],
    ids=["tf32-products-unfused", "tf32-products-fused", "tf32-products-sub-block-64-fused",
         "tf32-products-sub-block-64-unfused"],
)
def test_triton_with_16_bit_storage_stays_within_its_rounding(knobs, fusing):
    """float16 W, U, q-k block, start states and v_new; the W and U products in TF32, from T through the scratch
    (16-row blocks) and from T in registers (whole-chunk doubling)."""
    host = plan_round(make_requests(5, [(130, 0, None), (65, 0, None)], max_branches=3), 4)
    check_against_reference(host.to("cpu").delta, host.num_tokens, 5, 1, 32, 32, tolerance=2e-3,
                            store_dtype=torch.float16, **knobs, **fusing)


FLOAT16 = {"store_dtype": torch.float16, "tolerance": 2e-3}


@pytest.mark.parametrize(
    ("storage", "fusing"),
    [({}, {"fused_trunks": 0}), (FLOAT16, {"fused_trunks": 64}),
     # the other two pairings: each scan and each storage is over long segments in the two above
     pytest.param({}, {"fused_trunks": 64}, marks=pytest.mark.slow),
     pytest.param(FLOAT16, {"fused_trunks": 0}, marks=pytest.mark.slow)],
    ids=["float32-unfused", "float16-fused", "float32-fused", "float16-unfused"],
)
def test_long_segments_match_reference(storage, fusing):
    """Segments of 2..5 chunks, split at a save point (inside a chunk, and at a chunk's end), resumed, with
    branches: the unfused scan in float32, the fused one with 16-bit storage (both pairings crossed: -m slow)."""
    trunks = [(300, 0, None), (257, 0, 200), (129, 70, None), (192, 0, 128)]
    host = plan_round(make_requests(8, trunks, max_branches=2), 4)
    assert sorted(int(n) for n in host.levels[0].chunk_count) == [2, 3, 4, 5]
    check_against_reference(host.to("cpu").delta, host.num_tokens, 8, 1, 32, 16, **storage, **fusing)


ONE_PROGRAM, THREE_AND_TWO = {"chunk_programs": 1, "scan_programs": 1}, {"chunk_programs": 6, "scan_programs": 4}


@pytest.mark.parametrize(
    ("programs", "fusing"),
    [(ONE_PROGRAM, {"fused_trunks": 0}), (THREE_AND_TWO, {"fused_trunks": 0}), (ONE_PROGRAM, {"fused_trunks": 64}),
     pytest.param(THREE_AND_TWO, {"fused_trunks": 64}, marks=pytest.mark.slow)],
    ids=["unfused-one-program", "unfused-three-and-two", "fused-one-program", "fused-three-and-two"],
)
def test_capped_grids_loop_over_every_row(programs, fusing):
    """Programs that loop over several chunk rows and segments (a capped grid) compute the same round: caps
    are per launch, so with two value heads 6 and 4 programs give each head 3 chunk programs and 2 scan
    programs, and 1 gives each head one (the least). The fused scan loops over the trunks in the one-program
    grid; with three and two as well under -m slow."""
    trunks = [(64, 70, None), (130, 129, 200), (5, 1, None), (65, 0, 64), (63, 0, None)]
    host = plan_round(make_requests(6, trunks, max_branches=2), 4)
    assert all(len(level.init_row) > 2 for level in host.levels[::2])
    check_against_reference(host.to("cpu").delta, host.num_tokens, 6, 1, 16, 16, **programs, **fusing)


def test_plans_of_other_level_counts_run_in_groups_of_three():
    """One prep and one output launch serve three levels; a plan of one level, or of four, runs the same.
    A round's three levels are one group as they are (no empty levels made: a device fill each)."""
    host = plan_round(make_requests(7, [(130, 0, 100), (65, 0, None)], max_branches=3), 4)
    plan = host.to("cpu").delta
    (group,) = level_groups(plan.levels)
    assert all(got is level for got, level in zip(group, plan.levels, strict=True))
    four = dataclasses.replace(plan, levels=[*plan.levels, plan.levels[1]])  # level 1 again: its segments run twice
    check_against_reference(four, host.num_tokens, 7, 1, 16, 16)
    q, k, v, g, beta, states = random_inputs(7, host.num_tokens, plan.num_rows, 1, 16, 16)
    one = dataclasses.replace(plan, levels=plan.levels[:1])
    expected_states = states.clone()
    expected = gated_delta_reference(q, k, v, g, beta, one, expected_states)
    got = gated_delta_triton(q, k, v, g, beta, one, states)
    covered = plan.levels[0].chunk_tokens.flatten()
    covered = covered[covered < host.num_tokens]  # only a plan's segments' tokens get outputs
    assert relative_error(got[covered], expected[covered]) <= TOLERANCE
    assert relative_error(states, expected_states) <= TOLERANCE


@FUSING
def test_layers_share_one_workspace(fusing):
    """A forward's layers run on one workspace (`delta_workspace`, sized for every level group of the plan): each
    call, on tables the one before left, gives the reference's outputs; a workspace too small is refused."""
    host = plan_round(make_requests(9, [(130, 0, 100), (65, 0, None), (1, 0, None)], max_branches=3), 4)
    plan = host.to("cpu").delta
    four = dataclasses.replace(plan, levels=[*plan.levels, plan.levels[1]])  # two level groups
    config = tuned(**fusing)
    shared = delta_workspace(four, host.num_tokens, 2, 16, 16, torch.float32, torch.device("cpu"), config=config)
    assert shared.workspace is not None and four.workspace is None
    for seed in (9, 10):  # two layers
        q, k, v, g, beta, states = random_inputs(seed, host.num_tokens, plan.num_rows, 1, 16, 16)
        expected_states = states.clone()
        expected = gated_delta_reference(q, k, v, g, beta, four, expected_states)
        got = gated_delta_triton(q, k, v, g, beta, shared, states, config=config)
        assert relative_error(got, expected) <= TOLERANCE
        assert relative_error(states, expected_states) <= TOLERANCE
    small = dataclasses.replace(shared, workspace=shared.workspace[:-1])
    with pytest.raises(ValueError, match="workspace of"):
        gated_delta_triton(q, k, v, g, beta, small, states, config=config)


def test_triton_matches_reference_with_resume_and_save():
    # resumed requests start from state rows 1..3; two trunks are split at their save point
    trunks = [(64, 70, None), (130, 129, 200), (5, 1, None), (65, 0, 64), (63, 0, None)]
    host = plan_round(make_requests(3, trunks, max_branches=2), 4)
    assert len(host.levels) == 3
    check_against_reference(host.to("cpu").delta, host.num_tokens, 3, 1, 16, 16)


@FUSING
def test_tables_past_the_level_sizes_are_never_read(fusing):
    """A captured graph's level tables are padded past each level's `sizes` (its real chunk rows and
    segments): the kernels never visit those rows. Here they hold real token indices, nonzero state rows and
    chunk counts, and final rows over a state the round writes and reads; the round computes the same."""
    host = plan_round(make_requests(4, [(65, 0, None), (130, 0, 100)], max_branches=2), 4)
    plan = host.to("cpu").delta
    pad = 2

    def padded(level: DeltaLevel) -> DeltaLevel:
        def extend(x: torch.Tensor, value: int) -> torch.Tensor:
            return torch.cat([x, x.new_full((pad, *x.shape[1:]), value)])

        return dataclasses.replace(
            level,
            chunk_tokens=extend(level.chunk_tokens, 0),
            init_row=extend(level.init_row, 5),
            final_row=extend(level.final_row, 4),
            chunk_count=extend(level.chunk_count, 2),
            step_base=extend(level.step_base, 0),
        )

    # row 4: level 0 writes it (a trunk's save point), level 1 starts from it
    assert 4 in plan.levels[0].final_row.tolist() and 4 in plan.levels[1].init_row.tolist()
    run_plan = dataclasses.replace(plan, levels=[padded(level) for level in plan.levels])
    check_against_reference(plan, host.num_tokens, 4, 1, 16, 16, run_plan=run_plan, **fusing)


def test_trunk_remainders_are_chained_to_their_first_parts():
    """Level 0 names, per trunk split at a save point, the level-1 segment of its remainder: it starts from the
    first part's final row at the next token. Every level-1 segment is named once."""
    trunks = [(64, 70, None), (130, 129, 200), (5, 1, None), (65, 0, 64), (63, 0, None), (200, 0, 70)]
    host = plan_round(make_requests(8, trunks, max_branches=3), 4)
    first, remainder = host.levels[0], host.levels[1]
    assert remainder.chained and not first.chained and not host.levels[2].chained
    named = first.chain[first.chain >= 0]
    assert sorted(named.tolist()) == list(range(len(remainder.init_row))) and len(named) == 3
    for segment, follow in enumerate(first.chain.tolist()):
        if follow < 0:
            continue
        assert remainder.init_row[follow] == first.final_row[segment]
        rows = [segment] + [first.step_base[segment] + j for j in range(1, first.chunk_count[segment])]
        last_token = first.chunk_tokens[rows]
        assert remainder.chunk_tokens[follow, 0] == last_token[last_token < host.num_tokens].max() + 1
    assert (host.levels[2].chain == -1).all() and (remainder.chain == -1).all()


@FUSING
def test_chained_scan_computes_what_separate_launches_do(fusing):
    """The scan carrying a trunk's state into its remainder in one program gives, bit for bit, what a launch
    per level gives (the plan with its chain removed)."""
    trunks = [(130, 129, 200), (65, 0, 64), (200, 0, 70), (5, 1, None)]
    host = plan_round(make_requests(9, trunks, max_branches=1), 4)
    plan = host.to("cpu").delta
    unchained = dataclasses.replace(plan, levels=[
        dataclasses.replace(plan.levels[0], chain=torch.full_like(plan.levels[0].chain, -1)),
        dataclasses.replace(plan.levels[1], chained=False), plan.levels[2]])
    q, k, v, g, beta, states = random_inputs(9, host.num_tokens, plan.num_rows, 1, 16, 16)
    separate_states, expected_states = states.clone(), states.clone()
    chained = gated_delta_triton(q, k, v, g, beta, plan, states, config=tuned(**fusing))
    separate = gated_delta_triton(q, k, v, g, beta, unchained, separate_states, config=tuned(**fusing))
    assert torch.equal(chained, separate) and torch.equal(states, separate_states)
    expected = gated_delta_reference(q, k, v, g, beta, plan, expected_states)
    assert relative_error(chained, expected) <= TOLERANCE
    assert relative_error(states, expected_states) <= TOLERANCE


HELPING = [({"scan_helpers": 4, "helper_steps": 1}, "all-branch-rows"),
           ({"scan_helpers": 1, "helper_steps": 2}, "one-row"),
           ({"scan_helpers": 64, "helper_steps": 1}, "programs-loop-over-items"),
           ({"scan_helpers": 4, "helper_steps": 1, "scan_programs": 2}, "no-idle-programs")]


@pytest.mark.parametrize(
    ("helping", "save_at"),
    [pytest.param(helping, save_at, id=f"{trunk}-{name}",
                  marks=pytest.mark.slow if name == "programs-loop-over-items" or save_at and name != "all-branch-rows"
                  else ())
     for save_at, trunk in ((None, "whole-trunk"), (200, "split-at-save")) for helping, name in HELPING],
)
def test_the_fused_scan_preps_branch_rows_the_prep_leaves(helping, save_at):
    """In a fused round of one trunk the fused scan's programs that find no segment prep the first branch rows
    and the prep launch skips them (`_branch_rows_aside`): the same round, bit for bit, as with no helpers, for
    all 4 branch rows (4 helpers, one item per trunk row: room for 4 * 5 // 2 heads = 10, capped at the 4 rows),
    done by the 6 idle programs (3 padded segment slots x 2 heads) looping over their 8 items, one of them
    (1 * (5 // 2) // 2), and a grid with no idle scan programs (2 programs: one segment slot, no rows aside).
    Branches of 10 and 130 tokens: one and three chunk rows. Under -m slow: 64 helpers (the same 4 rows aside as
    4 helpers here: the same launch), and with the trunk split at a save point (its remainder chained: 6 trunk
    rows, the same counts of rows aside) the cases other than the first."""
    rng = np.random.default_rng(12)
    branches = [rng.integers(0, 100, n) for n in (10, 130)]
    save = Save(save_at, 1, np.arange(save_at)) if save_at else None
    host = plan_round([RequestSpec.of(rng.integers(0, 100, 300), branches, [np.array([1, 2])] * len(branches),
                                      save=save)], 4)
    plan = host.to("cpu").delta
    assert int(plan.levels[2].sizes[0]) == 4 and int(plan.levels[0].sizes[1]) == 1
    # as a captured graph's tables are: trunk segment slots past the real one, for the scan's idle programs
    padded = dataclasses.replace(plan.levels[0], **{
        name: torch.cat([getattr(plan.levels[0], name), getattr(plan.levels[0], name).new_full((3,), value)])
        for name, value in (("init_row", 0), ("final_row", -1), ("chunk_count", 0), ("step_base", 0), ("chain", -1))})
    plan = dataclasses.replace(plan, levels=[padded, *plan.levels[1:]])
    q, k, v, g, beta, states = random_inputs(12, host.num_tokens, plan.num_rows, 1, 16, 16)
    alone_states, expected_states = states.clone(), states.clone()
    helped = gated_delta_triton(q, k, v, g, beta, plan, states, config=tuned(fused_trunks=2, **helping))
    alone = gated_delta_triton(q, k, v, g, beta, plan, alone_states,
                               config=tuned(fused_trunks=2, scan_helpers=0, scan_programs=helping.get("scan_programs")))
    assert torch.equal(helped, alone) and torch.equal(states, alone_states)
    expected = gated_delta_reference(q, k, v, g, beta, plan, expected_states)
    assert relative_error(helped, expected) <= TOLERANCE and relative_error(states, expected_states) <= TOLERANCE


def test_scan_helper_settings_are_checked():
    host = plan_round(make_requests(13, [(65, 0, None)], max_branches=2), 4)
    q, k, v, g, beta, states = random_inputs(13, host.num_tokens, host.to("cpu").delta.num_rows, 1, 16, 16)
    for knobs in ({"scan_helpers": -1}, {"helper_steps": 0}):
        with pytest.raises(ValueError, match="scan_helpers"):
            gated_delta_triton(q, k, v, g, beta, host.to("cpu").delta, states, config=tuned(**knobs))
