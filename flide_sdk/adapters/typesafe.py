"""TypeSafe System One parity over HTTP semantics: the error mapping and an in-process transport.

Code written against the TypeSafe System One SDK (`typesafe-sdk`) ports to flide_sdk in two ways:

- Natively, without this module. `engine.ask` / `session.ask` take TypeSafe question objects and plain dicts
  (`questions.parse_question`) and return a `questions.SystemOneResponse` (answers by question name, `model`,
  `usage`, the TypeSafe views; `to_json()` is the System One wire form). Nothing on this path touches JSON.
- Unchanged, over HTTP semantics but in process. `client(engine)` / `async_client(engine)` build the TypeSafe
  clients on `transport(engine)`, a transport for httpx2 (the HTTP client the TypeSafe SDK takes), with the base
  URL `LOCAL_BASE_URL` so that errors name the in-process endpoint. The transport answers `POST /v1/systemone`
  (JSON bodies, zstd-compressed or not) and `GET /v1/models` from the engine.

Errors map onto TypeSafe's hierarchy by HTTP status (`http_error`), the same table for the transport and
for `as_typesafe_error`: a malformed body (not JSON, bad compression, a malformed multipart form) is 400 (bad
request); an image the engine cannot serve is 422 on `assets`;
a question or state the engine rejects is 422 (unprocessable entity) with a FastAPI-style `detail` list; a
prompt longer than the engine's limit is 400; a queue still full after `queue_timeout` is 429 (rate limit)
with a `retry-after-ms` header; a closed engine is 503 (internal server error class, 5xx). The request's
`model` is accepted whatever it names: the response's `model` is the engine's name, as a hosted API
answers with the model it resolved.

This module imports neither pydantic, httpx2 nor typesafe_sdk at import time: the transport duck-types
httpx2's `BaseTransport` / `AsyncBaseTransport` and imports httpx2 only when it builds a response.
"""

from __future__ import annotations

import datetime
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from flide_sdk.errors import (
    EngineClosedError,
    FlideError,
    InvalidAssetError,
    InvalidQuestionError,
    InvalidStateError,
    QueueFullError,
    StateTooLongError,
)
from flide_sdk.questions import SystemOneResponse

if TYPE_CHECKING:
    import httpx2

    from flide_sdk.engine import Engine

LOCAL_BASE_URL = "http://in-process.flide-sdk"
"""The base URL of the in-process clients (`client`, `async_client`): errors name it, not the hosted API."""
SYSTEM_ONE_PATH = "/v1/systemone"
MODELS_PATH = "/v1/models"
DEFAULT_QUEUE_TIMEOUT_S = 30.0


# --------------------------------------------------------------------------------------------- errors
class RequestError(FlideError, ValueError):
    """A request body the transport cannot read (answered 400), before the engine sees it."""


def _detail(location: str, error: Exception) -> dict[str, Any]:
    return {"detail": [{"loc": ["body", location], "msg": str(error), "type": "value_error"}]}


def http_error(error: BaseException) -> tuple[int, Any, dict[str, str]]:
    """(status, JSON body, headers) of the HTTP error response that stands for `error`."""
    if isinstance(error, InvalidQuestionError):
        return 422, _detail("questions", error), {}
    if isinstance(error, InvalidStateError):
        return 422, _detail("state", error), {}
    if isinstance(error, InvalidAssetError):
        return 422, _detail("assets", error), {}
    if isinstance(error, (StateTooLongError, RequestError)):
        return 400, {"detail": str(error)}, {}
    if isinstance(error, QueueFullError):
        return 429, {"detail": str(error)}, {"retry-after-ms": str(error.retry_after_ms)}
    if isinstance(error, EngineClosedError):
        return 503, {"detail": str(error)}, {}
    return 500, {"detail": f"{type(error).__name__}: {error}"}, {}


def as_typesafe_error(error: BaseException) -> Exception:
    """The `typesafe_sdk` exception a TypeSafe client raises for `error` (needs typesafe-sdk installed)."""
    import httpx2
    import typesafe_sdk as ts

    status, body, headers = http_error(error)
    by_status: dict[int, type[ts.TypeSafeAPIError]] = {
        400: ts.TypeSafeBadRequestError,
        422: ts.TypeSafeUnprocessableEntityError,
        429: ts.TypeSafeRateLimitError,
    }
    kind = by_status.get(status, ts.TypeSafeInternalServerError)
    return kind(status, body, httpx2.Headers(headers), endpoint=f"POST {LOCAL_BASE_URL}{SYSTEM_ONE_PATH}")


