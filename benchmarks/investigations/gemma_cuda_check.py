"""GPU self-check of Gemma 4 on CUDA (issue 62): small random Gemma 4 checkpoints shaped like the releases (head
dims 256 and 512, five sliding layers to one full, proportional RoPE on a quarter of the full layers' pairs, soft
cap 30), one per feature set (E4B-like: KV-shared last layers, per-layer inputs; 31B-like: keys = values on the
full layers, window 512; 26B-A4B-like: routed experts), answered by `Engine` on CUDA in float32 and bfloat16 with
graphs on and off, in rounds mixing lone asks of states past the window, a session with a fork and a fork of the
fork asked together, and the three resumed from their checkpoints. Each answer is compared with transformers'
`Gemma4ForCausalLM` on the question's standalone prompt (float32: max |dp| <= 1e-4 expected; bfloat16 reported
against transformers in bfloat16 and in float32), and the graph engine with the eager one. Prints and writes JSON.
The tokenizer is `flide_sdk.testing`'s tiny one (the configs' vocabulary is its).

    PYTHONPATH=$PWD python benchmarks/investigations/gemma_cuda_check.py [--configs e4b_like,31b_like] [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import flide_sdk as fl
from flide_sdk.testing import tiny_checkpoint

SLIDING, FULL = "sliding_attention", "full_attention"
ROPE = {FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
        SLIDING: {"rope_type": "default", "rope_theta": 1e4}}
BASE = {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 256, "global_head_dim": 512, "rope_parameters": ROPE, "final_logit_softcapping": 30.0,
        "hidden_size_per_layer_input": 0, "max_position_embeddings": 131072, "pad_token_id": 0, "eos_token_id": 1,
        "bos_token_id": 2, "tie_word_embeddings": True}
CONFIGS = {
    # E4B: per-layer inputs, the last 6 of 12 layers reading earlier layers' keys and values
    "e4b_like": {"num_hidden_layers": 12, "layer_types": ([SLIDING] * 5 + [FULL]) * 2, "sliding_window": 128,
                 "hidden_size_per_layer_input": 64, "num_kv_shared_layers": 6},
    # 31B: full layers' values are their keys, 4 of their own kv heads; the release's sliding window halved
    "31b_like": {"num_hidden_layers": 6, "layer_types": [SLIDING] * 5 + [FULL], "sliding_window": 512,
                 "num_attention_heads": 16, "num_key_value_heads": 8, "attention_k_eq_v": True,
                 "num_global_key_value_heads": 4},
    # 26B-A4B: the dense MLP plus 8 routed experts (top 2), k = v
    "26b_a4b_like": {"num_hidden_layers": 6, "layer_types": [SLIDING] * 5 + [FULL], "sliding_window": 128,
                     "enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 128,
                     "attention_k_eq_v": True, "num_global_key_value_heads": 1},
}
QUESTIONS = {
    "stuck": fl.Noul("Is the agent stuck in a loop?"),
    "next": fl.Choice("What comes next?", {"read": "inspect code", "edit": None, "test": "run tests", "submit": None}),
    "done": fl.Score("How close to done?", ["far", "halfway", "close", "done"]),
}
WORDS = ["the", "agent", "opened", "the", "file", "read", "line", "12", "found", "an", "error", "edited", "the",
         "function", "and", "ran", "the", "tests", "again", "then", "it", "checked", "the", "refund", "total"]


def text(words: int, offset: int = 0) -> str:
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(words))


def build(name: str, target: Path, seed: int = 0) -> torch.nn.Module:
    """The checkpoint of `name` with random weights that make every part count (projections ~ N(0, 1/fan_in),
    norms near 1, layer scalars and expert scales around 1); returns transformers' float32 model of it."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    vocab = json.loads((tiny_checkpoint() / "config.json").read_text())["vocab_size"]
    config = Gemma4TextConfig(**(BASE | CONFIGS[name] | {"vocab_size": vocab, "vocab_size_per_layer_input": vocab}))
    model = Gemma4ForCausalLM(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    for parameter_name, parameter in model.named_parameters():
        shape = parameter.shape
        if "norm" in parameter_name or parameter_name.endswith("router.scale"):
            value = torch.randn(shape, generator=generator) * 0.1 + 1.0
        elif parameter_name.endswith("per_expert_scale"):
            value = torch.rand(shape, generator=generator) + 0.5
        elif "embed_tokens" in parameter_name:
            value = torch.randn(shape, generator=generator) * 2.0 / shape[-1] ** 0.5
        else:
            value = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
        parameter.data.copy_(value)
    for buffer_name, buffer in model.named_buffers():
        if buffer_name.endswith("layer_scalar"):
            buffer.data.copy_(torch.rand(buffer.shape, generator=generator) * 0.5 + 0.75)
    model.save_pretrained(target)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint() / file, target / file)
    return model


def probabilities(answers) -> np.ndarray:
    values = []
    for name in sorted(QUESTIONS):
        answer = answers[name]
        values += [answer.noul, 1 - answer.noul] if isinstance(answer, fl.NoulAnswer) else \
            list(answer.probabilities.values())
    return np.array(values)


