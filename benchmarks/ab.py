"""Same-run A/B of two source trees on one machine: the scoreboard workloads, alternating blocks.

    PYTHONPATH=$PWD python benchmarks/ab.py --before .ab/before --after . --model-size 0.8B
    PYTHONPATH=$PWD python benchmarks/ab.py --before .ab/before --after . --tiny        (CPU smoke test)

Worker processes, `--replicas` per tree (each imports `flide_sdk` from its tree and uses only the public
API), load the same checkpoint; the driver sends them the same workloads in alternating blocks (ABBA order over
the trees, each tree's replicas in turn), one worker busy at a time. A tree's value in a block is the mean of its
replicas' values, so what one process happens to get (its cores, its memory layout) weighs less; the spread
between the replicas of one tree (an A/A ratio) is reported as the noise floor. Workloads: W1 (a ~2,000-token
unique state, Q = 1, 4, 16, 64 yes/no questions, lone asks), RACE lone asks, MultiRC paragraphs with all their
yes/no questions (up to 64) as lone asks, RACE with 64 concurrent clients (requests/s), an agent session
replayed to its step nearest 13,000 prompt tokens, and an agent session whose every step is also asked by a
fork of it with one more message, both at once. Reported per workload: the median over blocks and the ratio
after / before, with the median per-round stage times each tree counts and, where a tree counts them, its
Gated DeltaNet chunk rows and stream tokens per round (`engine.stats()`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

Q_COUNTS = (1, 4, 16, 64)
NEAR_TOKENS = 13_000


# ------------------------------------------------------------------------------------------------- worker
def worker(checkpoint: str, device: str, pool_bytes: int) -> None:
    """Serve workload commands read as JSON lines from stdin; answer each with a JSON line of timings."""
    import torch

    import flide_sdk as fl

    engine = fl.Engine.load(checkpoint, device=device, pool_bytes=pool_bytes)
    if hasattr(engine, "wait_for_graphs"):  # a tree whose engine captures in the background
        engine.wait_for_graphs()
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write to the protocol stream
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        before = engine.stats()
        result = asyncio.run(WORKLOADS[command["workload"]](engine, command))
        stats = engine.stats()
        memory = {"pool_reserved_bytes": stats.get("pool_reserved_bytes", stats.get("pool_capacity_bytes")),
                  "max_memory_allocated_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else 0}
        rounds = max(1, stats["rounds"] - before["rounds"])
        counts = {f"{key}_per_round": (stats[key] - before[key]) / rounds
                  for key in ("gdn_chunks", "tokens_computed") if key in stats}
        counts["rounds"] = stats["rounds"] - before["rounds"]
        print(json.dumps({**result, "stages_ms": stage_means(before, stats), "memory": memory, "counts": counts}),
              file=out, flush=True)
    engine.close()


def stage_means(before: dict, after: dict) -> dict[str, float]:
    """Each `*_seconds` counter of `engine.stats()` per round over a workload, in ms (what the two trees count)."""
    rounds = after["rounds"] - before["rounds"]
    return {key[: -len("_seconds")]: 1000 * (after[key] - before[key]) / rounds
            for key in after if key.endswith("_seconds") and key in before and rounds}


def probabilities(response: Any) -> list[float]:
    """Every option probability of a response, in question and label order (to compare the two trees)."""
    values = []
    for answer in response.values():
        values += [answer.noul] if hasattr(answer, "noul") else list(answer.probabilities.values())
    return values


async def lone(engine: Any, command: dict) -> dict:
    times, answers = [], []
    for state, questions in command["asks"]:
        started = time.perf_counter()
        response = await engine.ask(state, questions)
        times.append(1000 * (time.perf_counter() - started))
        answers += probabilities(response)
    return {"median_ms": statistics.median(times), "probabilities": answers}


async def clients(engine: Any, command: dict) -> dict:
    asks = list(command["asks"])
    started = time.perf_counter()

    async def client() -> None:
        while asks:
            state, questions = asks.pop()
            await engine.ask(state, questions)

    await asyncio.gather(*(client() for _ in range(command["clients"])))
    return {"requests_per_s": len(command["asks"]) / (time.perf_counter() - started)}


def replay(engine: Any, command: dict) -> Iterator[Any]:
    """The command's agent session, yielded after each step's messages are appended (its prelude first)."""
    session = engine.session()
    for message in command["prelude"]:
        session.append(message)
    for step in command["steps"]:
        for message in step:
            session.append(message)
        yield session


async def agent(engine: Any, command: dict) -> dict:
    """Replay the steps; the median latency of the steps whose prompt is nearest NEAR_TOKENS."""
    steps = []
    for session in replay(engine, command):
        started = time.perf_counter()
        response = await session.ask(command["questions"])
        steps.append((abs(response.usage.input_tokens - NEAR_TOKENS), 1000 * (time.perf_counter() - started)))
        if response.usage.input_tokens > NEAR_TOKENS * 1.25:
            break
    near = sorted(steps)[:5]
    return {"median_ms": statistics.median(ms for _, ms in near)}


async def forked(engine: Any, command: dict) -> dict:
    """Replay the steps; after each, a fork of the session adds a message and both ask at once (the fork's
    trunk continues the session's): the median time until both are answered."""
    times = []
    for session in replay(engine, command):
        child = session.fork()
        child.append(command["what_if"])
        started = time.perf_counter()
        await asyncio.gather(session.ask(command["questions"]), child.ask(command["questions"]))
        times.append(1000 * (time.perf_counter() - started))
        child.close()
    return {"median_ms": statistics.median(times)}


WORKLOADS = {"lone": lone, "clients": clients, "agent": agent, "forked": forked}


# ------------------------------------------------------------------------------------------------- driver
def workloads(block: int) -> dict[str, dict]:
    """Each workload's command for one block (states marked with the block, so no block resumes another's)."""
    from benchmarks.agent_replay import QUESTIONS, load_trajectory, trajectory_paths
    from benchmarks.common import STORY_QUESTIONS, quality_records, race_requests
    from benchmarks.invariance import multirc_requests

    articles = [record["input"] for record in quality_records()]
    commands: dict[str, dict] = {}
    for q in Q_COUNTS:
        questions = {f"s{i}": {"type": "noul", "instructions": STORY_QUESTIONS[i % len(STORY_QUESTIONS)]}
                     for i in range(q)}
        asks = [(f"Request {block}-{q}-{i}.\n{articles[(block + i) % len(articles)][:8000]}", questions)
                for i in range(12)]
        commands[f"w1_q{q}_median_ms"] = {"workload": "lone", "asks": asks}
    race = [(f"Passage {block}-{i}.\n{state}", {name: question.to_dict() for name, question in questions.items()})
            for i, (state, questions) in enumerate(race_requests(256))]
    commands["race_lone_median_ms"] = {"workload": "lone", "asks": race[:24]}
    multirc = [(f"Paragraph {block}-{i}.\n{state}", {name: question.to_dict() for name, question in questions.items()})
               for i, (state, questions) in enumerate(multirc_requests(12))]
    commands["multirc_lone_median_ms"] = {"workload": "lone", "asks": multirc}
    commands["race_64_clients_requests_per_s"] = {"workload": "clients", "asks": race, "clients": 64}
    prelude, steps = load_trajectory(trajectory_paths()[0], marker=f"agent {block}")
    commands["agent_near_13k_median_ms"] = {
        "workload": "agent", "prelude": prelude, "steps": steps,
        "questions": {name: question.to_dict() for name, question in QUESTIONS.items()}}
    prelude, steps = load_trajectory(trajectory_paths()[1], marker=f"forked agent {block}")
    commands["forked_agent_step_median_ms"] = {
        "workload": "forked", "prelude": prelude, "steps": steps[:16],
        "what_if": {"role": "user", "content": "Suppose the last command had failed with a permission error."},
        "questions": {name: question.to_dict() for name, question in QUESTIONS.items()}}
    return commands


class Worker:
    def __init__(self, tree: Path, checkpoint: Path, device: str, pool_bytes: int, log: Path) -> None:
        # its tree first: `flide_sdk` comes from there (the rest of the path, e.g. extra wheels, stays)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree.resolve()), os.environ.get("PYTHONPATH", "")])}
        self.log = log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", str(checkpoint), "--device", device,
             "--pool-bytes", str(pool_bytes)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, cwd=tree)

    def ready(self) -> None:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"a worker died at start: see {self.log.name}")

    def run(self, command: dict) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"a worker died: see {self.log.name}")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(60)


