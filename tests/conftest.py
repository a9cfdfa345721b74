"""Shared fixtures: the tiny checkpoint, engines over it, and transformers' float32 reference model."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # CI has no GPU: Triton kernels run in the interpreter (set before triton loads)

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import flide_sdk as fl
from flide_sdk.models.ops import reference_ops
from flide_sdk.prompt.base import Rendered
from flide_sdk.testing import tiny_checkpoint

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # xdist workers share the cores: no worker oversubscribes them
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

TOLERANCE = 1e-4  # max |delta p| against transformers in float32 (DESIGN.md §8); never loosen it
WORDS = (
    "the agent read the file and found an error in line 12 then it ran the test again and the test failed "
    "because the refund total was wrong so it opened the module to look at the function that returns the value"
).split()


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    return tiny_checkpoint()


@pytest.fixture(scope="module")
def single(tiny_path: Path):
    """One engine with no checkpoints: every ask computed from scratch, the answers others are compared to."""
    with fl.Engine.load(tiny_path, device="cpu", pool_bytes=0) as engine:
        yield engine


@pytest.fixture(scope="session")
def hf_tiny(tiny_path: Path):
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


@pytest.fixture
def engine(tiny_path: Path):
    with fl.Engine.load(tiny_path, device="cpu", dtype="float32") as engine:
        yield engine


class Gate:
    """Holds the engine's rounds at their first projection while closed, as a long round holds the device:
    the asks queued meanwhile stay queued (a test's busy engine, passed in as the engine's ops)."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self._holding = threading.Event()

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self._open.is_set():
            self._holding.set()
            assert self._open.wait(60), "a test left its gate closed"
        return reference_ops.linear(x, weight)

    @contextmanager
    def closed(self) -> Iterator[None]:
        """Rounds launched inside wait until the block exits."""
        self._holding.clear()
        self._open.clear()
        try:
            yield
        finally:
            self._open.set()

    def wait_held(self) -> None:
        """Wait until a round is held at the gate (from a coroutine: `await asyncio.to_thread(gate.wait_held)`)."""
        assert self._holding.wait(30), "no round reached the gate"


@contextmanager
def gated_engine(path: Path, **options) -> Iterator[tuple[fl.Engine, Gate]]:
    """A float32 CPU engine over `path` whose rounds pass `Gate` (open until a test closes it)."""
    with fl.Engine.load(path, device="cpu", dtype="float32") as loaded:
        model, prompt = loaded.model, loaded.prompt
    gate = Gate()
    with fl.Engine(model, prompt, torch.device("cpu"), ops=replace(reference_ops, linear=gate.linear),
                   **options) as engine:
        yield engine, gate


def text_of_tokens(tokens, target: int, seed: int = 0) -> str:
    """Prose whose token count (as a state string) is exactly `target`."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(tokens.encode(" ".join(words))) < target:
        words.append(rng.choice(WORDS))
    while len(tokens.encode(" ".join(words))) > target and words:
        words.pop()
    text = " ".join(words)
    filler = ["a", "b", "c", "d"]
    while len(tokens.encode(text)) < target:
        text += " " + filler[len(text) % 4]
    return text


def reference_probabilities(hf_model, rendered: Rendered, name: str) -> np.ndarray:
    """Option probabilities of transformers' model on the standalone prompt trunk + branch (float32)."""
    ids = torch.as_tensor(rendered.prompt_ids(name))[None]
    with torch.no_grad():
        logits = hf_model(ids).logits[0, -1].float()
    labels = torch.tensor(rendered.questions[name].label_ids)  # a copy: cached label ids are read-only
    return torch.softmax(logits[labels], dim=-1).numpy()


def answer_probabilities(answer) -> np.ndarray:
    """The option probabilities of an answer, in label order."""
    if isinstance(answer, fl.NoulAnswer):
        return np.array([answer.noul, 1.0 - answer.noul])
    return np.array(list(answer.probabilities.values()))
