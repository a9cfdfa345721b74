"""Registers, spills and shared memory of every Triton kernel a round launches, compiled for the H200 on CPU.

    PYTHONPATH=$PWD python benchmarks/investigations/kernel_resources.py [--model-size 0.8B] [--tokens 700]

No GPU needed: one real-shape round (a trunk and its branches, padded to its capacity as graph rounds are)
goes through the model with every Triton launch recorded instead of run; each distinct launch (kernel,
argument types, constexprs, warps, stages) is then compiled for sm_90 (`triton.compile`) with the
specialisation a CUDA launch would give it (16-divisible pointers and integers, integers equal to 1 made
constants: counted as plain integers before 2026-12-01, so earlier files describe kernels with a unit stride
argument as compiled with a runtime stride), and `ptxas -v` reports its registers and spills. A launch needing more shared memory than the H200 gives one block (227 KB) is
flagged: the run that would have found it on the device costs minutes of device time. Each launch also
counts its global load and store instructions by bytes per thread (`global_loads` / `global_stores`, from
the PTX): 2-byte loads of 16-bit tiles mean the compiler could not prove a row's alignment or a mask's
uniformity (the GDN output kernel's causal-masked load of its q-k block was one, until ab59aba).

Variants: the bf16 engine (the default kernels), the GDN with bf16 WY products or float32 storage, ForkAttention
tunings that bench_attention.py times, and the float32 engine (the
exactness runs). The numbers are those of the installed Triton: the GPU image runs
Triton 3.6, whose code differs from later versions; for its numbers, install it aside
(`pip install --target /tmp/t36 triton==3.6.0`) and put it first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from benchmarks.common import release_config, run_metadata, write_result
from flide_sdk.device.pool import CheckpointPool
from flide_sdk.kernels import (
    attention_front,
    fork_attention,
    gated_delta,
    gdn_front,
    gdn_gates,
    label_softmax,
    rms_norm,
    rotary,
    short_conv,
    swiglu,
)
from flide_sdk.kernels.fork_attention import FORK_ATTENTION
from flide_sdk.kernels.gated_delta import GATED_DELTA
from flide_sdk.models.ops import kernel_ops
from flide_sdk.models.qwen35 import Qwen35Config, Qwen35Model
from flide_sdk.plan.capacity import capacity_ladder, choose, pad_round
from flide_sdk.plan.layout import RequestSpec, plan_round

H200_SHARED_BYTES = 232_448  # per block, sm_90 (227 KB)
H200_MULTIPROCESSORS = 132  # what the kernels size their grids and choices by while a round is recorded
TARGET = GPUTarget("cuda", 90, 32)
MODULES = (attention_front, fork_attention, gated_delta, gdn_front, gdn_gates, label_softmax, rms_norm, rotary, short_conv,
           swiglu)
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
         torch.int32: "i32", torch.bool: "i1", torch.uint8: "u8"}


class Recorder:
    """Stands in for a launched kernel: `kernel[grid](*args, **meta)` records the launch and runs nothing."""

    def __init__(self, kernel: JITFunction) -> None:
        self.kernel = kernel
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid) -> Callable[..., None]:
        def launch(*args, **meta) -> None:
            self.launches.append((args, meta))

        return launch


def recorded_round(model_size: str, tokens: int, ops_variant: Callable, dtype: torch.dtype) -> list[tuple]:
    """(kernel, args, meta) of every Triton launch of one forward of a padded real-shape round."""
    text = release_config(model_size)["text_config"]
    config = Qwen35Config.from_text_config({**text, "model_type": "qwen3_5_text"})
    with torch.device("cpu"):
        model = Qwen35Model(config).to(dtype)
    model.fuse_projections()
    pool = CheckpointPool(config, torch.device("cpu"), dtype, 256 << 20, 8)
    rng = np.random.default_rng(0)
    trunk = rng.integers(0, 1000, tokens)
    request = RequestSpec.of(trunk, [rng.integers(0, 1000, 20)] * 4, [np.array([1, 2])] * 4)
    host = plan_round([request], config.conv_kernel, pool.state_rows, pool.kv_sink)
    capacity = choose(capacity_ladder(config.conv_kernel, 16384, 64, 262144), host)
    padded = pad_round(host, capacity, pool.window_sink)
    recorders = {}
    originals = {}
    for module in MODULES:
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and name.endswith("_kernel"):
                originals[module, name] = value
                recorders[module, name] = Recorder(value)
                setattr(module, name, recorders[module, name])
        if hasattr(module, "multiprocessors"):  # the H200's count: the launches a CUDA round makes (the fused GDN scan)
            originals[module, "multiprocessors"] = module.multiprocessors
            module.multiprocessors = lambda device: H200_MULTIPROCESSORS
    try:
        model(padded.to("cpu"), ops_variant(), pool.layer_caches())
    finally:
        for (module, name), value in originals.items():
            setattr(module, name, value)
    return [(r.kernel, args, meta) for r in recorders.values() for args, meta in r.launches]



def specialise(kernel: JITFunction, args: tuple, meta: dict) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) as a CUDA launch with these arguments would compile them."""
    names = kernel.arg_names
    constexpr_names = {p.name for p in kernel.params if p.is_constexpr}
    values = dict(zip(names, args))
    values.update({k: v for k, v in meta.items() if k in names})
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(names):
        value = values[name]
        if name in constexpr_names:
            signature[name] = "constexpr"
            constexprs[(index,)] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int) and value == 1:  # a launch makes an integer equal to 1 a constant
            signature[name] = "constexpr"
            constexprs[(index,)] = value
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: argument {name} of type {type(value).__name__}")
    options = {"num_warps": meta.get("num_warps", 4), "num_stages": meta.get("num_stages", 3)}
    return signature, constexprs, attrs, options