def commit_of(tree: Path) -> str:
    marker = tree / "COMMIT"
    if marker.exists():
        return marker.read_text().strip()
    probe = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
    return probe.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", metavar="CHECKPOINT")
    parser.add_argument("--before", type=Path)
    parser.add_argument("--after", type=Path)
    parser.add_argument("--model-size", default="0.8B")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default=None)
    parser.add_argument("--pool-bytes", type=int, default=8 << 30)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--replicas", type=int, default=2, help="worker processes per tree")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "ab.json")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.device, args.pool_bytes)

    import torch

    from benchmarks.common import build_random_checkpoint, run_metadata

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        from flide_sdk.testing import tiny_checkpoint

        checkpoint, size = tiny_checkpoint(), "tiny"
    else:
        checkpoint, size = build_random_checkpoint(args.model_size, Path("/tmp/ab-checkpoint")), args.model_size
    sides = {"before": args.before, "after": args.after}
    logs = args.out.parent
    logs.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    workers = {name: [Worker(tree, checkpoint, device, args.pool_bytes, logs / f"ab-{name}{r}.log")
                      for r in range(args.replicas)] for name, tree in sides.items()}
    for replicas in workers.values():
        for w in replicas:
            w.ready()
    print(f"[{time.perf_counter() - started:7.1f} s] all workers ready", file=sys.stderr, flush=True)
    # per tree and workload, one list per replica of each block's value; stages and memory of the first replica
    results: dict[str, dict[str, list[list[float]]]] = {name: {} for name in sides}
    stages: dict[str, dict[str, list[dict]]] = {name: {} for name in sides}  # per block, ms per round
    memory: dict[str, dict[str, dict]] = {name: {} for name in sides}  # after each workload's last block
    counts: dict[str, dict[str, dict]] = {name: {} for name in sides}  # per round, the last block's
    differences: dict[str, float] = {}  # lone workloads: max |dp| between the trees' answers (bf16 rounding)
    for block in range(args.blocks + 1):  # block 0 warms every worker up (compiles, first shapes), not counted
        commands = workloads(block)
        order = list(sides) if block % 2 else list(reversed(sides))
        for key, command in commands.items():
            answers = {}
            for name in order:
                replicas = range(args.replicas) if block % 2 else reversed(range(args.replicas))
                for r in replicas:
                    answer = workers[name][r].run(command)
                    answers.setdefault(name, answer)
                    if block:
                        per_replica = results[name].setdefault(key, [[] for _ in range(args.replicas)])
                        per_replica[r].append(next(iter(answer.values())))
                        if r == 0:
                            stages[name].setdefault(key, []).append(answer["stages_ms"])
                            memory[name][key] = answer.get("memory")
                            counts[name][key] = answer.get("counts", {})
            if all("probabilities" in a for a in answers.values()):
                gap = max(abs(x - y) for x, y in zip(*(a["probabilities"] for a in answers.values()), strict=True))
                differences[key] = max(differences.get(key, 0.0), gap)
        print(f"[{time.perf_counter() - started:7.1f} s] block {block}", file=sys.stderr, flush=True)
    for replicas in workers.values():
        for w in replicas:
            w.close()
    print(f"max |dp| between the trees' answers: {json.dumps(differences)}", file=sys.stderr)
    summary = {}
    for key in results["after"]:
        before, after = (statistics.median(statistics.fmean(values) for values in zip(*results[name][key]))
                         for name in ("before", "after"))
        slower = after / before if key.endswith("_ms") else before / after  # > 1: the after tree is slower
        # A/A: each tree's replicas against each other (the noise a single comparison carries)
        spread = {name: statistics.median(values[-1]) / statistics.median(values[0])
                  for name, values in ((name, results[name][key]) for name in sides) if len(values) > 1}
        summary[key] = {"before": before, "after": after, "after_over_before": after / before,
                        "slowdown": slower, "within_3_percent": slower <= 1.03, "within_5_percent": slower <= 1.05,
                        "replica_ratio": spread, "memory": {name: memory[name][key] for name in sides},
                        "counts": {name: counts[name][key] for name in sides}}
        print(f"{key:36s} before {before:9.3f}  after {after:9.3f}  slowdown {slower:6.3f}  replicas "
              + " ".join(f"{name} {ratio:.3f}" for name, ratio in spread.items()), file=sys.stderr)
        for name in sides:
            means = {stage: statistics.median(block[stage] for block in stages[name][key])
                     for stage in stages[name][key][0]}
            summary[key][f"{name}_stages_ms"] = means
            print(f"    {name:6s} " + " ".join(f"{stage}={ms:.3f}" for stage, ms in means.items() if ms >= 0.005),
                  file=sys.stderr)
    result = {**run_metadata(" ".join(sys.argv)), "benchmark": "ab", "model_size": size,
              "before_commit": commit_of(args.before), "after_commit": commit_of(args.after),
              "blocks": args.blocks, "replicas": args.replicas, "summary": summary, "max_abs_probability_difference": differences,
              "blocks_values": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
