"""A graph round alone on the device is finished by the event loop that awaits its asks (`answer_on_loop`).

CPU engines replay no graphs, so these tests stand a delayed runner in for the graphs: it runs the round
eagerly when launched and reports it done `DEVICE_SECONDS` later, as a replay on the device would be (host_sim's
modeled launch).
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

import flide_sdk as fl
from benchmarks.host_sim import ModeledLaunch
from flide_sdk.plan.capacity import capacity_ladder, choose
from flide_sdk.plan.layout import RoundPlan

from .conftest import answer_probabilities

GOOD = {"n": fl.Noul("Is it late?"), "c": fl.Choice("Next?", {"wait": None, "act": None})}
DEVICE_SECONDS = 0.05


class DelayedRunner:
    """Stands in for `GraphRunner`: the capacity ladder, and launches that run eagerly and finish later."""

    def __init__(self, engine: fl.Engine, seconds: float) -> None:
        self.engine, self.seconds = engine, seconds
        self.ladder = capacity_ladder(engine.model.config.conv_kernel, 4096, engine.max_round_requests,
                                      engine.renderer.max_prompt_tokens)

    def launch(self, plan: RoundPlan) -> ModeledLaunch:
        return ModeledLaunch(self.engine._run_eager(plan.host_round()), choose(self.ladder, plan), {},
                             time.perf_counter() + self.seconds, self.seconds)


def delayed(engine: fl.Engine, seconds: float = DEVICE_SECONDS) -> list[str]:
    """Make `engine` launch through a DelayedRunner (launching in the caller as a graph engine does) and return
    the list of the threads that finish its rounds, one name per round."""
    engine._graphs = DelayedRunner(engine, seconds)
    engine._loop.launch_in_caller = engine._fits_a_graph
    finishers: list[str] = []
    finish = engine._finish

    def recording(flight) -> None:
        finishers.append(threading.current_thread().name)
        finish(flight)

    engine._finish = engine._loop._finish = recording
    return finishers


def assert_same_answers(got, expected) -> None:
    for name in GOOD:
        assert np.abs(answer_probabilities(got[name]) - answer_probabilities(expected[name])).max() < 1e-6


@pytest.mark.asyncio
async def test_a_lone_round_is_finished_by_the_loop_that_awaits_it(tiny_path):
    """Once its graph has a replay time on record, a lone ask's round is finished on the asking loop's thread,
    its answers those of the round thread's finish; with answer_on_loop off the round thread finishes them all."""
    async with fl.Engine.load(tiny_path, device="cpu") as plain, fl.Engine.load(tiny_path, device="cpu") as engine:
        finishers = delayed(engine)
        states = [f"lone ask {i} about a late order" for i in range(4)]
        for state in states:
            assert_same_answers(await engine.ask(state, GOOD), await plain.ask(state, GOOD))
        me = threading.current_thread().name
        assert finishers == ["flide-rounds", me, me, me]  # the first round: no replay time on record yet
        engine.answer_on_loop = False
        assert_same_answers(await engine.ask(states[0], GOOD), await plain.ask(states[0], GOOD))
        assert finishers[-1] == "flide-rounds"
        assert engine.stats()["rounds"] == 5 and engine.stats()["graph_replays"] == 5


@pytest.mark.asyncio
async def test_a_blocked_loop_holds_up_no_other_ask(tiny_path):
    """A loop blocked past its lease (here by a synchronous sleep) does not hold up the asks of others: an ask
    from another thread queued meanwhile is answered while the loop still sleeps, the round thread having
    finished the leased round first, and the blocked loop gets its answers once it runs again."""
    async with fl.Engine.load(tiny_path, device="cpu") as plain, fl.Engine.load(tiny_path, device="cpu") as engine:
        finishers = delayed(engine)
        await engine.ask("a first ask, to time the graph", GOOD)
        task = asyncio.ensure_future(engine.ask("an ask whose loop blocks", GOOD))
        while engine.stats()["graph_replays"] < 2:  # the ask is launched by its own task on this loop
            await asyncio.sleep(0)
        answered: dict[str, float] = {}

        def other() -> None:
            asyncio.run(engine.ask("asked on another thread", GOOD))
            answered["at"] = time.perf_counter()

        helper = threading.Timer(3 * DEVICE_SECONDS, other)  # past the lease (1.5 x 0.05 + 0.001 s)
        helper.start()
        time.sleep(20 * DEVICE_SECONDS)  # noqa: ASYNC251 -- the point: this loop blocks past its lease
        woke = time.perf_counter()
        assert_same_answers(await task, await plain.ask("an ask whose loop blocks", GOOD))
        helper.join(30)
        assert answered["at"] < woke
        assert finishers == ["flide-rounds"] * 3
        assert_same_answers(await engine.ask("and the next", GOOD), await plain.ask("and the next", GOOD))
        assert finishers[-1] == threading.current_thread().name


