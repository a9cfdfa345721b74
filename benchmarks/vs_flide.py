"""flide_sdk next to flide 0.1.4 in one process on one checkpoint: the scoreboard's lone asks and 64 clients.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/vs_flide.py --model-size 4B        (flide 0.1.4 installed)
    PYTHONPATH=$PWD python benchmarks/vs_flide.py --tiny --no-flide                  (CPU smoke test)
    PYTHONPATH=/tmp/site:$PWD python benchmarks/vs_flide.py --model-size 4B --fp8  (both engines in FP8)

Both engines serve the same random-weight checkpoint (the real Qwen3.5 tokenizer) and see the same token ids:
flide runs a format plugin (`SameIds`, its documented extension point) whose plan is flide_sdk's rendering of
the request, so each question's trunk and branch ids are identical and each engine keeps its own forward, head
and host path (flide's decide / its Batcher, as its server drives them; `cuda_graphs` on, as it serves).
Workloads, each ask a state no earlier ask saw: W1 (a ~2,000-token QuALITY state with Q = 1, 16, 64 yes/no
questions), RACE passages with their questions, MultiRC paragraphs with all their yes/no questions; lone
latency in alternating blocks (ABBA over the engines, block 0 warms up), and RACE with 64 concurrent clients.
Reported: medians per engine, sdk / flide ratios, memory in use after load, and max |dp| between the engines'
answers (bf16 rounding only: same weights, same ids). With --pipeline, transformers' `pipeline("decision")` on the
same checkpoint (transformers >= 5.25) answers `--pipeline-requests` asks of each lone workload after the engines
are closed (one warm-up first): its own generic prompt, about as long, one prompt at a time; its 64-client rate is
1 / its RACE latency (it answers one request at a time). With --fp8 both engines quantize the checkpoint's
projections to FP8 at load (flide: `backbone_options={"quantize": "fp8"}`, flide_sdk: `weights="fp8"`); the lone
bar is then FP8_LONE_RATIO of flide's own FP8 (their answers then differ by both quantizations too).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

Q_COUNTS = (1, 16, 64)
# issue 64's bars: sdk / flide lone latency at most this per model size, 64-client throughput at least 1.2x
LONE_RATIO = {"0.8B": 0.7, "4B": 0.75}
FP8_LONE_RATIO = {"4B": 0.6}  # with --fp8: sdk / flide, both in FP8
THROUGHPUT_RATIO = 1.2
# the labels flide_sdk reads: its own prompt's, and the "Yes" / "No" of transformers' generic prompt (images.py)
LABELS = ("yes", "no", "Yes", "No", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ", *"0123456789")


def workloads(block: int, tiny: bool) -> dict[str, list[tuple[Any, dict]]]:
    """Each lone workload's asks for one block, as (state, System One questions); states marked by the block."""
    from benchmarks.common import STORY_QUESTIONS, quality_records, race_requests
    from benchmarks.invariance import multirc_requests

    articles = [record["input"] for record in quality_records()]
    count = 2 if tiny else 8
    asks: dict[str, list[tuple[Any, dict]]] = {}
    for q in Q_COUNTS:
        questions = {f"s{i}": {"type": "noul", "instructions": STORY_QUESTIONS[i % len(STORY_QUESTIONS)]}
                     for i in range(q)}
        asks[f"w1_q{q}"] = [(f"Request {block}-{q}-{i}.\n{articles[(block + i) % len(articles)][:8000]}", questions)
                            for i in range(count)]
    asks["race"] = [(f"Passage {block}-{i}.\n{state}", {n: q.to_dict() for n, q in questions.items()})
                    for i, (state, questions) in enumerate(race_requests(2 * count))]
    asks["multirc"] = [(f"Paragraph {block}-{i}.\n{state}", {n: q.to_dict() for n, q in questions.items()})
                       for i, (state, questions) in enumerate(multirc_requests(count))]
    return asks


def throughput_asks(block: int, count: int) -> list[tuple[Any, dict]]:
    from benchmarks.common import race_requests

    return [(f"Client passage {block}-{i}.\n{state}", {n: q.to_dict() for n, q in questions.items()})
            for i, (state, questions) in enumerate(race_requests(count))]


# ------------------------------------------------------------------------------------------- flide_sdk arm
class Sdk:
    name = "flide_sdk"

    def __init__(self, path: Path, device: str, dtype: str, graphs: bool, fp8: bool, **options: Any) -> None:
        from benchmarks.common import load_engine

        self.engine, self.load = load_engine(path, device, dtype, graphs, weights="fp8" if fp8 else None, **options)

    async def ask(self, state: Any, questions: dict, assets: dict | None = None) -> list[float]:
        response = await self.engine.ask(state, questions, assets=assets)
        return [p for answer in response.values()
                for p in ([answer.noul] if hasattr(answer, "noul") else answer.probabilities.values())]

    def close(self) -> None:
        self.engine.close()


