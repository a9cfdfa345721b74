"""`Engine`: the public entry point. Loads a checkpoint, renders asks, and runs them in rounds.

An ask is validated in the caller (errors raise there, and the engine stays usable), then queued; an
ask about a one-off state has its questions rendered and its state tokenized by the caller, or, when a
blocking caller finds the engine idle, by the round thread (its host stages ran faster there than on an
asking thread that slept through the last round; an error of those steps fails the ask's future alone).
A graph round alone on the device whose asks are all awaited on one event loop is finished by that loop
(`answer_on_loop`, `_watch`): it is awake when the round ends, so no thread hand-off lies on the answers'
path, and the same loop, still awake, prepares and launches its next ask itself. On the round
thread, `_select` admits queued asks with state-ready traversal (RadixFlow): each ask looks up the furthest
checkpoint matching its trunk; an ask that would resume from a checkpoint another admitted ask is producing
in this very round waits for the next round, while the scan goes on filling the round with independent
work, up to the round's token, request and question capacity.
`_launch` computes identical trunks once, plans each request's checkpoint save at its stable boundary,
lays everything out as one flat stream, and starts the model on it: the replay of the smallest captured
CUDA graph the round fits (`graphs.py`), or an eager forward (CPU, or a round larger than every graph).
It publishes the new checkpoints at once (device work is stream-ordered). `_finish` waits for the one
copy of the label probabilities to the host and resolves each ask's future with typed answers; the round
loop finishes round k after launching round k+1, so host and device work overlap.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from flide_sdk.device.graphs import BUFFERS, GraphRunner, Launch
from flide_sdk.device.pool import Checkpoint, CheckpointPool, PlannedSave
from flide_sdk.errors import AskTimeoutError, DeviceError, EngineClosedError, InvalidOptionError, QueueFullError
from flide_sdk.models.checkpoint import load_model, read_config
from flide_sdk.models.ops import Ops, ops_for
from flide_sdk.models.qwen35 import Qwen35Model
from flide_sdk.plan.capacity import Capacity, capacity_ladder
from flide_sdk.plan.layout import PAGE, Branches, HostRound, RequestSpec, Resume, RoundPlan, Save
from flide_sdk.questions import Answer, Question, Questions, State, SystemOneResponse, Usage, parse_questions
from flide_sdk.serve.loop import PendingAsk, RoundLoop
from flide_sdk.text.history import BLOCK, Trunk
from flide_sdk.text.render import Rendered, RenderedQuestion, Renderer, state_text

if TYPE_CHECKING:
    from flide_sdk.session import Session

LOG = logging.getLogger(__name__)
OPEN_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()
"""Engines not closed yet: closed at interpreter exit, so a script that never closes its engine exits cleanly
(a round thread still running while the interpreter finalizes aborted the process)."""


@atexit.register
def _close_open_engines() -> None:
    for engine in list(OPEN_ENGINES):
        engine.close()

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_POOL_BYTES = 512 << 20
CUDA_POOL_FRACTION = 0.4  # of the free device memory after the weights are loaded
# a graph round alone on the device is finished by the event loop awaiting its asks (`Engine._watch`): the loop
# polls the device from POLL_LEAD_S before the fastest of the graph's last REPLAY_WINDOW replays would end, and
# its lease runs LEASE_FACTOR x that time + LEASE_SLACK_S from the launch (the loop then gives the round back to
# the round thread, which also takes it once the lease has run out if asks queue behind it)
POLL_LEAD_S = 0.0003
REPLAY_WINDOW = 16
LEASE_FACTOR, LEASE_SLACK_S = 1.5, 0.001
SELECTOR_RESOLUTION_S = 0.001
DEFER_MIN_TOKENS = 64  # an ask waits for a checkpoint produced in the same round only if it saves this much
# (at least BLOCK: `_traverse` finds the producers an ask may wait for by the hash of their first block)
STAT_KEYS = (
    "rounds", "asks", "questions", "tokens_computed", "tokens_padded", "tokens_resumed", "checkpoint_hits",
    "checkpoint_misses", "graph_replays", "eager_runs", "deferred", "merged_trunks", "mutable_tail_tokens",
    "max_mutable_tail_tokens", "round_seconds", "submit_seconds", "queue_seconds", "select_seconds",
    "plan_seconds", "spec_seconds", "launch_seconds", "buffer_wait_seconds", "pad_seconds", "replay_call_seconds",
    "replay_seconds", "finish_seconds", "graphs_captured",
    "capture_seconds", "graph_memory_bytes", "submit_cpu_seconds", "plan_cpu_seconds", "launch_cpu_seconds",
)


def _resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to load on: cuda when available, else cpu; DeviceError for another kind or an absent GPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        raise DeviceError(f"device {device!r} is not a device name: give 'cpu', 'cuda' or 'cuda:N'") from error
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise DeviceError(f"device {device!r}: {why} (torch {torch.__version__}); load on 'cpu'")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise DeviceError(f"device {device!r}: only {torch.cuda.device_count()} CUDA devices are visible")
    elif resolved.type != "cpu":
        raise DeviceError(f"device {device!r} is not supported: flide_sdk runs on 'cpu' or 'cuda'")
    return resolved


def _resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise DeviceError(f"dtype must be one of {sorted(DTYPES)} (a name or the torch.dtype), got {dtype!r}")


def _check_options(positions: int, **options: float | None) -> None:
    """Refuse an engine option out of range (None: its default). Sizes are positive integers (pool budgets may
    be 0: no checkpoints), the deadline a finite number of milliseconds, prompts within the model's positions."""
    for name, value in options.items():
        if value is None:
            continue
        if name == "round_deadline_ms":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")
            expected = "a finite number of milliseconds >= 0"
        else:
            low = 0 if name == "pool_bytes" else 1
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
            expected = f"an integer >= {low}"
        if not ok:
            raise InvalidOptionError(f"{name} must be {expected}, got {value!r}")
    if options.get("max_prompt_tokens") is not None and options["max_prompt_tokens"] > positions:
        raise InvalidOptionError(f"max_prompt_tokens={options['max_prompt_tokens']} is more than the model's "
                                 f"{positions} positions (max_position_embeddings)")


