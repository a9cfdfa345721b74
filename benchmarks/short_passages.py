"""Short passages with a few multiple-choice questions each: lone latency and closed-loop throughput.

    PYTHONPATH=$PWD python benchmarks/short_passages.py --model-size 0.8B
    PYTHONPATH=$PWD python benchmarks/short_passages.py --tiny          (CPU smoke test)

Requests are real RACE passages (dev/middle) with their ~4 questions as `fl.Choice`. Every request's state
is unique (a first line 'Passage N.' numbers each request), so a passage asked again in a later phase is
computed again, never served from a checkpoint. Lone latency: wall time of `await engine.ask(...)`, one
request at a time, over distinct passages after a warm-up. Throughput: C closed-loop clients (asyncio
tasks; each takes the next passage and awaits its answers, again and again) for a fixed number of
requests, at C = 1, 8, 32, 64. Baseline (transformers, `benchmarks.baseline`): lone latency of each
passage's questions as one padded batch, and throughput as 64 requests' questions in one padded batch.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time

from benchmarks.baseline import Baseline, max_abs_dp, prompts_of
from benchmarks.common import (
    RACE_SOURCE,
    add_engine_args,
    answer_probabilities,
    bench_checkpoint,
    command_line,
    engine_settings,
    latency_stats,
    load_engine,
    race_requests,
    release_device_memory,
    run_metadata,
    stats_delta,
    target,
    write_result,
)

TARGET_LONE_MS = 5.0  # 0.8B, lone-request median
TARGET_THROUGHPUT_64 = 450.0  # requests/s with 64 clients


class Passages:
    """An endless supply of unique requests over the RACE passages (shared by every client)."""

    def __init__(self, passages: list) -> None:
        self.passages = passages
        self.serial = itertools.count()

    def next(self) -> tuple[str, dict]:
        serial = next(self.serial)
        article, questions = self.passages[serial % len(self.passages)]
        return f"Passage {serial}.\n{article}", questions


async def lone(engine, supply: Passages, warmup: int, repeat: int):
    for _ in range(warmup):
        await engine.ask(*supply.next())
    before = engine.stats()
    times, asked = [], []
    for _ in range(repeat):
        state, questions = supply.next()
        started = time.perf_counter()
        response = await engine.ask(state, questions)
        times.append(1000.0 * (time.perf_counter() - started))
        asked.append((state, questions, [answer_probabilities(response[name]) for name in questions]))
    return {"latency": latency_stats(times), "engine_stats": stats_delta(before, engine.stats())}, asked


async def closed_loop(engine, supply: Passages, clients: int, requests: int) -> dict:
    """`clients` tasks asking one request after another until `requests` have been started."""
    budget = itertools.count()
    times: list[float] = []

    async def client() -> None:
        while next(budget) < requests:
            state, questions = supply.next()
            started = time.perf_counter()
            await engine.ask(state, questions)
            times.append(1000.0 * (time.perf_counter() - started))

    await asyncio.gather(*(engine.ask(*supply.next()) for _ in range(clients)))  # warm-up at this concurrency
    before = engine.stats()
    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.perf_counter() - started
    stats = stats_delta(before, engine.stats())
    return {"clients": clients, "requests": len(times), "seconds": elapsed, "requests_per_s": len(times) / elapsed,
            "latency": latency_stats(times), "engine_stats": stats}


def run_engine(checkpoint, where, args, passages, counts):
    graphs, options = engine_settings(args)
    engine, load_info = load_engine(checkpoint, where["device"], where["dtype"], graphs, **options)
    supply = Passages(passages)

    async def measure():
        lone_result, asked = await lone(engine, supply, counts["warmup"], counts["repeat"])
        loops = [await closed_loop(engine, supply, c, max(counts["min_requests"], counts["per_client"] * c))
                 for c in counts["clients"]]
        return lone_result, asked, loops

    try:
        lone_result, asked, loops = asyncio.run(measure())
        rendered = [engine.render(state, questions) for state, questions, _ in asked]
    finally:
        engine.close()
    lone_result["prompt_tokens"] = request_tokens(rendered)
    return load_info, lone_result, [(prompts_of(r), ours) for r, (_, _, ours) in zip(rendered, asked)], loops


def request_tokens(rendered) -> dict:
    """Trunk and branch token counts of the measured requests."""
    trunks = [len(r.state_ids) for r in rendered]
    branches = [sum(len(q.ids) for q in r.questions.values()) for r in rendered]
    questions = [len(r.questions) for r in rendered]
    return {"trunk_min": min(trunks), "trunk_max": max(trunks), "trunk_mean": sum(trunks) / len(trunks),
            "branches_per_request_mean": sum(branches) / len(branches),
            "questions_per_request_mean": sum(questions) / len(questions)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--clients", default=None, help="concurrency levels (default 1,8,32,64; tiny 1,8)")
    parser.add_argument("--repeat", type=int, default=None, help="lone measured requests (default 40, tiny 4)")
    parser.add_argument("--warmup", type=int, default=None, help="lone warm-up requests (default 10, tiny 1)")
    parser.add_argument("--per-client", type=int, default=None,
                        help="closed-loop requests per client (default 16, tiny 2), at least --min-requests")
    parser.add_argument("--min-requests", type=int, default=None, help="default 200, tiny 4")
    parser.add_argument("--baseline-passages", type=int, default=None, help="default 10, tiny 2")
    parser.add_argument("--baseline-batch", type=int, default=None, help="requests in the throughput batch "
                        "(default 64, tiny 4)")
    parser.add_argument("--no-baseline", action="store_true")
    args = parser.parse_args()
    tiny = args.tiny
    counts = {
        "clients": [int(c) for c in (args.clients or ("1,8" if tiny else "1,8,32,64")).split(",")],
        "repeat": args.repeat or (4 if tiny else 40),
        "warmup": args.warmup if args.warmup is not None else (1 if tiny else 10),
        "per_client": args.per_client or (2 if tiny else 16),
        "min_requests": args.min_requests or (4 if tiny else 200),
        "baseline_passages": args.baseline_passages or (2 if tiny else 10),
        "baseline_batch": args.baseline_batch or (4 if tiny else 64),
    }
    passages = race_requests(24 if tiny else None)
    if tiny:  # the tiny tokenizer spends ~3x the tokens of the real one: keep CPU rounds short
        passages = [(article[:700], questions) for article, questions in passages]

    checkpoint, where = bench_checkpoint(args)
    load_info, lone_result, kept, loops = run_engine(checkpoint, where, args, passages, counts)
    release_device_memory()

    baseline_result = {"skipped": True}
    if not args.no_baseline:
        baseline = Baseline(checkpoint, where["device"], where["dtype"])
        per_passage, dp = [], []
        for prompts, ours in kept[: counts["baseline_passages"]]:
            timing, theirs = baseline.time(prompts, warmup=1, repeat=3)
            per_passage.append(timing["median_ms"])
            dp.append(max_abs_dp(ours, theirs))
        batch = [prompt for prompts, _ in kept[: counts["baseline_batch"]] for prompt in prompts]
        requests_in_batch = min(len(kept), counts["baseline_batch"])
        batch_timing, _ = baseline.time(batch, warmup=1, repeat=3)
        baseline_result = {
            **baseline.info,
            "lone_latency_per_passage": latency_stats(per_passage),
            "max_abs_dp_vs_engine": max(dp),
            "batch": {"requests": requests_in_batch, **batch_timing,
                      "requests_per_s": requests_in_batch / (batch_timing["median_ms"] / 1000.0)},
            "peak_memory_bytes": baseline.peak_memory_bytes(),
        }
        lone_result["speedup_vs_baseline"] = (baseline_result["lone_latency_per_passage"]["median_ms"]
                                              / lone_result["latency"]["median_ms"])
        for loop in loops:
            loop["throughput_vs_baseline_batch"] = loop["requests_per_s"] / baseline_result["batch"]["requests_per_s"]

    at_64 = next((loop["requests_per_s"] for loop in loops if loop["clients"] == 64), None)
    name = "short_passages-" + ("tiny" if tiny else args.model_size)
    write_result(name, {
        "benchmark": "short_passages", "model_size": "tiny" if tiny else args.model_size,
        **run_metadata(command_line()),
        "data": f"{RACE_SOURCE}: {len(passages)} passages with their questions as fl.Choice, each request's "
                "state prefixed with a unique line 'Passage N.'" + (", articles cut to 700 characters" if tiny else ""),
        "settings": {**where, **load_info, **counts,
                     "lone_latency": "wall time of await engine.ask(...), one request at a time",
                     "throughput": "closed loop: each client awaits its request, then starts the next"},
        "lone": lone_result,
        "throughput": loops,
        "baseline": baseline_result,
        "targets_for": "0.8B",
        "targets": {"lone_median_ms": target(lone_result["latency"]["median_ms"], TARGET_LONE_MS),
                    "requests_per_s_at_64_clients": target(at_64, TARGET_THROUGHPUT_64, "min")},
    })


if __name__ == "__main__":
    main()
