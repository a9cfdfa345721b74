"""Stable boundaries for a SentencePiece-style BPE (Gemma's): between added tokens the whole text is one BPE word,
its spaces written as "▁", a character outside the vocabulary as its UTF-8 byte tokens.

BPE starts from one symbol per character (its byte tokens for one outside the vocabulary) and each merge joins
two neighbouring symbols. The first symbol to cover the characters a, b at R-1 and R is made by a merge of a
symbol ending with a and one starting with b. Where no merge joins such parts (`SentencePieceBoundaries.pairs`:
the last character of each merge's left part with the first of its right part), no symbol ever covers both,
whatever text follows: BPE(x) = BPE(x[:R]) + BPE(x[R:]) (the merges on each side never see the other, and BPE
pops them by rank, then position, so each side merges as it would alone). A character encoded as byte tokens is
on a boundary when no merge takes a byte token as a part. With no added token spanning R (complete, or completable by
later text) and a normalizer that maps each character alone, R is stable. The argument and its cost:
docs/decisions/sentencepiece-boundaries.md.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer

from flide_sdk.text.cuts import BoundaryFinder
from flide_sdk.text.pretokenizer import BYTE_TOKENS, SPACE_MARK


class SentencePieceBoundaries(BoundaryFinder):
    """Stable boundaries of a SentencePiece-style BPE (checked by `pretokenizer.tokenizer_kind`): between two
    characters that no merge joins, never inside an added token. No token-level cuts:
    text without such a pair near its end (one script without spaces, a run of one symbol) keeps its tail."""

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
