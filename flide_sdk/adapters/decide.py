"""`decide`: a jev-style decorator that turns a typed Python function (or model class) into one decision request.

The decorated function's body never runs: its signature is the question. Each field of its return type (a msgspec
Struct or pydantic model) becomes one question, all asked in one request, and the answers are coerced back into
the field types; `.decision(...)` keeps each field's probabilities and confidence, `.map(inputs)` answers many
inputs in shared rounds, and the docstring is a jinja2 template of the call's arguments. An image argument (a PIL
image or a TypeSafe `Image`, as an argument or inside a dict, list or tuple one) is sent as an asset: its place in
the state holds its reference `<image:digest>`. The type mapping and
every rule chosen where jev is silent: docs/decide.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import functools
import inspect
import sys
import typing
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import jinja2
import jinja2.meta
import jinja2.sandbox
import msgspec
import numpy as np

from flide_sdk.errors import (
    EngineClosedError,
    FlideError,
    InvalidQuestionError,
    InvalidStateError,
    MapInputError,
    QueueFullError,
)
from flide_sdk.images import DecodedImage, decode_assets
from flide_sdk.prompt.base import LETTERS
from flide_sdk.questions import Answer, Choice, ChoiceAnswer, Noul, NoulAnswer, Question, Score, SystemOneResponse

if typing.TYPE_CHECKING:
    from flide_sdk.engine import Engine

T = TypeVar("T")
MAX_LEVELS = len(LETTERS)
DEFAULT_FLOAT_LEVELS = 5
CLASS_ATTRIBUTES = ("decide", "adecide")  # what the class form adds: blocking, then async
TEMPLATES = jinja2.sandbox.SandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False)
TEMPLATE_MARKS = ("{{", "{%", "{#")  # a docstring without any is used verbatim, never parsed


# ------------------------------------------------------------------------------------------ the state
def _pydantic_to_data(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    raise TypeError(f"{type(value).__name__} is not JSON data")


def to_data(value: Any) -> Any:
    """JSON data of a value: Structs, pydantic models, enums, dataclasses, datetimes converted."""
    return msgspec.to_builtins(value, enc_hook=_pydantic_to_data)


def bound_arguments(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of a call by parameter name, defaults applied (TypeError when they do not bind)."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


Request = tuple[Any, dict[str, Question], dict[str, DecodedImage] | None]
"""A call's state, questions and image assets by reference (None: no image)."""


def image_asset(value: Any) -> Any | None:
    """What `decode_assets` reads of an image argument: a PIL image itself, a TypeSafe `Image`'s bytes or path;
    None for any other value (the modules are checked only where they are loaded)."""
    pil, typesafe = sys.modules.get("PIL.Image"), sys.modules.get("typesafe_sdk")
    if pil is not None and isinstance(value, pil.Image):
        return value
    if typesafe is not None and isinstance(value, getattr(typesafe, "Image", ())):
        return value.data
    return None


