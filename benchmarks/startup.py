"""Start-up: a fresh process to its first answer, with and without CUDA graphs, and the device memory it takes.

    PYTHONPATH=$PWD python benchmarks/startup.py --model-size 0.8B
    PYTHONPATH=$PWD python benchmarks/startup.py --tiny          (CPU smoke test: graphs=False only)

The parent builds the random real-shape checkpoint once, then launches child Pythons (this script with
--child) one after another. Each child imports torch and flide_sdk, loads the engine (graphs=True captures
the CUDA-graph ladder in the background, serving meanwhile), asks one yes/no question about a RACE passage,
then a second about another, waits for every graph, and prints its timings as JSON: import, load, first and
second answer, all graphs ready, capture (`stats()["capture_seconds"]`), peak device memory
(`torch.cuda.max_memory_allocated`) and graph memory (stats). The
parent records the wall time from launch to the child's first answer and to its exit. Each setting runs
twice: first with an empty Triton cache (the kernels compile: a cold machine), then with the cache the
first run filled (a warm one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.time()  # before torch: the child's interpreter start is launch -> here (stdlib imports included)

MARK = "STARTUP-RESULT "
QUESTION = {"story": {"type": "noul", "instructions": "Is this text a story?"}}


def child(args) -> None:
    """Runs in the fresh process: import, load, first answer; prints one JSON line."""
    began = time.perf_counter()
    import torch

    import flide_sdk as fl

    imported = time.perf_counter()
    engine = fl.Engine.load(args.checkpoint, device=args.device, dtype=args.dtype, graphs=args.graphs == "on")
    loaded = time.perf_counter()
    states = json.loads(Path(args.states).read_text())
    first = engine.ask_sync(states[0], QUESTION)
    answered = time.perf_counter()
    answered_at = time.time()
    engine.ask_sync(states[1], QUESTION)
    second = time.perf_counter()
    engine.wait_for_graphs()
    graphs_ready = time.perf_counter()
    stats = engine.stats()
    cuda = args.device == "cuda"
    free, total = torch.cuda.mem_get_info() if cuda else (None, None)
    result = {
        "interpreter_seconds": STARTED - args.launched_at,
        "import_seconds": imported - began,
        "load_seconds": loaded - imported,
        "capture_seconds": stats.get("capture_seconds"),
        "load_without_capture_seconds": loaded - imported - (stats.get("capture_seconds") or 0.0),
        "first_answer_seconds": answered - loaded,
        "graphs_ready_seconds": graphs_ready - imported,
        "second_answer_ms": 1000.0 * (second - answered),
        "launch_to_first_answer_seconds": answered_at - args.launched_at,
        "first_answer": first["story"].noul,
        "graphs_captured": stats.get("graphs_captured"),
        "graph_memory_bytes": stats.get("graph_memory_bytes"),
        "pool_capacity_bytes": stats.get("pool_capacity_bytes"),
        "max_memory_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "memory_reserved_bytes": torch.cuda.memory_reserved() if cuda else None,
        "device_memory_in_use_bytes": (total - free) if cuda else None,
        "eager_runs": stats.get("eager_runs"), "graph_replays": stats.get("graph_replays"),
        "stats": stats,
    }
    engine.close()
    print(MARK + json.dumps(result, default=float), flush=True)


def launch(args, checkpoint: Path, where: dict, states: Path, graphs: bool, triton_cache: Path) -> dict:
    """One fresh child process; its JSON plus the parent's wall times."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--checkpoint", str(checkpoint),
               "--device", where["device"], "--dtype", where["dtype"], "--graphs", "on" if graphs else "off",
               "--states", str(states)]
    env = {**os.environ, "TRITON_CACHE_DIR": str(triton_cache)}
    launched_at = time.time()
    started = time.perf_counter()
    done = subprocess.run([*command, "--launched-at", repr(launched_at)], env=env, capture_output=True, text=True,
                          timeout=args.child_timeout, check=False)
    wall = time.perf_counter() - started
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        return {"graphs": graphs, "failed": True, "returncode": done.returncode, "stderr_tail": done.stderr[-2000:],
                "launch_to_exit_seconds": wall}
    return {"graphs": graphs, "launch_to_exit_seconds": wall, **json.loads(lines[-1][len(MARK):])}


def parent(args) -> None:
    from benchmarks.common import (
        RACE_SOURCE,
        bench_checkpoint,
        command_line,
        race_requests,
        release_device_memory,
        run_metadata,
        write_result,
    )

    checkpoint, where = bench_checkpoint(args)
    release_device_memory()
    passages = [article for article, _ in race_requests(2)]
    work = Path(tempfile.mkdtemp(prefix="flide-startup-"))
    states = work / "states.json"
    states.write_text(json.dumps(passages))
    settings = [False] if args.tiny else [True, False]
    runs = []
    for graphs in settings:
        cache = work / f"triton-cache-graphs-{graphs}"
        for temperature in ("cold", "warm"):
            run = launch(args, checkpoint, where, states, graphs, cache)
            runs.append({"triton_cache": temperature, **run})
            print(f"graphs={graphs} {temperature}: "
                  f"{run.get('launch_to_first_answer_seconds', 'failed')} s to the first answer", file=sys.stderr)
    summary = {
        f"graphs_{'on' if r['graphs'] else 'off'}_{r['triton_cache']}": {
            key: r.get(key) for key in ("launch_to_first_answer_seconds", "import_seconds", "load_seconds",
                                        "capture_seconds", "first_answer_seconds", "second_answer_ms",
                                        "graphs_ready_seconds", "graphs_captured", "eager_runs",
                                        "max_memory_allocated_bytes", "graph_memory_bytes", "failed")
        } for r in runs
    }
    name = "startup-" + ("tiny" if args.tiny else args.model_size)
    write_result(name, {
        "benchmark": "startup", "model_size": "tiny" if args.tiny else args.model_size,
        **run_metadata(command_line()),
        "data": f"{RACE_SOURCE}: the first two passages, one yes/no question each",
        "settings": {**where, "graphs_settings": settings,
                     "graphs_on_note": "not run with --tiny: CUDA graphs need a CUDA device" if args.tiny else None,
                     "child": "fresh `python benchmarks/startup.py --child`: import torch + flide_sdk, Engine.load, "
                              "ask_sync twice, wait_for_graphs; TRITON_CACHE_DIR empty for the cold run, reused for the warm one"},
        "summary": summary,
        "runs": runs,
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-size", default="0.8B")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test on the tiny checkpoint (graphs off)")
    parser.add_argument("--child-timeout", type=float, default=600.0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--graphs", choices=("on", "off"), help=argparse.SUPPRESS)
    parser.add_argument("--states", help=argparse.SUPPRESS)
    parser.add_argument("--launched-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
