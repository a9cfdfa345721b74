"""Exactness (DESIGN.md §8): every forked answer equals transformers on that question's standalone prompt."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import flide_sdk as fl

from .conftest import TOLERANCE, answer_probabilities, reference_probabilities, text_of_tokens

QUESTION_POOL = {
    "urgent": fl.Noul("Does this need a reply within the hour?"),
    "described": fl.Noul("Is the test fixed?", {"true": "the last run passed", "false": "it still fails"}),
    "action": fl.Choice("What next?", {"refund": "refund the order", "replace": None, "wait": "do nothing"}),
    "tool": fl.Choice("Which tool?", {name: None for name in ["bash", "edit", "search", "submit", "read", "test", "plan"]}),
    "severity": fl.Score("How severe?", ["low", "mid", "high"]),
    "progress": fl.Score("How close to done?", [f"level {i}" for i in range(12)]),
    "plain": {"type": "noul", "instructions": "Is the agent stuck?"},
    "json": fl.Choice({"task": "pick one"}, {"yes": {"why": "ok"}, "no": None}),
}


def pick(names: list[str]) -> dict:
    return {name: QUESTION_POOL[name] for name in names}


def mixed_requests(tokens) -> list[tuple[object, dict]]:
    """States of 1, ~300 and ~900 tokens (not multiples of 64), 1 to 8 questions, all three types."""
    one_token = "the"
    assert len(tokens.encode(one_token)) == 1
    mid = text_of_tokens(tokens, 301, seed=1)
    long = text_of_tokens(tokens, 899, seed=2)
    messages = [{"role": "user", "content": text_of_tokens(tokens, 150, seed=3)}, {"role": "assistant", "content": "ok"}]
    return [
        (one_token, pick(["urgent"])),
        (mid, pick(["action", "severity", "described"])),
        (long, pick(list(QUESTION_POOL))),
        (messages, pick(["tool", "progress"])),
    ]


def assert_exact(hf_model, engine, state, questions, answers) -> float:
    rendered = engine.render(state, questions)
    worst = 0.0
    for name in questions:
        expected = reference_probabilities(hf_model, rendered, name)
        got = answer_probabilities(answers[name])
        assert got.shape == expected.shape
        worst = max(worst, float(np.abs(got - expected).max()))
    assert worst <= TOLERANCE, f"max |dp| = {worst:.2e} > {TOLERANCE}"
    return worst


async def assert_mixed_round_exact(path, hf_model, **load_options) -> None:
    """The `mixed_requests` asked together take one round of an engine loaded from `path`, each exact."""
    async with fl.Engine.load(path, device="cpu", round_deadline_ms=500, **load_options) as engine:
        requests = mixed_requests(engine.tokens)
        answers = await asyncio.gather(*(engine.ask(state, questions) for state, questions in requests))
        assert engine.stats()["rounds"] == 1, "the requests must share one round for this test to mean anything"
        for (state, questions), got in zip(requests, answers):
            assert_exact(hf_model, engine, state, questions, got)


@pytest.mark.asyncio
async def test_mixed_round_matches_transformers(tiny_path, hf_tiny):
    await assert_mixed_round_exact(tiny_path, hf_tiny)


def test_question_asked_alone_matches(engine, hf_tiny):
    for state, questions in mixed_requests(engine.tokens):
        for name, question in questions.items():
            alone = engine.ask_sync(state, {name: question})
            assert_exact(hf_tiny, engine, state, {name: question}, alone)


def test_forked_answers_are_not_trivial(engine):
    """Guard for the tests above: the tiny model's answers depend on the state and spread over options."""
    questions = pick(["action", "severity"])
    first = engine.ask_sync("the refund was late", questions)
    second = engine.ask_sync("the test failed again", questions)
    a, b = answer_probabilities(first["action"]), answer_probabilities(second["action"])
    assert np.abs(a - b).max() > 1e-2
    assert 0.05 < a.max() < 0.999
