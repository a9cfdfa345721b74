"""`decide`: a jev-style decorator that turns a typed Python function into one decision request.

The decorated function's body never runs: its signature is the question. Its return annotation is a
msgspec Struct or a pydantic model; each field becomes one question, all of a call's questions are asked in
one request (branches of one trunk), and the answers are coerced back into the field types, so
`ticket = triage(text)` returns a `Ticket`. `triage.decision(text)` returns a `Decision` that keeps
everything the coercion dropped: per field, the probability of each value and a confidence.

jev (PyPI `jev`, "a decorator that compiles Python function definitions into Jev queries") maps a pydantic
return model's `bool` fields to Noul, `Literal` / `Enum` fields to Choice and bounded `int` / `float` fields
to Score. Its own documentation was not reachable from here; the rules below are the ones the closest
documented implementation of that mapping states (pydantic-ai's TypeSafe model, pydantic/pydantic-ai
#8450 and #8505: a bool is True when P(yes) reaches the threshold, 0.5 by default, a probability exactly
at the threshold being a yes; Literal / Enum pick the most probable option), and natural choices where
that is silent (marked "chosen"):

- `bool` -> Noul; value = P(yes) >= threshold (default 0.5). Confidence = distance from the threshold,
  scaled to 0 at the threshold and 1 at certainty (|2p - 1| at 0.5).
- `Literal[v1, v2, ...]` -> Choice over `str(v)`; value = the most probable literal (the first on ties).
- `Enum` -> Choice over its members, each labelled by its value when that is a string, else by its name
  (chosen); value = the most probable member.
- `int` bounded on both sides (ge/gt and le/lt) -> Score with one level per integer lo..hi (2 to 26
  levels), each described by its number; value = round(lo + E[level index]) with Python's round, i.e.
  round-half-to-even on the expected value (chosen: rounding the value, not the index).
- `float` bounded by ge and le -> Score with `float_levels` (default 5) evenly spaced levels from lo to hi
  (chosen); value = lo + (hi - lo) * E[level index] / (levels - 1), linear interpolation of the expected
  level, clipped to [lo, hi]. Exclusive float bounds are refused (chosen: an endpoint can be the answer).
- Anything else (unbounded numbers, str, optional or nested types, lists) raises InvalidQuestionError when
  the function is decorated.

Instructions of a field: its description (pydantic `Field(description=...)`, msgspec
`Meta(description=...)`), else its name with underscores as spaces, prefixed by the function's docstring
when it has one (chosen). State of a call (chosen, shared with `guard` / `route`): a one-parameter
function's argument as is, otherwise a dict of the bound arguments (defaults applied); Structs, pydantic
models, enums and other non-JSON values are converted to JSON data first. Models defined inside a function
resolve too (the decorator reads the annotations in the scope it is applied in). pydantic models are
rebuilt with `model_validate(..., by_name=True)` (pydantic >= 2.11), msgspec Structs with their constructor.
"""

from __future__ import annotations

import enum
import functools
import inspect
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import msgspec
import numpy as np

from flide_sdk.errors import InvalidQuestionError
from flide_sdk.questions import Answer, Choice, ChoiceAnswer, Noul, NoulAnswer, Question, Score
from flide_sdk.render import LETTERS
from flide_sdk.typesafe import SystemOneResponse

if typing.TYPE_CHECKING:
    from flide_sdk.engine import Engine

T = TypeVar("T")
MAX_LEVELS = len(LETTERS)
DEFAULT_FLOAT_LEVELS = 5