def resources(kernel: JITFunction, signature: dict, constexprs: dict, attrs: dict, options: dict) -> dict:
    """Registers, spill bytes and shared memory of one specialisation on sm_90."""
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=TARGET, options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp, "kernel.ptx")
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(Path(tmp, "k.o"))],
                                capture_output=True, text=True, check=True).stderr
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if f"entry function '{compiled.metadata.name}'" in line)
    own = "\n".join(lines[start:start + 4])  # the entry's properties, spills and register lines
    return {
        "global_loads": _access_widths(compiled.asm["ptx"], "ld"),
        "global_stores": _access_widths(compiled.asm["ptx"], "st"),
        "registers": _number(own, r"Used (\d+) registers"),
        "spill_store_bytes": _number(own, r"(\d+) bytes spill stores"),
        "spill_load_bytes": _number(own, r"(\d+) bytes spill loads"),
        "shared_bytes": compiled.metadata.shared,
        "fits_h200_shared": compiled.metadata.shared <= H200_SHARED_BYTES,
    }


PTX_GLOBAL_ACCESS = r"\b{op}\.global(?:\.[A-Za-z0-9_:]+?)*?(?:\.v(\d))?\.[bsuf](\d+)\s"


def _access_widths(ptx: str, op: str) -> dict[int, int]:
    """How many `op` ("ld" or "st") instructions of global memory the PTX has, by bytes per thread."""
    widths: dict[int, int] = {}
    for vector, bits in re.findall(PTX_GLOBAL_ACCESS.format(op=op), ptx):
        size = int(vector or 1) * int(bits) // 8
        widths[size] = widths.get(size, 0) + 1
    return dict(sorted(widths.items()))


def _number(text: str, pattern: str) -> int | None:
    found = re.search(pattern, text)
    return int(found.group(1)) if found else None


def _with(op: str, **knobs) -> Callable:
    """The kernel ops with one kernel's config changed (attention's tile tables built for its config too)."""
    def ops():
        base = kernel_ops()
        if op == "gated_delta":
            config = dataclasses.replace(GATED_DELTA, **knobs)
            return dataclasses.replace(base, gated_delta=functools.partial(base.gated_delta, config=config))
        config = dataclasses.replace(FORK_ATTENTION, **knobs)
        return dataclasses.replace(base, fork_attention=functools.partial(base.fork_attention, config=config),
                                   attention_tiles=functools.partial(base.attention_tiles, config=config))

    return ops


