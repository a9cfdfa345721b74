"""Input the engine refuses or accepts before anything is queued (issue 61): JSON nested past the one nesting limit
(`questions.MAX_NESTING`) in a state, an appended message or a question's content is a typed error, never a bare
RecursionError; a question name holding a lone surrogate is refused at ask (its answers could not be written as
JSON); a bare `{"type": "noul"}` is accepted, as transformers' decision pipeline accepts it."""

from __future__ import annotations

import json

import pytest
import torch

import flide_sdk as fl
from flide_sdk.questions import MAX_NESTING, check_nesting, parse_questions

from .test_decision_models import build as build_decision_model
from .test_decision_pipeline import assert_as_pipeline

BAD = b"tool said \xff then".decode("utf-8", "surrogateescape")  # a lone surrogate at 10
QUESTIONS_OK = {"ok": fl.Noul("Is it fine?")}


def nested(depth: int, leaf: object = "x") -> object:
    """`leaf` inside `depth` levels of alternating lists and objects (depth 0: the leaf itself)."""
    value = leaf
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


QUESTION_PLACES = {
    "noul instructions": lambda deep: {"type": "noul", "instructions": deep},
    "noul criteria": lambda deep: {"type": "noul", "instructions": "?", "criteria": {"true": deep}},
    "choice option": lambda deep: {"type": "choice", "instructions": "?", "criteria": {"a": deep, "b": None}},
    "score level": lambda deep: {"type": "score", "instructions": "?", "criteria": ["low", deep]},
}


def test_the_nesting_limit_is_counted_in_levels_and_walked_without_recursion():
    # mutation: the limit checked with `>=` (100 levels refused) -> fails; a recursive walk -> RecursionError at
    # 100,000 levels -> fails
    for value in ("text", 3, None, nested(MAX_NESTING), [nested(MAX_NESTING - 1)] * 3):
        assert check_nesting(value, "the state") is None
    for depth in (MAX_NESTING + 1, 1_000, 100_000):
        with pytest.raises(fl.InvalidStateError, match=f"the state is nested deeper than {MAX_NESTING} levels"):
            check_nesting(nested(depth), "the state")
    with pytest.raises(fl.InvalidQuestionError, match="Noul instructions"):
        check_nesting(nested(MAX_NESTING + 1), "Noul instructions", fl.InvalidQuestionError)
    circular: list = []
    circular.append(circular)
    with pytest.raises(fl.InvalidStateError, match="refers to itself"):
        check_nesting(circular, "the message")


@pytest.mark.parametrize("place", QUESTION_PLACES)
@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 1_000, 50_000])
def test_deep_question_content_is_an_invalid_question_before_anything_is_queued(engine, place, depth):
    # mutation: `_check_content` without its check_nesting call -> 101 levels are accepted and 1,000 raise a bare
    # RecursionError from json.dumps -> fails
    question = QUESTION_PLACES[place](nested(depth))
    with pytest.raises(fl.InvalidQuestionError, match=f"nested deeper than {MAX_NESTING} levels"):
        engine.ask_sync("a state", {"q": question})
    session = engine.session()
    session.append("a state")
    with pytest.raises(fl.InvalidQuestionError, match="nested deeper"):
        session.ask_sync({"q": question})
    if place == "noul instructions":  # the typed form checks at construction
        with pytest.raises(fl.InvalidQuestionError, match="nested deeper"):
            fl.Noul(nested(depth))
    assert engine.stats()["asks"] == 0


def test_question_content_at_the_limit_is_answered(engine):
    questions = {name: build(nested(MAX_NESTING)) for name, build in QUESTION_PLACES.items()}
    assert set(engine.ask_sync("a state", questions)) == set(questions)


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 5_000])
def test_a_deep_state_is_an_invalid_state_before_anything_is_queued(engine, depth):
    with pytest.raises(fl.InvalidStateError, match=f"nested deeper than {MAX_NESTING} levels"):
        engine.ask_sync(nested(depth), QUESTIONS_OK)
    assert engine.stats()["asks"] == 0


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 5_000])
def test_a_deep_appended_message_is_refused_and_the_session_still_answers(engine, depth):
    session = engine.session()
    session.append({"role": "user", "content": "fix it"})
    with pytest.raises(fl.InvalidStateError, match=f"nested deeper than {MAX_NESTING} levels"):
        session.append({"role": "tool", "content": nested(depth)})
    assert set(session.ask_sync(QUESTIONS_OK)) == {"ok"}


def test_a_state_at_the_limit_is_answered(engine):
    assert set(engine.ask_sync(nested(MAX_NESTING), QUESTIONS_OK)) == {"ok"}
    session = engine.session()
    session.append({"role": "tool", "content": nested(MAX_NESTING - 1)})
    assert set(session.ask_sync(QUESTIONS_OK)) == {"ok"}


@pytest.mark.parametrize("name", [BAD, "ok" + BAD[-6:], "\ud800"])
def test_a_question_name_with_a_lone_surrogate_is_refused_at_ask(engine, name):
    # mutation: parse_questions without its name check -> the ask is answered and `to_json` raises
    # UnicodeEncodeError -> fails
    with pytest.raises(fl.InvalidQuestionError, match="question name .* holds a lone surrogate"):
        engine.ask_sync("a state", {"fine": fl.Noul("?"), name: fl.Noul("Did the tool fail?")})
    assert engine.stats()["asks"] == 0
    response = engine.ask_sync("a state", {"naïve 東京 ✓": fl.Noul("Did the tool fail?")})
    assert json.loads(response.to_json())["answers"]["naïve 東京 ✓"]["type"] == "noul"


BARE = {"bare": {"type": "noul"}, "named": {"type": "noul", "instructions": "Did the build fail?"}}


def test_a_bare_noul_parses_and_is_answered(engine):
    # mutation: Noul requiring instructions or a described outcome again -> fails
    assert parse_questions(BARE)["bare"] == fl.Noul()
    answers = engine.ask_sync("The build failed at step 3.", {"bare": fl.Noul(), **BARE})
    assert 0.0 <= answers["bare"].noul <= 1.0


@pytest.fixture(scope="module")
def transformers_pair(tiny_path):
    """(an engine with rendering="transformers", transformers' pipeline) on the tiny checkpoint."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, pipeline

    model = Qwen3_5ForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    decide = pipeline("decision", model=model, tokenizer=AutoTokenizer.from_pretrained(tiny_path))
    with fl.Engine.load(tiny_path, device="cpu", dtype="float32", rendering="transformers") as engine:
        yield engine, decide


def test_a_bare_noul_with_transformers_rendering_gives_the_pipelines_probability(transformers_pair):
    engine, decide = transformers_pair
    state = "The build failed at step 3."
    assert_as_pipeline(decide, state, BARE, engine.ask_sync(state, BARE))


@pytest.mark.parametrize("kind", ["question", "jev"])
def test_a_bare_noul_on_a_decision_model_gives_the_pipelines_probability(tiny_path, tmp_path, kind):
    path, decide = build_decision_model(kind, tiny_path, tmp_path)
    with fl.Engine.load(path, device="cpu", dtype="float32") as engine:
        state = "The build failed at step 3."
        assert_as_pipeline(decide, state, BARE, engine.ask_sync(state, BARE))
