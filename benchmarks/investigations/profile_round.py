"""Where a round's device time goes: per-kernel CUDA time of one forward, grouped by kernel name.

    PYTHONPATH=$PWD python benchmarks/investigations/profile_round.py --model-size 0.8B

Rounds: a lone ~2,000-token QuALITY state with 1, 4, 16 and 64 yes/no questions, and a lone RACE passage
with its questions (short_passages' lone request), each padded to the capacity its CUDA graph would have.
The forward runs eagerly under torch.profiler (kernel times are those a graph replay runs; launch gaps are
not counted: `launches` says how many kernels a replay runs). Also times the host side of an ask:
tokenizing the state.

    ncu --profile-from-start off ... python benchmarks/investigations/profile_round.py --ncu ROUND

runs only ROUND (e.g. quality_2000_q1), warmed up, then one forward inside a CUDA profiler range, for Nsight
Compute's hardware counters of its kernels (no JSON: ncu writes the report).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import flide_sdk as fl
from benchmarks.common import (
    build_random_checkpoint,
    device_kernels,
    race_requests,
    run_metadata,
    write_result,
)
from benchmarks.fidelity import quality_request
from flide_sdk.plan.capacity import capacity_ladder, choose, pad_round
from flide_sdk.plan.layout import Branches, RequestSpec, plan_round


def yes_no_questions(count: int) -> dict:
    return {f"q{i}": fl.Noul(f"Does the passage mention a character named in clue number {i} of the list?")
            for i in range(count)}


def padded_round(engine: fl.Engine, state: str, questions: dict):
    """The lone request (state, questions) planned and padded to its graph's capacity, on the device."""
    rendered = engine.render(state, questions)
    pool = engine.pool
    spec = RequestSpec(rendered.state_ids, Branches.of([q.ids for q in rendered.questions.values()],
                                                   [q.label_ids for q in rendered.questions.values()]))
    host = plan_round([spec], engine.model.config.conv_kernel, pool.state_rows, pool.kv_sink)
    ladder = capacity_ladder(engine.model.config.conv_kernel, 16384, 64, engine.tokens.max_prompt_tokens)
    capacity = choose(ladder, host)
    padded = pad_round(host, capacity, pool.window_sink)
    return host, capacity, padded.to("cuda")


def kernel_table(engine: fl.Engine, label: str, state: str, questions: dict) -> dict:
    host, capacity, rnd = padded_round(engine, state, questions)
    caches = engine.pool.layer_caches()
    rows, prof = device_kernels(lambda: engine.model(rnd, engine.ops, caches))
    return {"round": label, "questions": len(questions), "tokens": host.num_real, "capacity_tokens": capacity.tokens,
            "device_ms_total": sum(row["ms"] for row in rows), "launches": sum(row["calls"] for row in rows),
            "kernels": rows[:30], "first_launches": launch_order(prof, FIRST_LAUNCHES)}


FIRST_LAUNCHES = 80  # about the first three layers: where each small kernel and memset of a replay comes from


def launch_order(prof, count: int) -> list[str] | str:
    """The names of the first `count` device kernels and memsets of the profiled forward, in start order."""
    try:
        device = [event for event in prof.events() if getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA]
        device.sort(key=lambda event: event.time_range.start)
        return [event.name[:60] for event in device[:count]]
    except Exception as failure:  # noqa: BLE001 - the order is a diagnostic; the table above stands without it
        return f"{type(failure).__name__}: {failure}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-size", default="0.8B")
    parser.add_argument("--ncu", metavar="ROUND", help="one forward of ROUND in a CUDA profiler range, nothing else")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_checkpoint(args.model_size, Path(tmp) / "model")
        engine = fl.Engine.load(path, device="cuda", dtype="bfloat16", graphs=False)
        state, _ = quality_request(engine.tokens)
        passage, passage_questions = race_requests(1)[0]
        rounds = {f"quality_2000_q{count}": (state, yes_no_questions(count)) for count in (1, 4, 16, 64)}
        rounds["race_passage"] = (passage, passage_questions)
        if args.ncu:
            _, _, rnd = padded_round(engine, *rounds[args.ncu])
            caches = engine.pool.layer_caches()
            for _ in range(3):
                engine.model(rnd, engine.ops, caches)
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            engine.model(rnd, engine.ops, caches)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            engine.close()
            return
        tables = [kernel_table(engine, label, *request) for label, request in rounds.items()]
        tokenize = []
        for rep in range(10):
            started = time.perf_counter()
            engine.prompt.trunk(f"Request {rep}.\n{state}")
            tokenize.append(1000 * (time.perf_counter() - started))
        engine.close()
    write_result(f"profile_round-{args.model_size}", {
        **run_metadata(f"python benchmarks/investigations/profile_round.py --model-size {args.model_size}"),
        "model_size": args.model_size,
        "tokenize_state_ms": sorted(tokenize),
        "rounds": tables,
    })


if __name__ == "__main__":
    main()
