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
A text with no such R near its end (a run of one symbol, CJK, long white space) gets a boundary proven at
token level instead (`TokenCuts`), so the mutable tail stays within TAIL_TOKENS: where the regex match is
fixed whatever follows, and inside the last piece where its BPE tokens cannot change
(`MergeTable.frontier`; the argument: docs/decisions/bounded-mutable-tail.md).
Full token blocks of BLOCK tokens are hashed as a chain (xxh3, each seeded with the previous hash), so a
checkpoint at m is found by hash, then confirmed by comparing tokens.
"""

from __future__ import annotations

import json
import logging
import threading
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash
from tokenizers import pre_tokenizers

from flide_sdk.errors import InvalidStateError
from flide_sdk.questions import UNENCODABLE_HINT, unencodable

if TYPE_CHECKING:
    from tokenizers import Tokenizer

LOG = logging.getLogger(__name__)
BLOCK = 64
# a longer mutable tail gets a token-level cut (TokenCuts): at most one BLOCK recomputed per ask, prose's bound
TAIL_TOKENS = 64
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

    def __init__(self, added_tokens: Sequence[str], tokenizer: Tokenizer | None = None) -> None:
        self.added = tuple(t for t in added_tokens if t)
        self.longest = max((len(t) for t in self.added), default=1)
        self.first_chars = {t[0] for t in self.added}
        self.tokens = None if tokenizer is None else TokenCuts(tokenizer, self)

    def token_cut(self, text: str) -> tuple[int, np.ndarray] | None:
        """The last stable boundary of `text` proven at token level (`TokenCuts.cut`), or None."""
        return None if self.tokens is None else self.tokens.cut(text)

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


def _nfc_starter(before: str, char: str) -> bool:
    """Whether NFC never joins `char` with `before` (text in NFC): combining class 0, no mark (every composition
    second of class 0 is a mark but the Hangul vowel and trailing jamo), assigned, and no Hangul syllable forms."""
    point, previous = ord(char), ord(before)
    if 0x1161 <= point <= 0x1175:  # a vowel jamo joins a leading one
        return not 0x1100 <= previous <= 0x1112
    if 0x11A8 <= point <= 0x11C2:  # a trailing jamo joins a syllable without one
        return not (0xAC00 <= previous <= 0xD7A3 and (previous - 0xAC00) % 28 == 0)
    return unicodedata.combining(char) == 0 and unicodedata.category(char) not in _NOT_STARTER


def _spaces(text: str) -> bool:
    return all(char in PATTERN_SPACE for char in text)


def _letter(char: str) -> bool:
    return unicodedata.category(char)[0] in "LM"


def _symbol(char: str) -> bool:
    """In the pattern's `[^\\s\\p{L}\\p{M}\\p{N}]` (unassigned and other code points left out: no cut next to them)."""
    return char not in PATTERN_SPACE and unicodedata.category(char) not in _NOT_SYMBOL


# the pattern's \s (Unicode White_Space; Python's isspace adds U+001C-U+001F), checked against the tokenizer in tests
PATTERN_SPACE = frozenset("\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | {
    chr(point) for point in range(0x2000, 0x200B)}
_LINE_BREAKS = "\r\n"
_NOT_STARTER = {"Mn", "Mc", "Me", "Cn", "Cs"}  # marks; unassigned (a later Unicode may make them marks); surrogates
_NOT_SYMBOL = {"Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Cn", "Cs"}
_NEVER = float("inf")


