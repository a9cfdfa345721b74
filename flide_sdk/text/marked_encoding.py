"""Encoding a rendered decision prompt as transformers' `apply_chat_template(..., sanitize_control_tokens=True)` does.

Control tokens (the tokenizer's special added tokens, and its other added tokens that the template itself writes)
found in the request's strings are wrapped in private-use markers before rendering; the rendered text is then
encoded piece by piece, each marked token as plain text (no added-token matching) and the rest as usual, so a
request can never write a token the template reserves. Without control tokens in the request it is one encode.
"""

from __future__ import annotations

import re
from typing import Any

import jinja2.nodes
import numpy as np
from tokenizers import Tokenizer

START, END = "\U000f0000", "\U000f0001"  # transformers' markers: the same characters give the same ids


def template_literals(environment: jinja2.Environment, source: str) -> str:
    """The literal text of a template (its raw text and string constants), NUL-joined so no search spans two."""
    tree = environment.parse(source)
    literals = {node.data for node in tree.find_all(jinja2.nodes.TemplateData)}
    literals |= {node.value for node in tree.find_all(jinja2.nodes.Const) if isinstance(node.value, str)}
    return "\0".join(sorted(literals))


def _alternation(tokens: list[str]) -> str:
    return "|".join(map(re.escape, sorted(tokens, key=len, reverse=True))) or "(?!)"


class MarkedEncoder:
    """Marks control tokens in request values and encodes rendered text with the marks honoured."""

    def __init__(self, tokenizer: Tokenizer, literals: str) -> None:
        self.tokenizer = tokenizer
        added = list(tokenizer.get_added_tokens_decoder().values())
        control = [t.content for t in added if t.special or (t.content in literals and not t.content.isspace())]
        self._control = re.compile(_alternation(control))
        self._markers = re.compile(f"{START}({_alternation([t.content for t in added])}){END}|[{START}{END}]")
        self._newline = self._encode("\n")

    def mark(self, value: Any) -> Any:
        """`value` with every control token in its strings wrapped in markers (dict keys untouched; markers
        already in a string dropped first, so none can be forged)."""
        if isinstance(value, str):
            value = value.replace(START, "").replace(END, "")
            return self._control.sub(lambda m: START + m.group(0) + END, value)
        if isinstance(value, dict):
            return {key: self.mark(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mark(item) for item in value]
        return value

    def encode(self, text: str) -> np.ndarray:
        """Token ids of rendered text: marked tokens as plain text, lone markers dropped (they still split)."""
        pieces = self._markers.split(text)
        ids = self._encode(pieces[0])
        for index, piece in enumerate(pieces[1:], start=1):
            if piece:
                ids += self._piece(piece, as_text=index % 2 == 1)
        return np.asarray(ids, dtype=np.int64)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _plain(self, text: str) -> list[int]:
        """The model's pipeline without added tokens: normalizer, pre-tokenizer, BPE."""
        tok = self.tokenizer
        if tok.normalizer is not None:
            text = tok.normalizer.normalize_str(text)
        splits = [text] if tok.pre_tokenizer is None else [s for s, _ in tok.pre_tokenizer.pre_tokenize_str(text)]
        return [token.id for split in splits for token in tok.model.tokenize(split)]

    def _piece(self, piece: str, as_text: bool) -> list[int]:
        encode = self._plain if as_text else self._encode
        ids = encode("\n" + piece)  # after a newline, as transformers encodes a piece from mid-chat
        if ids[: len(self._newline)] == self._newline:
            return ids[len(self._newline):]
        return encode(piece)