# ------------------------------------------------------------------------------------------ transport
def _decompress(body: bytes, encoding: str) -> bytes:
    if encoding in ("", "identity"):
        return body
    if encoding != "zstd":
        raise RequestError(f"unsupported Content-Encoding {encoding!r}; send zstd or uncompressed bodies")
    try:
        from compression import zstd  # Python 3.14+
    except ImportError:
        try:
            from backports import zstd  # what typesafe-sdk[zstd] installs before 3.14
        except ImportError:
            raise RequestError("a zstd body arrived but no zstd codec is installed (pip install backports.zstd)") from None
    try:
        return zstd.decompress(body)
    except zstd.ZstdError as error:
        raise RequestError(f"the zstd request body does not decompress: {error}") from None


@dataclass(frozen=True)
class SystemOneRequest:
    """A decoded `POST /v1/systemone` body: its state, questions and image assets by placeholder (None: none)."""

    state: Any
    questions: Any
    assets: dict[str, Any] | None


def _multipart(raw: bytes, content_type: str) -> dict[str, bytes]:
    """The parts of a `multipart/form-data` body (RFC 7578) by name."""
    boundary = next((p.strip().partition("=")[2].strip('"') for p in content_type.split(";")[1:]
                     if p.strip().startswith("boundary=")), "")
    if not boundary:
        raise RequestError("a multipart request without a boundary")
    delimiter = b"--" + boundary.encode("ascii", "replace")
    chunks = raw.split(delimiter)
    if len(chunks) < 3 or not chunks[-1].startswith(b"--"):
        raise RequestError("the multipart body is not closed by its boundary")
    parts = {}
    for chunk in chunks[1:-1]:
        head, found, content = chunk.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        name = re.search(rb'name="([^"]*)"', head) if found else None
        if name is None:
            raise RequestError("a multipart part without headers or a name")
        parts[name[1].decode("ascii", "replace")] = content.removesuffix(b"\r\n")
    return parts


