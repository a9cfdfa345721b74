"""The round loop: one background thread owns the device and runs queued asks in batched rounds.

Asks come from any thread or event loop. Each carries a `concurrent.futures.Future`; async callers await
it through `asyncio.wrap_future`, so results resolve on the caller's own loop and cancelling the awaiting
task cancels the ask if its round has not started (the loop skips futures it cannot mark running).
A round is admitted when the queued tokens reach the round capacity or a short deadline passes after the
first ask arrived; asks join a round in arrival order while they fit, and an ask larger than the capacity
runs alone. Closing fails every queued ask with `EngineClosedError`; a round already running finishes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from flide_sdk.errors import EngineClosedError


@dataclass(eq=False)
class PendingAsk:
    """One queued ask: its payload for the round runner, its stream token count, and its future."""

    payload: Any
    tokens: int
    future: Future = field(default_factory=Future)


class RoundLoop:
    """Batches pending asks into rounds and hands each round to `run_round` on a dedicated thread."""

    def __init__(
        self,
        run_round: Callable[[list[PendingAsk]], None],
        max_round_tokens: int,
        deadline_s: float,
        name: str = "flide-rounds",
    ) -> None:
        self._run_round = run_round
        self.max_round_tokens = max_round_tokens
        self.deadline_s = deadline_s
        self._pending: deque[PendingAsk] = deque()
        self._pending_tokens = 0
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, ask: PendingAsk) -> None:
        with self._cond:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            self._pending.append(ask)
            self._pending_tokens += ask.tokens
            self._cond.notify()

    def close(self, timeout: float | None = None) -> None:
        """Stop admitting, fail queued asks with EngineClosedError, and wait for a running round to end."""
        with self._cond:
            self._closed = True
            dropped = list(self._pending)
            self._pending.clear()
            self._pending_tokens = 0
            self._cond.notify_all()
        for ask in dropped:
            if ask.future.set_running_or_notify_cancel():
                ask.future.set_exception(EngineClosedError("the engine was closed before this ask ran"))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                deadline = time.monotonic() + self.deadline_s
                while not self._closed and self._pending_tokens < self.max_round_tokens:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                if self._closed:
                    return
                batch = self._take_round()
            if batch:
                self._run_round(batch)

    def _take_round(self) -> list[PendingAsk]:
        """Pop asks in order while they fit the capacity (the first always fits); drop cancelled ones."""
        batch: list[PendingAsk] = []
        tokens = 0
        while self._pending:
            ask = self._pending[0]
            if batch and tokens + ask.tokens > self.max_round_tokens:
                break
            self._pending.popleft()
            self._pending_tokens -= ask.tokens
            if not ask.future.set_running_or_notify_cancel():
                continue
            batch.append(ask)
            tokens += ask.tokens
        return batch
