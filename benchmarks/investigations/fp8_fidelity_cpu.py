"""FP8 weights' fidelity at release shapes without a GPU: mean TV to the float32 engine of the bf16 engine and of the
FP8 one (`weights="fp8"`), eager on CPU, on RACE passages with their questions (docs/decisions/fp8-weights.md).

    FLIDE_BENCH_DATA=.bench-data PYTHONPATH=$PWD python benchmarks/investigations/fp8_fidelity_cpu.py [--passages 8]

Random weights (`checkpoint.random_state_dict`, seed 0) at Qwen3.5-0.8B's shapes with the real tokenizer; about 9
minutes on two cores. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import flide_sdk as fl
from benchmarks.common import answer_probabilities, data_path, race_requests, release_config
from flide_sdk.models.checkpoint import random_state_dict, save_text_checkpoint
from flide_sdk.models.qwen35 import Qwen35Config


def checkpoint(model_size: str) -> Path:
    raw = release_config(model_size)
    text = {**raw["text_config"], "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
            "tie_word_embeddings": raw.get("tie_word_embeddings", True)}
    target = Path(tempfile.mkdtemp(prefix="fp8-fidelity-"))
    save_text_checkpoint(target, text, random_state_dict(Qwen35Config.from_text_config(text), seed=0,
                                                         dtype=torch.bfloat16))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data_path("tokenizer", "qwen3.5", name), target / name)
    return target


def answers(path: Path, requests: list, **options) -> tuple[list[np.ndarray], float]:
    started = time.perf_counter()
    with fl.Engine.load(path, device="cpu", graphs=False, **options) as engine:
        found = [engine.ask_sync(state, questions) for state, questions in requests]
    return [answer_probabilities(a[name]) for a in found for name in a], time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-size", default="0.8B")
    parser.add_argument("--passages", type=int, default=8)
    args = parser.parse_args()
    path = checkpoint(args.model_size)
    try:
        requests = [(state, {name: q.to_dict() for name, q in questions.items()})
                    for state, questions in race_requests(args.passages)]
        reference, _ = answers(path, requests, dtype="float32")
        result = {"model_size": args.model_size, "questions": len(reference)}
        for name, options in (("bf16", {"dtype": "bfloat16"}), ("fp8", {"dtype": "bfloat16", "weights": "fp8"})):
            got, seconds = answers(path, requests, **options)
            tv = np.array([0.5 * np.abs(g - r).sum() for g, r in zip(got, reference)])
            kept = np.mean([g.argmax() == r.argmax() for g, r in zip(got, reference)])
            result[name] = {"mean_tv": float(tv.mean()), "max_tv": float(tv.max()), "top_answer_kept": float(kept),
                            "seconds": seconds}
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