# ------------------------------------------------------------------------------------------- flide arm
@dataclass(frozen=True)
class SamePrompt:
    """A request as flide_sdk renders it, for flide: the ids, and flide's vision inputs for the images in the trunk
    (`Plan.vision`: pixel_values, image_grid_thw, mm_token_type_ids) or None."""

    rendered: Any  # flide_sdk.prompt.base.Rendered
    vision: dict[str, torch.Tensor] | None = None


Render = Callable[[Any, dict, list], SamePrompt]  # (state, questions, the request's images) -> its prompt


def text_render(path: Path) -> Render:
    """flide_sdk's own chat format of the checkpoint at `path`, text only."""
    from flide_sdk.prompt.base import as_rendered
    from flide_sdk.prompt.chat import ChatFormat
    from flide_sdk.questions import parse_questions

    chat = ChatFormat.from_checkpoint(path, 1 << 20)
    return lambda state, questions, images: SamePrompt(as_rendered(chat.parts(state, parse_questions(questions))))


def flide_format(render: Render, label_id: Callable[[str], int]):
    """Register the `sdk_ids` format with flide: its plan is flide_sdk's rendering (`render`: the same ids, and
    the same pixels for images), its head the output rows of every label flide_sdk reads (`label_id`), its finish a
    softmax over each question's labels."""
    import math

    from flide.formats import register
    from flide.formats.base import Plan, Read
    from flide.formats.next_token import NextToken, TokenRows

    from flide_sdk.errors import InvalidQuestionError

    label_index: dict[int, int] = {}  # label token -> its row of the head
    for label in LABELS:
        try:
            label_index.setdefault(label_id(label), len(label_index))
        except InvalidQuestionError:  # not one token in this tokenizer: no question of it reads this label
            continue

    @register("sdk_ids")
    class SameIds(NextToken):
        def load_heads(self, backbone) -> dict[str, Any]:
            weight, bias = backbone.output_head()
            return {"sdk": TokenRows(weight, list(label_index), bias)}

        def plan(self, request, **_: Any) -> Plan:
            questions = {name: q.model_dump(exclude_none=True) for name, q in request.questions.items()}
            prompt = render(request.state, questions, getattr(request, "images", None) or [])
            rendered = prompt.rendered
            data = [(questions[name]["type"] == "noul", [label_index[int(i)] for i in q.label_ids])
                    for name, q in rendered.questions.items()]
            return Plan(rendered.state_ids.tolist(), [q.ids.tolist() for q in rendered.questions.values()],
                        (Read("sdk"),), data, vision=prompt.vision)

        def finish(self, request, plan: Plan, outputs, **_: Any):
            probabilities = []
            for (noul, columns), out in zip(plan.data, outputs):
                logits = [out[0][0][c] for c in columns]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                probabilities += [weights[0] / total] if noul else [w / total for w in weights]
            return probabilities, {}

    return SameIds


def transformers_norm_eps() -> None:
    """flide 0.1.4's Gemma 4 reads transformers' `Gemma4RMSNorm.eps`, which transformers 5.25 (the pipeline arm's,
    first on the path when it runs) names `variance_epsilon`: alias it so both engines load in one process."""
    try:
        from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    except ImportError:
        return
    stored = Gemma4RMSNorm.__init__.__code__.co_names  # the attributes its constructor sets
    if "variance_epsilon" in stored and "eps" not in stored:
        Gemma4RMSNorm.eps = property(lambda norm: norm.variance_epsilon)


class Flide:
    name = "flide"

    def __init__(self, path: Path, device: str, dtype: str, graphs: bool, fp8: bool,
                 render: Render | None = None) -> None:
        import flide
        from flide.api.schema import SystemOneRequest
        from flide.runtime.engine import Engine
        from flide.runtime.online import Batcher

        from flide_sdk.text.tokens import Tokens

        transformers_norm_eps()
        flide_format(render or text_render(path), Tokens.from_checkpoint(path, 1 << 20).label_id)
        started = time.perf_counter()
        self.engine = Engine(str(path), format="sdk_ids", device=f"{device}:0" if device == "cuda" else device,
                             dtype="bfloat16" if dtype == "bfloat16" else "float32",
                             backbone_options={"cuda_graphs": graphs, **({"quantize": "fp8"} if fp8 else {})})
        self.batcher = Batcher(self.engine)
        self.load = {"version": flide.__version__, "load_seconds": time.perf_counter() - started}
        self.request = SystemOneRequest.model_validate

    def _request(self, state: Any, questions: dict, images: list | None):
        return self.request({"state": state, "questions": questions, **({"images": images} if images else {})})

    async def ask(self, state: Any, questions: dict, images: list | None = None) -> list[float]:
        """A lone ask: the engine's decide, as flide's server runs one without a batcher; `images` as flide's
        requests carry them (base64)."""
        return self.engine.decide(self._request(state, questions, images))[0]

    async def client_ask(self, state: Any, questions: dict, images: list | None = None) -> None:
        """An ask among many: plan, forward and finish through the Batcher, as flide's server does."""
        request = self._request(state, questions, images)
        plan = await asyncio.wrap_future(self.batcher.plan(request))
        branches, _ = await asyncio.wrap_future(self.batcher.forward(plan))
        while (follow := await asyncio.wrap_future(self.batcher.follow_up(request, plan, branches))) is not None:
            plan = follow
            branches, _ = await asyncio.wrap_future(self.batcher.forward(plan))
        await asyncio.wrap_future(self.batcher.finish(request, plan, branches))

    def close(self) -> None:
        pass


