"""The round loop: one background thread owns the device and runs queued asks in rounds.

Asks come from any thread or event loop. Each carries a `concurrent.futures.Future`; async callers await
it through `asyncio.wrap_future`, so results resolve on the caller's own loop, and cancelling the awaiting
task cancels the ask as long as no round has taken it. The queue is bounded: `submit` waits for room
(backpressure), nothing is dropped.

Rounds are pipelined: `launch` starts a round on the device and returns an in-flight handle, and
`finish` waits for one and resolves its asks. While a round runs, the thread builds and launches the next
one (up to `depth` rounds in flight), and finishes the oldest round when there is nothing to launch or
the pipeline is full, so the host work of round k+1 overlaps the device work of round k. When nothing is
in flight, a round is admitted at once, or, with a deadline, when the queued work reaches the round
capacity or the deadline passes. Which queued asks join a round is the engine's decision (`select`, run
under the queue lock on this thread: it marks the asks it takes as running and leaves the rest queued,
e.g. asks waiting for a checkpoint this round produces). With `launch_in_caller`, an ask it accepts that is
submitted while the loop is idle (nothing queued or in flight, no deadline, admission not held) is selected
and launched by the submitting thread itself, which saves the hand-off to the round thread on a lone ask's
critical path (a thread wake-up, 72 us median and 216 us p90 on the H200 host, `host_wake.json`); the round
thread then finishes it as any other. Only for launches that return at once (the engine accepts asks that
fit a captured CUDA graph). An ask whose preparation is deferred (`PendingAsk.prepare`: the engine's asks
about a one-off state, whose rendering and tokenizing are most of an ask's host work) and that finds the loop
idle is queued as it is: the round thread prepares, selects and launches it alone (on the H200's host its host
stages took about a quarter less time there than on an asking thread asleep through the previous round:
`Engine._state_ask`); otherwise the submitting thread prepares it.
A round launched alone on the device may be leased to another thread (`watch`, the engine's: the event loop
awaiting its asks) until a time `watch` returns: the round thread leaves it to that thread, which takes it out
of flight (`take`) once the device is done and finishes it itself. No hand-off between threads then lies on
the answers' path. The round thread finishes a leased round itself when the watcher gives it back (`release`),
or once the lease has run out and it has other work to do (asks queued, another round to finish; a watcher
that never polls again, e.g. a loop closed meanwhile, leaves its round to the next such moment or to `close`).
Closing fails every queued ask with `EngineClosedError`; rounds already launched finish. `hold()` pauses
admission, so a test can queue several asks and have them admitted together, deterministically.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from flide_sdk.errors import EngineClosedError, FlideError

LOG = logging.getLogger(__name__)


@dataclass(eq=False)
class PendingAsk:
    """One queued ask: its payload for the engine, an estimate of its stream tokens, its future, and when it
    was queued (time.perf_counter(), set by the loop). An ask whose preparation is deferred carries it in
    `prepare` (it fills payload and tokens, raising on bad input) until `prepare_now` runs it. `awaited_on` is
    the event loop awaiting the future (None for a blocking caller)."""

    payload: Any
    tokens: int
    future: Future = field(default_factory=Future)
    queued_at: float = 0.0
    prepare: Callable[[], None] | None = None
    awaited_on: asyncio.AbstractEventLoop | None = None

    def prepare_now(self) -> None:
        """Run the deferred preparation, if any, once."""
        if self.prepare is not None:
            prepare, self.prepare = self.prepare, None
            prepare()


class RoundLoop:
    """A bounded queue of asks and the thread that turns it into rounds."""

    def __init__(
        self,
        select: Callable[[deque[PendingAsk]], list[PendingAsk]],
        launch: Callable[[list[PendingAsk]], Any],
        finish: Callable[[Any], None],
        max_round_tokens: int,
        deadline_s: float,
        max_pending: int,
        depth: int = 2,
        name: str = "flide-rounds",
        launch_in_caller: Callable[[PendingAsk], bool] | None = None,
        watch: Callable[[Any], float | None] | None = None,
    ) -> None:
        self._select = select
        self._launch = launch
        self._finish = finish
        self.depth = depth
        self._in_flight: deque[Any] = deque()
        self.max_round_tokens = max_round_tokens
        self.deadline_s = deadline_s
        self.max_pending = max_pending
        self._pending: deque[PendingAsk] = deque()
        self._closed = False
        self._held = 0
        self.launch_in_caller = launch_in_caller
        self._launching = False  # a submitting thread is launching its ask's round
        self._watch = watch
        self._leases: dict[int, float] = {}  # id(flight) -> until when only its watcher finishes it (perf_counter)
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def running(self) -> bool:
        """Whether the round thread is still alive (it ends once closed and its rounds are finished)."""
        return self._thread.is_alive()

    def try_submit(self, ask: PendingAsk) -> bool:
        """Queue `ask` (or launch it on this thread, `launch_in_caller`) if there is room; False when the
        queue is full. An ask with a deferred preparation that finds the loop idle is queued as it is, for
        the round thread to prepare and launch; otherwise this thread prepares it first (its errors raise
        here)."""
        if self._queued_as_is(ask):
            return True
        ask.prepare_now()
        with self._cond:
            self._check_open()
            if len(self._pending) >= self.max_pending:
                return False
            inline = (self.launch_in_caller is not None and self._idle() and self.launch_in_caller(ask))
            if inline:
                ask.queued_at = time.perf_counter()
                self._launching = True
            else:
                self._queue(ask)
        if inline:
            self._launch_here(ask)
        return True

    def _queued_as_is(self, ask: PendingAsk) -> bool:
        """Queue an ask whose preparation is deferred as it is when the loop is idle (True: the round thread
        prepares it); False, nothing done, otherwise."""
        with self._cond:
            self._check_open()
            if ask.prepare is None or not self._idle():
                return False
            self._queue(ask)
            return True

    def _idle(self) -> bool:
        """Nothing queued, launching or in flight, no deadline, admission not held (called locked)."""
        return (self.deadline_s == 0 and not self._held and not self._launching and not self._pending
                and not self._in_flight)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed")

    def _queue(self, ask: PendingAsk) -> None:
        ask.queued_at = time.perf_counter()
        self._pending.append(ask)
        self._cond.notify_all()

    def _launch_here(self, ask: PendingAsk) -> None:
        """Prepare `ask` if its preparation was deferred, select and launch its round on this thread, then
        hand the round to the round thread (a failed preparation fails the ask alone)."""
        flight = None
        try:
            if not ask.future.cancelled():
                prepared = self._prepared(ask)
                batch = self._select(deque([ask])) if prepared else []
                flight = self._launch(batch) if batch else None
        except BaseException as error:  # a bug in select/launch: this ask fails, the loop goes on
            LOG.exception("launching an ask alone failed")
            if not ask.future.done():
                ask.future.set_exception(error)
        finally:
            with self._cond:
                if flight is not None:
                    self._add_flight(flight)
                self._launching = False
                self._cond.notify_all()

    @staticmethod
    def _prepared(ask: PendingAsk) -> bool:
        """Run a deferred preparation; False (the ask failed with its error) if it refused the input (a
        FlideError: a state too long for the model, a question with more options than single-token labels). The
        time it took does not count as queueing; any other error is a bug, for the caller to report."""
        started = time.perf_counter()
        try:
            ask.prepare_now()
        except FlideError as error:
            if ask.future.set_running_or_notify_cancel():
                ask.future.set_exception(error)
            return False
        ask.queued_at += time.perf_counter() - started
        return True

    def submit(self, ask: PendingAsk) -> None:
        """Queue `ask`, waiting for room while the queue is full (a deferred preparation runs on this thread
        unless the loop is idle, as in `try_submit`)."""
        if self._queued_as_is(ask):
            return
        ask.prepare_now()
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

    def close(self, timeout: float | None = None) -> None:
        """Stop admitting, fail queued asks with EngineClosedError, and wait for a running round to end."""
        self._close_queue("the engine was closed before this ask ran")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _queued_tokens(self) -> int:
        return sum(ask.tokens for ask in self._pending)

    def _loop(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as error:  # a bug in select/launch/finish: fail everyone, never hang callers
            LOG.exception("the round loop failed; the engine is closed")
            self._close_queue(f"the round loop failed: {error!r}")
        finally:
            with self._cond:  # closed by now: an ask being launched on its thread joins the rounds to finish
                while self._launching:
                    self._cond.wait()
            while True:  # leases no longer hold: the rounds must finish before the thread ends
                with self._cond:  # (a watcher may be taking one meanwhile)
                    if not self._in_flight:
                        break
                    flight = self._in_flight.popleft()
                    self._leases.pop(id(flight), None)
                self._finish(flight)

    def _close_queue(self, reason: str) -> None:
        """Stop admitting (new asks raise EngineClosedError) and fail every queued ask with `reason`."""
        with self._cond:
            self._closed = True
            dropped = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        for ask in dropped:
            if ask.future.set_running_or_notify_cancel():
                ask.future.set_exception(EngineClosedError(reason))

    def _step(self) -> bool:
        """Launch a round, or finish the oldest one in flight; False once closed. An ask queued with its
        preparation deferred (it found the loop idle) is prepared and launched alone first."""
        batch: list[PendingAsk] = []
        deferred = flight = None
        with self._cond:
            while (self._launching or not self._in_flight and (not self._pending or self._held)) and not self._closed:
                self._cond.wait()
            if self._closed:
                return False
            # a deferred ask is queued only into an empty queue (`_queued_as_is`), so it can only be the first
            if not self._held and self._pending and self._pending[0].prepare is not None:
                deferred = self._pending.popleft()
                self._launching = True
                self._cond.notify_all()
            elif self._pending and not self._held and len(self._in_flight) < self.depth:
                if not self._in_flight and self.deadline_s > 0:
                    deadline = time.monotonic() + self.deadline_s
                    while not self._closed and not self._held and self._queued_tokens() < self.max_round_tokens:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            break
                        self._cond.wait(remaining)
                    if self._closed or self._held:
                        return not self._closed
                batch = self._select(self._pending)
                self._cond.notify_all()  # room in the queue for waiting submitters
            else:
                flight = self._claim()
                if flight is None:  # every round in flight is leased: wait for a watcher to take or release one,
                    # and, with asks queued behind them, no longer than the first lease (no timed wake-up otherwise:
                    # in a run of lone asks it came while their loop was preparing the next one)
                    self._cond.wait(min(self._leases.values()) - time.perf_counter() if self._pending else None)
                    return True
        if deferred is not None:
            self._launch_here(deferred)
        elif batch:
            launched = self._launch(batch)
            if launched is not None:
                with self._cond:
                    self._add_flight(launched)
        elif flight is not None:
            self._finish(flight)
        return True

    def _add_flight(self, flight: Any) -> None:
        """Put a launched round in flight (called locked). A round alone on the device (nothing else in flight or
        queued) is offered to `watch`, which may lease its finishing to another thread until a time it returns
        (the event loop awaiting its asks, which then takes it with `take` once the device is done)."""
        alone = not self._in_flight and not self._pending
        self._in_flight.append(flight)
        if alone and self._watch is not None:
            until = self._watch(flight)
            if until is not None:
                self._leases[id(flight)] = until

    def _claim(self) -> Any | None:
        """The oldest round in flight that this thread may finish (no lease on it, or its lease ran out), taken
        out of flight; None while every round in flight is leased (called locked)."""
        now = time.perf_counter()
        for flight in self._in_flight:
            if self._leases.get(id(flight), now) <= now:
                self._leases.pop(id(flight), None)
                self._in_flight.remove(flight)
                return flight
        return None

    def take(self, flight: Any) -> bool:
        """Take a leased round out of flight for the calling thread to finish; False if the round thread claimed it
        already (its lease ran out)."""
        with self._cond:
            if self._leases.pop(id(flight), None) is None:
                return False
            self._in_flight.remove(flight)
            if self._pending:  # the round thread may be waiting for room in the pipeline
                self._cond.notify_all()
            return True

    def release(self, flight: Any) -> None:
        """Give a leased round back to the round thread (its watcher stops watching before the device is done)."""
        with self._cond:
            if self._leases.pop(id(flight), None) is not None:
                self._cond.notify_all()
