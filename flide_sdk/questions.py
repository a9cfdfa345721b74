"""Question and answer types (Noul, Choice, Score), their validation, and the answer formulas.

The types mirror the TypeSafe System One SDK (fields `instructions` and `criteria`; answers with `noul`,
`choice`, `score`, `legend`, `probabilities`, `confidence`) so that code written against it ports by
changing the client. They are msgspec Structs tagged by a `type` field, so plain dicts with a `"type"` key
convert to them losslessly. Formulas (DESIGN.md §4), for option probabilities p over k options:
Noul = P(yes); Choice confidence = (max p - 1/k) / (1 - 1/k); Score = sum_i i * p_i and score confidence =
1 - sum_i p_i * |i - mode| / MAD_uniform with MAD_uniform = sum_i |i - (k - 1) / 2| / k, clipped at 0.

Input checks shared with the state's path live here too: lone surrogates (`unencodable`) and the nesting limit
(`check_nesting`, `MAX_NESTING`), both walked without recursion, so no input raises a bare RecursionError.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Union

import msgspec

from .errors import FlideError, InvalidQuestionError, InvalidStateError

Content = Union[str, dict, list]
"""Instructions and option descriptions: text, or a JSON object / array rendered with json.dumps."""

NOUL_OUTCOMES = ("true", "false")
SCORINGS = ("label", "text")
"""How a Choice's options are read: one label token each (A, B, ...), or each option's own text as the reply."""
MAX_NESTING = 100
"""The deepest JSON data a state, an appended message or a question's content may hold: a container (dict,
list, tuple) inside another counts one level, a top-level container is level 1. Deeper data (a JSON encoder's
recursion gives out near 1,000) is refused with InvalidStateError / InvalidQuestionError before anything is
queued."""


class Tagged(msgspec.Struct, frozen=True, tag_field="type"):
    """A question or answer type tagged by its `type` ("noul", "choice", "score"), with its dict form."""

    @property
    def type(self) -> str:
        return self.__struct_config__.tag

    def to_dict(self) -> dict[str, Any]:
        """The JSON form as Python data, `type` included (score maps keyed by strings, as on the wire)."""
        return msgspec.to_builtins(self, str_keys=True)


def surrogate_at(text: str) -> int | None:
    """The index of the first lone surrogate in `text` (a code point no UTF-8 text holds, as in bytes decoded with
    errors="surrogateescape"), else None: free for ASCII text, one UTF-8 encode for other text (far less than
    tokenizing it)."""
    if text.isascii():
        return None
    try:
        text.encode()
    except UnicodeEncodeError as error:
        return error.start
    return None


def unencodable(value: Any, text: str | None = None) -> str | None:
    """Where `value` (a string, or JSON data whose text is `text`) holds a lone surrogate, in words (" at
    position 3", " in ['content'] at position 3"), else None."""
    checked = value if isinstance(value, str) else text
    if checked is not None and surrogate_at(checked) is None:
        return None
    found = _surrogate_path(value, "")
    if found is None:
        return None
    path, text_at = found
    point = ord(text_at[1][text_at[0]])
    return f"{' in ' + path if path else ''} at position {text_at[0]} (U+{point:04X})"


def _surrogate_path(value: Any, path: str) -> tuple[str, tuple[int, str]] | None:
    """(the path of the first lone surrogate in `value`, (its position, the string holding it)), in the order
    json.dumps writes the data (a key before its value), walked with a stack: no depth is too deep."""
    pending: list[tuple[Any, str]] = [(value, path)]
    while pending:
        item, at = pending.pop()
        if isinstance(item, str):
            found = surrogate_at(item)
            if found is not None:
                return at, (found, item)
        elif isinstance(item, Mapping):
            children: list[tuple[Any, str]] = []
            for key, child in item.items():
                if isinstance(key, str) and surrogate_at(key) is not None:  # found when it is popped
                    children.append((key, f"{at} (a key)" if at else "a key"))
                    break
                children.append((child, f"{at}[{key!r}]"))
            pending.extend(reversed(children))
        elif isinstance(item, (list, tuple)):
            pending.extend(reversed([(child, f"{at}[{index}]") for index, child in enumerate(item)]))
    return None


def check_nesting(value: Any, what: str, error: type[FlideError] = InvalidStateError) -> None:
    """Refuse JSON data nested deeper than MAX_NESTING levels (or circular) with `error` naming `what` ("the
    state", "the message", "Noul instructions", ...); a string or a number is level 0. Walked with a stack, so
    any depth is refused with a typed error, never a RecursionError; free for a string."""
    if not _nested(value):
        return
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if depth > MAX_NESTING:
            raise error(f"{what} is nested deeper than {MAX_NESTING} levels (JSON objects and arrays inside "
                        f"each other; flide_sdk.questions.MAX_NESTING) or refers to itself; flatten it")
        children = item.values() if isinstance(item, Mapping) else item
        pending.extend((child, depth + 1) for child in children if _nested(child))


def _nested(value: Any) -> bool:
    """Whether `value` holds other values (a JSON object or array): strings and numbers are checked first."""
    return not isinstance(value, (str, int, float)) and isinstance(value, (dict, list, tuple, Mapping))


UNENCODABLE_HINT = "text must be valid Unicode (bytes decoded with errors='surrogateescape' are not: use errors='replace')"


def _check_content(where: str, value: Any, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, (str, dict, list)):
        raise InvalidQuestionError(f"{where} must be a string, a JSON object or a list, not {type(value).__name__}")
    check_nesting(value, where, InvalidQuestionError)
    if isinstance(value, str):
        found = unencodable(value)
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as error:  # a set, bytes, an object, a non-string key
            raise InvalidQuestionError(f"{where} must be JSON data: {error}") from None
        found = unencodable(value, text)
    if found is not None:
        raise InvalidQuestionError(f"{where} holds a lone surrogate{found}; {UNENCODABLE_HINT}")


class Noul(Tagged, tag="noul", frozen=True, forbid_unknown_fields=True):
    """A yes/no question. `criteria` may describe the outcomes: {"true": ..., "false": ...}. Both are optional,
    as in transformers' decision pipeline: a bare `{"type": "noul"}` asks the prompt's own yes/no."""

    instructions: Content | None = None
    criteria: dict[str, Content | None] | None = None

    def __post_init__(self) -> None:
        _check_content("Noul instructions", self.instructions, optional=True)
        if self.criteria is not None:
            if not isinstance(self.criteria, Mapping):
                raise InvalidQuestionError("Noul criteria must be a mapping with keys 'true' and/or 'false'")
            unknown = set(self.criteria) - set(NOUL_OUTCOMES)
            if unknown:
                raise InvalidQuestionError(f"Noul criteria keys must be 'true'/'false', got {sorted(map(str, unknown))}")
            for key, value in self.criteria.items():
                _check_content(f"Noul criteria[{key!r}]", value, optional=True)

    def option_names(self) -> list[str]:
        return ["yes", "no"]

    def option_descriptions(self) -> list[Content | None]:
        criteria = self.criteria or {}
        return [criteria.get("true"), criteria.get("false")]

    def answer(self, probabilities: Sequence[float]) -> NoulAnswer:
        return NoulAnswer(noul=float(probabilities[0]))


class Choice(Tagged, tag="choice", frozen=True, forbid_unknown_fields=True):
    """A multiple-choice question: `criteria` maps each option name to a description (or None). `scoring`:
    "label" reads one label token per option; "text" scores each option name as the whole reply (the sum of
    its tokens' log-probabilities, then a softmax over the options)."""

    instructions: Content | None = None
    criteria: dict[str, Content | None] = msgspec.field(default_factory=dict)
    scoring: str = "label"

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise InvalidQuestionError(f"Choice scoring must be 'label' or 'text', got {self.scoring!r}")
        _check_content("Choice instructions", self.instructions, optional=True)
        if not isinstance(self.criteria, Mapping):
            raise InvalidQuestionError("Choice criteria must be a mapping of option name -> description or None")
        if not self.criteria:
            raise InvalidQuestionError("a Choice needs at least one option in criteria")
        for name, description in self.criteria.items():
            if not isinstance(name, str):
                raise InvalidQuestionError(f"Choice option names must be strings, got {name!r}")
            if not name.strip():
                raise InvalidQuestionError("Choice option names must not be empty")
            _check_content(f"Choice option name {name!r}", name, optional=False)
            _check_content(f"Choice option {name!r}", description, optional=True)

    def option_names(self) -> list[str]:
        return list(self.criteria)

    def to_dict(self) -> dict[str, Any]:
        """As `Tagged.to_dict`, without `scoring` when it is the default (the TypeSafe wire form has none)."""
        data = super().to_dict()
        if self.scoring == "label":
            del data["scoring"]
        return data

    def option_descriptions(self) -> list[Content | None]:
        return list(self.criteria.values())

    def answer(self, probabilities: Sequence[float]) -> ChoiceAnswer:
        names = self.option_names()
        values = [float(p) for p in probabilities]
        return ChoiceAnswer(
            choice=names[values.index(max(values))],  # the first of equal maxima
            probabilities=dict(zip(names, values)),
            confidence=choice_confidence(values),
        )


class Score(Tagged, tag="score", frozen=True, forbid_unknown_fields=True):
    """A score question: `criteria` lists the levels in order, one description per score from zero."""

    instructions: Content | None = None
    criteria: list[Content] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        _check_content("Score instructions", self.instructions, optional=True)
        if not isinstance(self.criteria, (list, tuple)):
            raise InvalidQuestionError("Score criteria must be a list of level descriptions")
        if not self.criteria:
            raise InvalidQuestionError("a Score needs at least one level in criteria")
        for level, description in enumerate(self.criteria):
            _check_content(f"Score level {level}", description, optional=False)

    def option_names(self) -> list[str]:
        return [str(level) for level in range(len(self.criteria))]

    def option_descriptions(self) -> list[Content | None]:
        return list(self.criteria)

    def answer(self, probabilities: Sequence[float]) -> ScoreAnswer:
        values = [float(p) for p in probabilities]
        return ScoreAnswer(
            score=sum(level * p for level, p in enumerate(values)),
            confidence=score_confidence(values),
            legend=dict(enumerate(self.criteria)),
            probabilities=dict(enumerate(values)),
        )


Question = Union[Noul, Choice, Score]


class NoulAnswer(Tagged, tag="noul", frozen=True):
    """P(yes) of a Noul question."""

    noul: float


class ChoiceAnswer(Tagged, tag="choice", frozen=True):
    """The most probable option, every option's probability, and a confidence in [0, 1]."""

    choice: str
    probabilities: dict[str, float]
    confidence: float


class ScoreAnswer(Tagged, tag="score", frozen=True):
    """The expected level index, the levels (legend), their probabilities, and a confidence in [0, 1]."""

    score: float
    confidence: float
    legend: dict[int, Content]
    probabilities: dict[int, float]


Answer = Union[NoulAnswer, ChoiceAnswer, ScoreAnswer]

State = str | Mapping[str, Any] | Sequence[Any]
"""What an ask is about: text as is, or JSON data (rendered with json.dumps)."""
Questions = Mapping[str, Question | Mapping[str, Any] | Any]
"""Questions by name: Noul / Choice / Score, a dict with a "type" key, or a TypeSafe SDK question object."""


def choice_confidence(probabilities: Sequence[float]) -> float:
    """(max p - 1/k) / (1 - 1/k); a one-option choice is certain."""
    k = len(probabilities)
    if k == 1:
        return 1.0
    return (float(max(probabilities)) - 1.0 / k) / (1.0 - 1.0 / k)


def score_confidence(probabilities: Sequence[float]) -> float:
    """1 - expected distance to the mode, relative to that of a uniform distribution; clipped at 0."""
    values = [float(p) for p in probabilities]
    k = len(values)
    if k == 1:
        return 1.0
    mode = values.index(max(values))
    mad_uniform = sum(abs(level - (k - 1) / 2) for level in range(k)) / k
    spread = sum(p * abs(level - mode) for level, p in enumerate(values))
    return max(0.0, 1.0 - spread / mad_uniform)


def parse_questions(questions: Any) -> dict[str, Question]:
    """Validate a questions mapping: names are non-empty strings of valid Unicode (they are keys of the answers'
    JSON); values as `parse_question` takes them."""
    if not isinstance(questions, Mapping):
        raise InvalidQuestionError(
            f"questions must be a mapping of name -> question, not {type(questions).__name__}"
        )
    if not questions:
        raise InvalidQuestionError("at least one question is required")
    fast = _parse_plain(questions)
    if fast is not None:
        return fast
    parsed: dict[str, Question] = {}
    for name, question in questions.items():
        if not isinstance(name, str) or not name:
            raise InvalidQuestionError(f"question names must be non-empty strings, got {name!r}")
        found = unencodable(name)
        if found is not None:
            raise InvalidQuestionError(f"question name {name!r} holds a lone surrogate{found}; {UNENCODABLE_HINT}")
        parsed[name] = parse_question(name, question)
    return parsed


def _parse_plain(questions: Mapping) -> dict[str, Question] | None:
    """The common case in one msgspec call: a dict of plain dict questions under valid names; None for anything
    else, or anything it refuses (`parse_questions` then says precisely what and where)."""
    if type(questions) is not dict or not all(type(q) is dict for q in questions.values()):
        return None
    if not all(type(name) is str and name for name in questions):
        return None
    try:
        "".join(questions).encode("utf-8")  # a lone surrogate in a name cannot be encoded
        return msgspec.convert(questions, type=dict[str, Question])
    except (UnicodeEncodeError, msgspec.ValidationError, FlideError):
        return None


def parse_question(name: str, question: Any) -> Question:
    """One question: ours as is; a dict with "type"; or a TypeSafe SDK question object (any object with a
    `type` and `model_dump()`, converted through its dump, so typesafe_sdk is never imported here)."""
    if isinstance(question, (Noul, Choice, Score)):
        return question
    if not isinstance(question, Mapping) and isinstance(getattr(question, "type", None), str):
        dump = getattr(question, "model_dump", None)
        if callable(dump):
            question = dump()
    if isinstance(question, Mapping):
        kind = question.get("type")
        if kind == "box":
            raise InvalidQuestionError(
                f"question {name!r} has unknown type 'box' (Box questions locate something in an image, which "
                "flide_sdk does not support); expected 'noul', 'choice' or 'score'"
            )
        if kind not in ("noul", "choice", "score"):
            raise InvalidQuestionError(
                f"question {name!r} has unknown type {kind!r}; expected 'noul', 'choice' or 'score'"
            )
        try:
            return msgspec.convert(dict(question), type=Question)
        except msgspec.ValidationError as error:
            raise InvalidQuestionError(f"question {name!r}: {error}") from None
    raise InvalidQuestionError(
        f"question {name!r} must be a Noul, Choice or Score (a TypeSafe one, or a dict with a 'type' key), "
        f"not {type(question).__name__}"
    )


class Usage(msgspec.Struct, frozen=True):
    """Token counts of one request: every prompt token of its questions (trunk + each question's text, however
    much was resumed from checkpoints), and the reply tokens read: one label per question, or every token of a
    text-scored question's option replies."""

    input_tokens: int
    output_tokens: int


class SystemOneResponse(dict):
    """The answers of one ask by question name, with the request's `model` and `usage`.

    A plain `dict[str, Answer]` for existing code, plus the TypeSafe SDK's surface: `answers`, `nouls`,
    `choices`, `scores`, `model`, `usage`. `to_dict()` / `to_json()` give the System One wire form.
    """

    __slots__ = ("model", "usage")

    def __init__(self, answers: Mapping[str, Answer], *, model: str, usage: Usage) -> None:
        super().__init__(answers)
        self.model = model
        self.usage = usage

    @property
    def answers(self) -> dict[str, Answer]:
        """All answers keyed by question name."""
        return dict(self)

    @property
    def nouls(self) -> dict[str, NoulAnswer]:
        """Yes/no answers keyed by question name."""
        return {name: a for name, a in self.items() if isinstance(a, NoulAnswer)}

    @property
    def choices(self) -> dict[str, ChoiceAnswer]:
        """Choice answers keyed by question name."""
        return {name: a for name, a in self.items() if isinstance(a, ChoiceAnswer)}

    @property
    def scores(self) -> dict[str, ScoreAnswer]:
        """Score answers keyed by question name."""
        return {name: a for name, a in self.items() if isinstance(a, ScoreAnswer)}

    def to_dict(self) -> dict[str, Any]:
        """The wire form as Python data: `{"model", "answers", "usage"}`, score maps keyed by strings."""
        return msgspec.to_builtins({"model": self.model, "answers": dict(self), "usage": self.usage}, str_keys=True)

    def to_json(self) -> bytes:
        """The wire form as JSON bytes (what `POST /v1/systemone` answers)."""
        return msgspec.json.encode({"model": self.model, "answers": dict(self), "usage": self.usage})

    def __repr__(self) -> str:
        return f"SystemOneResponse(model={self.model!r}, answers={dict(self)!r}, usage={self.usage!r})"