class MergeTable:
    """The merges of a byte-level BPE model, indexed for `frontier` (built once per tokenizer, on first use), and
    when each token is made: at its merge's rank, or for a merge out of rank order (one of its parts is made by a
    later merge) at once after its later part, before the next rank (`made_low` .. `made_high` bound it)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        state = json.loads(tokenizer.model.__getstate__())
        vocab: dict[str, int] = state["vocab"]
        pairs = [m.split(" ", 1) if isinstance(m, str) else m for m in state["merges"]]
        size = self.size = max(vocab.values()) + 1
        self.tokenizer = tokenizer
        left = np.fromiter((vocab[a] for a, _ in pairs), np.int64, len(pairs))
        right = np.fromiter((vocab[b] for _, b in pairs), np.int64, len(pairs))
        made = np.fromiter((vocab[a + b] for a, b in pairs), np.int64, len(pairs))
        rank = np.arange(len(pairs), dtype=np.float64)
        self.left, self.right_part = np.full(size, -1, np.int64), np.full(size, -1, np.int64)
        self.left[made], self.right_part[made] = left, right
        self.made_low, self.made_high = np.full(size, -1.0), np.full(size, -1.0)
        self.made_low[made] = self.made_high[made] = rank
        while True:
            parts_low = np.maximum(self.made_low[left], self.made_low[right])
            parts_high = np.maximum(self.made_high[left], self.made_high[right])
            late = rank <= parts_high
            low, high = np.where(late, parts_low, rank), np.where(late, np.floor(parts_high) + 0.5, rank)
            if np.array_equal(low, self.made_low[made]) and np.array_equal(high, self.made_high[made]):
                break
            self.made_low[made], self.made_high[made] = low, high
        self.out_of_order = int(late.sum())
        order = np.argsort(left * size + right, kind="stable")
        self.keys, self.rights, self.ranks = (left * size + right)[order], right[order], rank[order]
        self.length = np.zeros(size, np.int64)
        self.first = np.zeros(size, np.int64)
        for token, token_id in vocab.items():
            self.length[token_id], self.first[token_id] = len(token), ord(token[0])
        self.longest = int(self.length.max())
        self.unique = len(set(made.tolist())) == len(pairs)

    def _spine(self, token: int, death: float = _NEVER) -> list[tuple[int, int, float, float]]:
        """(node, its offset in `token`, the earliest it is made, the latest it is merged into its parent) down
        the right edge of `token`'s merge tree (`death`: that of `token` itself)."""
        nodes, start = [], 0
        while True:
            nodes.append((token, start, float(self.made_low[token]), death))
            if self.left[token] < 0:
                return nodes
            death = float(self.made_high[token])
            start += int(self.length[self.left[token]])
            token = int(self.right_part[token])

    def _first_merge(self, node: int, after: str, low: float, high: float) -> float:
        """The earliest time in (low, high) at which `node` may merge with a token that may start `after` (one
        that it starts with, or a longer one that starts with all of it), _NEVER if none."""
        if low >= high:
            return _NEVER
        start, stop = np.searchsorted(self.keys, [node * self.size, (node + 1) * self.size])
        rights, ranks = self.rights[start:stop], self.ranks[start:stop]
        if after:
            prefixes = [self.tokenizer.token_to_id(after[:n]) for n in range(1, min(self.longest, len(after)) + 1)]
            fits = np.isin(rights, [y for y in prefixes if y is not None])
            for i in np.flatnonzero((self.first[rights] == ord(after[0])) & (self.length[rights] > len(after))):
                fits[i] = self.tokenizer.id_to_token(int(rights[i])).startswith(after)
        else:
            fits = np.ones(len(rights), bool)
        # at its rank once both parts are made before it, else at once after the later part is made
        parts_high = np.maximum(self.made_high[rights], self.made_high[node])
        exact = ranks > parts_high
        earliest = np.where(exact, ranks, np.maximum(self.made_low[rights], self.made_low[node]))
        latest = np.where(exact, ranks, np.floor(parts_high) + 0.5)
        window = fits & (latest > low) & (earliest < high)
        return float(np.maximum(earliest[window], low).min()) if window.any() else _NEVER

    def _passes(self, token: int, word: str, start: int, since: float) -> float:
        """The earliest time after `since` at which a continuation of `word` may change `token` (at `start`, the
        last token before the frontier): a node on its right edge merges with what follows it; then, level by
        level up, the node's left sibling merges with what follows it or, when its parent is made at the latest,
        misses the partner it merges with. _NEVER if never."""
        spine = self._spine(token)
        end = start + int(self.length[token])
        earliest = _NEVER
        for level, (node, _, made, death) in enumerate(spine):
            moved = self._first_merge(node, word[end:], max(made, since), death)
            for parent, offset, _, _ in reversed(spine[:level]):
                if moved >= earliest:
                    break
                sibling_of = int(self.left[parent])
                split = start + offset + int(self.length[sibling_of])
                arrival = float(self.made_low[parent])
                for sibling, _, made, death in self._spine(sibling_of, float(self.made_high[parent])):
                    arrival = min(arrival, self._first_merge(sibling, word[split:], max(made, moved), death))
                moved = arrival
            earliest = min(earliest, moved)
        return earliest

    def frontier(self, word: str, ids: Sequence[int]) -> int | None:
        """Where the tokens `ids` of the BPE word `word` (byte-level characters) stop depending on what may
        follow: for every continuation c, BPE(word + c) starts with the tokens of `ids` that end at or before
        the returned offset (docs/decisions/bounded-mutable-tail.md gives the argument). None if `ids` are not
        tokens of `word`."""
        ids = np.asarray(ids, np.int64)
        starts = np.concatenate([[0], np.cumsum(self.length[ids])])
        if starts[-1] != len(word):
            return None
        since = -1.0  # the earliest time at which the frontier may pass the token before it
        for index in range(len(ids) - 1, -1, -1):
            since = self._passes(int(ids[index]), word, int(starts[index]), since)
            if since == _NEVER:
                return int(starts[index + 1])
        return 0


