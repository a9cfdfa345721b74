"""The transformers baseline the engine benchmarks compare with, run in the same process on the same tokens.

Each question is its own sequence: the request's trunk + that question's branch, exactly the ids of
`engine.render(state, questions)`. A batch of such prompts is right-padded with an attention mask and run
through `Qwen3_5ForCausalLM` (bf16 on the GPU; the tiny model in float32 on CPU under --tiny); the answer is
the softmax over the question's label ids of the logits at the prompt's last real token. Only those rows go
through the output head (as `logits_to_keep` would for one sequence). Transformers uses
flash-linear-attention for the Gated DeltaNet layers when `fla` imports at the moment its Qwen3.5 module is
first imported (on the GPU machine: PYTHONPATH=/tmp/fla); `fla_status()` says which implementation it bound.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import latency_stats


@dataclass(frozen=True)
class Prompt:
    """One standalone question prompt: trunk + branch ids, and the ids of its option labels."""

    ids: np.ndarray
    label_ids: np.ndarray


def prompts_of(rendered, names: Sequence[str] | None = None) -> list[Prompt]:
    """The standalone prompts of a rendered request (`engine.render(state, questions)`), in question order."""
    names = list(rendered.questions) if names is None else names
    return [Prompt(rendered.prompt_ids(name), rendered.questions[name].label_ids) for name in names]


def prompt_tokens(prompts: Sequence[Prompt]) -> dict[str, int]:
    """Real tokens of a batch and the tokens the padded batch computes."""
    lengths = [len(p.ids) for p in prompts]
    return {"prompts": len(lengths), "real_tokens": int(sum(lengths)), "padded_tokens": len(lengths) * max(lengths)}


def _bound_implementation(function: Any) -> str | None:
    """The function a transformers `use_kernel_func_from_hub_with_fallback` wrapper calls (the package's kernel
    or the PyTorch fallback), read from the wrapper's closure."""
    seen = set()
    while function is not None and id(function) not in seen:
        seen.add(id(function))
        code, closure = getattr(function, "__code__", None), getattr(function, "__closure__", None)
        if code is not None and closure:
            cells = dict(zip(code.co_freevars, closure))
            if "implementation" in cells:
                bound = cells["implementation"].cell_contents
                return f"{getattr(bound, '__module__', '?')}.{getattr(bound, '__qualname__', repr(bound))}"
        function = getattr(function, "__wrapped__", None)
    return None