# ------------------------------------------------------------------------------------------ the state
def _pydantic_to_data(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    raise TypeError(f"{type(value).__name__} is not JSON data")


def to_data(value: Any) -> Any:
    """JSON data of a value: Structs, pydantic models, enums, dataclasses, datetimes converted."""
    return msgspec.to_builtins(value, enc_hook=_pydantic_to_data)


def call_state(signature: inspect.Signature, args: tuple, kwargs: dict) -> Any:
    """The state of a call: a one-parameter function's argument as is, else a dict of the bound arguments."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    values = {name: to_data(value) for name, value in bound.arguments.items()}
    if len(signature.parameters) == 1:
        return next(iter(values.values()))
    return values


# -------------------------------------------------------------------------------------------- fields
@dataclass(frozen=True)
class FieldRule:
    """How one field is asked (`question`) and read back: option i of the question stands for `values[i]`."""

    name: str
    kind: Literal["bool", "choice", "int", "float"]
    question: Question
    values: tuple[Any, ...]

    def probabilities(self, answer: Answer) -> dict[Any, float]:
        """Probability of each value the field can take."""
        if isinstance(answer, NoulAnswer):
            return {True: answer.noul, False: 1.0 - answer.noul}
        return dict(zip(self.values, answer.probabilities.values()))

    def coerce(self, answer: Answer, threshold: float) -> Any:
        if isinstance(answer, NoulAnswer):
            return answer.noul >= threshold
        if isinstance(answer, ChoiceAnswer):
            return self.values[list(answer.probabilities).index(answer.choice)]
        lo, hi = self.values[0], self.values[-1]
        if self.kind == "int":
            return round(lo + answer.score)
        return float(np.clip(lo + (hi - lo) * answer.score / (len(self.values) - 1), lo, hi))

    def confidence(self, answer: Answer, threshold: float) -> float:
        if not isinstance(answer, NoulAnswer):
            return answer.confidence
        p = answer.noul
        if p >= threshold:
            return 0.0 if threshold >= 1.0 else (p - threshold) / (1.0 - threshold)
        return (threshold - p) / threshold


def _bounds(metadata: list[Any]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for item in metadata:
        for key in ("ge", "gt", "le", "lt"):
            value = getattr(item, key, None)
            if value is not None:
                found[key] = value
    return found


def _split_annotated(annotation: Any) -> tuple[Any, list[Any]]:
    if typing.get_origin(annotation) is typing.Annotated:
        base, *metadata = typing.get_args(annotation)
        return base, metadata
    return annotation, []


def _choice_rule(name: str, instructions: str, labels: list[str], values: tuple[Any, ...]) -> FieldRule:
    if len(set(labels)) != len(labels) or not all(label.strip() for label in labels):
        raise InvalidQuestionError(f"field {name!r}: its options {labels} must have distinct, non-empty labels")
    return FieldRule(name, "choice", Choice(instructions, dict.fromkeys(labels)), values)


def field_rule(name: str, annotation: Any, metadata: list[Any], instructions: str, float_levels: int) -> FieldRule:
    """The question of one field and how its answer reads back; InvalidQuestionError for unsupported types."""
    if annotation is bool:
        return FieldRule(name, "bool", Noul(instructions), (True, False))
    if typing.get_origin(annotation) is Literal:
        values = typing.get_args(annotation)
        return _choice_rule(name, instructions, [str(v) for v in values], values)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        members = tuple(annotation)
        labels = [m.value if isinstance(m.value, str) else m.name for m in members]
        return _choice_rule(name, instructions, labels, members)
    bounds = _bounds(metadata)
    if annotation is int:
        if not ({"ge", "gt"} & bounds.keys() and {"le", "lt"} & bounds.keys()):
            raise InvalidQuestionError(f"int field {name!r} needs a lower (ge/gt) and an upper (le/lt) bound to be a Score")
        lo = bounds["ge"] if "ge" in bounds else bounds["gt"] + 1
        hi = bounds["le"] if "le" in bounds else bounds["lt"] - 1
        levels = tuple(range(int(lo), int(hi) + 1))
        if not 2 <= len(levels) <= MAX_LEVELS:
            raise InvalidQuestionError(f"int field {name!r} spans {len(levels)} values; a Score needs 2 to {MAX_LEVELS}")
        return FieldRule(name, "int", Score(instructions, [str(v) for v in levels]), levels)
    if annotation is float:
        if "gt" in bounds or "lt" in bounds or not {"ge", "le"} <= bounds.keys():
            raise InvalidQuestionError(f"float field {name!r} needs inclusive bounds ge and le to be a Score")
        lo, hi = float(bounds["ge"]), float(bounds["le"])
        if not lo < hi:
            raise InvalidQuestionError(f"float field {name!r} has empty bounds [{lo:g}, {hi:g}]")
        levels = tuple(float(v) for v in np.linspace(lo, hi, float_levels))
        return FieldRule(name, "float", Score(instructions, [f"{v:g}" for v in levels]), levels)
    raise InvalidQuestionError(
        f"field {name!r} has type {annotation!r}; decide supports bool, Literal, Enum, and bounded int or float"
    )


# ------------------------------------------------------------------------------------ compiled model
def check_options(threshold: float, float_levels: int) -> None:
    """Refuse a threshold outside [0, 1] or a float level count a Score cannot hold."""
    if not 0.0 <= threshold <= 1.0:
        raise InvalidQuestionError(f"threshold must be within [0, 1], got {threshold}")
    if not 2 <= float_levels <= MAX_LEVELS:
        raise InvalidQuestionError(f"float_levels must be within [2, {MAX_LEVELS}], got {float_levels}")


@dataclass(frozen=True)
class Decision(Generic[T]):
    """One decided call: the coerced `value`, and per field the probability of each value and a confidence."""

    value: T
    probabilities: dict[str, dict[Any, float]]
    confidence: dict[str, float]
    response: SystemOneResponse


class CompiledModel(Generic[T]):
    """A return type compiled into questions, and the reading of a response back into an instance."""

    def __init__(self, model_type: type[T], *, context: str | None, threshold: float, float_levels: int) -> None:
        check_options(threshold, float_levels)
        self.model_type = model_type
        self.threshold = threshold
        self._pydantic = hasattr(model_type, "model_fields") and hasattr(model_type, "model_validate")
        rules = [
            field_rule(name, annotation, metadata, _instructions(name, description, context), float_levels)
            for name, annotation, metadata, description in self._fields(model_type)
        ]
        if not rules:
            raise InvalidQuestionError(f"{model_type.__name__} has no fields to ask about")
        self.rules = {rule.name: rule for rule in rules}
        self.questions: dict[str, Question] = {rule.name: rule.question for rule in rules}

    def _fields(self, model_type: type) -> list[tuple[str, Any, list[Any], str | None]]:
        if self._pydantic:
            return [
                (name, info.annotation, list(info.metadata), info.description)
                for name, info in model_type.model_fields.items()
            ]
        if isinstance(model_type, type) and issubclass(model_type, msgspec.Struct):
            hints = typing.get_type_hints(model_type, include_extras=True)
            fields = []
            for name in model_type.__struct_fields__:
                base, metadata = _split_annotated(hints[name])
                description = next((m.description for m in metadata if isinstance(m, msgspec.Meta) and m.description), None)
                fields.append((name, base, metadata, description))
            return fields
        raise InvalidQuestionError(
            f"the return annotation must be a msgspec Struct or a pydantic model, not {model_type!r}"
        )

    def decision(self, response: SystemOneResponse) -> Decision[T]:
        """The instance the response stands for, with each field's value probabilities and confidence."""
        values = {name: rule.coerce(response[name], self.threshold) for name, rule in self.rules.items()}
        value = self.model_type.model_validate(values, by_name=True) if self._pydantic else self.model_type(**values)
        return Decision(
            value=value,
            probabilities={name: rule.probabilities(response[name]) for name, rule in self.rules.items()},
            confidence={name: rule.confidence(response[name], self.threshold) for name, rule in self.rules.items()},
            response=response,
        )


def _instructions(name: str, description: str | None, context: str | None) -> str:
    text = description or name.replace("_", " ").strip()
    return f"{context}\n{text}" if context else text


# ------------------------------------------------------------------------------------------ decorator
def decide(
    engine: Engine, *, threshold: float = 0.5, float_levels: int = DEFAULT_FLOAT_LEVELS
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a (sync or async) function whose return annotation is a msgspec Struct or pydantic model.

    Calling it asks the engine one request about the call's arguments and returns the coerced instance;
    `.decision(...)` returns the `Decision` instead; `.questions` are the compiled questions.
    threshold: P(yes) at or above which a bool field is True. float_levels: levels of a float Score.
    """

    check_options(threshold, float_levels)
    scope = dict(sys._getframe(1).f_locals)  # where the decorator runs: resolves models defined in a function

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        try:
            hints = typing.get_type_hints(function, localns=scope, include_extras=True)
        except NameError as error:
            raise InvalidQuestionError(f"{function.__qualname__}: cannot resolve an annotation ({error})") from None
        if "return" not in hints:
            raise InvalidQuestionError(f"{function.__qualname__} needs a return annotation (a Struct or pydantic model)")
        model_type, _ = _split_annotated(hints["return"])
        docstring = inspect.getdoc(function)
        compiled = CompiledModel(model_type, context=docstring, threshold=threshold, float_levels=float_levels)
        signature = inspect.signature(function)

        if inspect.iscoroutinefunction(function):

            async def decision(*args: Any, **kwargs: Any) -> Decision:
                state = call_state(signature, args, kwargs)
                return compiled.decision(await engine.ask(state, compiled.questions))

            @functools.wraps(function)
            async def call(*args: Any, **kwargs: Any) -> Any:
                return (await decision(*args, **kwargs)).value

        else:

            def decision(*args: Any, **kwargs: Any) -> Decision:
                state = call_state(signature, args, kwargs)
                return compiled.decision(engine.ask_sync(state, compiled.questions))

            @functools.wraps(function)
            def call(*args: Any, **kwargs: Any) -> Any:
                return decision(*args, **kwargs).value

        call.decision = decision  # type: ignore[attr-defined]
        call.questions = compiled.questions  # type: ignore[attr-defined]
        return call

    return wrap

