"""The batch-invariant mode: every answer has the bits (`==` on the returned floats) of its question asked alone
on an engine with no checkpoints, whatever shares its round, and after resuming from any earlier checkpoint."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

import flide_sdk as fl
from flide_sdk.errors import InvalidOptionError
from flide_sdk.kernels.fixed_order import fixed_matmul
from flide_sdk.models.ops import reference_ops

from .conftest import TOLERANCE, answer_probabilities, reference_probabilities, text_of_tokens
from .test_text_scoring import teacher_forced

QUESTIONS = {
    "stuck": fl.Noul("Is the agent stuck in a loop?"),
    "next": fl.Choice("What comes next?", {"read": "inspect code", "edit": None, "test": "run tests", "submit": None}),
    "done": fl.Score("How close to done?", ["far", "halfway", "close", "done"]),
    "tool": fl.Choice("Which tool?", {name: None for name in ["bash", "edit", "search", "submit", "read", "plan"]}),
    "urgent": fl.Noul("Does this need a reply within the hour?"),
    "command": fl.Choice("Which command next?", {"the test": None, "the test again": None, "read line 12": None},
                         scoring="text"),
}
WORDS = ["the", "agent", "opened", "the", "file", "read", "line", "12", "found", "an", "error", "edited", "the", "function", "and", "ran", "the", "tests", "again"]


def growth(rng: random.Random) -> str:
    text = " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 90)))
    return text + rng.choice(["", "ing", " test", ".", "\n"])


def some_questions(rng: random.Random) -> dict:
    names = rng.sample(sorted(QUESTIONS), rng.randint(1, 3))
    return {name: QUESTIONS[name] for name in names}


class Alone:
    """Each question asked alone on an engine without checkpoints (every trunk computed from position 0)."""

    def __init__(self, engine: fl.Engine) -> None:
        self.engine = engine
        self.cache: dict[tuple[str, str], object] = {}

    def answer(self, state: str, name: str):
        key = (state, name)
        if key not in self.cache:
            self.cache[key] = self.engine.ask_sync(state, {name: QUESTIONS[name]}).answers[name]
        return self.cache[key]

    def assert_same_bits(self, state: str, answers: dict) -> None:
        for name, answer in answers.items():
            alone = self.answer(state, name)
            assert answer == alone, f"{name}: {answer} != alone {alone}"


@pytest.fixture(scope="module")
def alone(tiny_path):
    with fl.Engine.load(tiny_path, device="cpu", pool_bytes=0, batch_invariant=True) as engine:
        yield Alone(engine)


@pytest.mark.asyncio
async def test_random_mixed_rounds_have_the_bits_of_questions_asked_alone(tiny_path, alone):
    """Rounds of up to 16 requests mixing one-off asks and sessions that resume from their last step's
    checkpoint: each answer equals its question asked alone, bit for bit."""
    rng = random.Random(7)
    async with fl.Engine.load(tiny_path, device="cpu", round_deadline_ms=300, batch_invariant=True) as engine:
        sessions = [(engine.session(), [""]) for _ in range(5)]
        for step in range(4):
            asks, states = [], []
            for session, text in sessions:
                addition = growth(rng)
                session.append(addition)
                text[0] += addition
                questions = some_questions(rng)
                asks.append(session.ask(questions))
                states.append(text[0])
            for _ in range(rng.randint(1, 11)):
                state = text_of_tokens(engine.tokens, rng.randint(1, 300), seed=rng.randint(0, 3))
                asks.append(engine.ask(state, some_questions(rng)))
                states.append(state)
            rounds = engine.stats()["rounds"]
            responses = await asyncio.gather(*asks)
            assert engine.stats()["rounds"] - rounds < len(asks), "asks must share rounds for this test to mean anything"
            for state, response in zip(states, responses):
                alone.assert_same_bits(state, response.answers)
        stats = engine.stats()
        assert stats["checkpoint_hits"] >= 10 and stats["tokens_resumed"] > 0
    with fl.Engine.load(tiny_path, device="cpu", batch_invariant=True) as fresh:  # a brand-new engine too
        state, text = states[-1], sessions[0][1][0]
        for asked in (state, text):
            alone.assert_same_bits(asked, fresh.ask_sync(asked, {"tool": QUESTIONS["tool"]}).answers)


def test_resumed_from_any_earlier_checkpoint_has_the_bits_of_a_fresh_trunk(tiny_path, alone):
    """A state asked after a shorter prefix of it left a checkpoint (any earlier step) resumes from there and
    keeps the bits of the fresh computation; checkpoints sit at multiples of 64 tokens."""
    rng = random.Random(3)
    steps = [""]
    for _ in range(5):
        steps.append(steps[-1] + growth(rng))
    steps = steps[1:]
    with fl.Engine.load(tiny_path, device="cpu", batch_invariant=True) as engine:
        for later in range(1, len(steps)):
            for earlier in range(later):
                engine.clear_pool()
                engine.ask_sync(steps[earlier], {"stuck": QUESTIONS["stuck"]})
                resumed = engine.stats()["tokens_resumed"]
                answers = engine.ask_sync(steps[later], QUESTIONS).answers
                gained = engine.stats()["tokens_resumed"] - resumed
                assert gained > 0 and gained % 64 == 0, "resumed from a 64-aligned checkpoint of the earlier step"
                alone.assert_same_bits(steps[later], answers)


def test_invariant_answers_stay_exact_against_transformers(tiny_path, hf_tiny, alone):
    state = text_of_tokens(alone.engine.tokens, 700, seed=5)
    rendered = alone.engine.render(state, QUESTIONS)
    for name, question in QUESTIONS.items():
        got = answer_probabilities(alone.answer(state, name))
        expected = (teacher_forced(hf_tiny, alone.engine, state, name, question) if name == "command"
                    else reference_probabilities(hf_tiny, rendered, name))
        assert np.abs(got - expected).max() <= TOLERANCE


def test_the_default_mode_is_not_batch_invariant_here(tiny_path):
    """Guard for the tests above: without the mode, a question forked among others differs in its last bits
    from the same question asked alone, so the tests above can fail."""
    with fl.Engine.load(tiny_path, device="cpu", pool_bytes=0) as engine:
        state = text_of_tokens(engine.tokens, 500, seed=2)
        together = engine.ask_sync(state, QUESTIONS).answers
        differ = [name for name in QUESTIONS if engine.ask_sync(state, {name: QUESTIONS[name]}).answers[name]
                  != together[name]]
        assert differ


def test_custom_ops_are_refused_in_the_mode(alone):
    """The mode's guarantee rests on its own fixed-order ops: an engine given other ops refuses it."""
    engine = alone.engine
    with pytest.raises(InvalidOptionError, match="batch_invariant"):
        fl.Engine(engine.model, engine.prompt, engine.device, ops=reference_ops, batch_invariant=True)


def test_fixed_matmul_keeps_its_bits_in_any_batch_and_chunk():
    """A product keeps its bits whatever else is in its batch or its chunk of rows, with a transposed operand
    too (the GDN state update, K^T v_new: a broadcast product left to torch's layout summed it otherwise)."""
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(300, 4, 64, 16, generator=gen), torch.randn(300, 4, 64, 16, generator=gen)
    full = fixed_matmul(k.transpose(-1, -2), v)
    for lo, hi in [(0, 1), (5, 6), (0, 7), (3, 200)]:
        assert torch.equal(fixed_matmul(k[lo:hi].transpose(-1, -2), v[lo:hi]), full[lo:hi]), (lo, hi)
    assert torch.allclose(full, k.transpose(-1, -2) @ v, rtol=1e-5, atol=1e-4)
    a, b = torch.randn(40, 64, generator=gen), torch.randn(64, 8192, generator=gen)  # 8 rows a chunk
    rows = fixed_matmul(a, b)
    for lo, hi in [(0, 1), (3, 4), (0, 9), (5, 22), (31, 40)]:
        assert torch.equal(fixed_matmul(a[lo:hi], b), rows[lo:hi]), (lo, hi)
