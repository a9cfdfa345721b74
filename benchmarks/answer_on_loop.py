"""Lone-ask latency with a round finished by its awaiting event loop (`answer_on_loop`) and by the round thread,
in alternating blocks on one engine.

    PYTHONPATH=$PWD python benchmarks/answer_on_loop.py [--model-size 0.8B] [--tiny] [--reps 6]

One engine (CUDA graphs, random weights of the real shapes, the real tokenizer) answers lone asks one after the
other: RACE passages with their questions (short_passages' lone phase), then unique 2,000-token states with
Q = 1, 4, 16 and 64 yes/no questions (questions_per_state's). Each kind runs `--reps` pairs of blocks, one with
`engine.answer_on_loop` on ("loop": the asking loop tokenizes, launches, polls the device near the round's
expected end and finishes the round itself) and one with it off ("thread": a one-off state tokenized, launched
and finished by the round thread, as before 21dd8f1), the order alternating from pair to pair, so the host's
drift falls on both. Reports per kind and mode the median and mean of the block medians (ms) and the mean host
stages per ask (`stats()`).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

from benchmarks.common import (
    add_engine_args,
    bench_checkpoint,
    command_line,
    engine_settings,
    load_engine,
    race_requests,
    run_metadata,
    stats_delta,
    write_result,
)
from benchmarks.questions_per_state import UniqueStates, noul_questions
from benchmarks.short_passages import Passages

MODES = ("loop", "thread")
STAGES = ("submit", "queue", "plan", "launch", "pad", "replay_call", "replay", "round", "finish")


async def block(engine, mode: str, requests: list) -> dict:
    """Lone asks one after the other in `mode`: their median latency and mean host stages per ask."""
    engine.answer_on_loop = mode == "loop"
    before = engine.stats()
    times = []
    for state, questions in requests:
        started = time.perf_counter()
        await engine.ask(state, questions)
        times.append(1000.0 * (time.perf_counter() - started))
    delta = stats_delta(before, engine.stats())["delta"]
    stages = {f"{stage}_ms": 1000.0 * delta[f"{stage}_seconds"] / len(requests) for stage in STAGES}
    return {"median_ms": float(np.median(times)), "stages_ms": stages}


async def alternate(engine, make, reps: int, size: int) -> dict:
    """`reps` pairs of blocks of `size` asks (`make()` gives one), the modes' order alternating."""
    blocks: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for rep in range(reps):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
            blocks[mode].append(await block(engine, mode, [make() for _ in range(size)]))
    summary = {}
    for mode, runs in blocks.items():
        medians = [run["median_ms"] for run in runs]
        stages = {key: float(np.mean([run["stages_ms"][key] for run in runs])) for key in runs[0]["stages_ms"]}
        summary[mode] = {"median_of_block_medians_ms": float(np.median(medians)),
                         "mean_of_block_medians_ms": float(np.mean(medians)), "mean_stages_ms": stages}
    return {"summary": summary, "blocks": blocks}


async def measure(engine, reps: int, race_block: int, state_block: int, warmup: int) -> dict:
    results = {}
    race = Passages(race_requests())
    for _ in range(warmup):
        await engine.ask(*race.next())
    results["race"] = await alternate(engine, race.next, reps, race_block)
    states = UniqueStates(engine.renderer, 2000)
    for q in (1, 4, 16, 64):
        questions = noul_questions(q)
        for _ in range(warmup):
            await engine.ask(states.next(), questions)
        results[f"q{q}"] = await alternate(engine, lambda asked=questions: (states.next(), asked), reps, state_block)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--reps", type=int, default=6, help="pairs of blocks per kind")
    args = parser.parse_args()
    checkpoint, where = bench_checkpoint(args)
    graphs, options = engine_settings(args)
    engine, load_info = load_engine(checkpoint, where["device"], where["dtype"], graphs, **options)
    sizes = (3, 3, 2) if args.tiny else (25, 12, 6)
    try:
        results = asyncio.run(measure(engine, 2 if args.tiny else args.reps, *sizes))
        eager_runs = engine.stats()["eager_runs"]
    finally:
        engine.close()
    write_result(f"answer_on_loop-{'tiny' if args.tiny else args.model_size}", {
        "benchmark": "answer_on_loop", "model_size": args.model_size, **run_metadata(command_line()),
        "settings": {**where, **load_info, "modes": {"loop": "answer_on_loop=True", "thread": "answer_on_loop=False"},
                     "blocks": {"race": sizes[0], "states": sizes[1]}, "warmup": sizes[2]},
        "summary": {kind: {mode: [round(r["median_of_block_medians_ms"], 4), round(r["mean_of_block_medians_ms"], 4)]
                           for mode, r in result["summary"].items()} for kind, result in results.items()},
        "results": results,
        "eager_runs": eager_runs,
    })


if __name__ == "__main__":
    main()