class Pipeline:
    """transformers' `pipeline("decision")` on the checkpoint, in the engines' dtype on their device."""

    name = "pipeline"

    def __init__(self, path: Path, device: str, dtype: str) -> None:
        import transformers

        started = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        self.decide = transformers.pipeline("decision", model=model, tokenizer=tokenizer)
        self.device = device
        self.load = {"version": transformers.__version__, "load_seconds": time.perf_counter() - started}

    async def ask(self, state: Any, questions: dict) -> list[float]:
        answers = self.decide({"state": state, "questions": questions})
        if self.device == "cuda":
            torch.cuda.synchronize()
        return [p for name in questions for p in ([answers[name]["noul"]] if answers[name]["type"] == "noul"
                                                  else answers[name]["probabilities"].values())]


def pipeline_lone(path: Path, device: str, dtype: str, args, phases) -> tuple[dict[str, float], dict]:
    """The pipeline's median lone latency per workload over `args.pipeline_requests` asks of the last block's,
    after one warm-up ask; and its load."""
    with phases("pipeline"):
        arm = Pipeline(path, device, dtype)
        asks = workloads(args.blocks, args.tiny)
        asyncio.run(arm.ask(*asks["race"][-1]))  # warm-up
        medians = {key: asyncio.run(lone(arm, found[: args.pipeline_requests]))[0] for key, found in asks.items()}
    return medians, arm.load


# ------------------------------------------------------------------------------------------- driver
def used_bytes(device: str) -> int:
    """Device memory in use (all allocators: torch's, the pool's own mappings, graphs), context excluded by
    the caller taking differences."""
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


async def lone(arm, asks: list[tuple[Any, dict]]) -> tuple[float, list[float]]:
    times, answers = [], []
    for state, questions in asks:
        started = time.perf_counter()
        answers += await arm.ask(state, questions)
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times), answers


async def clients(ask: Callable[..., Any], asks: list[tuple], count: int) -> float:
    """Requests per second of `count` clients taking `ask(*args)` of `asks` one after another."""
    pending = list(asks)
    started = time.perf_counter()

    async def client() -> None:
        while pending:
            await ask(*pending.pop())

    await asyncio.gather(*(client() for _ in range(count)))
    return len(asks) / (time.perf_counter() - started)


def run_blocks(arms: list, args, phases, lone_ms: dict, throughput: dict) -> dict[str, dict[str, list[float]]]:
    """The lone workloads in blocks (ABBA over the arms, block 0 a warm-up) and the clients' run at the first
    and last block; returns the last block's answers per workload and arm."""
    answers: dict[str, dict[str, list[float]]] = {}
    for block in range(args.blocks + 1):
        order = arms if block % 2 else arms[::-1]
        with phases(f"block {block} " + " ".join(arm.name for arm in arms)):
            for key, asks in workloads(block, args.tiny).items():
                for arm in order:
                    ms, answers.setdefault(key, {})[arm.name] = asyncio.run(lone(arm, asks))
                    if block:
                        lone_ms[arm.name].setdefault(key, []).append(ms)
            if block in (0, args.blocks):  # the clients' run: warm-up, then once at the end
                asks = throughput_asks(block, 16 if args.tiny else args.client_requests)
                for arm in order:
                    rate = asyncio.run(clients(getattr(arm, "client_ask", arm.ask), asks, args.clients))
                    if block:
                        throughput[arm.name].append(rate)
    return answers


def targets(summary: dict[str, dict[str, float]], size: str, fp8: bool = False) -> dict[str, dict]:
    """Each workload's sdk / flide ratio against its bar (lone: at most LONE_RATIO, FP8_LONE_RATIO with both in
    FP8; clients: at least 1.2)."""
    from benchmarks.common import target

    lone_ratio = FP8_LONE_RATIO if fp8 else LONE_RATIO
    found = {}
    for key, row in summary.items():
        if "sdk_over_flide" not in row:
            continue
        if key.endswith("_lone_ms") and size in lone_ratio:
            found[f"{key[:-3]}_sdk_over_flide"] = target(row["sdk_over_flide"], lone_ratio[size])
        elif key.endswith("_requests_per_s"):
            found[f"{key}_sdk_over_flide"] = target(row["sdk_over_flide"], THROUGHPUT_RATIO, "min")
    return found


