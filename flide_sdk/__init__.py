"""flide_sdk: exact, forked decision questions (yes/no, choice, score) about a long, growing state.

Public API (DESIGN.md §2): `Engine` with `ask`, `ask_sync`, `render`, `stats`, `aclose`; question types
`Noul`, `Choice`, `Score` and their answers; the `SystemOneResponse` every ask returns; the agent-framework
entry points `decide`, `guard`, `route` (and `flide_sdk.typesafe.transport` for the TypeSafe SDK); errors
in `flide_sdk.errors`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _register_source_kernels() -> None:
    """Make the top-level `kernels/` folder importable as `flide_sdk.kernels` when running from a checkout.

    An installed wheel (or an editable install) maps it there already; with only PYTHONPATH set to the
    repository root, this registers the folder under that name so nothing named `kernels` is top-level.
    """
    name = __name__ + ".kernels"
    if importlib.util.find_spec(name) is not None:
        return
    source = Path(__file__).resolve().parent.parent / "kernels" / "__init__.py"
    spec = importlib.util.spec_from_file_location(name, source, submodule_search_locations=[str(source.parent)])
    if spec is None or spec.loader is None:
        raise ImportError(f"flide_sdk.kernels not found (looked for {source})")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


_register_source_kernels()

from flide_sdk.decide import decide  # noqa: E402
from flide_sdk.engine import Engine  # noqa: E402
from flide_sdk.errors import (  # noqa: E402
    CheckpointError,
    EngineClosedError,
    FlideError,
    GuardBlockedError,
    InvalidQuestionError,
    InvalidStateError,
    QueueFullError,
    StateTooLongError,
)
from flide_sdk.guard import guard, route  # noqa: E402
from flide_sdk.questions import Choice, ChoiceAnswer, Noul, NoulAnswer, Score, ScoreAnswer  # noqa: E402
from flide_sdk.render import Rendered, RenderedQuestion  # noqa: E402
from flide_sdk.typesafe import SystemOneResponse, Usage  # noqa: E402

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
