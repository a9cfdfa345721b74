"""The ecosystem's decision models on flide_sdk against transformers' `pipeline("decision")`, on one device.

    PYTHONPATH=$PWD python benchmarks/decision_models.py --model moe          (Qwen3.5-MoE at 35B-A3B shapes)
    PYTHONPATH=$PWD python benchmarks/decision_models.py --model moe --tiny   (CPU smoke test)
    PYTHONPATH=$PWD python benchmarks/decision_models.py --model jev          (a JEV head at Qwen3.5-4B shapes)

W1 (a unique ~2,000-token QuALITY state, Q = 1, 16, 64 yes/no questions): the lone latency (wall time of one ask,
median) and the throughput of 64 closed-loop clients (requests/s), each request about a state of its own. The
model is built in device memory from random bf16 weights with the real shapes (transformers' `Qwen3_5MoeTextConfig`
defaults are the 35B-A3B's: 40 layers, 256 experts, top-8); its 70 GB do not fit the device's disk, so no
checkpoint is written: the engine is built on the model, and the transformers model reads the same tensors. Both
render with transformers' generic decision prompt (`rendering="transformers"`), so max |dp| between them is
reported. The pipeline answers one prompt at a time, one request at a time: its 64-client throughput is its
sequential requests/s (concurrent callers only queue on the same device).

`--model jev`: a JEV decision head (24 rows, soft cap, per-type temperatures, the JEV prompt) on a Qwen3.5-4B-
shaped random base, against transformers' `JevForDecision` on the same tensors, and against flide_sdk on the
same base and prompt without the head (label logits of the same letters): the head's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import flide_sdk as fl
from benchmarks.common import (
    Phases,
    command_line,
    data_path,
    latency_stats,
    release_device_memory,
    run_metadata,
    stats_delta,
    target,
    write_result,
)
from benchmarks.questions_per_state import UniqueStates
from flide_sdk.models.checkpoint import random_state_dict
from flide_sdk.models.config import Qwen35Config
from flide_sdk.models.qwen35 import Qwen35Model
from flide_sdk.prompt import load_format
from flide_sdk.text.tokens import Tokens

Q_COUNTS = (1, 16, 64)
CLIENTS = 64
TINY_MOE = {"vocab_size": 1024, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 16, "linear_value_head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}


def moe_directory(tiny: bool) -> tuple[Path, dict[str, Any]]:
    """A checkpoint directory without weights: the MoE config.json and a tokenizer (the tiny one, or Qwen3.5's)."""
    from transformers import Qwen3_5MoeTextConfig

    path = Path(tempfile.mkdtemp(prefix="flide-moe-"))
    if tiny:
        from flide_sdk.testing import tiny_checkpoint

        source = tiny_checkpoint()
        text = Qwen3_5MoeTextConfig(**TINY_MOE, eos_token_id=json.loads((source / "config.json").read_text())[
            "eos_token_id"]).to_dict()
    else:
        source = data_path("tokenizer", "qwen3.5")
        text = Qwen3_5MoeTextConfig().to_dict()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, path / name)
    (path / "config.json").write_text(json.dumps(text))
    return path, text


JEV_LETTERS = [chr(ord("A") + i) for i in range(24)]  # single tokens in Qwen3.5's tokenizer: the no-head twin reads them
JEV_JUDGE = {"slots": {"num_slots": 24, "ranges": {"noul": [0, 2], "score": [2, 8], "choice": [8, 24]},
                       "verbalizers": JEV_LETTERS}, "softcap": 8.0, "adapter_subfolder": "adapter"}
JEV_CALIBRATION = {"per_kind": {"noul": 0.8, "choice": 1.2, "score": 1.0}}


