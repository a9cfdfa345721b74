"""Options scored by their text: exactness on the device, fidelity, and the cost against label scoring.

    PYTHONPATH=$PWD python benchmarks/text_scoring.py --model-size 0.8B
    PYTHONPATH=$PWD python benchmarks/text_scoring.py --tiny          (CPU smoke test)

Questions: RACE passages, each with one Choice of 8 options of 10-30 tokens (the passage's own answer options
of that length, from all its questions). Reported, same run:
- exactness: a float32 engine against transformers' float32 model teacher-forced on `prompt + option tokens +
  <|im_end|>` (max |dp| over the options, and max |d log-likelihood|), and as a yardstick the same options
  scored as labels against transformers' label softmax on the same device;
- fidelity: the bfloat16 engine's answers against the float32 engine's (total variation), and as a yardstick
  transformers' bfloat16 model against its float32 one (both teacher-forced);
- cost: lone latency of the Choice scored by text and of the same options scored as labels (an engine without
  checkpoints, so every ask computes its passage; after a pass over every request and the capture of the graphs
  it asked for), with the stream tokens, graph replays and eager rounds of each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np
import torch

import flide_sdk as fl
from benchmarks.common import (
    add_engine_args,
    answer_probabilities,
    bench_checkpoint,
    command_line,
    engine_settings,
    latency_stats,
    load_engine,
    race_requests,
    release_device_memory,
    run_metadata,
    stats_delta,
    target,
    token_count,
    write_result,
)

OPTIONS = 8
OPTION_TOKENS = (10, 30)


def text_requests(renderer, count: int) -> list[tuple[str, list[str], str]]:
    """(passage, 8 options of 10-30 tokens, the first question's stem) for each RACE passage that has them."""
    requests = []
    for state, questions in race_requests():
        options = [name for question in questions.values() for name in question.criteria.values()
                   if OPTION_TOKENS[0] <= token_count(renderer, name) <= OPTION_TOKENS[1]]
        options = list(dict.fromkeys(options))[:OPTIONS]
        if len(options) == OPTIONS:
            requests.append((state, options, next(iter(questions.values())).instructions))
        if len(requests) == count:
            break
    return requests


def choice(options: list[str], instructions: str, scoring: str) -> fl.Choice:
    return fl.Choice(instructions, {option: None for option in options}, scoring=scoring)


def label_reference(model, engine: fl.Engine, state: str, question: fl.Choice) -> np.ndarray:
    """transformers' softmax over the label logits of the standalone prompt."""
    rendered = engine.render(state, {"q": question})
    ids = torch.as_tensor(rendered.prompt_ids("q"), device=model.device)[None]
    with torch.no_grad():
        logits = model(ids).logits[0, -1].double()
    labels = torch.as_tensor(np.array(rendered.questions["q"].label_ids), device=model.device)
    return torch.softmax(logits[labels], dim=-1).cpu().numpy()


def teacher_forced(model, engine: fl.Engine, state: str, question: fl.Choice) -> np.ndarray:
    """Each option's log-likelihood of `prompt + option + <|im_end|>` under transformers (float64 sums)."""
    prompt = engine.render(state, {"q": question}).prompt_ids("q")
    end = engine.tokens.tokenizer.token_to_id("<|im_end|>")
    scores = []
    for option in question.option_names():
        reply = np.append(engine.tokens.encode(option), end)
        ids = torch.as_tensor(np.concatenate([prompt, reply]), device=model.device)[None]
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(reply)].double()
        picked = torch.log_softmax(logits, dim=-1).gather(1, torch.as_tensor(reply, device=model.device)[:, None])
        scores.append(float(picked.sum()))
    return np.array(scores)


def softmax(scores: np.ndarray) -> np.ndarray:
    weights = np.exp(scores - scores.max())
    return weights / weights.sum()


async def answers(engine: fl.Engine, requests: list, scoring: str) -> list[np.ndarray]:
    out = []
    for state, options, instructions in requests:
        response = await engine.ask(state, {"q": choice(options, instructions, scoring)})
        out.append(answer_probabilities(response["q"]))
    return out


