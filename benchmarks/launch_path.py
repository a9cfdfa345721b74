"""Host time of launching a lone ask's round, warm and cold: why the engine's host stages take 2-4x what
host_path.py measures for the same work.

    PYTHONPATH=$PWD python benchmarks/launch_path.py [--model-size 0.8B] [--repeat 40]

On the H200 at 54070ce a lone Q = 1 ask about a 2,000-token state spent 0.80 ms planning and 0.89 ms
launching its round, all of it CPU time of the round thread, against about 0.15 and 0.3 ms in host_path.
This script loads the engine (CUDA graphs, random weights of the real shapes, the real tokenizer) and runs
unique Q = 1 asks (questions_per_state's states) through the same engine code, `Engine._select`,
`_launch` and `_finish`, on this thread, under four conditions (`--repeat` asks each):
- in_engine: `engine.ask_sync`, the round thread doing it (the reference: what the benchmarks see);
- back_to_back: asks prepared beforehand, run one after another (host caches warm);
- after_idle: the same with 10 ms of sleep before each (the gap a lone ask leaves while the GPU runs);
- after_tokenize: each ask prepared (its state tokenized by the tokenizer's threads) just before it runs.
Per condition, medians in ms of each host stage the engine records (`stats()`): spec, plan (and its CPU
time), launch (and its CPU time) and, within launch, padding and the replay call (the copies are inside the graph since 2026-11-30).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque

import numpy as np

from benchmarks.common import (
    add_engine_args,
    bench_checkpoint,
    command_line,
    engine_settings,
    load_engine,
    run_metadata,
    write_result,
)
from benchmarks.questions_per_state import UniqueStates, noul_questions

STAGES = ("spec", "plan", "plan_cpu", "launch", "launch_cpu", "pad", "replay_call")
IDLE_S = 0.010


def stage_ms(before: dict, after: dict) -> dict[str, float]:
    """The host stages between two `stats()` readings, in ms."""
    return {stage: 1000.0 * (after[f"{stage}_seconds"] - before[f"{stage}_seconds"]) for stage in STAGES}


def run_here(engine, ask) -> dict[str, float]:
    """One prepared ask selected, launched and finished on this thread, as the round thread does it."""
    before = engine.stats()
    flight = engine._launch(engine._select(deque([ask])))
    engine._finish(flight)
    ask.future.result(0)
    return stage_ms(before, engine.stats())


def condition(name: str, engine, states: UniqueStates, questions, repeat: int) -> list[dict[str, float]]:
    if name == "in_engine":
        timings = []
        for _ in range(repeat):
            state = states.next()
            before = engine.stats()
            engine.ask_sync(state, questions)
            timings.append(stage_ms(before, engine.stats()))
        return timings
    if name == "after_tokenize":
        return [run_here(engine, engine._prepare_state(states.next(), questions)) for _ in range(repeat)]
    prepared = [engine._prepare_state(states.next(), questions) for _ in range(repeat)]
    timings = []
    for ask in prepared:
        if name == "after_idle":
            time.sleep(IDLE_S)
        timings.append(run_here(engine, ask))
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--repeat", type=int, default=None, help="asks per condition (default 40, tiny 3)")
    parser.add_argument("--state-tokens", type=int, default=None, help="state length (default 2000, tiny 300)")
    args = parser.parse_args()
    repeat = args.repeat or (3 if args.tiny else 40)
    state_tokens = args.state_tokens or (300 if args.tiny else 2000)
    checkpoint, where = bench_checkpoint(args)
    graphs, options = engine_settings(args)
    engine, load_info = load_engine(checkpoint, where["device"], where["dtype"], graphs, **options)
    results = {}
    try:
        states = UniqueStates(engine.renderer, state_tokens)
        questions = noul_questions(1)
        condition("back_to_back", engine, states, questions, 5)  # warm-up
        for name in ("in_engine", "back_to_back", "after_idle", "after_tokenize"):
            timings = condition(name, engine, states, questions, repeat)
            results[name] = {stage: statistics.median(t[stage] for t in timings) for stage in STAGES}
            results[name]["plan_and_launch"] = statistics.median(t["plan"] + t["launch"] for t in timings)
        stats = engine.stats()
    finally:
        engine.close()
    name = "launch_path-" + ("tiny" if args.tiny else args.model_size)
    write_result(name, {
        "benchmark": "launch_path", "model_size": "tiny" if args.tiny else args.model_size,
        **run_metadata(command_line()),
        "settings": {**where, **load_info, "repeat": repeat, "state_tokens": state_tokens, "questions": 1,
                     "idle_s": IDLE_S, "state_token_range": [int(np.min(states.lengths)), int(np.max(states.lengths))],
                     "graph_replays": stats["graph_replays"], "eager_runs": stats["eager_runs"]},
        "median_ms": results,
    })


if __name__ == "__main__":
    main()
