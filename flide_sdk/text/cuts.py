"""Stable boundaries for the Qwen3.5 pre-tokenizer: positions R of a text where whatever is appended later leaves
the tokens before R unchanged, so a growing history is tokenized again only after its last one.

Character level (`BoundaryFinder`): with the Qwen3.5 pre-tokenizer (a regex split, then byte-level BPE inside each
piece) no piece crosses position R, and the pieces before R do not depend on anything after R, when
(a) text[R-1] is a newline and text[R] is not white space, (b) text[R-1] is a letter or mark and text[R] is
neither, or (c) text[R-1] is a digit (always a piece of its own) and text[R] is not a mark; and no added
token (complete, or completable by later text) spans R. (SentencePiece-style BPE has its own rule:
`sentencepiece.SentencePieceBoundaries`; `Tokens` refuses other tokenizers.)
Token level (`TokenCuts`): a text with no such R near its end (a run of one symbol, CJK, long white space) gets
a boundary proven on its tokens instead: where the regex match is fixed whatever follows, and inside the last
piece where its BPE tokens cannot change (`merges.MergeTable.frontier`; the argument:
docs/decisions/bounded-mutable-tail.md).
"""

from __future__ import annotations

import threading
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from tokenizers import pre_tokenizers

from flide_sdk.text.merges import MergeTable
from flide_sdk.text.pretokenizer import PATTERN_SPACE, byte_level_chars, supported

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_LINE_BREAKS = "\r\n"
_NOT_STARTER = {"Mn", "Mc", "Me", "Cn", "Cs"}  # marks; unassigned (a later Unicode may make them marks); surrogates
_NOT_SYMBOL = {"Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Cn", "Cs"}


def _splits(before: str, after: str) -> bool:
    if before == "\n":
        return not after.isspace()
    kind_before, kind_after = unicodedata.category(before)[0], unicodedata.category(after)[0]
    if kind_before in "LM":
        return kind_after not in "LM"
    return kind_before == "N" and kind_after != "M"


class BoundaryFinder:
    """Finds stable boundaries for the Qwen3.5 pre-tokenizer, given the tokenizer's added tokens (`splits`: the
    character-class rule; `sentencepiece.SentencePieceBoundaries` has its own)."""

    splits = staticmethod(_splits)  # whether the tokenization always splits between two characters

    def __init__(self, added_tokens: Sequence[str], tokenizer: Tokenizer | None = None) -> None:
        self.added = tuple(t for t in added_tokens if t)
        self.longest = max((len(t) for t in self.added), default=1)
        self.first_chars = {t[0] for t in self.added}
        self.tokens = None if tokenizer is None else TokenCuts(tokenizer, self)

    def token_cut(self, text: str) -> tuple[int, np.ndarray] | None:
        """The last stable boundary of `text` proven at token level (`TokenCuts.cut`), or None."""
        return None if self.tokens is None else self.tokens.cut(text)

    def inside_added(self, text: str, position: int) -> bool:
        """Whether an added token, or the start of one that later text could complete, spans `position`."""
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

    def first(self, text: str, low: int, high: int) -> int | None:
        """Smallest R in [max(low, 1), min(high, len(text) - 1)] that is a stable boundary of `text`, or None."""
        splits = self.splits
        for position in range(max(low, 1), min(high, len(text) - 1) + 1):
            if splits(text[position - 1], text[position]) and not self.inside_added(text, position):
                return position
        return None

    def last(self, text: str, low: int) -> int | None:
        """Largest R in [low, len(text) - 1] that is a stable boundary of `text`, or None."""
        splits = self.splits
        for position in range(len(text) - 1, max(low, 1) - 1, -1):
            if splits(text[position - 1], text[position]) and not self.inside_added(text, position):
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


class TokenCuts:
    """Stable boundaries proven at token level, for text that has no character-class boundary near its end
    (a run of one symbol, base64, CJK without spaces, long white space): `cut(text)` returns the last one."""

    def __init__(self, tokenizer: Tokenizer, boundaries: BoundaryFinder) -> None:
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
        return _nfc_starter(text[position - 1], text[position]) and not self.boundaries.inside_added(text, position)

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


class _Piece(NamedTuple):
    """One regex piece of an encoding: its characters [start, end) and its tokens [first, stop)."""

    start: int
    end: int
    first: int
    stop: int


def _pieces(word_ids: Sequence[int | None], offsets: Sequence[tuple[int, int]]) -> list[_Piece]:
    """Each regex piece (added tokens included) of an encoding."""
    pieces: list[_Piece] = []
    for index, word in enumerate(word_ids):
        if index and word is not None and word == word_ids[index - 1]:
            pieces[-1] = _Piece(pieces[-1].start, offsets[index][1], pieces[-1].first, index + 1)
        else:
            pieces.append(_Piece(offsets[index][0], offsets[index][1], index, index + 1))
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

