"""The round loop: one background thread owns the device; it schedules, launches and finishes every round.

Asks come from any thread or event loop, validated and tokenized there. Each carries a
`concurrent.futures.Future`; async callers await it through `asyncio.wrap_future`, so results resolve on the
caller's own loop, and cancelling the awaiting task withdraws the ask as long as no round has taken it. An
event loop's asks are staged and queued together by one callback at the end of the loop's iteration
(`Staging`), so asks created at once (`asyncio.gather`) reach the round thread at once and share a round. The
queue is bounded: submitters wait for room (backpressure), nothing is dropped.

Rounds are pipelined: while a round runs, the thread schedules and launches the next one (up to `depth`
rounds in flight), and finishes the oldest round when there is nothing to launch or the pipeline is full, so
the host work of round k+1 overlaps the device work of round k. When nothing is in flight a round is
admitted at once or, with a deadline, when the queued work reaches the round capacity or the deadline passes.
Once the device has been idle for IDLE_WORK_AFTER_S, or longer where the executor says so
(`idle_work_after`), the thread does the executor's idle work one step at a time (`idle_step`: capture the
next CUDA graph, or give unused pool memory back), so asks that come in a burst (the first ones after start
among them) are not held up by it.
Closing fails every queued ask with `EngineClosedError`; rounds already launched finish.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from flide_sdk.errors import AskTimeoutError, EngineClosedError, QueueFullError
from flide_sdk.options import on_device
from flide_sdk.questions import SystemOneResponse
from flide_sdk.serve.asks import Ask
from flide_sdk.serve.executor import Executor, Launched
from flide_sdk.serve.stats import Stats

LOG = logging.getLogger(__name__)
IDLE_WORK_AFTER_S = 0.1  # idle time (no round in flight or queued) before the loop captures a graph or trims


class RoundLoop:
    """A bounded queue of asks and the thread that turns it into rounds on `executor`."""

    def __init__(self, executor: Executor, *, deadline_s: float, max_pending: int, depth: int,
                 name: str = "flide-rounds", device: torch.device = torch.device("cpu")) -> None:
        self.executor = executor
        self.device = device  # the thread's current device: rounds launch on the engine's, whichever it is
        self.deadline_s = deadline_s
        self.max_pending = max_pending
        self.depth = depth
        self._pending: deque[Ask] = deque()
        self._in_flight: deque[Launched] = deque()
        self._closed = False
        self._worked_at = time.monotonic()  # when a round was last launched or finished (or the loop started)
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def running(self) -> bool:
        """Whether the round thread is still alive (it ends once closed and its rounds are finished)."""
        return self._thread.is_alive()

    def offer(self, asks: Sequence[Ask]) -> int:
        """Queue the leading asks that there is room for, all at once; how many were queued."""
        with self._cond:
            self.check_open()
            taken = asks[: max(0, self.max_pending - len(self._pending))]
            for ask in taken:
                self._queue(ask)
            return len(taken)

    def submit(self, ask: Ask) -> None:
        """Queue `ask`, waiting for room while the queue is full."""
        with self._cond:
            while not self._closed and len(self._pending) >= self.max_pending:
                self._cond.wait()
            self.check_open()
            self._queue(ask)

    def wake(self) -> None:
        """Have the loop look for idle work again (the executor has some now: a cleared pool to trim)."""
        with self._cond:
            self._cond.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Stop admitting, fail queued asks with EngineClosedError, and wait for the rounds in flight to end."""
        self._close_queue("the engine was closed before this ask ran")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed")

    def _queue(self, ask: Ask) -> None:
        ask.queued_at = time.perf_counter()
        self._pending.append(ask)
        self._cond.notify_all()

    def _close_queue(self, reason: str) -> None:
        with self._cond:
            self._closed = True
            dropped = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        for ask in dropped:
            fail(ask, EngineClosedError(reason))

    def _run(self) -> None:
        with on_device(self.device):
            try:
                while self._step():
                    pass
            except BaseException as error:  # a bug in scheduling or launching: fail everyone, never hang callers
                LOG.exception("the round loop failed; the engine is closed")
                self._close_queue(f"the round loop failed: {error!r}")
            finally:
                while self._in_flight:
                    self._finish(self._in_flight.popleft())

    def _idle(self) -> bool:
        return not self._in_flight and not self._pending and not self._closed

    def _step(self) -> bool:
        """Launch a round, or finish the oldest one in flight, or (idle) do idle work; False once closed."""
        with self._cond:
            while self._idle():
                idle_for = time.monotonic() - self._worked_at
                if idle_for < IDLE_WORK_AFTER_S:  # block first: the answers just given reach their loops sooner
                    self._cond.wait(IDLE_WORK_AFTER_S - idle_for)
                    continue
                after = self.executor.idle_work_after()
                if after is not None and idle_for >= after:
                    break
                self._cond.wait(None if after is None else after - idle_for)
            if self._closed:
                return False
            if self._idle():
                batch, idle_work = None, True
            else:
                idle_work = False
                launch = bool(self._pending) and len(self._in_flight) < self.depth
                if launch and not self._in_flight and self.deadline_s > 0:
                    self._wait_for_a_full_round()
                    if self._closed:
                        return False
                batch = self.executor.select(self._pending) if launch else None
                if batch is not None:
                    self._pending = deque(batch.kept)
                    self._cond.notify_all()  # room in the queue for waiting submitters
        if idle_work:  # between rounds: an ask that comes meanwhile waits for this one step at most
            self.executor.idle_step()
            return True
        if batch is None:
            self._finish(self._in_flight.popleft())
        elif batch.requests:
            launched = self.executor.launch(batch)
            if launched is not None:
                self._in_flight.append(launched)
        self._worked_at = time.monotonic()
        return True

    def _wait_for_a_full_round(self) -> None:
        """Wait (locked) until the queued asks fill a round or the deadline passes."""
        deadline = time.monotonic() + self.deadline_s
        while not self._closed and sum(ask.tokens for ask in self._pending) < self.executor.limits.tokens:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._cond.wait(remaining)

    def _finish(self, launched: Launched) -> None:
        try:
            self.executor.finish(launched)
        except Exception as error:  # a bug in finishing: this round's asks fail, the engine goes on
            LOG.exception("finishing a round failed")
            self.executor.fail(launched, error)