def main() -> None:
    from benchmarks.common import (
        Phases,
        add_engine_args,
        bench_checkpoint,
        release_device_memory,
        run_metadata,
        write_result,
    )

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--blocks", type=int, default=4, help="measured blocks (block 0, a warm-up, comes on top)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--client-requests", type=int, default=256)
    parser.add_argument("--no-flide", action="store_true", help="the flide_sdk arm alone (CPU smoke test)")
    parser.add_argument("--fp8", action="store_true", help="both engines with FP8 weights quantized at load")
    parser.add_argument("--pipeline", action="store_true",
                        help="also time pipeline(\"decision\") on the lone workloads (transformers >= 5.25)")
    parser.add_argument("--pipeline-requests", type=int, default=2, help="the pipeline's asks per workload")
    parser.add_argument("--turns", action="store_true",
                        help="one engine at a time (shapes where both do not fit on the card): every block on "
                             "flide_sdk, then every block on flide, instead of alternating blocks")
    args = parser.parse_args()
    phases = Phases()
    with phases("checkpoint"):
        path, setup = bench_checkpoint(args)
    device, dtype, graphs = setup["device"], setup["dtype"], not (args.tiny or args.eager)
    classes = (Sdk,) if args.no_flide else (Sdk, Flide)
    lone_ms: dict[str, dict[str, list[float]]] = {cls.name: {} for cls in classes}
    throughput: dict[str, list[float]] = {cls.name: [] for cls in classes}
    answers: dict[str, dict[str, list[float]]] = {}  # the last block's, per workload and engine
    memory, loads = {}, {}
    # Both engines resident, blocks alternating over them; with --turns (shapes where both do not fit) one
    # engine at a time runs every block, then gives its memory back.
    for group in [[cls] for cls in classes] if args.turns else [list(classes)]:
        arms = []
        for cls in group:
            before = used_bytes(device)
            with phases(f"load {cls.name}"):
                arms.append(cls(path, device, dtype, graphs, args.fp8))
            memory[cls.name] = used_bytes(device) - before
            loads[cls.name] = arms[-1].load
        for key, found in run_blocks(arms, args, phases, lone_ms, throughput).items():
            answers.setdefault(key, {}).update(found)
        for arm in arms:
            arm.close()
        del arms
        release_device_memory()
    gaps = {key: max(abs(x - y) for x, y in zip(*both.values(), strict=True))
            for key, both in answers.items() if len(both) == 2}
    pipeline: dict[str, float] = {}
    if args.pipeline:
        pipeline, loads["pipeline"] = pipeline_lone(path, device, dtype, args, phases)
    summary: dict[str, Any] = {}
    for key in lone_ms["flide_sdk"]:
        row = {name: statistics.median(values[key]) for name, values in lone_ms.items()}
        if "flide" in row:
            row["sdk_over_flide"] = row["flide_sdk"] / row["flide"]
        if key in pipeline:
            row["pipeline"] = pipeline[key]
            row["sdk_over_pipeline"] = row["flide_sdk"] / pipeline[key]
        summary[f"{key}_lone_ms"] = row
    row = {name: statistics.median(values) for name, values in throughput.items()}
    if "flide" in row:
        row["sdk_over_flide"] = row["flide_sdk"] / row["flide"]
    if "race" in pipeline:
        row["pipeline"] = 1000.0 / pipeline["race"]
        row["sdk_over_pipeline"] = row["flide_sdk"] / row["pipeline"]
    summary[f"race_{args.clients}_clients_requests_per_s"] = row
    for key, row in summary.items():
        print(f"{key:40s} " + "  ".join(f"{name} {value:9.3f}" for name, value in row.items()), file=sys.stderr)
    print(f"memory after load (GiB): {  {k: round(v / 2**30, 2) for k, v in memory.items()} }", file=sys.stderr)
    print(f"max |dp| between the engines: {gaps}", file=sys.stderr)
    size = "tiny" if args.tiny else args.model_size
    name = f"vs_flide-{size}" + ("-fp8" if args.fp8 else "")
    result = {**run_metadata(" ".join(sys.argv)), "benchmark": "vs_flide", "model_size": size, **setup,
              "blocks": args.blocks, "turns": args.turns, "fp8": args.fp8, "load": loads,
              "memory_after_load_bytes": memory, "summary": summary, "targets": targets(summary, size, args.fp8),
              "max_abs_probability_difference": gaps,
              "blocks_values": lone_ms, "phases_s": phases.seconds}
    write_result(name, result)


if __name__ == "__main__":
    main()
