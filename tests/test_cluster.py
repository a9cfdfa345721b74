"""`flide_sdk.cluster` without Ray: its replicas and client behind a fake Serve handle that routes a session
family to the replica that served it (as Serve's multiplexed routing does) and can lose a replica. Sessions stay
on one replica and resume from its checkpoints; a lost replica's sessions continue elsewhere, exactly; errors are
the SDK's. The same run on a local Ray cluster: tests/test_cluster_ray.py."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

import flide_sdk as fl
from flide_sdk.cluster import ClusterClient, FlideReplica

from .conftest import TOLERANCE, answer_probabilities

QUESTIONS = {
    "stuck": fl.Noul("Is the agent stuck in a loop?"),
    "next": fl.Choice("What comes next?", {"read": "inspect code", "edit": None, "test": "run tests"}),
}
WORDS = "the agent opened the file read line 12 found an error edited the function and ran the tests again".split()


def step_text(session: int, step: int) -> str:
    return f" session {session} step {step}: " + " ".join(WORDS[(session + step) % 5 :] * 2)


def probabilities(response: fl.SystemOneResponse) -> np.ndarray:
    return np.concatenate([answer_probabilities(response[name]) for name in QUESTIONS])


async def step_all(sessions: list, texts: list[str], step: int, single: fl.Engine) -> None:
    """Append step `step` to every session (and to its text in `texts`), ask them all at once, and check each
    answer against `single` asked the whole text."""
    for index, session in enumerate(sessions):
        session.append(step_text(index, step))
        texts[index] += step_text(index, step)
    answers = await asyncio.gather(*(session.ask(QUESTIONS) for session in sessions))
    for text, got in zip(texts, answers):
        assert np.abs(probabilities(got) - probabilities(single.ask_sync(text, QUESTIONS))).max() <= TOLERANCE


class FakeHandle:
    """`handle.ask.remote(...)`, `handle.options(multiplexed_model_id=f).session_ask.remote(...)`: a family
    goes to the live replica that served it, else to the next live one in turn; a lost replica raises."""

    def __init__(self, replicas: list[FlideReplica]) -> None:
        self.replicas, self.lost, self.routes = replicas, set(), {}
        self.turn = itertools.cycle(range(len(replicas)))

    def options(self, multiplexed_model_id: str = "") -> FakeHandle.Bound:
        return FakeHandle.Bound(self, multiplexed_model_id)

    def __getattr__(self, name: str) -> FakeHandle.Method:
        return FakeHandle.Method(self, "", name)

    async def call(self, family: str, name: str, args: tuple):
        index = self.routes.get(family)
        if index is None or index in self.lost:  # the next live one in turn (if none is left, a lost one)
            for _ in self.replicas:
                index = next(self.turn)
                if index not in self.lost:
                    break
        if family:
            self.routes[family] = index
        await asyncio.sleep(0)
        if index in self.lost:
            raise RuntimeError("the actor died")
        return await getattr(self.replicas[index], name)(*args)

    class Bound:
        def __init__(self, handle: FakeHandle, family: str) -> None:
            self.handle, self.family = handle, family

        def __getattr__(self, name: str) -> FakeHandle.Method:
            return FakeHandle.Method(self.handle, self.family, name)

    class Method:
        def __init__(self, handle: FakeHandle, family: str, name: str) -> None:
            self.handle, self.family, self.name = handle, family, name

        def remote(self, *args):
            return self.handle.call(self.family, self.name, args)


@pytest.mark.asyncio
async def test_sessions_stay_on_a_replica_and_continue_exactly_when_it_is_lost(tiny_path, single):
    """8 sessions x 10 steps on 2 replicas: each session's asks go to one replica and every step after its
    first resumes from a checkpoint there; replica 0 is lost after step 5, and its sessions' next asks recompute
    their history once on replica 1; every answer equals a single engine's; a fork asks its parent's replica."""
    replicas = [FlideReplica(str(tiny_path), {"device": "cpu"}) for _ in range(2)]
    handle = FakeHandle(replicas)
    client = ClusterClient(handle)
    sessions = [client.session() for _ in range(8)]
    texts = [""] * 8
    for step in range(10):
        if step == 5:
            handle.lost.add(0)
        await step_all(sessions, texts, step, single)
    moved = [s for s in sessions if s.replicas[0] == replicas[0].name]
    assert len(moved) == 4 and all(set(s.replicas[5:]) == {replicas[1].name} for s in moved)
    assert all(set(s.replicas) == {replicas[1].name} for s in sessions if s not in moved)
    first = await replicas[0].stats()
    second = await sessions[0].replica_stats()  # the replica its asks now go to: the one left
    assert second["replica"] == replicas[1].name
    assert first["checkpoint_hits"] == 4 * 4, "steps 2-5 of its 4 sessions"
    assert second["checkpoint_hits"] == 4 * 9 + 4 * 4, "its own sessions' steps 2-10, the moved ones' 7-10"
    fork = sessions[1].fork()
    fork.append(" the fork goes on")
    got = await fork.ask(QUESTIONS)
    assert fork.replicas == [sessions[1].replicas[-1]]
    assert np.abs(probabilities(got) - probabilities(single.ask_sync(texts[1] + " the fork goes on", QUESTIONS))
                  ).max() <= TOLERANCE
    for replica in replicas:
        replica.engine.close()


@pytest.mark.asyncio
async def test_cluster_errors_are_the_sdks(tiny_path):
    replica = FlideReplica(str(tiny_path), {"device": "cpu"})
    handle = FakeHandle([replica])
    client = ClusterClient(handle)
    with pytest.raises(fl.InvalidQuestionError):
        await client.ask("state", {"q": {"type": "vote"}})
    session = client.session()
    session.append("the agent")
    with pytest.raises(fl.InvalidQuestionError):
        await session.ask({"q": {"type": "choice", "instructions": "Which?", "criteria": {}}})
    assert (await client.ask("state", QUESTIONS))["stuck"].noul >= 0
    handle.lost.add(0)
    with pytest.raises(fl.ReplicaError):
        await session.ask(QUESTIONS)
    replica.engine.close()