def with_references(value: Any, images: dict[str, DecodedImage]) -> Any:
    """`value` with each image in it (top level, or in dicts, lists and tuples) replaced by its reference
    `<image:...>` (its digest), the images decoded into `images` by reference (InvalidAssetError for a bad one)."""
    asset = image_asset(value)
    if asset is not None:
        decoded = decode_assets({"argument": asset})["argument"]
        reference = f"<image:{decoded.digest.hex()}>"
        images[reference] = decoded
        return reference
    if isinstance(value, dict):
        return {key: with_references(item, images) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [with_references(item, images) for item in value]
    return value


def state_of(signature: inspect.Signature, arguments: dict[str, Any]) -> Any:
    """The state of bound arguments: a one-parameter function's argument as is, else a dict of all of them."""
    values = {}
    for name, value in arguments.items():
        try:
            values[name] = to_data(value)
        except (TypeError, ValueError, msgspec.MsgspecError) as error:
            raise InvalidStateError(f"argument {name!r} is not JSON data: {error}") from error
    if len(signature.parameters) == 1:
        return next(iter(values.values()))
    return values


def call_state(signature: inspect.Signature, args: tuple, kwargs: dict) -> Any:
    """The state of a call: a one-parameter function's argument as is, else a dict of the bound arguments."""
    return state_of(signature, bound_arguments(signature, args, kwargs))


def compile_template(name: str, docstring: str | None, parameters: list[str]) -> tuple[jinja2.Template | None, str | None]:
    """A docstring as a template of the call's arguments, or (None, its fixed text) when it has no placeholder;
    InvalidQuestionError for a syntax error or a placeholder naming none of `parameters`."""
    if not docstring or not any(mark in docstring for mark in TEMPLATE_MARKS):
        return None, docstring or None
    try:
        names = jinja2.meta.find_undeclared_variables(TEMPLATES.parse(docstring)) - set(TEMPLATES.globals)
        template = TEMPLATES.from_string(docstring)
    except jinja2.TemplateSyntaxError as error:
        raise InvalidQuestionError(f"{name}: its docstring is not a valid template (line {error.lineno}: {error.message})") from None
    unknown = sorted(names - set(parameters))
    if unknown:
        raise InvalidQuestionError(
            f"{name}: docstring placeholder(s) {', '.join(unknown)} name no parameter of {name}({', '.join(parameters)})"
        )
    if names:
        return template, None
    try:  # only comments, raw blocks or constants: rendered once
        return None, template.render() or None
    except jinja2.TemplateError as error:
        raise InvalidQuestionError(f"{name}: its docstring template fails to render: {error}") from None


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
    """One decided call: the coerced `value`, per field the probability of each value and a confidence, the
    engine's `response`, and the `questions` asked (a templated docstring renders into them per call)."""

    value: T
    probabilities: dict[str, dict[Any, float]]
    confidence: dict[str, float]
    response: SystemOneResponse
    questions: dict[str, Question]


class CompiledModel(Generic[T]):
    """A return type compiled into questions, and the reading of a response back into an instance."""

    def __init__(self, model_type: type[T], *, context: str | None, threshold: float, float_levels: int,
                 scope: dict[str, Any] | None = None) -> None:
        check_options(threshold, float_levels)
        self.model_type = model_type
        self.threshold = threshold
        self._pydantic = hasattr(model_type, "model_fields") and hasattr(model_type, "model_validate")
        fields = self._fields(model_type, scope)
        self.texts = {name: description or name.replace("_", " ").strip() for name, _, _, description in fields}
        rules = [
            field_rule(name, annotation, metadata, _instructions(context, self.texts[name]), float_levels)
            for name, annotation, metadata, _ in fields
        ]
        if not rules:
            raise InvalidQuestionError(f"{model_type.__name__} has no fields to ask about")
        self.rules = {rule.name: rule for rule in rules}
        self.questions: dict[str, Question] = {rule.name: rule.question for rule in rules}

    def _fields(self, model_type: type, scope: dict[str, Any] | None) -> list[tuple[str, Any, list[Any], str | None]]:
        if self._pydantic:
            return [
                (name, info.annotation, list(info.metadata), info.description)
                for name, info in model_type.model_fields.items()
            ]
        if isinstance(model_type, type) and issubclass(model_type, msgspec.Struct):
            try:
                hints = typing.get_type_hints(model_type, localns=scope, include_extras=True)
            except NameError as error:
                raise InvalidQuestionError(f"{model_type.__qualname__}: cannot resolve an annotation ({error})") from None
            fields = []
            for name in model_type.__struct_fields__:
                base, metadata = _split_annotated(hints[name])
                description = next((m.description for m in metadata if isinstance(m, msgspec.Meta) and m.description), None)
                fields.append((name, base, metadata, description))
            return fields
        raise InvalidQuestionError(
            f"decide needs a msgspec Struct or a pydantic model (the return annotation, or the decorated class), "
            f"not {model_type!r}"
        )

    def questions_for(self, context: str | None) -> dict[str, Question]:
        """The questions with `context` (a call's rendered docstring) before each field's own text."""
        return {
            name: msgspec.structs.replace(question, instructions=_instructions(context, self.texts[name]))
            for name, question in self.questions.items()
        }

    def decision(self, response: SystemOneResponse, questions: dict[str, Question] | None = None) -> Decision[T]:
        """The instance the response stands for, with each field's value probabilities and confidence;
        `questions`: what was asked (the compiled questions by default)."""
        values = {name: rule.coerce(response[name], self.threshold) for name, rule in self.rules.items()}
        value = self.model_type.model_validate(values, by_name=True) if self._pydantic else self.model_type(**values)
        return Decision(
            value=value,
            probabilities={name: rule.probabilities(response[name]) for name, rule in self.rules.items()},
            confidence={name: rule.confidence(response[name], self.threshold) for name, rule in self.rules.items()},
            response=response,
            questions=self.questions if questions is None else questions,
        )


def _instructions(context: str | None, text: str) -> str:
    return f"{context}\n{text}" if context else text


# ------------------------------------------------------------------------------------------- deciders
def _run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to its end on a private event loop (on a helper thread when this one runs a loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as helper:
        return helper.submit(asyncio.run, coroutine).result()


class Decider(Generic[T]):
    """A compiled decide target: the state and questions of a call, asked alone or many in shared rounds."""

    def __init__(self, engine: Engine, name: str, signature: inspect.Signature, model_type: type[T],
                 docstring: str | None, scope: dict[str, Any], threshold: float, float_levels: int) -> None:
        self.engine = engine
        self.name = name
        self.signature = signature
        self.template, context = compile_template(name, docstring, list(signature.parameters))
        self.compiled = CompiledModel(model_type, context=context, threshold=threshold, float_levels=float_levels,
                                      scope=scope)
        self.questions = None if self.template is not None else self.compiled.questions

    def request(self, args: tuple, kwargs: dict) -> Request:
        """The state, questions and image assets of one call (a templated docstring rendered with its
        arguments, images as their references)."""
        images: dict[str, DecodedImage] = {}
        arguments = {name: with_references(value, images)
                     for name, value in bound_arguments(self.signature, args, kwargs).items()}
        state = state_of(self.signature, arguments)
        if self.template is None:
            return state, self.compiled.questions, images or None
        try:
            context = self.template.render(arguments)
        except Exception as error:  # an undefined attribute, the sandbox, or a filter failing on these values
            raise InvalidStateError(f"{self.name}: its docstring template fails on this call's arguments: {error}") from error
        return state, self.compiled.questions_for(context), images or None

    def decide_sync(self, args: tuple, kwargs: dict) -> Decision[T]:
        state, questions, assets = self.request(args, kwargs)
        return self.compiled.decision(self.engine.ask_sync(state, questions, assets=assets), questions)

    async def decide(self, args: tuple, kwargs: dict) -> Decision[T]:
        state, questions, assets = self.request(args, kwargs)
        return self.compiled.decision(await self.engine.ask(state, questions, assets=assets), questions)

    def requests(self, inputs: Iterable[Any]) -> list[Request]:
        """Each input's state and questions, all checked before anything is asked (MapInputError otherwise)."""
        one = len(self.signature.parameters) == 1
        requests = []
        for index, item in enumerate(inputs):
            if not one and isinstance(item, tuple):
                args, kwargs = item, {}
            elif not one and isinstance(item, Mapping):
                args, kwargs = (), dict(item)
            else:
                args, kwargs = (item,), {}
            try:
                requests.append(self.request(args, kwargs))
            except (TypeError, FlideError) as error:
                raise MapInputError(self.name, index, error) from error
        return requests

    async def ask_all(self, requests: list[Request]) -> list[Decision[T]]:
        """Submit every request at once (they share rounds) and read the answers back in order."""
        responses = await asyncio.gather(*(self.engine.ask(state, q, assets=assets) for state, q, assets in requests),
                                         return_exceptions=True)
        decisions = []
        for index, ((_, questions, _), response) in enumerate(zip(requests, responses)):
            if isinstance(response, BaseException):
                if isinstance(response, (EngineClosedError, QueueFullError)) or not isinstance(response, Exception):
                    raise response  # the engine's state, or a cancellation: no input is at fault
                raise MapInputError(self.name, index, response) from response
            decisions.append(self.compiled.decision(response, questions))
        return decisions

    def decide_many_sync(self, inputs: Iterable[Any]) -> list[Decision[T]]:
        requests = self.requests(inputs)
        return _run(self.ask_all(requests)) if requests else []

    async def decide_many(self, inputs: Iterable[Any]) -> list[Decision[T]]:
        return await self.ask_all(self.requests(inputs))


def _surface(decider: Decider, is_async: bool, function: Callable[..., Any] | None, name: str) -> Callable[..., Any]:
    """The public callable of a decider: a call gives the value, `.decision` the Decision, `.map` and
    `.decision.map` the same for many inputs; `.questions` the compiled questions (None when templated)."""
    if is_async:

        async def decision(*args: Any, **kwargs: Any) -> Decision:
            return await decider.decide(args, kwargs)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return (await decider.decide(args, kwargs)).value

        async def decisions(inputs: Iterable[Any]) -> list[Decision]:
            return await decider.decide_many(inputs)

        async def values(inputs: Iterable[Any]) -> list[Any]:
            return [decided.value for decided in await decider.decide_many(inputs)]

    else:

        def decision(*args: Any, **kwargs: Any) -> Decision:
            return decider.decide_sync(args, kwargs)

        def call(*args: Any, **kwargs: Any) -> Any:
            return decider.decide_sync(args, kwargs).value

        def decisions(inputs: Iterable[Any]) -> list[Decision]:
            return decider.decide_many_sync(inputs)

        def values(inputs: Iterable[Any]) -> list[Any]:
            return [decided.value for decided in decider.decide_many_sync(inputs)]

    for helper, qualname in ((decision, f"{name}.decision"), (decisions, f"{name}.decision.map"), (values, f"{name}.map")):
        helper.__name__, helper.__qualname__ = qualname.rsplit(".", 1)[-1], qualname
    if function is not None:
        call = functools.wraps(function)(call)
    else:
        call.__name__, call.__qualname__ = name.rsplit(".", 1)[-1], name
        call.__signature__ = decider.signature  # type: ignore[attr-defined]
    decision.map = decisions  # type: ignore[attr-defined]
    call.decision = decision  # type: ignore[attr-defined]
    call.map = values  # type: ignore[attr-defined]
    call.questions = decider.questions  # type: ignore[attr-defined]
    return call


def _decide_function(engine: Engine, function: Callable[..., Any], scope: dict[str, Any], threshold: float,
                     float_levels: int) -> Callable[..., Any]:
    try:
        hints = typing.get_type_hints(function, localns=scope, include_extras=True)
    except NameError as error:
        raise InvalidQuestionError(f"{function.__qualname__}: cannot resolve an annotation ({error})") from None
    if "return" not in hints:
        raise InvalidQuestionError(f"{function.__qualname__} needs a return annotation (a Struct or pydantic model)")
    model_type, _ = _split_annotated(hints["return"])
    decider = Decider(engine, function.__qualname__, inspect.signature(function), model_type,
                      inspect.getdoc(function), scope, threshold, float_levels)
    return _surface(decider, inspect.iscoroutinefunction(function), function, function.__qualname__)


def _decide_class(engine: Engine, model_type: type[T], scope: dict[str, Any], threshold: float,
                  float_levels: int) -> type[T]:
    name = f"{model_type.__qualname__}.decide"
    parameter = inspect.Parameter("state", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    signature = inspect.Signature([parameter], return_annotation=model_type)
    own_doc = model_type.__dict__.get("__doc__")  # not inspect.getdoc: it would inherit BaseModel's docstring
    docstring = inspect.cleandoc(own_doc) if isinstance(own_doc, str) else None
    decider = Decider(engine, name, signature, model_type, docstring, scope, threshold, float_levels)
    for attribute in CLASS_ATTRIBUTES:
        if attribute in decider.compiled.rules or hasattr(model_type, attribute):
            raise InvalidQuestionError(
                f"{model_type.__qualname__} already has a field or attribute {attribute!r}, which the class form of "
                f"decide adds; rename it or decorate a function instead"
            )
    for attribute, is_async in zip(CLASS_ATTRIBUTES, (False, True)):
        surface = _surface(decider, is_async, None, f"{model_type.__qualname__}.{attribute}")
        setattr(model_type, attribute, staticmethod(surface))
    return model_type


def _check_engine(engine: Any) -> None:
    """Refuse a bare `@fl.decide` (a function or class where the engine goes) and other non-engines."""
    if inspect.isclass(engine) or inspect.isroutine(engine):
        what = "class" if inspect.isclass(engine) else "function"
        raise InvalidQuestionError(
            f"decide needs an engine: use @fl.decide(engine) (a bare @fl.decide was applied to the {what} "
            f"{getattr(engine, '__qualname__', engine)!r})"
        )
    if not (callable(getattr(engine, "ask", None)) and callable(getattr(engine, "ask_sync", None))):
        raise InvalidQuestionError(f"decide needs an engine: use @fl.decide(engine), not a {type(engine).__name__}")


# ------------------------------------------------------------------------------------------ decorator
def decide(
    engine: Engine, *, threshold: float = 0.5, float_levels: int = DEFAULT_FLOAT_LEVELS
) -> Callable[[Any], Any]:
    """Decorate a (sync or async) function whose return annotation is a msgspec Struct or pydantic model, or
    such a class itself.

    A decorated function, called, asks the engine one request about the call's arguments and returns the
    coerced instance; `.decision(...)` returns the `Decision` instead; `.map(inputs)` / `.decision.map(inputs)`
    answer many inputs in shared rounds; `.questions` are the compiled questions (None with placeholders).
    A decorated class gets `Model.decide(state)` and `await Model.adecide(state)`, each with that surface.
    threshold: P(yes) at or above which a bool field is True. float_levels: levels of a float Score.
    """

    _check_engine(engine)
    check_options(threshold, float_levels)
    scope = dict(sys._getframe(1).f_locals)  # where the decorator runs: resolves models defined in a function

    def wrap(target: Any) -> Any:
        if isinstance(target, type):
            return _decide_class(engine, target, scope, threshold, float_levels)
        return _decide_function(engine, target, scope, threshold, float_levels)

    return wrap
