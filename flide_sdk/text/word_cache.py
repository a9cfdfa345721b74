"""A single-threaded, exact fast path for the Qwen3.5 tokenizer, which `text.tokens.Tokens` asks first.

`WordEncoder.encode(text)` gives the ids that `tokenizer.encode(text, add_special_tokens=False).ids` gives,
or None when it cannot vouch for them (the caller then asks the tokenizer). It owns the whitelist W of
characters it accepts, the pre-tokenizer pattern rewritten for `re` on W, the added-token split, the cuts of a
long text into lines and chunks, and its caches (short segments whole, lines, chunks, pieces). Only pieces
never seen before are encoded: by the tokenizer's BPE model on their byte-level characters (many at once: by the
tokenizer, in a batch). Why: a state is tokenized on a lone ask's critical path, and states repeat much of what
came before (docs/decisions/word-cache.md has the measurements).

Lines. A newline followed by spaces or tabs and then a character that is not white space ends a regex piece
(a piece holding a line break, through the pattern's white-space-then-line-breaks or punctuation-then-line-breaks
alternative, ends at the last line break of its white-space run, and that run has none past this newline), and
the split past it depends on the text past it alone (no lookbehind). So a long text's ids are its lines'
(`LINE_CUT`), each line's those of it with its newline. Lines seen before come from a dict; the others go
through the chunks below, and a text with mostly new lines goes through them whole.

Chunks. A space whose neighbours are both not white space starts a regex piece, and the split past it depends
on the text past it alone: the pattern has no lookbehind, and a piece holds a space after its first character
only if it is all white space (which such a space is not next to). So a text's ids are those of its part
before its first such space followed by, for each such space, those of the space and what follows it up to the
next one (a chunk). Long texts are cut there with `str.split` after every other space has been swapped for NUL
(outside the whitelist, so never in an accepted text; a NUL stands for a space in a chunk's key), and the chunks'
ids come from a dict, a few new chunks' from their regex pieces'. A text whose chunks are mostly new (sampled
from its start before cutting it, and from all its chunks when a look-up misses) is split whole instead, and its
chunks are cached later by `fill_chunks`, which the engine calls while the device computes a round. Texts of up
to SPLIT_WHOLE characters (questions, passages, an agent step's messages) are split whole.

Why it is exact. The Qwen3.5 tokenizer (checked at construction, else `encode` always returns None) extracts
its added tokens first (leftmost-longest; none strips or needs a whole word, none is normalized), NFC-
normalizes each segment between them, splits it with a regex (`QWEN_PRETOKENIZER_PATTERN`, pieces isolated),
maps each piece to byte-level characters and runs BPE (no dropout) inside it; nothing changes ids after. So
the ids of a text are, per segment, the concatenation over its regex pieces of ids(piece), and ids(piece)
depends on the piece alone: the tokenizer's ids of the piece by itself, once it splits into just itself,
which are the BPE model's ids of its byte-level characters (a piece of W is NFC, as W has no marks).
What remains is to split as the tokenizer's regex engine (oniguruma) does. On the whitelist W every
Unicode class the pattern names is a plain, long-stable set (letters, digits, four white-space characters;
no marks, no character that NFC changes, no long s, which `(?i)` would fold to `s`), so the pattern with
those sets spelled out, and its case-insensitive contractions spelled `'[sS]`..., splits alike in `re`; a
text with any character outside W is left to the tokenizer. Tests compare with the tokenizer on fuzz,
every character of W in context, and the real data.
"""

from __future__ import annotations

import itertools
import logging
import operator
import re
import unicodedata
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
from tokenizers import Tokenizer, pre_tokenizers

from flide_sdk.text.pretokenizer import byte_level_chars, supported

LOG = logging.getLogger(__name__)

