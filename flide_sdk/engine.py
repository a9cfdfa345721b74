"""`Engine`: the public entry point. Loads a checkpoint, renders asks, and runs them through the round loop.

An ask is validated and rendered in the caller (errors raise there, and the engine stays usable), then
queued. The round thread lays every admitted ask out as one flat stream (`layout.plan_round`), runs the
model once, copies the label probabilities to the host in one transfer, and resolves each ask's future
with typed answers.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flide_sdk.errors import EngineClosedError
from flide_sdk.layout import RequestSpec, plan_round
from flide_sdk.models.checkpoint import load_model
from flide_sdk.models.qwen35 import Qwen35Model
from flide_sdk.ops import Ops, reference_ops
from flide_sdk.questions import Answer, Question, parse_questions
from flide_sdk.render import Rendered, Renderer
from flide_sdk.rounds import PendingAsk, RoundLoop

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


class _AskPayload:
    """What the round runner needs of one ask: its rendered ids and its parsed questions."""

    __slots__ = ("rendered", "questions")

    def __init__(self, rendered: Rendered, questions: dict[str, Question]) -> None:
        self.rendered = rendered
        self.questions = questions

    def request(self) -> RequestSpec:
        branches = list(self.rendered.questions.values())
        return RequestSpec(self.rendered.state_ids, [b.ids for b in branches], [b.label_ids for b in branches])


class Engine:
    """A loaded model serving asks. Build it with `Engine.load(path)` or `Engine.tiny()`."""

    def __init__(
        self,
        model: Qwen35Model,
        renderer: Renderer,
        device: torch.device,
        *,
        ops: Ops = reference_ops,
        max_round_tokens: int = 8192,
        round_deadline_ms: float = 1.0,
        name: str = "qwen3.5",
    ) -> None:
        self.model = model
        self.renderer = renderer
        self.device = device
        self.ops = ops
        self.name = name
        self._stats_lock = threading.Lock()
        self._stats = {"rounds": 0, "asks": 0, "questions": 0, "tokens_computed": 0, "eager_runs": 0, "round_seconds": 0.0}
        self._loop = RoundLoop(self._run_round, max_round_tokens, round_deadline_ms / 1000.0)

    @classmethod
    def load(
        cls,
        path: str | Path,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        *,
        max_prompt_tokens: int | None = None,
        max_round_tokens: int | None = None,
        round_deadline_ms: float = 1.0,
    ) -> Engine:
        """Load an HF-format Qwen3.5 checkpoint directory (text-only or release layout).

        device: "cuda" when available, else "cpu". dtype: bfloat16 on CUDA, float32 on CPU.
        max_prompt_tokens: longest standalone prompt accepted (default: the model's max positions).
        max_round_tokens: stream tokens per round before a round is split (default 16384 CUDA / 8192 CPU).
        """
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        model = load_model(path, device, _resolve_dtype(dtype, device))
        limit = max_prompt_tokens or model.config.max_position_embeddings
        renderer = Renderer.from_checkpoint(path, limit)
        capacity = max_round_tokens or (16384 if device.type == "cuda" else 8192)
        return cls(model, renderer, device, max_round_tokens=capacity, round_deadline_ms=round_deadline_ms, name=Path(path).name)

    @classmethod
    def tiny(cls, seed: int = 0, **load_options: Any) -> Engine:
        """The embedded default: a tiny random-weight Qwen3.5 on CPU (answers show the machinery, not judgement)."""
        from flide_sdk.testing import tiny_checkpoint

        load_options.setdefault("device", "cpu")
        return cls.load(tiny_checkpoint(seed), **load_options)

    # ----------------------------------------------------------------------------------------- asking
    def render(self, state: Any, questions: Any) -> Rendered:
        """The token-level view of an ask: trunk ids, and per question its branch ids, label ids and labels."""
        return self.renderer.render(state, parse_questions(questions))

    def _submit(self, state: Any, questions: Any) -> PendingAsk:
        if self._loop.closed:
            raise EngineClosedError("the engine is closed")
        parsed = parse_questions(questions)
        payload = _AskPayload(self.renderer.render(state, parsed), parsed)
        ask = PendingAsk(payload, payload.request().num_tokens)
        self._loop.submit(ask)
        return ask

    async def ask(self, state: Any, questions: Any) -> dict[str, Answer]:
        """Answer `questions` (name -> Noul/Choice/Score or dict) about `state` (a string, or JSON data)."""
        return await asyncio.wrap_future(self._submit(state, questions).future)

    def ask_sync(self, state: Any, questions: Any, timeout: float | None = None) -> dict[str, Answer]:
        """Blocking `ask`, for scripts. Do not call it from the engine's own callbacks."""
        return self._submit(state, questions).future.result(timeout)

    # ------------------------------------------------------------------------------------ round runner
    def _run_round(self, batch: list[PendingAsk]) -> None:
        started = time.perf_counter()
        try:
            host = plan_round([ask.payload.request() for ask in batch], self.model.config.conv_kernel)
            probabilities = self.model(host.to(self.device), self.ops).cpu().numpy()
        except Exception as error:  # a failed round fails its asks, never the loop
            for ask in batch:
                ask.future.set_exception(error)
            return
        results: list[dict[str, Answer]] = []
        row = 0
        for ask in batch:
            answers: dict[str, Answer] = {}
            for name, question in ask.payload.questions.items():
                count = len(ask.payload.rendered.questions[name].label_ids)
                answers[name] = question.answer(np.asarray(probabilities[row, :count], dtype=np.float64))
                row += 1
            results.append(answers)
        with self._stats_lock:
            self._stats["rounds"] += 1
            self._stats["eager_runs"] += 1
            self._stats["asks"] += len(batch)
            self._stats["questions"] += row
            self._stats["tokens_computed"] += host.num_tokens
            self._stats["round_seconds"] += time.perf_counter() - started
        for ask, answers in zip(batch, results):
            ask.future.set_result(answers)

    def stats(self) -> dict[str, float]:
        """Counters since start: rounds, asks, questions, tokens_computed, eager_runs, round_seconds."""
        with self._stats_lock:
            return dict(self._stats)

    # ---------------------------------------------------------------------------------------- lifecycle
    @property
    def closed(self) -> bool:
        return self._loop.closed

    def close(self) -> None:
        """Stop the engine: queued asks fail with EngineClosedError; a running round finishes first."""
        self._loop.close()

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._loop.close)

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"Engine({self.name!r}, device={self.device}, dtype={self.model.embed_tokens.weight.dtype}, {state})"
