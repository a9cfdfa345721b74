"""`@fl.guard` and `@fl.route`: sync and async wrapped functions, block / reroute / pass, batching, sessions."""

from __future__ import annotations

import asyncio

import pytest
import typesafe_sdk as ts

import flide_sdk as fl

DESTRUCTIVE = fl.Noul("Does this command delete or overwrite data?")
TEAM = fl.Choice("Which team should handle this ticket?", {"billing": "payments", "bugs": "defects", "sales": None})


def p_yes(engine: fl.Engine, state) -> float:
    return engine.ask_sync(state, {"guard": DESTRUCTIVE})["guard"].noul


def test_sync_guard_passes_below_and_blocks_above_the_threshold(engine):
    p = p_yes(engine, "Command: rm -rf build/")
    calls = []

    def run(command: str) -> str:
        calls.append(command)
        return f"ran {command}"

    lenient = fl.guard(engine, DESTRUCTIVE, block_above=min(1.0, p + 0.01), state="Command: {command}")(run)
    assert lenient("rm -rf build/") == "ran rm -rf build/" and calls == ["rm -rf build/"]

    strict = fl.guard(engine, DESTRUCTIVE, block_above=max(0.0, p - 0.01), state="Command: {command}")(run)
    with pytest.raises(fl.GuardBlockedError) as blocked:
        strict("rm -rf build/")
    assert calls == ["rm -rf build/"]  # the blocked call did not run
    assert blocked.value.probability == pytest.approx(p, abs=1e-5) and blocked.value.function.endswith(".run")

    rerouted = fl.guard(engine, DESTRUCTIVE, block_above=0.0, on_block=lambda command: f"approval needed: {command}")(run)
    assert rerouted("ls") == "approval needed: ls" and calls == ["rm -rf build/"]
    assert run.__name__ == rerouted.__name__ == "run"


@pytest.mark.asyncio
async def test_async_guard_with_a_state_callable_and_an_async_reroute(engine):
    seen = []

    def state(command: str, cwd: str = "/repo") -> str:
        return f"In {cwd} the agent runs: {command}"

    async def ask_human(command: str, cwd: str = "/repo") -> str:
        await asyncio.sleep(0)
        return f"asked a human about {command}"

    async def run(command: str, cwd: str = "/repo") -> str:
        seen.append(command)
        return f"ran {command} in {cwd}"

    p = (await engine.ask(state("git push --force"), {"guard": DESTRUCTIVE}))["guard"].noul
    passing = fl.guard(engine, DESTRUCTIVE, block_above=min(1.0, p + 0.01), state=state)(run)
    assert await passing("git push --force") == "ran git push --force in /repo"
    blocking = fl.guard(engine, DESTRUCTIVE, block_above=max(0.0, p - 0.01), state=state, on_block=ask_human)(run)
    assert await blocking("git push --force") == "asked a human about git push --force"
    raising = fl.guard(engine, DESTRUCTIVE.instructions, block_above=max(0.0, p - 0.01), state=state)(run)  # a string
    with pytest.raises(fl.GuardBlockedError):
        await raising("git push --force")
    assert seen == ["git push --force"]


@pytest.mark.asyncio
async def test_a_guarded_function_called_from_64_tasks_is_answered_in_fewer_rounds(engine):
    def state(ticket: int) -> str:
        return f"Ticket {ticket}: please delete my account and all my data."

    @fl.guard(engine, ts.Noul(instructions="Does the user ask to delete data?"), block_above=1.0, state=state)
    async def handle(ticket: int) -> int:
        return ticket * 2

    before = engine.stats()
    results = await asyncio.gather(*(handle(i) for i in range(64)))
    after = engine.stats()
    assert results == [2 * i for i in range(64)]
    assert after["asks"] - before["asks"] == 64
    assert after["rounds"] - before["rounds"] <= 2 < 64


