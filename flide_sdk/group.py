"""`EngineGroup`: one engine per device behind one API, each session pinned to the device holding its checkpoints.

A session's checkpoints live in the pool of the engine it was made on, so its asks, and its forks' (a fork is a
session of the same engine), always go there: the affinity is the session object itself. A new session goes to
the engine with the fewest open sessions, a one-off ask to the engine with the fewest asks in flight. Each engine
keeps its own round thread, the one owner of its device. `stats()` gives each engine's counters and their totals.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from flide_sdk.engine import Engine
from flide_sdk.errors import EngineClosedError, InvalidOptionError
from flide_sdk.images import Assets
from flide_sdk.prompt.base import Rendered
from flide_sdk.questions import Questions, State, SystemOneResponse
from flide_sdk.session import Session


class EngineGroup:
    """Engines of one model, one per device: `EngineGroup.load(path, devices=["cuda:0", "cuda:1"])`."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        if not engines:
            raise InvalidOptionError("an engine group needs at least one engine")
        self.engines = list(engines)
        self._sessions = [weakref.WeakSet() for _ in self.engines]  # each engine's sessions
        self._in_flight = [0] * len(self.engines)  # one-off asks awaiting their answers, per engine
        self._lock = threading.Lock()  # asks may come from several threads and event loops
        self._closed = False

    @classmethod
    def load(cls, path: str | Path, devices: Sequence[str | torch.device], **load_options: Any) -> EngineGroup:
        """One `Engine.load(path, device, **load_options)` per device, loaded in parallel (a device may repeat:
        engines on one CPU)."""
        if not devices:
            raise InvalidOptionError("devices: name at least one device")
        with ThreadPoolExecutor(len(devices)) as pool:
            futures = [pool.submit(Engine.load, path, device, **load_options) for device in devices]
            engines, errors = [], []
            for future in futures:
                try:
                    engines.append(future.result())
                except Exception as error:  # noqa: BLE001 - closed below, then the first error is raised
                    errors.append(error)
        if errors:
            for engine in engines:
                engine.close()
            raise errors[0]
        return cls(engines)

    def session(self) -> Session:
        """A new session on the engine with the fewest open sessions (ties: the first)."""
        self._check_open()
        with self._lock:
            index = min(range(len(self.engines)),
                        key=lambda i: sum(not session.closed for session in self._sessions[i]))
            session = self.engines[index].session()
            self._sessions[index].add(session)
        return session

    def render(self, state: State, questions: Questions, *, assets: Assets | None = None) -> Rendered:
        """`Engine.render` (the engines share one model and tokenizer)."""
        return self.engines[0].render(state, questions, assets=assets)

    async def ask(self, state: State, questions: Questions, *, assets: Assets | None = None,
                  queue_timeout: float | None = None) -> SystemOneResponse:
        """`Engine.ask` on the engine with the fewest one-off asks in flight (ties: the first)."""
        index = self._take()
        try:
            return await self.engines[index].ask(state, questions, assets=assets, queue_timeout=queue_timeout)
        finally:
            self._give_back(index)

    def ask_sync(self, state: State, questions: Questions, timeout: float | None = None, *,
                 assets: Assets | None = None, queue_timeout: float | None = None) -> SystemOneResponse:
        """Blocking `ask`, for scripts (`Engine.ask_sync` on the least busy engine)."""
        index = self._take()
        try:
            return self.engines[index].ask_sync(state, questions, timeout, assets=assets, queue_timeout=queue_timeout)
        finally:
            self._give_back(index)

    def _take(self) -> int:
        self._check_open()
        with self._lock:
            index = min(range(len(self.engines)), key=self._in_flight.__getitem__)
            self._in_flight[index] += 1
        return index

    def _give_back(self, index: int) -> None:
        with self._lock:
            self._in_flight[index] -= 1

    def stats(self) -> dict[str, Any]:
        """Each engine's `stats()` (with its device) and their totals: counters summed, `max_*` the largest."""
        engines = [{"device": str(engine.device), **engine.stats()} for engine in self.engines]
        total: dict[str, float] = {}
        for stats in engines:
            for key, value in stats.items():
                if key != "device":
                    total[key] = max(total.get(key, value), value) if key.startswith("max_") else (
                        total.get(key, 0) + value)
        return {"engines": engines, "total": total}

    def info(self) -> dict[str, Any]:
        return {"engines": [engine.info() for engine in self.engines]}

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close every engine (idempotent)."""
        self._closed = True
        for engine in self.engines:
            engine.close()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine group is closed")

    def __enter__(self) -> EngineGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> EngineGroup:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._closed = True
        for engine in self.engines:
            await engine.aclose()

    def __repr__(self) -> str:
        return f"EngineGroup({', '.join(str(engine.device) for engine in self.engines)})"
