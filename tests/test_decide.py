"""`@fl.decide`: field types map to questions, answers coerce back by the jev rules, decoration refuses the rest."""

from __future__ import annotations

import asyncio
import enum
import inspect
from typing import Annotated, Literal, Optional

import msgspec
import numpy as np
import pytest
from pydantic import BaseModel, Field, create_model

import flide_sdk as fl
from flide_sdk.decide import CompiledModel, call_state

TEXT = "Second time this month my card was charged twice. Fix it or I cancel."


class Area(enum.Enum):
    BILLING = "billing"
    BUG = 2  # not a string: labelled by its name


class Ticket(BaseModel):
    urgent: bool = Field(description="Does this need a reply within the hour?")
    area: Literal["billing", "bug", "other"]
    team: Area
    severity: int = Field(ge=1, le=4)
    churn_risk: float = Field(ge=0, le=10)


class StructTicket(msgspec.Struct):
    urgent: Annotated[bool, msgspec.Meta(description="Does this need a reply within the hour?")]
    priority: Annotated[int, msgspec.Meta(gt=-1, lt=3)]
    tone: Literal["calm", "angry"]


def probabilities(answer) -> list[float]:
    return [answer.noul, 1.0 - answer.noul] if isinstance(answer, fl.NoulAnswer) else list(answer.probabilities.values())


def compiled(model=Ticket, **options) -> CompiledModel:
    return CompiledModel(model, context=options.pop("context", None), threshold=options.pop("threshold", 0.5),
                         float_levels=options.pop("float_levels", 5))


def response(model: CompiledModel, probabilities: dict[str, list[float]]) -> fl.SystemOneResponse:
    """A response whose answers have exactly these option probabilities (the engine's own answer formulas)."""
    answers = {name: model.questions[name].answer(np.asarray(p, dtype=np.float64)) for name, p in probabilities.items()}
    return fl.SystemOneResponse(answers, model="test", usage=fl.Usage(input_tokens=0, output_tokens=len(answers)))


TICKET_ANSWERS = {"urgent": [0.7, 0.3], "area": [0.2, 0.5, 0.3], "team": [0.4, 0.6],
                  "severity": [0.1, 0.2, 0.3, 0.4], "churn_risk": [0.0, 0.0, 1.0, 0.0, 0.0]}


def test_each_supported_field_type_maps_to_its_question():
    q = compiled(context="Triage a support ticket.").questions
    assert q["urgent"] == fl.Noul("Triage a support ticket.\nDoes this need a reply within the hour?")
    assert q["area"] == fl.Choice("Triage a support ticket.\narea", {"billing": None, "bug": None, "other": None})
    assert q["team"].option_names() == ["billing", "BUG"]
    assert q["severity"] == fl.Score("Triage a support ticket.\nseverity", ["1", "2", "3", "4"])
    assert q["churn_risk"].criteria == ["0", "2.5", "5", "7.5", "10"]
    assert compiled(float_levels=3).questions["churn_risk"].criteria == ["0", "5", "10"]
    struct = compiled(StructTicket).questions
    assert struct["urgent"] == fl.Noul("Does this need a reply within the hour?")
    assert struct["priority"].criteria == ["0", "1", "2"]  # gt=-1, lt=3 -> 0..2
    assert struct["tone"] == fl.Choice("tone", {"calm": None, "angry": None})


def test_bool_is_true_from_the_threshold_up():
    model = compiled()
    assert model.decision(response(model, {**TICKET_ANSWERS, "urgent": [0.5, 0.5]})).value.urgent is True
    assert model.decision(response(model, {**TICKET_ANSWERS, "urgent": [0.4999, 0.5001]})).value.urgent is False
    strict = compiled(threshold=0.8)
    assert strict.decision(response(strict, {**TICKET_ANSWERS, "urgent": [0.79, 0.21]})).value.urgent is False
    decided = strict.decision(response(strict, {**TICKET_ANSWERS, "urgent": [0.8, 0.2]}))
    assert decided.value.urgent is True and decided.confidence["urgent"] == pytest.approx(0.0)  # exactly at the bar
    assert strict.decision(response(strict, {**TICKET_ANSWERS, "urgent": [0.9, 0.1]})).confidence["urgent"] == pytest.approx(0.5)
    assert strict.decision(response(strict, {**TICKET_ANSWERS, "urgent": [0.4, 0.6]})).confidence["urgent"] == pytest.approx(0.5)
    assert model.decision(response(model, TICKET_ANSWERS)).confidence["urgent"] == pytest.approx(0.4)  # |2p - 1|


@pytest.mark.parametrize(
    ("probabilities", "expected"),
    [
        ([0.5, 0.5, 0.0, 0.0], 2),  # E = 1.5 -> 2 (even)
        ([0.0, 0.5, 0.5, 0.0], 2),  # E = 2.5 -> 2 (even)
        ([0.0, 0.0, 0.5, 0.5], 4),  # E = 3.5 -> 4 (even)
        ([0.0, 0.51, 0.49, 0.0], 2),  # E = 2.49 -> 2
        ([0.0, 0.0, 0.0, 1.0], 4),
    ],
)
def test_int_scores_round_the_expected_value_half_to_even(probabilities, expected):
    model = compiled()
    assert model.decision(response(model, {**TICKET_ANSWERS, "severity": probabilities})).value.severity == expected


