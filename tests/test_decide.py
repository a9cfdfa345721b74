"""`@fl.decide`: field types map to questions, answers coerce back by the jev rules, decoration refuses the rest."""

from __future__ import annotations

import asyncio
import enum
import inspect
from typing import Annotated, Literal

import msgspec
import numpy as np
import pytest
from pydantic import BaseModel, Field, create_model

import flide_sdk as fl
from flide_sdk.adapters.decide import CompiledModel, call_state

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
     Annotated[float, Field(gt=0, le=1)], Annotated[float, Field(ge=0)], bool | None, list[bool], Ticket],
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



# ------------------------------------------------------------------------------- templates, map, class form
TEXTS = [TEXT, "Thanks, the refund arrived.", "The app crashes when I open settings.", "Where is my invoice?",
         "Please cancel my plan today.", "Login fails with error 500 since this morning."]


def assert_same_answers(decided: fl.Decision, expected: fl.Decision | fl.SystemOneResponse, abs: float = 1e-6) -> None:
    response = expected.response if isinstance(expected, fl.Decision) else expected
    for name, answer in decided.response.items():
        assert probabilities(answer) == pytest.approx(probabilities(response[name]), abs=abs), name


def test_the_docstring_is_a_template_rendered_per_call(engine):
    @fl.decide(engine)
    def triage(text: str, plan: str = "free") -> Ticket:
        """Triage a ticket from a customer on the {{ plan }} plan{% if plan == "pro" %} (answer within the hour){% endif %}."""

    assert triage.questions is None  # no fixed questions: each call renders its own
    pro, free = triage.decision(TEXT, plan="pro"), triage.decision(TEXT)
    assert pro.questions["urgent"].instructions == (
        "Triage a ticket from a customer on the pro plan (answer within the hour).\nDoes this need a reply within the hour?"
    )
    assert free.questions["area"] == fl.Choice("Triage a ticket from a customer on the free plan.\narea",
                                               {"billing": None, "bug": None, "other": None})
    assert "on the pro plan" in engine.render({"text": TEXT, "plan": "pro"}, pro.questions).questions["severity"].text
    assert_same_answers(pro, engine.ask_sync({"text": TEXT, "plan": "pro"}, pro.questions))  # what was asked

    @fl.decide(engine)
    def fixed(text: str) -> Ticket:
        """Triage a support ticket. {# a comment, rendered away once #}"""

    assert fixed.questions["urgent"].instructions == "Triage a support ticket. \nDoes this need a reply within the hour?"
    assert fixed.decision(TEXT).questions is fixed.questions  # compiled once, the same objects every call

    @fl.decide(engine)
    def strict(text: str) -> Ticket:
        """Triage {{ text.summary }}."""  # a str has no attribute summary: StrictUndefined fails the call

    with pytest.raises(fl.InvalidStateError, match="strict.*template"):
        strict.decision(TEXT)


def test_a_placeholder_naming_no_parameter_raises_at_decoration_time(engine):
    with pytest.raises(fl.InvalidQuestionError, match=r"placeholder\(s\) txt name no parameter of .*triage\(text, plan\)"):

        @fl.decide(engine)
        def triage(text: str, plan: str = "free") -> Ticket:
            """Triage {{ txt }} for a {{ plan }} customer."""

    with pytest.raises(fl.InvalidQuestionError, match="not a valid template"):

        @fl.decide(engine)
        def broken(text: str) -> Ticket:
            """Triage {{ text."""

    with pytest.raises(fl.InvalidQuestionError, match=r"text name no parameter of .*Judged\.decide\(state\)"):

        @fl.decide(engine)
        class Judged(BaseModel):
            """Judge {{ text }}."""  # the class form's one parameter is `state`

            urgent: bool


def test_map_answers_in_order_as_single_calls_do_in_shared_rounds(engine):
    @fl.decide(engine)
    def triage(text: str) -> Ticket:
        """Triage a support ticket."""

    before = engine.stats()
    values = triage.map(iter(TEXTS))
    after = engine.stats()
    assert after["asks"] - before["asks"] == len(TEXTS)
    assert after["rounds"] - before["rounds"] < len(TEXTS)  # submitted together: they share rounds
    decisions = triage.decision.map(TEXTS)
    singles = [triage.decision(text) for text in TEXTS]
    for value, decided, single in zip(values, decisions, singles):
        assert isinstance(value, Ticket) and isinstance(decided, fl.Decision)
        assert_same_answers(decided, single)
        assert value.model_dump(exclude={"churn_risk"}) == single.value.model_dump(exclude={"churn_risk"})
        assert value.churn_risk == pytest.approx(single.value.churn_risk, abs=1e-5)
    assert triage.map([]) == []


