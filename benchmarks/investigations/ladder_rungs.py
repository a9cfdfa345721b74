"""Which graph capacities a lone round replays fastest on: the evidence for the ladder's rungs.

    PYTHONPATH=$PWD python benchmarks/investigations/ladder_rungs.py [--model-size 0.8B] [--rungs 512,544,576,...]

cuBLAS's GEMMs are not monotone in their row count (on the H200 the 0.8B MLP's up projection took 50.1 us at
2,176 rows, 45.5 at 2,240), so a larger graph can replay a round faster than the smallest one it fits. This
script loads an engine without graphs (random weights of the real shapes, the real tokenizer), captures one
`GraphRunner` over `--rungs` (capacities of the engine's own shape rules, `capacity_ladder(tokens=...)`), and
replays real lone rounds, each on every candidate it fits up to twice its tokens: RACE passages with their
questions (short_passages' rounds, `--passages` of them) and asks about a 2,000-token QuALITY state with 1, 4
and 16 yes/no questions (questions_per_state's). Rounds are planned as the engine plans a one-off ask, less its
checkpoint save. Per round and capacity: the median device time of `--repeat` replays after 3, in ms, for
each of `--passes` passes (their spread is the noise). The capacities' one-token placeholder replays are
reported too (the capacity-dependent part alone: GEMMs and the other token-wise kernels over all rows).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import flide_sdk as fl
from benchmarks.common import build_random_checkpoint, cuda_time_ms, race_requests, run_metadata, write_result
from benchmarks.questions_per_state import UniqueStates, noul_questions
from flide_sdk.device.graphs import GraphRunner, placeholder_round
from flide_sdk.plan.capacity import Capacity, capacity_ladder, stage_into
from flide_sdk.plan.layout import Branches, RequestSpec, RoundPlan

DEFAULT_RUNGS = "448,512,544,576,608,640,704,768,2048,2176,2240,2304,2624,2688,2752,2816"


def lone_plan(engine: fl.Engine, state: str, questions: dict) -> RoundPlan:
    """The round of one ask about `state`, laid out as the engine lays out a one-off ask (without its save)."""
    ask = engine.prepare(engine.renderer.trunk(state), questions)
    spec = RequestSpec(ask.payload.trunk.tokens(), Branches.join([ask.payload.branches]))
    return RoundPlan([spec], engine.model.config.conv_kernel, engine.pool.state_rows, engine.pool.kv_sink)


def replay_ms(engine: fl.Engine, runner: GraphRunner, plan: RoundPlan, capacity: Capacity, repeat: int) -> float:
    """Median device time of the capacity's graph replaying `plan` (staged into its first buffer's views)."""
    pool = engine.pool
    captured = runner._captured[capacity]
    stage_into(plan, capacity, captured.host_views[0], pool.window_sink, pool.kv_sink, pool.state_rows.zero)
    return round(cuda_time_ms(captured.graphs[0].replay, warmup=3, repeat=repeat)["median_ms"], 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-size", default="0.8B")
    parser.add_argument("--rungs", default=DEFAULT_RUNGS, help="comma-separated candidate capacities (tokens)")
    parser.add_argument("--passages", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()
    rungs = tuple(sorted(int(t) for t in args.rungs.split(",")))
    with tempfile.TemporaryDirectory() as tmp:
        engine = fl.Engine.load(build_random_checkpoint(args.model_size, Path(tmp) / "model"), graphs=False)
        pool, kernel = engine.pool, engine.model.config.conv_kernel
        ladder = capacity_ladder(kernel, rungs[-1], engine.max_round_requests, engine.renderer.max_prompt_tokens,
                                 tokens=rungs)
        runner = GraphRunner(engine.model, engine.ops, engine._caches, ladder, pool.state_rows, pool.window_sink,
                             pool.kv_sink)
        runner.capture()
        placeholder = placeholder_round(kernel, pool.state_rows, pool.kv_sink).plan
        plans = {f"race{i}": lone_plan(engine, f"Passage {i}.\n{text}", questions)
                 for i, (text, questions) in enumerate(race_requests(args.passages))}
        states = UniqueStates(engine.renderer, 2000)
        plans.update({f"quality_2000_q{q}": lone_plan(engine, states.next(), noul_questions(q)) for q in (1, 4, 16)})
        rounds = {}
        for name, plan in plans.items():
            candidates = [c for c in runner.ladder if c.fits(plan) and c.tokens <= 2 * plan.num_real]
            rounds[name] = {"tokens": plan.num_real, "replay_ms": {
                c.tokens: [replay_ms(engine, runner, plan, c, args.repeat) for _ in range(args.passes)]
                for c in candidates}}
        placeholders = {c.tokens: replay_ms(engine, runner, placeholder, c, args.repeat) for c in runner.ladder}
        engine.close()
    torch.cuda.synchronize()
    write_result(f"ladder_rungs-{args.model_size}", {
        "benchmark": "ladder_rungs", "model_size": args.model_size,
        **run_metadata(f"python benchmarks/investigations/ladder_rungs.py --model-size {args.model_size} --rungs {args.rungs}"),
        "settings": {"rungs": list(rungs), "passages": args.passages, "repeat": args.repeat, "passes": args.passes},
        "rounds": rounds, "placeholder_replay_ms": placeholders,
    })


if __name__ == "__main__":
    main()
