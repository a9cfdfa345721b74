"""The round loop: one background thread owns the device; it schedules, launches and finishes every round.

Asks come from any thread or event loop, validated and tokenized there. Each carries a
`concurrent.futures.Future`; async callers await it through `asyncio.wrap_future`, so results resolve on the
caller's own loop, and cancelling the awaiting task withdraws the ask as long as no round has taken it. The
queue is bounded: `submit` waits for room (backpressure), nothing is dropped.

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

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from flide_sdk.errors import EngineClosedError, QueueFullError
from flide_sdk.options import on_device
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
        self._held = 0
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

    def try_submit(self, ask: Ask) -> bool:
        """Queue `ask` if there is room; False when the queue is full."""
        with self._cond:
            self._check_open()
            if len(self._pending) >= self.max_pending:
                return False
            self._queue(ask)
            return True

    def submit(self, ask: Ask) -> None:
        """Queue `ask`, waiting for room while the queue is full."""
        with self._cond:
            while not self._closed and len(self._pending) >= self.max_pending:
                self._cond.wait()
            self._check_open()
            self._queue(ask)

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Pause admission while inside: queued asks wait, then are admitted together on exit."""
        with self._cond:
            self._held += 1
        try:
            yield
        finally:
            with self._cond:
                self._held -= 1
                self._cond.notify_all()

    def wake(self) -> None:
        """Have the loop look for idle work again (the executor has some now: a cleared pool to trim)."""
        with self._cond:
            self._cond.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Stop admitting, fail queued asks with EngineClosedError, and wait for the rounds in flight to end."""
        self._close_queue("the engine was closed before this ask ran")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _check_open(self) -> None:
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
            if ask.future.set_running_or_notify_cancel():
                ask.future.set_exception(EngineClosedError(reason))

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
        return not self._in_flight and (not self._pending or self._held) and not self._closed

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
                launch = bool(self._pending) and not self._held and len(self._in_flight) < self.depth
                if launch and not self._in_flight and self.deadline_s > 0:
                    self._wait_for_a_full_round()
                    if self._closed or self._held:
                        return not self._closed
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
        while (not self._closed and not self._held
               and sum(ask.tokens for ask in self._pending) < self.executor.limits.tokens):
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


def room_waits(queue_timeout: float | None, stats: Stats) -> Iterator[float]:
    """Growing pauses between attempts to queue an ask; QueueFullError once `queue_timeout` has passed, with a
    retry hint of one mean round (1 ms before the first round)."""
    deadline = None if queue_timeout is None else time.monotonic() + queue_timeout
    delay = 0.0005
    while deadline is None or time.monotonic() < deadline:
        yield delay
        delay = min(delay * 2, 0.05)
    counts = stats.snapshot()
    rounds, seconds = counts["rounds"], counts["round_seconds"]
    raise QueueFullError(float(queue_timeout), max(1, round(1000 * seconds / rounds)) if rounds else 1)
