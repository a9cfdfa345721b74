"""What every prompt format gives the engine, and the one Jinja sandbox the formats render templates in.

A format turns (state, questions) into `TrunkQuestions`: trunks (token ids with a stable boundary, where a
checkpoint is saved and later asks resume) and, per question, a branch and where its answer is read. The engine
queues one ask per trunk and knows nothing else of the format.
"""

from __future__ import annotations

import datetime
import json
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np

from flide_sdk.errors import InvalidQuestionError, StateTooLongError
from flide_sdk.images import DecodedImage
from flide_sdk.models.decision import DecisionSpec
from flide_sdk.questions import Question, State
from flide_sdk.text.history import History, StateLog, Trunk
from flide_sdk.text.tokens import Tokens

if TYPE_CHECKING:
    from flide_sdk.prompt.images import RequestImages

LETTERS = tuple(string.ascii_uppercase)
CHARS_PER_TOKEN = 32  # a rendered text longer than this many characters per allowed token is refused unencoded
MAX_REPEAT = 1 << 20  # the longest string or list a template may build with `*`, and the largest `**` result's bits


@dataclass(frozen=True)
class RenderedQuestion:
    """One question's branch: its token ids (after the trunk), its label tokens and labels, its text; scored by
    text: no labels, and each option's reply (its tokens and the end of the turn) in `replies`."""

    ids: np.ndarray
    label_ids: np.ndarray
    labels: tuple[str, ...]
    text: str
    replies: tuple[np.ndarray, ...] = ()
    temperature: float = 1.0  # a decision model's, for this question's type: probabilities ~ p ** (1 / T)
    shared: bool = False  # read inside the one branch the ask's shared questions have (`Branches.of`)

    @property
    def options(self) -> int:
        return len(self.replies) or len(self.label_ids)


@dataclass(frozen=True)
class Rendered:
    """A request at token level: `state_ids` is the trunk; `trunk + questions[name].ids` is a whole prompt.
    A format's prompts may split a request into several trunks: `trunks` then names each question's."""

    state_ids: np.ndarray
    questions: dict[str, RenderedQuestion]
    trunks: dict[str, np.ndarray] = field(default_factory=dict)

    def prompt_ids(self, name: str) -> np.ndarray:
        """The standalone prompt of one question (up to its read token): its trunk + its branch."""
        return np.concatenate([self.trunks.get(name, self.state_ids), self.questions[name].ids])


@dataclass(frozen=True)
class TrunkQuestions:
    """One trunk of a request and the branches of the questions it holds."""

    trunk: Trunk
    questions: dict[str, RenderedQuestion]


class PromptFormat(Protocol):
    """How questions about a state are written and read. `name` is `Engine.info()["rendering"]`, `decision`
    the decision files it follows (None: a plain model's), `spec` what it reads them as (its head and adapter are
    loaded with the weights; None: flide_sdk's own prompt)."""

    name: str
    tokens: Tokens
    decision: str | None
    spec: DecisionSpec | None

    def new_state(self) -> History | StateLog:
        """An empty session state: what `Session.append` grows and `snapshot()` gives `parts`."""

    def request_images(self, assets: Mapping[str, DecodedImage]) -> RequestImages | None:
        """A request's images as this format places them; InvalidAssetError when it cannot (no vision tower)."""

    def parts(self, state: State | Trunk, questions: Mapping[str, Question],
              assets: Mapping[str, DecodedImage] | None = None) -> list[TrunkQuestions]:
        """The trunks of an ask (a one-off state, or a session's snapshot) and each question's branch, with the
        images of `assets` where the state names them; bad input raises InvalidQuestionError / InvalidStateError /
        InvalidAssetError / StateTooLongError here, before anything is queued."""


def as_rendered(parts: list[TrunkQuestions]) -> Rendered:
    """The token-level view of an ask's parts (`Engine.render`): the first trunk, and each question's trunk when
    there are several."""
    questions = {name: q for part in parts for name, q in part.questions.items()}
    trunks = {name: part.trunk.tokens() for part in parts for name in part.questions} if len(parts) > 1 else {}
    return Rendered(parts[0].trunk.tokens(), questions, trunks)


def check_lengths(tokens: Tokens, parts: list[TrunkQuestions]) -> None:
    """StateTooLongError when a question's whole prompt (its longest reply included) passes max_prompt_tokens."""
    for part in parts:
        tokens.check_length(len(part.trunk) + max(len(q.ids) + max((len(r) for r in q.replies), default=0)
                                                  for q in part.questions.values()))


class _TooLong(Exception):
    """A template built a string or list past MAX_REPEAT items (`render_bounded` makes it a StateTooLongError)."""

    def __init__(self, items: int) -> None:
        super().__init__(f"{items} items")
        self.items = items


class _Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """transformers' chat-template sandbox, with `*` and `**` bounded so a template cannot exhaust memory."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*" and isinstance(right, (str, list, tuple)):
            left, right = right, left
        if operator == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int):
            if len(left) * max(right, 0) > MAX_REPEAT:
                raise _TooLong(len(left) * right)
        if operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and right * max(1, abs(left).bit_length()) > MAX_REPEAT:
                raise jinja2.sandbox.SecurityError("a template's '**' result is too large")
        return super().call_binop(context, operator, left, right)


def environment() -> jinja2.Environment:
    """A sandbox like transformers' for chat templates: trimmed blocks, loop controls, its `tojson` (no HTML
    escaping), `raise_exception` and `strftime_now`."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def render_bounded(template: jinja2.Template, source: str, max_tokens: int, **values: Any) -> str:
    """`template` rendered with `values`, its output stopped past CHARS_PER_TOKEN characters per allowed token
    (StateTooLongError, before anything is encoded); whatever the template raises is an InvalidQuestionError
    naming `source`."""
    limit, parts, size = CHARS_PER_TOKEN * max_tokens, [], 0
    append = parts.append
    try:
        for part in template.root_render_func(template.new_context(values)):
            append(part)
            size += len(part)
            if size > limit:
                raise StateTooLongError(size // CHARS_PER_TOKEN, max_tokens)
    except (StateTooLongError, InvalidQuestionError):
        raise
    except _TooLong as error:
        raise StateTooLongError(max(error.items // CHARS_PER_TOKEN, max_tokens + 1), max_tokens) from None
    except Exception as error:  # the template is the checkpoint's code: whatever it raises, it did not render
        raise InvalidQuestionError(f"{source}: does not render this request ({type(error).__name__}: "
                                   f"{error})") from None
    return "".join(parts)