# the whitelist W, as inclusive code point ranges: printable ASCII and \t \n \r (not \v \f: white space
# whose handling differs between engines' \s); Latin-1 without NBSP (white space) and the soft hyphen
# (format); Latin Extended-A/B without U+017F (long s); General Punctuation without its spaces, separators
# and format characters; the euro and trade mark signs
WHITELIST = (
    (0x09, 0x0A), (0x0D, 0x0D), (0x20, 0x7E), (0xA1, 0xAC), (0xAE, 0x017E), (0x0180, 0x024F),
    (0x2010, 0x2027), (0x2030, 0x205E), (0x20AC, 0x20AC), (0x2122, 0x2122),
)
WHITE_SPACE = " \t\n\r"
# the cache is cleared whole when it would pass this many pieces (about 120 bytes each with the dict's share:
# some 25 MB at most); English prose reaches about 10,000 distinct pieces in 15 QuALITY articles
MAX_CACHED_PIECES = 200_000
# new pieces up to this many are encoded one by one on the calling thread (by the BPE model alone, `_piece_ids`),
# more in one parallel batch: a batch call wakes the tokenizer's worker threads (one per CPU), which costs more
# than a few dozen short pieces (a RACE passage brings about 24 new to the cache, a QuALITY state about 9)
FEW_MISSING = 64
# chunks (about 180 bytes each: some 18 MB at most; QuALITY's 15 articles make about 22,000)
MAX_CACHED_CHUNKS = 100_000
# plain segments up to this long (between added tokens: a chat template's "\n", "assistant\n", ...) are looked up
# whole, before any cutting (a branch text has five such segments after its question)
SHORT_SEGMENT = 32
# plain segments up to this long (a question, a passage, an agent step's new messages) go through the regex
# split whole: on texts that short the cut and the look-ups gained little when warm and cost more when new
SPLIT_WHOLE = 2048
# a longer text more than 1 / this of whose chunks are new (in a sample of about CHUNK_SAMPLE of them, spread over
# it) is split whole, its chunks cached later from that split by `fill_chunks` (for a new article, splitting each
# new chunk on its own took about as long again as the whole split, and caching them all as long again)
NEW_CHUNKS_SPLIT_WHOLE = 8
CHUNK_SAMPLE = 64
PROBE_CHARS = 512  # a long text's start whose chunks are sampled before cutting it whole (a new text is not cut)
UNFILLED_TEXTS = 8  # texts split whole whose chunks wait for `fill_chunks` (older ones are dropped)
# a long text is first cut into lines, after each newline followed by spaces or tabs and then a character that is
# not white space (see the module docstring): a line's ids (with its newline) come from a dict when it was seen
# before, and only the lines never seen go through the chunks; a text more than 1 / this of whose lines are new
# goes through the chunks whole (a line of its own per call costs more than its share of one pass)
LINE_CUT = re.compile("\n(?=[ \t]*[^ \t\n\r])")
NEW_LINES_CHUNKED_WHOLE = 8
MAX_CACHED_LINES = 50_000  # lines (a QuALITY article's are 20-80 characters, some a whole paragraph)
NUL = "\0"  # stands for a space next to white space in a chunk (the text is cut at the other spaces)
# the spaces next to white space (runs of spaces, spaces before or after a line break or tab), swapped for NUL
# pair by pair; after the first swap no two spaces are adjacent, so the last two catch the single spaces that
# runs of three or more, and the other swaps, leave next to a NUL
_SPACE_RUNS = ("  ", NUL * 2)
_NEXT_TO = {ws: ((ws + " ", ws + NUL), (" " + ws, NUL + ws)) for ws in "\n\t\r"}
_NEXT_TO_NUL = ((NUL + " ", NUL * 2), (" " + NUL, NUL * 2))
# piece look-ups tried, each after adding the pieces missing (another thread may clear the cache between)
ADD_ATTEMPTS = 3
# the contractions' apostrophe matched once: the same alternatives in the same order after it, so the same pieces
# (and one alternative tried at each position instead of seven)
_CONTRACTIONS = "'(?:" + "|".join("".join(f"[{c.lower()}{c.upper()}]" for c in word)
                                  for word in ("s", "t", "re", "ve", "m", "ll", "d")) + ")"


def _ranges(chars: Iterable[str]) -> str:
    """A regex class body for `chars`: code points folded into ranges, ends other than ASCII letters and
    digits written `\\uXXXX`."""
    points = sorted({ord(c) for c in chars})
    body = []
    for _, run in itertools.groupby(enumerate(points), lambda pair: pair[1] - pair[0]):
        run = [p for _, p in run]
        ends = [run[0]] if len(run) == 1 else [run[0], run[-1]]
        body.append("-".join(chr(p) if chr(p).isascii() and chr(p).isalnum() else f"\\u{p:04x}" for p in ends))
    return "".join(body)


