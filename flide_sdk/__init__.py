"""flide_sdk: exact, forked decision questions (yes/no, choice, score) about a long, growing state.

Public API (DESIGN.md §2): `Engine` with `ask`, `ask_sync`, `render`, `stats`, `aclose`; question types
`Noul`, `Choice`, `Score` and their answers; the `SystemOneResponse` every ask returns; the agent-framework
entry points `decide`, `guard`, `route` (and `flide_sdk.typesafe.transport` for the TypeSafe SDK); errors
in `flide_sdk.errors`.
"""

from __future__ import annotations

from flide_sdk.decide import decide
from flide_sdk.engine import Engine
from flide_sdk.errors import (
    CheckpointError,
    EngineClosedError,
    FlideError,
    GuardBlockedError,
    InvalidQuestionError,
    InvalidStateError,
    QueueFullError,
    StateTooLongError,
)
from flide_sdk.guard import guard, route
from flide_sdk.questions import Choice, ChoiceAnswer, Noul, NoulAnswer, Score, ScoreAnswer
from flide_sdk.render import Rendered, RenderedQuestion
from flide_sdk.typesafe import SystemOneResponse, Usage

__all__ = [
    "CheckpointError",
    "Choice",
    "ChoiceAnswer",
    "Engine",
    "EngineClosedError",
    "FlideError",
    "GuardBlockedError",
    "InvalidQuestionError",
    "InvalidStateError",
    "Noul",
    "Rendered",
    "RenderedQuestion",
    "NoulAnswer",
    "QueueFullError",
    "Score",
    "ScoreAnswer",
    "StateTooLongError",
    "SystemOneResponse",
    "Usage",
    "decide",
    "guard",
    "route",
]