async def workload(engine: fl.Engine, window: int) -> list[tuple[str, np.ndarray]]:
    """(state, answer probabilities) of: a round of lone asks (1 token, past the window, 4 windows), a session,
    its fork and a fork of the fork asked in one round, then each resumed with more text."""
    done: list[tuple[str, np.ndarray]] = []
    states = [text(1), text(window + 37, 3), text(4 * window, 7)]
    for state, answers in zip(states, await asyncio.gather(*(engine.ask(s, QUESTIONS) for s in states))):
        done.append((state, probabilities(answers)))
    parent = engine.session()
    texts = {"parent": text(2 * window + 11, 1)}
    parent.append(texts["parent"])
    child = parent.fork()
    child.append(" then the child " + text(window // 2, 5))
    texts["child"] = texts["parent"] + " then the child " + text(window // 2, 5)
    grandchild = child.fork()
    grandchild.append(" and the grandchild " + text(window, 9))
    texts["grandchild"] = texts["child"] + " and the grandchild " + text(window, 9)
    sessions = {"parent": parent, "child": child, "grandchild": grandchild}
    for name, answers in zip(sessions, await asyncio.gather(*(s.ask(QUESTIONS) for s in sessions.values()))):
        done.append((texts[name], probabilities(answers)))
    for name, session in sessions.items():
        addition = f" {name} again and " + text(window + 5, 2)
        session.append(addition)
        texts[name] += addition
        done.append((texts[name], probabilities(await session.ask(QUESTIONS))))
    return done


def reference(model: torch.nn.Module, engine: fl.Engine, state: str) -> np.ndarray:
    """transformers' option probabilities on each question's standalone prompt, in `probabilities`' order."""
    rendered = engine.render(state, QUESTIONS)
    values = []
    for name in sorted(QUESTIONS):
        ids = torch.as_tensor(rendered.prompt_ids(name), device="cuda")[None]
        with torch.no_grad():
            logits = model(ids).logits[0, -1].float()
        labels = torch.tensor(rendered.questions[name].label_ids, device="cuda")
        values += torch.softmax(logits[labels], dim=-1).tolist()
    return np.array(values)


def check(name: str, root: Path) -> dict:
    path = root / name
    model = build(name, path)
    window = CONFIGS[name]["sliding_window"]
    model = model.cuda()
    result: dict = {"config": BASE | CONFIGS[name]}
    for dtype in ("float32", "bfloat16"):
        runs = {}
        for graphs in (True, False):
            started = time.perf_counter()
            with fl.Engine.load(path, device="cuda", dtype=dtype, graphs=graphs) as engine:
                engine.wait_for_graphs()
                runs[graphs] = asyncio.run(workload(engine, window))
                stats = engine.stats()
                info = engine.info()
                if graphs:
                    expected32 = [reference(model, engine, state) for state, _ in runs[graphs]]
                    if dtype == "bfloat16":
                        bf16 = copy.deepcopy(model).to(torch.bfloat16)
                        expected16 = [reference(bf16, engine, state) for state, _ in runs[graphs]]
                        del bf16
            entry = {"graphs": graphs, "seconds": time.perf_counter() - started,
                     "rounds": stats.get("rounds"), "checkpoint_hits": stats.get("checkpoint_hits"),
                     "graph_replays": stats.get("graph_replays"), "eager_runs": stats.get("eager_runs"), "checkpoint_token_bytes":
                         info.get("checkpoint_token_bytes"),
                     "max_dp_vs_transformers_float32": max(float(np.abs(got - want).max()) for (_, got), want
                                                           in zip(runs[graphs], expected32))}
            if dtype == "bfloat16":
                entry["max_dp_vs_transformers_bfloat16"] = max(float(np.abs(got - want).max()) for (_, got), want
                                                               in zip(runs[graphs], expected16))
            result[f"{dtype}_{'graphs' if graphs else 'eager'}"] = entry
            print(name, dtype, json.dumps(entry), flush=True)
        result[f"{dtype}_graphs_vs_eager_max_dp"] = max(
            float(np.abs(a - b).max()) for (_, a), (_, b) in zip(runs[True], runs[False]))
    result["float32_within_1e-4"] = all(result[f"float32_{mode}"]["max_dp_vs_transformers_float32"] <= 1e-4
                                        for mode in ("graphs", "eager"))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", default="gemma_cuda_check.json")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # transformers' float32 reference in full float32
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs.split(","):
            try:
                results[name] = check(name, Path(tmp))
            except Exception as error:  # noqa: BLE001 (one config's failure must not hide the others')
                results[name] = {"error": f"{type(error).__name__}: {error}"}
                print(name, "FAILED", results[name]["error"], flush=True)
            Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps({name: {key: value for key, value in entry.items() if "max_dp" in key or "within" in key
                             or key == "error"} if isinstance(entry, dict) else entry
                      for name, entry in results.items()}, indent=1))


if __name__ == "__main__":
    main()
