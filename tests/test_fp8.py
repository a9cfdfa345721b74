"""FP8 weights (`Engine.load(weights="fp8")`, FP8 checkpoints), float32 compute on CPU: the engine's answers are a
float reference's on the dequantized weights with the same per-token activation quantization; an FP8 checkpoint in
transformers' fine-grained layout answers as the same weights quantized at load; the projections' bytes halve
against bfloat16; options and layouts not served are typed errors."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import flide_sdk as fl
from flide_sdk.errors import CheckpointError, InvalidOptionError
from flide_sdk.kernels.fp8 import FP8, FP8_MAX, fp8_linear_reference
from flide_sdk.models.checkpoint import load_model
from flide_sdk.models.fp8 import quantized
from flide_sdk.models.ops import fp8_ops, reference_ops
from flide_sdk.prompt.chat import ChatFormat

from .conftest import answer_probabilities
from .test_exactness import mixed_requests

TOLERANCE = 1e-4  # the fp8 engine against its float reference (the same quantized operands; float32 sums)


def moe_checkpoint(tiny_path: Path, path: Path) -> Path:
    from .test_moe import save_moe

    save_moe(tiny_path, path)
    return path


def gemma_checkpoint(tiny_path: Path, path: Path) -> Path:
    from .test_gemma4 import make_gemma_checkpoint

    make_gemma_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tiny_path, tmp_path_factory):
    made: dict[str, Path] = {"dense": tiny_path}

    def get(kind: str) -> Path:
        if kind not in made:
            build = {"moe": moe_checkpoint, "gemma": gemma_checkpoint}[kind]
            made[kind] = build(tiny_path, tmp_path_factory.mktemp(f"fp8-{kind}"))
        return made[kind]

    return get


def ask_all(engine: fl.Engine, requests: list) -> list:
    async def run() -> list:
        return await asyncio.gather(*(engine.ask(state, questions) for state, questions in requests))

    return asyncio.run(run())


def probabilities(answers: list, requests: list) -> list[np.ndarray]:
    return [answer_probabilities(got[name]) for got, (_, questions) in zip(answers, requests) for name in questions]


@pytest.mark.parametrize("kind", ["dense", "moe", "gemma"])
def test_answers_are_the_dequantized_reference(checkpoints, kind):
    """The engine's FP8 GEMM (`torch._scaled_mm`, row-wise scales) against `fp8_linear_reference` (the same per-token
    quantized activations and FP8 weights, dequantized, multiplied in float32), one mixed round each; the distance
    to the unquantized float32 engine is printed, not bounded. Fails if the scaled GEMM drops or misplaces a scale
    (mutation: `scale_b=weight.scale[:, None]` or no `scale_a`), or if the engine skips quantizing a projection
    the reference quantizes."""
    path = checkpoints(kind)
    with fl.Engine.load(path, device="cpu", weights="fp8", round_deadline_ms=500) as engine:
        assert engine.info()["weights"] == "fp8"
        requests = mixed_requests(engine.tokens)
        got = probabilities(ask_all(engine, requests), requests)
    model = load_model(path, "cpu", torch.float32, weights="fp8")
    prompt = ChatFormat.from_checkpoint(path, model.config.max_position_embeddings)
    ops = fp8_ops(reference_ops, fp8_linear_reference)
    with fl.Engine(model, prompt, torch.device("cpu"), ops=ops, round_deadline_ms=500) as reference:
        expected = probabilities(ask_all(reference, requests), requests)
    worst = max(float(np.abs(g - e).max()) for g, e in zip(got, expected))
    assert worst <= TOLERANCE, f"max |dp| = {worst:.2e} against the dequantized reference"
    with fl.Engine.load(path, device="cpu", round_deadline_ms=500) as full:
        unquantized = probabilities(ask_all(full, requests), requests)
    tv = [0.5 * float(np.abs(g - u).sum()) for g, u in zip(got, unquantized)]
    print(f"\n{kind}: fp8 vs float32 weights over {len(tv)} questions: mean TV {np.mean(tv):.2e}, "
          f"max TV {max(tv):.2e}; vs its dequantized reference max |dp| {worst:.2e}")
    assert max(tv) > TOLERANCE, "the FP8 engine answers as the float32 one: nothing was quantized"


def block_quantized(weight: torch.Tensor, block: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' fine-grained FP8 of a weight [..., N, K]: per [rows, cols] block (None: per row) the largest
    |value| maps to 448; returns (float8 values, float32 scale_inv [..., ceil(N/rows), ceil(K/cols)])."""
    rows, cols = weight.shape[-2:]
    block_rows, block_cols = block if block is not None else (1, cols)
    padded = torch.zeros(*weight.shape[:-2], math.ceil(rows / block_rows) * block_rows,
                         math.ceil(cols / block_cols) * block_cols)
    padded[..., :rows, :cols] = weight
    tiles = padded.unflatten(-1, (-1, block_cols)).unflatten(-3, (-1, block_rows))  # [..., R, br, C, bc]
    scale_inv = (tiles.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp(min=1e-12)
    values = (tiles / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values.flatten(-4, -3).flatten(-2)[..., :rows, :cols].contiguous(), scale_inv


def expanded(scale_inv: torch.Tensor, block: list[int] | None, shape: torch.Size) -> torch.Tensor:
    rows, cols = shape[-2:]
    block_rows, block_cols = block if block is not None else (1, cols)
    full = scale_inv.repeat_interleave(block_rows, dim=-2).repeat_interleave(block_cols, dim=-1)
    return full[..., :rows, :cols]


def write_fp8_pair(source: Path, fp8_path: Path, float_path: Path, block: list[int] | None) -> None:
    """`source` rewritten as an FP8 checkpoint (every `*_proj.weight` of the decoder in float8 with its
    `weight_scale_inv`, the a/b gate projections too) and as the float32 checkpoint of its dequantized weights."""
    for path in (fp8_path, float_path):
        shutil.copytree(source, path)
        (path / "model.safetensors").unlink()
    tensors = load_file(str(source / "model.safetensors"))
    fp8_tensors, float_tensors = {}, {}
    for key, tensor in tensors.items():
        if key.startswith("model.layers.") and key.endswith("_proj.weight"):
            values, scale_inv = block_quantized(tensor.float(), block)
            fp8_tensors[key], fp8_tensors[key + "_scale_inv"] = values, scale_inv
            float_tensors[key] = values.float() * expanded(scale_inv, block, values.shape)
        else:
            fp8_tensors[key] = float_tensors[key] = tensor
    save_file(fp8_tensors, str(fp8_path / "model.safetensors"), metadata={"format": "pt"})
    save_file(float_tensors, str(float_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": block}
    (fp8_path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("block", [[128, 128], [32, 16], None], ids=["128x128", "32x16", "rows"])
def test_an_fp8_checkpoint_answers_as_its_weights_quantized_at_load(tiny_path, tmp_path, block):
    """An FP8 checkpoint (block scales, or one scale per row) loads as it is (weights="auto") and answers bit for
    bit as the float32 checkpoint of its dequantized weights loaded with weights="fp8". Fails if a block scale is
    read transposed or ignored (mutation: `repeat_interleave(block_cols, dim=-2)` in `models.fp8.dequantized`)."""
    fp8_path, float_path = tmp_path / "fp8", tmp_path / "float"
    write_fp8_pair(tiny_path, fp8_path, float_path, block)
    with fl.Engine.load(fp8_path, device="cpu", round_deadline_ms=500) as engine:
        assert engine.info()["weights"] == "fp8"
        requests = mixed_requests(engine.tokens)
        got = probabilities(ask_all(engine, requests), requests)
    with fl.Engine.load(float_path, device="cpu", weights="fp8", round_deadline_ms=500) as engine:
        expected = probabilities(ask_all(engine, requests), requests)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)


def test_projection_bytes_halve_against_bfloat16(tiny_path):
    """`info()["memory_bytes"]["weights_bytes"]`: each quantized projection's 2 bytes an element in bfloat16 become
    1, plus a float32 scale per row; everything else keeps its bytes. Fails if a fused projection's old copy stays
    referenced (mutation: `FusedProjections` keeping the unfused `Fp8Weight`s) or a projection stays unquantized."""
    tensors = load_file(str(tiny_path / "model.safetensors"))
    projections = [t for key, t in tensors.items() if quantized(key.removeprefix("model."))]
    elements = sum(t.numel() for t in projections)
    rows = sum(t.numel() // t.shape[-1] for t in projections)
    assert elements > 0
    with fl.Engine.load(tiny_path, device="cpu", dtype="bfloat16") as bf16:
        bf16_bytes = bf16.info()["memory_bytes"]["weights_bytes"]
    with fl.Engine.load(tiny_path, device="cpu", dtype="bfloat16", weights="fp8") as fp8:
        fp8_bytes = fp8.info()["memory_bytes"]["weights_bytes"]
    assert fp8_bytes == bf16_bytes - elements + 4 * rows


def test_options_not_served_are_typed(tiny_path):
    with pytest.raises(InvalidOptionError, match="weights must be one of"):
        fl.Engine.load(tiny_path, device="cpu", weights="int8")
    with pytest.raises(InvalidOptionError, match="FP8 weights"):
        fl.Engine.load(tiny_path, device="cpu", weights="fp8", batch_invariant=True)


def rewrite(path: Path, config: dict | None = None, drop: str | None = None, scale_shape: str | None = None) -> None:
    if config is not None:
        raw = json.loads((path / "config.json").read_text())
        raw["quantization_config"] |= config
        (path / "config.json").write_text(json.dumps(raw))
    if drop is not None or scale_shape is not None:
        tensors = load_file(str(path / "model.safetensors"))
        if drop is not None:
            del tensors[drop]
        if scale_shape is not None:
            tensors[scale_shape] = torch.ones(1, 1, 3)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


SCALE = "model.layers.0.mlp.down_proj.weight_scale_inv"


@pytest.mark.parametrize(("change", "message"), [
    ({"config": {"activation_scheme": "static"}}, "activation_scheme 'static'"),
    ({"config": {"quant_method": "gptq"}}, "quant_method 'gptq'"),
    ({"config": {"scale_fmt": "ue8m0"}}, "scale_fmt 'ue8m0'"),
    ({"config": {"weight_block_size": [128]}}, "weight_block_size"),
    ({"drop": SCALE}, "no shard holds model.layers.0.mlp.down_proj.weight_scale_inv"),
    ({"scale_shape": SCALE}, "down_proj.weight_scale_inv has shape \\(1, 1, 3\\)"),
], ids=["static", "gptq", "ue8m0", "block", "no-scale", "scale-shape"])
def test_fp8_layouts_not_served_are_checkpoint_errors(tiny_path, tmp_path, change, message):
    write_fp8_pair(tiny_path, tmp_path / "fp8", tmp_path / "float", [128, 128])
    rewrite(tmp_path / "fp8", **change)
    with pytest.raises(CheckpointError, match=message):
        fl.Engine.load(tmp_path / "fp8", device="cpu")


def test_lora_adapters_merge_before_quantizing(tiny_path, tmp_path):
    """A checkpoint with a LoRA adapter loaded with weights="fp8" answers bit for bit as its merged float32 weights
    written out and loaded with weights="fp8": the adapter is merged in float32, then quantized. Fails if the
    merge is applied to the quantized weight or skipped (mutation: `lora.merged` after `quantize_rows`)."""
    from .test_lora import build

    path, _ = build("repo", tiny_path, tmp_path)
    with fl.Engine.load(path, device="cpu") as merged:
        weights = {name: tensor.clone() for name, tensor in merged.model.state_dict().items()}
    plain = tmp_path / "merged"
    shutil.copytree(path, plain, ignore=shutil.ignore_patterns("tuned", "*.safetensors"))
    decision = json.loads((plain / "decision.json").read_text())
    del decision["adapter"]
    (plain / "decision.json").write_text(json.dumps(decision))
    save_file({"model." + name: tensor.contiguous() for name, tensor in weights.items()},
              str(plain / "model.safetensors"), metadata={"format": "pt"})
    results = []
    for checkpoint in (path, plain):
        with fl.Engine.load(checkpoint, device="cpu", weights="fp8", round_deadline_ms=500) as engine:
            requests = mixed_requests(engine.tokens)
            results.append(probabilities(ask_all(engine, requests), requests))
    for got, expected in zip(*results):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_the_token_quantization_kernel_is_bit_equal_to_its_definition(dtype):
    """`quantize_rows_triton` (the CUDA engine's, interpreted here) against `quantize_rows`: rows over six decades
    of scale, a zero row, one dominated by an outlier, a width past one block, strided rows; then every float32 step
    of a sweep over e4m3's range (ties, subnormals, signed zeros) at scale 1. Mutations caught: a plain cast to
    float8 (the interpreter rounds a carry into the next power of two down: 127.2 -> 64), the zero's sign dropped."""
    from flide_sdk.kernels.fp8 import quantize_rows
    from flide_sdk.kernels.fp8_quantize import QUANTIZE_BLOCK, quantize_rows_triton

    generator = torch.Generator().manual_seed(3)
    wide = torch.randn(7, QUANTIZE_BLOCK + 500, generator=generator) * torch.logspace(-3, 3, 7)[:, None]
    wide[3] = 0.0
    wide[4, 5] = 1e4
    x = wide.to(dtype)[:, : QUANTIZE_BLOCK + 300]  # strided rows
    sweep = torch.cat([torch.linspace(-448.0, 448.0, 200_001), torch.tensor([448.0, -0.0, 2.0**-10, 3 * 2.0**-10,
                                                                             -(2.0**-11), 0.5 + 2.0**-5])])
    for tokens in (x, sweep.to(dtype)[None, :]):
        want, got = quantize_rows(tokens), quantize_rows_triton(tokens)
        assert torch.equal(got.scale, want.scale)
        assert torch.equal(got.values.view(torch.uint8), want.values.view(torch.uint8))
