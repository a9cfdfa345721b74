"""ForkAttention on the H200: error against the float32 reference, and FLOP rate against flash SDPA.

    PYTHONPATH=$PWD python benchmarks/bench_attention.py --model-size 0.8B

Rounds (issue 4): (a) one 2,000-token trunk + 64 branches of 20 tokens; (b) 32 requests of a 350-token
trunk + 4 branches of 20; (c) a resumed trunk: 8,000 cached tokens + 500 new + 4 branches of 20. Only
visible query-key pairs count as work; the baseline is PyTorch's flash SDPA on ONE causal sequence with
the same number of visible pairs (so the same useful FLOPs), same heads and head dim. Also: questions_per_state's
lone Q = 1 round (2,000 + 40) and an agent step (300 new tokens + 4 x 50 after 13,000 cached). Times the
key-split settings next to the default (none: one work item per tile, as before 2026-12-01), and with
--tilings the tile shapes swept on 2026-11-30, and reports the best.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import KERNEL_ROUNDS, cuda_time_ms, release_config, round_requests, run_metadata, write_result
from flide_sdk.kernels.fork_attention import FORK_ATTENTION, ForkAttentionConfig, attention_tiles, fork_attention_triton
from flide_sdk.kernels.reference import fork_attention_reference
from flide_sdk.plan.layout import PAGE, plan_round

ROUNDS = {  # and questions_per_state's lone Q = 1 ask, and an agent step over a 13,000-token cached history
    **KERNEL_ROUNDS,
    "q1_one_trunk_1_branch": [(2000, [40], 0)],
    "d_agent_step_13000_cached": [(300, [50] * 4, 13000)],
}
DEFAULT = {"block_rows": 64, "heads_per_program": 4, "num_warps": 4, "block_keys": 32}  # the engine's tiling
TUNINGS = [  # key splits: the default, none (one work item per tile, as before 2026-12-01), smaller and larger
    DEFAULT,
    {**DEFAULT, "min_split_keys": 1 << 40},
    {**DEFAULT, "min_split_keys": 256},
    {**DEFAULT, "min_split_keys": 1024},
]
TILINGS = [  # --tilings: the tilings swept on 2026-11-30 (fd37cde's timings chose the default)
    {"block_rows": 128, "heads_per_program": 1, "num_warps": 8},
    {"block_rows": 128, "heads_per_program": 4, "num_warps": 8},
    {"block_rows": 128, "heads_per_program": 2, "num_warps": 8},
    {"block_rows": 64, "heads_per_program": 1, "num_warps": 4},
    {"block_rows": 64, "heads_per_program": 4, "num_warps": 4},
    {"block_rows": 64, "heads_per_program": 1, "num_warps": 8},
    {"block_rows": 64, "heads_per_program": 2, "num_warps": 8},
    {"block_rows": 128, "heads_per_program": 1, "num_warps": 8, "block_keys": 32},
    {"block_rows": 128, "heads_per_program": 1, "num_warps": 8, "block_keys": 32, "num_stages": 3},
    {"block_rows": 128, "heads_per_program": 2, "num_warps": 8, "block_keys": 32},
    {"block_rows": 64, "heads_per_program": 1, "num_warps": 4, "block_keys": 32},
    {"block_rows": 128, "heads_per_program": 1, "num_warps": 8, "num_stages": 1},
    # the group's 4 query heads x 32 tokens: K/V loaded once per group, and a trunk tile's masked diagonal is
    # one 32-key block (a quarter of the wasted triangle of 128-token tiles)
    {"block_rows": 128, "heads_per_program": 4, "num_warps": 8, "block_keys": 32},
]
# On sm_90 (Triton 3.6, D = 256, 2 stages unless named) every tiling takes 255 registers; 128 rows x 64 keys
# (the default before) spills 144 B in 192 KB of shared memory (one program per SM; 3 stages would need
# 256 KB), 64 rows at 8 warps spill nothing; the 32-key tilings, the default among them, are
# kernel_resources.py variants, summarised in benchmarks/README.md.


def config_of(knobs: dict) -> ForkAttentionConfig:
    """The engine's 16-bit config with a tuning's constants (`num_warps`, `num_stages`: its warps and stages)."""
    names = {"num_warps": "warps", "num_stages": "stages"}
    return dataclasses.replace(FORK_ATTENTION, **{names.get(key, key): value for key, value in knobs.items()})


def tuning_name(knobs: dict) -> str:
    name = f"rows{knobs['block_rows']}_heads{knobs['heads_per_program']}_w{knobs['num_warps']}"
    if "block_keys" in knobs:
        name += f"_keys{knobs['block_keys']}"
    if "num_stages" in knobs:
        name += f"_stages{knobs['num_stages']}"
    if "min_split_keys" in knobs:
        name += "_unsplit" if knobs["min_split_keys"] >= 1 << 40 else f"_split{knobs['min_split_keys']}"
    return name


def build_round(spec, heads: int, kv_heads: int, dim: int, device: str = "cuda"):
    requests, pages_used = round_requests(spec)
    host = plan_round(requests, 4)
    rnd = host.to(device)
    total = host.num_tokens
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    tensors = {"q": randn(total, heads, dim), "k": randn(total, kv_heads, dim), "v": randn(total, kv_heads, dim),
               "k_cache": randn(max(pages_used, 1) * PAGE, kv_heads, dim),
               "v_cache": randn(max(pages_used, 1) * PAGE, kv_heads, dim)}
    return host, rnd, tensors


def visible_pairs(host) -> int:
    """Query-key pairs the visibility rule allows, summed over every query row."""
    index = np.arange(host.num_tokens)
    own = index - host.seg_lo + 1
    context = host.ctx_hi - host.key_lo
    cached = np.array([host.plan.requests[r].start for r in host.request_of])
    return int((own + context + cached).sum())


def sdpa_baseline(pairs: int, heads: int, dim: int) -> dict:
    length = int(math.sqrt(2 * pairs))
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, heads, length, dim, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        timing = cuda_time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    return {"length": length, "pairs": length * (length + 1) // 2, **timing}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-size", default="0.8B")
    parser.add_argument("--tilings", action="store_true", help="also time the tilings swept on 2026-11-30")
    args = parser.parse_args()
    tunings = TUNINGS + TILINGS * args.tilings
    text = release_config(args.model_size)["text_config"]
    heads, kv_heads, dim = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    results = {}
    for name, spec in ROUNDS.items():
        host, rnd, t = build_round(spec, heads, kv_heads, dim)
        reference = fork_attention_reference(t["q"].float(), t["k"].float(), t["v"].float(), rnd.attention, None,
                                             t["k_cache"].float(), t["v_cache"].float())
        ours = fork_attention_triton(t["q"], t["k"], t["v"], rnd.attention, None, t["k_cache"], t["v_cache"])
        error = float((ours.float() - reference).norm() / reference.norm())
        pairs = visible_pairs(host)
        flops_per_pair = 4 * dim * heads
        timings = {}
        for knobs in tunings:
            try:
                config = config_of(knobs)
                # the work table built once, as the engine builds it once per pass for all its layers
                tiled = attention_tiles(rnd.attention, None, heads, kv_heads, dim, t["q"].dtype, config)

                def run(config=config, tiled=tiled, t=t):
                    return fork_attention_triton(t["q"], t["k"], t["v"], tiled, None, t["k_cache"], t["v_cache"],
                                                 config=config)

                timings[tuning_name(knobs)] = cuda_time_ms(run)
            except Exception as failure:  # noqa: BLE001 - a tile shape that does not fit is reported, not fatal
                timings[tuning_name(knobs)] = {"error": str(failure)[:200]}
        default = timings[tuning_name(DEFAULT)]["median_ms"]
        best_name, best = min(((k, v["median_ms"]) for k, v in timings.items() if "median_ms" in v), key=lambda kv: kv[1])
        sdpa = sdpa_baseline(pairs, heads, dim)
        ours_rate = pairs * flops_per_pair / (default * 1e-3) / 1e12
        best_rate = pairs * flops_per_pair / (best * 1e-3) / 1e12
        sdpa_rate = sdpa["pairs"] * flops_per_pair / (sdpa["median_ms"] * 1e-3) / 1e12
        results[name] = {
            "tokens": host.num_tokens, "visible_pairs": pairs, "relative_error_bf16_vs_fp32": error,
            "ours_ms": default, "ours_tflops": ours_rate, "best_tuning": best_name, "best_ms": best,
            "best_tflops": best_rate, "sdpa": sdpa, "sdpa_tflops": sdpa_rate,
            "rate_ratio_default": ours_rate / sdpa_rate, "rate_ratio_best": best_rate / sdpa_rate, "tunings": timings,
        }
    write_result(f"attention-{args.model_size}", {
        "benchmark": "fork_attention", "model_size": args.model_size, "heads": heads, "kv_heads": kv_heads,
        "head_dim": dim, **run_metadata(f"python benchmarks/bench_attention.py --model-size {args.model_size}" + " --tilings" * args.tilings),
        "rounds": results,
    })


if __name__ == "__main__":
    main()
