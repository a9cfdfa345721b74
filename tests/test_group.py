"""`EngineGroup`: engines of one model behind one API; sessions stay on the engine holding their checkpoints,
new sessions and one-off asks go where there is least work, and the answers are a single engine's."""

from __future__ import annotations

import asyncio

import pytest

import flide_sdk as fl

from .test_cluster import QUESTIONS, WORDS, step_all


@pytest.mark.asyncio
async def test_sessions_stay_on_their_engine_and_answer_as_one_engine(tiny_path, single):
    """4 sessions x 4 steps on two engines: sessions placed by load, two on each; every step equals one
    engine's answer; every step after the first resumes from its checkpoint on its own engine."""
    async with fl.EngineGroup.load(tiny_path, ["cpu", "cpu"]) as group:
        sessions = [group.session() for _ in range(4)]
        engines = [group.engines.index(session.engine) for session in sessions]
        assert engines == [0, 1, 0, 1], "each new session goes to the engine with the fewest"
        texts = [""] * 4
        for step in range(4):
            await step_all(sessions, texts, step, single)
        stats = group.stats()
        assert [engine["checkpoint_hits"] for engine in stats["engines"]] == [6, 6], "3 resumed steps a session"
        assert [engine["asks"] for engine in stats["engines"]] == [8, 8]
        assert stats["total"]["asks"] == 16 and stats["total"]["checkpoint_hits"] == 12
        fork = sessions[1].fork()
        assert fork.engine is sessions[1].engine, "a fork shares its parent's checkpoints: same engine"


@pytest.mark.asyncio
async def test_one_off_asks_go_to_the_engine_with_fewest_in_flight(tiny_path):
    async with fl.EngineGroup.load(tiny_path, ["cpu", "cpu"]) as group:
        states = [f"state {i}: " + " ".join(WORDS) for i in range(6)]
        answers = await asyncio.gather(*(group.ask(state, QUESTIONS) for state in states))
        assert all(set(answer.answers) == set(QUESTIONS) for answer in answers)
        assert [engine["asks"] for engine in group.stats()["engines"]] == [3, 3]
        rendered, alone = group.render(states[0], QUESTIONS), group.engines[1].render(states[0], QUESTIONS)
        assert list(rendered.state_ids) == list(alone.state_ids) and rendered.questions.keys() == set(QUESTIONS)
        closed_first = group.session()
        closed_first.close()
        assert group.engines.index(group.session().engine) == 0, "closed sessions do not count"


def test_group_errors_and_close(tiny_path):
    with pytest.raises(fl.InvalidOptionError):
        fl.EngineGroup.load(tiny_path, [])
    with pytest.raises(fl.CheckpointError):
        fl.EngineGroup.load(tiny_path.parent / "missing", ["cpu", "cpu"])
    group = fl.EngineGroup.load(tiny_path, ["cpu"])
    assert group.ask_sync("the agent", QUESTIONS, timeout=60)["stuck"].noul >= 0
    group.close()
    assert group.closed and all(engine.closed for engine in group.engines)
    with pytest.raises(fl.EngineClosedError):
        group.ask_sync("the agent", QUESTIONS)
    with pytest.raises(fl.EngineClosedError):
        group.session()
