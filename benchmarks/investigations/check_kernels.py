"""GPU correctness sweep of the forked Gated DeltaNet kernel in bf16: error vs the float32 reference per
tuning, and where non-finite values appear (trunk or branch rows, heads), for debugging on the H200.
Each tuning runs in its own process, so an illegal memory access in one cannot hide the others (its stderr
tail is reported instead).

    PYTHONPATH=$PWD python benchmarks/investigations/check_kernels.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import numpy as np
import torch

from benchmarks.common import write_result
from flide_sdk.kernels.gated_delta import GATED_DELTA, gated_delta_triton
from flide_sdk.kernels.reference import gated_delta_reference
from flide_sdk.plan.layout import RequestSpec, plan_round

CONFIGS = [  # the default, then every knob value of bench_gdn's sweep (one of them crashed it at 01c9a99)
    {},
    {"store_dtype": torch.float32},
    {"sub_block": 32},
    {"sub_block": 64},
    {"prep_warps": 8},
    {"block_v": 64},
    {"block_v": 128},
    {"split_v": 1},
    {"split_v": 2},
    {"scan_warps": 8},
    {"scan_warps": 2},
    {"scan_stages": 1},
    {"scan_stages": 3},
    {"scan_stages": 2},
    {"fused_trunks": 0},
    {"fused_trunks": 64},
    {"chunk_programs": 1, "scan_programs": 1},
]


def inputs(total: int, k_heads: int, v_heads: int, dim: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k = randn(total, k_heads, dim).bfloat16(), randn(total, k_heads, dim).bfloat16()
    v = randn(total, v_heads, dim).bfloat16()
    g = -torch.nn.functional.softplus(randn(total, v_heads)) * 0.3
    beta = torch.sigmoid(randn(total, v_heads))
    return q, k, v, g, beta


def check(config: dict) -> dict:
    rng = np.random.default_rng(0)
    request = RequestSpec.of(rng.integers(0, 9, 2000), [rng.integers(0, 9, 20) for _ in range(64)], [np.array([1])] * 64)
    host = plan_round([request], 4)
    rnd = host.to("cuda")
    q, k, v, g, beta = inputs(host.num_tokens, 16, 16, 128)
    states_ref = torch.zeros(rnd.delta.num_rows, 16, 128, 128, device="cuda")
    reference = gated_delta_reference(q.float(), k.float(), v.float(), g, beta, rnd.delta, states_ref)
    states = torch.zeros_like(states_ref)
    out = gated_delta_triton(q, k, v, g, beta, rnd.delta, states, config=dataclasses.replace(GATED_DELTA, **config)).float()
    torch.cuda.synchronize()
    bad = ~torch.isfinite(out)
    diff = torch.where(bad, torch.zeros_like(out), out - reference)
    return {
        "nonfinite_outputs": int(bad.sum()),
        "nonfinite_trunk_rows": int(bad[:2000].any(dim=2).any(dim=1).sum()),
        "nonfinite_branch_rows": int(bad[2000:].any(dim=2).any(dim=1).sum()),
        "nonfinite_heads": bad.any(dim=2).any(dim=0).nonzero().flatten().tolist(),
        "nonfinite_states": int((~torch.isfinite(states)).sum()),
        "rel_err_finite_part": float(diff.norm() / reference.norm()),
        "state_rel_err": float((torch.nan_to_num(states) - states_ref).norm() / states_ref.norm()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=int, help="run one tuning in this process and print its JSON")
    args = parser.parse_args()
    if args.config is not None:
        print(json.dumps(check(CONFIGS[args.config])))
        return
    results = {}
    for index, config in enumerate(CONFIGS):
        name = ",".join(f"{key}={value}" for key, value in config.items()) or "default"
        run = subprocess.run([sys.executable, __file__, "--config", str(index)], capture_output=True, text=True,
                             check=False)
        lines = run.stdout.strip().splitlines()
        results[name] = json.loads(lines[-1]) if run.returncode == 0 and lines else {"failed": run.stderr[-600:]}
    write_result("check-gdn-bf16", {"round": "a: 2000 + 64x20, 0.8B GDN shapes", "configs": results})


if __name__ == "__main__":
    main()