def test_a_loop_closed_while_its_round_runs_does_not_stall_the_engine(tiny_path):
    """A loop closed with its leased round in flight (a timed-out `asyncio.run`) never polls again: the engine
    finishes that round when the next ask comes, and serves it as usual."""
    with fl.Engine.load(tiny_path, device="cpu") as engine:
        finishers = delayed(engine)
        asyncio.run(engine.ask("a first ask, to time the graph", GOOD))

        async def impatient() -> None:
            await asyncio.wait_for(engine.ask("asked, then given up on", GOOD), DEVICE_SECONDS / 5)

        with pytest.raises(asyncio.TimeoutError):
            asyncio.run(impatient())
        time.sleep(3 * DEVICE_SECONDS)  # the lease runs out
        response = asyncio.run(engine.ask("the next ask", GOOD))
        assert set(response) == set(GOOD)
        assert engine.stats()["rounds"] == 3 and finishers[1] == "flide-rounds"


@pytest.mark.asyncio
async def test_a_cancelled_ask_does_not_stop_its_round_being_finished(tiny_path):
    """Cancelling the awaiting task once its round runs leaves the round to finish (on the loop, which polls
    on whether or not the task awaits) and the engine serving."""
    async with fl.Engine.load(tiny_path, device="cpu") as engine:
        finishers = delayed(engine)
        await engine.ask("a first ask, to time the graph", GOOD)
        task = asyncio.ensure_future(engine.ask("an ask cancelled while it runs", GOOD))
        while engine.stats()["graph_replays"] < 2:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while engine.stats()["rounds"] < 2:
            await asyncio.sleep(0.005)
        assert finishers[-1] == threading.current_thread().name
        response = await engine.ask("the engine still serves", GOOD)
        assert set(response) == set(GOOD) and engine.stats()["rounds"] == 3


@pytest.mark.asyncio
async def test_a_round_awaited_on_several_loops_is_finished_by_the_round_thread(tiny_path):
    """Asks awaited on two loops (another thread's and this one's) admitted together make one round that no
    single loop could finish alone: the round thread finishes it, each ask answered as alone."""
    async with fl.Engine.load(tiny_path, device="cpu") as plain, fl.Engine.load(tiny_path, device="cpu") as engine:
        finishers = delayed(engine)
        await engine.ask("a first ask, to time the graph", GOOD)
        results: dict[str, dict] = {}
        with engine.admission_paused():
            other = threading.Thread(target=lambda: results.update(
                other=asyncio.run(engine.ask("asked on another loop", GOOD))))
            other.start()
            mine = asyncio.ensure_future(engine.ask("asked on this loop", GOOD))
            while len(engine._loop._pending) < 2:
                await asyncio.sleep(0.001)
        results["mine"] = await mine
        other.join(30)
        assert engine.stats()["rounds"] == 2 and finishers == ["flide-rounds", "flide-rounds"]
        assert_same_answers(results["mine"], await plain.ask("asked on this loop", GOOD))
        assert_same_answers(results["other"], await plain.ask("asked on another loop", GOOD))


@pytest.mark.asyncio
async def test_many_sessions_on_one_loop_are_answered_as_alone(tiny_path):
    """Sessions stepping concurrently on one loop (rounds of several asks, some alone on the device and so
    finished on the loop): every answer equals that of the same history asked on an engine without leases."""
    async with fl.Engine.load(tiny_path, device="cpu") as plain, fl.Engine.load(tiny_path, device="cpu") as engine:
        finishers = delayed(engine, 0.02)

        async def agent(index: int, on: fl.Engine) -> list[dict]:
            session = on.session()
            answers = []
            for step in range(3):
                session.append({"role": "user", "content": f"agent {index} step {step}: the order is late"})
                answers.append(await session.ask(GOOD))
            return answers

        got = await asyncio.gather(*(agent(i, engine) for i in range(8)))
        expected = [await agent(i, plain) for i in range(8)]
        for mine, theirs in zip(got, expected):
            for a, b in zip(mine, theirs):
                assert_same_answers(a, b)
        assert engine.stats()["asks"] == 24 and len(finishers) == engine.stats()["rounds"]


@pytest.mark.asyncio
async def test_closing_with_a_leased_round_in_flight_answers_it(tiny_path):
    """Closing the engine while its loop holds the lease of a running round still answers that ask (the round
    thread finishes every round in flight before it ends, leases or not)."""
    engine = fl.Engine.load(tiny_path, device="cpu")
    finishers = delayed(engine, 0.2)
    await engine.ask("a first ask, to time the graph", GOOD)
    task = asyncio.ensure_future(engine.ask("asked just before the close", GOOD))
    while engine.stats()["graph_replays"] < 2:
        await asyncio.sleep(0)
    engine.close()
    response = await task
    assert set(response) == set(GOOD) and finishers == ["flide-rounds", "flide-rounds"]
    with pytest.raises(fl.EngineClosedError):
        await engine.ask("too late", GOOD)
