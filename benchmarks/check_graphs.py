"""CUDA-graph replay against eager execution on the GPU: same checkpoint, same asks, same kernels.

    PYTHONPATH=$PWD python benchmarks/check_graphs.py --model-size 0.8B [--no-float32]

Builds the random real-shape checkpoint, starts one engine with graphs (reporting capture time and graph
memory) and one without, and asks both the same mixed work: lone asks of many sizes, a batch of RACE
passages at once, and a growing session (resume + save rounds). Reports the largest |dp| between the two
(bf16 rounding: padded GEMMs may pick other cuBLAS algorithms), the graph engine's eager-run count (must
be 0 below the largest capacity), and both engines' stats; then, unless --no-float32, a float32 engine's
answers to the same work give the scale of bf16 rounding (both bf16 engines against it). The JSON is written
once the eager engine has run and again after the float32 one (at 0.8B on the H200 the bf16 engines take about
3 minutes together, the float32 engine over 6 more).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import numpy as np
import torch

import flide_sdk as fl
from benchmarks.common import (
    GEMMA_SIZES,
    MODEL_SIZES,
    Phases,
    build_random_checkpoint,
    run_metadata,
    write_result,
)
from benchmarks.fidelity import quality_request, race_requests


def probabilities(response) -> list[float]:
    values = []
    for answer in response.values():
        if hasattr(answer, "noul"):
            values.append(answer.noul)
        else:
            values.extend(answer.probabilities.values())
    return values


async def workload(engine: fl.Engine, state: str, questions: dict, passages: list) -> list[float]:
    out: list[float] = []
    words = state.split()
    for size in (30, 300, 1500, len(words)):  # lone asks, different capacities
        out += probabilities(await engine.ask(" ".join(words[:size]), questions))
    responses = await asyncio.gather(*(engine.ask(text, qs) for text, qs in passages))  # one or more rounds
    for response in responses:
        out += probabilities(response)
    session = engine.session()
    for step in range(6):  # resumes from checkpoints and saves new ones
        session.append({"role": "user", "content": " ".join(words[step * 120 : (step + 1) * 120])})
        out += probabilities(await session.ask({"story": fl.Noul("Is this text a story?")}))
    return out


async def lone_latency(engine: fl.Engine, state: str, count: int, repeats: int = 20) -> dict:
    """Median wall time of lone asks with `count` yes/no questions on unique ~2,000-token states, with the
    engine's per-stage seconds per round over the same asks."""
    questions = {f"q{i}": fl.Noul(f"Does the passage mention a character named in clue number {i} of the list?")
                 for i in range(count)}
    for warm in range(3):
        await engine.ask(f"Warm-up {warm}.\n{state}", questions)
    before = engine.stats()
    times = []
    for rep in range(repeats):
        started = asyncio.get_running_loop().time()
        await engine.ask(f"Request {rep} of {count}.\n{state}", questions)
        times.append(1000 * (asyncio.get_running_loop().time() - started))
    after = engine.stats()
    rounds = after["rounds"] - before["rounds"]
    stages = {key: 1000 * (after[key] - before[key]) / rounds for key in after if key.endswith("_seconds")}
    return {"questions": count, "median_ms": float(np.median(times)), "p90_ms": float(np.percentile(times, 90)),
            "per_round_ms": stages, "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-size", default="0.8B", choices=MODEL_SIZES + GEMMA_SIZES)
    parser.add_argument("--no-float32", dest="float32", action="store_false",
                        help="skip the float32 engine (the bf16 rounding scale; the slowest phase, over 6 min at 0.8B)")
    args = parser.parse_args()
    command = f"python benchmarks/check_graphs.py --model-size {args.model_size}" + ("" if args.float32 else " --no-float32")
    phases = Phases()
    with tempfile.TemporaryDirectory() as tmp:
        with phases("checkpoint"):
            path = build_random_checkpoint(args.model_size, Path(tmp) / "model")
        results = {}
        answers = {}
        engines = [("graphs", True, "bfloat16"), ("eager", False, "bfloat16")]
        for name, graphs, dtype in engines + ([("float32", False, "float32")] if args.float32 else []):
            with phases(name):
                run_engine(path, name, graphs, dtype, answers, results)
            if name != "graphs":  # written once the comparison exists (after eager), again with the float32 scale
                write_result(f"check_graphs-{args.model_size}", summary(args.model_size, command, answers, results,
                                                                      phases))


def summary(model_size: str, command: str, answers: dict, results: dict, phases: Phases) -> dict:
    """The graph engine's answers against the eager engine's (and both against float32 once it ran)."""
    diff = np.abs(answers["graphs"] - answers["eager"])
    to_float32 = {name: np.abs(answers[name] - answers["float32"]) for name in ("graphs", "eager")
                  if "float32" in answers}
    return {
        **run_metadata(command),
        "model_size": model_size,
        "probabilities_compared": len(diff),
        "max_abs_dp_graph_vs_eager": float(diff.max()),
        "mean_abs_dp_graph_vs_eager": float(diff.mean()),
        "bf16_rounding_scale": {f"{name}_vs_float32_{stat}": float(getattr(np, stat)(value))
                                for name, value in to_float32.items() for stat in ("mean", "max")} or None,
        "graph_engine_eager_runs": results["graphs"]["stats"]["eager_runs"],
        "seconds": dict(phases.seconds),
        **results,
    }


def run_engine(path: Path, name: str, graphs: bool, dtype: str, answers: dict, results: dict) -> None:
    """One engine's answers to the mixed workload (into `answers[name]`) and, but for the float32 reference,
    its lone latencies, stats and peak memory (into `results[name]`)."""
    torch.cuda.reset_peak_memory_stats()
    engine = fl.Engine.load(path, device="cuda", dtype=dtype, graphs=graphs)
    engine.wait_for_graphs()
    state, questions = quality_request(engine.tokens)
    passages = race_requests(40)
    answers[name] = np.array(asyncio.run(workload(engine, state, questions, passages)))
    if name != "float32":
        latency = [asyncio.run(lone_latency(engine, state, count)) for count in (1, 16, 64)]
        results[name] = {
            "lone_latency": latency,
            "stats": engine.stats(),
            "peak_memory_bytes": torch.cuda.max_memory_allocated(),
        }
    engine.close()
    del engine
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
