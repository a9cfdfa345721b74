"""Forked Gated DeltaNet on the H200: error against the float32 reference, time against flash-linear-attention.

    PYTHONPATH=$PWD python benchmarks/bench_gdn.py --model-size 0.8B

Rounds (issue 4): (a) one 2,000-token trunk + 64 branches of 20 tokens; (b) 32 requests of a 350-token trunk +
4 branches of 20; (c) a trunk of 500 new tokens resuming after 8,000 cached ones, from the state the float32
reference leaves after a random 8,000-token prefix, + 4 branches of 20 (no fla baseline: errors and our time
only); and a lone 2,000-token trunk + 1 branch (questions_per_state at Q = 1). Inputs are random bf16 q, k, v
with the release's GDN shapes, g = -softplus(x - 2) and beta = sigmoid(x) in float32. Reported per round:
- error: relative error (||delta|| / ||ref||) of our bf16 outputs and of the state rows the round writes,
  against `gated_delta_reference` in float32 on the same (bf16-rounded) inputs, with the default knobs and
  with the accuracy option (W, U and the q-k block stored in float32);
- time: median of CUDA-event timings of our kernel replayed in a CUDA graph (and eager), after warm-up;
- baseline: flash-linear-attention's `chunk_gated_delta_rule` on the same tokens as independent varlen
  sequences (trunk and each branch from a zero state; cu_seqlens, batch 1, [1, T, H, D], q/k L2-normalised
  in the kernel, final states out), in a CUDA graph when it captures, else eager; q and k are repeated to
  the value heads for it. Its error is measured on the trunk tokens and trunk final states, which it
  computes exactly like the reference;
- ours on the round padded as the engine replays it (`ours_padded_as_the_engine`): inputs and plan padded to
  the capacity the engine's graph ladder picks (16,384 tokens and 64 requests at most), its output on the
  real tokens against the unpadded run's; the engine's GDN time includes this padding;
- kernels: per-kernel device time of ours and of fla's chunk pipeline (torch.profiler, per call, eager),
  so the kernel that trails its counterpart shows;
- knob settings given with --variants: errors, and times unpadded and padded as the engine replays them;
  with --isolate each setting runs in a process of its own next to the default (only ours, no FLA), so
  one that faults on the device (as a sweep of 01c9a99 and the variants of e29605c did: an illegal memory
  access) is recorded as failed and the others still run;
- a greedy sweep of our tuning knobs (one knob at a time, keeping the best) unless --no-sweep.
fla is imported here only: it is the baseline, not a dependency of the package.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import (
    KERNEL_ROUNDS,
    cuda_time_ms,
    device_kernels,
    release_config,
    round_requests,
    run_metadata,
    write_result,
)
from flide_sdk.kernels.gated_delta import GATED_DELTA, gated_delta_triton
from flide_sdk.kernels.reference import gated_delta_reference
from flide_sdk.plan.capacity import capacity_ladder, choose, pad_round
from flide_sdk.plan.layout import HostRound, RequestSpec, RoundTensors, Save, StateRows, plan_round

ROUNDS = {  # q1 .. q64: questions_per_state's lone asks (~40-token questions); race_lone: short_passages' lone ask
    "q1_one_trunk_1_branch": [(2000, [20], 0)],
    **KERNEL_ROUNDS,
    "q4_one_trunk_4_branches": [(2000, [40] * 4, 0)],
    "q16_one_trunk_16_branches": [(2000, [40] * 16, 0)],
    "race_lone": [(350, [50] * 4, 0)],
}
KNOB_CHOICES = {  # first value = the kernel's default
    "sub_block": [16, 32, 64],
    "prep_warps": [4, 8],
    "block_v": [32, 64, 128],
    "split_v": [None, 1, 2],
    "scan_warps": [4, 8, 2],
    "scan_stages": [3, 2, 1],
}
PRECISE = {"store_dtype": torch.float32, "scan_warps": 8}
CONV_KERNEL = 4  # the releases' short-convolution width (plan_round's conv tables; unused by the GDN)
REPEAT = 100
DEVICE = "cuda"


def random_inputs(total: int, k_heads: int, v_heads: int, dk: int, dv: int, seed: int = 0) -> dict:
    """bf16 q, k, v and float32 g = -softplus(x - 2), beta = sigmoid(x) for `total` tokens."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE)

    return {
        "q": randn(total, k_heads, dk).bfloat16(), "k": randn(total, k_heads, dk).bfloat16(),
        "v": randn(total, v_heads, dv).bfloat16(),
        "g": -F.softplus(randn(total, v_heads) - 2.0), "beta": torch.sigmoid(randn(total, v_heads)),
    }


