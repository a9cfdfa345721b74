"""`Session`: an agent's growing history, asked about step after step, each step computing only what is new.

A session is a `History` (appends are cheap: no compute, no tokenization) bound to an engine. Each ask
tokenizes only the mutable tail and the new text, and its round saves a checkpoint at the new stable
boundary; the next ask of this session, of a fork, or of any request starting with the same tokens
resumes from it. `fork()` copies the history (not the device state: checkpoints are shared in the pool).
Images appended with a message (`assets=`) are decoded at the append; their digests are part of the history's
hashes, so a later ask resumes past them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from flide_sdk.errors import InvalidStateError
from flide_sdk.images import Assets, decode_assets
from flide_sdk.questions import Questions
from flide_sdk.text.history import History, StateLog, Trunk

if TYPE_CHECKING:
    from flide_sdk.engine import Engine
    from flide_sdk.questions import SystemOneResponse
    from flide_sdk.serve.asks import Ask, AskGroup


class Session:
    """Create with `engine.session()`; `append` text or messages, `await ask(questions)`, `fork()`."""

    def __init__(self, engine: Engine, history: History | StateLog) -> None:
        self.engine = engine
        self._history = history
        self._closed = False

    def append(self, item: str | Mapping[str, Any], *, assets: Assets | None = None) -> None:
        """Add text (concatenated to a text state) or a message dict with `role`/`content` (a list state), and
        the images its text names (`assets`, by placeholder: decoded here, InvalidAssetError with the history
        unchanged). A placeholder names one image for the whole session."""
        self._check_open()
        decoded = decode_assets(assets)
        if isinstance(self._history, StateLog):
            self._history.append(item, decoded)
        elif decoded:
            self._history.append(item, self.engine.prompt.request_images(decoded))
        else:
            self._history.append(item)

    def _prepare(self, questions: Questions) -> Ask | AskGroup:
        history = self._history
        assets = history.assets if isinstance(history, StateLog) else None
        return self.engine.prepare(history.snapshot(), questions, assets)

    async def ask(self, questions: Questions) -> SystemOneResponse:
        """Answer `questions` about the history so far (its images included)."""
        self._check_open()
        return await self.engine.submit(self._prepare(questions))

    def ask_sync(self, questions: Questions, timeout: float | None = None) -> SystemOneResponse:
        """Blocking `ask`, for scripts; AskTimeoutError after `timeout` s (the ask is withdrawn if it has not started)."""
        self._check_open()
        return self.engine.submit_sync(self._prepare(questions), timeout)

    def trunk(self) -> Trunk:
        """The history so far as token ids: a snapshot (its stable part and the mutable tail). A decision
        model's prompt prints the state inside its template, one trunk per group of questions: see `render`."""
        if isinstance(self._history, StateLog):
            raise InvalidStateError("a decision model's session has no single trunk; "
                                    "engine.render(state, questions) shows each question's")
        return self._history.snapshot()

    def fork(self) -> Session:
        """A session with the same history that then diverges (shares every checkpoint so far)."""
        self._check_open()
        return Session(self.engine, self._history.fork())

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Refuse further appends and asks (checkpoints stay in the pool until evicted)."""
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidStateError("this session is closed")

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
