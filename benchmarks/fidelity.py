"""Answer fidelity on the GPU: the bf16 engine against a float32 reference, next to transformers' own bf16.

    PYTHONPATH=$PWD python benchmarks/fidelity.py --model-size 0.8B

A random checkpoint with the real Qwen3.5 config and tokenizer is built on the GPU. Requests are real
reading data (a QuALITY article cut to ~2,000 tokens with its questions; RACE passages with theirs; each
state also gets a Noul and a Score), asked of the engine all at once so they share rounds. The reference
is transformers' Qwen3_5ForCausalLM in float32 on each question's standalone prompt (trunk + branch);
transformers in bf16 on the same prompts is the bar the engine must meet (DESIGN.md §8). Reported: mean
and p99 total variation, top-answer agreement, and flips at 0.5 for yes/no. The engine in float32 on the
GPU is also compared with the float32 reference (max |dp|: the CPU exactness contract, on CUDA).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import tempfile
from pathlib import Path

import numpy as np
import torch

import flide_sdk as fl
from benchmarks.common import build_random_checkpoint, data_path, run_metadata, write_result

OPTION = re.compile(r"\(([A-D])\)\s*(.*?)(?=\s*\([A-D]\)|$)", re.DOTALL)


def quality_request(renderer, max_tokens: int = 2000):
    record = json.loads(data_path("reading", "quality", "quality.jsonl").open().readline())
    ids = renderer._encode(record["input"])[:max_tokens]
    state = renderer.tokenizer.decode(ids.tolist())
    questions = {}
    for index, text in enumerate(record["instructions"]):
        stem, _, rest = text.partition("\n\n")
        options = {label: body.strip()[:200] for label, body in OPTION.findall(rest)}
        if len(options) >= 2:
            questions[f"q{index}"] = fl.Choice(stem.strip(), options)
    return state, questions


def race_requests(count: int):
    requests = []
    for path in sorted(data_path("reading", "race", "dev", "middle").glob("*.txt"))[:count]:
        record = json.loads(path.read_text())
        questions = {
            f"q{i}": fl.Choice(question.replace("_", "___"), dict(zip("ABCD", options)))
            for i, (question, options) in enumerate(zip(record["questions"], record["options"]))
        }
        requests.append((record["article"], questions))
    return requests


def with_common_questions(questions: dict) -> dict:
    return {
        **questions,
        "is_story": fl.Noul("Is this text a story?"),
        "difficulty": fl.Score("How hard is this text to read?", ["easy", "average", "hard", "very hard"]),
    }


def probabilities(answer) -> np.ndarray:
    if isinstance(answer, fl.NoulAnswer):
        return np.array([answer.noul, 1.0 - answer.noul])
    return np.array(list(answer.probabilities.values()), dtype=np.float64)


def hf_probabilities(model, rendered, name: str) -> np.ndarray:
    ids = torch.as_tensor(rendered.prompt_ids(name), device="cuda")[None]
    with torch.no_grad():
        logits = model(ids, logits_to_keep=1).logits[0, -1].float()
    labels = torch.as_tensor(rendered.questions[name].label_ids, device="cuda")
    return torch.softmax(logits[labels], dim=-1).double().cpu().numpy()


def summarize(candidate: list[np.ndarray], reference: list[np.ndarray], noul: list[bool]) -> dict:
    tv = np.array([0.5 * np.abs(c - r).sum() for c, r in zip(candidate, reference)])
    agree = np.mean([c.argmax() == r.argmax() for c, r in zip(candidate, reference)])
    flips = [((c[0] > 0.5) != (r[0] > 0.5)) for c, r, n in zip(candidate, reference, noul) if n]
    return {
        "questions": len(tv), "mean_tv": float(tv.mean()), "p99_tv": float(np.quantile(tv, 0.99)),
        "max_abs_dp": float(max(np.abs(c - r).max() for c, r in zip(candidate, reference))),
        "top_agreement": float(agree), "noul_flips_at_0.5": float(np.mean(flips)) if flips else 0.0,
    }


async def ask_all(engine, requests):
    return await asyncio.gather(*(engine.ask(state, questions) for state, questions in requests))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-size", default="0.8B")
    parser.add_argument("--race", type=int, default=24, help="RACE passages")
    args = parser.parse_args()
    from transformers import Qwen3_5ForCausalLM

    checkpoint = build_random_checkpoint(args.model_size, Path(tempfile.mkdtemp(prefix="flide-fidelity-")))
    engine16 = fl.Engine.load(checkpoint, device="cuda", dtype="bfloat16", round_deadline_ms=20)
    requests = [quality_request(engine16.renderer)] + race_requests(args.race)
    requests = [(state, with_common_questions(questions)) for state, questions in requests]
    answers16 = asyncio.run(ask_all(engine16, requests))
    stats16 = engine16.stats()
    engine16.close()
    del engine16
    engine32 = fl.Engine.load(checkpoint, device="cuda", dtype="float32", round_deadline_ms=20)
    answers32 = asyncio.run(ask_all(engine32, requests))
    renderer = engine32.renderer
    engine32.close()
    del engine32
    torch.cuda.empty_cache()

    reference, hf16, ours16, ours32, noul = [], [], [], [], []
    model32 = Qwen3_5ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).cuda().eval()
    rendered_all = [renderer.render(state, fl.questions.parse_questions(q)) for state, q in requests]
    for rendered, (_, questions) in zip(rendered_all, requests):
        for name in questions:
            reference.append(hf_probabilities(model32, rendered, name))
    del model32
    torch.cuda.empty_cache()
    model16 = Qwen3_5ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda().eval()
    for rendered, (_, questions), a16, a32 in zip(rendered_all, requests, answers16, answers32):
        for name, question in questions.items():
            hf16.append(hf_probabilities(model16, rendered, name))
            ours16.append(probabilities(a16[name]))
            ours32.append(probabilities(a32[name]))
            noul.append(isinstance(question, fl.Noul))
    result = {
        "benchmark": "fidelity", "model_size": args.model_size,
        **run_metadata(f"python benchmarks/fidelity.py --model-size {args.model_size} --race {args.race}"),
        "data": "QuALITY (CC BY 4.0) article 1 cut to 2,000 tokens + its questions; RACE dev/middle (non-commercial "
                f"research) first {args.race} passages; plus one Noul and one Score per state",
        "requests": len(requests),
        "engine_bf16_vs_fp32_reference": summarize(ours16, reference, noul),
        "transformers_bf16_vs_fp32_reference": summarize(hf16, reference, noul),
        "engine_fp32_cuda_vs_fp32_reference": summarize(ours32, reference, noul),
        "engine_bf16_rounds": stats16["rounds"],
    }
    result["engine_tv_no_worse_than_transformers_bf16"] = (
        result["engine_bf16_vs_fp32_reference"]["mean_tv"] <= result["transformers_bf16_vs_fp32_reference"]["mean_tv"]
    )
    write_result(f"fidelity-{args.model_size}", result)


if __name__ == "__main__":
    main()
