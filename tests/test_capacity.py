"""The round planner for CUDA graphs (pure host code): every metadata field of `plan_round` against a slow
per-token reference layout, bucket choice, the padding bound, padding only at the tail, splitting rounds at
request boundaries, and padded rounds computing exactly what unpadded rounds compute (reference ops and
the Triton kernels under the interpreter, pool writes included)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools

import numpy as np
import pytest
import torch

import flide_sdk as fl
from flide_sdk.kernels import fixed_order
from flide_sdk.kernels.reference import expand_round_reference
from flide_sdk.kernels.round_metadata import expand_round_triton
from flide_sdk.models.ops import kernel_ops, reference_ops
from flide_sdk.plan.capacity import (
    FIRST_RUNGS_TOKENS,
    TOKEN_LADDER,
    capacity_ladder,
    capture_order,
    choose,
    pad_round,
    text_capacity,
)
from flide_sdk.plan.layout import (
    DISCARD_ROW,
    GDN_CHUNK,
    PAGE,
    Branches,
    RequestSpec,
    Resume,
    Save,
    StateRows,
    plan_round,
    round_tensors,
)
from flide_sdk.plan.requests import state_rows_needed
from flide_sdk.testing import make_tiny_checkpoint

from .test_kernels_engine import SMALL_TINY

K = 4
ROWS = StateRows(zero=40, scratch=41, scratch_count=16)
SINK = 10_000


def random_requests(seed: int, count: int = 6) -> list[RequestSpec]:
    """Trunks of 1..200 tokens, some resuming (history not a multiple of PAGE), some saving, 1..6 branches."""
    rng = np.random.default_rng(seed)
    requests = []
    for index in range(count):
        computed = int(rng.choice([1, 2, 3, 63, 64, 65, 130, 200]))
        start = int(rng.choice([0, 0, 1, 2, 70, 129])) if index % 2 else 0
        resume = Resume(slot=index, pages=rng.permutation(30)[: -(-start // PAGE)]) if start else None
        save = None
        if rng.random() < 0.6:
            at = int(rng.integers(start + 1, start + computed + 1))
            save = Save(at, slot=20 + index, kv_slots=rng.integers(0, 5000, at - start))
        branches = [rng.integers(0, 99, rng.integers(1, 40)) for _ in range(rng.integers(1, 7))]
        labels = [np.arange(rng.integers(1, 5)) + 3 for _ in branches]
        requests.append(RequestSpec.of(rng.integers(0, 99, computed), branches, labels, start=start, resume=resume,
                                       save=save))
    return requests


def slow_layout(requests: list[RequestSpec]) -> dict:
    """The layout rules written token by token (the definition plan_round must match)."""
    total = sum(r.num_tokens for r in requests)
    out = {name: [] for name in ("ids", "positions", "key_lo", "ctx_hi", "seg_lo", "request_of", "vis_end",
                                 "piece_lo", "conv_src", "kv_slots", "readout_rows", "labels", "save_window_src")}
    segments: list[set] = [set(), set(), set()]
    cursor = resumes = 0
    for index, request in enumerate(requests):
        s, first, comp = cursor, request.start, len(request.trunk)
        resume_index = resumes
        resumes += request.resume is not None

        def trunk_row(p: int, s: int = s, first: int = first, resume_index: int = resume_index) -> int:
            if p >= first:
                return s + p - first + 1
            if p >= 0:
                return 1 + total + resume_index * (K - 1) + p - first + K - 1
            return 0

        split = request.save.at - first if request.save else comp
        for i in range(comp):
            out["ids"].append(request.trunk[i])
            out["positions"].append(first + i)
            out["key_lo"].append(s), out["ctx_hi"].append(s), out["seg_lo"].append(s), out["request_of"].append(index)
            out["vis_end"].append(s + request.num_tokens), out["piece_lo"].append(s)
            out["conv_src"].append([trunk_row(first + i - j) for j in range(K - 1, -1, -1)])
            out["kv_slots"].append(int(request.save.kv_slots[i]) if request.save and i < split else SINK)
        scratch = ROWS.scratch + index
        init = ROWS.slot_base + request.resume.slot if request.resume else ROWS.zero
        if request.save:
            save_row = ROWS.slot_base + request.save.slot
            segments[0].add((s, split, init, save_row))
            if split < comp:
                segments[1].add((s + split, comp - split, save_row, scratch))
            trunk_final = save_row if split == comp else scratch
            out["save_window_src"].append([trunk_row(request.save.at - j) for j in range(K - 1, 0, -1)])
        else:
            segments[0].add((s, comp, init, scratch))
            trunk_final = scratch
        cursor += comp
        offset = 0
        for length, label in zip(request.branches.lengths, request.branches.labels):
            c = cursor
            for i in range(length):
                out["ids"].append(request.branches.ids[offset + i])
                p = first + comp + i
                out["positions"].append(p)
                out["key_lo"].append(s), out["ctx_hi"].append(s + comp), out["seg_lo"].append(c)
                out["request_of"].append(index), out["vis_end"].append(c + length), out["piece_lo"].append(c)
                out["conv_src"].append([c + q - first - comp + 1 if q >= first + comp else trunk_row(q)
                                        for q in (p - j for j in range(K - 1, -1, -1))])
                out["kv_slots"].append(SINK)
            segments[2].add((c, int(length), trunk_final, DISCARD_ROW))
            out["readout_rows"].append(c + length - 1)
            out["labels"].append([int(x) for x in label if x >= 0])
            offset += length
            cursor += length
    out["segments"] = segments
    return out


def level_segments(level) -> set:
    """(start, length, init row, final row) of each segment, read back from the chunk table (a segment's
    chunk 0 is row k, its chunk j > 0 row step_base[k] + j)."""
    found = set()
    for k in range(len(level.init_row)):
        rows = [k] + [level.step_base[k] + j for j in range(1, level.chunk_count[k])]
        tokens = np.concatenate([level.chunk_tokens[row] for row in rows])
        real = tokens[tokens < PAD_INDEX[0]]
        assert np.array_equal(real, np.arange(real[0], real[0] + len(real))), "a segment's chunks are contiguous"
        assert (tokens[len(real):] == PAD_INDEX[0]).all(), "padding only at a segment's end"
        found.add((int(real[0]), len(real), int(level.init_row[k]), int(level.final_row[k])))
    return found


PAD_INDEX = [0]


@pytest.mark.parametrize("seed", range(6))
def test_short_siblings_share_chunk_rows(seed):
    """Packed, a branch level's segments are runs of stream-adjacent unpacked ones (one init row, final states
    not kept) of at most a chunk together, covering the same tokens; nothing else changes."""
    requests = random_requests(seed)
    packed, unpacked = plan_round(requests, K, ROWS, SINK), plan_round(requests, K, ROWS, SINK, pack=False)
    PAD_INDEX[0] = packed.num_real
    for name in ("token_rows", "conv_src", "kv_slots", "readout_rows", "label_ids"):
        assert np.array_equal(getattr(packed, name), getattr(unpacked, name)), name
    for index, (mine, theirs) in enumerate(zip(packed.levels, unpacked.levels)):
        if index < 2:
            assert level_segments(mine) == level_segments(theirs)
            continue
        runs = sorted(level_segments(mine))
        singles = sorted(level_segments(theirs))
        assert sum(length for _, length, *_ in runs) == sum(length for _, length, *_ in singles)
        for start, length, init, final in runs:
            inside = [s for s in singles if start <= s[0] < start + length]
            assert sum(s[1] for s in inside) == length and inside[0][0] == start
            assert len(inside) == 1 or (length <= GDN_CHUNK and final == DISCARD_ROW
                                        and all(s[2] == init and s[3] == DISCARD_ROW for s in inside))
        assert len(runs) <= len(singles)


def test_packing_counts():
    """54 questions of 20 tokens on one trunk: 18 chunk rows of three questions, not 54."""
    rng = np.random.default_rng(0)
    request = RequestSpec.of(rng.integers(0, 99, 300), [rng.integers(0, 99, 20) for _ in range(54)],
                             [np.array([1, 2])] * 54)
    packed = plan_round([request], K)
    assert [level.chunks for level in packed.plan.levels] == [5, 0, 18]
    assert [level.chunks for level in plan_round([request], K, pack=False).plan.levels] == [5, 0, 54]


@pytest.fixture(scope="module")
def two_layer_path(tmp_path_factory):
    """The interpreter's model for rounds compared with rounds: `test_kernels_engine`'s small tiny model cut to
    one layer of each kind (every kernel of a forward pass, every pool arena written); the per-layer caches of
    several layers of a kind are `test_kernels_engine`'s."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("two-layers"), **{
        **SMALL_TINY, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]})


