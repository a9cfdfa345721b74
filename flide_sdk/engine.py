"""`Engine`: the public entry point. Loads a checkpoint and answers asks about one-off states or sessions.

The asking thread validates, renders and tokenizes an ask (bad input raises there, and the engine stays
usable), then queues it; the round thread (`serve.loop`) schedules, launches and finishes every round.
"""

from __future__ import annotations

import asyncio
import atexit
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from flide_sdk.device.graphs import BUFFERS
from flide_sdk.errors import EngineClosedError
from flide_sdk.images import Assets, decode_assets
from flide_sdk.models.checkpoint import DecoderModel, load_model, read_config, read_raw_config
from flide_sdk.models.fp8 import check_weights, holds_fp8, read_layout
from flide_sdk.models.gemma4_vision import GemmaVision, load_gemma_vision
from flide_sdk.models.ops import Ops, ops_for
from flide_sdk.models.qwen35_vision import Vision, load_vision
from flide_sdk.options import (
    MAX_PENDING,
    check_fp8,
    check_modes,
    check_options,
    on_device,
    resolve_device,
    resolve_dtype,
)
from flide_sdk.plan.layout import PAGE
from flide_sdk.prompt import PromptFormat, Rendered, load_format
from flide_sdk.prompt.base import as_rendered
from flide_sdk.questions import Questions, State, SystemOneResponse, parse_questions
from flide_sdk.serve.asks import Ask, AskGroup
from flide_sdk.serve.executor import build_executor
from flide_sdk.serve.loop import RoundLoop, Staging, submit_blocking
from flide_sdk.serve.stats import Stats
from flide_sdk.startup import Startup, load_kernels, memory_split, size, weight_bytes
from flide_sdk.text.history import Trunk
from flide_sdk.text.tokens import Tokens

if TYPE_CHECKING:
    from flide_sdk.session import Session

OPEN_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()  # closed at exit: a live round thread aborts finalizing


@atexit.register
def _close_open_engines() -> None:
    for engine in list(OPEN_ENGINES):
        engine.close()


