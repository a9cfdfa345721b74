"""Token history of a growing state: incremental tokenization at the stable boundary, chained block hashes.

The trunk text of a state is `head + body + closer + "\\n\\n"` where `head` opens the chat template's user
turn, `body` only ever grows (appended text, or `[` + messages joined by `, `) and `closer` is what a new
append replaces (`]` for a message list). Under a chat template that trims the user content (`trims`, Gemma 4's),
the body's leading white space is dropped and the blank line follows only a body that holds text. Tokens before the stable boundary m (`cuts`: the last position where
the tokenization splits whatever is appended later) never change; the *mutable tail* after it (a word that may
continue, the closer, the blank line) is tokenized again at the next ask, so the host work of an append + ask
grows with the new text, not with the whole history. A tail past TAIL_TOKENS gets a token-level cut
(`cuts.TokenCuts`), checked here on the current text before it is taken.
Full token blocks of BLOCK tokens are hashed as a chain (xxh3, each seeded with the previous hash), so a
checkpoint at m is found by hash, then confirmed by comparing tokens. An image's pads are the same tokens for any
image of its size: its digest is chained into the hash of the block holding its first pad, and compared with the
tokens, so a checkpoint serves only the same images.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import xxhash

from flide_sdk.errors import InvalidAssetError, InvalidStateError
from flide_sdk.questions import UNENCODABLE_HINT, check_nesting, unencodable
from flide_sdk.text.cuts import BoundaryFinder

if TYPE_CHECKING:
    from flide_sdk.images import DecodedImage
    from flide_sdk.plan.images import TrunkImages

LOG = logging.getLogger(__name__)
BLOCK = 64
# a longer mutable tail gets a token-level cut (TokenCuts): at most one BLOCK recomputed per ask, prose's bound
TAIL_TOKENS = 64
HASH_SEED = 0x5EED_F11D
SEPARATOR = "\n\n"

Encoder = Callable[[str, int], tuple[np.ndarray, int]]
"""(text, cut) -> (token ids of text, how many of them encode text[:cut]); cut is 0 or a stable boundary."""


class ImageText(Protocol):
    """An append's images, as a prompt format places them (`prompt.images.RequestImages`)."""

    def split(self, text: str) -> list[str | int]:
        """`text` cut at placeholders: text pieces, and the index of each image found."""

    def image(self, index: int) -> tuple[np.ndarray, bytes, Any]:
        """Image `index`'s token ids, its digest, and what the format keeps of it (`History.image_builder`)."""


