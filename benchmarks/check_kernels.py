"""GPU correctness sweep of the forked Gated DeltaNet kernel in bf16: error vs the float32 reference per
tuning, and where non-finite values appear (which level, chunk row and head), for debugging on the H200.

    PYTHONPATH=$PWD python benchmarks/check_kernels.py
"""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.common import write_result
from flide_sdk.kernels.gated_delta import gated_delta_reference, gated_delta_triton
from flide_sdk.layout import RequestSpec, plan_round

CONFIGS = [
    {},
    {"scan_stages": 1},
    {"prep_warps": 4, "block_v": 64, "split_v": 2, "scan_stages": 1},
    {"store_dtype": torch.float32},
    {"sub_block": 32},
    {"scan_warps": 8},
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


def main() -> None:
    rng = np.random.default_rng(0)
    request = RequestSpec(rng.integers(0, 9, 2000), [rng.integers(0, 9, 20) for _ in range(64)], [np.array([1])] * 64)
    host = plan_round([request], 4)
    rnd = host.to("cuda")
    q, k, v, g, beta = inputs(host.num_tokens, 16, 16, 128)
    states_ref = torch.zeros(rnd.delta.num_rows, 16, 128, 128, device="cuda")
    reference = gated_delta_reference(q.float(), k.float(), v.float(), g, beta, rnd.delta, states_ref)
    trunk = slice(0, 2000)
    results = {}
    for config in CONFIGS:
        name = ",".join(f"{key}={value}" for key, value in config.items()) or "default"
        states = torch.zeros_like(states_ref)
        try:
            out = gated_delta_triton(q, k, v, g, beta, rnd.delta, states, **config).float()
        except Exception as failure:
            results[name] = {"error": str(failure)[:300]}
            continue
        bad = ~torch.isfinite(out)
        entry = {
            "nonfinite_outputs": int(bad.sum()),
            "nonfinite_trunk_rows": int(bad[trunk].any(dim=(1, 2)).sum()),
            "nonfinite_branch_rows": int(bad[2000:].any(dim=(1, 2)).sum()),
            "first_bad_row": int(bad.any(dim=(1, 2)).nonzero()[0]) if bad.any() else -1,
            "nonfinite_heads": sorted(set(bad.any(dim=(0, 2)).nonzero().flatten().tolist())),
            "nonfinite_states": int((~torch.isfinite(states)).sum()),
        }
        finite = torch.isfinite(out)
        diff = torch.where(finite, out - reference, torch.zeros_like(out))
        entry["rel_err_finite_part"] = float(diff.norm() / reference.norm())
        entry["state_rel_err"] = float((torch.nan_to_num(states) - states_ref).norm() / states_ref.norm())
        results[name] = entry
    write_result("check-gdn-bf16", {"round": "a: 2000 + 64x20, 0.8B GDN shapes", "configs": results})


if __name__ == "__main__":
    main()
