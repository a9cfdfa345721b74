"""Host work of preparing an ask, per prompt format: `engine.prepare` (parse, render, tokenize, lay out) on CPU.

    PYTHONPATH=$PWD python benchmarks/prompt_host.py [--repeat 40]

Formats on the tiny checkpoint: flide_sdk's own prompt, a decision model whose `questions` template prints all
questions in one prompt (control tokens sanitized, and not), and transformers' generic prompt
(`rendering="transformers"`); Q = 1, 16, 64 yes/no questions (as dicts) about a 2,000-token state, each ask's
state new (its first line), the rest of it repeating as an agent's history does. Also the stream tokens of the
ask (what a round computes with no checkpoint) next to the pipeline's prompt tokens, for the `questions` template.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import flide_sdk as fl
from flide_sdk.testing import tiny_checkpoint

QUESTIONS_TEMPLATE = """<|im_start|>user
{{ state if state is string else state|tojson }}<|im_end|>
{% for q in questions %}<|im_start|>{{ q.name }}: {{ q.instructions }} [{{ q.labels|join('/') }}]<|split|>\
{{ q.options|join(', ') }}<|mark|>
{% endfor %}"""


def checkpoints(root: Path) -> dict[str, tuple[Path, str]]:
    """(checkpoint, rendering) per format."""
    out = {"flide": (tiny_checkpoint(), "flide"), "transformers generic": (tiny_checkpoint(), "transformers")}
    for sanitize in (True, False):
        path = root / f"questions-{sanitize}"
        shutil.copytree(tiny_checkpoint(), path)
        (path / "decision_template.jinja").write_text(QUESTIONS_TEMPLATE)
        (path / "decision.json").write_text(json.dumps({"sanitize_control_tokens": sanitize}))
        out[f"questions template ({'sanitized' if sanitize else 'not sanitized'})"] = (path, "flide")
    return out


def state_of(engine: fl.Engine, index: int, tokens: int = 2000) -> str:
    words = ("the agent read the file and found an error in line 12 then it ran the test again and the test "
             "failed because the refund total was wrong so it opened the module").split()
    text, body = f"Request {index}.", []
    while len(engine.tokens.encode(" ".join(body))) < tokens:
        body.append(words[(len(body) * 7 + index % 5) % len(words)])
    return text + " " + " ".join(body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=40)
    args = parser.parse_args()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as root:
        engines = {name: fl.Engine.load(path, device="cpu", dtype="float32", rendering=rendering)
                   for name, (path, rendering) in checkpoints(Path(root)).items()}
        states = [state_of(next(iter(engines.values())), i) for i in range(args.repeat)]
        for q in (1, 16, 64):
            questions = {f"q{i}": {"type": "noul", "instructions": f"Is claim number {i} of the list true?"}
                         for i in range(q)}
            times: dict[str, list[float]] = {name: [] for name in engines}
            asks = {}
            for state in states:  # the formats in turn, so each sees the same machine
                for name, engine in engines.items():
                    started = time.perf_counter()
                    asks[name] = engine.prepare(state, questions)
                    times[name].append(1000 * (time.perf_counter() - started))
            for name, ask in asks.items():
                parts = getattr(ask, "asks", [ask])
                kept = times[name][len(times[name]) // 8:]  # the first asks fill the caches
                results.setdefault(name, {})[f"q{q}"] = {
                    "median_ms": round(statistics.median(kept), 3),
                    "p10_ms": round(sorted(kept)[len(kept) // 10], 3),
                    "stream_tokens": sum(len(a.trunk) + a.branch_tokens for a in parts),
                    "prompt_tokens": sum(a.prompt_tokens for a in parts)}
                print(f"{name:36s} Q={q:2d} {results[name][f'q{q}']}", file=sys.stderr)
        for engine in engines.values():
            engine.close()
    from benchmarks.common import run_metadata, write_result

    write_result("prompt_host-tiny", {**run_metadata(" ".join(sys.argv)), "benchmark": "prompt_host",
                                      "model_size": "tiny", "device": "cpu", "results": results})


if __name__ == "__main__":
    main()
