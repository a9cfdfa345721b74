"""Batch invariance: the same bits alone, forked, under load and resumed; and what the mode costs.

    PYTHONPATH=$PWD python benchmarks/invariance.py --model-size 0.8B
    PYTHONPATH=$PWD python benchmarks/invariance.py --tiny          (CPU smoke test)

Questions on real data: RACE passages, MultiRC paragraphs with all their questions (each candidate answer a
yes/no question), QuALITY articles, and agent trajectories replayed through sessions. Every question is first
asked alone on a batch-invariant engine without checkpoints (its reference bits), then on a second
batch-invariant engine: forked with all questions of its state, in rounds of up to 64 requests from 64
closed-loop clients (random subsets of the questions), and step by step through sessions that resume from the
checkpoint of the step before. Reported: questions compared and mismatches (any bit of any returned float).

Cost, same run, on RACE: the default and the batch-invariant engine at 64 closed-loop clients (requests/s)
and lone requests of 4 questions (latency); on every question of the reading sets, each mode's total variation
to a float32 engine's answers and their paired difference.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time

import numpy as np

import flide_sdk as fl
from benchmarks.agent_replay import QUESTIONS as AGENT_QUESTIONS
from benchmarks.agent_replay import load_trajectory, trajectory_paths
from benchmarks.common import (
    add_engine_args,
    answer_probabilities,
    bench_checkpoint,
    command_line,
    cut_tokens,
    data_path,
    engine_settings,
    latency_stats,
    load_engine,
    quality_choices,
    quality_records,
    race_requests,
    release_device_memory,
    run_metadata,
    stats_delta,
    target,
    write_result,
)

MAX_QUESTIONS = 64  # per MultiRC paragraph


def multirc_requests(count: int) -> list[tuple[str, dict]]:
    """The first `count` MultiRC paragraphs, each with every candidate answer of every question as a yes/no
    question (up to MAX_QUESTIONS)."""
    requests = []
    with data_path("reading", "multirc", "train.jsonl").open() as lines:
        for line in itertools.islice(lines, count):
            passage = json.loads(line)["passage"]
            questions = {}
            for q in passage["questions"]:
                for a in q["answers"]:
                    questions[f"q{q['idx']}a{a['idx']}"] = fl.Noul(f"{q['question']} Is this a correct answer: {a['text']}")
            requests.append((passage["text"], dict(itertools.islice(questions.items(), MAX_QUESTIONS))))
    return requests


def reading_requests(renderer, tiny: bool) -> dict[str, list[tuple[str, dict]]]:
    """The one-off states and their questions, by data set (QuALITY articles cut to 3,000 tokens)."""
    quality = [(cut_tokens(renderer, r["input"], 0, 3000), quality_choices(r)) for r in quality_records()[:3]]
    return {"race": race_requests(8 if tiny else 40), "multirc": multirc_requests(2 if tiny else 6),
            "quality": [(state, questions) for state, questions in quality if questions]}


def agent_steps(agents: int, steps: int) -> list[list[list[dict]]]:
    """Per agent, the message list after each of its first `steps` steps (tool outputs cut to 4,000 chars)."""
    runs = []
    for index, path in enumerate(trajectory_paths()[:agents]):
        prelude, moves = load_trajectory(path, f"agent {index}", max_chars=4000)
        history, states = list(prelude), []
        for move in moves[:steps]:
            history = history + move
            states.append(history)
        runs.append(states)
    return runs


class Reference:
    """Each question asked alone on a batch-invariant engine without checkpoints: its reference bits."""

    def __init__(self, engine: fl.Engine) -> None:
        self.engine = engine
        self.answers: dict[tuple[str, str], object] = {}

    async def answer(self, state, name: str, question) -> object:
        key = (json.dumps(state), name)
        if key not in self.answers:
            self.answers[key] = (await self.engine.ask(state, {name: question})).answers[name]
        return self.answers[key]


class Tally:
    """Questions compared and mismatches, per case."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = {}

    async def check(self, case: str, reference: Reference, state, questions: dict, answers: dict) -> None:
        counts = self.counts.setdefault(case, {"questions": 0, "mismatches": 0})
        for name, question in questions.items():
            counts["questions"] += 1
            counts["mismatches"] += answers[name] != await reference.answer(state, name, question)


