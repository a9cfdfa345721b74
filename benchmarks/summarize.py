"""One screen of the numbers that matter from benchmark JSON files (a GPU run's $OUT, or benchmarks/results).

    python benchmarks/summarize.py $OUT            # every *.json there
    python benchmarks/summarize.py results/2026-11-30-fidelity-0.8B.json ...

Per file: the commit, then the targets (measured, target, met) of the engine benchmarks, fidelity's mean TV
lines, the per-kernel table heads of profile_round, and the timings of bench_gdn / bench_conv / attention.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _targets(data: dict[str, Any]) -> list[str]:
    return [f"  {name}: {t['measured']:.4g} (target {t['target']}, {'met' if t['met'] else 'NOT met'})"
            for name, t in data.get("targets", {}).items()]


def _fidelity(data: dict[str, Any]) -> list[str]:
    lines = [f"  {key}: mean TV {data[key]['mean_tv']:.4f}, max |dp| {data[key]['max_abs_dp']:.3g}"
             for key in data if key.endswith("_reference") and isinstance(data[key], dict)]
    lines += [f"  variant {name}: mean TV {v['mean_tv']:.4f}" for name, v in data.get("variants", {}).items()]
    return lines


def _profile(data: dict[str, Any], top: int = 8) -> list[str]:
    lines = []
    for rnd in data["rounds"]:
        kernels = ", ".join(f"{k['kernel'][:28]} {k['ms']:.2f}" for k in rnd["kernels"][:top])
        lines.append(f"  {rnd.get('round', rnd['questions'])}: {rnd['tokens']} tokens, "
                     f"{rnd['device_ms_total']:.2f} ms, {rnd.get('launches', '?')} launches; {kernels}")
    return lines


def _kernel_rounds(data: dict[str, Any]) -> list[str]:
    lines = []
    for name, rnd in data["rounds"].items():
        if "ours_ms" in rnd:  # bench_attention
            timings = {"ours": rnd["ours_ms"], "sdpa": rnd["sdpa"]["median_ms"], "rate_ratio": rnd["rate_ratio_best"]}
        elif "tunings" in rnd:  # bench_conv
            timings = {key: value["median_ms"] for key, value in rnd["tunings"].items() if "median_ms" in value}
        else:  # bench_gdn: graph-replay medians, variants unpadded / padded as the engine
            timings = {key: value["graph"]["median_ms"] for key, value in rnd.items()
                       if isinstance(value, dict) and "median_ms" in value.get("graph", {})}
            timings |= {f"{name} unpadded/padded": f"{v['graph']['median_ms']:.4g}/"
                        f"{v.get('padded_as_the_engine', {}).get('median_ms', float('nan')):.4g}"
                        + _default_alongside(v)
                        for name, v in rnd.get("variants", {}).items() if "median_ms" in v["graph"]}
        lines.append(f"  {name}: " + ", ".join(f"{key} {value if isinstance(value, str) else f'{value:.4g}'}"
                                               for key, value in timings.items()))
        lines += [f"    {who} kernels: " + ", ".join(f"{row['kernel'][:28]} {row['ms']:.4g}" for row in rows[:5])
                  for who, rows in rnd.get("kernels", {}).items()]
    return lines


def _default_alongside(variant: dict[str, Any]) -> str:
    """The default's times from the variant's own process (bench_gdn --isolate), if it ran in one."""
    default = variant.get("default_in_this_process")
    if not default:
        return ""
    return f" (default {default['graph_ms']:.4g}/{default['padded_graph_ms'] or float('nan'):.4g})"


def summarize(path: Path) -> list[str]:
    """The summary lines of one benchmark JSON file."""
    data = json.loads(path.read_text())
    lines = [f"{path.name} (commit {data.get('commit', '?')})"]
    lines += _targets(data)
    if data.get("benchmark") == "fidelity":
        lines += _fidelity(data)
    rounds = data.get("rounds")
    if isinstance(rounds, list):
        lines += _profile(data)
    elif isinstance(rounds, dict):
        lines += _kernel_rounds(data)
    lines += [f"  variant {name} FAILED (exit status {failure['exit_status']})"
              for name, failure in data.get("failed_variants", {}).items()]
    return lines


def main(arguments: list[str]) -> None:
    paths = []
    for argument in arguments or ["."]:
        path = Path(argument)
        paths += sorted(path.glob("*.json")) if path.is_dir() else [path]
    for path in paths:
        print("\n".join(summarize(path)))


if __name__ == "__main__":
    main(sys.argv[1:])