@dataclass
class Staged:
    """An ask waiting for the end of its event loop's iteration (or for room in the queue)."""

    ask: Ask
    answered: asyncio.Future  # what its coroutine awaits (cancelled: withdrawn before it was queued)
    queue_timeout: float | None  # seconds to wait for room (None: as long as it takes)
    deadline: float | None  # time.monotonic() past which it fails with QueueFullError


class Staging:
    """Queues the asks of coroutines: each event loop's asks are staged, and one callback at the end of that
    loop's iteration hands every staged ask to the round loop at once (`RoundLoop.offer`). A lone ask pays
    that one callback; asks that find the queue full are offered again after growing pauses."""

    def __init__(self, rounds: RoundLoop, stats: Stats) -> None:
        self.rounds, self.stats = rounds, stats
        self._stages: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopStage] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def stage(self, ask: Ask, queue_timeout: float | None) -> asyncio.Future:
        """From a coroutine: queue `ask` with the other asks its event loop stages in this iteration; the future
        of its answers on this loop (cancelling it withdraws the ask as long as no round has taken it)."""
        self.rounds.check_open()
        loop = asyncio.get_running_loop()
        answered = asyncio.wrap_future(ask.future, loop=loop)
        stage = self._stages.get(loop)
        if stage is None:
            with self._lock:
                stage = self._stages.setdefault(loop, _LoopStage(self))
        deadline = None if queue_timeout is None else time.monotonic() + queue_timeout
        stage.add(Staged(ask, answered, queue_timeout, deadline), loop)
        return answered