def test_map_items_of_a_multi_parameter_function_and_a_failing_input(engine):
    @fl.decide(engine)
    def triage(text: str, plan: str = "free") -> StructTicket:
        """Triage a ticket from a {{ plan }} customer."""

    decisions = triage.decision.map([(TEXT, "pro"), {"text": TEXT, "plan": "team"}, TEXT])
    assert [d.questions["tone"].instructions for d in decisions] == [
        "Triage a ticket from a pro customer.\ntone", "Triage a ticket from a team customer.\ntone",
        "Triage a ticket from a free customer.\ntone"]
    assert_same_answers(decisions[1], engine.ask_sync({"text": TEXT, "plan": "team"}, decisions[1].questions))

    before = engine.stats()["asks"]
    with pytest.raises(fl.MapInputError, match=r"triage\.map: input 1 failed: TypeError") as unbound:
        triage.map([TEXT, (TEXT, "pro", "extra"), TEXT])
    assert unbound.value.index == 1 and isinstance(unbound.value.__cause__, TypeError)
    with pytest.raises(fl.MapInputError, match="input 2 failed: InvalidStateError: argument 'plan'") as not_data:
        triage.map([TEXT, TEXT, (TEXT, object())])
    assert not_data.value.index == 2
    assert engine.stats()["asks"] == before  # inputs are checked before anything is asked
    with pytest.raises(fl.MapInputError, match="input 1 failed: StateTooLongError") as too_long:
        triage.map([TEXT, "word " * 40_000, TEXT])  # refused by the engine; the others are still answered
    assert isinstance(too_long.value.error, fl.StateTooLongError) and isinstance(too_long.value, fl.FlideError)


@pytest.mark.asyncio
async def test_async_map_submits_every_input_at_once(engine):
    @fl.decide(engine)
    async def judge(text: str) -> StructTicket:
        """Judge this ticket."""

    @fl.decide(engine)
    def judge_sync(text: str) -> StructTicket:
        """Judge this ticket."""

    before = engine.stats()
    values = await judge.map(TEXTS)
    after = engine.stats()
    assert after["asks"] - before["asks"] == len(TEXTS)
    assert after["rounds"] - before["rounds"] <= 2 < len(TEXTS)
    decisions = await judge.decision.map(TEXTS)
    for text, value, decided in zip(TEXTS, values, decisions):
        single = await judge.decision(text)
        assert isinstance(value, StructTicket) and value == single.value
        assert_same_answers(decided, single)
    assert judge_sync.map(TEXTS[:2]) == values[:2]  # a sync map called from a running loop: a helper thread
    with pytest.raises(fl.MapInputError, match=r"judge\.map: input 1 failed: InvalidStateError: argument 'text'"):
        await judge.map([TEXT, object()])


def test_the_class_form_with_a_pydantic_model(engine):
    @fl.decide(engine, threshold=0.3)
    class Triaged(BaseModel):
        """Triage a ticket from a customer on the {{ state.plan }} plan."""

        urgent: bool = Field(description="Does this need a reply within the hour?")
        area: Literal["billing", "bug", "other"]
        severity: int = Field(ge=1, le=4)

    assert Triaged(urgent=True, area="bug", severity=2).area == "bug"  # normal construction is untouched
    assert set(Triaged.model_fields) == {"urgent", "area", "severity"}
    assert list(inspect.signature(Triaged.decide).parameters) == ["state"] and Triaged.decide.questions is None
    state = {"plan": "pro", "text": TEXT}
    decision = Triaged.decide.decision(state)
    assert decision.questions["urgent"].instructions == (
        "Triage a ticket from a customer on the pro plan.\nDoes this need a reply within the hour?"
    )
    expected = engine.ask_sync(state, decision.questions)  # the state: the argument as is
    assert_same_answers(decision, expected)
    assert decision.value.urgent is (expected["urgent"].noul >= 0.3)
    value = Triaged.decide(state)
    assert isinstance(value, Triaged) and value.area == decision.value.area
    mapped = Triaged.decide.decision.map([state, {"plan": "free", "text": TEXT}])
    assert_same_answers(mapped[0], decision)
    assert mapped[1].questions["area"].instructions == "Triage a ticket from a customer on the free plan.\narea"
    assert asyncio.run(Triaged.adecide(state)) == value

    with pytest.raises(fl.InvalidQuestionError, match="'decide'"):

        @fl.decide(engine)
        class Clash(BaseModel):
            decide: bool


@pytest.mark.asyncio
async def test_the_class_form_with_a_msgspec_struct(engine):
    @fl.decide(engine)
    class Judged(msgspec.Struct):
        """Judge this ticket."""

        urgent: Annotated[bool, msgspec.Meta(description="Does this need a reply within the hour?")]
        tone: Literal["calm", "angry"]

    assert Judged(False, "calm") == Judged(urgent=False, tone="calm")  # normal construction is untouched
    assert Judged.adecide.questions["tone"] == fl.Choice("Judge this ticket.\ntone", {"calm": None, "angry": None})
    value, decision = await asyncio.gather(Judged.adecide(TEXT), Judged.adecide.decision(TEXT))
    expected = await engine.ask(TEXT, Judged.adecide.questions)
    assert isinstance(value, Judged) and value.tone == expected["tone"].choice
    assert_same_answers(decision, expected)
    values = await Judged.adecide.map(TEXTS[:3])
    assert values[0] == value and all(isinstance(v, Judged) for v in values)
    assert msgspec.json.decode(msgspec.json.encode(value), type=Judged) == value


def test_a_bare_decorator_raises_at_decoration_time():
    with pytest.raises(fl.InvalidQuestionError, match=r"decide needs an engine: use @fl\.decide\(engine\).*triage"):

        @fl.decide
        def triage(text: str) -> Ticket: ...

    with pytest.raises(fl.InvalidQuestionError, match=r"decide needs an engine: use @fl\.decide\(engine\).*Bare"):

        @fl.decide
        class Bare(BaseModel):
            urgent: bool

    with pytest.raises(fl.InvalidQuestionError, match="decide needs an engine"):
        fl.decide("engine")