def decode_request(content: bytes, headers: Mapping[str, str]) -> SystemOneRequest:
    """The state, questions and assets of a `POST /v1/systemone` body: JSON (zstd or not), or the TypeSafe SDK's
    multipart form (a `request` JSON part, each image asset naming its part); raises RequestError or the engine's
    input errors."""
    raw = _decompress(content, headers.get("content-encoding", "").strip().lower())
    content_type = headers.get("content-type", "")
    parts: dict[str, bytes] = {}
    if content_type.split(";")[0].strip() == "multipart/form-data":
        parts = _multipart(raw, content_type)
        if "request" not in parts:
            raise RequestError("a multipart request without its 'request' part")
        raw = parts.pop("request")
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as error:
        raise RequestError(f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object with 'state' and 'questions'")
    if "state" not in body:
        raise InvalidStateError("the request has no 'state'")
    assets = body.get("assets")
    if assets is not None:
        if not isinstance(assets, dict):
            raise InvalidAssetError("assets", "must map placeholders to asset objects")
        if not assets:
            raise RequestError("an empty 'assets': leave it out when the request sends no images")
        assets = {name: _asset(name, entry, parts) for name, entry in assets.items()}
    return SystemOneRequest(body["state"], body.get("questions"), assets)


def _asset(name: str, entry: Any, parts: Mapping[str, bytes]) -> Any:
    """An asset entry as the engine takes it: the bytes of the part it names (its format is read from them), else
    the entry itself (`data_base64`)."""
    if isinstance(entry, dict) and entry.get("part") is not None:
        if entry.get("type", "image") != "image":
            raise InvalidAssetError(name, f"asset type {entry.get('type')!r} is not served (only 'image')")
        data = parts.get(entry["part"])
        if data is None:
            raise InvalidAssetError(name, f"names the part {entry['part']!r}, which the request does not hold")
        return data
    return entry


class Transport:
    """An httpx2 transport (sync and async) answering the System One API from an engine in this process.

    Closing it (as a TypeSafe client does when it closes) leaves the engine open: the caller owns the engine.
    """

    def __init__(self, engine: Engine, *, queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S) -> None:
        self.engine = engine
        self.queue_timeout = queue_timeout

    # httpx2's AsyncBaseTransport
    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        await request.aread()
        route = self._route(request)
        if route is not None:
            return route
        try:
            body = decode_request(request.content, request.headers)
            answers = await self.engine.ask(body.state, body.questions, assets=body.assets,
                                            queue_timeout=self.queue_timeout)
        except Exception as error:  # every failure becomes the HTTP error a client maps to its exception
            return self._error(request, error)
        return self._answers(request, answers)

    # httpx2's BaseTransport
    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        request.read()
        route = self._route(request)
        if route is not None:
            return route
        try:
            body = decode_request(request.content, request.headers)
            answers = self.engine.ask_sync(body.state, body.questions, assets=body.assets,
                                           queue_timeout=self.queue_timeout)
        except Exception as error:  # every failure becomes the HTTP error a client maps to its exception
            return self._error(request, error)
        return self._answers(request, answers)

    def _route(self, request: httpx2.Request) -> httpx2.Response | None:
        """The response of every request that is not a System One call; None for `POST /v1/systemone`."""
        path = request.url.path.rstrip("/")
        if path.endswith(SYSTEM_ONE_PATH):
            return None if request.method == "POST" else self._json(request, 405, {"detail": "Method Not Allowed"})
        if path.endswith(MODELS_PATH):
            if request.method != "GET":
                return self._json(request, 405, {"detail": "Method Not Allowed"})
            return self._json(request, 200, {"models": [self._model_metadata()]})
        return self._json(request, 404, {"detail": "Not Found"})

    def _model_metadata(self) -> dict[str, str]:
        return {
            "name": self.engine.name,
            "description": f"in-process flide_sdk engine: {self.engine!r}",
            "release_date": datetime.date.today().isoformat(),
        }

    def _answers(self, request: httpx2.Request, answers: SystemOneResponse) -> httpx2.Response:
        return self._json(request, 200, content=answers.to_json())

    def _error(self, request: httpx2.Request, error: Exception) -> httpx2.Response:
        status, body, headers = http_error(error)
        return self._json(request, status, body, headers)

    @staticmethod
    def _json(
        request: httpx2.Request,
        status: int,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        content: bytes | None = None,
    ) -> httpx2.Response:
        import httpx2

        return httpx2.Response(
            status,
            headers={
                "content-type": "application/json",
                "x-typesafe-request-id": f"local-{uuid.uuid4().hex}",
                **(headers or {}),
            },
            content=msgspec.json.encode(body) if content is None else content,
            request=request,
        )

    def close(self) -> None:
        """Nothing to release (the engine stays open)."""

    async def aclose(self) -> None:
        """Nothing to release (the engine stays open)."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Transport:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def transport(engine: Engine, *, queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S) -> Transport:
    """An in-process httpx2 transport for `TypeSafeClient` / `AsyncTypeSafeClient(transport=...)`.

    queue_timeout: seconds an ask may wait for room in a full engine queue before the request is answered
    429 (TypeSafe's rate-limit error, with `retry_after_ms`).
    """
    return Transport(engine, queue_timeout=queue_timeout)


def client(engine: Engine, *, queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S, **options: Any) -> Any:
    """A `typesafe_sdk.TypeSafeClient` answered by `engine` in this process (base URL `LOCAL_BASE_URL`, so its
    errors name the in-process endpoint). `options` go to the client (e.g. `retry`). Needs typesafe-sdk."""
    import typesafe_sdk

    options.setdefault("api_key", "local")
    return typesafe_sdk.TypeSafeClient(base_url=LOCAL_BASE_URL, transport=transport(engine, queue_timeout=queue_timeout),
                                       **options)


def async_client(engine: Engine, *, queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S, **options: Any) -> Any:
    """The `typesafe_sdk.AsyncTypeSafeClient` twin of `client`."""
    import typesafe_sdk

    options.setdefault("api_key", "local")
    return typesafe_sdk.AsyncTypeSafeClient(base_url=LOCAL_BASE_URL,
                                            transport=transport(engine, queue_timeout=queue_timeout), **options)