def _default_pool_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_POOL_FRACTION)
    return CPU_POOL_BYTES


class AskPayload:
    """One ask on its way through the round thread: trunk, questions, their branches (laid out once, when
    the ask is prepared, so the round thread only concatenates them), the resume point."""

    __slots__ = ("branch_tokens", "branches", "first_block", "label_counts", "questions", "rendered", "resume", "trunk",
                 "trunk_key")

    def __init__(self, trunk: Trunk, questions: dict[str, Question], rendered: dict[str, RenderedQuestion]) -> None:
        self.trunk = trunk
        self.questions = questions
        self.rendered = rendered
        self.branches = Branches.of([q.ids for q in rendered.values()], [q.label_ids for q in rendered.values()])
        self.branch_tokens = int(self.branches.lengths.sum())
        self.label_counts = [len(rendered[name].label_ids) for name in questions]  # each question's labels, in order
        self.resume: Checkpoint | None = None
        # equal for asks with the same trunk (`same_trunk` holds only between asks with equal keys)
        self.trunk_key = (len(trunk), trunk.boundary, trunk.block_hash(trunk.boundary // BLOCK))
        # hash of the first BLOCK tokens (None if shorter): equal for an ask and any producer it `waits_for`
        self.first_block = trunk.block_hash(1) if len(trunk) >= BLOCK else None

    @property
    def resume_length(self) -> int:
        return 0 if self.resume is None else self.resume.length

    def same_trunk(self, other: AskPayload) -> bool:
        a, b = self.trunk, other.trunk
        return (
            len(a) == len(b)
            and a.boundary == b.boundary
            and a.block_hash(a.boundary // BLOCK) == b.block_hash(b.boundary // BLOCK)  # stored hashes: a quick no
            and np.array_equal(a.tail, b.tail)
            and a.prefix_equals(b.buffer, b.boundary)
        )

    def waits_for(self, producer: AskPayload) -> bool:
        """Whether this ask should resume from the checkpoint `producer` writes in the current round
        (worth a round's wait only when it saves at least DEFER_MIN_TOKENS of trunk)."""
        at = producer.trunk.boundary
        if not self.resume_length + DEFER_MIN_TOKENS <= at < len(self.trunk) or at <= producer.resume_length:
            return False
        blocks = at // BLOCK  # when both hashes are stored, they give a quick no before comparing tokens
        ours = self.trunk.block_hash(blocks) if blocks <= self.trunk.boundary // BLOCK else None
        if ours is not None and ours != producer.trunk.block_hash(blocks):
            return False
        return self.trunk.prefix_equals(producer.trunk.buffer, at) and not self.same_trunk(producer)


@dataclass(eq=False)
class InFlight:
    """A launched round: its asks (grouped by shared trunk), real stream tokens, and its probabilities
    (a `Launch` to wait for, or the array itself when the round ran eagerly)."""

    groups: list[list[PendingAsk]]
    tokens: int
    result: Launch | np.ndarray
    started: float


class Engine:
    """A loaded model serving asks. Build it with `Engine.load(path)` or `Engine.tiny()`."""

    def __init__(
        self,
        model: Qwen35Model,
        renderer: Renderer,
        device: torch.device,
        *,
        ops: Ops | None = None,
        pool_bytes: int | None = None,
        pool_checkpoints: int | None = None,
        max_round_tokens: int = 8192,
        max_round_requests: int = 64,
        round_deadline_ms: float = 0.0,
        max_pending: int = 4096,
        graphs: bool | None = None,
        answer_on_loop: bool = True,
        name: str = "qwen3.5",
    ) -> None:
        _check_options(model.config.max_position_embeddings, max_prompt_tokens=renderer.max_prompt_tokens,
                       pool_bytes=pool_bytes, pool_checkpoints=pool_checkpoints, max_round_tokens=max_round_tokens,
                       max_round_requests=max_round_requests, round_deadline_ms=round_deadline_ms,
                       max_pending=max_pending)
        self.model = model
        self.renderer = renderer
        self.device = device
        self.ops = ops_for(device) if ops is None else ops
        self.name = name
        dtype = model.embed_tokens.weight.dtype
        budget = _default_pool_bytes(device) if pool_bytes is None else pool_bytes
        self.pool = CheckpointPool(model.config, device, dtype, budget, pool_checkpoints, max_round_requests)
        self._caches = self.pool.layer_caches()
        self._pool_lock = threading.Lock()  # the round thread holds it while it reads or changes the pool
        self._stats_lock = threading.Lock()
        self._stats: dict[str, float] = dict.fromkeys(STAT_KEYS, 0)
        self.max_round_requests = max_round_requests
        self.answer_on_loop = answer_on_loop
        self._replays: dict[Capacity, deque[float]] = {}  # device seconds of each graph's last replays
        self.max_round_questions = max_round_tokens  # every question has at least one branch token
        self.max_round_pages: int | None = None  # history pages the resumed asks of a round read (graphs: a limit)
        self._graphs: GraphRunner | None = None
        if graphs if graphs is not None else device.type == "cuda":
            if device.type != "cuda":
                raise DeviceError("CUDA graphs need a CUDA device (graphs=True on cpu)")
            ladder = capacity_ladder(model.config.conv_kernel, max_round_tokens, max_round_requests,
                                     renderer.max_prompt_tokens)
            self._graphs = GraphRunner(model, self.ops, self._caches, ladder, self.pool.state_rows,
                                       self.pool.window_sink, self.pool.kv_sink)
            report = self._graphs.capture()
            self.max_round_questions = ladder[-1].questions
            self.max_round_pages = ladder[-1].pages
            self._stats.update(graphs_captured=report.graphs, capture_seconds=report.seconds,
                               graph_memory_bytes=report.memory_bytes)
        # rounds in flight at once: one per staging/readback buffer of the graphs (a buffer and its events
        # are reused by the round after next, launched once this one is finished)
        self._loop = RoundLoop(self._select, self._launch, self._finish, max_round_tokens,
                               round_deadline_ms / 1000.0, max_pending, depth=BUFFERS,
                               launch_in_caller=None if self._graphs is None else self._fits_a_graph,
                               watch=self._watch)
        OPEN_ENGINES.add(self)

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
        max_pending: int = 4096,
        graphs: bool | None = None,
        answer_on_loop: bool = True,
    ) -> Engine:
        """Load an HF-format Qwen3.5 checkpoint directory (text-only or release layout).

        device: "cuda" when available, else "cpu". dtype: bfloat16 on CUDA, float32 on CPU.
        max_prompt_tokens: longest standalone prompt accepted (default: the model's max positions).
        max_round_tokens: stream tokens per round before a round is split (default 16384 CUDA / 8192 CPU);
        max_round_requests: distinct trunks per round (each holds a scratch state row while it runs).
        round_deadline_ms: when the device is idle, how long a round waits for more asks (default: none).
        graphs: capture CUDA graphs of the round forward at start (default: on CUDA); rounds then replay the
        smallest graph they fit, and only a round larger than max_round_tokens runs eagerly.
        pool_bytes: checkpoint pool budget (default 40% of free device memory on CUDA, 512 MiB on CPU);
        pool_checkpoints: how many checkpoints it holds at most (default: a quarter of the budget's worth).
        max_pending: queued asks before `ask` waits for room.
        answer_on_loop: a graph round alone on the device whose asks are all awaited on one event loop is
        finished by that loop: it sleeps until shortly before the round's expected end, polls the device on
        each pass, and computes the answers itself, so no hand-off between threads lies on the answers' path
        (it costs the loop's thread a core for a fraction of a millisecond per round). False: the round
        thread finishes every round.
        """
        device = _resolve_device(device)
        dtype = _resolve_dtype(dtype, device)
        config, _ = read_config(path)  # config, tokenizer and template are checked before any weight is read
        _check_options(config.max_position_embeddings, max_prompt_tokens=max_prompt_tokens, pool_bytes=pool_bytes,
                       pool_checkpoints=pool_checkpoints, max_round_tokens=max_round_tokens,
                       max_round_requests=max_round_requests, round_deadline_ms=round_deadline_ms,
                       max_pending=max_pending)
        renderer = Renderer.from_checkpoint(path, max_prompt_tokens or config.max_position_embeddings, config.vocab_size)
        model = load_model(path, device, dtype)
        return cls(
            model, renderer, device,
            pool_bytes=pool_bytes,
            pool_checkpoints=pool_checkpoints,
            max_round_tokens=max_round_tokens or (16384 if device.type == "cuda" else 8192),
            max_round_requests=max_round_requests,
            round_deadline_ms=round_deadline_ms,
            max_pending=max_pending,
            graphs=graphs,
            answer_on_loop=answer_on_loop,
            name=Path(path).name,
        )

    @classmethod
    def tiny(cls, seed: int = 0, **load_options: Any) -> Engine:
        """The embedded default: a tiny random-weight Qwen3.5 on CPU (answers show the machinery, not judgement)."""
        from flide_sdk.testing import tiny_checkpoint

        load_options.setdefault("device", "cpu")
        return cls.load(tiny_checkpoint(seed), **load_options)

    # ----------------------------------------------------------------------------------------- asking
    def render(self, state: State, questions: Questions) -> Rendered:
        """The token-level view of an ask: trunk ids, and per question its branch ids, label ids and labels."""
        return self.renderer.render(state, parse_questions(questions))

    def session(self) -> Session:
        """A new, empty session: an agent's growing history whose asks resume from checkpoints."""
        from flide_sdk.session import Session

        return Session(self, self.renderer.new_history())

    def prepare(self, trunk: Trunk, questions: Questions) -> PendingAsk:
        """Validate questions against a trunk and build the queued form of the ask (raises on bad input)."""
        if self._loop.closed:
            raise EngineClosedError("the engine is closed")
        started, cpu_started = time.perf_counter(), time.thread_time()
        parsed = parse_questions(questions)
        ask = PendingAsk(None, 0)
        self._fill(ask, trunk, parsed, self.renderer.render_questions(parsed))
        self._count_submit(started, cpu_started)
        return ask

    async def submit(self, ask: PendingAsk, queue_timeout: float | None = None) -> SystemOneResponse:
        """Queue a prepared ask (waiting for room while the queue is full) and await its answers.

        queue_timeout: seconds to wait for room before raising QueueFullError (None: wait as long as it takes).
        """
        waits = self._room_waits(queue_timeout)
        ask.awaited_on = asyncio.get_running_loop()
        if self.answer_on_loop and self._graphs is not None:
            ask.prepare_now()  # this loop is awake when it finishes a round (`_poll`): no hand-off needed
        while not self._loop.try_submit(ask):
            await asyncio.sleep(next(waits))
        return await asyncio.wrap_future(ask.future)

    async def ask(self, state: State, questions: Questions, *, queue_timeout: float | None = None) -> SystemOneResponse:
        """Answer `questions` (name -> Noul/Choice/Score, a TypeSafe question, or a dict) about `state`
        (a string, or JSON data). The response maps each name to its answer and carries `model` and `usage`."""
        return await self.submit(self._state_ask(state, questions), queue_timeout)

    def ask_sync(
        self, state: State, questions: Questions, timeout: float | None = None, *, queue_timeout: float | None = None
    ) -> SystemOneResponse:
        """Blocking `ask`, for scripts. Do not call it from the engine's own callbacks."""
        return self.submit_sync(self._state_ask(state, questions), timeout, queue_timeout)

    def _state_ask(self, state: State, questions: Questions) -> PendingAsk:
        """The queued form of an ask about a one-off state, its questions and state validated (bad input raises
        here), rendering the questions and tokenizing the state left for later: to the round thread when the ask
        finds the engine idle, to the submitting thread otherwise (`RoundLoop.try_submit`). An error of those
        steps (a state too long for the model, a question with more options than single-token labels) then fails
        the ask's future (one raised in the caller otherwise). The asking thread has slept through the previous
        ask's round, the round thread has just waited for the device: on the H200's host, in one device call, a
        lone ask's submit took 2.80 -> 2.11 ms at Q = 1 with the state tokenized there, plan 0.71 -> 0.54, launch
        0.62 -> 0.47, its latency 11.11 -> 10.48 ms (Q = 64: 20.35 -> 18.71;
        `2026-12-01-questions_per_state-0.8B-handoff-ab.json`); with a RACE passage's four new questions rendered
        there too, its lone latency went from 5.71 / 5.11 / 4.81 to 4.98 / 4.75 / 4.99 ms in alternating blocks
        of 25 asks (`2026-12-01-host-ab-h200.json`). An ask awaited on an event loop of a graph engine with
        `answer_on_loop` is prepared by that loop at once (`submit`): the loop finished the previous round itself
        (`_poll`), so it did not sleep through its end."""
        if self._loop.closed:
            raise EngineClosedError("the engine is closed")
        started, cpu_started = time.perf_counter(), time.thread_time()
        parsed = parse_questions(questions)
        text = state_text(state)
        ask = PendingAsk(None, 0)
        ask.prepare = functools.partial(self._prepare_text, ask, text, parsed)
        self._count_submit(started, cpu_started)
        return ask

    def _prepare_text(self, ask: PendingAsk, text: str, parsed: dict[str, Question]) -> None:
        """Render the questions and tokenize a one-off state's text into `ask` (its time counts in submit_seconds)."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        rendered = self.renderer.render_questions(parsed)
        self._fill(ask, self.renderer.trunk(text), parsed, rendered)
        self._count_submit(started, cpu_started)

    def _fill(self, ask: PendingAsk, trunk: Trunk, parsed: dict[str, Question],
              rendered: dict[str, RenderedQuestion]) -> None:
        self.renderer.check_length(len(trunk), rendered)
        ask.payload = AskPayload(trunk, parsed, rendered)
        ask.tokens = trunk.fresh + ask.payload.branch_tokens

    def _count_submit(self, started: float, cpu_started: float) -> None:
        with self._stats_lock:
            self._stats["submit_seconds"] += time.perf_counter() - started
            self._stats["submit_cpu_seconds"] += time.thread_time() - cpu_started

    def _prepare_state(self, state: State, questions: Questions) -> PendingAsk:
        """An ask about a one-off state prepared on this thread (benchmarks time its launch alone)."""
        ask = self._state_ask(state, questions)
        ask.prepare_now()
        return ask

    def submit_sync(
        self, ask: PendingAsk, timeout: float | None = None, queue_timeout: float | None = None
    ) -> SystemOneResponse:
        """Queue a prepared ask (waiting for room, at most `queue_timeout` s) and block until its answers arrive.

        After `timeout` s, AskTimeoutError; an ask no round has taken yet is withdrawn then, as a cancelled
        async ask is."""
        if queue_timeout is None:
            self._loop.submit(ask)
        else:
            waits = self._room_waits(queue_timeout)
            while not self._loop.try_submit(ask):
                time.sleep(next(waits))
        try:
            return ask.future.result(timeout)
        except concurrent.futures.TimeoutError:
            if ask.future.cancel():
                raise AskTimeoutError(float(timeout), withdrawn=True) from None
            if ask.future.done():  # answered just now
                return ask.future.result()
            raise AskTimeoutError(float(timeout), withdrawn=False) from None

    def _room_waits(self, queue_timeout: float | None) -> Iterator[float]:
        """Growing pauses between attempts to queue an ask; QueueFullError once `queue_timeout` has passed,
        with a retry hint of one mean round."""
        deadline = None if queue_timeout is None else time.monotonic() + queue_timeout
        delay = 0.0005
        while deadline is None or time.monotonic() < deadline:
            yield delay
            delay = min(delay * 2, 0.05)
        with self._stats_lock:
            rounds, seconds = self._stats["rounds"], self._stats["round_seconds"]
        retry_after_ms = max(1, round(1000 * seconds / rounds)) if rounds else max(1, round(1000 * self._loop.deadline_s))
        raise QueueFullError(float(queue_timeout), retry_after_ms)

    @contextmanager
    def admission_paused(self) -> Iterator[None]:
        """Test hook: asks queued inside this block are admitted together when it exits."""
        with self._loop.hold():
            yield

    def clear_pool(self) -> None:
        """Evict every checkpoint not in use by a running round."""
        with self._pool_lock:
            self.pool.clear()

    # ------------------------------------------------------------------------------------ round thread
    def _select(self, pending: deque[PendingAsk]) -> list[PendingAsk]:
        """State-ready traversal over the queue; runs on the round thread with the queue locked."""
        started = time.perf_counter()
        with self._pool_lock:
            selected = self._traverse(pending)
        with self._stats_lock:
            self._stats["select_seconds"] += time.perf_counter() - started
        return selected

    def _traverse(self, pending: deque[PendingAsk]) -> list[PendingAsk]:
        # with graphs a round must fit the largest capacity: one padding token past its real tokens, and the
        # history pages of its resumed asks (a round of 32 long agent sessions ran eagerly without this check:
        # compiling the eager shapes stalled every agent for 5 s on the H200, agent_replay at ee6c036)
        capacity = self._loop.max_round_tokens - (self._graphs is not None)
        selected: list[PendingAsk] = []
        by_trunk: dict[tuple[int, int, int], list[AskPayload]] = {}  # selected asks, indexed for the scan
        by_first_block: dict[int, list[AskPayload]] = {}
        kept: deque[PendingAsk] = deque()
        tokens = requests = questions = pages = 0
        deferred = 0
        while pending:
            ask = pending.popleft()
            payload: AskPayload = ask.payload
            if ask.future.cancelled():
                continue
            resume = self.pool.lookup(payload.trunk)
            payload.resume = resume
            if any(payload.waits_for(other) for other in by_first_block.get(payload.first_block, ())):
                kept.append(ask)
                deferred += 1
                continue
            merged = any(payload.same_trunk(other) for other in by_trunk.get(payload.trunk_key, ()))
            cost = payload.branch_tokens + (0 if merged else len(payload.trunk) - payload.resume_length)
            history = 0 if merged else -(-payload.resume_length // PAGE)
            full = (tokens + cost > capacity or requests + (not merged) > self.max_round_requests
                    or questions + len(payload.branches) > self.max_round_questions
                    or self.max_round_pages is not None and pages + history > self.max_round_pages)
            if selected and full:
                kept.append(ask)
                continue
            if not ask.future.set_running_or_notify_cancel():
                continue
            if resume is not None:
                self.pool.pin(resume)
            selected.append(ask)
            by_trunk.setdefault(payload.trunk_key, []).append(payload)
            if payload.first_block is not None:
                by_first_block.setdefault(payload.first_block, []).append(payload)
            tokens += cost
            requests += not merged
            questions += len(payload.branches)
            pages += history
        pending.extend(kept)
        if deferred:
            with self._stats_lock:
                self._stats["deferred"] += deferred
        return selected

    def _fits_a_graph(self, ask: PendingAsk) -> bool:
        """Whether `ask` alone fits the largest captured graph even with no checkpoint to resume from (its
        round then replays a graph: launching it returns at once, so the asking thread may do it)."""
        payload: AskPayload = ask.payload
        largest = self._graphs.ladder[-1]
        return len(payload.trunk) + payload.branch_tokens < largest.tokens and len(payload.branches) <= largest.questions

    def _launch(self, batch: list[PendingAsk]) -> InFlight | None:
        """Plan a round, start it on the device, and publish its checkpoints (device work is stream-ordered,
        so a later round reading them runs after this one wrote them). None if it failed (asks resolved)."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        groups: list[list[PendingAsk]] = []
        by_trunk: dict[tuple[int, int, int], list[list[PendingAsk]]] = {}
        for ask in batch:
            candidates = by_trunk.setdefault(ask.payload.trunk_key, [])
            group = next((g for g in candidates if g[0].payload.same_trunk(ask.payload)), None)
            if group is None:
                groups.append([ask])
                candidates.append(groups[-1])
            else:
                group.append(ask)
        saves: list[PlannedSave] = []
        with self._pool_lock:
            try:
                specs = []
                for group in groups:
                    spec, save = self._request_spec(group)
                    specs.append(spec)
                    if save is not None:
                        saves.append(save)
                specified = time.perf_counter()
                plan = RoundPlan(specs, self.model.config.conv_kernel, self.pool.state_rows, self.pool.kv_sink)
                planned, cpu_planned = time.perf_counter(), time.thread_time()
                self.pool.copy_pages([copy for save in saves for copy in save.page_copies])
                launch = None if self._graphs is None else self._graphs.launch(plan)
                result = launch if launch is not None else self._run_eager(plan.host_round())
            except Exception as error:  # a failed round fails its asks, never the loop
                for save in saves:
                    self.pool.abort(save)
                self._unpin(batch)
                for ask in batch:
                    ask.future.set_exception(error)
                return None
            self._unpin(batch)
            for save in saves:
                self.pool.commit(save)
        launched, cpu_launched = time.perf_counter(), time.thread_time()
        with self._stats_lock:
            self._stats["queue_seconds"] += sum(started - ask.queued_at for ask in batch)
            self._stats["plan_seconds"] += planned - started
            self._stats["spec_seconds"] += specified - started
            self._stats["launch_seconds"] += launched - planned
            self._stats["plan_cpu_seconds"] += cpu_planned - cpu_started
            self._stats["launch_cpu_seconds"] += cpu_launched - cpu_planned
            if launch is not None:
                for key, seconds in launch.host_seconds.items():
                    self._stats[key] += seconds
            self._stats["graph_replays" if launch is not None else "eager_runs"] += 1
            self._stats["tokens_padded"] += plan.num_real if launch is None else launch.capacity.tokens
        self.renderer.words.fill_chunks()  # the device computes meanwhile: cache the chunks of new texts now
        return InFlight(groups, plan.num_real, result, started)

    def _run_eager(self, host: HostRound) -> np.ndarray:
        return self.model(host.to(self.device), self.ops, self._caches).cpu().numpy()

    def _finish(self, flight: InFlight) -> None:
        """Wait for a launched round and resolve its asks."""
        waited = time.perf_counter()
        result = flight.result
        probabilities = result.wait() if isinstance(result, Launch) else result
        finished = time.perf_counter()
        answers = self._answers(flight.groups, probabilities)
        self._count_round(flight.groups, flight.tokens, finished - flight.started)
        with self._stats_lock:
            self._stats["finish_seconds"] += finished - waited
            if isinstance(result, Launch):
                device = result.device_seconds()
                self._replays.setdefault(result.capacity, deque(maxlen=REPLAY_WINDOW)).append(device["replay_seconds"])
                for key, seconds in device.items():
                    self._stats[key] += seconds
        for ask, response in answers:
            ask.future.set_result(response)

    def _watch(self, flight: InFlight) -> float | None:
        """Lease a round alone on the device to the event loop that awaits all its asks (`answer_on_loop`): the
        loop polls from POLL_LEAD_S before the fastest of its graph's recent replays would end and finishes the
        round itself (`_poll`). Returns until when the lease holds (None: no lease, the round thread finishes
        it). Called by the round loop, locked."""
        result = flight.result
        if not self.answer_on_loop or not isinstance(result, Launch):
            return None
        loops = {ask.awaited_on for group in flight.groups for ask in group}
        with self._stats_lock:  # another thread's `_finish` may be adding a replay time
            replays = self._replays.get(result.capacity)
            fastest = min(replays) if replays else None
        if len(loops) != 1 or None in loops or fastest is None:
            return None
        poll_at = result.started_at + fastest - POLL_LEAD_S
        until = result.started_at + LEASE_FACTOR * fastest + LEASE_SLACK_S
        loop = loops.pop()
        try:
            loop.call_soon_threadsafe(self._poll_from, loop, flight, poll_at, until)
        except RuntimeError:  # the loop is closed: nobody awaits there
            return None
        return until

    def _poll_from(self, loop: asyncio.AbstractEventLoop, flight: InFlight, poll_at: float, until: float) -> None:
        """On the awaiting loop: start polling the leased round at `poll_at` (time.perf_counter()), or up to
        SELECTOR_RESOLUTION_S before it: an event loop's selector sleeps in whole milliseconds, rounded up."""
        delay = poll_at - time.perf_counter() - SELECTOR_RESOLUTION_S
        if delay > 0:
            loop.call_later(delay, self._poll, loop, flight, until)
        else:
            self._poll(loop, flight, until)

    def _poll(self, loop: asyncio.AbstractEventLoop, flight: InFlight, until: float) -> None:
        """On the awaiting loop: finish the leased round if the device is done with it, poll again on the loop's
        next pass otherwise (its other tasks run meanwhile), and give the round back to the round thread once
        the lease runs out."""
        if flight.result.done():
            if self._loop.take(flight):
                try:
                    self._finish(flight)
                except BaseException as error:  # a bug in finishing: this round's asks fail, the engine goes on
                    LOG.exception("finishing a round on its event loop failed")
                    for ask in (ask for group in flight.groups for ask in group if not ask.future.done()):
                        ask.future.set_exception(error)
        elif time.perf_counter() < until:
            loop.call_soon(self._poll, loop, flight, until)
        else:
            self._loop.release(flight)

    def _request_spec(self, group: list[PendingAsk]) -> tuple[RequestSpec, PlannedSave | None]:
        lead: AskPayload = group[0].payload
        trunk, resume = lead.trunk, lead.resume
        start = lead.resume_length
        save = self.pool.plan_save(trunk, resume, trunk.boundary)
        spec = RequestSpec(
            trunk=trunk.tokens(start),
            branches=Branches.join([ask.payload.branches for ask in group]),
            start=start,
            resume=None if resume is None else Resume(resume.slot, np.asarray(resume.pages, dtype=np.int64)),
            save=None if save is None else Save(trunk.boundary, save.checkpoint.slot, save.kv_slots),
        )
        return spec, save

    def _unpin(self, batch: list[PendingAsk]) -> None:
        for ask in batch:
            if ask.payload.resume is not None:
                self.pool.unpin(ask.payload.resume)

    def _answers(self, groups: list[list[PendingAsk]], probabilities: np.ndarray) -> list[tuple[PendingAsk, SystemOneResponse]]:
        results = []
        row = 0
        # Python floats (float64), one conversion a round of the label columns its questions use: the answer
        # formulas on a few floats each are cheaper than on numpy rows (a RACE ask's four Choice answers: 26 -> 18
        # us back to back, 0.17 -> 0.08 ms right after a round, tiny engine on this CPU); 64 yes/no answers took
        # 87 -> 27 us with their label columns converted instead of all 26 (this repository's CPU VM)
        width = max(max(ask.payload.label_counts) for group in groups for ask in group)
        rows = probabilities[:, :width].astype(np.float64).tolist()
        for group in groups:
            for ask in group:
                answers: dict[str, Answer] = {}
                for (name, question), count in zip(ask.payload.questions.items(), ask.payload.label_counts):
                    answers[name] = question.answer(rows[row][:count])
                    row += 1
                usage = Usage(input_tokens=len(ask.payload.trunk) + ask.payload.branch_tokens, output_tokens=len(answers))
                results.append((ask, SystemOneResponse(answers, model=self.name, usage=usage)))
        return results

    def _count_round(self, groups: list[list[PendingAsk]], tokens: int, seconds: float) -> None:
        with self._stats_lock:
            s = self._stats
            s["rounds"] += 1
            s["tokens_computed"] += tokens
            s["round_seconds"] += seconds
            s["merged_trunks"] += sum(len(group) - 1 for group in groups)
            for group in groups:
                for ask in group:
                    payload: AskPayload = ask.payload
                    s["asks"] += 1
                    s["questions"] += len(payload.questions)
                    s["tokens_resumed"] += payload.resume_length
                    s["checkpoint_hits" if payload.resume is not None else "checkpoint_misses"] += 1
                    tail = len(payload.trunk) - payload.trunk.boundary
                    s["mutable_tail_tokens"] = tail
                    s["max_mutable_tail_tokens"] = max(s["max_mutable_tail_tokens"], tail)

    def stats(self) -> dict[str, float]:
        """Counters since start (DESIGN.md §7) plus pool occupancy."""
        with self._stats_lock:
            stats = dict(self._stats)
        stats.update(
            pool_bytes=self.pool.used_bytes,
            pool_capacity_bytes=self.pool.capacity_bytes,
            checkpoints=self.pool.num_checkpoints,
            **self.pool.counters,
        )
        return stats

    def info(self) -> dict[str, Any]:
        """What this engine runs and with what memory: model shapes, device, dtype, limits, the captured graph
        capacities (stream tokens; empty without graphs), and bytes of weights, checkpoint pool and graphs."""
        config = self.model.config
        weights = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        return {
            "model": self.name,
            "device": str(self.device),
            "dtype": str(self.model.embed_tokens.weight.dtype).removeprefix("torch."),
            "layers": config.num_layers,
            "attention_layers": config.layer_types.count("full_attention"),
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "max_prompt_tokens": self.renderer.max_prompt_tokens,
            "max_round_tokens": self._loop.max_round_tokens,
            "max_round_requests": self.max_round_requests,
            "capacities": [] if self._graphs is None else [c.tokens for c in self._graphs.ladder],
            "memory_bytes": {
                "weights": weights,
                "pool": self.pool.capacity_bytes,
                "graphs": int(self._stats["graph_memory_bytes"]),
            },
        }

    # ---------------------------------------------------------------------------------------- lifecycle
    @property
    def closed(self) -> bool:
        return self._loop.closed

    def close(self) -> None:
        """Stop the engine: queued asks fail with EngineClosedError; launched rounds finish first. Then the
        checkpoint pool and the captured graphs are released (the model's weights stay with the engine)."""
        self._loop.close()
        if self._loop.running:  # closed from a callback on the round thread: it still finishes its rounds
            return
        with self._pool_lock:
            self._graphs = None
            self._caches = []
            self.pool.release()

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
