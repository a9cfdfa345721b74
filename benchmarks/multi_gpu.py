"""Several GPUs in one process: an `EngineGroup` of one engine per device against one engine.

    PYTHONPATH=$PWD python benchmarks/multi_gpu.py --model-size 0.8B     (every visible GPU)
    PYTHONPATH=$PWD python benchmarks/multi_gpu.py --tiny                (CPU smoke test: two CPU engines)

Agents: mini-swe-agent trajectories replayed through sessions as in `agent_replay` (four questions after every
step), 16 agents per device: 16 on one engine, then 16 x N on the group of N engines; steps/s of each. Every
step after an agent's first resumes from the checkpoint of its step before, which lives on the device its
session was made on: each engine's checkpoint hits are checked against the resumed steps of the sessions
it holds, so a session that changed device would show as a miss. RACE: closed-loop clients as in
`short_passages` (unique passages with their ~4 Choice questions), 128 on one engine, then 128 on the group.
Targets (two GPUs): both ratios at least 1.8.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

import flide_sdk as fl
from benchmarks.agent_replay import Agent, load_trajectory, many_agents, trajectory_paths
from benchmarks.common import (
    RACE_SOURCE,
    add_engine_args,
    bench_checkpoint,
    command_line,
    engine_settings,
    load_engine,
    race_requests,
    release_device_memory,
    run_metadata,
    target,
    write_result,
)
from benchmarks.short_passages import Passages, closed_loop

TARGET_RATIO = 1.8  # two GPUs against one, agents and RACE


class GroupFront:
    """The group through the calls the agent and RACE workloads make on an engine (stats: the group's totals)."""

    def __init__(self, group: fl.EngineGroup) -> None:
        self.group = group
        self.session, self.ask, self.render = group.session, group.ask, group.render

    def stats(self) -> dict:
        return self.group.stats()["total"]


async def agents_on(front, engines: list, trajectories: list, steps: int) -> dict:
    """The agents replay concurrently (`agent_replay.many_agents`); per engine: its sessions, and its checkpoint
    hits against the resumed steps of those sessions."""
    agents = [Agent(front, prelude, trajectory[:steps]) for prelude, trajectory in trajectories]
    placed = [engines.index(agent.session.engine) for agent in agents]
    before = [engine.stats()["checkpoint_hits"] for engine in engines]
    result = await many_agents(front, agents)
    per_engine = []
    for index, engine in enumerate(engines):
        mine = [agent for agent, at in zip(agents, placed) if at == index]
        per_engine.append({"device": str(engine.device), "sessions": len(mine),
                           "checkpoint_hits": engine.stats()["checkpoint_hits"] - before[index],
                           "resumed_steps": sum(len(agent.steps) - 1 for agent in mine)})
    stayed = all(agent.session.engine is engines[at] for agent, at in zip(agents, placed))
    result.pop("pool_samples")
    return {**result, "engines": per_engine, "sessions_kept_their_device": stayed and all(
        e["checkpoint_hits"] == e["resumed_steps"] for e in per_engine)}


def fleet(count: int, marker: str, chars: int | None) -> list:
    paths = trajectory_paths()
    return [load_trajectory(paths[i % len(paths)], f"{marker} {i}", chars) for i in range(count)]


def measure(front, engines: list, settings: dict, marker: str) -> dict:
    """Warm-up (two steps of one agent per engine), then the agents, then the RACE clients."""
    chars = settings["max_message_chars"]
    agents = settings["agents_per_device"] * len(engines)

    async def run() -> dict:
        await many_agents(front, [Agent(front, prelude, steps[:2])
                                  for prelude, steps in fleet(len(engines), f"{marker} warm-up", chars)])
        for engine in engines:
            engine.clear_pool()
        replay = await agents_on(front, engines, fleet(agents, marker, chars), settings["steps"])
        passages = race_requests(settings["passages"])
        if settings["passages"]:  # tiny: the tiny tokenizer spends ~3x the tokens of the real one
            passages = [(article[:700], questions) for article, questions in passages]
        supply = Passages(passages)
        clients = settings["clients"]
        race = await closed_loop(front, supply, clients, settings["per_client"] * clients)
        return {"agents": replay, "race": race}

    return asyncio.run(run())


def one_engine(checkpoint, device: str, dtype: str, graphs: bool, options: dict, settings: dict) -> tuple:
    engine, load_info = load_engine(checkpoint, device, dtype, graphs, **options)
    try:
        return measure(engine, [engine], settings, "one"), load_info
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--devices", default=None,
                        help="comma-separated devices of the group (default: every visible GPU; tiny: cpu,cpu)")
    parser.add_argument("--agents-per-device", type=int, default=None, help="default 16, tiny 2")
    parser.add_argument("--steps", type=int, default=None, help="steps per agent (default 40, tiny 2)")
    parser.add_argument("--clients", type=int, default=None, help="RACE closed-loop clients (default 128, tiny 4)")
    parser.add_argument("--per-client", type=int, default=None, help="RACE requests per client (default 16, tiny 1)")
    args = parser.parse_args()
    tiny = args.tiny
    devices = (args.devices.split(",") if args.devices else
               ["cpu", "cpu"] if tiny else [f"cuda:{i}" for i in range(torch.cuda.device_count())])
    settings = {
        "devices": devices,
        "agents_per_device": args.agents_per_device or (2 if tiny else 16),
        "steps": args.steps or (2 if tiny else 40),
        "clients": args.clients or (4 if tiny else 128),
        "per_client": args.per_client or (1 if tiny else 16),
        "passages": 24 if tiny else None,
        "max_message_chars": 300 if tiny else None,
    }
    checkpoint, where = bench_checkpoint(args)
    graphs, options = engine_settings(args)

    one, load_info = one_engine(checkpoint, devices[0], where["dtype"], graphs, options, settings)
    release_device_memory()  # the engine and its weights are gone before the group loads

    started = time.perf_counter()
    group = fl.EngineGroup.load(checkpoint, devices, dtype=where["dtype"], graphs=graphs,
                                **{k: v for k, v in options.items() if v is not None})
    loaded = time.perf_counter()
    for member in group.engines:
        member.wait_for_graphs()
    group_load = {"load_seconds": loaded - started, "graphs_ready_seconds": time.perf_counter() - started}
    try:
        many = measure(GroupFront(group), group.engines, settings, "group")
    finally:
        group.close()

    agents_ratio = many["agents"]["steps_per_s"] / one["agents"]["steps_per_s"]
    race_ratio = many["race"]["requests_per_s"] / one["race"]["requests_per_s"]
    name = "multi_gpu-" + ("tiny" if tiny else args.model_size)
    write_result(name, {
        "benchmark": "multi_gpu", "model_size": "tiny" if tiny else args.model_size,
        **run_metadata(command_line()),
        "data": "mini-swe-agent trajectories (as agent_replay) and " + RACE_SOURCE + " (as short_passages)",
        "settings": {**where, **load_info, "group": group_load, **settings,
                     "agents": "16 agents on one engine, 16 per engine on the group; steps/s of all together",
                     "race": "closed loop: each client awaits its request, then starts the next"},
        "one_engine": one,
        "group": many,
        "ratios": {"agent_steps_per_s": agents_ratio, "race_requests_per_s": race_ratio},
        "targets_for": "2 GPUs",
        "targets": {"agent_steps_per_s_ratio": target(agents_ratio, TARGET_RATIO, "min"),
                    "race_requests_per_s_ratio": target(race_ratio, TARGET_RATIO, "min"),
                    "sessions_kept_their_device": target(float(many["agents"]["sessions_kept_their_device"]), 1.0,
                                                         "min")},
    })


if __name__ == "__main__":
    main()