@pytest.mark.parametrize(
    ("probabilities", "expected"),
    [
        ([0.0, 0.0, 1.0, 0.0, 0.0], 5.0),
        ([0.5, 0.0, 0.0, 0.0, 0.5], 5.0),  # E[index] = 2 of 4
        ([0.0, 0.5, 0.5, 0.0, 0.0], 3.75),  # E[index] = 1.5 -> 0 + 10 * 1.5 / 4
        ([0.0, 0.0, 0.0, 0.0, 1.0], 10.0),
    ],
)
def test_float_scores_interpolate_the_expected_level(probabilities, expected):
    model = compiled()
    assert model.decision(response(model, {**TICKET_ANSWERS, "churn_risk": probabilities})).value.churn_risk == pytest.approx(expected)


def test_float_scores_stay_within_their_bounds():
    class Narrow(BaseModel):
        share: float = Field(ge=0.1, le=0.3)

    model = compiled(Narrow, float_levels=3)
    assert model.decision(response(model, {"share": [0.0, 0.0, 1.0]})).value.share == 0.3  # 0.1 + 0.2 overshoots


def test_literal_and_enum_choices_pick_the_most_probable_value():
    model = compiled()
    decided = model.decision(response(model, TICKET_ANSWERS))
    assert decided.value.area == "bug" and decided.value.team is Area.BUG
    assert decided.probabilities["team"] == {Area.BILLING: pytest.approx(0.4), Area.BUG: pytest.approx(0.6)}
    assert decided.probabilities["urgent"] == {True: pytest.approx(0.7), False: pytest.approx(0.3)}
    assert decided.probabilities["severity"] == {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4}
    assert decided.value == Ticket(urgent=True, area="bug", team=Area.BUG, severity=3, churn_risk=5.0)
    tie = model.decision(response(model, {**TICKET_ANSWERS, "area": [0.4, 0.4, 0.2], "team": [0.5, 0.5]})).value
    assert tie.area == "billing" and tie.team is Area.BILLING  # ties go to the first declared option


@pytest.mark.parametrize(
    "annotation",
    [str, int, Annotated[int, Field(ge=0)], Annotated[int, Field(ge=3, le=3)], Annotated[int, Field(ge=0, le=30)],
     Annotated[float, Field(gt=0, le=1)], Annotated[float, Field(ge=0)], Optional[bool], list[bool], Ticket],
)
def test_unsupported_fields_raise_at_decoration_time(engine, annotation):
    model = create_model("Model", field=(annotation, ...))
    with pytest.raises(fl.InvalidQuestionError, match="field"):

        @fl.decide(engine)
        def judge(text: str) -> model: ...


def test_bad_signatures_and_options_raise_at_decoration_time(engine):
    with pytest.raises(fl.InvalidQuestionError, match="return annotation"):

        @fl.decide(engine)
        def no_annotation(text: str): ...

    with pytest.raises(fl.InvalidQuestionError, match="msgspec Struct or a pydantic model"):

        @fl.decide(engine)
        def plain(text: str) -> dict: ...

    with pytest.raises(fl.InvalidQuestionError, match="threshold"):
        fl.decide(engine, threshold=1.5)
    with pytest.raises(fl.InvalidQuestionError, match="float_levels"):
        fl.decide(engine, float_levels=1)


def test_the_state_is_the_argument_or_the_bound_arguments():
    def one(text: str) -> None: ...

    def two(text: str, plan: Area = Area.BILLING, tags: tuple = ()) -> None: ...

    assert call_state(inspect.signature(one), ("hi",), {}) == "hi"
    assert call_state(inspect.signature(two), ("hi",), {"tags": ("a",)}) == {"text": "hi", "plan": "billing", "tags": ("a",)}


def test_sync_decide_returns_the_model_coerced_from_one_request(engine):
    @fl.decide(engine, threshold=0.3)
    def triage(text: str, plan: str = "pro") -> Ticket:
        """Triage a support ticket."""

    stats = engine.stats()
    decision = triage.decision(TEXT)
    assert engine.stats()["asks"] == stats["asks"] + 1  # all five fields in one request
    assert isinstance(decision.value, Ticket)
    expected = engine.ask_sync({"text": TEXT, "plan": "pro"}, triage.questions)  # the state: the bound arguments
    for name in ("urgent", "area", "team", "severity"):
        assert decision.probabilities[name] == pytest.approx(dict(zip(decision.probabilities[name], probabilities(expected[name]))), abs=1e-5)
    assert decision.value.urgent is (decision.response["urgent"].noul >= 0.3)
    assert decision.value.area == decision.response["area"].choice
    assert decision.value.severity == round(1 + decision.response["severity"].score)
    assert decision.value.churn_risk == pytest.approx(10 * decision.response["churn_risk"].score / 4)
    again = triage(TEXT)
    assert isinstance(again, Ticket) and again.area == decision.value.area and again.severity == decision.value.severity


@pytest.mark.asyncio
async def test_async_decide_with_a_msgspec_struct(engine):
    @fl.decide(engine)
    async def judge(text: str) -> StructTicket: ...

    value, decision = await asyncio.gather(judge(TEXT), judge.decision(TEXT))
    assert isinstance(value, StructTicket) and value == decision.value
    expected = await engine.ask(TEXT, judge.questions)  # one argument: the state is the argument itself
    assert value.tone == expected["tone"].choice
    assert value.priority == round(expected["priority"].score)
    assert decision.probabilities["urgent"][True] == pytest.approx(expected["urgent"].noul, abs=1e-5)