def character_classes() -> tuple[str, str, str]:
    """Class bodies of W's letters (\\p{L}), digits (\\p{N}) and white space (\\s), checked: every
    character of W is assigned, NFC-stable, not a mark, and exactly one of letter, digit, space, other."""
    letters, digits, spaces = [], [], []
    for low, high in WHITELIST:
        for point in range(low, high + 1):
            char = chr(point)
            kind = unicodedata.category(char)
            if kind[0] in "MC" and char not in WHITE_SPACE or unicodedata.normalize("NFC", char) != char:
                raise AssertionError(f"U+{point:04X} ({kind}) does not belong in the whitelist")
            if char.isspace() != (char in WHITE_SPACE) or (kind[0] == "Z") != (char == " "):
                raise AssertionError(f"U+{point:04X}: white space not as expected")
            if char == "\u017f" or char in "\xa0\xad\x85\x0b\x0c":
                raise AssertionError(f"U+{point:04X} is excluded from the whitelist")
            if kind[0] == "L":
                letters.append(char)
            elif kind[0] == "N":
                digits.append(char)
            elif char in WHITE_SPACE:
                spaces.append(char)
    return _ranges(letters), _ranges(digits), _ranges(spaces)


def whitelist_pattern() -> str:
    """The pre-tokenizer pattern for `re`, valid on texts of W only (same alternatives, same order)."""
    letters, digits, space = character_classes()
    return (
        f"{_CONTRACTIONS}|[^\\r\\n{letters}{digits}]?[{letters}]+|[{digits}]| ?[^{space}{letters}{digits}]+[\\r\\n]*"
        f"|[{space}]*[\\r\\n]+|[{space}]+(?![^{space}])|[{space}]+"
    )








def cut_at_spaces(segment: str) -> list[str]:
    """The segment's part before its first space between two characters that are not white space, then what
    follows each such space up to the next (every other space as NUL, see the module docstring)."""
    marked = segment.replace(*_SPACE_RUNS)
    for ws, swaps in _NEXT_TO.items():
        if ws in marked:
            for swap in swaps:
                marked = marked.replace(*swap)
    if NUL in marked:
        for swap in _NEXT_TO_NUL:
            marked = marked.replace(*swap)
    return marked.split(" ")


def _bounded_update(cache: dict[str, bytes], new: dict[str, bytes], keep: Iterable[str], limit: int,
                    base: dict[str, bytes]) -> None:
    """Add `new` to `cache`; when that would pass `limit` entries, clear it first down to `base` and the
    entries of `keep` (the keys of the text being encoded)."""
    if len(cache) + len(new) > limit:
        kept = {key: ids for key in keep if (ids := cache.get(key)) is not None}
        cache.clear()
        cache.update(base)
        cache.update(kept)
    cache.update(new)


class SplitText(NamedTuple):
    """A text split whole whose chunks wait for `WordEncoder.fill_chunks`: its regex pieces and their ids."""

    segment: str
    pieces: list[str]
    ids: list[bytes]