class TokenBuffer:
    """An append-only, growable array of token ids; views of it stay valid as it grows."""

    def __init__(self, capacity: int = 256) -> None:
        self._data = np.empty(capacity, dtype=np.int64)
        self.size = 0
        self.images: list[tuple[int, bytes]] = []  # (first pad, digest) of each image in the buffer, in order
        self.shared_upto = 0  # tokens [0, shared_upto) are also a fork's: checkpoints up to there may serve it

    def extend(self, ids: np.ndarray) -> None:
        needed = self.size + len(ids)
        if needed > len(self._data):
            grown = np.empty(max(needed, 2 * len(self._data)), dtype=np.int64)
            grown[: self.size] = self._data[: self.size]
            self._data = grown
        self._data[self.size : needed] = ids
        self.size = needed

    def view(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        view = self._data[start : self.size if stop is None else stop]
        view.flags.writeable = False
        return view

    def copy(self) -> TokenBuffer:
        other = TokenBuffer(max(256, self.size))
        other.extend(self._data[: self.size])
        other.images = list(self.images)
        return other

    def marks(self, length: int) -> list[tuple[int, bytes]]:
        """(first pad, digest) of the images starting before `length`."""
        return [mark for mark in self.images if mark[0] < length]


def chain_hashes(tokens: np.ndarray, previous: int = HASH_SEED, marks: Sequence[tuple[int, bytes]] = (),
                 offset: int = 0) -> list[int]:
    """Chained xxh3 hashes of the full BLOCK-token blocks of `tokens` (whose first is at index `offset`),
    continuing from `previous`; the digest of each image of `marks` (first pad, digest) chained after the block
    holding its first pad."""
    hashes = []
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        previous = xxhash.xxh3_64_intdigest(tokens[start : start + BLOCK].tobytes(), seed=previous)
        for at, digest in marks:
            if offset + start <= at < offset + start + BLOCK:
                previous = xxhash.xxh3_64_intdigest(digest, seed=previous)
        hashes.append(previous)
    return hashes


@dataclass(frozen=True)
class Trunk:
    """The trunk of one ask: `stable` (tokens before the boundary m, a view of its history's buffer),
    `tail` (the mutable tail), the block hashes of the stable part, the buffer it lives in, and its images (their
    pads, digests and patches; None: text only)."""

    stable: np.ndarray
    tail: np.ndarray
    hashes: Sequence[int]  # append-only; hashes[b] covers blocks [0, b] (only b < boundary // BLOCK is read)
    buffer: TokenBuffer
    fresh: int  # tokens not in the stable part of the history's previous snapshot (a cost estimate)
    images: TrunkImages | None = None

    @property
    def boundary(self) -> int:
        return len(self.stable)

    def __len__(self) -> int:
        return len(self.stable) + len(self.tail)

    def tokens(self, start: int = 0) -> np.ndarray:
        """Token ids from `start` to the end (copies only the part after `start`)."""
        if start >= len(self.stable):
            return self.tail[start - len(self.stable) :]
        return np.concatenate([self.stable[start:], self.tail])

    def block_hash(self, blocks: int) -> int:
        """Chained hash of the first `blocks` full blocks (computed on demand past the stable part)."""
        if blocks == 0:
            return HASH_SEED
        start = len(self.stable) // BLOCK
        if blocks <= start:
            return self.hashes[blocks - 1]
        extra = chain_hashes(self.tokens(start * BLOCK)[: (blocks - start) * BLOCK], self.block_hash(start),
                             self.marks(len(self)), start * BLOCK)
        return extra[blocks - start - 1]

    def marks(self, length: int) -> list[tuple[int, bytes]]:
        """(first pad, digest) of this trunk's images starting before `length`."""
        return [] if self.images is None else self.images.marks(length)

    def prefix_equals(self, buffer: TokenBuffer, length: int) -> bool:
        """Whether tokens [0, length) of this trunk equal those of `buffer`, and so do the images among them
        (same buffer: by construction)."""
        if length > len(self):
            return False
        if buffer is self.buffer and length <= len(self.stable):
            return True
        ours = self.tokens()[:length] if length > len(self.stable) else self.stable[:length]
        return bool(np.array_equal(ours, buffer.view(0, length))) and self.marks(length) == buffer.marks(length)


def prompt_text(value: Any, what: str = "the state") -> str:
    """`value` as it appears in a prompt: a string as is, anything else as JSON. InvalidStateError naming `what`
    when it is not JSON-serializable, nests deeper than `questions.MAX_NESTING` or holds a lone surrogate, which no
    tokenizer can encode."""
    if isinstance(value, str):
        text = value
    else:
        check_nesting(value, what)
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as error:
            raise InvalidStateError(f"{what} must be a string or JSON-serializable: {error}") from None
    found = unencodable(value, text)
    if found is not None:
        raise InvalidStateError(f"{what} holds a lone surrogate{found}; {UNENCODABLE_HINT}")
    return text


def plain(value: Any) -> str:
    """A value as a template prints it: nothing for None, else as `prompt_text` does."""
    return "" if value is None else prompt_text(value)


def check_append(kind: str | None, item: Any) -> tuple[str, str]:
    """(the kind a session's state has after appending `item` to one of `kind`, the item's prompt text);
    InvalidStateError for an item of the other kind, or neither text nor a message dict."""
    if isinstance(item, str):
        if kind == "messages":
            raise InvalidStateError("this session holds messages; append a dict with 'role' and 'content'")
        return "text", prompt_text(item, "the appended text")
    if not isinstance(item, dict) or "role" not in item or "content" not in item:
        raise InvalidStateError("append a string, or a message dict with 'role' and 'content'")
    if kind == "text":
        raise InvalidStateError("this session holds text; append strings, not messages")
    return "messages", prompt_text(item, "the message")


class StateLog:
    """A session's state kept whole (its text, or its list of messages), for a decision model's prompt, which
    prints the state inside its own template: every ask renders it again (`snapshot` is the state, `assets` the
    images appended so far, by placeholder)."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.items: list[Any] = []
        self.assets: dict[str, DecodedImage] = {}

    def append(self, item: str | dict[str, Any], assets: dict[str, DecodedImage] | None = None) -> None:
        kind, _ = check_append(self.kind, item)
        for name, image in (assets or {}).items():
            known = self.assets.get(name)
            if known is not None and known.digest != image.digest:
                raise InvalidAssetError(name, "this placeholder already names another image in this session")
        self.kind = kind
        self.items.append(item if isinstance(item, str) else dict(item))
        self.assets.update(assets or {})

    def snapshot(self) -> str | list[dict[str, Any]]:
        return list(self.items) if self.kind == "messages" else "".join(self.items)

    def fork(self) -> StateLog:
        other = StateLog()
        other.kind, other.items, other.assets = self.kind, list(self.items), dict(self.assets)
        return other


class History:
    """A state that grows by appends, tokenized incrementally; `snapshot()` gives the trunk of an ask."""

    def __init__(self, head: str, encode: Encoder, boundaries: BoundaryFinder, trims: bool = False) -> None:
        self._encode = encode
        self._boundaries = boundaries
        self.kind: str | None = None  # "text" or "messages", fixed by the first append
        self.buffer = TokenBuffer()
        self.hashes: list[int] = []
        self._pending = head  # text after the stable boundary, up to the end of the body
        self._lookbehind = ""  # the last characters before the stable boundary
        self._closer = ""
        self._trims = trims  # the template trims the content: no leading white space, no blank line after nothing
        self._separator = "" if trims else SEPARATOR
        self.appended_chars = 0
        self._token_cut_at = 0  # appended_chars from which a token-level cut is tried again after one failed
        self.images: list[tuple[int, Any]] = []  # (first pad, what the format keeps) of each image appended
        self._snapshotted = 0  # the buffer's size at the last snapshot
        # the trunk's images from `images` (set by a format that places images; None: text only)
        self.image_builder: Callable[[list[tuple[int, Any]]], TrunkImages] | None = None

    @classmethod
    def of_state(cls, head: str, state_body: str, encode: Encoder, boundaries: BoundaryFinder,
                 trims: bool = False) -> History:
        history = cls(head, encode, boundaries, trims)
        history._add(state_body)
        history.kind = "state"
        return history

    def append(self, item: str | dict[str, Any], images: ImageText | None = None) -> None:
        """Append text (concatenated) or a message dict with `role` and `content` (the state is then a list);
        `images`: the images its text names, spliced in as their tokens."""
        kind, encoded = check_append(self.kind, item)
        if kind == "text":
            piece = item
        else:
            piece = ("[" if self.kind is None else ", ") + encoded
            self._closer = "]"
        self.kind = kind
        if images is None or self.image_builder is None:
            self._add(piece)
            return
        for part in images.split(piece):
            if isinstance(part, str):
                self._add(part)
            else:
                self._add_image(*images.image(part))

    def _add_image(self, ids: np.ndarray, digest: bytes, kept: Any) -> None:
        """The text so far encoded whole (an image's first token is an added one: the tokenizer splits there),
        then the image's tokens, stable at once."""
        if self._trims and not self.appended_chars:
            self._separator = SEPARATOR  # an image is content
        self.appended_chars += 1
        if self._pending:
            self.buffer.extend(self._encode(self._pending, 0)[0])
        self.buffer.images.append((self.buffer.size + 1, digest))  # after the image's start token
        self.images.append((self.buffer.size + 1, kept))
        self.buffer.extend(ids)
        self._pending, self._lookbehind = "", ""
        self._hash()

    def _hash(self) -> None:
        unhashed = self.buffer.view(len(self.hashes) * BLOCK)
        self.hashes.extend(chain_hashes(unhashed, self.hashes[-1] if self.hashes else HASH_SEED, self.buffer.images,
                                        len(self.hashes) * BLOCK))

    def _add(self, text: str) -> None:
        if self._trims and not self.appended_chars:
            text = text.lstrip()  # as Jinja's `trim`, Python's white space
            if text:
                self._separator = SEPARATOR
        self._pending += text
        self.appended_chars += len(text)

    def snapshot(self) -> Trunk:
        """Tokenize the tail, advance the stable boundary, and return the trunk of an ask made now."""
        body = self._pending
        text = self._lookbehind + body
        found = self._boundaries.last(text, len(self._lookbehind) + 1)
        relative = 0 if found is None else found - len(self._lookbehind)
        ids, stable_count = self._encode(body + self._closer + self._separator, relative)
        if len(ids) - stable_count > TAIL_TOKENS and self.appended_chars >= self._token_cut_at:
            relative, stable_count = self._token_cut(body, relative, ids, stable_count)
        previous = self._snapshotted
        if stable_count:
            found = len(self._lookbehind) + relative
            self._pending = body[relative:]
            self._lookbehind = text[max(0, found - self._boundaries.longest) : found]
            self.buffer.extend(ids[:stable_count])
            self._hash()
        tail = ids[stable_count:]
        tail.flags.writeable = False
        images = self.image_builder(list(self.images)) if self.images and self.image_builder else None
        self._snapshotted = self.buffer.size
        return Trunk(self.buffer.view(), tail, self.hashes, self.buffer, self.buffer.size + len(tail) - previous,
                     images)

    def _token_cut(self, body: str, relative: int, ids: np.ndarray, stable_count: int) -> tuple[int, int]:
        """Move the boundary (`relative` in `body`, `stable_count` tokens) to the last token-level cut of the
        tail, once the tokens on both sides of it are those of the whole text (checked here); after a failure,
        try again once the text after the boundary has doubled (so the attempts cost linear time in all)."""
        rest = body[relative:]
        found = self._boundaries.token_cut(rest)
        if found is not None:
            cut, before = found
            end = stable_count + len(before)
            after, _ = self._encode(rest[cut:] + self._closer + self._separator, 0)
            if np.array_equal(ids[stable_count:end], before) and np.array_equal(ids[end:], after):
                return relative + cut, end
            self._boundaries.tokens.refuted += 1
            LOG.warning("a token-level cut was refuted by the tokenizer; the tail stays as it is")
        self._token_cut_at = self.appended_chars + len(rest)
        return relative, stable_count

    def fork(self) -> History:
        """An independent copy with the same history (the token buffer is copied once)."""
        other = History.__new__(History)
        other.__dict__.update(self.__dict__)
        self.buffer.shared_upto = self.buffer.size
        other.buffer = self.buffer.copy()
        other.buffer.shared_upto = other.buffer.size
        other.hashes = list(self.hashes)
        other.images = list(self.images)
        return other