@dataclass
class BenchRound:
    """A benchmark round: its requests, host plan and device tensors, random inputs, fla's cu_seqlens (one
    sequence per segment, stream order), the stream rows of the trunks and the sequence index of each trunk."""

    requests: list[RequestSpec]
    host: HostRound
    rnd: RoundTensors
    inputs: dict
    cu_seqlens: torch.Tensor
    trunk_rows: torch.Tensor
    trunk_sequences: torch.Tensor


def build_round(spec, k_heads: int, v_heads: int, dk: int, dv: int) -> BenchRound:
    requests = round_requests(spec)[0]
    host = plan_round(requests, CONV_KERNEL)
    lengths = [n for trunk, branches, _ in spec for n in (trunk, *branches)]
    trunk_sequences = np.cumsum([0] + [1 + len(branches) for _, branches, _ in spec])[:-1]
    return BenchRound(
        requests=requests, host=host, rnd=host.to(DEVICE),
        inputs=random_inputs(host.num_tokens, k_heads, v_heads, dk, dv),
        cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.long, device=DEVICE),
        trunk_rows=torch.from_numpy(np.flatnonzero(host.seg_lo == host.key_lo)).to(DEVICE),
        trunk_sequences=torch.from_numpy(trunk_sequences).to(DEVICE),
    )


def write_resumed_states(requests: list[RequestSpec], states: torch.Tensor, k_heads: int, v_heads: int, dk: int,
                         dv: int) -> None:
    """Into `states`, the state each resumed trunk of the round resumes from: the float32 reference over a
    random prefix as long as its cached tokens, saved into its slot's row (the round's state rows)."""
    rows = StateRows.compact(requests)
    for request in requests:
        if request.resume is None:
            continue
        cached = request.start
        prefix = RequestSpec.of(np.zeros(cached, np.int64), [np.zeros(1, np.int64)], [np.array([1])],
                                save=Save(cached, request.resume.slot, np.arange(cached)))
        plan = plan_round([prefix], CONV_KERNEL, rows).to(DEVICE).delta
        x = random_inputs(cached + 1, k_heads, v_heads, dk, dv, seed=1 + request.resume.slot)
        gated_delta_reference(x["q"].float(), x["k"].float(), x["v"].float(), x["g"], x["beta"], plan, states)


def padded_run(host, inputs: dict, states: torch.Tensor, max_prompt_tokens: int) -> tuple[int, Callable] | None:
    """(capacity tokens, a closure running ours on the round padded as the engine's graph of that capacity
    sees it: zero input rows past the real tokens, the padded plan), or None if no graph of the engine fits."""
    capacity = choose(capacity_ladder(CONV_KERNEL, 16384, 64, max_prompt_tokens), host)
    if capacity is None:
        return None
    plan = pad_round(host, capacity, 0).to(DEVICE).delta  # zero row 0 (StateRows.compact); no sinks read
    extra = capacity.tokens - host.num_tokens
    padded = {name: torch.cat([x, x.new_zeros(extra, *x.shape[1:])]) for name, x in inputs.items()}
    return capacity.tokens, lambda **knobs: gated_delta_triton(padded["q"], padded["k"], padded["v"], padded["g"],
                                                                padded["beta"], plan, states,
                                                                config=replace(GATED_DELTA, **knobs))


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).norm() / expected.double().norm())


def graph_of(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """`fn` captured in a CUDA graph after warm-up runs on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def timed(fn: Callable[[], object]) -> dict:
    """Eager and graph-replay timings of `fn` in ms (the graph entry holds the error if capture fails)."""
    result = {"eager": cuda_time_ms(fn, warmup=5, repeat=REPEAT)}
    try:
        graph = graph_of(fn)
        result["graph"] = cuda_time_ms(graph.replay, warmup=10, repeat=REPEAT)
    except Exception as failure:  # noqa: BLE001 - a baseline that does not capture is timed eagerly only
        result["graph"] = {"error": f"{type(failure).__name__}: {str(failure)[:300]}"}
    return result


def sweep(run_ours: Callable[..., torch.Tensor], mode: str, base: dict) -> dict:
    """Greedy one-knob-at-a-time search from `base` (`mode` timings); every configuration tried, the best."""
    best_knobs: dict = dict(base)
    best_time = timed(lambda: run_ours(**base))[mode]["median_ms"]
    tried = {"base": best_time}
    for knob, choices in KNOB_CHOICES.items():
        for value in choices[1:]:
            knobs = {**best_knobs, knob: value}
            name = ",".join(f"{k}={v}" for k, v in knobs.items())
            try:
                elapsed = timed(lambda knobs=knobs: run_ours(**knobs))[mode]["median_ms"]
            except Exception as failure:  # noqa: BLE001 - an invalid tiling for this shape is reported, not fatal
                tried[name] = f"{type(failure).__name__}: {str(failure)[:200]}"
                continue
            tried[name] = elapsed
            if elapsed < best_time:
                best_knobs, best_time = knobs, elapsed
    return {"best_knobs": {k: str(v) for k, v in best_knobs.items()}, "best_ms": best_time, "tried_ms": tried}


def fla_baseline(inputs: dict, group: int, cu_seqlens: torch.Tensor) -> tuple[Callable | None, str | None]:
    """A closure running fla's chunk kernel on the round as independent sequences, or why there is none."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as failure:
        return None, f"flash-linear-attention not importable: {failure}"
    q, k = (x.repeat_interleave(group, dim=1)[None] for x in (inputs["q"], inputs["k"]))
    v, g, beta = inputs["v"][None], inputs["g"][None], inputs["beta"][None]

    def run():
        return chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                      cu_seqlens=cu_seqlens)

    return run, None


