"""Indexed short convolution on the H200: time of each tuning against the memory-bound floor, and the
window save, on the rounds the end-to-end benchmarks run.

    PYTHONPATH=$PWD python benchmarks/bench_conv.py --model-size 0.8B

Rounds: one 2,000-token trunk + 1 branch of 40 tokens (questions_per_state, Q = 1), the same trunk + 64
branches of 40, and 64 requests of a 350-token trunk + 4 branches of 20 (short_passages at 64 clients).
Inputs are random bf16 [T, C] with the release's conv channels (2 Hk Dk + Hv Dv), the weights float32 and
tap-major as the engine keeps them. Per tuning (tokens and
channels per program, warps): the median time of a CUDA-graph replay and the effective bandwidth of one read
and one write of x, next to the H200's 4.8 TB/s; the output must equal the default tuning's.
Errors (the kernel rounds of issue 4, `KERNEL_ROUNDS`: (a), (b) and (c), whose trunk resumes after 8,000
cached tokens and so reads its checkpoint's window): the relative error of the bf16 kernel (float32 sums,
bf16 output) against `indexed_conv_reference` in float32 on the same bf16 inputs, weights and windows.
"""

from __future__ import annotations

import argparse
import functools

import numpy as np
import torch

from benchmarks.common import KERNEL_ROUNDS, cuda_time_ms, release_config, round_requests, run_metadata, write_result
from flide_sdk.kernels.reference import indexed_conv_reference
from flide_sdk.kernels.short_conv import indexed_conv_triton, save_windows_triton
from flide_sdk.plan.layout import RequestSpec, Save, plan_round

ROUNDS = {
    "q1_one_trunk_1_branch": [(2000, [40])],
    "one_trunk_64_branches": [(2000, [40] * 64)],
    "passages_64_requests": [(350, [20] * 4)] * 64,
}
# (tokens, channels per program, warps); first: the default (best or within 2% on the H200, 7117ef9 and cca1c70)
TUNINGS = [(16, 128, 4), (32, 128, 4), (32, 128, 8), (32, 64, 4), (8, 256, 4), (16, 256, 8), (64, 128, 8)]
PEAK_BYTES_PER_S = 4.8e12
DEVICE = "cuda"


def graph_time(fn) -> dict[str, float]:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_time_ms(graph.replay, warmup=5, repeat=100)


def errors(channels: int, kernel: int) -> dict[str, dict]:
    """Relative error of the bf16 kernel against the float32 reference on each kernel round."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE).bfloat16()

    found = {}
    for name, spec in KERNEL_ROUNDS.items():
        requests, _ = round_requests(spec)
        rnd = plan_round(requests, kernel).to(DEVICE)
        x, weight = randn(rnd.ids.shape[0], channels), randn(kernel, channels).float().t()  # as the engine's
        arena = randn(len(spec), kernel - 1, channels)  # request i's checkpoint window in slot i
        slots = rnd.checkpoint.resume_slots
        reference = indexed_conv_reference(x.float(), arena.float(), slots, weight.float(), rnd.conv_src)
        found[name] = {"tokens": int(x.shape[0]), "resumed_windows": int(slots.numel())}
        ours = indexed_conv_triton(x, arena, slots, weight, rnd.conv_src).float()
        found[name]["relative_error_bf16_vs_fp32"] = float((ours - reference).norm() / reference.norm())
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-size", default="0.8B")
    args = parser.parse_args()
    text = release_config(args.model_size)["text_config"]
    channels = 2 * text["linear_num_key_heads"] * text["linear_key_head_dim"] + (
        text["linear_num_value_heads"] * text["linear_value_head_dim"])
    kernel = text["linear_conv_kernel_dim"]
    rng = np.random.default_rng(0)
    results = {}
    for name, spec in ROUNDS.items():
        requests = [RequestSpec.of(rng.integers(0, 100, trunk), [rng.integers(0, 100, b) for b in branches],
                                   [np.array([1])] * len(branches), save=Save(trunk, slot, np.arange(trunk)))
                    for slot, (trunk, branches) in enumerate(spec)]
        rnd = plan_round(requests, kernel).to(DEVICE)
        total = rnd.ids.shape[0]
        x = torch.randn(total, channels, device=DEVICE, dtype=torch.bfloat16)
        # the engine's weights: float32, tap-major ([K, C] storage read as [C, K], `GatedDeltaNet.conv_weight`)
        weight = torch.randn(kernel, channels, device=DEVICE).t()
        arena = torch.zeros(len(spec) + 1, kernel - 1, channels, device=DEVICE, dtype=torch.bfloat16)
        plan = rnd.checkpoint
        reference = indexed_conv_triton(x, arena, plan.resume_slots, weight, rnd.conv_src)
        floor_ms = 1000 * 2 * x.numel() * x.element_size() / PEAK_BYTES_PER_S
        tunings = {}
        for block_t, block_c, warps in TUNINGS:
            run = functools.partial(indexed_conv_triton, x, arena, plan.resume_slots, weight, rnd.conv_src,
                                    block_t=block_t, block_c=block_c, num_warps=warps)
            got = run()
            timing = graph_time(run)
            tunings[f"t{block_t}_c{block_c}_w{warps}"] = {
                **timing, "equal_to_default": bool(torch.equal(got, reference)),
                "max_abs_diff_vs_default": float((got.float() - reference.float()).abs().max()),
                "floor_fraction": floor_ms / timing["median_ms"]}
        save = graph_time(functools.partial(save_windows_triton, x, arena, plan.resume_slots, plan.save_slots,
                                            plan.save_window_src))
        best = min(tunings, key=lambda key: tunings[key]["median_ms"])
        results[name] = {"tokens": total, "channels": channels, "floor_ms": floor_ms, "tunings": tunings,
                         "best": best, "save_windows": save, "saves": int(plan.save_slots.shape[0])}
    write_result(f"conv-{args.model_size}", {
        "benchmark": "indexed_conv", "model_size": args.model_size,
        **run_metadata(f"python benchmarks/bench_conv.py --model-size {args.model_size}"),
        "rounds": results, "errors": errors(channels, kernel),
    })


if __name__ == "__main__":
    main()
