"""GPU self-check of FP8 weights (issue 64 item 4): the tokens' quantization kernel bit-equal to its definition on
CUDA, the FP8 GEMM against its float reference, inside a CUDA graph, its time (with the kernel's quantization, with
torch's, and the GEMM alone) next to bf16's at 4B's projection shapes, and tiny engines (dense and MoE Qwen3.5) loaded with
weights="fp8" on CUDA (bf16, graphs) against the same FP8 engine on CPU in float32 and the CUDA bf16 engine.
Prints JSON (and writes it with --out).

    PYTHONPATH=$PWD python benchmarks/investigations/fp8_cuda_check.py [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import flide_sdk as fl
from flide_sdk.kernels.fp8 import fp8_linear, fp8_linear_reference, quantize_rows
from flide_sdk.kernels.fp8_quantize import quantize_rows_triton
from flide_sdk.models.checkpoint import random_state_dict, save_text_checkpoint
from flide_sdk.models.config import Qwen35Config
from flide_sdk.testing import tiny_checkpoint, tiny_config_json, write_tokenizer_files

SHAPES_4B = [(2560, 8192), (2560, 2 * 9216), (9216, 2560), (4096, 2560)]  # (K, N): fused q|k|v-like, gate|up, down, o


def op_check() -> dict:
    found = {}
    generator = torch.Generator(device="cuda").manual_seed(0)
    for tokens in (1, 7, 333, 2048):
        x = torch.randn(tokens, 1024, device="cuda", generator=generator).bfloat16()
        weight = quantize_rows(torch.randn(2048, 1024, device="cuda", generator=generator) / 32)
        got, expected = fp8_linear(x, weight).float(), fp8_linear_reference(x, weight).float()
        found[f"T{tokens}_max_rel_to_reference"] = float(((got - expected).abs().max() / expected.abs().max()))
        kernel, torch_ops = quantize_rows_triton(x * 3), quantize_rows(x * 3)
        found[f"T{tokens}_quantize_kernel_bit_equal"] = bool(
            torch.equal(kernel.scale, torch_ops.scale)
            and torch.equal(kernel.values.view(torch.uint8), torch_ops.values.view(torch.uint8)))
    x = torch.randn(333, 1024, device="cuda", generator=generator).bfloat16()
    static = x.clone()
    eager = fp8_linear(static, weight)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_linear(static, weight)
    static.copy_(x * 2)
    graph.replay()
    found["graph_replay_equals_eager"] = bool(torch.equal(captured, fp8_linear(x * 2, weight)))
    found["graph_changed_with_input"] = not bool(torch.equal(captured, eager))
    return found


def timed(fn, repeats: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def gemm_times() -> dict:
    found = {}
    for tokens in (64, 2048):
        for k, n in SHAPES_4B:
            x = torch.randn(tokens, k, device="cuda").bfloat16()
            dense = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
            weight = quantize_rows(dense)
            tokens_q = quantize_rows(x)
            found[f"T{tokens}_K{k}_N{n}"] = {
                "bf16_ms": timed(lambda x=x, dense=dense: F.linear(x, dense)),
                "fp8_ms": timed(lambda x=x, weight=weight: fp8_linear(x, weight, quantize_rows_triton)),
                "fp8_torch_quantize_ms": timed(lambda x=x, weight=weight: fp8_linear(x, weight)),
                "quantize_kernel_ms": timed(lambda x=x: quantize_rows_triton(x)),
                "fp8_gemm_only_ms": timed(lambda q=tokens_q, weight=weight: torch._scaled_mm(
                    q.values, weight.values.t(), scale_a=q.scale[:, None], scale_b=weight.scale[None, :],
                    out_dtype=torch.bfloat16)),
            }
    return found


def moe_checkpoint(path: Path) -> Path:
    tiny = tiny_checkpoint()
    base = json.loads((tiny / "config.json").read_text())
    config_json = tiny_config_json(base["vocab_size"], base["eos_token_id"], model_type="qwen3_5_moe_text",
                                   num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                                   moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                   tie_word_embeddings=False)
    config = Qwen35Config.from_text_config(config_json, moe=True)
    save_text_checkpoint(path, config_json, random_state_dict(config, seed=5))
    from tokenizers import Tokenizer

    write_tokenizer_files(path, Tokenizer.from_file(str(tiny / "tokenizer.json")))
    return path


def answers(path: Path, requests: list, **options) -> tuple[list[np.ndarray], dict]:
    async def run(engine: fl.Engine) -> list:
        return await asyncio.gather(*(engine.ask(state, questions) for state, questions in requests))

    with fl.Engine.load(path, round_deadline_ms=200, max_round_tokens=2048, **options) as engine:
        engine.wait_for_graphs()
        got = asyncio.run(run(engine))
        info = engine.info()
    values = [np.array([a.noul] if hasattr(a, "noul") else list(a.probabilities.values()))
              for response in got for a in response.values()]
    return values, {"weights": info["weights"], "weights_bytes": info["memory_bytes"]["weights_bytes"]}


def engine_check(path: Path) -> dict:
    requests = [(f"State {i}: " + "the cat sat on the mat and read a book about the sea. " * (5 + 40 * i),
                 {"story": fl.Noul("Is this a story?"), "mood": fl.Score("How calm is it?", ["calm", "tense"])})
                for i in range(3)]
    cuda8, info8 = answers(path, requests, device="cuda", dtype="bfloat16", weights="fp8")
    cpu8, _ = answers(path, requests, device="cpu", weights="fp8")
    cuda16, info16 = answers(path, requests, device="cuda", dtype="bfloat16")
    cpu32, _ = answers(path, requests, device="cpu")
    tv = lambda a, b: float(np.mean([0.5 * np.abs(x - y).sum() for x, y in zip(a, b)]))  # noqa: E731
    return {"cuda_fp8_vs_cpu_fp8_max_dp": float(max(np.abs(a - b).max() for a, b in zip(cuda8, cpu8))),
            "mean_tv_cuda_fp8_vs_cpu_fp32": tv(cuda8, cpu32), "mean_tv_cuda_bf16_vs_cpu_fp32": tv(cuda16, cpu32),
            "fp8": info8, "bf16": info16}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "op": op_check(),
              "gemm_ms": gemm_times(), "dense": engine_check(tiny_checkpoint()),
              "moe": engine_check(moe_checkpoint(Path(tempfile.mkdtemp(prefix="fp8-moe-"))))}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