async def lone(engine: fl.Engine, requests: list, scoring: str, repeat: int) -> dict:
    await answers(engine, requests, scoring)  # warm-up: every capacity the asks need, then its graph
    await asyncio.to_thread(engine.wait_for_graphs)
    before, times = engine.stats(), []
    for index in range(repeat):
        state, options, instructions = requests[index % len(requests)]
        started = time.perf_counter()
        await engine.ask(state, {"q": choice(options, instructions, scoring)})
        times.append((time.perf_counter() - started) * 1000)
    delta = stats_delta(before, engine.stats())
    return {"latency_ms": latency_stats(times), "tokens_per_ask": delta["delta"]["tokens_computed"] / repeat,
            "per_round_ms": delta["per_round_ms"],
            "eager_runs": delta["delta"].get("eager_runs", 0), "graph_replays": delta["delta"].get("graph_replays", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    args = parser.parse_args()
    checkpoint, where = bench_checkpoint(args)
    graphs, options = engine_settings(args)
    device, dtype = where["device"], where["dtype"]
    count, exact_count, repeat = (4, 2, 6) if args.tiny else (40, 6, 60)

    async def run() -> dict:
        exact, _ = load_engine(checkpoint, device, "float32", False, pool_bytes=0, **options)
        requests = text_requests(exact.tokens, count)
        from transformers import Qwen3_5ForCausalLM

        model = Qwen3_5ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval()
        worst_p = worst_ll = worst_label = 0.0
        for state, opts, instructions in requests[:exact_count]:
            labelled = choice(opts, instructions, "label")
            got = answer_probabilities((await exact.ask(state, {"q": labelled}))["q"])
            worst_label = max(worst_label, float(np.abs(got - label_reference(model, exact, state, labelled)).max()))
            question = choice(opts, instructions, "text")
            expected = teacher_forced(model, exact, state, question)
            got = answer_probabilities((await exact.ask(state, {"q": question}))["q"])
            worst_p = max(worst_p, float(np.abs(got - softmax(expected)).max()))
            # the engine's log-likelihood differences, recovered from its probabilities where they are not tiny
            seen = got > 1e-6
            if seen.sum() >= 2:
                ours = np.log(got[seen]) - np.log(got[seen]).mean()
                theirs = expected[seen] - expected[seen].mean()
                worst_ll = max(worst_ll, float(np.abs(ours - theirs).max()))
        transformers_float32 = [softmax(teacher_forced(model, exact, state, choice(opts, instructions, "text")))
                                for state, opts, instructions in requests]
        model = model.to(torch.bfloat16)
        transformers_bf16 = [softmax(teacher_forced(model, exact, state, choice(opts, instructions, "text")))
                             for state, opts, instructions in requests]
        del model
        float32_answers = await answers(exact, requests, "text")
        exact.close()
        release_device_memory()
        served, load = load_engine(checkpoint, device, dtype, graphs, pool_bytes=0, **options)
        served_answers = await answers(served, requests, "text")
        tv = [0.5 * float(np.abs(a - b).sum()) for a, b in zip(served_answers, float32_answers)]
        tv_transformers = [0.5 * float(np.abs(a - b).sum()) for a, b in zip(transformers_bf16, transformers_float32)]
        cost = {scoring: await lone(served, requests, scoring, repeat) for scoring in ("label", "text")}
        served.close()
        ratio = cost["text"]["latency_ms"]["median_ms"] / cost["label"]["latency_ms"]["median_ms"]
        option_tokens = [token_count(served.tokens, o) for _, opts, _ in requests for o in opts]
        return {"requests": len(requests), "option_tokens": {"min": min(option_tokens), "max": max(option_tokens),
                                                            "mean": float(np.mean(option_tokens))},
                "exactness": {"questions": min(exact_count, len(requests)), "max_abs_dp": worst_p,
                              "max_abs_dloglik": worst_ll, "labels_max_abs_dp": worst_label},
                "fidelity_to_float32": {"mean_tv": float(np.mean(tv)), "max_tv": float(np.max(tv)),
                                        "transformers_bf16_mean_tv": float(np.mean(tv_transformers)),
                                        "transformers_bf16_max_tv": float(np.max(tv_transformers))},
                "cost": cost, "text_over_label_latency": ratio, "load": load,
                "targets": {"exact_max_abs_dp": target(worst_p, 1e-4)}}

    result = asyncio.run(run())
    result.update(where)
    result.update(run_metadata(command_line()))
    name = "text-scoring-tiny" if args.tiny else f"text-scoring-{args.model_size}"
    write_result(name, result)
    print(json.dumps({"targets": result["targets"], "cost": result["cost"]}, indent=1))


if __name__ == "__main__":
    main()