@pytest.mark.parametrize("seed", range(6))
def test_every_field_matches_the_slow_layout(seed):
    requests = random_requests(seed)
    host = plan_round(requests, K, ROWS, SINK, pack=False)  # packing: `test_short_siblings_share_chunk_rows`
    slow = slow_layout(requests)
    PAD_INDEX[0] = host.num_real
    for name in ("ids", "positions", "key_lo", "ctx_hi", "seg_lo", "request_of", "vis_end", "piece_lo", "conv_src",
                 "kv_slots", "readout_rows"):
        assert np.array_equal(getattr(host, name), np.array(slow[name])), name
    assert [[int(x) for x in row if x >= 0] for row in host.label_ids] == slow["labels"]
    assert np.array_equal(host.save_window_src, np.array(slow["save_window_src"]).reshape(-1, K - 1))
    assert host.save_slots.tolist() == [r.save.slot for r in requests if r.save]
    assert host.resume_slots.tolist() == [r.resume.slot for r in requests if r.resume]
    assert host.history_len.tolist() == [r.start for r in requests]
    for index, request in enumerate(requests):
        count = -(-request.start // PAGE)
        pages = host.pages[host.page_offset[index] : host.page_offset[index] + count]
        assert pages.tolist() == (request.resume.pages[:count].tolist() if request.resume else [])
    assert len(host.levels) == 3
    for level, expected in zip(host.levels, slow["segments"]):
        assert level_segments(level) == expected
        assert all(a >= b for a, b in zip(level.active, level.active[1:]))
        assert len(level.chunk_tokens) == sum(level.active) == int(level.chunk_count.sum())
        assert level.sizes.tolist() == [len(level.chunk_tokens), len(level.init_row)]


def test_bucket_choice_and_padding_bound():
    ladder = capacity_ladder(K, max_tokens=16384, max_requests=64, max_prompt_tokens=32768)
    assert [c.tokens for c in ladder] == list(TOKEN_LADDER)
    rng = np.random.default_rng(3)
    for _ in range(40):
        trunk = int(rng.integers(1, 9000))
        questions = int(rng.integers(1, 65))
        request = RequestSpec.of(rng.integers(0, 9, trunk), [rng.integers(0, 9, 20)] * questions,
                                 [np.array([1, 2])] * questions)
        host = plan_round([request], K, ROWS, SINK)
        capacity = choose(ladder, host)
        if host.num_real >= ladder[-1].tokens:
            assert capacity is None
            continue
        smaller = [c for c in ladder if c.tokens < capacity.tokens]
        assert all(not c.fits(host) for c in smaller), "the smallest capacity that fits is chosen"
        assert capacity.tokens <= max(512, 4 / 3 * (host.num_real + 1)), "padding is bounded by the ladder step"
        if 1536 <= host.num_real < 6144:
            assert capacity.tokens <= 1.17 * (host.num_real + 1), "finer steps where lone asks land"


def test_padding_only_at_the_tail_and_padded_rounds_fit():
    requests = random_requests(11)
    host = plan_round(requests, K, ROWS, SINK)
    ladder = capacity_ladder(K, 4096, 16, 4096)
    capacity = choose(ladder, host)
    padded = pad_round(host, capacity, window_sink=39)
    real, total = host.num_real, capacity.tokens
    assert padded.ids.shape == (total,) and padded.num_real == real
    for name in ("ids", "positions", "key_lo", "ctx_hi", "seg_lo", "request_of", "kv_slots"):
        assert np.array_equal(getattr(padded, name)[:real], getattr(host, name)), name
    assert (padded.key_lo[real:] == real).all() and (padded.seg_lo[real:] == real).all()
    assert (padded.request_of[real:] == len(requests)).all() and padded.history_len[len(requests)] == 0
    assert (padded.kv_slots[real:] == SINK).all() and (padded.conv_src[real:] == 0).all()
    shifted = np.where(host.conv_src > real, host.conv_src + total - real, host.conv_src)
    assert np.array_equal(padded.conv_src[:real], shifted)
    questions = host.num_questions
    assert np.array_equal(padded.readout_rows[:questions], host.readout_rows)
    assert (padded.readout_rows[questions:] == real).all()
    for level, original in zip(padded.levels, host.levels):
        chunks = len(original.chunk_tokens)
        assert (level.chunk_tokens[chunks:] == total).all() and (level.chunk_count[len(original.init_row):] == 0).all()
        assert (level.final_row[len(original.init_row):] == DISCARD_ROW).all()
        assert np.array_equal(level.chain[: len(original.init_row)], original.chain)
        assert (level.chain[len(original.init_row):] == -1).all() and level.chained == original.chained
        assert level.sizes.tolist() == [chunks, len(original.init_row)], "sizes count the real rows only"
        kept = original.chunk_tokens
        assert np.array_equal(level.chunk_tokens[:chunks], np.where(kept == real, total, kept))


def test_padded_rounds_compute_what_unpadded_rounds_compute(two_layer_path):
    """Reference ops and the Triton kernels (interpreter): probabilities, saved states, windows and keys. The
    first round saves its long trunk inside its second chunk (a remainder past the save point) beside a
    request with no save, and a fork of the trunk from its save point (saving) with a fork of its own (the twin's
    deeper levels); the second resumes the trunk after two pages of history, the last partial, and saves."""
    engine = fl.Engine.load(two_layer_path, device="cpu")
    try:
        model, pool = engine.model, engine.pool
        rng = np.random.default_rng(5)
        trunk = rng.integers(0, 200, 72)
        grandchild = RequestSpec.of(rng.integers(0, 200, 25), [rng.integers(0, 200, 6)], [np.array([5, 6])], start=86)
        child = RequestSpec.of(rng.integers(0, 200, 30), [rng.integers(0, 200, 7)], [np.array([5, 6, 7])], start=66,
                               save=Save(86, 2, np.arange(66, 86)), forks=(grandchild,))
        first = [RequestSpec.of(trunk, [rng.integers(0, 200, 9), rng.integers(0, 200, 15)],
                                [np.array([5, 6, 7]), np.array([5])], save=Save(66, 0, np.arange(66)),
                                forks=(child,)),
                 # a label question and a question scored by the text of two options (one branch each)
                 RequestSpec(rng.integers(0, 200, 20), Branches.of(
                     [rng.integers(0, 200, 3), rng.integers(0, 200, 4)], [np.array([5, 6]), np.zeros(0, np.int64)],
                     [[], [np.array([7, 8, 9]), np.array([7, 11])]]))]
        second = [RequestSpec.of(trunk[66:], [np.array([1, 2, 3])], [np.array([5, 6])], start=66,
                                 resume=Resume(0, np.arange(2)), save=Save(72, 1, np.arange(192, 198)))]
        rungs = capacity_ladder(model.config.conv_kernel, 1024, 8, 4096)
        ladder = sorted(rungs + [text_capacity(c) for c in rungs], key=lambda c: (c.tokens, c.text_reads))
        # the kernels' projections sum in a fixed order: torch's CPU GEMM blocks rows by their count, so a row's
        # last bit depends on how many rows share the product (the 9 readout rows of the unpadded round against
        # the 48 of the padded one: 4.8e-7)
        for ops in (reference_ops, dataclasses.replace(kernel_ops(), linear=fixed_order.linear_fixed)):
            results = []
            for padded in (False, True):
                caches = [(tensor, kind) for cache, kind in zip(pool.layer_caches(), model.config.layer_types)
                          for tensor in cache]
                for tensor, _ in caches:
                    tensor.zero_()
                outputs = []
                for requests in (first, second):
                    assert pool.hold_scratch(state_rows_needed(requests))  # as the engine's round thread does
                    host = plan_round(requests, model.config.conv_kernel, pool.state_rows, pool.kv_sink)
                    if padded:
                        capacity = choose(ladder, host)
                        assert capacity.tokens > host.num_real, "the round is padded"
                        host_run = pad_round(host, capacity, pool.window_sink)
                    else:
                        host_run = host
                    readout = model(host_run.to("cpu"), ops, engine.pool.layer_caches())
                    outputs.append(readout.label_logprobs[: host.num_questions, : host.label_ids.shape[1]])
                    outputs.append(readout.text_logprobs[: len(host.plan.text_reads)])
                outputs += [tensor[: 4 * PAGE if kind == "full_attention" else 2].clone()
                            for tensor, kind in caches]  # keys and values of 4 pages, states and windows of 2 slots
                results.append(outputs)
            # the torch reference is compared to float32 rounding at each tensor's scale (8 units in the last place of
            # its largest value): torch's CPU elementwise ops compute a tensor's tail elements with scalar code
            # (std::exp, ...) and the rest with vector code (SLEEF), so its values depend on the tensor's length in
            # their last bit (the gates of 227 tokens against 256: 7e-9, grown to 2e-6 on values up to 4 after 8
            # layers, on an AVX-512 CPU); the kernels to 1e-6
            for unpadded, padded_out in zip(*results):
                scale = float(padded_out.abs().max()) if ops is reference_ops and padded_out.numel() else 1.0
                assert torch.allclose(unpadded, padded_out, atol=1e-6 * max(1.0, scale), rtol=0)
            assert results[0][4].abs().sum() > 0, "the first round saved a state"
            assert len(results[0][1]) == 5 and len(results[0][3]) == 0, "the first round reads 5 text tokens"
    finally:
        engine.close()


def test_rounds_split_at_request_boundaries_and_large_requests_run_alone(two_layer_path):
    """Asks that do not fit one round together are split over rounds, never inside a request; a request
    larger than the round capacity still runs (alone); answers equal a roomy engine's. (Prompts of 80..111
    tokens, no two of which fit 128, and one of about 500.)"""
    words = " ".join(f"w{i}" for i in range(400))
    states = [f"{k} {words[: 60 + 10 * k]}" for k in range(5)] + [words[:600]]
    question = {"q": fl.Noul("Is it long?")}

    async def run(engine):
        answers = await asyncio.gather(*(engine.ask(state, question) for state in states))
        return [r["q"].noul for r in answers], engine.stats()

    small = fl.Engine.load(two_layer_path, device="cpu", max_round_tokens=128)
    roomy = fl.Engine.load(two_layer_path, device="cpu", max_round_tokens=8192)
    try:
        got, small_stats = asyncio.run(run(small))
        expected, roomy_stats = asyncio.run(run(roomy))
    finally:
        small.close()
        roomy.close()
    assert roomy_stats["rounds"] == 1 and small_stats["rounds"] >= 4
    assert small_stats["asks"] == len(states)
    assert max(abs(a - b) for a, b in zip(got, expected)) <= 1e-5


def staged_and_expanded(host, capacity, expand):
    """A round staged into a flat buffer for `capacity` (as a graph's staging buffer) and expanded by `expand`
    (the reference or the kernel): the flat buffer and the arrays a graph's forward reads, by name."""
    from flide_sdk.device.graphs import FlatLayout, StagingLayout, device_round

    layout = StagingLayout(capacity)
    flat = torch.full((layout.elements,), -7, dtype=torch.int64)
    host.plan.stage(layout.views(flat.numpy()), capacity.shape, 39)
    expanded = FlatLayout(capacity.shape.expanded_shapes())
    arrays, run = device_round(capacity, layout.views(flat), expanded.views(torch.full((expanded.elements,), -7)),
                               expand)
    run()
    return flat, arrays


def test_staging_layout_packs_every_field_once_and_expands_to_the_padded_round():
    """The flat staging buffer of each capacity holds every staged array at its own offset, and a round staged
    there and expanded (reference and kernel, the interpreter) gives every array `pad_round` gives (what the
    graph's forward then reads). The reference expands each round at every capacity it fits up to about twice
    its tokens, the kernel (whose programs the interpreter runs one by one) at the two smallest: the least
    padding and a rung more."""
    from flide_sdk.device.graphs import StagingLayout

    cases = [(random_requests(seed, count), K) for seed, count in ((2, 6), (3, 1), (4, 9))]
    tiny = RequestSpec.of(np.array([7]), [np.array([1]), np.array([2, 3])], [np.array([5]), np.array([5])])
    cases += [([tiny], K), ([tiny] * 3, 2)]  # pieces shorter than the conv window; a kernel of 2 taps
    checked = collections.Counter()
    for requests, kernel in cases:
        host = plan_round(requests, kernel, ROWS, SINK)
        fitting = 0
        for capacity in capacity_ladder(kernel, 4096, 16, 4096):
            layout = StagingLayout(capacity)
            spans = sorted((offset, offset + int(np.prod(shape))) for offset, shape in layout.fields.values())
            assert spans[0][0] == 0 and spans[-1][1] == layout.elements == capacity.elements
            assert all(end == start for (_, end), (start, _) in itertools.pairwise(spans)), "fields tile the buffer"
            if not capacity.fits(host) or capacity.tokens > 2 * host.num_real + 256:
                continue
            padded = pad_round(host, capacity, 39)
            fitting += 1
            for expand in (expand_round_reference, expand_round_triton)[: 2 if fitting <= 2 else 1]:
                flat, arrays = staged_and_expanded(host, capacity, expand)
                assert (flat != -7).any()
                for name, array in padded.arrays().items():
                    assert np.array_equal(arrays[name].numpy(), array), (name, expand.__name__, capacity.tokens)
                checked[expand] += 1
    assert checked[expand_round_triton] == 10 and checked[expand_round_reference] >= 30


def test_a_pass_over_refilled_round_tensors_answers_the_new_round(two_layer_path):
    """As graph capture does: round tensors that are views of one flat buffer, a pass, the buffer refilled with
    another round, a second pass on the same tensor objects. Tables derived from the metadata inside a pass
    (the attention tile tables) must be rebuilt: the second pass answers what a pass on fresh tensors does."""
    from flide_sdk.device.graphs import FlatLayout, StagingLayout, device_round

    engine = fl.Engine.load(two_layer_path, device="cpu")
    try:
        model, pool, ops = engine.model, engine.pool, kernel_ops()
        rng = np.random.default_rng(8)
        rounds = [[RequestSpec.of(rng.integers(0, 200, n), [rng.integers(0, 200, 6)] * b, [np.array([5, 6])] * b)
                   for n, b in requests] for requests in ([(20, 1)], [(70, 1), (20, 2)])]
        assert pool.hold_scratch(max(map(state_rows_needed, rounds)))  # as the engine's round thread does
        hosts = [plan_round(requests, model.config.conv_kernel, pool.state_rows, pool.kv_sink) for requests in rounds]
        capacity = choose(capacity_ladder(model.config.conv_kernel, 1024, 8, 4096), hosts[1])
        layout, expanded = StagingLayout(capacity), FlatLayout(capacity.shape.expanded_shapes())
        flat = torch.zeros(layout.elements, dtype=torch.int64)
        arrays, expand = device_round(capacity, layout.views(flat), expanded.views(torch.zeros(expanded.elements,
                                                                                                dtype=torch.int64)))
        rnd = None
        for host in hosts:
            host.plan.stage(layout.views(flat.numpy()), capacity.shape, pool.window_sink)
            expand()
            rnd = rnd or round_tensors(host.plan, capacity.shape, arrays)
            reused = model(rnd, ops, engine.pool.layer_caches()).label_logprobs[: host.num_questions]
        fresh = model(hosts[1].to("cpu"), ops, engine.pool.layer_caches()).label_logprobs
        assert torch.allclose(reused[:, :2].exp(), fresh[:, :2].exp(), atol=1e-6, rtol=0)  # probabilities
    finally:
        engine.close()


def test_graphs_are_captured_small_rungs_first_then_largest_first():
    """Every capacity once: the largest first (every later graph reuses its memory in the shared pool), then the
    rungs lone asks land on, smallest first; then the rest from the largest down."""
    ladder = capacity_ladder(4)
    order = [capacity.tokens for capacity in capture_order(ladder)]
    assert sorted(order) == [capacity.tokens for capacity in ladder]
    assert order[0] == TOKEN_LADDER[-1]
    small = [t for t in order if t <= FIRST_RUNGS_TOKENS]
    assert order[1 : len(small) + 1] == sorted(small) and small[0] == TOKEN_LADDER[0]
    rest = order[len(small) + 1 :]
    assert rest == sorted(rest, reverse=True) and rest[0] == TOKEN_LADDER[-2]


def test_label_rounds_take_the_ladder_and_text_rounds_its_twin_with_read_rows():
    """A round with text-scored options fits only a capacity with read rows; a label-only round of the same
    size takes the rung without them (whose forward has no read path)."""
    rungs = capacity_ladder(4, 2048, 8, 4096)
    ladder = sorted(rungs + [text_capacity(c) for c in rungs], key=lambda c: (c.tokens, c.text_reads))
    assert all(c.text_reads == 0 for c in rungs) and all(text_capacity(c).text_reads >= 32 for c in rungs)
    rng = np.random.default_rng(2)
    question, replies = rng.integers(0, 99, 40), [rng.integers(0, 99, n) for n in (3, 7, 2)]
    text = RequestSpec(rng.integers(0, 99, 300), Branches.of([question], [np.zeros(0, np.int64)], [replies]))
    label = RequestSpec(text.trunk, Branches.of([question] * 3, [np.array([1, 2])] * 3))
    for spec, reads in ((label, 0), (text, 12)):
        host = plan_round([spec], 4)
        assert len(host.plan.text_reads) == reads
        chosen = choose(ladder, host)
        assert chosen.tokens == min(c.tokens for c in rungs if c.tokens > host.num_real)
        assert (chosen.text_reads > 0) == bool(reads) and choose(rungs, host) is (None if reads else chosen)
