"""A checkpoint pool that cannot grow on a full card: it evicts (or saves no checkpoint), and every ask answers.

    PYTHONPATH=$PWD python benchmarks/investigations/full_card.py --model-size 0.8B

Loads an engine whose pool cap is far above what the card will hold, fills the card with a tensor until about
`--free-gib` is left, then runs agents whose sessions grow past that memory (each step a new piece of a QuALITY
article). Prints whether any ask failed, the pool's `growth_refused` and `evictions` counters and its bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import torch

import flide_sdk as fl
from benchmarks.common import build_random_checkpoint, quality_records, run_metadata, write_result


async def run_agents(engine: fl.Engine, agents: int, steps: int) -> list[str]:
    articles = [record["input"] for record in quality_records()]
    failures: list[str] = []

    async def agent(index: int) -> None:
        session = engine.session()
        text = articles[index % len(articles)]
        for step in range(steps):
            session.append(f"[agent {index} step {step}] " + text[(step * 4000) % len(text):][:4000])
            try:
                answers = await session.ask({"stuck": fl.Noul("Is the agent stuck?")})
                assert 0.0 <= answers["stuck"].noul <= 1.0
            except Exception as error:  # noqa: BLE001 (what a full card must never raise, of any type)
                failures.append(f"{type(error).__name__}: {error}")

    await asyncio.gather(*(agent(i) for i in range(agents)))
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-size", default="0.8B")
    parser.add_argument("--free-gib", type=float, default=3.0)
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    path = build_random_checkpoint(args.model_size, Path("/tmp/full-card-checkpoint"))
    engine = fl.Engine.load(path, device="cuda", pool_bytes=200 << 30)
    engine.wait_for_graphs()
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(max(0, free - int(args.free_gib * 2**30)), dtype=torch.uint8, device="cuda")
    failures = asyncio.run(run_agents(engine, args.agents, args.steps))
    stats = engine.stats()
    result = {**run_metadata(" ".join(sys.argv)), "benchmark": "full_card", "model_size": args.model_size,
              "free_gib_left": args.free_gib, "failures": failures[:5], "failed_asks": len(failures),
              "asks": stats["asks"], "growth_refused": stats["growth_refused"], "evictions": stats["evictions"],
              "checkpoints_saved": stats["checkpoints_saved"], "pool_bytes": stats["pool_bytes"],
              "pool_capacity_bytes": stats["pool_capacity_bytes"]}
    del filler
    engine.close()
    write_result(f"full_card-{args.model_size}", result)


if __name__ == "__main__":
    main()
