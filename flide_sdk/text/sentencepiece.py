"""Stable boundaries for a SentencePiece-style BPE (Gemma's): between added tokens the whole text is one BPE word,
its spaces written as "▁", a character outside the vocabulary as its UTF-8 byte tokens.

BPE starts from one symbol per character (its byte tokens for one outside the vocabulary) and each merge joins
two neighbouring symbols. The first symbol to cover the characters a, b at R-1 and R is made by a merge of a
symbol ending with a and one starting with b. Where no merge joins such parts (`SentencePieceBoundaries.pairs`:
the last character of each merge's left part with the first of its right part), no symbol ever covers both,
whatever text follows: BPE(x) = BPE(x[:R]) + BPE(x[R:]) (the merges on each side never see the other, and BPE
pops them by rank, then position, so each side merges as it would alone). A character encoded as byte tokens is
on a boundary when no merge takes a byte token as a part. With no added token spanning R (complete, or completable by
later text) and a normalizer that maps each character alone, R is stable.
Text with no such pair near its end (letters without spaces, a run of one symbol) gets token-level cuts
(`SymbolCuts`): inside the open BPE word, at a token boundary before the merge frontier (`merges.MergeTable
.frontier`, run on the word's symbols, one character each). The argument and its cost:
docs/decisions/sentencepiece-boundaries.md.
"""

from __future__ import annotations

import json
import threading

import numpy as np
from tokenizers import Tokenizer, models

from flide_sdk.text.cuts import BoundaryFinder
from flide_sdk.text.merges import MergeTable
from flide_sdk.text.pretokenizer import BYTE_TOKENS, SPACE_MARK

BYTE_SYMBOLS = tuple(chr(0x10FF00 + byte) for byte in range(256))  # private use: a byte token as one character


class SentencePieceBoundaries(BoundaryFinder):
    """Stable boundaries of a SentencePiece-style BPE (checked by `pretokenizer.tokenizer_kind`): between two
    characters that no merge joins, never inside an added token; token-level cuts (`SymbolCuts`) for a long
    tail without them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__([token.content for token in tokenizer.get_added_tokens_decoder().values()])
        state = json.loads(tokenizer.model.__getstate__())
        vocab: dict[str, int] = state["vocab"]
        byte_tokens = set(BYTE_TOKENS)
        merges = [m.split(" ", 1) if isinstance(m, str) else m for m in state["merges"]]
        # byte tokens are symbols of their own: a merge of one (never in Gemma's) makes their neighbours joinable
        self.bytes_merge = any(part in byte_tokens for merge in merges for part in merge)
        self.chars = frozenset(token for token in vocab if len(token) == 1)
        self.pairs = frozenset(left[-1] + right[0] for left, right in merges)  # what a merge joins at its seam
        self.tokens = SymbolCuts(tokenizer, self, vocab, merges)

    def splits(self, before: str, after: str) -> bool:
        """Whether no symbol of the BPE can cover both `before` and the `after` that follows it (characters of
        the text before normalization)."""
        if before == " ":
            before = SPACE_MARK
        if after == " ":
            after = SPACE_MARK
        if before in self.chars and after in self.chars:
            return before + after not in self.pairs
        return not self.bytes_merge


class SymbolCuts:
    """Stable boundaries proven at token level inside the open BPE word (the text after the last added token,
    which later text extends): `cut(text)` returns the last token boundary before the word's merge frontier.
    The frontier is computed by `MergeTable` on the word's symbols as characters (a byte token as one private-use
    character), over a copy of the BPE whose byte tokens are spelt so; off when a byte token takes part in a merge
    or a private-use stand-in is in the vocabulary."""

    def __init__(self, tokenizer: Tokenizer, boundaries: SentencePieceBoundaries, vocab: dict[str, int],
                 merges: list[list[str]]) -> None:
        self.tokenizer = tokenizer
        self.boundaries = boundaries
        spelt = dict(zip(BYTE_TOKENS, BYTE_SYMBOLS))
        stand_ins = frozenset(BYTE_SYMBOLS)
        self.enabled = not boundaries.bytes_merge and not any(stand_ins.intersection(token) for token in vocab)
        self._symbols = {spelt.get(token, token): token_id for token, token_id in vocab.items()}  # kept for `table`
        self._merges = [(left, right) for left, right in merges]
        self._added_ids = set(tokenizer.get_added_tokens_decoder())
        self._table: MergeTable | None = None
        self._lock = threading.Lock()
        self.refuted = 0  # cuts whose tokens were not the whole text's (History checks each): never, by the argument

    @property
    def table(self) -> MergeTable:
        """The merge index of the BPE over symbols (built on the first cut: about a second for 262,144 tokens)."""
        with self._lock:
            if self._table is None:
                self._table = MergeTable(Tokenizer(models.BPE(self._symbols, self._merges)))
                self.enabled = self.enabled and self._table.unique
            return self._table

    def known_end(self, text: str) -> int:
        """How much of `text` later text cannot change: up to any added token's start it ends with."""
        end = len(text)
        for token in self.boundaries.added:
            for size in range(min(len(token) - 1, len(text)), 0, -1):
                if text.endswith(token[:size]):
                    end = min(end, len(text) - size)
                    break
        return end

    def cut(self, text: str) -> tuple[int, np.ndarray] | None:
        """The last stable boundary R of `text` (which starts at a stable boundary) inside its open word, past 0,
        with the token ids of text[:R], or None."""
        if not self.enabled:
            return None
        table = self.table
        head = text[: self.known_end(text)]
        if len(head) < 2 or not self.enabled:
            return None
        encoding = self.tokenizer.encode(head, add_special_tokens=False)
        ids = np.asarray(encoding.ids, np.int64)
        first = len(ids)  # the open word's first token: after the last added token
        while first and int(ids[first - 1]) not in self._added_ids:
            first -= 1
        if first == len(ids):
            return None
        start = encoding.offsets[first][0]
        word = head[start:]
        chars = self.boundaries.chars
        pieces = [char if char in chars else "".join(BYTE_SYMBOLS[byte] for byte in char.encode())
                  for char in word.replace(" ", SPACE_MARK)]  # each character's symbols
        frontier = table.frontier("".join(pieces), ids[first:])
        if not frontier:
            return None
        char_at = np.concatenate([[0], np.cumsum([len(piece) for piece in pieces])])  # symbols before each character
        token_at = np.concatenate([[0], np.cumsum(table.length[ids[first:]])])
        shared = np.intersect1d(token_at[(token_at > 0) & (token_at <= frontier)], char_at, assume_unique=True)
        for position in shared[::-1].tolist():
            cut = start + int(np.searchsorted(char_at, position))
            if cut < len(text) and not self.boundaries.inside_added(text, cut):
                return cut, ids[: first + int(np.searchsorted(token_at, position))]
        return None
