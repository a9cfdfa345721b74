"""Sibling packing: Gated DeltaNet chunk rows and device time per round, packed against unpacked, same run.

    PYTHONPATH=$PWD python benchmarks/packing.py --model-size 0.8B
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/packing.py --tiny   (CPU smoke test: counts and errors)

Rounds as the engine plans them (rendered with the Qwen3.5 tokenizer and chat template): each of 6 MultiRC
paragraphs with all its yes/no questions (up to 64) as a lone round; a 2,000-token QuALITY cut with 64 yes/no
questions; a RACE passage with one Choice of 8 options of 10-30 tokens scored by text. Per round: chunk rows
(all levels) packed and unpacked (`plan_round(..., pack=...)`; the batch-invariant mode never packs); the Gated
DeltaNet forward of one layer (`gated_delta_triton`, the model's shapes, random bf16 inputs) replayed in a CUDA
graph, packed and unpacked (median ms over 100 replays); and the relative error of each against the float32
reference of the unpacked plan. End-to-end latency before/after packing is `benchmarks/ab.py`'s
(`multirc_lone_median_ms`, `w1_q64_median_ms`).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from benchmarks.bench_gdn import graph_of, random_inputs, relative_error
from benchmarks.common import (
    STORY_QUESTIONS,
    command_line,
    cuda_time_ms,
    cut_tokens,
    data_path,
    quality_records,
    release_config,
    run_metadata,
    write_result,
)
from benchmarks.invariance import multirc_requests
from benchmarks.text_scoring import choice, text_requests
from flide_sdk.kernels.gated_delta import gated_delta_triton
from flide_sdk.kernels.reference import gated_delta_reference
from flide_sdk.plan.layout import plan_round
from flide_sdk.plan.requests import Branches, RequestSpec
from flide_sdk.prompt.base import as_rendered
from flide_sdk.prompt.chat import ChatFormat
from flide_sdk.questions import Noul, parse_questions

CONV_KERNEL = 4
REPEAT = 100


def request_of(renderer: ChatFormat, state: str, questions: dict) -> RequestSpec:
    """The request the engine computes for a lone ask (no checkpoint)."""
    rendered = as_rendered(renderer.parts(state, parse_questions(questions)))
    parts = list(rendered.questions.values())
    return RequestSpec(np.asarray(rendered.state_ids, dtype=np.int64),
                       Branches.of([q.ids for q in parts], [q.label_ids for q in parts], [q.replies for q in parts]))


def rounds(renderer: ChatFormat, tiny: bool) -> dict[str, RequestSpec]:
    out = {f"multirc_{i}": request_of(renderer, state, questions)
           for i, (state, questions) in enumerate(multirc_requests(2 if tiny else 6))}
    state = cut_tokens(renderer, quality_records()[0]["input"], 0, 300 if tiny else 2000)
    questions = {f"s{i}": Noul(STORY_QUESTIONS[i % len(STORY_QUESTIONS)]) for i in range(64)}
    out["w1_q64"] = request_of(renderer, state, questions)
    texts = text_requests(renderer, 1)
    if texts:
        passage, options, instructions = texts[0]
        out["race_text_choice_8"] = request_of(renderer, passage, {"q": choice(options, instructions, "text")})
    return out


def measure(request: RequestSpec, shapes: tuple[int, int, int, int], device: str, timing: bool) -> dict:
    k_heads, v_heads, dk, dv = shapes
    plans = {packed: plan_round([request], CONV_KERNEL, pack=packed) for packed in (False, True)}
    entry = {"stream_tokens": plans[True].num_real,
             "questions": len(request.branches),
             "chunk_rows": {("packed" if packed else "unpacked"): sum(level.chunks for level in host.plan.levels)
                            for packed, host in plans.items()},
             "branch_chunk_rows": {("packed" if packed else "unpacked"): sum(level.chunks for level in
                                                                              host.plan.levels[2:])
                                   for packed, host in plans.items()}}
    x = random_inputs(plans[True].num_tokens, k_heads, v_heads, dk, dv) if device == "cuda" else {
        name: value.cpu().float() for name, value in random_inputs_cpu(plans[True].num_tokens, shapes).items()}
    rows = plans[True].plan.rows.num_rows
    reference_states = torch.zeros(rows, v_heads, dk, dv, device=device)
    unpacked_plan = plans[False].to(device).delta
    reference = gated_delta_reference(x["q"].float(), x["k"].float(), x["v"].float(), x["g"], x["beta"],
                                      unpacked_plan, reference_states)
    for packed, host in plans.items():
        name = "packed" if packed else "unpacked"
        plan = host.to(device).delta
        states = torch.zeros(rows, v_heads, dk, dv, device=device)

        def run(plan=plan, states=states):
            return gated_delta_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], plan, states)

        entry.setdefault("rel_err_vs_float32_reference", {})[name] = relative_error(run(), reference)
        if timing:
            graph = graph_of(run)
            entry.setdefault("gdn_graph_ms", {})[name] = cuda_time_ms(graph.replay, warmup=10, repeat=REPEAT)
    if timing:
        entry["gdn_packed_over_unpacked"] = (entry["gdn_graph_ms"]["packed"]["median_ms"]
                                             / entry["gdn_graph_ms"]["unpacked"]["median_ms"])
    return entry


def random_inputs_cpu(total: int, shapes: tuple[int, int, int, int]) -> dict:
    """float32 inputs on the CPU (the interpreter) with the distribution of `bench_gdn.random_inputs`."""
    k_heads, v_heads, dk, dv = shapes
    gen = torch.Generator().manual_seed(0)
    return {"q": torch.randn(total, k_heads, dk, generator=gen), "k": torch.randn(total, k_heads, dk, generator=gen),
            "v": torch.randn(total, v_heads, dv, generator=gen),
            "g": -torch.nn.functional.softplus(torch.randn(total, v_heads, generator=gen) - 2.0),
            "beta": torch.sigmoid(torch.randn(total, v_heads, generator=gen))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-size", default="0.8B")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    renderer = ChatFormat.from_checkpoint(data_path("tokenizer", "qwen3.5"), 32768)
    text = release_config(args.model_size)["text_config"]
    shapes = (text["linear_num_key_heads"], text["linear_num_value_heads"], text["linear_key_head_dim"],
              text["linear_value_head_dim"])
    device = "cpu" if args.tiny else "cuda"
    if args.tiny:  # the interpreter: small heads, no timing
        shapes = (1, 2, 16, 16)
    results = {name: measure(request, shapes, device, not args.tiny)
               for name, request in rounds(renderer, args.tiny).items()}
    multirc = [entry for name, entry in results.items() if name.startswith("multirc")]
    summary = {"multirc_questions_per_paragraph": [entry["questions"] for entry in multirc],
               "multirc_branch_chunk_rows": {kind: [entry["branch_chunk_rows"][kind] for entry in multirc]
                                             for kind in ("unpacked", "packed")}}
    if not args.tiny:
        summary["gdn_packed_over_unpacked"] = {name: entry["gdn_packed_over_unpacked"]
                                               for name, entry in results.items()}
    result = {"benchmark": "packing", "model_size": "tiny" if args.tiny else args.model_size,
              "gdn_shapes": dict(zip(("k_heads", "v_heads", "dk", "dv"), shapes)), "summary": summary,
              "rounds": results, **run_metadata(command_line())}
    write_result("packing-tiny" if args.tiny else f"packing-{args.model_size}", result)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
