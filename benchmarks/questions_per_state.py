"""Lone-request latency of Q yes/no questions about one ~2,000-token state, against transformers.

    PYTHONPATH=$PWD python benchmarks/questions_per_state.py --model-size 0.8B
    PYTHONPATH=$PWD python benchmarks/questions_per_state.py --tiny          (CPU smoke test)

One request at a time: a state of real prose (a QuALITY article, 2,000 +- 50 tokens with the renderer's
tokenizer) and Q = 1, 4, 16, 64 `fl.Noul` questions of 15-20 tokens each (`common.STORY_QUESTIONS`).
Every request's state is unique (a distinct first line, and the article and its start rotate), so no
checkpoint can serve it; `checkpoint_hits` in the stats delta shows it. Latency is the wall time of
`await engine.ask(...)`, median and p90 over the repetitions after a warm-up. The baseline is transformers
on the Q standalone prompts of one of the measured states as one padded batch (`benchmarks.baseline`).
Model FLOP utilisation = non-embedding parameters x 2 x tokens computed per request / latency / 790e12.
The states of a run of asks are made before its first ask (`timed_asks`), as short_passages' are.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import flide_sdk as fl
from benchmarks.baseline import Baseline, max_abs_dp, prompts_of
from benchmarks.common import (
    PEAK_BF16_FLOPS,
    QUALITY_SOURCE,
    STORY_QUESTIONS,
    add_engine_args,
    answer_probabilities,
    bench_checkpoint,
    command_line,
    cut_tokens,
    engine_settings,
    latency_stats,
    load_engine,
    model_flop_utilisation,
    non_embedding_parameters,
    quality_records,
    release_device_memory,
    run_metadata,
    stats_delta,
    target,
    token_count,
    write_result,
)

TARGETS_MS = {1: 9.0, 4: 9.0, 16: 11.0, 64: 18.0}  # 0.8B, lone-request median latency
TARGET_SPEEDUP_AT_64 = 40.0
TOLERANCE = 50  # state tokens either side of --state-tokens


class UniqueStates:
    """States of `tokens` +- TOLERANCE tokens, each with its own first line, rotating article and start."""

    def __init__(self, renderer, tokens: int) -> None:
        self.renderer = renderer
        self.tokens = tokens
        self.articles = [record["input"] for record in quality_records()]
        self.count = 0
        self.lengths: list[int] = []

    def next(self) -> str:
        serial = self.count
        self.count += 1
        header = f"Reading copy {serial}.\n"
        article = self.articles[serial % len(self.articles)]
        start = 97 * (serial // len(self.articles))
        body_tokens = self.tokens - token_count(self.renderer, header)
        state = header + cut_tokens(self.renderer, article, start, body_tokens)
        length = token_count(self.renderer, state)
        if abs(length - self.tokens) > TOLERANCE:
            raise ValueError(f"state {serial} is {length} tokens, not {self.tokens} +- {TOLERANCE}")
        self.lengths.append(length)
        return state


def noul_questions(count: int) -> dict[str, fl.Noul]:
    if count > len(STORY_QUESTIONS):
        raise ValueError(f"at most {len(STORY_QUESTIONS)} distinct questions")
    return {f"q{i}": fl.Noul(text) for i, text in enumerate(STORY_QUESTIONS[:count])}


async def timed_asks(engine, states: UniqueStates, questions, count: int) -> tuple[list[float], list[str], list]:
    """`count` asks one after the other, each about a new state. The states are made before the first ask:
    making one tokenizes a whole article with the HF tokenizer, which between two asks left the engine's own
    host work (the state's tokenization included) running on caches it had evicted."""
    asked = [states.next() for _ in range(count)]
    times, answers = [], []
    for state in asked:
        started = time.perf_counter()
        response = await engine.ask(state, questions)
        times.append(1000.0 * (time.perf_counter() - started))
        answers.append(response)
    return times, asked, answers


async def measure(engine, states: UniqueStates, q_values, warmup: int, repeat: int, params: int):
    """Per Q: latency, token counts, FLOP utilisation and the stats delta; plus, for the baseline, the standalone
    prompts of the first measured state and the engine's answers to them."""
    results, kept = {}, {}
    for q in q_values:
        questions = noul_questions(q)
        await timed_asks(engine, states, questions, warmup)
        before = engine.stats()
        times, asked, answers = await timed_asks(engine, states, questions, repeat)
        stats = stats_delta(before, engine.stats())
        rendered = [engine.render(state, questions) for state in asked]
        trunk = [len(r.state_ids) for r in rendered]
        branch = sum(len(b.ids) for b in rendered[0].questions.values())
        computed = stats["delta"].get("tokens_computed", 0) / max(1, stats["delta"].get("asks", 1))
        latency = latency_stats(times)
        results[q] = {
            "questions": q,
            "latency": latency,
            "trunk_tokens": {"min": min(trunk), "max": max(trunk)},
            "branch_tokens_total": branch,
            "prompt_tokens_per_request": {"min": min(trunk) + branch, "max": max(trunk) + branch},
            "tokens_computed_per_request": computed,
            "model_flop_utilisation": model_flop_utilisation(params, computed, latency["median_ms"] / 1000.0),
            "checkpoint_hits": stats["delta"].get("checkpoint_hits"),
            "engine_stats": stats,
        }
        kept[q] = (prompts_of(rendered[0]), [answer_probabilities(answers[0][name]) for name in questions])
    return results, kept


def run_engine(checkpoint, where, args, q_values, warmup, repeat, state_tokens):
    graphs, options = engine_settings(args)
    engine, load_info = load_engine(checkpoint, where["device"], where["dtype"], graphs, **options)
    try:
        instruction_tokens = [token_count(engine.tokens, text) for text in STORY_QUESTIONS[: max(q_values)]]
        params = non_embedding_parameters(engine.model)
        states = UniqueStates(engine.tokens, state_tokens)
        results, kept = asyncio.run(measure(engine, states, q_values, warmup, repeat, params))
    finally:
        engine.close()
    tokens = {"state_tokens": {"min": min(states.lengths), "max": max(states.lengths)},
              "instruction_tokens": {"min": min(instruction_tokens), "max": max(instruction_tokens)},
              "non_embedding_parameters": params, "peak_flops": PEAK_BF16_FLOPS}
    return results, kept, load_info, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--q", default="1,4,16,64", help="questions per request, comma-separated")
    parser.add_argument("--repeat", type=int, default=None, help="measured requests per Q (default 30, tiny 3)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up requests per Q (default 5, tiny 1)")
    parser.add_argument("--state-tokens", type=int, default=None, help="state length (default 2000, tiny 300)")
    parser.add_argument("--baseline-repeat", type=int, default=None, help="default 5, tiny 1")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--tokenizer-threads", type=int, default=None,
                        help="the tokenizer's worker threads (RAYON_NUM_THREADS, set before its first use; default "
                             "one per CPU): whether they slow the round thread's host stages (results get a suffix)")
    args = parser.parse_args()
    if args.tokenizer_threads is not None:
        os.environ["RAYON_NUM_THREADS"] = str(args.tokenizer_threads)
    repeat = args.repeat or (3 if args.tiny else 30)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 5)
    state_tokens = args.state_tokens or (300 if args.tiny else 2000)
    baseline_repeat = args.baseline_repeat or (1 if args.tiny else 5)
    q_values = [int(q) for q in args.q.split(",")]

    checkpoint, where = bench_checkpoint(args)
    results, kept, load_info, tokens = run_engine(checkpoint, where, args, q_values, warmup, repeat, state_tokens)
    release_device_memory()

    baseline_info = {"skipped": True}
    if not args.no_baseline:
        baseline = Baseline(checkpoint, where["device"], where["dtype"])
        baseline_info = baseline.info
        for q, (prompts, ours) in kept.items():
            timing, theirs = baseline.time(prompts, warmup=1, repeat=baseline_repeat)
            results[q]["baseline"] = timing
            results[q]["speedup_vs_baseline"] = timing["median_ms"] / results[q]["latency"]["median_ms"]
            results[q]["max_abs_dp_vs_baseline"] = max_abs_dp(ours, theirs)
        baseline_info["peak_memory_bytes"] = baseline.peak_memory_bytes()

    targets = {f"q{q}_median_ms": target(results[q]["latency"]["median_ms"], bound)
               for q, bound in TARGETS_MS.items() if q in results}
    if 64 in results and "speedup_vs_baseline" in results[64]:
        targets["q64_speedup_vs_baseline"] = target(results[64]["speedup_vs_baseline"], TARGET_SPEEDUP_AT_64, "min")
    name = "questions_per_state-" + ("tiny" if args.tiny else args.model_size)
    name += "" if args.tokenizer_threads is None else f"-threads{args.tokenizer_threads}"
    write_result(name, {
        "benchmark": "questions_per_state", "model_size": "tiny" if args.tiny else args.model_size,
        **run_metadata(command_line()),
        "data": f"{QUALITY_SOURCE}: the 15 articles, rotated, cut to {state_tokens} +- {TOLERANCE} tokens, each "
                "state with its own first line 'Reading copy N.'",
        "settings": {**where, **load_info, "repeat": repeat, "warmup": warmup, "state_tokens": state_tokens,
                     "q_values": q_values, "baseline_repeat": baseline_repeat,
                     "tokenizer_threads": os.environ.get("RAYON_NUM_THREADS", "one per CPU"),
                     "latency": "wall time of await engine.ask(...), one request at a time, the states made "
                                "before the run's first ask"},
        "tokens": tokens,
        "baseline_info": baseline_info,
        "results": {f"q{q}": value for q, value in results.items()},
        "targets_for": "0.8B", "targets": targets,
    })


if __name__ == "__main__":
    main()
