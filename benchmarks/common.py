"""Shared benchmark plumbing: data location, random real-shape checkpoints, run metadata, JSON output.

Benchmarks run on the GPU machine with the project on PYTHONPATH and a copy of ../shared/data in
`.bench-data/` (git-ignored, carried to the device). Weights are random (no downloads): speed does not
depend on their values, and fidelity is measured against a float32 run of the same random weights.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("FLIDE_BENCH_DATA", ROOT / ".bench-data"))
MODEL_SIZES = ("0.8B", "2B", "4B")
GEMMA_SIZES = ("E2B", "E4B", "26B-A4B", "31B")  # Gemma 4 release shapes (engine benchmarks: --model-size E4B ...)


def data_path(*parts: str) -> Path:
    """A file of the shared data copy; a clear error if the copy is missing."""
    path = DATA.joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: copy ../shared/data to {DATA} (see benchmarks/README.md)")
    return path


def release_config(model_size: str) -> dict[str, Any]:
    family = "Gemma-4" if model_size in GEMMA_SIZES else "Qwen3.5"
    return json.loads(data_path("configs", f"{family}-{model_size}.json").read_text())


def build_random_checkpoint(model_size: str, target: Path, seed: int = 0) -> Path:
    """A text-layout (`qwen3_5_text`) Qwen3.5 checkpoint with the real config and tokenizer and random bf16
    weights, readable by flide_sdk and by transformers' Qwen3_5ForCausalLM alike; Gemma 4 sizes go to
    `build_random_gemma_checkpoint`."""
    if model_size in GEMMA_SIZES:
        return build_random_gemma_checkpoint(model_size, target, seed)
    from flide_sdk.models.checkpoint import random_state_dict, save_text_checkpoint
    from flide_sdk.models.qwen35 import Qwen35Config

    raw = release_config(model_size)
    tie = raw.get("tie_word_embeddings", raw["text_config"].get("tie_word_embeddings", False))
    text = {**raw["text_config"], "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
            "tie_word_embeddings": tie}
    config = Qwen35Config.from_text_config(text)
    weights = random_state_dict(config, seed=seed, dtype=torch.bfloat16, device="cuda")
    save_text_checkpoint(target, text, {name: tensor.cpu() for name, tensor in weights.items()})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data_path("tokenizer", "qwen3.5", name), target / name)
    return target



# Qwen3-VL's released image processor settings, which Qwen3.5's vision tower shares: 16-pixel patches, 2 x 2
# merge, 2 frames per patch, between 256^2 and 4096^2 pixels (preprocessor_config.json's `size`)
QWEN_IMAGE_PROCESSOR = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 65536,
                        "max_pixels": 16777216}


def build_random_vl_checkpoint(model_size: str, target: Path, seed: int = 0) -> Path:
    """A release-layout (`qwen3_5`, vision tower included) Qwen3.5 checkpoint with the release config, random bf16
    weights from transformers' own initialisation, the real tokenizer with a chat template that prints image
    blocks as Qwen3.5's does, and Qwen3-VL's image processor settings: what `pipeline("decision")` and both
    engines load."""
    from transformers import PreTrainedTokenizerFast, Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.vision_checkpoint import VL_CHAT_TEMPLATE

    config = Qwen3_5Config.from_dict(release_config(model_size))
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3_5ForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(target)
    del model
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(data_path("tokenizer", "qwen3.5", "tokenizer.json")),
                                        eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(target)
    Qwen2VLImageProcessorPil(**QWEN_IMAGE_PROCESSOR).save_pretrained(target)
    return target

GEMMA_VOCAB = 262144  # Gemma 4's vocabulary, every size


def gemma_text_corpus() -> list[str]:
    """Real English text of the shared data (reading passages, agent trajectories), one string per file."""
    files = sorted(data_path("reading").rglob("*.*")) + sorted(data_path("trajectories").rglob("*.json"))
    return [file.read_text(encoding="utf-8", errors="replace") for file in files if file.is_file()]


def synthetic_gemma_tokenizer(vocab_size: int = GEMMA_VOCAB, seed: int = 0):
    """A full-size tokenizer in Gemma's layout (`flide_sdk.testing.gemma_tokenizer`; no real Gemma tokenizer is on
    disk): merges trained as SentencePiece trains them on the shared data's text, then filled to `vocab_size`
    with random "▁"-led words, each made by a merge of its prefix and its last letter (so every token is one BPE
    can make, as in a real vocabulary). The speed of tokenizing does not depend on which tokens they are."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    from flide_sdk.testing import _GEMMA_TRAINING_SPLIT, gemma_base_vocab, gemma_tokenizer

    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(_GEMMA_TRAINING_SPLIT), behavior="isolated")
    vocab = gemma_base_vocab()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(vocab), show_progress=False)
    trainer_tokenizer.train_from_iterator(gemma_text_corpus(), trainer)
    learned = json.loads(trainer_tokenizer.model.__getstate__())
    for token, _ in sorted(learned["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    rng = np.random.default_rng(seed)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    for letter in ["\u2581", *letters]:
        vocab.setdefault(letter, len(vocab))
    while len(vocab) < vocab_size:
        word = "\u2581" + "".join(rng.choice(letters, rng.integers(2, 12)))
        for end in range(2, len(word) + 1):
            if len(vocab) >= vocab_size:
                break
            if word[:end] not in vocab:
                vocab[word[:end]] = len(vocab)
                merges.append((word[: end - 1], word[end - 1]))
    return gemma_tokenizer(vocab, merges)


def build_random_gemma_checkpoint(model_size: str, target: Path, seed: int = 0,
                                  shard_bytes: int = 4 << 30) -> Path:
    """A text-only (`gemma4_text`) Gemma 4 checkpoint with the release's text config, random bf16 weights (the
    shapes transformers' Gemma4ForCausalLM has, its tied head left out) in safetensors shards written one at a
    time, and a synthetic Gemma-layout tokenizer of the full vocabulary (no real one can be downloaded)."""
    from safetensors.torch import save_file
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from flide_sdk.testing import write_gemma_tokenizer

    text = {**release_config(model_size)["text_config"], "model_type": "gemma4_text",
            "architectures": ["Gemma4ForCausalLM"]}
    config = Gemma4TextConfig.from_dict(text)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in Gemma4ForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    target.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(seed)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * int(np.prod(shape))
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    index = {}
    for number, names in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: (0.02 * torch.randn(shapes[name], generator=generator, device=device)).bfloat16().cpu()
                   for name in names}
        save_file(tensors, str(target / file), metadata={"format": "pt"})
        index.update(dict.fromkeys(names, file))
        del tensors
    total = sum(2 * int(np.prod(shape)) for shape in shapes.values())
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": index}))
    config.save_pretrained(target)
    write_gemma_tokenizer(target, synthetic_gemma_tokenizer(config.vocab_size))
    return target


# The kernel benchmarks' rounds (issue 4), requests as (trunk tokens, branch tokens, cached tokens the trunk
# resumes after): (a) one 2,000-token trunk + 64 branches of 20; (b) 32 requests of 350 + 4 x 20; (c) 500 new
# trunk tokens after 8,000 cached + 4 x 20.
KERNEL_ROUNDS = {
    "a_one_trunk_64_branches": [(2000, [20] * 64, 0)],
    "b_32_requests": [(350, [20] * 4, 0)] * 32,
    "c_resumed_8000_cached": [(500, [20] * 4, 8000)],
}


def round_requests(spec: list[tuple[int, list[int], int]]) -> tuple[list, int]:
    """The requests of a kernel benchmark round (random ids, one label each) and the KV pages they resume
    over: request i, if it has cached tokens, resumes from pool slot i and pages of its own, numbered from 0."""
    from flide_sdk.plan.layout import PAGE, RequestSpec, Resume

    rng = np.random.default_rng(0)
    requests, pages = [], 0
    for slot, (trunk, branches, cached) in enumerate(spec):
        resume = None
        if cached:
            count = -(-cached // PAGE)
            resume = Resume(slot, np.arange(pages, pages + count))
            pages += count
        requests.append(RequestSpec.of(rng.integers(0, 100, trunk), [rng.integers(0, 100, b) for b in branches],
                                       [np.array([1])] * len(branches), start=cached, resume=resume))
    return requests, pages


def run_metadata(command: str) -> dict[str, Any]:
    """Commit, date, GPU, versions: what a committed result must say about where it came from."""
    commit = os.environ.get("FLIDE_COMMIT", "")
    if not commit:
        try:
            probe = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
            commit = probe.stdout.strip() if probe.returncode == 0 else ""
        except OSError:
            commit = ""
    import transformers
    import triton

    return {
        "date": datetime.date.today().isoformat(),
        "commit": commit or "unknown",
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "command": command,
    }


class Phases:
    """Wall seconds of a long benchmark's phases (`with phases("name"): ...`), each printed to stderr as it
    ends, so a run cut by a time limit still shows how far it got and how long each part took; `seconds`
    goes into the JSON."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.began = time.perf_counter()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        yield
        self.seconds[name] = round(time.perf_counter() - started, 2)
        print(f"[{time.perf_counter() - self.began:7.1f} s] {name}: {self.seconds[name]:.1f} s", file=sys.stderr,
              flush=True)


def write_result(name: str, result: dict[str, Any]) -> None:
    """Print the JSON and write it to $OUT/<name>.json when OUT is set."""
    text = json.dumps(result, indent=2, default=float)
    print(text)
    out = os.environ.get("OUT")
    if out:
        Path(out, f"{name}.json").write_text(text)


def cuda_time_ms(fn, warmup: int = 5, repeat: int = 30) -> dict[str, float]:
    """Median and p90 of `fn()` in milliseconds, timed with CUDA events after a warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return {"median_ms": times[len(times) // 2], "p90_ms": times[int(0.9 * (len(times) - 1))]}


def device_kernels(fn, repeat: int = 1, warmup: int = 3):
    """Device kernels (and memsets) of `repeat` calls of `fn` under torch.profiler, after `warmup` calls:
    ({"kernel", "calls", "ms"} per name, ms and calls per call of `fn`, longest first; the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
        if device_us > 0:
            rows.append({"kernel": event.key[:120], "calls": event.count / repeat, "ms": device_us / 1000 / repeat})
    rows.sort(key=lambda row: -row["ms"])
    return rows, prof


def median_ms(fn: Callable[[Any], Any], repeat: int, setup: Callable[[int], Any] = lambda i: i,
              warmup: int = 5) -> float:
    """Median wall time of `fn(setup(i))` in milliseconds, `setup` not timed (i counts calls)."""
    times = []
    for i in range(warmup + repeat):
        argument = setup(i)
        started = time.perf_counter_ns()
        fn(argument)
        times.append(time.perf_counter_ns() - started)
    return float(np.median(times[warmup:])) / 1e6


def wall_time_ms(fn, warmup: int = 2, repeat: int = 10) -> dict[str, float]:
    """Median and p90 wall-clock latency of `fn()` (which must finish its own work) in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return {"median_ms": times[len(times) // 2], "p90_ms": times[int(0.9 * (len(times) - 1))]}


def command_line() -> str:
    """The command that started this script, as run from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


# ------------------------------------------------------------------------------------- engine runs
PEAK_BF16_FLOPS = 790e12  # the dense bf16 rate model FLOP utilisation is measured against (H200)
STAGE_SUFFIX = "_seconds"


def add_engine_args(parser) -> None:
    """Options every engine benchmark takes: the model, the CPU smoke mode, graphs and the round deadline."""
    parser.add_argument("--model-size", default="0.8B", choices=MODEL_SIZES + GEMMA_SIZES)
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke test: flide_sdk.testing.tiny_checkpoint() in float32, small counts")
    parser.add_argument("--eager", action="store_true", help="load the engine with graphs=False")
    parser.add_argument("--round-deadline-ms", type=float, default=None,
                        help="engine round deadline (default: the engine's own)")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="the interpreter's thread switch interval for the run, in seconds (sys.setswitchinterval; "
                             "default: the interpreter's, 0.005). A process-wide setting of the host application, not "
                             "the engine's: with several clients the round thread waits for the GIL up to this long "
                             "while the asking thread prepares asks (docs/decisions/switch-interval.md)")


def bench_checkpoint(args) -> tuple[Path, dict[str, Any]]:
    """The checkpoint a run uses and where it runs: the tiny random model on CPU in float32 with --tiny,
    else a random real-shape checkpoint of --model-size on CUDA in bfloat16 (deleted when the process exits)."""
    if args.tiny:
        from flide_sdk.testing import tiny_checkpoint

        return tiny_checkpoint(), {"model": "tiny (flide_sdk.testing.tiny_checkpoint)", "device": "cpu",
                                   "dtype": "float32", "tiny": True}
    path = build_random_checkpoint(args.model_size, Path(tempfile.mkdtemp(prefix="flide-bench-")))
    atexit.register(shutil.rmtree, path, ignore_errors=True)  # 4B is ~9 GB of disk per script
    if args.model_size in GEMMA_SIZES:
        return path, {"model": f"Gemma-4-{args.model_size} shapes, random bf16 weights, synthetic Gemma-layout "
                               "tokenizer of the full vocabulary", "device": "cuda", "dtype": "bfloat16", "tiny": False}
    return path, {"model": f"Qwen3.5-{args.model_size} shapes, random bf16 weights, real tokenizer",
                  "device": "cuda", "dtype": "bfloat16", "tiny": False}


def load_engine(path: Path, device: str, dtype: str, graphs: bool, **options: Any):
    """`Engine.load` timed, then its graphs awaited; returns (engine, the options used and the times). Options
    that are None are left to the engine's defaults."""
    import flide_sdk as fl

    options = {key: value for key, value in options.items() if value is not None}
    started = time.perf_counter()
    engine = fl.Engine.load(path, device=device, dtype=dtype, graphs=graphs, **options)
    loaded = time.perf_counter()
    engine.wait_for_graphs()  # the workloads time replays, not the eager rounds of the background capture
    return engine, {"graphs": graphs, "load_options": options, "load_seconds": loaded - started,
                    "graphs_ready_seconds": time.perf_counter() - started, "switch_interval_s": sys.getswitchinterval(),
                    "memory_bytes": engine.info()["memory_bytes"]}  # weights, graphs, pool, work space after load


def engine_settings(args) -> tuple[bool, dict[str, Any]]:
    """(graphs, extra load options) from the common command-line options; sets the switch interval if given."""
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    graphs = not (args.tiny or args.eager)
    return graphs, {"round_deadline_ms": args.round_deadline_ms}


def release_device_memory() -> None:
    """Give the memory of dropped objects (a closed engine) back, before the baseline runs in the same process."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def pool_geometry(engine) -> dict[str, Any]:
    """Bytes of one checkpoint slot (recurrent states + conv windows) and of one KV page, when the engine's pool
    exposes them."""
    pool = getattr(engine, "pool", None)
    return {key: getattr(pool, key, None) for key in ("slot_bytes", "page_bytes", "num_slots", "num_pages")}


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Every counter of `engine.stats()` over a measured phase (after - before, whatever keys exist; gauges such
    as pool bytes are also given at the end), and per round, in milliseconds, every `*_seconds` stage."""
    delta = {key: after[key] - before.get(key, 0) for key in after if isinstance(after[key], (int, float))}
    rounds = delta.get("rounds", 0)
    per_round_ms = {
        key[: -len(STAGE_SUFFIX)] + "_ms": 1000.0 * value / rounds
        for key, value in delta.items() if key.endswith(STAGE_SUFFIX) and rounds
    }
    per_round = {key: delta[key] / rounds for key in ("asks", "questions", "tokens_computed") if rounds and key in delta}
    return {"delta": delta, "per_round_ms": per_round_ms, "per_round": per_round, "end": dict(after)}


def latency_stats(times_ms: list[float]) -> dict[str, float]:
    """Median, p90 (nearest rank), mean, min and max of a list of latencies in milliseconds."""
    values = np.sort(np.asarray(times_ms, dtype=np.float64))
    if not len(values):
        return {"n": 0}
    return {"n": len(values), "median_ms": float(np.median(values)),
            "p90_ms": float(values[int(np.ceil(0.9 * len(values))) - 1]), "mean_ms": float(values.mean()),
            "min_ms": float(values[0]), "max_ms": float(values[-1])}


def target(measured: float | None, bound: float, kind: str = "max") -> dict[str, Any]:
    """A measured value next to its target; `met` says whether it is within (kind "max": <=, "min": >=)."""
    met = None if measured is None else (measured <= bound if kind == "max" else measured >= bound)
    return {"measured": measured, "target": bound, "kind": kind, "met": met}


def non_embedding_parameters(model: torch.nn.Module) -> int:
    """Parameters outside the token embedding and the output head (the matmul work per token is twice this)."""
    return sum(p.numel() for name, p in model.named_parameters()
               if not name.startswith(("embed_tokens", "lm_head")))


def model_flop_utilisation(params: int, tokens: float, seconds: float, peak: float = PEAK_BF16_FLOPS) -> float:
    """non-embedding parameters x 2 x tokens computed / latency / peak rate (attention scores left out)."""
    return 2.0 * params * tokens / seconds / peak


def answer_probabilities(answer) -> np.ndarray:
    """An answer's option probabilities in option order (a Noul as [P(yes), P(no)])."""
    import flide_sdk as fl

    if isinstance(answer, fl.NoulAnswer):
        return np.array([answer.noul, 1.0 - answer.noul])
    return np.array(list(answer.probabilities.values()), dtype=np.float64)


# ------------------------------------------------------------------------------------------- data
RACE_SOURCE = "RACE dev/middle (non-commercial research)"
QUALITY_SOURCE = "QuALITY via L-Eval (CC BY 4.0)"
OPTION = re.compile(r"\(([A-D])\)\s*(.*?)(?=\s*\([A-D]\)|$)", re.DOTALL)


def quality_records() -> list[dict[str, Any]]:
    """The QuALITY articles (`input`) with their four-option questions (`instructions`)."""
    with data_path("reading", "quality", "quality.jsonl").open() as lines:
        return [json.loads(line) for line in lines if line.strip()]


def quality_choices(record: dict[str, Any]) -> dict[str, Any]:
    """A QuALITY record's questions as `fl.Choice` (options cut to 200 characters)."""
    import flide_sdk as fl

    questions = {}
    for index, text in enumerate(record["instructions"]):
        stem, _, rest = text.partition("\n\n")
        options = {label: body.strip()[:200] for label, body in OPTION.findall(rest)}
        if len(options) >= 2:
            questions[f"q{index}"] = fl.Choice(stem.strip(), options)
    return questions


def race_requests(count: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    """RACE passages (sorted by file name, the first `count`) with their questions as `fl.Choice`."""
    import flide_sdk as fl

    requests = []
    for path in sorted(data_path("reading", "race", "dev", "middle").glob("*.txt"))[:count]:
        record = json.loads(path.read_text())
        questions = {
            f"q{i}": fl.Choice(question.replace("_", "___"), dict(zip("ABCD", options)))
            for i, (question, options) in enumerate(zip(record["questions"], record["options"]))
        }
        requests.append((record["article"], questions))
    return requests


def token_count(renderer, text: str) -> int:
    return len(renderer.tokenizer.encode(text, add_special_tokens=False).ids)


def cut_tokens(renderer, text: str, start: int, count: int) -> str:
    """`count` tokens of `text` from token `start` (taken modulo the room there is), decoded back to text."""
    ids = renderer.tokenizer.encode(text, add_special_tokens=False).ids
    start = start % (len(ids) - count + 1) if len(ids) > count else 0
    return renderer.tokenizer.decode(ids[start : start + count])


# Yes/no questions about a story, each 15-20 tokens with the Qwen3.5 tokenizer (questions_per_state.py
# reports the lengths under whichever tokenizer it runs with).
STORY_QUESTIONS = (
    "Does the narrator describe a journey to another planet or moon somewhere in this passage?",
    "Is the main character in this passage a member of a ship's crew or an expedition?",
    "Does anyone in this passage openly lie to another character about something that matters to the plot?",
    "Is there a scene in this passage where two characters argue about what to do next?",
    "Does this passage mention a machine, robot or computer that can speak or think?",
    "Is the story in this passage told by a first-person narrator who takes part in it?",
    "Does a character in this passage receive a message, letter or radio signal from far away?",
    "Is any character in this passage described as being afraid for their own life?",
    "Does the passage describe a city, settlement or building in some visual detail?",
    "Is money, payment or a debt an important part of what happens in this passage?",
    "Does a character in this passage break a law, rule or explicit order from a superior?",
    "Is there any violence or physical fighting between two or more characters somewhere in this passage?",
    "Does the passage take place mostly aboard a spaceship, airship or other kind of vessel?",
    "Is a government, military or official authority mentioned as acting in this passage?",
    "Does any character in this passage express love or romantic interest in another character?",
    "Is the weather, the sky or the climate described in some detail in this passage?",
    "Does the passage include a spoken conversation between at least three of the different characters?",
    "Is one of the characters in this passage a scientist, doctor or engineer by profession?",
    "Does the passage suggest that the events take place in the future rather than the past?",
    "Is an animal or an alien creature described as doing something in this passage?",
    "Does a character in this passage make a discovery that surprises the other characters?",
    "Is anybody in this passage injured, sick or in need of urgent medical attention?",
    "Does the passage mention food, drink or a meal being shared between the characters?",
    "Is a character in this passage trying to escape from a place, a person or a situation?",
    "Does the narrator reveal a secret about his or her own past somewhere in this passage?",
    "Is there a misunderstanding between two of the characters that drives the action of this passage?",
    "Does the passage contain a joke, a pun or a moment that is clearly meant to be funny?",
    "Is a weapon such as a gun, a knife or a ray mentioned anywhere in this passage?",
    "Does any character in this passage mention their family, children or their home town?",
    "Is the passage made up mostly of description and reflection rather than of dialogue and action?",
    "Does a character in this passage give a long speech or explanation to the others?",
    "Is a journey over land, by sea or through the air under way during this passage?",
    "Does the passage describe a crowd, a meeting or a large public gathering of people?",
    "Is a character in this passage waiting for someone or something that has not yet arrived?",
    "Does a character in this passage change his or her mind about an important decision?",
    "Is a name of a real country, city or historical person mentioned in this passage?",
    "Does the passage describe a character's clothing, face or physical appearance in detail?",
    "Is there a clear antagonist in this passage who works against the main character?",
    "Does any character in this passage use a drug, a medicine or an alcoholic drink?",
    "Is the time of day, such as night, morning or evening, stated clearly in this passage?",
    "Does the passage mention a newspaper, a book, a report or some other written document?",
    "Is a character in this passage hiding something from the others in the same room?",
    "Does the passage describe a trade, a bargain or a negotiation between two parties?",
    "Is any character in this passage described as old, elderly or near the end of life?",
    "Does the passage include a flashback to events that happened to a character many years earlier?",
    "Is a character in this passage alone for a long time, without anyone to talk to?",
    "Does the passage describe a competition, a game or a contest between the characters?",
    "Is some piece of technology in this passage shown failing, breaking down or behaving unexpectedly?",
    "Does a character in this passage ask someone else for help with a serious problem?",
    "Is the main character of this passage described as being unusually clever or gifted?",
    "Does the passage mention a prison, a cell or anyone being held against their will?",
    "Is there a moment in this passage where a character laughs or smiles at someone else?",
    "Does the passage describe an explosion, a fire, a crash or a similar kind of disaster?",
    "Is a character in this passage described as working hard at a job or a daily task?",
    "Does any character in this passage travel back or forward in time by any means?",
    "Is the ending of this passage hopeful for the main character rather than bleak?",
    "Does the passage describe music, singing or one of the characters playing a musical instrument?",
    "Is any character in this passage a child, a teenager or otherwise clearly very young?",
    "Does the passage mention a disease, a plague or an epidemic affecting many people?",
    "Is a character in this passage pretending to be someone he or she is not?",
    "Does a character in this passage make a promise that the others expect him to keep?",
    "Is a ship, a vehicle or a machine being repaired or built by hand in this passage?",
    "Does the passage describe a landscape such as mountains, deserts, forests or oceans?",
    "Is anyone in this passage described as rich, powerful or of very high social rank?",
    "Does the passage mention an election, a vote or a decision made by a whole group?",
    "Is a character in this passage punished, fined or demoted for something they did?",
    "Does the passage end in the middle of an action scene or a moment of high tension?",
    "Is the relationship between two of the characters in this passage shown to be changing over time?",
)