async def invariance(served: fl.Engine, reference: Reference, reading: dict, agents: list, clients: int,
                     mixed_requests: int) -> dict:
    tally = Tally()
    everything = [request for requests in reading.values() for request in requests]
    for state, questions in everything:  # forked: all questions of a state in one ask, one ask at a time
        await tally.check("forked", reference, state, questions, (await served.ask(state, questions)).answers)
    rng = random.Random(0)
    budget = itertools.count()
    before = served.stats()

    async def client() -> None:  # mixed rounds: closed-loop clients, random subsets of a state's questions
        while next(budget) < mixed_requests:
            state, questions = rng.choice(everything)
            names = rng.sample(sorted(questions), rng.randint(1, len(questions)))
            subset = {name: questions[name] for name in names}
            await tally.check("mixed_64_clients", reference, state, subset, (await served.ask(state, subset)).answers)

    await asyncio.gather(*(client() for _ in range(clients)))
    mixed = stats_delta(before, served.stats())

    async def agent(states: list) -> None:  # resumed: a session per agent, one ask per step
        session = served.session()
        seen = 0
        for state in states:
            for item in state[seen:]:
                session.append(item)
            seen = len(state)
            answers = (await session.ask(AGENT_QUESTIONS)).answers
            await tally.check("resumed_sessions", reference, state, AGENT_QUESTIONS, answers)

    before = served.stats()
    await asyncio.gather(*(agent(states) for states in agents))
    resumed = stats_delta(before, served.stats())["delta"]
    total = {key: sum(c[key] for c in tally.counts.values()) for key in ("questions", "mismatches")}
    return {"cases": tally.counts, "total": total, "distinct_questions": len(reference.answers),
            "mixed_rounds": {"rounds": mixed["delta"].get("rounds"), "asks_per_round": mixed["per_round"].get("asks")},
            "resumed_checkpoint_hits": resumed.get("checkpoint_hits"), "resumed_tokens": resumed.get("tokens_resumed")}


async def throughput(engine: fl.Engine, requests: list, clients: int, count: int) -> dict:
    budget = itertools.count()
    supply = itertools.cycle(requests)

    async def client() -> None:
        while next(budget) < count:
            await engine.ask(*next(supply))

    await asyncio.gather(*(engine.ask(*next(supply)) for _ in range(clients)))  # warm-up at this concurrency
    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return {"clients": clients, "requests": count, "requests_per_s": count / (time.perf_counter() - started)}


async def lone(engine: fl.Engine, requests: list, repeat: int) -> tuple[dict, list]:
    times, answers = [], []
    for state, questions in requests[:3]:
        await engine.ask(state, questions)
    for state, questions in itertools.islice(itertools.cycle(requests), repeat):
        started = time.perf_counter()
        response = await engine.ask(state, questions)
        times.append(1000.0 * (time.perf_counter() - started))
        answers.append([answer_probabilities(response.answers[name]) for name in questions])
    return latency_stats(times), answers


async def probabilities(engine: fl.Engine, requests: list) -> list[np.ndarray]:
    """Every question's option probabilities, each state asked once with all its questions."""
    answers = []
    for state, questions in requests:
        response = await engine.ask(state, questions)
        answers += [answer_probabilities(response.answers[name]) for name in questions]
    return answers