class TokenCuts:
    """Stable boundaries proven at token level, for text that has no character-class boundary near its end
    (a run of one symbol, base64, CJK without spaces, long white space): `cut(text)` returns the last one."""

    def __init__(self, tokenizer: Tokenizer, boundaries: BoundaryFinder) -> None:
        from flide_sdk.text.word_cache import byte_level_chars, supported  # word_cache imports this module

        model = tokenizer.model
        self.enabled = (
            supported(tokenizer)
            and not model.ignore_merges
            and not model.byte_fallback
            and not model.continuing_subword_prefix
            and not model.end_of_word_suffix
            and set(byte_level_chars()) == set(pre_tokenizers.ByteLevel.alphabet())
        )
        self.tokenizer = tokenizer
        self.boundaries = boundaries
        self._bytes = dict(enumerate(byte_level_chars()))  # for str.translate of a text's bytes as Latin-1
        self._added_ids = set(tokenizer.get_added_tokens_decoder())
        self._table: MergeTable | None = None
        self._lock = threading.Lock()
        self.refuted = 0  # cuts whose tokens were not the whole text's (History checks each): never, by the argument

    @property
    def table(self) -> MergeTable:
        with self._lock:
            if self._table is None:
                self._table = MergeTable(self.tokenizer)
                self.enabled = self.enabled and self._table.unique
            return self._table

    def known_end(self, text: str) -> int:
        """How much of `text` later text cannot change: up to its last NFC starter, and before any added token
        that later text could complete (or lengthen)."""
        end = len(text) - 1
        while end > 0 and not _nfc_starter(text[end - 1], text[end]):
            end -= 1
        for token in self.boundaries.added:
            for size in range(min(len(token) - 1, len(text)), 0, -1):
                if text.endswith(token[:size]):
                    end = min(end, len(text) - size)
                    break
        return max(end, 0)

    def cut(self, text: str) -> tuple[int, np.ndarray] | None:
        """The last stable boundary R of `text` (text[0] starts a regex piece and a BPE word whatever follows)
        past 0, with the token ids of text[:R], or None."""
        return next(self.cuts(text), None)

    def cuts(self, text: str) -> Iterator[tuple[int, np.ndarray]]:
        """The stable boundaries of `text` past 0 that this proves, last first, each with the ids of text[:R]:
        where the regex match of every piece before it is fixed whatever follows, and, inside the first piece
        that is not, where its tokens before it are (the open word's frontier)."""
        if not self.enabled:
            return
        table = self.table
        known = self.known_end(text)
        head = text[:known]
        if known < 2 or not self.enabled or not unicodedata.is_normalized("NFC", head):
            return
        encoding = self.tokenizer.encode(head, add_special_tokens=False)
        ids = np.asarray(encoding.ids, np.int64)
        offsets = encoding.offsets
        pieces = _pieces(encoding.word_ids, offsets)
        settled = 0  # pieces fixed whatever follows: their regex match read nothing past `head`
        while settled < len(pieces):
            start, end, first, _ = pieces[settled]
            if not (len(ids) > first and int(ids[first]) in self._added_ids) and _reads_to(head, start, end) >= known:
                break
            settled += 1
        if settled < len(pieces):
            start, end, first, stop = pieces[settled]
            for cut, word_ids in self._open_cuts(head, start, end, ids[first:stop], table):
                if self._boundary(text, cut):
                    yield cut, np.concatenate([ids[:first], word_ids])
        else:
            start, first = known, len(ids)
        if start > 0 and self._boundary(text, start):
            yield start, ids[:first]
        for index in range(settled - 1, -1, -1):
            start, end, first, stop = pieces[index]
            kind = _kind(head[start:end])
            for token in range(stop - 1, first, -1):
                cut = offsets[token][0]
                if offsets[token - 1][1] == cut and _inside(head, start, end, cut, kind) and self._boundary(text, cut):
                    yield cut, ids[:token]
            if start > 0 and self._boundary(text, start):
                yield start, ids[:first]

    def _boundary(self, text: str, position: int) -> bool:
        return _nfc_starter(text[position - 1], text[position]) and not self.boundaries._inside_added(text, position)

    def _word(self, text: str, start: int, open_word: bool, table: MergeTable, ids: np.ndarray | None = None) -> _Word:
        """`text` (at `start` in the whole text) taken as one BPE word (`ids`: its tokens, when known): its
        tokens, and where they may be cut: at every token boundary between characters of a complete word, at
        those up to the frontier of an open one (a word that later text may extend)."""
        word = text.encode().decode("latin-1").translate(self._bytes)
        if ids is None:
            ids = np.array([token.id for token in self.tokenizer.model.tokenize(word)], np.int64)
        limit = table.frontier(word, ids) if open_word else len(word)
        if text.isascii():
            char_at = np.arange(len(text) + 1)
        else:  # UTF-8 bytes before each character
            points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
            char_at = np.concatenate([[0], np.cumsum(1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000))])
        token_at = np.concatenate([[0], np.cumsum(table.length[ids])])
        if limit is None:
            return _Word(ids, {})
        shared = np.intersect1d(token_at[token_at <= limit], char_at, assume_unique=True)
        counts = np.searchsorted(token_at, shared)
        chars = np.searchsorted(char_at, shared)
        return _Word(ids, dict(zip((start + chars).tolist(), counts.tolist())))

    def _open_cuts(self, head: str, start: int, end: int, ids: np.ndarray,
                   table: MergeTable) -> Iterator[tuple[int, np.ndarray]]:
        """Cuts inside the piece head[start:end] (its tokens `ids`), the first that later text may still change
        (the open word), last first, with the tokens from its start to each."""
        known = len(head)
        kind = _kind(head[start:end])
        if kind in ("letter", "symbol"):
            if end == known:
                word = self._word(head[start:], start, True, table, ids)
                yield from word.cuts(lambda cut: _inside(head, start, end, cut, kind))
            return
        if kind != "space" or not _spaces(head[start:]):
            return
        breaks = [i for i in range(start, known) if head[i] in _LINE_BREAKS]
        if not breaks:  # spaces only: later text keeps at least all but the last one in this piece
            word = self._word(head[start : known - 1], start, True, table)
            yield from word.cuts(lambda cut: _inside(head, start, known - 1, cut, kind))
            return
        whole = self._word(head[start:], start, True, table)  # a later line break in the run makes it one word
        if breaks[-1] == known - 1:
            yield from whole.cuts(lambda cut: _inside(head, start, known, cut, kind))
            return
        # else the run is, whatever follows, either one word up to a later line break, or two: up to its last
        # line break and the spaces after it; a cut must be one of both, with the same tokens before it
        lines = self._word(head[start : breaks[-1] + 1], start, False, table)
        spaces = self._word(head[breaks[-1] + 1 : known - 1], breaks[-1] + 1, True, table)
        for cut, before in whole.cuts(lambda cut: _inside(head, start, known, cut, kind)):
            if cut <= breaks[-1] + 1:
                other = lines.before(cut)
            else:
                other = spaces.before(cut)
                other = None if other is None else np.concatenate([lines.ids, other])
            if other is not None and np.array_equal(other, before):
                yield cut, before