def jev_directory(tiny: bool) -> tuple[Path, dict[str, Any]]:
    """A checkpoint directory without decoder weights: a dense config.json (Qwen3.5-4B's text config, or the tiny
    one), a tokenizer and the JEV head's judge and calibration configs (its weights are made on the device)."""
    from flide_sdk.testing import tiny_checkpoint

    path = Path(tempfile.mkdtemp(prefix="flide-jev-"))
    source = tiny_checkpoint() if tiny else data_path("tokenizer", "qwen3.5")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, path / name)
    if tiny:  # with the CUDA kernels' smallest value head, so `--tiny-device cuda` runs
        text = {**json.loads((source / "config.json").read_text()), "linear_value_head_dim": 32}
    else:
        text = {**json.loads(data_path("configs", "Qwen3.5-4B.json").read_text())["text_config"],
                "model_type": "qwen3_5_text"}
    (path / "config.json").write_text(json.dumps(text))
    (path / "judge_config.json").write_text(json.dumps(JEV_JUDGE))
    (path / "calibration.json").write_text(json.dumps(JEV_CALIBRATION))
    from safetensors.torch import save_file  # the head file the spec names; the engines' head is made on the device

    rows = JEV_JUDGE["slots"]["num_slots"]
    save_file({"proj.weight": torch.zeros(rows, text["hidden_size"]), "proj.bias": torch.zeros(rows)},
              str(path / "head.safetensors"))
    return path, text


def jev_head(model: Qwen35Model, rows: int, softcap: float | None):
    """A random JEV head for `model`, on its device in its dtype."""
    from flide_sdk.models.qwen35 import DecisionHead

    weight = model.head_weight()
    generator = torch.Generator(device=weight.device).manual_seed(1)
    head = DecisionHead(model.config.hidden_size, rows, softcap).to(weight.device)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator, device=weight.device) * 0.05)
        head.bias.copy_(torch.randn(head.bias.shape, generator=generator, device=weight.device))
    return head.to(weight.dtype)


def jev_engine(path: Path, model: Qwen35Model, head, device: str, **options: Any) -> fl.Engine:
    """The engine of the JEV model (`head` set on the model), or of its base without a head (`head` None), which
    reads the same prompt's letter labels from the language-model head."""
    import dataclasses

    from flide_sdk.models.decision import read_decision
    from flide_sdk.prompt import special_tokens_of
    from flide_sdk.prompt.chat import load_chat_template
    from flide_sdk.prompt.template import TemplateFormat

    config = model.config
    spec = read_decision(path, json.loads((path / "config.json").read_text()))
    spec = spec if head is not None else dataclasses.replace(spec, head=None)
    model.decision_head = head
    tokens = Tokens.from_checkpoint(path, config.max_position_embeddings, config.vocab_size)
    prompt = TemplateFormat(spec, tokens, load_chat_template(path), special_tokens_of(path), "decision")
    return fl.Engine(model, prompt, torch.device(device),
                     name="jev-random" if head is not None else "jev-base-random", **options)


def jev_twin(model: Qwen35Model, head, text: dict[str, Any], device: str):
    """transformers' `JevForDecision` on the engine model's tensors (its `model.*`, and the head as `proj`), with
    the decision config the pipeline reads for a head next to the weights (no adapter)."""
    from transformers import JevConfig, JevForDecision

    head_configs = {"judge_config": JEV_JUDGE, "calibration": JEV_CALIBRATION}
    config = JevConfig(text_config=text, **head_configs)
    with torch.device("meta"):
        twin = JevForDecision(config)
    state = {"model." + name: tensor for name, tensor in model.state_dict().items()
             if not name.startswith(("lm_head.", "decision_head."))}
    state["proj.weight"], state["proj.bias"] = head.weight, head.bias
    twin.load_state_dict(state, assign=True, strict=True)
    with torch.device(device):
        twin.model.rotary_emb = type(twin.model.rotary_emb)(twin.model.config)
    decision_config = JevConfig.decision_config(head_configs, text)
    decision_config.adapter = None
    twin.decision_config = decision_config
    return twin.eval()


def random_model(config: Qwen35Config, device: str, dtype: torch.dtype) -> Qwen35Model:
    """The decoder with random weights (`random_state_dict`) made on the device, fused as a loaded one is."""
    if torch.device(device).type == "cuda":
        config.check_cuda_kernels()  # as loading a checkpoint does
    with torch.device("meta"):
        model = Qwen35Model(config)
    model.load_state_dict(random_state_dict(config, seed=0, dtype=dtype, device=device), assign=True)
    model.fuse_projections()
    return model.eval()


