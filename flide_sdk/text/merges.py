"""The merge order of a BPE model, indexed to answer one question: up to where are the tokens of a word fixed
whatever text later extends it (`MergeTable.frontier`)? A word is a string of one character per initial symbol:
byte-level characters for Qwen3.5, the characters (byte tokens spelt as one character each) for SentencePiece.

The token-level cuts (`cuts.TokenCuts`, `sentencepiece.SymbolCuts`) place a stable boundary inside a word that may
still grow only up to that frontier; the argument is in docs/decisions/bounded-mutable-tail.md.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tokenizers import Tokenizer

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

