"""`Tokens`: a checkpoint's tokenizer and the exact fast ways to use it, apart from any prompt format.

Every prompt format encodes its text here: `encode` is the tokenizer's own ids (the reference), `encode_cut` a
state's ids cut at a stable boundary (the word encoder first, else pieces the tokenizer encodes in parallel),
`encode_texts` short texts such as question blocks (cached by text), `label_id` one label's single token.
It also holds the prompt length limit, which every format's trunks and branches are checked against.
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from flide_sdk.errors import CheckpointError, InvalidQuestionError, StateTooLongError
from flide_sdk.text.cuts import BoundaryFinder
from flide_sdk.text.history import History, Trunk
from flide_sdk.text.pretokenizer import TokenizerKind, tokenizer_kind
from flide_sdk.text.sentencepiece import SentencePieceBoundaries
from flide_sdk.text.word_cache import WordEncoder

# a text the word encoder declines is encoded in about one piece per CPU (the tokenizer's thread pool), in
# parallel, each piece 128 to 512 characters: a short text (a passage, a step's messages) still spreads over
# the threads, a long one is not cut into more pieces than the threads need (each piece costs host time of its own)
ENCODE_PIECES = os.cpu_count() or 1
ENCODE_PIECE_CHARS = (128, 512)
TEXT_CACHE = 4096  # encoded short texts kept, least recently used dropped first


def trim(cache: OrderedDict, size: int) -> None:
    """Drop the least recently used entries past `size`."""
    while len(cache) > size:
        cache.popitem(last=False)


class Tokens:
    """The tokenizer of a checkpoint (its kind checked: Qwen3.5's byte-level BPE or a SentencePiece-style BPE),
    its stable boundaries, its word encoder (Qwen3.5's only), and the longest prompt an engine accepts."""

    def __init__(self, tokenizer: Tokenizer, max_prompt_tokens: int) -> None:
        self.kind = tokenizer_kind(tokenizer)
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        if self.kind is TokenizerKind.SENTENCEPIECE_BPE:
            self.boundaries: BoundaryFinder = SentencePieceBoundaries(tokenizer)
        else:
            added = [token.content for token in tokenizer.get_added_tokens_decoder().values()]
            self.boundaries = BoundaryFinder(added, tokenizer)  # the tokenizer for token-level cuts of long tails
        self.words = WordEncoder(tokenizer)  # the fast path of `encode_cut` (`words.enabled`: whether it runs)
        self._texts: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self._label_ids: dict[str, int] = {}

    @classmethod
    def from_checkpoint(cls, path: str | Path, max_prompt_tokens: int, vocab_size: int | None = None) -> Tokens:
        """The tokenizer.json of a checkpoint directory. CheckpointError, naming the file, for a tokenizer that
        does not load or is of no kind served (`pretokenizer.tokenizer_kind`), or one with token ids from `vocab_size` on (the embedding's rows)."""
        tokenizer_file = Path(path) / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(f"{path}: no tokenizer.json")
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # tokenizers raises a bare Exception for a file it cannot read
            raise CheckpointError(f"{tokenizer_file}: not a readable tokenizer ({error})") from error
        try:
            tokenizer_kind(tokenizer)
        except CheckpointError as error:
            raise CheckpointError(f"{tokenizer_file}: {error}") from error
        if vocab_size is not None:
            largest = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
            if largest >= vocab_size:
                raise CheckpointError(f"{tokenizer_file}: token id {largest} is past the model's vocab_size "
                                      f"{vocab_size} (config.json); every id of the tokenizer needs an embedding row")
        return cls(tokenizer, max_prompt_tokens)

    def encode(self, text: str) -> np.ndarray:
        """The tokenizer's own ids of `text` (int64, no special tokens, no fast path): the reference every other
        encoding here equals."""
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_cut(self, text: str, cut: int) -> tuple[np.ndarray, int]:
        """Token ids of `text`, and how many of them encode `text[:cut]` (`cut`: 0, or a stable boundary of
        `text`). The text is cut there (same tokens: no regex piece, so no BPE merge, crosses a stable boundary)
        and both parts go to the word encoder. When it declines either (a character it does not vouch for),
        the text is cut there and, when long, at more stable boundaries, into pieces that the tokenizer encodes
        in parallel, without offsets."""
        if cut:
            first = self.words.encode(text[:cut])
            second = None if first is None else self.words.encode(text[cut:])
            if second is not None:
                return np.concatenate([first, second]), len(first)
        else:
            ids = self.words.encode(text)
            if ids is not None:
                return ids, 0
        shortest, longest = ENCODE_PIECE_CHARS
        every = min(longest, max(shortest, len(text) // ENCODE_PIECES))
        cuts = self.boundaries.cuts(text, every) if len(text) >= 2 * every else []
        if cut and cut not in cuts:
            bisect.insort(cuts, cut)
        bounds = [0, *cuts, len(text)]
        pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
        encodings = self.tokenizer.encode_batch_fast(pieces, add_special_tokens=False)
        ids = np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encodings])
        before = sum(len(e) for e, end in zip(encodings, bounds[1:]) if end <= cut)
        return ids, before

    def encode_texts(self, texts: Iterable[str]) -> list[np.ndarray]:
        """Token ids of short texts (read-only, shared): from the cache by text, the rest from the word encoder
        (a batch call of the tokenizer wakes its worker threads, too costly for a few short texts) or, for the
        texts it declines, in one batch."""
        texts = list(texts)
        with self._lock:
            found = {text: self._texts[text] for text in texts if text in self._texts}
            for text in found:
                self._texts.move_to_end(text)
        new = list(dict.fromkeys(text for text in texts if text not in found))
        if new:
            for text in new:
                ids = self.words.encode(text)
                if ids is not None:
                    ids.flags.writeable = False
                    found[text] = ids
            declined = [text for text in new if text not in found]
            for text, encoding in zip(declined, self.tokenizer.encode_batch_fast(declined, add_special_tokens=False)):
                ids = np.asarray(encoding.ids, dtype=np.int64)
                ids.flags.writeable = False
                found[text] = ids
            with self._lock:
                self._texts.update((text, found[text]) for text in new)
                trim(self._texts, TEXT_CACHE)
        return [found[text] for text in texts]

    def cached_texts(self) -> int:
        with self._lock:
            return len(self._texts)

    def label_id(self, label: str) -> int:
        """The one token of a label; InvalidQuestionError when the tokenizer makes it more (or fewer)."""
        if label not in self._label_ids:
            ids = self.encode(label)
            if len(ids) != 1:
                raise InvalidQuestionError(f"label {label!r} is {len(ids)} tokens in this tokenizer, not one")
            self._label_ids[label] = int(ids[0])
        return self._label_ids[label]

    def history(self, head: str, trims: bool = False) -> History:
        """An empty, growing history whose text starts with `head` (a session's state; `trims`: the chat
        template trims the user content)."""
        return History(head, self.encode_cut, self.boundaries, trims)

    def trunk(self, head: str, body: str, trims: bool = False) -> Trunk:
        """The trunk of a one-off ask: `head + body` and the blank line, tokenized with its stable boundary
        (`trims`: `body` without its leading white space, and no blank line when nothing is left)."""
        return History.of_state(head, body, self.encode_cut, self.boundaries, trims).snapshot()

    def check_length(self, longest: int) -> None:
        """StateTooLongError when a whole prompt of `longest` tokens passes max_prompt_tokens."""
        if longest > self.max_prompt_tokens:
            raise StateTooLongError(longest, self.max_prompt_tokens)
