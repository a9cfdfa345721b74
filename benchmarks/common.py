"""Shared benchmark plumbing: data location, random real-shape checkpoints, run metadata, JSON output.

Benchmarks run on the GPU machine with the project on PYTHONPATH and a copy of ../shared/data in
`.bench-data/` (git-ignored, carried to the device). Weights are random (no downloads): speed does not
depend on their values, and fidelity is measured against a float32 run of the same random weights.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("FLIDE_BENCH_DATA", ROOT / ".bench-data"))
MODEL_SIZES = ("0.8B", "2B", "4B")


def data_path(*parts: str) -> Path:
    """A file of the shared data copy; a clear error if the copy is missing."""
    path = DATA.joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: copy ../shared/data to {DATA} (see benchmarks/README.md)")
    return path


def release_config(model_size: str) -> dict[str, Any]:
    return json.loads(data_path("configs", f"Qwen3.5-{model_size}.json").read_text())


def build_random_checkpoint(model_size: str, target: Path, seed: int = 0) -> Path:
    """A text-layout (`qwen3_5_text`) Qwen3.5 checkpoint with the real config and tokenizer and random bf16
    weights, readable by flide_sdk and by transformers' Qwen3_5ForCausalLM alike."""
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


def run_metadata(command: str) -> dict[str, Any]:
    """Commit, date, GPU, versions: what a committed result must say about where it came from."""
    commit = os.environ.get("FLIDE_COMMIT", "")
    if not commit:
        try:
            probe = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
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
