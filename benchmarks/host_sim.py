"""The engine's host path under closed-loop clients, on CPU, with a modeled device: where host threads stall.

    PYTHONPATH=$PWD python benchmarks/host_sim.py [--clients 8,32,64] [--switch-interval 0.005] [--passes 2]

Everything a CUDA engine does on the host runs as it does there: the real Qwen3.5 tokenizer and chat template,
rendering, the round loop and its threads, admission, planning and the staging of every round into a graph
capacity's staging arrays (`stage_into`, two buffers in rotation). Only the device is modeled: a launched round
completes `placeholder(T) + 0.9 ms per 1,000 real tokens` after the previous one (the 0.8B H200 replay times of each
capacity's one-token placeholder, `2026-12-01-ladder-rungs-h200.json`, plus the real tokens' share: a RACE
passage 3.2 ms, a 2,165-token Q = 4 ask 7.8 ms, as measured), and waiting for it sleeps without the GIL (a CUDA
event wait spins without it). The tiny random model stands behind the engine (no forward runs). Runs
short_passages' lone phase and its closed loops, and reports, per client count, the request rate and the
round thread's per-round staging wall time against its CPU time: staging that waits far longer than it
computes is a thread waiting for the GIL. `--switch-interval` sets `sys.setswitchinterval` for the run (the
interpreter's default is 0.005 s).

On this repository's CPU VM (the engine of 9507bb1, `2026-12-01-host_sim-cpu.json`) it reproduced the H200's
8-client rates (291 / 303 requests/s against 261-388 there) and their staging waits (1.7-3.1 ms a round for
0.6 ms of CPU, against 1.3-5.0 for 0.9): the round thread waits for the GIL while the asking thread prepares
resumed clients' asks (a convoy, up to the switch interval). With a 0.5 ms switch interval: 394 / 434 requests/s
at 8 clients, 551 / 557 at 32 (488 / 521 at the default), 599 / 601 at 64 (595 / 598), the lone latency alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import command_line, race_requests, run_metadata, write_result
from benchmarks.host_path import real_engine_parts
from benchmarks.short_passages import Passages, closed_loop, lone
from flide_sdk.device.graphs import BUFFERS, Launch, StagingLayout
from flide_sdk.plan.capacity import Capacity, capacity_ladder, choose, stage_into
from flide_sdk.plan.layout import RoundPlan, StateRows

DEVICE_MS_PER_1K_TOKENS = 0.9  # a round's real tokens' share of its replay, on top of its capacity's placeholder


def placeholder_ms() -> dict[int, float]:
    """Replay ms of each capacity's one-token placeholder on the H200 (0.8B); rungs measured only on real rounds
    (544, 2,240) sit between their neighbours."""
    path = Path(__file__).parent / "results" / "2026-12-01-ladder-rungs-h200.json"
    measured = {int(tokens): times[0] for tokens, times in json.loads(path.read_text())["placeholder_replay_ms"].items()}
    return {**measured, 544: (measured[512] + measured[576]) / 2, 2240: (measured[2176] + measured[2304]) / 2}


class ModeledLaunch(Launch):
    """A launched round that is done at `done_at` (time.perf_counter())."""

    def __init__(self, probabilities: np.ndarray, capacity: Capacity, host_seconds: dict[str, float], done_at: float,
                 device_seconds: float) -> None:
        super().__init__(probabilities, [], capacity, host_seconds, done_at - device_seconds)
        self.done_at, self.seconds = done_at, device_seconds

    def done(self) -> bool:
        return time.perf_counter() >= self.done_at

    def wait(self) -> np.ndarray:
        time.sleep(max(0.0, self.done_at - time.perf_counter()))
        return self._probabilities

    def device_seconds(self) -> dict[str, float]:
        return {"replay_seconds": self.seconds}


class ModeledRunner:
    """`GraphRunner.launch` on the host (capacity choice, staging into two rotating buffers) with a modeled device."""

    def __init__(self, ladder: list[Capacity], rows: StateRows, window_sink: int, kv_sink: int,
                 replay_ms: dict[int, float]) -> None:
        self.ladder, self.rows, self.window_sink, self.kv_sink, self.replay_ms = ladder, rows, window_sink, kv_sink, replay_ms
        layouts = {capacity: StagingLayout(capacity) for capacity in ladder}
        flat = [np.zeros(max(layout.elements for layout in layouts.values()), np.int64) for _ in range(BUFFERS)]
        self.views = {capacity: [layout.views(buffer) for buffer in flat] for capacity, layout in layouts.items()}
        self.done = [0.0] * BUFFERS  # when the round that last used each buffer is done
        self.next = 0

    def launch(self, plan: RoundPlan) -> ModeledLaunch | None:
        capacity = choose(self.ladder, plan)
        if capacity is None:
            return None
        buffer, self.next = self.next, (self.next + 1) % BUFFERS
        started = time.perf_counter()
        time.sleep(max(0.0, self.done[buffer] - started))
        freed = time.perf_counter()
        stage_into(plan, capacity, self.views[capacity][buffer], self.window_sink, self.kv_sink, self.rows.zero)
        padded = time.perf_counter()
        seconds = (self.replay_ms[capacity.tokens] + DEVICE_MS_PER_1K_TOKENS * plan.num_real / 1000) / 1000
        done_at = max(padded, max(self.done)) + seconds
        self.done[buffer] = done_at
        probabilities = np.full((plan.num_questions, capacity.labels), 1 / capacity.labels, np.float32)
        host = {"buffer_wait_seconds": freed - started, "pad_seconds": padded - freed, "replay_call_seconds": 0.0}
        return ModeledLaunch(probabilities, capacity, host, done_at, seconds)


def run(clients: list[int], switch_interval: float) -> dict:
    """One engine with a modeled device: short_passages' lone phase and closed loops, at `switch_interval`."""
    default = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval)
    renderer, conv_kernel, engine = real_engine_parts()
    try:
        pool = engine.pool
        ladder = capacity_ladder(conv_kernel, 16384, engine.max_round_requests, renderer.max_prompt_tokens)
        runner = ModeledRunner(ladder, pool.state_rows, pool.window_sink, pool.kv_sink, placeholder_ms())
        engine._graphs = runner  # as a CUDA engine: graph capacities, launches from the asking thread when idle
        engine._loop.launch_in_caller = engine._fits_a_graph
        engine.max_round_questions, engine.max_round_pages = ladder[-1].questions, ladder[-1].pages
        supply = Passages(race_requests())

        async def measure():
            lone_result, _ = await lone(engine, supply, 10, 40)
            return lone_result, [await closed_loop(engine, supply, c, max(200, 16 * c)) for c in clients]

        lone_result, loops = asyncio.run(measure())
    finally:
        engine.close()
        sys.setswitchinterval(default)
    result = {"lone_median_ms": lone_result["latency"]["median_ms"]}
    for loop in loops:
        stages = loop["engine_stats"]["per_round_ms"]
        result[f"clients_{loop['clients']}"] = {
            "requests_per_s": loop["requests_per_s"], "asks_per_round": loop["engine_stats"]["per_round"]["asks"],
            **{key: stages[key] for key in ("submit_ms", "submit_cpu_ms", "plan_ms", "pad_ms", "launch_cpu_ms",
                                            "buffer_wait_ms", "replay_ms")},
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="8,32,64")
    parser.add_argument("--switch-interval", default="0.005", help="comma-separated seconds, each run in turn")
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    intervals = [float(s) for s in args.switch_interval.split(",")]
    passes = {str(interval): [] for interval in intervals}
    for _ in range(args.passes):
        for interval in intervals:
            passes[str(interval)].append(run(clients, interval))
            print(interval, json.dumps(passes[str(interval)][-1]), file=sys.stderr, flush=True)
    write_result("host_sim-cpu", {
        "benchmark": "host_sim", **run_metadata(command_line()),
        "settings": {"clients": clients, "device_model": f"placeholder(T) + {DEVICE_MS_PER_1K_TOKENS} ms per 1,000 "
                     "real tokens, 0.8B on the H200", "passes": args.passes},
        "by_switch_interval_s": passes,
    })


if __name__ == "__main__":
    main()