class WordEncoder:
    """Exact ids of whitelisted texts from a piece -> ids cache; None for what it does not vouch for.

    Safe to call from several threads: the cache is a dict read and written whole-entry under the GIL; two
    threads may encode the same new piece, with the same result; a clear only makes pieces miss again."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.enabled = supported(tokenizer)
        whitelist = (chr(point) for low, high in WHITELIST for point in range(low, high + 1))
        self._outside = re.compile(f"[^{_ranges(whitelist)}]")
        self._split = re.compile(whitelist_pattern())
        decoder = tokenizer.get_added_tokens_decoder()
        added = {token.content: token_id for token_id, token in decoder.items() if token.content}
        # added tokens that strip or match whole words only, or are matched after normalization, are not
        # split here: a text holding any added token is then left to the tokenizer
        self._plain_added = all(not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in decoder.values())
        self._added_ids = {content: np.int64(token_id).tobytes() for content, token_id in added.items()}
        self._added_first = "".join(sorted({content[0] for content in added}))
        longest_first = sorted(added, key=len, reverse=True)  # at one position: the longest, as the tokenizer
        self._added = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if added else None
        self.cache: dict[str, bytes] = dict(self._added_ids)  # piece -> its ids as int64 bytes
        self.chunks: dict[str, bytes] = {}  # chunk (NUL for its spaces but the first) -> the ids of " " + it
        self.short: dict[str, bytes] = {}  # short plain segment -> its ids
        self.lines: dict[str, bytes] = {}  # line of a long text (without its newline) -> the ids of it + "\n"
        # texts split whole whose chunks wait for `fill_chunks` (the last UNFILLED_TEXTS of them)
        self.unfilled: deque[SplitText] = deque(maxlen=UNFILLED_TEXTS)
        # a new piece's ids from the BPE model alone (what the tokenizer runs on a piece once it has normalized,
        # split and byte-mapped it), when the tokenizer's byte-level alphabet is the standard one
        self._byte_chars = byte_level_chars()
        self._direct = set(self._byte_chars) == set(pre_tokenizers.ByteLevel.alphabet())

    def segments(self, text: str) -> list[str] | None:
        """The text around its added tokens: plain text, token, plain text, ..., plain text (just the text when it
        holds none); None if it holds an added token this encoder does not split. Whether the plain text is
        whitelisted is checked where it is not served from a cache (`whitelisted`)."""
        if self._added is None or not any(c in text for c in self._added_first):
            return [text]
        segments = self._added.split(text)
        return None if len(segments) > 1 and not self._plain_added else segments

    def encode(self, text: str) -> np.ndarray | None:
        """Token ids of `text` (int64, writable), as the tokenizer gives them without special tokens; None
        when the encoder is disabled, the text holds a character outside the whitelist, or other threads kept
        clearing the caches while this call added the text's new chunks or pieces."""
        if not self.enabled:
            return None
        segments = self.segments(text)
        if segments is None:
            return None
        parts = []
        for at, segment in enumerate(segments):
            if at % 2:
                parts.append(self._added_ids[segment])
            elif segment:
                ids = self.short.get(segment) if len(segment) <= SHORT_SEGMENT else None
                if ids is None:
                    ids = self._segment_ids(segment)
                    if ids is None:
                        return None
                    if len(segment) <= SHORT_SEGMENT:
                        _bounded_update(self.short, {segment: ids}, set(), MAX_CACHED_CHUNKS, {})
                parts.append(ids)
        return np.frombuffer(bytearray().join(parts), np.int64)

    def whitelisted(self, text: str) -> bool:
        """Whether every character of `text` is in W. Only text no cache serves is checked: a cached short
        segment, line or chunk was checked when it was encoded (a rotating window finds most of its lines cached,
        and a scan of them all would cost more than their look-ups). No NFC check is needed: a text of W is NFC
        (every character of W is an NFC-stable starter and no two compose, tests/test_word_cache.py), so the
        tokenizer's normalizer leaves it as it is."""
        return self._outside.search(text) is None

    def pieces(self, text: str) -> list[str]:
        """The regex pieces of a whitelisted text without added tokens, as the tokenizer's pre-tokenizer splits it
        (what every id of this encoder is built from)."""
        return self._split.findall(text)

    def _segment_ids(self, segment: str) -> bytes | None:
        """The ids (int64 bytes) of a text without added tokens: a long one's from its lines' (`_lines_ids`), the
        others' (a short text, a long one with mostly new lines) through `_chunked_ids`; None as `encode` (where
        text no cache serves is checked against W)."""
        if len(segment) > SPLIT_WHOLE:
            lines = LINE_CUT.split(segment)
            if len(lines) > 2:  # at least one whole line between the first and the last
                ids = self._lines_ids(lines)
                if ids is not NotImplemented:
                    return ids
        return self._chunked_ids(segment)

    def _lines_ids(self, lines: list[str]) -> bytes | None:
        """The ids of a long text cut into `lines` (LINE_CUT's split: each but the last stands for itself + "\n"):
        the lines seen before from the line cache, the others (cached now) and the last through the chunks;
        NotImplemented when more than 1 / NEW_LINES_CHUNKED_WHOLE of the lines are new, None as `encode`."""
        last = lines.pop()
        ids = list(map(self.lines.get, lines))
        missing_at = list(itertools.compress(itertools.count(), map(operator.is_, ids, itertools.repeat(None))))
        if len(missing_at) * NEW_LINES_CHUNKED_WHOLE > len(lines):
            return NotImplemented
        new = {}
        for at in missing_at:
            line = lines[at]
            line_ids = new.get(line) or self._chunked_ids(line + "\n")
            if line_ids is None:
                return None
            ids[at] = new[line] = line_ids
        last_ids = self._chunked_ids(last) if last else b""
        if last_ids is None:
            return None
        _bounded_update(self.lines, new, lines, MAX_CACHED_LINES, {})
        return b"".join(ids) + last_ids

    def _chunked_ids(self, segment: str) -> bytes | None:
        """The ids of a text without added tokens: its chunks' from the chunk cache, its part before the first chunk
        from its regex pieces' (a short text's all from its pieces'); None as `encode` (the text is checked against
        W first: a new line of a long text, or a long text with mostly new lines, comes here). A text whose start,
        or whose chunks, are mostly new is split whole, its chunks cached later (`fill_chunks`)."""
        if not self.whitelisted(segment):
            return None
        if len(segment) <= SPLIT_WHOLE:
            return self._split_ids(segment)
        if self._mostly_new(cut_at_spaces(segment[:PROBE_CHARS])[1:-1]):  # the probe's last chunk may be cut short
            return self._split_deferring(segment)
        chunks = cut_at_spaces(segment)
        first = chunks[0].replace(NUL, " ")
        del chunks[0]
        head_ids = self._split_ids(first)
        if head_ids is None:
            return None
        ids = list(map(self.chunks.get, chunks))
        if all(ids):  # a chunk's ids are never empty: None marks the chunks not cached
            return head_ids + b"".join(ids)
        # chunks never seen before (a unique text has a few), or cleared by another thread meanwhile
        if self._mostly_new(chunks):
            return self._split_deferring(segment)
        missing_at = list(itertools.compress(itertools.count(), map(operator.is_, ids, itertools.repeat(None))))
        new = self._add_chunks(list(dict.fromkeys(map(chunks.__getitem__, missing_at))), chunks)
        if new is None:
            return None
        for at in missing_at:
            ids[at] = new[chunks[at]]
        return head_ids + b"".join(ids)

    def _mostly_new(self, chunks: list[str]) -> bool:
        """Whether more than 1 / NEW_CHUNKS_SPLIT_WHOLE of a sample of about CHUNK_SAMPLE chunks, spread over
        `chunks`, are missing from the chunk cache."""
        sample = chunks[:: max(1, len(chunks) // CHUNK_SAMPLE)]
        return (len(sample) - sum(map(self.chunks.__contains__, sample))) * NEW_CHUNKS_SPLIT_WHOLE > len(sample)

    def _add_chunks(self, missing: list[str], chunks: list[str]) -> dict[str, bytes] | None:
        """Cache the ids of a text's few new chunks, each from its regex pieces', and return them (None, nothing
        cached, if a piece is declined); a clear keeps the text's other chunks (`chunks`)."""
        findall = self._split.findall
        split = [findall(" " + chunk.replace(NUL, " ")) for chunk in missing]
        ids = self._piece_bytes(list(itertools.chain.from_iterable(split)))
        if ids is None:
            return None
        new, at = {}, 0
        for chunk, pieces in zip(missing, split):
            new[chunk] = b"".join(ids[at : at + len(pieces)])
            at += len(pieces)
        _bounded_update(self.chunks, new, chunks, MAX_CACHED_CHUNKS, {})
        return new

    def _split_deferring(self, segment: str) -> bytes | None:
        """The segment's ids from its regex pieces' (as without chunks); cutting it and caching its chunks are left
        to `fill_chunks` (a new 2,000-token state has about 1,200: caching them here took about as long as the rest)."""
        pieces = self._split.findall(segment)
        ids = self._piece_bytes(pieces)
        if ids is None:
            return None
        self.unfilled.append(SplitText(segment, pieces, ids))
        return b"".join(ids)

    def fill_chunks(self) -> None:
        """Cache the chunks and lines of the texts recently split whole, as slices of their ids: the pieces fall at
        the chunks' and lines' ends (no piece crosses a cut), so a chunk's or a line's ids are the ids of the pieces
        between its ends. Meant for idle host time (the engine calls it once a round is launched, while the device
        computes); only the last UNFILLED_TEXTS texts wait for it. It never raises: a text whose pieces do not fall
        at its cuts (which the split rules out) is logged and left uncached."""
        while self.unfilled:
            try:
                segment, pieces, ids = self.unfilled.popleft()
            except IndexError:  # another thread took the last one
                return
            joined = b"".join(ids)
            # bytes of ids up to each piece's end, by the characters up to it; a chunk's or line's ends are pieces' ends
            bytes_at = dict(zip(itertools.accumulate(map(len, pieces), initial=0),
                                itertools.accumulate(map(len, ids), initial=0)))
            chunks = cut_at_spaces(segment)
            head_chars = len(chunks[0])
            del chunks[0]
            lines = LINE_CUT.split(segment)[:-1]  # each for itself + its newline; the last (none after it) is not kept
            try:
                chunk_at = list(map(bytes_at.__getitem__, map(operator.add, itertools.accumulate(
                    map(len, chunks), initial=head_chars), itertools.count())))
                line_at = list(map(bytes_at.__getitem__, itertools.accumulate((len(line) + 1 for line in lines),
                                                                              initial=0)))
            except KeyError:  # cannot happen (see the module docstring); caching is only a shortcut: skip it
                LOG.warning("a regex piece crosses a clean space or a line's end: %.60r... left uncached", segment)
                continue
            for cache, keys, at, limit in ((self.chunks, chunks, chunk_at, MAX_CACHED_CHUNKS),
                                           (self.lines, lines, line_at, MAX_CACHED_LINES)):
                new = dict(zip(keys, map(joined.__getitem__, map(slice, at, at[1:]))))
                _bounded_update(cache, new, new.keys(), limit, {})

    def _split_ids(self, text: str) -> bytes | None:
        """The ids (int64 bytes) of a whitelisted text without added tokens, from its regex pieces'."""
        ids = self._piece_bytes(self._split.findall(text))
        return None if ids is None else b"".join(ids)

    def _piece_bytes(self, pieces: list[str]) -> list[bytes] | None:
        """Each piece's ids (int64 bytes) from the piece cache, the pieces missing from it added first, all at once
        (a new text's many pieces in one batch); None as `encode`."""
        cache = self.cache
        for _ in range(ADD_ATTEMPTS):
            try:
                return list(map(cache.__getitem__, pieces))
            except KeyError:  # pieces never seen before (or, again, cleared by another thread meanwhile)
                if not self.add_pieces(pieces):
                    return None
        return None

    def add_pieces(self, pieces: list[str]) -> bool:
        """Cache the ids of the pieces missing from the cache, from the tokenizer; False (nothing cached) if one
        is not a regex piece by itself (splits into more than itself). When they would pass the bound, the cache
        is cleared first, keeping the text's other pieces. Set operations find them (a text brings few new pieces
        among many known ones)."""
        distinct = set(pieces)
        missing = [piece for piece in distinct.difference(self.cache) if piece not in self._added_ids]
        for piece in missing:
            whole = self._split.match(piece)
            if whole is None or whole.end() != len(piece):
                return False
        if len(missing) <= FEW_MISSING:  # one at a time, on this thread: no wake-up of the tokenizer's threads
            ids = [self._piece_ids(piece) for piece in missing]
        else:
            ids = [encoding.ids for encoding in self.tokenizer.encode_batch_fast(missing, add_special_tokens=False)]
        new = {piece: np.asarray(piece_ids, np.int64).tobytes() for piece, piece_ids in zip(missing, ids)}
        # added after the tokenizer (other threads fill the cache meanwhile), so the bound holds up to the
        # pieces of the few texts whose inserts interleave
        _bounded_update(self.cache, new, distinct, MAX_CACHED_PIECES, self._added_ids)
        return True

    def _piece_ids(self, piece: str) -> list[int]:
        """The tokenizer's ids of one piece that splits into just itself and is no added token: the BPE model's
        on its byte-level characters (the tokenizer's whole pipeline when the alphabet is not the standard one)."""
        if not self._direct:
            return self.tokenizer.encode(piece, add_special_tokens=False).ids
        chars = "".join(map(self._byte_chars.__getitem__, piece.encode()))
        return [token.id for token in self.tokenizer.model.tokenize(chars)]
