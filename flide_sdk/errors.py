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


class InvalidAssetError(FlideError, ValueError):
    """An image of a request cannot be served: no data, undecodable or truncated bytes, a format not served or not
    the one declared, zero or too many pixels, or a placeholder reference with no asset. `name` is the placeholder;
    raised before anything is queued."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"asset {name!r}: {reason}")
        self.name = name
        self.reason = reason


class MissingExtraError(FlideError, ImportError):
    """A feature needs an optional dependency that is not installed (e.g. Pillow for images: `flide_sdk[images]`)."""


class StateTooLongError(FlideError, ValueError):
    """A rendered prompt is longer than the engine's `max_prompt_tokens`; nothing is truncated."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(
            f"rendered prompt has {tokens} tokens, more than the engine's max_prompt_tokens={limit}; "
            "shorten the state or load the engine with a larger max_prompt_tokens"
        )
        self.tokens = tokens
        self.limit = limit


class AskTimeoutError(FlideError, TimeoutError):
    """A blocking ask (`ask_sync(timeout=...)`) did not finish in time. An ask no round had taken yet was withdrawn
    (`withdrawn`: it will never be computed); one already running finishes on the device, its answer dropped."""

    def __init__(self, timeout: float, withdrawn: bool) -> None:
        state = "it was withdrawn before any round took it" if withdrawn else "its round was already running"
        super().__init__(f"the ask did not finish within {timeout:g} s; {state}")
        self.timeout = timeout
        self.withdrawn = withdrawn


class InvalidOptionError(FlideError, ValueError):
    """An option of `Engine.load` / `Engine` is out of range (a size that is not a positive integer, a limit past
    what the model holds); raised before anything is loaded or allocated."""


class EngineClosedError(FlideError, RuntimeError):
    """The engine was closed (or is closing); the ask was not and will not be answered."""


EngineClosed = EngineClosedError
"""Alias: the name the session issue and the TypeSafe-style hierarchy use."""


class CheckpointError(FlideError, ValueError):
    """A checkpoint directory cannot be served: a file missing or unreadable (config, weights, tokenizer, chat
    template), a config value out of range, a tensor of the wrong shape or dtype or not finite. The message
    names the file and the field, tensor or value."""


class DeviceError(FlideError, ValueError):
    """The device or dtype asked of `Engine.load` is unknown, unsupported, or not available in this torch."""


class ReplicaError(FlideError, RuntimeError):
    """The cluster replica holding an ask failed while it ran (`flide_sdk.cluster`): that ask has no answers; a
    session's next ask continues on a live replica, recomputing its history once."""


class QueueFullError(FlideError, TimeoutError):
    """The engine's queue stayed full for longer than the ask's `queue_timeout` (backpressure); retry later."""

    def __init__(self, timeout: float, retry_after_ms: int) -> None:
        super().__init__(
            f"the engine's queue stayed full for {timeout:g} s; retry in about {retry_after_ms} ms "
            "(or load the engine with a larger max_pending)"
        )
        self.timeout = timeout
        self.retry_after_ms = retry_after_ms


class GuardBlockedError(FlideError):
    """A `@guard` blocked a call: its question's P(yes) was above `block_above` and no `on_block` was given."""

    def __init__(self, function: str, probability: float, block_above: float) -> None:
        super().__init__(f"guard blocked {function}(): P(yes)={probability:.3f} is above block_above={block_above:g}")
        self.function = function
        self.probability = probability
        self.block_above = block_above


class MapInputError(FlideError, ValueError):
    """One input of a decided function's `.map` failed (arguments that do not bind, a state or docstring
    template that does not render, a prompt too long): `index` names it, `error` (also `__cause__`) is why."""

    def __init__(self, function: str, index: int, error: BaseException) -> None:
        super().__init__(f"{function}.map: input {index} failed: {type(error).__name__}: {error}")
        self.function = function
        self.index = index
        self.error = error
