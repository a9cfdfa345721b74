"""flide_sdk: exact, forked decision questions (yes/no, choice, score) about a long, growing state.

Public API (docs/ARCHITECTURE.md): `Engine` with `ask`, `ask_sync`, `session`, `render`, `stats`, `aclose`;
`EngineGroup` (one engine per device); `Session`; question types `Noul`, `Choice`, `Score` and their answers;
the `SystemOneResponse` every ask returns; the agent-framework entry points `decide` (and its `Decision`),
`guard`, `route` (`flide_sdk.adapters.typesafe` for the TypeSafe SDK); every error the SDK raises derives from
`FlideError`.
The library prints nothing itself: it logs to the `flide_sdk` logger, which has a NullHandler.
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version

from flide_sdk.adapters.decide import Decision, decide
from flide_sdk.adapters.guard import guard, route
from flide_sdk.engine import Engine
from flide_sdk.errors import (
    AskTimeoutError,
    CheckpointError,
    DeviceError,
    EngineClosedError,
    FlideError,
    GuardBlockedError,
    InvalidOptionError,
    InvalidQuestionError,
    InvalidStateError,
    MapInputError,
    QueueFullError,
    ReplicaError,
    StateTooLongError,
)
from flide_sdk.group import EngineGroup
from flide_sdk.prompt.base import Rendered, RenderedQuestion
from flide_sdk.questions import (
    Answer,
    Choice,
    ChoiceAnswer,
    Noul,
    NoulAnswer,
    Question,
    Questions,
    Score,
    ScoreAnswer,
    State,
    SystemOneResponse,
    Usage,
)
from flide_sdk.session import Session

logging.getLogger(__name__).addHandler(logging.NullHandler())

try:
    __version__ = version("flide_sdk")
except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
    __version__ = "0+unknown"

__all__ = [
    "Answer",
    "AskTimeoutError",
    "CheckpointError",
    "Choice",
    "ChoiceAnswer",
    "Decision",
    "DeviceError",
    "Engine",
    "EngineClosedError",
    "EngineGroup",
    "FlideError",
    "GuardBlockedError",
    "InvalidOptionError",
    "InvalidQuestionError",
    "InvalidStateError",
    "MapInputError",
    "Noul",
    "NoulAnswer",
    "Question",
    "Questions",
    "QueueFullError",
    "Rendered",
    "RenderedQuestion",
    "ReplicaError",
    "Score",
    "ScoreAnswer",
    "Session",
    "State",
    "StateTooLongError",
    "SystemOneResponse",
    "Usage",
    "__version__",
    "decide",
    "guard",
    "route",
]
