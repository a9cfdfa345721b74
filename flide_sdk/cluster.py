"""Ray Serve deployment (optional extra `[ray]`): one engine per replica, each session routed to the replica that
holds its checkpoints.

`deployment(path, num_replicas=...)` is a Serve application of `FlideReplica`: one `Engine` per replica (one GPU
each with `ray_actor_options={"num_gpus": 1}`). `ClusterClient(handle)` is the async API an application uses:
`await client.ask(state, questions, assets=...)`, `client.session()` with `append`, `ask` and `fork`. Images are
decoded and checked at the client (InvalidAssetError before anything is sent) and travel decoded, so a replica
never reads a client's files and sees the same pixels and digests. Affinity: a session's
asks carry its family's id (a session and its forks share one, so forks find their parent's checkpoints) as
Serve's multiplexed model id, which Serve routes to a replica that has served it (docs/decisions/
cluster-affinity.md). The client keeps each session's history; a replica keeps its own session per session id
and how many history items it has appended, and asks for the rest when an ask brings too few (a replica that
never saw the session, or holds an old copy): it recomputes them once, so nothing is lost and answers stay
exact. A replica failure fails the asks it held (`ReplicaError`); the next ones go to a live replica.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flide_sdk.engine import Engine
from flide_sdk.errors import FlideError, InvalidAssetError, QueueFullError, ReplicaError
from flide_sdk.images import Assets, DecodedImage, decode_assets
from flide_sdk.options import MAX_PENDING
from flide_sdk.questions import Questions, State, SystemOneResponse
from flide_sdk.session import Session

MAX_SESSION_FAMILIES = 1 << 20  # ids a replica keeps routing to itself (Serve evicts the least recently used)


@dataclass(frozen=True)
class SessionReply:
    """A replica's answer to a session ask: the response, or (response None) the number of history items it
    holds, from which the client must send the rest; and which replica answered."""

    response: SystemOneResponse | None
    have: int
    replica: str


@dataclass(frozen=True)
class HistoryItem:
    """One appended history item and the images its text names, decoded at the client."""

    item: str | Mapping[str, Any]
    assets: Mapping[str, DecodedImage] = field(default_factory=dict)


@dataclass
class _Held:
    session: Session
    items: int  # history items appended to it


class FlideReplica:
    """One engine and the sessions it holds (the deployment's class; plain Python, tested without Ray)."""

    def __init__(self, path: str, load_options: Mapping[str, Any]) -> None:
        self.engine = Engine.load(path, **load_options)
        self.sessions: dict[str, _Held] = {}
        self.name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

    async def ask(self, state: State, questions: Questions, assets: Assets | None = None) -> SystemOneResponse:
        return await self.engine.ask(state, questions, assets=assets)

    async def session_ask(self, session_id: str, first: int, items: list[HistoryItem], questions: Questions
                          ) -> SessionReply:
        """Append `items` (history items `first` on) to the session, then ask; if it holds fewer than `first`
        items, ask nothing and say how many it holds."""
        held = self.sessions.get(session_id)
        if held is None:
            held = self.sessions[session_id] = _Held(self.engine.session(), 0)
        if first > held.items:
            return SessionReply(None, held.items, self.name)
        for entry in items[held.items - first :]:
            held.session.append(entry.item, assets=entry.assets or None)
        held.items = first + len(items)
        return SessionReply(await held.session.ask(questions), held.items, self.name)

    async def stats(self) -> dict[str, Any]:
        return {"replica": self.name, **self.engine.stats()}


def deployment(path: str | Path, *, num_replicas: int = 1, ray_actor_options: Mapping[str, Any] | None = None,
               **load_options: Any) -> Any:
    """The Serve application (`serve.run(deployment(...))`): `num_replicas` replicas of `FlideReplica`, each
    `Engine.load(path, **load_options)`; a session ask registers its family's id on the replica that serves it,
    so Serve routes the family's next asks there."""
    from ray import serve

    # a replica takes as many asks at once as its engine queues (Serve's default of 5 would cap its rounds at 5
    # asks, and send a busy replica's sessions elsewhere)
    ongoing = int(load_options.get("max_pending", MAX_PENDING))

    @serve.deployment(num_replicas=num_replicas, ray_actor_options=dict(ray_actor_options or {}),
                      max_ongoing_requests=ongoing)
    class FlideDeployment(FlideReplica):
        @serve.multiplexed(max_num_models_per_replica=MAX_SESSION_FAMILIES)
        async def route(self, family: str) -> str:
            return family

        async def session_ask(self, session_id: str, first: int, items: list[HistoryItem], questions: Questions
                              ) -> SessionReply:
            family = serve.get_multiplexed_model_id()
            if family:
                await self.route(family)
            return await super().session_ask(session_id, first, items, questions)

    return FlideDeployment.bind(str(path), load_options)


def app_builder(args: Mapping[str, str]) -> Any:
    """The application `serve run flide_sdk.cluster:app_builder path=DIR num_replicas=N [num_gpus=1]
    [num_cpus=C] [device=cuda] [dtype=bfloat16]` deploys (Serve passes the command line's key=value pairs)."""
    actor = {key: float(args[key]) for key in ("num_gpus", "num_cpus") if key in args}
    load = {key: args[key] for key in ("device", "dtype") if key in args}
    return deployment(args["path"], num_replicas=int(args.get("num_replicas", 1)), ray_actor_options=actor, **load)


def _raise_as_flide(error: Exception) -> None:
    """The SDK's error for a failure in the cluster: the replica's own FlideError, QueueFullError for Serve's
    backpressure, ReplicaError for a replica that died or could not answer."""
    cause = getattr(error, "cause", None)
    if isinstance(error, FlideError):
        raise error
    if isinstance(cause, FlideError):
        raise cause from None
    if type(error).__name__ == "BackPressureError":
        raise QueueFullError(0.0, 100) from error
    raise ReplicaError(f"the replica holding this ask failed: {type(error).__name__}: {error}") from error


class ClusterClient:
    """The SDK's API over a Serve deployment handle (`serve.run(deployment(...))` or `serve.get_app_handle`)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def ask(self, state: State, questions: Questions, *, assets: Assets | None = None) -> SystemOneResponse:
        """`Engine.ask` on a replica; `assets` are decoded here (InvalidAssetError before anything is sent)."""
        decoded = decode_assets(assets) or None
        try:
            return await self.handle.ask.remote(state, questions, decoded)
        except Exception as error:  # noqa: BLE001 - mapped to the SDK's errors
            _raise_as_flide(error)

    def session(self) -> ClusterSession:
        return ClusterSession(self, uuid.uuid4().hex)

    async def _session_ask(self, family: str, args: tuple) -> SessionReply:
        return await self._call(family, "session_ask", args)

    async def _call(self, family: str, method: str, args: tuple) -> Any:
        try:
            return await getattr(self.handle.options(multiplexed_model_id=family), method).remote(*args)
        except Exception as error:  # noqa: BLE001 - mapped to the SDK's errors
            _raise_as_flide(error)


@dataclass
class ClusterSession:
    """A session whose history the client keeps: `append`, `await ask(questions)`, `fork()`. `replicas` names the
    replica that answered each ask."""

    client: ClusterClient
    family: str
    items: list[HistoryItem] = field(default_factory=list)
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    replicas: list[str] = field(default_factory=list)
    _acknowledged: int = 0  # items the replica that answered last holds
    _digests: dict[str, bytes] = field(default_factory=dict)  # each placeholder's image so far

    def append(self, item: str | Mapping[str, Any], *, assets: Assets | None = None) -> None:
        """Add a history item and the images its text names (decoded here: InvalidAssetError with the history
        unchanged; a placeholder names one image for the whole session, as in `Session.append`)."""
        decoded = decode_assets(assets)
        for name, image in decoded.items():
            if self._digests.get(name, image.digest) != image.digest:
                raise InvalidAssetError(name, "this placeholder already names another image in this session")
        self.items.append(HistoryItem(item, decoded))
        self._digests.update((name, image.digest) for name, image in decoded.items())

    async def ask(self, questions: Questions) -> SystemOneResponse:
        first = self._acknowledged
        reply = await self.client._session_ask(self.family, (self.session_id, first, self.items[first:], questions))
        if reply.response is None:  # a replica without (all of) this session: the history from what it holds
            first = reply.have
            reply = await self.client._session_ask(self.family,
                                                   (self.session_id, first, self.items[first:], questions))
        if reply.response is None:
            raise ReplicaError("a replica lost this session's history twice in a row")
        self._acknowledged = reply.have
        self.replicas.append(reply.replica)
        return reply.response

    async def replica_stats(self) -> dict[str, Any]:
        """`stats()` of the replica this session's asks go to, with its name (`replica`)."""
        return await self.client._call(self.family, "stats", ())

    def fork(self) -> ClusterSession:
        """A session with the same history, routed with its parent (whose checkpoints it resumes from)."""
        return ClusterSession(self.client, self.family, list(self.items), _digests=dict(self._digests))