def transformers_twin(model: Qwen35Model, text: dict[str, Any], device: str):
    """transformers' `Qwen3_5MoeForCausalLM` on the engine model's tensors (the stacked experts are its
    gate_up_proj / down_proj), with its rotary buffers made on the device."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(**text)
    with torch.device("meta"):
        twin = Qwen3_5MoeForCausalLM(config)
    state = {}
    for name, tensor in model.state_dict().items():
        if ".mlp.experts." in name:
            continue
        state[name if name == "lm_head.weight" else "model." + name] = tensor
    for index, layer in enumerate(model.layers):
        state[f"model.layers.{index}.mlp.experts.gate_up_proj"] = layer.mlp.gate_up
        state[f"model.layers.{index}.mlp.experts.down_proj"] = layer.mlp.down
    twin.load_state_dict(state, assign=True, strict=True)
    with torch.device(device):
        twin.model.rotary_emb = type(twin.model.rotary_emb)(config)
    left = [name for name, buffer in twin.named_buffers() if buffer.is_meta]
    if left:
        raise RuntimeError(f"buffers left unmade: {left}")
    return twin.eval()


@torch.inference_mode()
def grouped_vs_reference(model: Qwen35Model, tokens: int = 512) -> dict[str, float]:
    """The routed experts of layer 0 on random inputs: the grouped GEMMs (the CUDA op) against the per-expert
    reference, in the weights' dtype."""
    from flide_sdk.kernels.moe import moe_experts_grouped
    from flide_sdk.kernels.reference import moe_experts_reference

    moe = model.layers[0].mlp
    x = torch.randn(tokens, model.config.hidden_size, device=moe.down.device).to(moe.down.dtype)
    weights, experts = torch.topk(torch.softmax((x @ moe.gate.weight.T).float(), -1), moe.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    expected = moe_experts_reference(x, moe.gate_up, moe.down, experts, weights).float()
    got = moe_experts_grouped(x, moe.gate_up, moe.down, experts, weights).float()
    return {"max_abs_diff": float((got - expected).abs().max()), "mean_abs": float(expected.abs().mean())}


def questions_of(count: int) -> dict[str, dict[str, str]]:
    from benchmarks.common import STORY_QUESTIONS

    return {f"q{i}": {"type": "noul", "instructions": text} for i, text in enumerate(STORY_QUESTIONS[:count])}


async def engine_point(engine, states: UniqueStates, q: int, repeat: int, requests: int) -> dict[str, Any]:
    """Lone latency over `repeat` asks, then `requests` asks from CLIENTS closed-loop clients; each about a new state."""
    questions = questions_of(q)
    lone = [states.next() for _ in range(repeat + 2)]
    times = []
    for index, state in enumerate(lone):
        started = time.perf_counter()
        await engine.ask(state, questions)
        if index >= 2:  # two warm-up asks
            times.append(1000.0 * (time.perf_counter() - started))
    supply = iter([states.next() for _ in range(requests + CLIENTS)])
    budget = itertools.count()

    async def client() -> None:
        while next(budget) < requests:
            await engine.ask(next(supply), questions)

    await asyncio.gather(*(engine.ask(next(supply), questions) for _ in range(CLIENTS)))  # warm-up
    before = engine.stats()
    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    elapsed = time.perf_counter() - started
    return {"lone": latency_stats(times), "clients": CLIENTS, "requests": requests, "seconds": elapsed,
            "requests_per_s": requests / elapsed, "engine_stats": stats_delta(before, engine.stats())["per_round"]}


def measure(engine, label: str, states: UniqueStates, q_values: list[int], repeat: int, requests: int,
            pipeline_repeat: int, phases: Phases) -> tuple[dict[int, dict[str, Any]], dict[int, tuple[list[str], list]]]:
    """`engine_point` at each Q, and the engine's answers about `pipeline_repeat` + 1 more states per Q (for the
    pipeline to answer too: the first one is its warm-up); the engine is closed after."""
    points, kept = {}, {}
    try:
        for q in q_values:
            with phases(f"{label} Q={q}"):
                points[q] = asyncio.run(engine_point(engine, states, q, repeat, requests))
                if pipeline_repeat:
                    asked = [states.next() for _ in range(pipeline_repeat + 1)]
                    kept[q] = asked, [engine.ask_sync(state, questions_of(q)) for state in asked]
    finally:
        engine.close()
    return points, kept


def pipeline_point(decide, states: list[str], q: int, device: str) -> tuple[dict[str, Any], list[dict]]:
    """The pipeline's latency per request over `states` (the first one a warm-up) and its answers."""
    questions, times, answers = questions_of(q), [], []
    for index, state in enumerate(states):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        answers.append(decide({"state": state, "questions": questions}))
        if device == "cuda":
            torch.cuda.synchronize()
        if index:
            times.append(1000.0 * (time.perf_counter() - started))
    latency = latency_stats(times)
    return {"lone": latency, "requests_per_s": 1000.0 / latency["median_ms"]}, answers[1:]


def max_abs_dp(ours: list, theirs: list[dict]) -> float:
    return max(abs(float(a[name].noul) - float(t[name]["noul"])) for a, t in zip(ours, theirs) for name in t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["moe", "jev"], default="moe")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shapes, float32, small counts")
    parser.add_argument("--tiny-device", default="cpu", help="where --tiny runs (cuda: the CUDA ops in float32)")
    parser.add_argument("--repeat", type=int, default=None, help="lone asks per Q (default 10, tiny 2)")
    parser.add_argument("--requests", type=int, default=None, help="64-client requests per Q (default 256, tiny 70)")
    parser.add_argument("--pipeline-repeat", type=int, default=None, help="pipeline requests per Q (default 3, tiny 1)")
    parser.add_argument("--q", default=",".join(map(str, Q_COUNTS)))
    parser.add_argument("--max-round-tokens", type=int, default=None, help="the engine's (default 16384, tiny 8192)")
    parser.add_argument("--pool-gib", type=float, default=4.0,
                        help="the checkpoint pool's cap (W1's states are unique: each needs one checkpoint; 70 GB of "
                             "weights leave an H100 little room, and the pool's default cap is a share of the free "
                             "memory at start, before the rounds' activations)")
    args = parser.parse_args()
    tiny = args.tiny
    device, dtype = (args.tiny_device, torch.float32) if tiny else ("cuda", torch.bfloat16)
    repeat, requests = args.repeat or (2 if tiny else 10), args.requests or (70 if tiny else 256)
    pipeline_repeat = args.pipeline_repeat or (1 if tiny else 3)
    q_values = [int(q) for q in args.q.split(",")]
    phases = Phases()
    from transformers.pipelines import SUPPORTED_TASKS

    if "decision" not in SUPPORTED_TASKS:  # before the engine's part: the baseline is the point
        import transformers

        raise SystemExit(f"transformers {transformers.__version__} has no decision pipeline (5.2x has)")

    if args.model == "jev":
        return run_jev(args, device, dtype, repeat, requests, pipeline_repeat, q_values, phases)
    with phases("build"):
        path, text = moe_directory(tiny)
        config = Qwen35Config.from_text_config(text, moe=True)
        model = random_model(config, device, dtype)
        tokens = Tokens.from_checkpoint(path, config.max_position_embeddings, config.vocab_size)
        prompt = load_format(path, json.loads((path / "config.json").read_text()), tokens, "transformers")
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with phases("op check"):
        op_check = grouped_vs_reference(model)
        print(f"grouped vs reference: {op_check}", file=sys.stderr)
    with phases("engine start"):
        engine = fl.Engine(model, prompt, torch.device(device), graphs=device == "cuda", name="qwen3.5-moe-random",
                           max_round_tokens=args.max_round_tokens or (8192 if tiny else 16384), pool_bytes=int(args.pool_gib * 2**30))
        engine.wait_for_graphs()
        release_device_memory()  # what capture cached goes back to the driver, where the pool maps its pages
        info = engine.info()
    states = UniqueStates(tokens, 300 if tiny else 2000)
    points, kept = measure(engine, "flide_sdk", states, q_values, repeat, requests, pipeline_repeat, phases)
    results: dict[str, Any] = {f"q{q}": {"flide_sdk": points[q]} for q in q_values}
    del engine
    release_device_memory()

    with phases("pipeline load"):
        from transformers import AutoTokenizer, pipeline

        twin = transformers_twin(model, text, device)
        decide = pipeline("decision", model=twin, tokenizer=AutoTokenizer.from_pretrained(path))
    for q in q_values:
        with phases(f"pipeline Q={q}"):
            timing, theirs = pipeline_point(decide, kept[q][0], q, device)
            point = results[f"q{q}"]
            point["pipeline"] = timing
            point["lone_speedup"] = timing["lone"]["median_ms"] / point["flide_sdk"]["lone"]["median_ms"]
            point["throughput_ratio"] = point["flide_sdk"]["requests_per_s"] / timing["requests_per_s"]
            point["max_abs_dp"] = max_abs_dp(kept[q][1][1:], theirs)
    shutil.rmtree(path, ignore_errors=True)
    targets = {f"q{q}_{name}": target(results[f"q{q}"][key], 1.0, "min") for q in q_values
               for name, key in (("lone_speedup_vs_pipeline", "lone_speedup"),
                                 ("throughput_ratio_vs_pipeline", "throughput_ratio"))}
    write_result(f"decision_models_{args.model}-{'tiny' if tiny else '35B'}", {
        "benchmark": "decision_models", "model": args.model, **run_metadata(command_line()),
        "settings": {"shapes": "tiny" if tiny else "Qwen3.5-35B-A3B (transformers' Qwen3_5MoeTextConfig defaults)",
                     "device": device, "dtype": str(dtype).removeprefix("torch."), "weights_bytes": weights,
                     "q_values": q_values, "repeat": repeat, "requests": requests, "clients": CLIENTS,
                     "pipeline_repeat": pipeline_repeat, "rendering": "transformers", "pool_gib": args.pool_gib,
                     "state_tokens": {"min": min(states.lengths), "max": max(states.lengths)},
                     "transformers_experts_implementation": twin.config._experts_implementation,
                     "engine": {key: info[key] for key in ("capacities", "memory_bytes", "max_round_tokens")}},
        "targets": targets,
        "grouped_vs_reference": op_check,
        "phases_s": phases.seconds,
        "results": results,
        "summary": {key: {"flide_ms": value["flide_sdk"]["lone"]["median_ms"],
                          "pipeline_ms": value["pipeline"]["lone"]["median_ms"],
                          "lone_speedup": value["lone_speedup"],
                          "flide_rps_64": value["flide_sdk"]["requests_per_s"],
                          "pipeline_rps": value["pipeline"]["requests_per_s"],
                          "throughput_ratio": value["throughput_ratio"], "max_abs_dp": value["max_abs_dp"]}
                    for key, value in results.items()},
    })


def run_jev(args: argparse.Namespace, device: str, dtype: torch.dtype, repeat: int, requests: int,
            pipeline_repeat: int, q_values: list[int], phases: Phases) -> None:
    """The JEV model, then its base without the head, each on its own engine; then the pipeline."""
    from transformers import AutoTokenizer, pipeline

    tiny = args.tiny
    with phases("build"):
        path, text = jev_directory(tiny)
        config = Qwen35Config.from_text_config(text)
        model = random_model(config, device, dtype)
        head = jev_head(model, JEV_JUDGE["slots"]["num_slots"], JEV_JUDGE["softcap"])
        states = UniqueStates(Tokens.from_checkpoint(path, config.max_position_embeddings, config.vocab_size),
                              300 if tiny else 2000)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
    options = {"graphs": device == "cuda", "max_round_tokens": args.max_round_tokens or (8192 if tiny else 16384),
               "pool_bytes": int(args.pool_gib * 2**30)}
    results: dict[str, Any] = {f"q{q}": {} for q in q_values}
    kept: dict[int, tuple[list[str], list]] = {}
    info = {}
    for label, with_head in (("flide_sdk", True), ("flide_sdk_no_head", False)):
        with phases(f"{label} start"):
            engine = jev_engine(path, model, head if with_head else None, device, **options)
            engine.wait_for_graphs()
            release_device_memory()
            info[label] = engine.info()
        points, asked = measure(engine, label, states, q_values, repeat, requests, pipeline_repeat if with_head else 0,
                                phases)
        kept.update(asked)  # the head's answers, which the pipeline's are compared with
        for q in q_values:
            results[f"q{q}"][label] = points[q]
        del engine
        release_device_memory()
    model.decision_head = None
    with phases("pipeline load"):
        decide = pipeline("decision", model=jev_twin(model, head, text, device),
                          tokenizer=AutoTokenizer.from_pretrained(path))
    for q in q_values:
        with phases(f"pipeline Q={q}"):
            timing, theirs = pipeline_point(decide, kept[q][0], q, device)
            point = results[f"q{q}"]
            ours, base = point["flide_sdk"], point["flide_sdk_no_head"]
            point["pipeline"] = timing
            point["lone_speedup"] = timing["lone"]["median_ms"] / ours["lone"]["median_ms"]
            point["throughput_ratio"] = ours["requests_per_s"] / timing["requests_per_s"]
            point["head_lone_cost"] = ours["lone"]["median_ms"] / base["lone"]["median_ms"] - 1.0
            point["head_throughput_cost"] = 1.0 - ours["requests_per_s"] / base["requests_per_s"]
            point["max_abs_dp"] = max_abs_dp(kept[q][1][1:], theirs)
    shutil.rmtree(path, ignore_errors=True)
    targets = {f"q{q}_{name}": target(results[f"q{q}"][key], bound, kind) for q in q_values
               for name, key, bound, kind in (("lone_speedup_vs_pipeline", "lone_speedup", 1.0, "min"),
                                              ("throughput_ratio_vs_pipeline", "throughput_ratio", 1.0, "min"),
                                              ("head_lone_cost", "head_lone_cost", 0.03, "max"),
                                              ("head_throughput_cost", "head_throughput_cost", 0.03, "max"))}
    write_result(f"decision_models_jev-{'tiny' if tiny else '4B'}", {
        "benchmark": "decision_models", "model": "jev", **run_metadata(command_line()),
        "settings": {"shapes": "tiny" if tiny else "Qwen3.5-4B base, JEV head of 24 rows (softcap 8)",
                     "device": device, "dtype": str(dtype).removeprefix("torch."), "weights_bytes": weights,
                     "q_values": q_values, "repeat": repeat, "requests": requests, "clients": CLIENTS,
                     "pipeline_repeat": pipeline_repeat, "prompt": "JEV (bare-v1)", "pool_gib": args.pool_gib,
                     "state_tokens": {"min": min(states.lengths), "max": max(states.lengths)},
                     "engine": {key: info["flide_sdk"][key] for key in ("capacities", "memory_bytes",
                                                                         "max_round_tokens")}},
        "targets": targets,
        "phases_s": phases.seconds,
        "results": results,
        "summary": {key: {"flide_ms": value["flide_sdk"]["lone"]["median_ms"],
                          "no_head_ms": value["flide_sdk_no_head"]["lone"]["median_ms"],
                          "pipeline_ms": value["pipeline"]["lone"]["median_ms"],
                          "lone_speedup": value["lone_speedup"],
                          "flide_rps_64": value["flide_sdk"]["requests_per_s"],
                          "no_head_rps_64": value["flide_sdk_no_head"]["requests_per_s"],
                          "pipeline_rps": value["pipeline"]["requests_per_s"],
                          "head_lone_cost": value["head_lone_cost"],
                          "head_throughput_cost": value["head_throughput_cost"],
                          "max_abs_dp": value["max_abs_dp"]}
                    for key, value in results.items()},
    })


if __name__ == "__main__":
    main()