class Engine:
    """A loaded model serving asks. Build it with `Engine.load(path)` or `Engine.tiny()`."""

    def __init__(
        self,
        model: DecoderModel,
        prompt: PromptFormat,
        device: torch.device,
        *,
        ops: Ops | None = None,
        pool_bytes: int | None = None,
        pool_checkpoints: int | None = None,
        max_round_tokens: int = 8192,
        max_round_requests: int = 64,
        round_deadline_ms: float = 0.0,
        max_pending: int = MAX_PENDING,
        graphs: bool | None = None,
        batch_invariant: bool = False,
        name: str = "qwen3.5",
        startup: Startup | None = None,
        vision: Vision | GemmaVision | None = None,
    ) -> None:
        check_options(model.config.max_position_embeddings, max_prompt_tokens=prompt.tokens.max_prompt_tokens,
                       pool_bytes=pool_bytes, pool_checkpoints=pool_checkpoints, max_round_tokens=max_round_tokens,
                       max_round_requests=max_round_requests, round_deadline_ms=round_deadline_ms,
                       max_pending=max_pending)
        fp8 = holds_fp8(model)
        check_modes(device, graphs, batch_invariant, custom_ops=ops is not None, moe=model.config.is_moe, fp8=fp8)
        self.model = model
        self.prompt = prompt  # how questions are written and read (`prompt.load_format`)
        self.tokens = prompt.tokens
        self.device = device
        self.batch_invariant = batch_invariant
        self.name = name
        self.max_round_tokens = max_round_tokens
        self.max_round_requests = max_round_requests
        startup = Startup(progress=False) if startup is None else startup
        self.weights_bytes = weight_bytes(model)
        self.weights = "fp8" if fp8 else str(model.embed_tokens.weight.dtype).removeprefix("torch.")
        startup.stage("weights", f"{size(self.weights_bytes)} on {device}" + (" (FP8 projections)" if fp8 else ""))
        self.kernel_bundle = load_kernels(device, startup)
        self._stats = Stats()
        ops = ops_for(device, batch_invariant, fp8) if ops is None else ops
        self._executor = build_executor(model, ops, self.tokens, pool_bytes, pool_checkpoints, max_round_tokens,
                                        max_round_requests, graphs if graphs is not None else device.type == "cuda",
                                        self._stats, name, startup, batch_invariant, vision)
        self.ops, self.pool = self._executor.ops, self._executor.pool  # ops: invariant projections need the ladder
        # rounds in flight at once: one per staging/readback buffer pair of the graphs (reused by the round after next)
        self._loop = RoundLoop(self._executor, deadline_s=round_deadline_ms / 1000.0, max_pending=max_pending,
                               depth=BUFFERS, device=device)
        self._staging = Staging(self._loop, self._stats)
        OPEN_ENGINES.add(self)
        self._stats.set(load_seconds=startup.elapsed())
        ladder = self._executor.graphs.ladder if self._executor.graphs else ()
        startup.stage("serving", f"{len(ladder)} CUDA graphs to capture in the background" if ladder else "")

    @classmethod
    def load(
        cls,
        path: str | Path,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        *,
        max_prompt_tokens: int | None = None,
        max_round_tokens: int | None = None,
        max_round_requests: int = 64,
        round_deadline_ms: float = 0.0,
        pool_bytes: int | None = None,
        pool_checkpoints: int | None = None,
        max_pending: int = MAX_PENDING,
        graphs: bool | None = None,
        batch_invariant: bool = False,
        rendering: str = "flide",
        progress: bool | None = None,
        weights: str = "auto",
    ) -> Engine:
        """Load an HF-format Qwen3.5 checkpoint directory, dense or MoE (text-only or release layout).

        device: "cuda" when available, else "cpu". dtype: bfloat16 on CUDA, float32 on CPU.
        max_prompt_tokens: longest standalone prompt accepted (default: the model's max positions).
        max_round_tokens: stream tokens per round before a round is split (default 16384 CUDA / 8192 CPU);
        max_round_requests: distinct trunks per round (each holds a scratch state row while it runs).
        round_deadline_ms: when the device is idle, how long a round waits for more asks (default: none).
        graphs: CUDA graphs of the round forward (default: on CUDA), captured in the background, smallest first,
        while the engine serves (`wait_for_graphs`); a round replays the smallest captured one it fits, else eager.
        pool_bytes: the checkpoint pool's cap: it takes memory as sessions need it, up to this (default: 64 sessions
        of 32k tokens, or 40% of the free device memory if less; 512 MiB at most on CPU);
        pool_checkpoints: how many checkpoints it holds at most (default: a quarter of the budget's worth).
        max_pending: queued asks before `ask` waits for room.
        batch_invariant: every answer keeps its bits whatever else shares its round, alone, forked or resumed
        (fixed-order products, attention and GDN chunks from each question's fork, checkpoints every 64 tokens).
        rendering: how questions are written into prompts: "flide" (flide_sdk's own), or "transformers" (the
        generic prompt of transformers' `pipeline("decision")`, whose probabilities it then gives). A decision
        model (`decision.json` / `decision_template.jinja`, a JEV head, a vLLM-style `decision_config.json`) is
        asked with its own prompt, labels, head and temperatures, as that pipeline asks it.
        progress: print the start-up stages and the graph capture on stderr (default: when it is a terminal).
        weights: "auto" (the checkpoint's own: the compute dtype, or FP8 for an FP8 checkpoint) or "fp8": the
        decoder's projections in float8_e4m3fn with a scale per output row, activations scaled per token (CUDA:
        Hopper or newer, bfloat16; docs/decisions/fp8-weights.md); embeddings, heads, norms and gates stay in `dtype`.
        """
        device = resolve_device(device)
        startup = Startup(progress, label=None if device.index is None else str(device))  # "cuda:1", not "cuda"
        dtype = resolve_dtype(dtype, device)
        check_weights(weights)
        config, _ = read_config(path)  # config, tokenizer and prompt files are checked before any weight is read
        fp8 = weights == "fp8" or read_layout(read_raw_config(Path(path)), Path(path) / "config.json") is not None
        if fp8:
            check_fp8(device, dtype)
        options = {"pool_bytes": pool_bytes, "pool_checkpoints": pool_checkpoints, "max_pending": max_pending,
                   "max_round_requests": max_round_requests, "round_deadline_ms": round_deadline_ms}
        check_options(config.max_position_embeddings, max_prompt_tokens=max_prompt_tokens,
                      max_round_tokens=max_round_tokens, **options)
        check_modes(device, graphs, batch_invariant, custom_ops=False, moe=config.is_moe, fp8=fp8)
        tokens = Tokens.from_checkpoint(path, max_prompt_tokens or config.max_position_embeddings, config.vocab_size)
        prompt = load_format(Path(path), read_raw_config(Path(path)), tokens, rendering)
        with on_device(device):  # what loading runs on the device runs on this one, the caller's device kept
            spec = prompt.spec
            model = load_model(path, device, dtype, spec and spec.head, spec and spec.adapter, weights)
            # None: the checkpoint reads no images
            vision = load_vision(path, device, dtype) or load_gemma_vision(path, device, dtype)
            return cls(model, prompt, device, graphs=graphs, batch_invariant=batch_invariant, name=Path(path).name,
                       startup=startup, vision=vision,
                       max_round_tokens=max_round_tokens or (16384 if device.type == "cuda" else 8192), **options)

    @classmethod
    def tiny(cls, seed: int = 0, **load_options: Any) -> Engine:
        """The embedded default: a tiny random-weight Qwen3.5 on CPU (answers show the machinery, not judgement)."""
        from flide_sdk.testing import tiny_checkpoint

        load_options.setdefault("device", "cpu")
        return cls.load(tiny_checkpoint(seed), **load_options)

    def render(self, state: State, questions: Questions, *, assets: Assets | None = None) -> Rendered:
        """The token-level view of an ask: trunk ids, and per question its branch ids, label ids and labels (a
        format's prompts may give questions trunks of their own: `Rendered.trunks`); images of `assets` as their
        tokens (pads expanded) where the state names them, as the checkpoint's processor places them."""
        parsed = parse_questions(questions)
        return as_rendered(self.prompt.parts(state, parsed, decode_assets(assets) or None))

    def session(self) -> Session:
        """A new, empty session: an agent's growing history whose asks resume from checkpoints."""
        from flide_sdk.session import Session

        return Session(self, self.prompt.new_state())

    def prepare(self, trunk: Trunk | State, questions: Questions, assets: Assets | None = None) -> Ask | AskGroup:
        """Validate `questions` and render them against a trunk (a session's snapshot, or a one-off state) and
        the images of `assets`: the queued form of an ask (a group of asks when the format's prompts give its
        questions several trunks). Bad input raises here (a bad image: InvalidAssetError)."""
        if self._loop.closed:
            raise EngineClosedError("the engine is closed")
        started, cpu_started = time.perf_counter(), time.thread_time()
        parsed = parse_questions(questions)
        decoded = decode_assets(assets) or None
        asks = [Ask(part.trunk, {name: parsed[name] for name in part.questions}, part.questions)
                for part in self.prompt.parts(trunk, parsed, decoded)]
        ask: Ask | AskGroup = asks[0] if len(asks) == 1 else AskGroup(asks, list(parsed))
        self._stats.add(submit_seconds=time.perf_counter() - started,
                        submit_cpu_seconds=time.thread_time() - cpu_started)
        return ask

    async def submit(self, ask: Ask | AskGroup, queue_timeout: float | None = None) -> SystemOneResponse:
        """Queue a prepared ask (waiting for room while the queue is full) and await its answers.
        queue_timeout: seconds to wait for room before raising QueueFullError (None: wait as long as it takes)."""
        if isinstance(ask, AskGroup):  # staged in this iteration together: they share a round
            futures = [self._staging.stage(one, queue_timeout) for one in ask.asks]
            return ask.merge(list(await asyncio.gather(*futures)))
        return await self._staging.stage(ask, queue_timeout)  # queued with this loop's asks of this iteration

    async def ask(self, state: State, questions: Questions, *, assets: Assets | None = None,
                  queue_timeout: float | None = None) -> SystemOneResponse:
        """Answer `questions` (name -> Noul/Choice/Score, a TypeSafe question, or a dict) about `state`
        (a string, or JSON data). The response maps each name to its answer and carries `model` and `usage`.
        assets: images by placeholder (an asset dict with `data_base64`, a PIL image, bytes or a path), seen
        wherever the state's text names them; decoded and checked here (InvalidAssetError) before anything is
        queued."""
        return await self.submit(self.prepare(state, questions, assets), queue_timeout)

    def ask_sync(
        self, state: State, questions: Questions, timeout: float | None = None, *, assets: Assets | None = None,
        queue_timeout: float | None = None,
    ) -> SystemOneResponse:
        """Blocking `ask`, for scripts. Do not call it from the engine's own callbacks."""
        return self.submit_sync(self.prepare(state, questions, assets), timeout, queue_timeout)

    def submit_sync(
        self, ask: Ask | AskGroup, timeout: float | None = None, queue_timeout: float | None = None
    ) -> SystemOneResponse:
        """Queue a prepared ask (waiting for room, at most `queue_timeout` s) and block until its answers arrive.
        After `timeout` s, AskTimeoutError; an ask no round has taken yet is withdrawn then (as when cancelled)."""
        asks = ask.asks if isinstance(ask, AskGroup) else [ask]
        responses = submit_blocking(self._loop, self._stats, asks, timeout, queue_timeout)
        return ask.merge(responses) if isinstance(ask, AskGroup) else responses[0]

    def wait_for_graphs(self, timeout: float | None = None) -> bool:
        """Block until no CUDA graph is left to capture (or capturing gave up); False after `timeout` s."""
        return self._executor.captured.wait(timeout)

    def clear_pool(self) -> None:
        """Evict every checkpoint not in use by a running round; their memory is given back once the device idles."""
        self._executor.clear_pool()
        self._loop.wake()

    def stats(self) -> dict[str, float]:
        """Counters since start (DESIGN.md §7), start-up times (`load_seconds`; `first_answer_ready_seconds`
        from the start of `load` to the first answered round, 0 before), pool occupancy and the memory split."""
        stats = self._stats.snapshot()
        with self._executor.pool_lock:
            full_pages, sliding_pages = self.pool.pages_in_use
            stats.update(pool_bytes=self.pool.used_bytes, pool_capacity_bytes=self.pool.capacity_bytes,
                         pool_pages=full_pages, pool_sliding_pages=sliding_pages,
                         checkpoints=self.pool.num_checkpoints, **self.pool.counters)
        stats.update(self._memory(stats))
        return stats

    def _memory(self, stats: dict[str, float]) -> dict[str, int]:
        return memory_split(self.weights_bytes, int(stats["graph_memory_bytes"]), self.pool.reserved_bytes,
                            self.pool.used_bytes, self.pool.allocator_bytes, self.device)

    def info(self) -> dict[str, Any]:
        """What this engine runs and with what memory: model shapes, device, dtype (`weights`: "fp8" when its
        projections are FP8, else the dtype), limits, the captured graph
        capacities (stream tokens; empty without graphs), and bytes of weights, checkpoint pool and graphs
        (`checkpoint_token_bytes`: the keys and values a checkpointed token takes in the pool within the sliding
        window, `checkpoint_bytes`: what a checkpoint of 2k, 20k and 200k tokens holds, sliding layers keeping
        their window's pages only (`StateLayout.checkpoint_bytes`); `attention_layers`:
        the layers that attend, full or sliding-window, `sliding_attention_layers` the latter)."""
        config = self.model.config
        return {
            "model": self.name,
            "device": str(self.device),
            "dtype": str(self.model.embed_tokens.weight.dtype).removeprefix("torch."),
            "weights": self.weights,
            "layers": config.num_layers,
            "attention_layers": sum(kind != "linear_attention" for kind in config.layer_types),
            "sliding_attention_layers": config.layer_types.count("sliding_attention"),
            "checkpoint_token_bytes": self.pool.page_bytes // PAGE,
            "checkpoint_bytes": {tokens: self.pool.layout.checkpoint_bytes(tokens, self.model.embed_tokens.weight.dtype)
                                 for tokens in (2_000, 20_000, 200_000)},
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "max_prompt_tokens": self.tokens.max_prompt_tokens,
            "max_round_tokens": self.max_round_tokens,
            "max_round_requests": self.max_round_requests,
            "batch_invariant": self.batch_invariant,
            "rendering": self.prompt.name,
            "decision": self.prompt.decision,
            "capacities": [] if self._executor.graphs is None else [c.tokens for c in self._executor.graphs.ladder],
            "kernel_bundle": None if self.kernel_bundle is None else str(self.kernel_bundle.bundle),
            "memory_bytes": self._memory(self._stats.snapshot()),
        }

    @property
    def closed(self) -> bool:
        return self._loop.closed

    def close(self) -> None:
        """Stop the engine: queued asks fail with EngineClosedError; launched rounds finish first. Then the
        checkpoint pool and the captured graphs are released (the model's weights stay with the engine)."""
        self._loop.close()
        if not self._loop.running:  # closed from the round thread itself: it releases nothing mid-round
            self._executor.release()

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

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
