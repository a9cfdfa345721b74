"""Token history of a growing state: incremental tokenization, chained block hashes, the stable boundary.

The trunk text of a state is `head + body + closer + "\\n\\n"` where `head` opens the chat template's user
turn, `body` only ever grows (appended text, or `[` + messages joined by `, `) and `closer` is what a new
append replaces (`]` for a message list). The *stable boundary* m is the last position where the
tokenization splits whatever is appended later; tokens before it never change, tokens after it (the
*mutable tail*: a word that may continue, the closer, the blank line) are tokenized again at the next ask.
So the host work of an append + ask grows with the new text, not with the whole history.

Why a boundary is stable: with the Qwen3.5 pre-tokenizer (a regex split, then byte-level BPE inside each
piece) no piece crosses position R, and the pieces before R do not depend on anything after R, when
(a) text[R-1] is a newline and text[R] is not white space, (b) text[R-1] is a letter or mark and text[R] is
neither, or (c) text[R-1] is a digit (always a piece of its own) and text[R] is not a mark; and no added
token (complete, or completable by later text) spans R. `Renderer` refuses other pre-tokenizers.
Full token blocks of BLOCK tokens are hashed as a chain (xxh3, each seeded with the previous hash), so a
checkpoint at m is found by hash, then confirmed by comparing tokens.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from flide_sdk.errors import InvalidStateError
from flide_sdk.questions import UNENCODABLE_HINT, unencodable

BLOCK = 64
HASH_SEED = 0x5EED_F11D
SEPARATOR = "\n\n"
QWEN_PRETOKENIZER_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

Encoder = Callable[[str, int], tuple[np.ndarray, int]]
"""(text, cut) -> (token ids of text, how many of them encode text[:cut]); cut is 0 or a stable boundary."""


class TokenBuffer:
    """An append-only, growable array of token ids; views of it stay valid as it grows."""

    def __init__(self, capacity: int = 256) -> None:
        self._data = np.empty(capacity, dtype=np.int64)
        self.size = 0
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
        return other


def chain_hashes(tokens: np.ndarray, previous: int = HASH_SEED) -> list[int]:
    """Chained xxh3 hashes of the full BLOCK-token blocks of `tokens`, continuing from `previous`."""
    hashes = []
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        previous = xxhash.xxh3_64_intdigest(tokens[start : start + BLOCK].tobytes(), seed=previous)
        hashes.append(previous)
    return hashes


@dataclass(frozen=True)
class Trunk:
    """The trunk of one ask: `stable` (tokens before the boundary m, a view of its history's buffer),
    `tail` (the mutable tail), the block hashes of the stable part, and the buffer it lives in."""

    stable: np.ndarray
    tail: np.ndarray
    hashes: Sequence[int]  # append-only; hashes[b] covers blocks [0, b] (only b < boundary // BLOCK is read)
    buffer: TokenBuffer
    fresh: int  # tokens not in the stable part of the history's previous snapshot (a cost estimate)

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
        extra = chain_hashes(self.tokens(start * BLOCK)[: (blocks - start) * BLOCK], self.block_hash(start))
        return extra[blocks - start - 1]

    def prefix_equals(self, buffer: TokenBuffer, length: int) -> bool:
        """Whether tokens [0, length) of this trunk equal those of `buffer` (same buffer: by construction)."""
        if length > len(self):
            return False
        if buffer is self.buffer and length <= len(self.stable):
            return True
        ours = self.tokens()[:length] if length > len(self.stable) else self.stable[:length]
        return bool(np.array_equal(ours, buffer.view(0, length)))


def _splits(before: str, after: str) -> bool:
    if before == "\n":
        return not after.isspace()
    kind_before, kind_after = unicodedata.category(before)[0], unicodedata.category(after)[0]
    if kind_before in "LM":
        return kind_after not in "LM"
    return kind_before == "N" and kind_after != "M"


class BoundaryFinder:
    """Finds stable boundaries for the Qwen3.5 pre-tokenizer, given the tokenizer's added tokens."""

    def __init__(self, added_tokens: Sequence[str]) -> None:
        self.added = tuple(t for t in added_tokens if t)
        self.longest = max((len(t) for t in self.added), default=1)
        self.first_chars = {t[0] for t in self.added}

    def _inside_added(self, text: str, position: int) -> bool:
        for start in range(max(0, position - self.longest + 1), position):
            if text[start] not in self.first_chars:
                continue
            for token in self.added:
                if start + len(token) > position and token.startswith(text[start : start + len(token)]):
                    return True
        return False

    def cuts(self, text: str, every: int, search: int = 256) -> list[int]:
        """Stable boundaries about `every` characters apart (each the last one at or before its target),
        where `text` can be encoded in independent pieces: the pieces' tokens are the whole text's."""
        found: list[int] = []
        for target in range(every, len(text) - every // 2, every):
            low = max(target - search, found[-1] + 1 if found else 1)
            cut = self.last(text[: target + 1], low)
            if cut is not None:
                found.append(cut)
        return found

    def last(self, text: str, low: int) -> int | None:
        """Largest R in [low, len(text) - 1] that is a stable boundary of `text`, or None."""
        for position in range(len(text) - 1, max(low, 1) - 1, -1):
            if _splits(text[position - 1], text[position]) and not self._inside_added(text, position):
                return position
        return None


class History:
    """A state that grows by appends, tokenized incrementally; `snapshot()` gives the trunk of an ask."""

    def __init__(self, head: str, encode: Encoder, boundaries: BoundaryFinder) -> None:
        self._encode = encode
        self._boundaries = boundaries
        self.kind: str | None = None  # "text" or "messages", fixed by the first append
        self.buffer = TokenBuffer()
        self.hashes: list[int] = []
        self._pending = head  # text after the stable boundary, up to the end of the body
        self._lookbehind = ""  # the last characters before the stable boundary
        self._closer = ""
        self.appended_chars = 0

    @classmethod
    def of_state(cls, head: str, state_body: str, encode: Encoder, boundaries: BoundaryFinder) -> History:
        history = cls(head, encode, boundaries)
        history._pending += state_body
        history.kind = "state"
        return history

    def append(self, item: str | dict[str, Any]) -> None:
        """Append text (concatenated) or a message dict with `role` and `content` (the state is then a list)."""
        if isinstance(item, str):
            if self.kind == "messages":
                raise InvalidStateError("this session holds messages; append a dict with 'role' and 'content'")
            found = unencodable(item)
            if found is not None:
                raise InvalidStateError(f"the appended text holds a lone surrogate{found}; {UNENCODABLE_HINT}")
            self.kind = "text"
            self._pending += item
            self.appended_chars += len(item)
            return
        if not isinstance(item, dict) or "role" not in item or "content" not in item:
            raise InvalidStateError("append a string, or a message dict with 'role' and 'content'")
        if self.kind == "text":
            raise InvalidStateError("this session holds text; append strings, not messages")
        try:
            encoded = json.dumps(item, ensure_ascii=False)
        except (TypeError, ValueError) as error:
            raise InvalidStateError(f"the message is not JSON-serializable: {error}") from None
        found = unencodable(item, encoded)
        if found is not None:
            raise InvalidStateError(f"the message holds a lone surrogate{found}; {UNENCODABLE_HINT}")
        piece = ("[" if self.kind is None else ", ") + encoded
        self.kind = "messages"
        self._closer = "]"
        self._pending += piece
        self.appended_chars += len(piece)

    def snapshot(self) -> Trunk:
        """Tokenize the tail, advance the stable boundary, and return the trunk of an ask made now."""
        body = self._pending
        text = self._lookbehind + body
        found = self._boundaries.last(text, len(self._lookbehind) + 1)
        relative = 0 if found is None else found - len(self._lookbehind)
        ids, stable_count = self._encode(body + self._closer + SEPARATOR, relative)
        previous = self.buffer.size
        if stable_count:
            self._pending = body[relative:]
            self._lookbehind = text[max(0, found - self._boundaries.longest) : found]
            self.buffer.extend(ids[:stable_count])
            unhashed = self.buffer.view(len(self.hashes) * BLOCK)
            self.hashes.extend(chain_hashes(unhashed, self.hashes[-1] if self.hashes else HASH_SEED))
        tail = ids[stable_count:]
        tail.flags.writeable = False
        return Trunk(self.buffer.view(), tail, self.hashes, self.buffer, self.buffer.size + len(tail) - previous)

    def fork(self) -> History:
        """An independent copy with the same history (the token buffer is copied once)."""
        other = History.__new__(History)
        other.__dict__.update(self.__dict__)
        self.buffer.shared_upto = self.buffer.size
        other.buffer = self.buffer.copy()
        other.buffer.shared_upto = other.buffer.size
        other.hashes = list(self.hashes)
        return other
