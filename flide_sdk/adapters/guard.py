"""Routing guards: `@guard` (block or reroute a call when a yes/no question says so) and `@route` (dispatch a
call to one of several functions by the most probable option of a choice question).

Both wrap a sync or an async function and ask one question about each call before it runs. The state of
the question is built from the call's arguments: a template (`"Run {command}?"`, formatted with the bound
arguments, defaults applied), a callable taking the same arguments, or by default the arguments themselves
(`decide.call_state`: one argument as is, several as a dict). An async wrapper awaits `engine.ask`, so
concurrent calls share rounds; a sync one blocks on `engine.ask_sync`.

Given a `session` (or a callable mapping the call's arguments to the session of its conversation), each
call's state is appended to that session before asking, so a guarded agent step resumes from the
checkpoint of the previous step and computes only its new tokens. The state must then be what
`Session.append` takes: text, or a message dict with `role` and `content`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Union

from flide_sdk.adapters.decide import call_state
from flide_sdk.errors import GuardBlockedError, InvalidQuestionError
from flide_sdk.questions import Choice, Noul, Question, SystemOneResponse, parse_question
from flide_sdk.session import Session

if TYPE_CHECKING:
    from flide_sdk.engine import Engine

StateSpec = Union[str, Callable[..., Any], None]
"""A template formatted with the bound arguments, a callable taking the call's arguments, or None."""
SessionSpec = Union[Session, Callable[..., Session], None]
"""One session for every call, a callable returning the session of a call's conversation, or None."""


class _Asker:
    """Builds the state of a call and asks the question about it, alone or in the call's session."""

    def __init__(self, engine: Engine, name: str, question: Question, function: Callable[..., Any],
                 state: StateSpec, session: SessionSpec) -> None:
        if state is not None and not isinstance(state, str) and not callable(state):
            raise InvalidQuestionError(f"state must be a template string, a callable or None, not {type(state).__name__}")
        if session is not None and not isinstance(session, Session) and not callable(session):
            raise InvalidQuestionError(f"session must be a Session, a callable returning one, or None, not {type(session).__name__}")
        self.engine = engine
        self.questions = {name: question}
        self.signature = inspect.signature(function)
        self.state = state
        self.session = session

    def _state(self, args: tuple, kwargs: dict) -> Any:
        if self.state is None:
            return call_state(self.signature, args, kwargs)
        if isinstance(self.state, str):
            bound = self.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return self.state.format(**bound.arguments)
        return self.state(*args, **kwargs)

    def _session(self, args: tuple, kwargs: dict) -> Session | None:
        if self.session is None or isinstance(self.session, Session):
            return self.session
        return self.session(*args, **kwargs)

    async def ask(self, args: tuple, kwargs: dict) -> SystemOneResponse:
        state = self._state(args, kwargs)
        session = self._session(args, kwargs)
        if session is None:
            return await self.engine.ask(state, self.questions)
        session.append(state)
        return await session.ask(self.questions)

    def ask_sync(self, args: tuple, kwargs: dict) -> SystemOneResponse:
        state = self._state(args, kwargs)
        session = self._session(args, kwargs)
        if session is None:
            return self.engine.ask_sync(state, self.questions)
        session.append(state)
        return session.ask_sync(self.questions)


def _question_of(kind: type, question: Any) -> Question:
    """The decorator's question parsed like any other (ours, TypeSafe's, a dict); a string is a Noul's text."""
    if isinstance(question, str) and kind is Noul:
        question = Noul(question)
    parsed = parse_question(kind.__name__.lower(), question)
    if not isinstance(parsed, kind):
        raise InvalidQuestionError(f"this decorator asks a {kind.__name__} question, got a {type(parsed).__name__}")
    return parsed


async def _resolve(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


def guard(
    engine: Engine,
    question: Any,
    *,
    block_above: float = 0.5,
    on_block: Callable[..., Any] | None = None,
    state: StateSpec = None,
    session: SessionSpec = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Guard a sync or async function with a yes/no question about its arguments.

    question: a Noul (ours, TypeSafe's, a dict) or its instructions as a string. When P(yes) is above
    `block_above` the call does not run: `on_block` is called with the same arguments instead (reroute;
    awaited when it returns an awaitable) or, without one, GuardBlockedError is raised.
    """
    noul = _question_of(Noul, question)
    if not 0.0 <= block_above <= 1.0:
        raise InvalidQuestionError(f"block_above must be within [0, 1], got {block_above}")

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        asker = _Asker(engine, "guard", noul, function, state, session)

        def blocked(probability: float, args: tuple, kwargs: dict) -> Any:
            if on_block is None:
                raise GuardBlockedError(function.__qualname__, probability, block_above)
            return on_block(*args, **kwargs)

        if inspect.iscoroutinefunction(function):

            @functools.wraps(function)
            async def call(*args: Any, **kwargs: Any) -> Any:
                probability = (await asker.ask(args, kwargs))["guard"].noul
                if probability > block_above:
                    return await _resolve(blocked(probability, args, kwargs))
                return await function(*args, **kwargs)

        else:

            @functools.wraps(function)
            def call(*args: Any, **kwargs: Any) -> Any:
                probability = asker.ask_sync(args, kwargs)["guard"].noul
                if probability > block_above:
                    return blocked(probability, args, kwargs)
                return function(*args, **kwargs)

        return call

    return wrap


def route(
    engine: Engine,
    question: Any,
    *,
    routes: Mapping[str, Callable[..., Any]],
    min_confidence: float = 0.0,
    state: StateSpec = None,
    session: SessionSpec = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Dispatch calls of the decorated (fallback) function by the most probable option of a Choice.

    routes: option name -> function called with the same arguments. The decorated function itself runs
    when the choice's confidence is below `min_confidence` or the chosen option has no route.
    """
    choice = _question_of(Choice, question)
    unknown = set(routes) - set(choice.option_names())
    if unknown:
        raise InvalidQuestionError(f"routes {sorted(unknown)} are not options of the question {choice.option_names()}")
    if not all(callable(target) for target in routes.values()):
        raise InvalidQuestionError("every route must be callable")
    if not 0.0 <= min_confidence <= 1.0:
        raise InvalidQuestionError(f"min_confidence must be within [0, 1], got {min_confidence}")

    def wrap(fallback: Callable[..., Any]) -> Callable[..., Any]:
        asker = _Asker(engine, "route", choice, fallback, state, session)

        def target(response: SystemOneResponse) -> Callable[..., Any]:
            answer = response["route"]
            return routes.get(answer.choice, fallback) if answer.confidence >= min_confidence else fallback

        if inspect.iscoroutinefunction(fallback):

            @functools.wraps(fallback)
            async def call(*args: Any, **kwargs: Any) -> Any:
                return await _resolve(target(await asker.ask(args, kwargs))(*args, **kwargs))

        else:

            @functools.wraps(fallback)
            def call(*args: Any, **kwargs: Any) -> Any:
                return target(asker.ask_sync(args, kwargs))(*args, **kwargs)

        return call

    return wrap