class _LoopStage:
    """One event loop's staged asks; touched only on that loop's thread. It holds no reference to the loop (the
    loop keys it weakly)."""

    def __init__(self, staging: Staging) -> None:
        self.staging = staging
        self.staged: list[Staged] = []
        self.flush_scheduled = False
        self.pause = ROOM_PAUSES_S[0]

    def add(self, staged: Staged, loop: asyncio.AbstractEventLoop) -> None:
        self.staged.append(staged)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            loop.call_soon(self.flush)

    def flush(self) -> None:
        self.flush_scheduled = False
        staged = [s for s in self.staged if not s.answered.cancelled()]  # withdrawn by its caller
        self.staged = []
        try:
            queued = self.staging.rounds.offer([s.ask for s in staged])
        except EngineClosedError as error:
            for s in staged:
                fail(s.ask, error)
            return
        now = time.monotonic()
        for s in staged[queued:]:
            if s.deadline is not None and now >= s.deadline:
                fail(s.ask, queue_full(s.queue_timeout, self.staging.stats))
            else:
                self.staged.append(s)
        if not self.staged:
            self.pause = ROOM_PAUSES_S[0]
            return
        self.flush_scheduled = True
        asyncio.get_running_loop().call_later(self.pause, self.flush)
        self.pause = min(2 * self.pause, ROOM_PAUSES_S[1])


def fail(ask: Ask, error: BaseException) -> None:
    """Fail an ask that no round has taken (unless its caller withdrew it)."""
    if ask.future.set_running_or_notify_cancel():
        ask.future.set_exception(error)


ROOM_PAUSES_S = (0.0005, 0.05)  # the first and the longest pause between attempts to queue into a full queue


def room_waits(queue_timeout: float | None, stats: Stats) -> Iterator[float]:
    """Growing pauses between attempts to queue an ask; QueueFullError once `queue_timeout` has passed."""
    deadline = None if queue_timeout is None else time.monotonic() + queue_timeout
    delay = ROOM_PAUSES_S[0]
    while deadline is None or time.monotonic() < deadline:
        yield delay
        delay = min(delay * 2, ROOM_PAUSES_S[1])
    raise queue_full(queue_timeout, stats)


def queue_full(queue_timeout: float, stats: Stats) -> QueueFullError:
    """The error of an ask that found no room for `queue_timeout` s, with a retry hint of one mean round (1 ms
    before the first round)."""
    counts = stats.snapshot()
    rounds, seconds = counts["rounds"], counts["round_seconds"]
    return QueueFullError(float(queue_timeout), max(1, round(1000 * seconds / rounds)) if rounds else 1)


def submit_blocking(loop: RoundLoop, stats: Stats, asks: list[Ask], timeout: float | None,
                    queue_timeout: float | None) -> list[SystemOneResponse]:
    """Queue `asks` together (waiting for room, at most `queue_timeout` s) and block until their answers arrive.
    After `timeout` s, AskTimeoutError; an ask no round has taken yet is withdrawn then (as when cancelled)."""
    if queue_timeout is None:
        for one in asks:
            loop.submit(one)
    else:
        waits, queued = room_waits(queue_timeout, stats), 0
        while queued < len(asks):  # a group's asks queued at once where there is room: they share a round
            queued += loop.offer(asks[queued:])
            if queued < len(asks):
                time.sleep(next(waits))
    deadline = None if timeout is None else time.monotonic() + timeout
    responses = []
    for index, one in enumerate(asks):
        try:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            responses.append(one.future.result(left))
        except concurrent.futures.TimeoutError:
            withdrawn = [later.future.cancel() for later in asks[index:]]
            if all(later.future.done() and not later.future.cancelled() for later in asks[index:]):
                responses += [later.future.result() for later in asks[index:]]  # answered just now
                break
            raise AskTimeoutError(float(timeout), withdrawn=all(withdrawn)) from None
    return responses