def fla_status() -> dict[str, Any]:
    """Whether `fla` (flash-linear-attention) imports, what transformers reports, and which Gated DeltaNet and
    short-convolution implementations its Qwen3.5 module bound."""
    status: dict[str, Any] = {}
    try:
        importlib.import_module("fla")
        status["fla_importable"] = True
    except Exception as error:  # noqa: BLE001 - any import failure means "not available"
        status["fla_importable"] = False
        status["fla_import_error"] = repr(error)[:300]
    for distribution in ("flash-linear-attention", "fla-core"):
        try:
            status[f"{distribution}_version"] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            status[f"{distribution}_version"] = None
    from transformers.utils import import_utils

    for check in ("is_flash_linear_attention_available", "is_causal_conv1d_available"):
        probe = getattr(import_utils, check, None)
        try:
            status[f"transformers_{check}"] = None if probe is None else bool(probe())
        except Exception as error:  # noqa: BLE001
            status[f"transformers_{check}"] = f"error: {error!r}"[:300]
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    bound = {name: _bound_implementation(getattr(modeling, name, None))
             for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn")}
    status["bound_implementations"] = bound
    chunk = bound["torch_chunk_gated_delta_rule"]
    status["transformers_uses_fla"] = None if chunk is None else chunk.startswith("fla")
    return status


def load_transformers(checkpoint: str | Path, dtype: torch.dtype, device: str):
    """`Qwen3_5ForCausalLM` from a text-layout checkpoint, in eval mode on `device`."""
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()


@dataclass
class PaddedBatch:
    ids: torch.Tensor  # [B, T] right-padded
    mask: torch.Tensor  # [B, T] 1 on real tokens
    last: torch.Tensor  # [B] index of each prompt's last real token
    labels: torch.Tensor  # [B, L] label ids, padded with 0
    label_valid: torch.Tensor  # [B, L]
    label_counts: list[int]


def pad_batch(prompts: Sequence[Prompt], device: str, pad_id: int = 0) -> PaddedBatch:
    lengths = [len(p.ids) for p in prompts]
    counts = [len(p.label_ids) for p in prompts]
    ids = torch.full((len(prompts), max(lengths)), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.zeros((len(prompts), max(counts)), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt.ids)] = torch.as_tensor(prompt.ids)
        mask[row, : len(prompt.ids)] = 1
        labels[row, : len(prompt.label_ids)] = torch.as_tensor(prompt.label_ids)
    valid = torch.arange(max(counts))[None, :] < torch.as_tensor(counts)[:, None]
    last = torch.as_tensor(lengths) - 1
    return PaddedBatch(ids.to(device), mask.to(device), last.to(device), labels.to(device), valid.to(device), counts)


@torch.inference_mode()
def run_batch(model, batch: PaddedBatch) -> list[np.ndarray]:
    """One forward of a padded batch; each prompt's label probabilities (float64, on the host)."""
    hidden = model.model(input_ids=batch.ids, attention_mask=batch.mask, use_cache=False).last_hidden_state
    rows = hidden[torch.arange(len(batch.last), device=hidden.device), batch.last]
    logits = model.lm_head(rows).float()
    picked = logits.gather(1, batch.labels).masked_fill(~batch.label_valid, float("-inf"))
    probabilities = torch.softmax(picked, dim=-1).double().cpu().numpy()
    return [probabilities[row, :count] for row, count in enumerate(batch.label_counts)]


def label_probabilities(model, prompts: Sequence[Prompt], device: str) -> list[np.ndarray]:
    """Each prompt's label probabilities from one padded batch."""
    return run_batch(model, pad_batch(prompts, device))


def _synchronize(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


class Baseline:
    """The transformers model plus the timing every benchmark uses for it."""

    def __init__(self, checkpoint: str | Path, device: str, dtype: str) -> None:
        self.device = device
        self.dtype = dtype
        self.fla = fla_status()  # before loading: reports the binding the model module made at import
        if str(device).startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()  # peak_memory_bytes() is then the baseline's alone
        self.model = load_transformers(checkpoint, getattr(torch, dtype), device)
        self.info = {
            "model": "transformers Qwen3_5ForCausalLM, each question as its own sequence (trunk + branch), "
                     "right-padded batch with attention mask, softmax over the label ids at the last real token",
            "dtype": dtype, "device": device,
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
            **self.fla,
        }

    def probabilities(self, prompts: Sequence[Prompt]) -> list[np.ndarray]:
        return label_probabilities(self.model, prompts, self.device)

    def time(self, prompts: Sequence[Prompt], warmup: int = 1, repeat: int = 3) -> tuple[dict[str, Any], list[np.ndarray]]:
        """Wall time of forward + label softmax + host copy + synchronize for one padded batch of `prompts`
        (the batch is built and copied to the device once, outside the timing); with the answers."""
        batch = pad_batch(prompts, self.device)
        answers = None
        for _ in range(warmup):
            answers = run_batch(self.model, batch)
        times = []
        for _ in range(repeat):
            _synchronize(self.device)
            started = time.perf_counter()
            answers = run_batch(self.model, batch)
            _synchronize(self.device)
            times.append(1000.0 * (time.perf_counter() - started))
        return {**latency_stats(times), **prompt_tokens(prompts)}, answers

    def peak_memory_bytes(self) -> int | None:
        return torch.cuda.max_memory_allocated() if str(self.device).startswith("cuda") else None


def max_abs_dp(ours: Sequence[np.ndarray], theirs: Sequence[np.ndarray]) -> float:
    """Largest |p_engine - p_baseline| over every option of every question."""
    return float(max(np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(ours, theirs)))