@dataclass(frozen=True)
class _Word:
    ids: np.ndarray
    counts: dict[int, int]  # cut position -> tokens before it

    def before(self, cut: int) -> np.ndarray | None:
        count = self.counts.get(cut)
        return None if count is None else self.ids[:count]

    def cuts(self, allowed: Callable[[int], bool]) -> Iterator[tuple[int, np.ndarray]]:
        for cut in sorted(self.counts, reverse=True):
            if allowed(cut):
                yield cut, self.ids[: self.counts[cut]]


def _pieces(word_ids: Sequence[int | None], offsets: Sequence[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """(start, end, first token, end token) of each regex piece (added tokens included) of an encoding."""
    pieces = []
    for index, word in enumerate(word_ids):
        if index and word is not None and word == word_ids[index - 1]:
            start, _, first, _ = pieces[-1]
            pieces[-1] = (start, offsets[index][1], first, index + 1)
        else:
            pieces.append((offsets[index][0], offsets[index][1], index, index + 1))
    return pieces


def _reads_to(text: str, start: int, end: int) -> int:
    """The last position the pattern's match of the piece text[start:end] looks at (the character that ends
    its run, the two its alternatives try first, a white-space run to its end)."""
    reach = max(end, start + 2)
    if text[start] in PATTERN_SPACE:
        run = start
        while run < len(text) and text[run] in PATTERN_SPACE:
            run += 1
        reach = max(reach, run)
    return reach


def _kind(piece: str) -> str:
    if _spaces(piece):
        return "space"
    if len(piece) > 1 and all(map(_letter, piece[1:])):
        return "letter"
    if not any(unicodedata.category(c)[0] in "LMN" for c in piece):
        return "symbol"
    return "other"


def _inside(text: str, start: int, end: int, cut: int, kind: str) -> bool:
    """Whether the pattern, run on text[cut:] and whatever follows, matches text[cut:end] (and on, as the
    piece text[start:end] extends) first: the piece's run goes on across the cut, and no alternative tried
    before it can match at the cut."""
    if not start < cut < end:
        return False
    if kind == "letter":  # a letter starts no contraction or symbol-led match; cuts past a contraction's length
        return cut >= start + 4 and _letter(text[cut - 1]) and unicodedata.category(text[cut])[0] == "L"
    if kind == "symbol":  # a symbol before it and two after: no letter run or contraction begins at the cut
        return cut + 1 < len(text) and all(map(_symbol, text[cut - 1 : cut + 2]))
    if kind == "space":  # no letter or symbol follows the cut's first character, so a white-space alternative
        return (text[cut - 1] in PATTERN_SPACE and text[cut] in PATTERN_SPACE
                and (text[cut] in _LINE_BREAKS or cut + 1 < len(text) and text[cut + 1] in PATTERN_SPACE))
    return False


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
        self._token_cut_at = 0  # appended_chars from which a token-level cut is tried again after one failed

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
        if len(ids) - stable_count > TAIL_TOKENS and self.appended_chars >= self._token_cut_at:
            relative, stable_count = self._token_cut(body, relative, ids, stable_count)
        previous = self.buffer.size
        if stable_count:
            found = len(self._lookbehind) + relative
            self._pending = body[relative:]
            self._lookbehind = text[max(0, found - self._boundaries.longest) : found]
            self.buffer.extend(ids[:stable_count])
            unhashed = self.buffer.view(len(self.hashes) * BLOCK)
            self.hashes.extend(chain_hashes(unhashed, self.hashes[-1] if self.hashes else HASH_SEED))
        tail = ids[stable_count:]
        tail.flags.writeable = False
        return Trunk(self.buffer.view(), tail, self.hashes, self.buffer, self.buffer.size + len(tail) - previous)

    def _token_cut(self, body: str, relative: int, ids: np.ndarray, stable_count: int) -> tuple[int, int]:
        """Move the boundary (`relative` in `body`, `stable_count` tokens) to the last token-level cut of the
        tail, once the tokens on both sides of it are those of the whole text (checked here); after a failure,
        try again once the text after the boundary has doubled (so the attempts cost linear time in all)."""
        rest = body[relative:]
        found = self._boundaries.token_cut(rest)
        if found is not None:
            cut, before = found
            end = stable_count + len(before)
            after, _ = self._encode(rest[cut:] + self._closer + SEPARATOR, 0)
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
        return other