def isolated_variants(model_size: str, variants: list[dict], rounds_filter: str) -> None:
    """Each knob setting timed by a child process of this script (--variants-only), next to the default in
    that process; a child that fails is recorded with the end of its error output."""
    rounds: dict[str, dict] = {}
    failed: dict[str, dict] = {}
    child_env = {key: value for key, value in os.environ.items() if key != "OUT"}
    metadata = None
    for knobs in variants:
        key = json.dumps(knobs)
        command = [sys.executable, __file__, "--model-size", model_size, "--no-sweep", "--variants-only",
                   "--variants", json.dumps([knobs]), "--rounds", rounds_filter]
        child = subprocess.run(command, check=False, capture_output=True, text=True, env=child_env)
        if child.returncode != 0 or "{" not in child.stdout:
            failed[key] = {"exit_status": child.returncode, "stderr_tail": child.stderr[-1500:]}
            print(f"variant {key} failed: {child.stderr[-600:]}", file=sys.stderr, flush=True)
            continue
        result = json.loads(child.stdout[child.stdout.index("{"):])
        metadata = metadata or {name: result[name] for name in ("k_heads", "v_heads", "dk", "dv")}
        for name, entry in result["rounds"].items():
            merged = rounds.setdefault(name, {key_: entry[key_] for key_ in ("tokens", "sequences", "chunks_per_level")})
            variant = entry["variants"][key]
            variant["default_in_this_process"] = {
                "graph_ms": entry["ours"]["graph"].get("median_ms"),
                "padded_graph_ms": entry.get("ours_padded_as_the_engine", {}).get("graph", {}).get("median_ms"),
            }
            merged.setdefault("variants", {})[key] = variant
        print(f"variant {key}: done", file=sys.stderr, flush=True)
    command = (f"python benchmarks/bench_gdn.py --model-size {model_size} --isolate --variants '{json.dumps(variants)}'"
               + (f" --rounds {rounds_filter}" if rounds_filter else ""))
    write_result(f"gdn-options-{model_size}", {
        "benchmark": "gated_delta", "model_size": model_size, **(metadata or {}), **run_metadata(command),
        "isolated": True, "rounds": rounds, "failed_variants": failed,
    })


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-size", default="0.8B")
    parser.add_argument("--no-sweep", action="store_true", help="time the default knobs only")
    parser.add_argument("--sweep-float32-storage", action="store_true",
                        help="sweep from the engine's setting (float32 W/U storage) instead of the defaults")
    parser.add_argument("--variants", type=json.loads, default=[],
                        help='JSON list of knob settings timed (with their errors) next to the default, e.g. '
                             '\'[{"sub_block": 64}, {"prep_warps": 8}]\'')
    parser.add_argument("--isolate", action="store_true", help="each variant in a process of its own")
    parser.add_argument("--variants-only", action="store_true",
                        help="time the default and the variants only (no float32 storage, no FLA, no sweep)")
    parser.add_argument("--rounds", default="", help="comma-separated names of the rounds to run (default: all)")
    args = parser.parse_args()
    if args.isolate and args.variants:
        isolated_variants(args.model_size, args.variants, args.rounds)
        return
    text = release_config(args.model_size)["text_config"]
    k_heads, v_heads = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
    results = {}
    for name, spec in ROUNDS.items():
        if args.rounds and name not in args.rounds.split(","):
            continue
        bench = build_round(spec, k_heads, v_heads, dk, dv)
        x, trunk_rows = bench.inputs, bench.trunk_rows
        plan = bench.rnd.delta
        states = torch.zeros(plan.num_rows, v_heads, dk, dv, device=DEVICE)
        write_resumed_states(bench.requests, states, k_heads, v_heads, dk, dv)
        reference_states = states.clone()
        reference = gated_delta_reference(x["q"].float(), x["k"].float(), x["v"].float(), x["g"], x["beta"], plan,
                                          reference_states)

        # both closures are called within this iteration only (no late binding)
        def run_ours(**knobs):
            return gated_delta_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], plan, states,  # noqa: B023
                                      config=replace(GATED_DELTA, **knobs))

        def errors(**knobs) -> dict:
            ours = run_ours(**knobs)
            written = slice(1, plan.num_rows)  # noqa: B023
            return {
                "output_rel_err": relative_error(ours, reference),  # noqa: B023
                "trunk_output_rel_err": relative_error(ours[trunk_rows], reference[trunk_rows]),  # noqa: B023
                "state_rel_err": relative_error(states[written], reference_states[written]),  # noqa: B023
            }

        entry = {
            "tokens": int(x["v"].shape[0]), "sequences": int(bench.cu_seqlens.numel() - 1),
            "levels": len(plan.levels), "chunks_per_level": [int(level.chunk_tokens.shape[0]) for level in plan.levels],
            "ours": {**errors(), **timed(lambda: run_ours())},
        }
        if not args.variants_only:
            # the accuracy option: W, U and the q-k block stored in float32, TF32 products in the prep's WY
            # form and in the scan
            entry["ours_float32_storage"] = {
                **errors(**PRECISE), **timed(lambda: run_ours(**PRECISE)), "knobs": str(PRECISE),
            }
        padded = padded_run(bench.host, x, states, text["max_position_embeddings"])
        if padded is not None:
            capacity_tokens, run_padded = padded
            unpadded = run_ours()
            entry["ours_padded_as_the_engine"] = {
                "capacity_tokens": capacity_tokens,
                "max_abs_diff_vs_unpadded": float((run_padded()[: unpadded.shape[0]] - unpadded).abs().max()),
                **timed(run_padded),
            }
        for knobs in args.variants:
            variant = {**errors(**knobs), **timed(lambda k=knobs: run_ours(**k))}
            if padded is not None:
                variant["padded_as_the_engine"] = timed(lambda k=knobs, run=padded[1]: run(**k))["graph"]
            entry.setdefault("variants", {})[json.dumps(knobs)] = variant
        # ratios compare CUDA-graph replays when both capture, else eager runs
        mode = "graph" if "median_ms" in entry["ours"]["graph"] else "eager"
        if args.variants_only:
            run_fla, fla_missing = None, "not run (--variants-only)"
        elif any(cached for _, _, cached in spec):
            run_fla, fla_missing = None, "a resumed trunk: fla is timed on the rounds that start from zero states"
        else:
            run_fla, fla_missing = fla_baseline(x, v_heads // k_heads, bench.cu_seqlens)
        if run_fla is None:
            entry["fla"] = {"error": fla_missing}
        else:
            fla_out, fla_states = run_fla()
            entry["fla"] = {
                "trunk_output_rel_err": relative_error(fla_out[0][trunk_rows], reference[trunk_rows]),
                "trunk_state_rel_err": relative_error(fla_states[bench.trunk_sequences], reference_states[1:1 + len(spec)]),
                "qk_heads_repeated_to_value_heads": v_heads != k_heads,
                **timed(run_fla),
            }
            mode = mode if "median_ms" in entry["fla"]["graph"] else "eager"
            entry["kernels"] = {"ours": device_kernels(run_ours, repeat=10)[0],
                                "fla": device_kernels(run_fla, repeat=10)[0]}
            entry["ratio_ours_over_fla"] = entry["ours"][mode]["median_ms"] / entry["fla"][mode]["median_ms"]
        entry["ratio_mode"] = mode
        if not (args.no_sweep or args.variants_only):
            entry["sweep"] = sweep(run_ours, mode, PRECISE if args.sweep_float32_storage else {})
            if run_fla is not None:
                entry["ratio_best_over_fla"] = entry["sweep"]["best_ms"] / entry["fla"][mode]["median_ms"]
        results[name] = entry
    flags = (f" --rounds {args.rounds}" * bool(args.rounds) + " --no-sweep" * args.no_sweep
             + " --sweep-float32-storage" * args.sweep_float32_storage
             + " --variants-only" * args.variants_only)
    if args.variants:
        flags += f" --variants '{json.dumps(args.variants)}'"
    command = f"python benchmarks/bench_gdn.py --model-size {args.model_size}{flags}"
    write_result(f"gdn{'-options' * bool(args.variants)}-{args.model_size}", {
        "benchmark": "gated_delta", "model_size": args.model_size, "k_heads": k_heads, "v_heads": v_heads,
        "dk": dk, "dv": dv, **run_metadata(command), "rounds": results,
    })


if __name__ == "__main__":
    main()
