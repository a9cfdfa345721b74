"""The round loop on a fake executor: one thread launches and finishes every round, rounds pipeline up to the
depth, bugs fail asks instead of hanging, closing answers the rounds in flight. And the scheduler as a pure
function of the queue and the pool: admission, identical trunks, splitting at capacity, cancellation."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import flide_sdk as fl
from flide_sdk.serve.asks import Ask
from flide_sdk.serve.executor import Launched
from flide_sdk.serve.loop import IDLE_WORK_AFTER_S, RoundLoop
from flide_sdk.serve.scheduler import RoundBatch, RoundLimits, schedule

QUESTION = {"q": fl.Noul("Is it late?")}
LIMITS = RoundLimits(tokens=10_000, requests=64, questions=10_000)


class FakeExecutor:
    """Schedules with the real scheduler (no checkpoints) and answers each ask with its round's number once
    `device_seconds` have passed after its launch; records the thread and order of every call."""

    def __init__(self, limits: RoundLimits = LIMITS, device_seconds: float = 0.0, captures: int = 0,
                 capture_seconds: float = 0.0, idle_after: float = 0.0) -> None:
        self.limits = limits
        self.idle_after = idle_after
        self.device_seconds = device_seconds
        self.captures_left = captures
        self.capture_seconds = capture_seconds
        self.calls: list[tuple[str, str, int]] = []  # (call, thread, round)
        self.rounds = 0
        self.fail_select: BaseException | None = None
        self.fail_finish: BaseException | None = None
        self.launch_gate: threading.Event | None = None

    def record(self, call: str, round_index: int) -> None:
        self.calls.append((call, threading.current_thread().name, round_index))

    @property
    def capturing(self) -> bool:
        return self.captures_left > 0

    def idle_work_after(self) -> float | None:
        return self.idle_after if self.capturing else None

    def idle_step(self) -> None:
        time.sleep(self.capture_seconds)
        self.captures_left -= 1
        self.record("capture", self.rounds)

    def select(self, queue) -> RoundBatch:
        if self.fail_select is not None:
            raise self.fail_select
        batch = schedule(queue, lambda trunk: None, self.limits)
        for request in batch.requests:
            request.asks = [ask for ask in request.asks if ask.future.set_running_or_notify_cancel()]
        batch.requests = [request for request in batch.requests if request.asks]
        return batch

    def launch(self, batch: RoundBatch) -> Launched:
        if self.launch_gate is not None:
            self.launch_gate.wait(30)
        self.rounds += 1
        self.record("launch", self.rounds)
        return Launched(batch.requests, 0, self.rounds, time.perf_counter())

    def finish(self, launched: Launched) -> None:
        time.sleep(max(0.0, launched.started + self.device_seconds - time.perf_counter()))
        self.record("finish", launched.result)
        if self.fail_finish is not None:
            raise self.fail_finish
        for request in launched.requests:
            for ask in request.asks:
                ask.future.set_result(launched.result)

    def fail(self, launched: Launched, error: BaseException) -> None:
        for request in launched.requests:
            for ask in request.asks:
                ask.future.set_exception(error)


@pytest.fixture(scope="module")
def asker(tiny_path):
    """Builds asks (validated and tokenized by a tiny engine) for loops of fake executors."""
    with fl.Engine.load(tiny_path, device="cpu") as engine:
        yield lambda state, questions=QUESTION: engine.prepare(state, questions)


def run_loop(executor: FakeExecutor, depth: int = 2, deadline_s: float = 0.0, max_pending: int = 64) -> RoundLoop:
    return RoundLoop(executor, deadline_s=deadline_s, max_pending=max_pending, depth=depth)


def test_one_thread_launches_and_finishes_every_round(asker):
    executor = FakeExecutor(device_seconds=0.01)
    loop = run_loop(executor)
    asks = []
    for i in range(4):
        for _ in range(3):
            asks.append(asker(f"state {i}"))
            loop.submit(asks[-1])
        time.sleep(0.002)
    assert all(ask.future.result(10) >= 1 for ask in asks)
    loop.close()
    assert {thread for _, thread, _ in executor.calls} == {"flide-rounds"}
    assert sorted(i for call, _, i in executor.calls if call == "finish") == list(range(1, executor.rounds + 1))


def test_rounds_pipeline_up_to_the_depth(asker):
    """With asks queued, the next round is launched while the previous one is on the device; never more than
    `depth` rounds in flight."""
    executor = FakeExecutor(device_seconds=0.02, limits=RoundLimits(tokens=10_000, requests=1, questions=10_000))
    loop = run_loop(executor, depth=2)
    asks = [asker(f"ask {i}") for i in range(4)]
    assert loop.offer(asks) == 4
    assert [ask.future.result(10) for ask in asks] == [1, 2, 3, 4]
    loop.close()
    order = [(call, i) for call, _, i in executor.calls]
    assert order.index(("launch", 2)) < order.index(("finish", 1))  # launched while round 1 ran
    in_flight = 0
    for call, _ in order:
        in_flight += 1 if call == "launch" else -1
        assert in_flight <= 2


def test_asks_offered_together_share_a_round(asker):
    executor = FakeExecutor()
    loop = run_loop(executor)
    asks = [asker(f"together {i}") for i in range(5)]
    assert loop.offer(asks) == 5
    assert {ask.future.result(10) for ask in asks} == {1}
    loop.close()


def test_a_deadline_waits_for_more_asks(asker):
    executor = FakeExecutor()
    loop = run_loop(executor, deadline_s=0.2)
    asks = [asker(f"deadline {i}") for i in range(3)]
    for ask in asks:
        loop.submit(ask)
        time.sleep(0.01)
    assert {ask.future.result(10) for ask in asks} == {1}
    loop.close()


def submit_one(asker, executor: FakeExecutor) -> tuple[RoundLoop, Ask]:
    loop = run_loop(executor)
    ask = asker("state")
    loop.submit(ask)
    return loop, ask


def test_a_bug_in_scheduling_closes_the_loop_and_fails_queued_asks(asker):
    executor = FakeExecutor()
    executor.fail_select = RuntimeError("admission bug")
    loop, ask = submit_one(asker, executor)
    with pytest.raises(fl.EngineClosedError, match="admission bug"):
        ask.future.result(10)
    assert loop.closed
    with pytest.raises(fl.EngineClosedError):
        loop.submit(asker("after"))


def test_a_bug_in_finishing_fails_that_round_only(asker):
    executor = FakeExecutor()
    executor.fail_finish = RuntimeError("finish bug")
    loop, ask = submit_one(asker, executor)
    with pytest.raises(RuntimeError, match="finish bug"):
        ask.future.result(10)
    executor.fail_finish = None
    after = asker("after")
    loop.submit(after)
    assert after.future.result(10) == 2 and not loop.closed
    loop.close()


def test_closing_answers_rounds_in_flight_and_fails_queued_asks(asker):
    executor = FakeExecutor(device_seconds=0.1, limits=RoundLimits(tokens=10_000, requests=1, questions=10_000))
    loop = run_loop(executor, depth=1)
    running, queued = asker("running"), asker("queued")
    loop.submit(running)
    time.sleep(0.03)
    loop.submit(queued)
    loop.close()
    assert running.future.result(10) == 1
    with pytest.raises(fl.EngineClosedError):
        queued.future.result(10)
    assert not loop.running


def test_the_first_asks_run_before_any_capture(asker):
    """Asks queued right after start are answered before the loop captures its first graph; capturing
    starts once the loop has been idle for IDLE_WORK_AFTER_S."""
    executor = FakeExecutor(captures=3, capture_seconds=0.01)
    loop = run_loop(executor)
    asks = [asker(f"first {i}") for i in range(3)]
    loop.offer(asks)
    assert [ask.future.result(10) for ask in asks] == [1, 1, 1]
    deadline = time.monotonic() + 10
    while executor.capturing and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.close()
    calls = [call for call, _, _ in executor.calls]
    assert calls == ["launch", "finish", "capture", "capture", "capture"], calls


def test_graphs_are_captured_between_rounds_on_the_round_thread(asker):
    """An idle loop captures, one capacity per step, on the round thread; an ask that comes meanwhile is
    launched after the step in progress, before the next one; every capture is done in the end."""
    executor = FakeExecutor(captures=6, capture_seconds=0.05)
    loop = run_loop(executor)
    time.sleep(IDLE_WORK_AFTER_S + 0.07)  # the loop is in its second capture step
    ask = asker("while capturing")
    loop.submit(ask)
    assert ask.future.result(10) == 1
    deadline = time.monotonic() + 10
    while executor.capturing and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.close()
    calls = [call for call, _, _ in executor.calls]
    assert calls.count("capture") == 6 and not executor.capturing
    assert 1 <= calls.index("launch") <= 3, calls  # after the step it came during, not after all of them
    assert calls.index("finish") < calls.index("launch") + 2  # finished before the loop captured on
    assert {thread for _, thread, _ in executor.calls} == {"flide-rounds"}


def test_idle_work_waits_as_long_as_the_executor_asks(asker):
    """Idle work the executor puts off (a pool trim) is not done in pauses shorter than that, and is done once
    the device has idled that long."""
    executor = FakeExecutor(captures=1, idle_after=0.6)
    loop = run_loop(executor)
    for i in range(3):
        time.sleep(0.3)  # a pause shorter than the executor's delay, then an ask
        ask = asker(f"burst {i}")
        loop.submit(ask)
        ask.future.result(10)
    assert executor.capturing
    deadline = time.monotonic() + 10
    while executor.capturing and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.close()
    assert [call for call, _, _ in executor.calls][-1] == "capture" and not executor.capturing


def test_closing_during_capture_ends_the_loop(asker):
    executor = FakeExecutor(captures=1000, capture_seconds=0.01)
    loop = run_loop(executor)
    time.sleep(IDLE_WORK_AFTER_S + 0.03)
    loop.close(timeout=5)
    assert not loop.running and executor.captures_left > 900
    with pytest.raises(fl.EngineClosedError):
        loop.submit(asker("too late"))


def test_a_full_queue_refuses_and_then_admits(asker):
    executor = FakeExecutor()
    executor.launch_gate = threading.Event()
    loop = run_loop(executor, max_pending=2)
    first = asker("first")
    loop.submit(first)
    time.sleep(0.02)  # taken by the round thread, held at launch
    queued = [asker(f"q {i}") for i in range(3)]
    assert loop.offer(queued) == 2  # the leading two fit
    assert loop.offer(queued[2:]) == 0
    executor.launch_gate.set()
    assert first.future.result(10) == 1 and all(ask.future.result(10) >= 2 for ask in queued[:2])
    assert not queued[2].future.done()
    loop.close()


@pytest.mark.asyncio
async def test_a_cancelled_ask_is_dropped_before_its_round(asker):
    executor = FakeExecutor()
    executor.launch_gate = threading.Event()
    loop = run_loop(executor)
    busy = asker("holds the device")
    loop.submit(busy)
    time.sleep(0.02)  # taken by the round thread, held at launch
    ask, kept = asker("cancelled"), asker("kept")
    loop.offer([ask, kept])
    waiting = asyncio.ensure_future(asyncio.wrap_future(ask.future))
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.sleep(0.01)
    executor.launch_gate.set()
    assert await asyncio.wrap_future(kept.future) == 2 and ask.future.cancelled()
    assert executor.rounds == 2
    loop.close()


# ------------------------------------------------------------------------------------------ the scheduler
def test_identical_trunks_share_one_request(asker):
    asks = [asker("same"), asker("same", {"c": fl.Choice("Next?", {"a": None, "b": None})}), asker("other")]
    batch = schedule(asks, lambda trunk: None, LIMITS)
    assert [len(r.asks) for r in batch.requests] == [2, 1] and batch.asks == [asks[0], asks[1], asks[2]]


def test_rounds_split_at_capacity_but_admit_a_large_first_ask(asker):
    asks = [asker("word " * 60), asker("short"), asker("word " * 61)]
    tokens = [len(ask.trunk) + ask.branch_tokens for ask in asks]
    batch = schedule(asks, lambda trunk: None, RoundLimits(tokens=tokens[0] - 1, requests=64, questions=100))
    assert batch.asks == [asks[0]] and batch.kept == asks[1:]  # the first ask runs alone, however large
    batch = schedule(asks, lambda trunk: None, RoundLimits(tokens=tokens[0] + tokens[1], requests=64, questions=100))
    assert batch.asks == asks[:2] and batch.kept == [asks[2]]  # the scan goes on past an ask that does not fit
    batch = schedule(asks, lambda trunk: None, RoundLimits(tokens=10_000, requests=2, questions=100))
    assert batch.asks == asks[:2]
    batch = schedule(asks, lambda trunk: None, RoundLimits(tokens=10_000, requests=64, questions=2))
    assert batch.asks == asks[:2]


def test_cancelled_asks_are_dropped_by_the_scheduler(asker):
    asks = [asker("a"), asker("b"), asker("c")]
    asks[1].future.cancel()
    batch = schedule(asks, lambda trunk: None, LIMITS)
    assert batch.asks == [asks[0], asks[2]] and batch.kept == []
