"""Host time of an ask and of a round, on CPU: rendering, preparing, admitting, planning and staging.

    PYTHONPATH=$PWD python benchmarks/host_path.py [--repeat 200]

No device work: it runs anywhere. It uses the real Qwen3.5 tokenizer and chat template (`tokenizer/qwen3.5`
of the data copy) and the real 0.8B config for the conv kernel and the model length; the model behind the
engine is the tiny random one (rendering, preparing and planning never look at weights). Each number is the
median over `--repeat` runs, in milliseconds:

- tokenize: `renderer.trunk(state)` of a unique ~2,000-token QuALITY state (a numbered first line), through
  the word encoder (`word_cache`, the single-threaded fast path that takes whitelisted texts; between calls
  it caches the chunks of the texts it split whole, as the engine has it do once a round is launched);
  tokenize_rotating_ms: the states questions_per_state asks about (15 articles, each window moving on by 97
  tokens a turn), which bring about 9 pieces the word cache has not seen each (0.86 against 0.57 ms with none
  new on this repository's CPU VM, before the chunk cache);
- tokenize_after_idle_ms: the same after 10 ms of sleep before each call (the gap a lone ask leaves while
  the GPU runs its round): in the engine the host stages take about twice what this script measures them at;
  this separates a cold host (caches, the tokenizer's sleeping threads) from contention inside the engine;
- tokenize_by_piece_chars: the same, and `renderer.trunk` of a RACE passage (~250 tokens), through the word
  encoder (`word_encoder`) and, with it off (the path of texts it declines), with the text cut into pieces of
  a fixed 512 characters (the earlier rule) and of 128 or 64 to 512 characters, about one per CPU
  (`render.ENCODE_PIECE_CHARS`; the default is 128 to 512): how finely to cut for this host's threads;
- render_questions: the branches of 1 and 64 yes/no questions (`common.STORY_QUESTIONS`), asked again and
  again as in `questions_per_state.py`; `_cold`: 64 questions never seen before;
- prepare: `engine.prepare(trunk, questions)`, the queued form of an ask (validation, rendering, branches);
  per ask for the 64 RACE passages with their ~4 Choice questions each;
- select_race64: the round thread admitting 64 queued RACE asks (`Engine._traverse`: checkpoint lookup,
  state-ready traversal, merging identical trunks) into a round;
- round: what a round does on the host before the device copy (`Engine._launch`, `GraphRunner.launch`):
  its `RoundPlan` (plan_ms), `choose` on the ladder of a CUDA engine, and `stage_into` (the plan writing its
  staged arrays into the pinned-buffer views of the chosen capacity, `StagingLayout`; stage_ms), for Q = 1 and
  Q = 64 on the 2,000-token state, for the RACE passages
  that fill one round (16,384 tokens) and, planned only (no graph fits), for all 64 of them. Each request
  saves a checkpoint at its stable boundary, as a one-off ask does.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from collections import deque
from typing import Any

import numpy as np
import torch

import flide_sdk as fl
from benchmarks.common import (
    STORY_QUESTIONS,
    command_line,
    cut_tokens,
    data_path,
    median_ms,
    quality_records,
    race_requests,
    run_metadata,
    write_result,
)
from benchmarks.questions_per_state import UniqueStates
from flide_sdk.device.graphs import StagingLayout
from flide_sdk.engine import AskPayload, Engine
from flide_sdk.models.checkpoint import load_model
from flide_sdk.plan.capacity import capacity_ladder, choose, stage_into
from flide_sdk.plan.layout import PAGE, Branches, RequestSpec, RoundPlan, Save, StateRows
from flide_sdk.testing import tiny_checkpoint
from flide_sdk.text import render
from flide_sdk.text.render import Renderer

STATE_TOKENS = 2000
MAX_ROUND_TOKENS, MAX_ROUND_REQUESTS = 16384, 64  # the CUDA engine's defaults
# the 0.8B pool on an H200 (40% of free memory): about 700 checkpoint slots and 52,000 KV pages
SLOTS, KV_PAGES = 700, 52_000
ROWS = StateRows(zero=SLOTS, scratch=SLOTS + 1, scratch_count=MAX_ROUND_REQUESTS)


def real_engine_parts() -> tuple[Renderer, int, Engine]:
    """The real tokenizer's renderer, the real 0.8B conv kernel, and a CPU engine that renders with the real
    renderer around the tiny model (a CUDA engine's round limits)."""
    config = json.loads(data_path("configs", "Qwen3.5-0.8B.json").read_text())["text_config"]
    renderer = Renderer.from_checkpoint(data_path("tokenizer", "qwen3.5"), config["max_position_embeddings"])
    model = load_model(tiny_checkpoint(), torch.device("cpu"), torch.float32)
    # the engine refuses prompts longer than its model's positions: give the tiny model the real model's
    model.config = dataclasses.replace(model.config, max_position_embeddings=renderer.max_prompt_tokens)
    engine = Engine(model, renderer, torch.device("cpu"), pool_bytes=16 << 20, graphs=False,
                    max_round_tokens=MAX_ROUND_TOKENS, max_round_requests=MAX_ROUND_REQUESTS)
    return renderer, int(config["linear_conv_kernel_dim"]), engine


def request_spec(payload: AskPayload, index: int) -> RequestSpec:
    """The request of one fresh trunk as `Engine._request_spec` makes it: the whole trunk, saving at its
    stable boundary into slot `index` (KV pages of its own)."""
    trunk = payload.trunk
    at = trunk.boundary
    kv_slots = index * 1024 * PAGE + np.arange(at, dtype=np.int64)
    return RequestSpec(trunk.tokens(), Branches.join([payload.branches]), save=Save(at, index, kv_slots))


def fill_round(specs: list[RequestSpec]) -> list[RequestSpec]:
    """The first requests that fit one round of a CUDA engine (its token and request limits)."""
    tokens = np.cumsum([spec.num_tokens for spec in specs])
    return specs[: min(MAX_ROUND_REQUESTS, int(np.searchsorted(tokens, MAX_ROUND_TOKENS, side="right")))]


class Stager:
    """Pinned-buffer stand-in: one flat int64 array and each capacity's views of it, as `GraphRunner` keeps."""

    def __init__(self, conv_kernel: int, max_prompt_tokens: int) -> None:
        self.ladder = capacity_ladder(conv_kernel, MAX_ROUND_TOKENS, MAX_ROUND_REQUESTS, max_prompt_tokens)
        layouts = [StagingLayout(capacity) for capacity in self.ladder]
        self.flat = np.zeros(max(layout.elements for layout in layouts), dtype=np.int64)
        self.views = {layout.capacity: layout.views(self.flat) for layout in layouts}
        self.conv_kernel = conv_kernel

    def plan(self, specs: list[RequestSpec]) -> RoundPlan:
        """The round's plan, as `Engine._launch` makes it (its arrays are written by `stage`)."""
        return RoundPlan(specs, self.conv_kernel, ROWS, KV_PAGES * PAGE)

    def stage(self, plan: RoundPlan) -> None:
        capacity = choose(self.ladder, plan)
        stage_into(plan, capacity, self.views[capacity], SLOTS, KV_PAGES * PAGE, ROWS.zero)

    def round_ms(self, specs: list[RequestSpec], repeat: int) -> dict[str, Any]:
        host = self.plan(specs)
        capacity = choose(self.ladder, host)
        result = {"requests": len(specs), "questions": host.num_questions, "tokens": host.num_real,
                  "capacity_tokens": None if capacity is None else capacity.tokens,
                  "plan_ms": median_ms(lambda _: self.plan(specs), repeat)}
        if capacity is not None:
            result.update(
                choose_ms=median_ms(lambda _: choose(self.ladder, host), repeat),
                stage_ms=median_ms(lambda _: self.stage(host), repeat),
                total_ms=median_ms(lambda _: self.stage(self.plan(specs)), repeat),
            )
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    repeat = args.repeat
    renderer, conv_kernel, engine = real_engine_parts()
    try:
        body = cut_tokens(renderer, quality_records()[0]["input"], 0, STATE_TOKENS)
        states = [f"Reading copy {i}.\n{body}" for i in range(repeat + 10)]
        nouls = {q: {f"q{i}": fl.Noul(text) for i, text in enumerate(STORY_QUESTIONS[:q])} for q in (1, 64)}
        trunk = renderer.trunk(states[0])
        # as questions_per_state makes them (15 articles, each window moving on): about 9 new pieces a state
        made = UniqueStates(renderer, STATE_TOKENS)
        for _ in range(20):  # as the benchmark's warm-up fills the word cache
            renderer.trunk(made.next())
        rotating = [made.next() for _ in range(repeat + 5)]
        race = [(f"Passage {i}.\n{text}", questions) for i, (text, questions) in enumerate(race_requests(64))]
        race_trunks = [renderer.trunk(state) for state, _ in race]

        def unseen(i: int) -> dict[str, fl.Noul]:
            return {f"q{k}": fl.Noul(f"{text} (variant {i})") for k, text in enumerate(STORY_QUESTIONS[:64])}

        def queued(_: int) -> deque:
            return deque(engine.prepare(t, questions) for t, (_, questions) in zip(race_trunks, race))

        def admit(pending: deque) -> None:
            engine._unpin(engine._traverse(pending))

        def filled(i: int) -> int:
            """As in the engine, which has the word encoder cache a new text's chunks once its round is launched."""
            renderer.words.fill_chunks()
            return i

        ask = {
            "state_tokens": len(trunk),
            "tokenize_ms": median_ms(lambda i: renderer.trunk(states[i]), repeat, filled),
            "tokenize_after_idle_ms": median_ms(lambda i: renderer.trunk(states[i]), repeat,
                                                lambda i: time.sleep(0.01) or filled(i)),
            "tokenize_rotating_ms": median_ms(lambda i: renderer.trunk(rotating[i]), repeat, filled),
            "render_questions_ms": {q: median_ms(lambda _, qs=qs: renderer.render_questions(qs), repeat)
                                    for q, qs in nouls.items()},
            "render_questions_cold_ms": {64: median_ms(renderer.render_questions, repeat, unseen)},
            "prepare_ms": {q: median_ms(lambda _, qs=qs: engine.prepare(trunk, qs), repeat)
                           for q, qs in nouls.items()},
            "prepare_race_per_ask_ms": median_ms(
                lambda _: [engine.prepare(t, qs) for t, (_, qs) in zip(race_trunks, race)], repeat // 4) / len(race),
            "select_race64_ms": median_ms(admit, repeat // 4, queued),
        }
        passages = [f"Passage {i}.\n{text}" for i in range(repeat // 8 + 1) for text, _ in race]
        ask["tokenize_by_piece_chars"] = {"word_encoder": {
            "state_ms": median_ms(lambda i: renderer.trunk(states[i]), repeat, filled),
            "race_passage_ms": median_ms(lambda i: renderer.trunk(passages[i]), repeat, filled)}}
        default_chars = render.ENCODE_PIECE_CHARS
        renderer.words.enabled = False
        try:
            for chars in ((512, 512), (128, 512), (64, 512)):
                render.ENCODE_PIECE_CHARS = chars
                ask["tokenize_by_piece_chars"][f"{chars[0]}-{chars[1]}"] = {
                    "state_ms": median_ms(lambda i: renderer.trunk(states[i]), repeat),
                    "race_passage_ms": median_ms(lambda i: renderer.trunk(passages[i]), repeat)}
        finally:
            render.ENCODE_PIECE_CHARS = default_chars
            renderer.words.enabled = True
        ask["cpus"] = render.ENCODE_PIECES
        ask["ask_host_ms"] = {q: ask["tokenize_ms"] + ask["prepare_ms"][q] for q in nouls}
        stager = Stager(conv_kernel, renderer.max_prompt_tokens)
        lone = {q: [request_spec(engine.prepare(trunk, qs).payload, 0)] for q, qs in nouls.items()}
        race_specs = [request_spec(engine.prepare(t, qs).payload, i) for i, (t, (_, qs)) in
                      enumerate(zip(race_trunks, race))]
        gc.collect()
        rounds = {
            "q1": stager.round_ms(lone[1], repeat),
            "q64": stager.round_ms(lone[64], repeat),
            "race_round": stager.round_ms(fill_round(race_specs), repeat),
            "race64_plan_only": stager.round_ms(race_specs, repeat),
        }
    finally:
        engine.close()
    write_result("host_path", {
        "benchmark": "host_path", **run_metadata(command_line()),
        "settings": {"repeat": repeat, "tokenizer": "Qwen3.5 (real)", "conv_kernel": conv_kernel,
                     "ladder": f"capacity_ladder(max_tokens={MAX_ROUND_TOKENS}, max_requests={MAX_ROUND_REQUESTS})",
                     "statistic": "median wall ms on this host's CPU"},
        "ask": ask,
        "round": rounds,
    })


if __name__ == "__main__":
    main()