UNFUSED_ON_CUDA = {"fused_trunks": 0}  # 4-byte GDN storage never takes the fused scan on CUDA (the interpreter would)
VARIANTS = {
    "bf16 engine": (torch.bfloat16, kernel_ops),
    "bf16, GDN float32 storage": (torch.bfloat16, _with("gated_delta", store_dtype=torch.float32, **UNFUSED_ON_CUDA)),
    "bf16, GDN 2 scan stages": (torch.bfloat16, _with("gated_delta", scan_stages=2)),
    # ForkAttention tilings besides the default (64 rows = 4 heads x 16 tokens, 32-key blocks, 4 warps), each
    # given in full: rows, heads per program, keys per block, warps (and stages where not 2)
    "bf16, attention 128 rows x 1 head, 64 keys, 8 warps (default before fd37cde)": (torch.bfloat16, _with(
        "fork_attention", block_rows=128, heads_per_program=1, block_keys=64, warps=8)),
    "bf16, attention 128 rows x 1 head, 32 keys, 8 warps": (torch.bfloat16, _with(
        "fork_attention", block_rows=128, heads_per_program=1, block_keys=32, warps=8)),
    "bf16, attention 128 rows x 1 head, 32 keys, 8 warps, 3 stages": (torch.bfloat16, _with(
        "fork_attention", block_rows=128, heads_per_program=1, block_keys=32, warps=8, stages=3)),
    "bf16, attention 64 rows x 1 head, 32 keys, 4 warps": (torch.bfloat16, _with(
        "fork_attention", block_rows=64, heads_per_program=1, block_keys=32, warps=4)),
    "bf16, attention 128 rows x 1 head, 64 keys, 8 warps, 1 stage": (torch.bfloat16, _with(
        "fork_attention", block_rows=128, heads_per_program=1, block_keys=64, warps=8, stages=1)),
    "bf16, attention 4 heads x 32 tokens, 32 keys, 8 warps": (torch.bfloat16, _with(
        "fork_attention", block_rows=128, heads_per_program=4, block_keys=32, warps=8)),
    "float32 engine": (torch.float32, _with("gated_delta", **UNFUSED_ON_CUDA)),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-size", default="0.8B")
    parser.add_argument("--tokens", type=int, default=300, help="trunk tokens of the recorded round")
    parser.add_argument("--only", default="", help="the variants whose name contains this (default: all)")
    args = parser.parse_args()
    seen: dict[tuple, dict] = {}
    rows = []
    for variant, (dtype, ops_variant) in VARIANTS.items():
        if args.only not in variant:
            continue
        for kernel, launch_args, meta in recorded_round(args.model_size, args.tokens, ops_variant, dtype):
            signature, constexprs, attrs, options = specialise(kernel, launch_args, meta)
            key = (kernel.fn.__name__, tuple(signature.items()), tuple(sorted(constexprs.items())),
                   tuple(sorted(attrs)), tuple(options.items()))
            if key not in seen:
                seen[key] = resources(kernel, signature, constexprs, attrs, options)
                rows.append({"variant": variant, "kernel": kernel.fn.__name__,
                             "constexprs": {signature_name: value for (index,), value in constexprs.items()
                                            for signature_name in [kernel.arg_names[index]]},
                             **options, **seen[key]})
                flag = "" if seen[key]["fits_h200_shared"] else "  <-- exceeds the H200's shared memory"
                print(f"{variant:40s} {kernel.fn.__name__:26s} warps {options['num_warps']} stages "
                      f"{options['num_stages']}: {seen[key]['registers']} regs, spills "
                      f"{seen[key]['spill_store_bytes']} B, shared {seen[key]['shared_bytes']} B, loads by bytes "
                      f"{seen[key]['global_loads']}{flag}", flush=True)
    command = f"python benchmarks/investigations/kernel_resources.py --model-size {args.model_size} --tokens {args.tokens}" + (
        f" --only '{args.only}'" if args.only else "")
    write_result(f"kernel_resources-{args.model_size}", {
        "benchmark": "kernel_resources", "model_size": args.model_size, "target": "sm_90 (H200)",
        "compiled_with_triton": triton.__version__, **run_metadata(command),
        "over_shared_memory": [row for row in rows if not row["fits_h200_shared"]], "launches": rows,
    })


if __name__ == "__main__":
    main()
