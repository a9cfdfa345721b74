"""Start-up: a fresh process to its first answer, on an empty Triton cache with and without a kernel bundle and on
a warm cache, and the device memory the engine takes.

    PYTHONPATH=$PWD python benchmarks/startup.py --model-size 0.8B
    PYTHONPATH=$PWD python benchmarks/startup.py --tiny          (CPU smoke test: graphs off, no bundle)

The parent builds the random real-shape checkpoint once, then launches child Pythons (this script with
--child) one after another. Each child imports torch and flide_sdk, loads the engine (graphs captured in the
background, serving meanwhile), records the device memory the engine holds before any ask, asks one yes/no
question about a RACE passage, then a second about another, waits for every graph, and prints its timings as
JSON. The parent records the wall time from launch to the child's first answer. Runs, in order: "cold" (an
empty Triton cache, no bundle: every kernel compiles), "warm" (the cache the cold run filled), then the bundle
is built by `python -m flide_sdk bundle build` (timed) and "bundle" runs on an empty Triton cache with
that bundle in the bundle directory.
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
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.init()
        free_before, _ = torch.cuda.mem_get_info()
    engine = fl.Engine.load(args.checkpoint, device=args.device, dtype=args.dtype, graphs=args.graphs == "on")
    loaded = time.perf_counter()
    engine_memory = free_before - torch.cuda.mem_get_info()[0] if cuda else None
    memory_after_load = engine.info()["memory_bytes"]
    states = json.loads(Path(args.states).read_text())
    first = engine.ask_sync(states[0], QUESTION)
    answered = time.perf_counter()
    answered_at = time.time()
    engine.ask_sync(states[1], QUESTION)
    second = time.perf_counter()
    engine.wait_for_graphs()
    graphs_ready = time.perf_counter()
    stats = engine.stats()
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
        "engine_device_memory_after_load_bytes": engine_memory,
        "memory_split_after_load": memory_after_load,
        "memory_split_after_graphs": engine.info()["memory_bytes"],
        "kernel_bundle": engine.info()["kernel_bundle"],
        "first_answer_ready_seconds": stats.get("first_answer_ready_seconds"),
        "pool_capacity_bytes": stats.get("pool_capacity_bytes"),
        "max_memory_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "memory_reserved_bytes": torch.cuda.memory_reserved() if cuda else None,
        "device_memory_in_use_bytes": (total - free) if cuda else None,
        "eager_runs": stats.get("eager_runs"), "graph_replays": stats.get("graph_replays"),
        "stats": stats,
    }
    engine.close()
    print(MARK + json.dumps(result, default=float), flush=True)


def launch(args, checkpoint: Path, where: dict, states: Path, graphs: bool, triton_cache: Path, bundles: Path) -> dict:
    """One fresh child process (Triton cache `triton_cache`, bundle directory under `bundles`); its JSON plus the
    parent's wall times."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--checkpoint", str(checkpoint),
               "--device", where["device"], "--dtype", where["dtype"], "--graphs", "on" if graphs else "off",
               "--states", str(states)]
    env = {**os.environ, "TRITON_CACHE_DIR": str(triton_cache), "FLIDE_SDK_CACHE": str(bundles)}
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


GIB = 1 << 30


def startup_targets(runs: list[dict], model_size: str) -> dict[str, dict]:
    """Issue 31's bars, from the runs: first answers by setting, graph memory, the engine's memory after load (at
    0.8B; at 4B only the first answer with a bundle)."""
    from benchmarks.common import target

    by_run = {run["run"]: run for run in runs if not run.get("failed")}
    first = {label: by_run.get(label, {}).get("launch_to_first_answer_seconds") for label in ("bundle", "cold", "warm")}
    if model_size == "4B":
        return {"first_answer_seconds_with_bundle": target(first["bundle"], 25.0)}
    warm = by_run.get("warm", {})
    split = warm.get("memory_split_after_load") or {}
    after_load = warm.get("engine_device_memory_after_load_bytes")
    return {
        "first_answer_seconds_with_bundle": target(first["bundle"], 15.0),
        "first_answer_seconds_without_bundle": target(first["cold"], 30.0),
        "first_answer_seconds_warm_cache": target(first["warm"], 8.0),
        "graph_memory_gib": target(None if warm.get("graph_memory_bytes") is None else warm["graph_memory_bytes"] / GIB,
                                   2.0),
        "engine_memory_after_load_over_weights_gib": target(
            None if after_load is None or not split else (after_load - split["weights_bytes"]) / GIB, 3.0),
    }


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
    graphs = not args.tiny
    runs = []

    def run(label: str, cache: Path, bundles: Path) -> None:
        result = launch(args, checkpoint, where, states, graphs, cache, bundles)
        runs.append({"run": label, **result})
        print(f"{label}: {result.get('launch_to_first_answer_seconds', 'failed')} s to the first answer",
              file=sys.stderr)

    no_bundles = work / "sdk-empty"
    run("cold", work / "triton-cold", no_bundles)
    run("warm", work / "triton-cold", no_bundles)
    bundle_build = None
    if graphs:
        bundles = work / "sdk-bundle"
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "flide_sdk", "bundle", "build", str(checkpoint)],
                              env={**os.environ, "FLIDE_SDK_CACHE": str(bundles)}, capture_output=True, text=True,
                              timeout=args.child_timeout, check=False)
        files = sorted((bundles / "kernels").glob("*.tar"))
        bundle_build = {"seconds": time.perf_counter() - started, "returncode": done.returncode,
                        "bundle": files[0].name if files else None,
                        "bundle_bytes": files[0].stat().st_size if files else None, "stderr_tail": done.stderr[-1500:]}
        print(f"bundle build: {bundle_build['seconds']:.1f} s, {bundle_build['bundle']}", file=sys.stderr)
        run("bundle", work / "triton-bundle", bundles)
    summary = {
        r["run"]: {
            key: r.get(key) for key in ("launch_to_first_answer_seconds", "import_seconds", "load_seconds",
                                        "first_answer_seconds", "first_answer_ready_seconds", "second_answer_ms",
                                        "graphs_ready_seconds", "capture_seconds", "graphs_captured", "eager_runs",
                                        "engine_device_memory_after_load_bytes", "max_memory_allocated_bytes",
                                        "graph_memory_bytes", "kernel_bundle", "failed")
        } for r in runs
    }
    name = "startup-" + ("tiny" if args.tiny else args.model_size)
    write_result(name, {
        "benchmark": "startup", "model_size": "tiny" if args.tiny else args.model_size,
        **run_metadata(command_line()),
        "data": f"{RACE_SOURCE}: the first two passages, one yes/no question each",
        "settings": {**where, "graphs": graphs,
                     "child": "fresh `python benchmarks/startup.py --child`: import torch + flide_sdk, Engine.load, "
                              "ask_sync twice, wait_for_graphs; TRITON_CACHE_DIR empty for cold and bundle, the cold "
                              "run's for warm; FLIDE_SDK_CACHE empty except for bundle"},
        "bundle_build": bundle_build,
        "targets": {} if args.tiny else startup_targets(runs, args.model_size),
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