def test_a_guard_reuses_the_conversation_session(engine):
    history = [{"role": "user", "content": "Clean up the repository and free some disk space. " * 8}]
    conversation = engine.session()
    conversation.append(history[0])

    @fl.guard(engine, DESTRUCTIVE, block_above=1.0, session=conversation,
              state=lambda command: {"role": "assistant", "content": f"run: {command}"})
    def run(command: str) -> str:
        return command

    computed, resumed = [], []
    for command in ("du -sh *", "rm -rf node_modules", "git gc"):
        before = engine.stats()
        assert run(command) == command
        after = engine.stats()
        computed.append(after["tokens_computed"] - before["tokens_computed"])
        resumed.append(after["tokens_resumed"] - before["tokens_resumed"])
        history.append({"role": "assistant", "content": f"run: {command}"})
    assert resumed[0] == 0 and 0 < resumed[1] < resumed[2]  # each step resumes from the checkpoint of the last
    assert computed[2] < resumed[2]  # a step computes its new tokens, not the whole conversation
    in_session = conversation.fork().ask_sync({"guard": DESTRUCTIVE})["guard"].noul
    assert in_session == pytest.approx(p_yes(engine, history), abs=1e-4)  # the guard appended exactly its states


@pytest.mark.asyncio
async def test_a_guard_finds_each_conversation_session_by_its_arguments(engine):
    sessions = {"a": engine.session(), "b": engine.session()}

    @fl.guard(engine, DESTRUCTIVE, block_above=1.0, session=lambda conversation, command: sessions[conversation],
              state=lambda conversation, command: f"\n$ {command}")
    async def run(conversation: str, command: str) -> str:
        return f"{conversation}:{command}"

    assert await asyncio.gather(run("a", "ls"), run("b", "rm x"), run("a", "pwd")) == ["a:ls", "b:rm x", "a:pwd"]
    p = (await sessions["a"].fork().ask({"guard": DESTRUCTIVE}))["guard"].noul
    assert p == pytest.approx(p_yes(engine, "\n$ ls\n$ pwd"), abs=1e-4)


def test_route_dispatches_to_the_most_probable_option(engine):
    text = "I was charged twice for my subscription."
    answer = engine.ask_sync(text, {"route": TEAM})["route"]
    handled = []
    routes = {name: (lambda ticket, name=name: handled.append(name) or name) for name in TEAM.option_names()}

    @fl.route(engine, TEAM, routes=routes)
    def triage(ticket: str) -> str:
        return "fallback"

    assert triage(text) == answer.choice and handled == [answer.choice]

    @fl.route(engine, TEAM, routes=routes, min_confidence=min(1.0, answer.confidence + 0.01))
    def unsure(ticket: str) -> str:
        return "human review"

    assert unsure(text) == "human review"

    partial = {name: fn for name, fn in routes.items() if name != answer.choice}

    @fl.route(engine, TEAM, routes=partial)
    def unrouted(ticket: str) -> str:
        return "no route"

    assert unrouted(text) == "no route"


@pytest.mark.asyncio
async def test_async_route_awaits_async_routes(engine):
    text = "The export button crashes the app."
    expected = (await engine.ask(text, {"route": TEAM}))["route"].choice

    async def team(ticket: str, name: str = "") -> str:
        await asyncio.sleep(0)
        return name

    routes = {name: (lambda ticket, name=name: team(ticket, name)) for name in TEAM.option_names()}

    @fl.route(engine, {"type": "choice", "instructions": TEAM.instructions, "criteria": TEAM.criteria}, routes=routes)
    async def triage(ticket: str) -> str:
        return "fallback"

    assert await asyncio.gather(*(triage(text) for _ in range(3))) == [expected] * 3


def test_bad_guard_and_route_arguments_raise_at_decoration_time(engine):
    with pytest.raises(fl.InvalidQuestionError, match="Noul"):
        fl.guard(engine, TEAM)
    with pytest.raises(fl.InvalidQuestionError, match="block_above"):
        fl.guard(engine, DESTRUCTIVE, block_above=2.0)
    with pytest.raises(fl.InvalidQuestionError, match="Choice"):
        fl.route(engine, DESTRUCTIVE, routes={})
    with pytest.raises(fl.InvalidQuestionError, match="not options"):
        fl.route(engine, TEAM, routes={"legal": print})
    with pytest.raises(fl.InvalidQuestionError, match="callable"):
        fl.route(engine, TEAM, routes={"billing": "billing"})
    with pytest.raises(fl.InvalidQuestionError, match="state"):
        fl.guard(engine, DESTRUCTIVE, state=42)(print)