def fidelity(invariant: list, default: list, exact: list) -> dict:
    """Total variation to the float32 answers, per mode, and the paired difference (invariant - default) with
    its standard error: the mode is no worse when the difference is within two standard errors of 0 or below."""
    tv = {name: np.array([0.5 * float(np.abs(a - b).sum()) for a, b in zip(answers, exact)])
          for name, answers in (("invariant", invariant), ("default", default))}
    diff = tv["invariant"] - tv["default"]
    error = float(diff.std(ddof=1) / np.sqrt(len(diff)))
    return {"questions": len(diff), **{f"tv_{name}": {"mean": float(v.mean()), "max": float(v.max())}
                                       for name, v in tv.items()},
            "paired_difference": {"mean": float(diff.mean()), "standard_error": error,
                                  "invariant_worse_share": float((diff > 0).mean()),
                                  "invariant_better_share": float((diff < 0).mean())},
            "no_worse": bool(diff.mean() <= 2 * error)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--clients", type=int, default=64)
    args = parser.parse_args()
    checkpoint, where = bench_checkpoint(args)
    graphs, options = engine_settings(args)
    device, dtype = where["device"], where["dtype"]
    mixed_requests, cost_requests, repeat = (40, 60, 10) if args.tiny else (600, 2000, 60)

    async def run() -> dict:
        alone, alone_load = load_engine(checkpoint, device, dtype, graphs, pool_bytes=0, batch_invariant=True, **options)
        served, served_load = load_engine(checkpoint, device, dtype, graphs, batch_invariant=True, **options)
        reading = reading_requests(served.tokens, args.tiny)
        agents = agent_steps(2, 4 if args.tiny else 12)
        started = time.perf_counter()
        checked = await invariance(served, Reference(alone), reading, agents, args.clients, mixed_requests)
        checked["seconds"] = time.perf_counter() - started
        linear = served.ops.linear  # on CUDA: cuBLAS for the shapes shown to sum alike at every row count
        checked["projections"] = {"shapes": sorted(served.model.projection_shapes()),
                                  "cublas_floors": {str(k): v for k, v in getattr(linear, "floors", {}).items()}}
        alone.close()
        race = reading["race"]
        everything = [request for requests in reading.values() for request in requests]
        race4 = [(state, dict(itertools.islice(q.items(), 4))) for state, q in race if len(q) >= 4]
        cost = {"invariant": {"throughput": await throughput(served, race, args.clients, cost_requests)}}
        cost["invariant"]["lone_q4_latency_ms"], _ = await lone(served, race4, repeat)
        invariant_answers = await probabilities(served, everything)
        served.close()
        release_device_memory()
        default, default_load = load_engine(checkpoint, device, dtype, graphs, **options)
        cost["default"] = {"throughput": await throughput(default, race, args.clients, cost_requests)}
        cost["default"]["lone_q4_latency_ms"], _ = await lone(default, race4, repeat)
        default_answers = await probabilities(default, everything)
        default.close()
        release_device_memory()
        exact, _ = load_engine(checkpoint, device, "float32", False, **options)
        cost["fidelity_to_float32"] = fidelity(invariant_answers, default_answers, await probabilities(exact, everything))
        exact.close()
        paired = cost["fidelity_to_float32"]["paired_difference"]  # no worse: within two standard errors of 0
        ratio = cost["invariant"]["throughput"]["requests_per_s"] / cost["default"]["throughput"]["requests_per_s"]
        lone_ratio = (cost["invariant"]["lone_q4_latency_ms"]["median_ms"]
                      / cost["default"]["lone_q4_latency_ms"]["median_ms"])
        return {"invariance": checked, "cost": cost,
                "loads": {"alone": alone_load, "served": served_load, "default": default_load},
                "targets": {"mismatches": target(checked["total"]["mismatches"], 0),
                            "questions": target(checked["total"]["questions"], 600, "min"),
                            "throughput_ratio_64_clients": target(ratio, 0.95, "min"),
                            "lone_q4_latency_ratio": target(lone_ratio, 1.10),
                            "fidelity_tv_difference": target(paired["mean"], 2 * paired["standard_error"])}}

    result = asyncio.run(run())
    result.update(where)
    result.update(run_metadata(command_line()))
    name = "invariance-tiny" if args.tiny else f"invariance-{args.model_size}"
    write_result(name, result)
    print(json.dumps({"targets": result["targets"], "cases": result["invariance"]["cases"]}, indent=1))


if __name__ == "__main__":
    main()
