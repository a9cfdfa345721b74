"""Exceptions raised by flide_sdk.

Every error the SDK raises on purpose derives from `FlideError`, so callers can catch the family at once.
Input errors also derive from `ValueError` and lifecycle errors from `RuntimeError`, so generic handlers
keep working. A failed ask never poisons the engine: the next ask runs normally.
"""

from __future__ import annotations


class FlideError(Exception):
    """Base class of every error raised by flide_sdk."""


class InvalidQuestionError(FlideError, ValueError):
    """A question (or the questions mapping) is malformed: empty, unknown type, bad options, bad labels."""


class InvalidStateError(FlideError, ValueError):
    """The state cannot be rendered (not JSON-serializable, or a message without role/content)."""


class StateTooLongError(FlideError, ValueError):
    """A rendered prompt is longer than the engine's `max_prompt_tokens`; nothing is truncated."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(
            f"rendered prompt has {tokens} tokens, more than the engine's max_prompt_tokens={limit}; "
            "shorten the state or load the engine with a larger max_prompt_tokens"
        )
        self.tokens = tokens
        self.limit = limit


class EngineClosedError(FlideError, RuntimeError):
    """The engine was closed (or is closing); the ask was not and will not be answered."""


EngineClosed = EngineClosedError
"""Alias: the name the session issue and the TypeSafe-style hierarchy use."""


class CheckpointError(FlideError, ValueError):
    """A checkpoint directory is missing files, has an unsupported model type, or lacks weights."""
