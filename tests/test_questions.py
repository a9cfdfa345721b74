"""Question types, dict parsing, and the answer formulas of DESIGN.md §4."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

import flide_sdk as fl
from flide_sdk.questions import choice_confidence, parse_questions, score_confidence


def test_positional_keyword_and_dict_forms_agree():
    positional = fl.Choice("What next?", {"refund": "refund it", "replace": None})
    keyword = fl.Choice(instructions="What next?", criteria={"refund": "refund it", "replace": None})
    parsed = parse_questions({"q": {"type": "choice", "instructions": "What next?",
                                    "criteria": {"refund": "refund it", "replace": None}}})["q"]
    assert positional == keyword == parsed
    assert fl.Score("How?", ["a", "b"]) == parse_questions({"s": {"type": "score", "instructions": "How?",
                                                                  "criteria": ["a", "b"]}})["s"]
    assert fl.Noul("Is it?") == parse_questions({"n": {"type": "noul", "instructions": "Is it?"}})["n"]


def test_questions_and_answers_encode_with_a_type_tag():
    encoded = msgspec.json.decode(msgspec.json.encode(fl.Noul("Is it?")))
    assert encoded == {"type": "noul", "instructions": "Is it?", "criteria": None}
    answer = fl.ScoreAnswer(score=1.0, confidence=0.5, legend={0: "a", 1: "b"}, probabilities={0: 0.5, 1: 0.5})
    assert msgspec.json.decode(msgspec.json.encode(answer))["type"] == "score"


def test_noul_answer_is_p_yes():
    assert fl.Noul("?").answer(np.array([0.8, 0.2])).noul == pytest.approx(0.8)


def test_choice_answer_formula():
    question = fl.Choice("?", {"a": None, "b": None, "c": None, "d": None})
    answer = question.answer(np.array([0.1, 0.55, 0.25, 0.1]))
    assert answer.choice == "b"
    assert answer.probabilities == {"a": 0.1, "b": 0.55, "c": 0.25, "d": 0.1}
    assert answer.confidence == pytest.approx((0.55 - 0.25) / 0.75)
    assert choice_confidence(np.array([0.25] * 4)) == pytest.approx(0.0)
    assert choice_confidence(np.array([1.0, 0.0])) == pytest.approx(1.0)
    assert choice_confidence(np.array([1.0])) == 1.0


def test_score_answer_formula():
    question = fl.Score("?", ["low", "mid", "high"])
    p = np.array([0.2, 0.5, 0.3])
    answer = question.answer(p)
    assert answer.score == pytest.approx(0.5 + 0.6)
    assert answer.legend == {0: "low", 1: "mid", 2: "high"}
    assert answer.probabilities == {0: 0.2, 1: 0.5, 2: 0.3}
    mad_uniform = (1 + 0 + 1) / 3
    assert answer.confidence == pytest.approx(1 - (0.2 * 1 + 0.3 * 1) / mad_uniform)
    assert score_confidence(np.array([0.0, 1.0, 0.0])) == pytest.approx(1.0)
    assert score_confidence(np.array([1 / 3] * 3)) == pytest.approx(1 - (2 / 3) / mad_uniform)
    assert score_confidence(np.array([0.34, 0.0, 0.66 - 1e-9][::-1])) >= 0.0  # clipped at zero
    assert not math.isnan(score_confidence(np.array([1.0])))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: fl.Choice("?", {}), "at least one option"),
        (lambda: fl.Choice("?", {1: None}), "must be strings"),
        (lambda: fl.Choice("?", {"": None}), "must not be empty"),
        (lambda: fl.Choice("?", ["a", "b"]), "mapping"),
        (lambda: fl.Score("?", []), "at least one level"),
        (lambda: fl.Score("?", [None]), "level 0"),
        (lambda: fl.Noul("?", {"maybe": "x"}), "true"),
        (lambda: fl.Noul(3), "string"),
        (lambda: fl.Noul({"tags": {1, 2}}), "must be JSON data"),
        (lambda: fl.Choice("?", {"a": {(1, 2): "tuple key"}}), "must be JSON data"),
    ],
)
def test_invalid_questions_raise(build, message):
    with pytest.raises(fl.InvalidQuestionError, match=message):
        build()


@pytest.mark.parametrize(
    ("questions", "message"),
    [
        ({}, "at least one question"),
        ([fl.Noul("?")], "mapping"),
        ({"": fl.Noul("?")}, "non-empty strings"),
        ({"q": {"type": "box"}}, "unknown type"),
        ({"q": {"instructions": "no type"}}, "unknown type"),
        ({"q": "Is it?"}, "must be a Noul"),
        ({"q": {"type": "choice", "criteria": {}}}, "at least one option"),
        ({"q": {"type": "choice", "criteria": {"a": None}, "extra": 1}}, "unknown field"),
    ],
)
def test_invalid_question_mappings_raise(questions, message):
    with pytest.raises(fl.InvalidQuestionError, match=message):
        parse_questions(questions)
