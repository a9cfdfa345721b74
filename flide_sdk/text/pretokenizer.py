"""What the text layer assumes of the tokenizer: the two kinds it serves exactly (`tokenizer_kind`), the Qwen3.5
pre-tokenizer pattern, its white space, the byte-level alphabet, and the SentencePiece-style layout.

The stable boundaries (`cuts`), the token-level cuts and the word encoder (`word_cache`) are exact only for a
byte-level BPE tokenizer whose pre-tokenizer splits by this pattern; the boundaries of `sentencepiece` only for a
BPE over the whole text with spaces as "▁" and byte fallback (Gemma's). They share these definitions here, so
that none of them imports another for them.
"""

from __future__ import annotations

import enum
import json
from typing import Any

from tokenizers import Tokenizer, models

from flide_sdk.errors import CheckpointError

QWEN_PRETOKENIZER_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# the pattern's \s (Unicode White_Space; Python's isspace adds U+001C-U+001F), checked against the tokenizer in tests
PATTERN_SPACE = frozenset("\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | {
    chr(point) for point in range(0x2000, 0x200B)}


def component_settings(component: Any) -> dict:
    """A tokenizer component's settings (pre-tokenizer, normalizer, post-processor; {} for None), read from
    the component itself: `Tokenizer.to_str()` serializes the whole vocabulary too (about a second)."""
    return {} if component is None else json.loads(component.__getstate__())


class TokenizerKind(enum.Enum):
    """A tokenizer layout whose stable boundaries flide_sdk knows."""

    QWEN35 = "Qwen3.5 byte-level BPE"
    SENTENCEPIECE_BPE = "SentencePiece-style BPE"


SPACE_MARK = "\u2581"  # "▁": what the SentencePiece-style normalizer writes for a space
BYTE_TOKENS = tuple(f"<0x{byte:02X}>" for byte in range(256))  # byte fallback's tokens


def tokenizer_kind(tokenizer: Tokenizer) -> TokenizerKind:
    """Which kind `tokenizer` is; CheckpointError for any other (the stable-boundary rules depend on it)."""
    if _qwen_pretokenizer(tokenizer):
        return TokenizerKind.QWEN35
    normalizer = component_settings(tokenizer.normalizer)
    if normalizer.get("type") == "Replace" and normalizer.get("content") == SPACE_MARK:
        problem = sentencepiece_problem(tokenizer)
        if problem is None:
            return TokenizerKind.SENTENCEPIECE_BPE
        raise CheckpointError(f"unsupported tokenizer: a SentencePiece-style BPE, but {problem}")
    raise CheckpointError("unsupported tokenizer: flide_sdk needs the Qwen3.5 byte-level BPE pre-tokenizer or a "
                          "SentencePiece-style BPE (spaces as \u2581, byte fallback, no split regex)")


def _qwen_pretokenizer(tokenizer: Tokenizer) -> bool:
    """Whether the pre-tokenizer is Qwen3.5's (its pattern, then byte-level without its own regex; NFC or none)."""
    pre = component_settings(tokenizer.pre_tokenizer)
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    split = next((s for s in steps if s.get("type") == "Split"), {})
    byte_level = next((s for s in steps if s.get("type") == "ByteLevel"), {})
    normalizer = component_settings(tokenizer.normalizer).get("type")
    return (split.get("pattern", {}).get("Regex") == QWEN_PRETOKENIZER_PATTERN
            and not byte_level.get("use_regex", True) and normalizer in (None, "NFC"))


def sentencepiece_problem(tokenizer: Tokenizer) -> str | None:
    """None when `tokenizer` has the layout transformers' Gemma converter writes (and its `GemmaTokenizer` builds
    again from the file's vocabulary and merges), which `sentencepiece.SentencePieceBoundaries` is exact for:
    spaces replaced by "▁" and nothing else normalized; no pre-tokenizer, or a split at " " (which that normalizer
    leaves none of); a BPE run over each text between added tokens, without dropout, subword affixes or
    `ignore_merges`, with byte fallback to all 256 byte tokens (so no unknown token); added tokens matched as
    written (none strips or needs a whole word, none matched after normalization holds a space); no truncation
    or padding. Else what differs."""
    normalizer = component_settings(tokenizer.normalizer)
    pre = component_settings(tokenizer.pre_tokenizer)
    model = tokenizer.model
    if normalizer != {"type": "Replace", "pattern": {"String": " "}, "content": SPACE_MARK}:
        return f"its normalizer is {normalizer}, not a plain replacement of spaces by {SPACE_MARK}"
    if pre and not (pre.get("type") == "Split" and pre.get("pattern") == {"String": " "} and not pre.get("invert")):
        return f"its pre-tokenizer is {pre.get('type')}, not none or a split at spaces"
    if not isinstance(model, models.BPE):
        return f"its model is {type(model).__name__}, not BPE"
    if model.dropout or model.continuing_subword_prefix or model.end_of_word_suffix or model.ignore_merges:
        return "its BPE has dropout, a subword prefix or suffix, or ignore_merges"
    if not model.byte_fallback or any(model.token_to_id(token) is None for token in BYTE_TOKENS):
        return "its BPE lacks byte fallback to all 256 byte tokens <0x00>..<0xFF>"
    added = tokenizer.get_added_tokens_decoder().values()
    if any(token.lstrip or token.rstrip or token.single_word for token in added):
        return "an added token strips white space or matches whole words only"
    if any(token.normalized and (" " in token.content or SPACE_MARK in token.content) for token in added):
        return f"an added token matched after normalization holds a space or {SPACE_MARK}"
    if tokenizer.truncation is not None or tokenizer.padding is not None:
        return "it truncates or pads"
    if getattr(tokenizer, "encode_special_tokens", False):
        return "it encodes special tokens as text"
    return None


def supported(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer is exactly the one the word encoder and the token-level cuts are exact for: the
    pattern's split (pieces isolated) then byte-level mapping, NFC or no normalizer, a byte-level post-processor,
    BPE without dropout, no truncation or padding, special tokens not encoded from text."""
    pre = component_settings(tokenizer.pre_tokenizer)
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or [step.get("type") for step in steps] != ["Split", "ByteLevel"]:
        return False
    split, byte_level = steps
    return (
        split.get("pattern") == {"Regex": QWEN_PRETOKENIZER_PATTERN}
        and split.get("behavior") == "Isolated"
        and split.get("invert") is False
        and byte_level.get("use_regex") is False
        and byte_level.get("add_prefix_space") is False
        and component_settings(tokenizer.normalizer).get("type", "NFC") == "NFC"
        and component_settings(tokenizer.post_processor).get("type", "ByteLevel") == "ByteLevel"
        and isinstance(tokenizer.model, models.BPE)
        and not tokenizer.model.dropout
        and tokenizer.truncation is None
        and tokenizer.padding is None
        and not getattr(tokenizer, "encode_special_tokens", False)
    )


def byte_level_chars() -> list[str]:
    """The byte-level alphabet of GPT-2-style BPE, by byte: the printable Latin-1 bytes stand for themselves,
    the other 68 for the code points from 256 on, in byte order (checked against the tokenizer's alphabet
    before use)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = {byte: chr(byte) for byte in printable}
    for offset, byte in enumerate(byte for byte in range(256) if byte not in chars):
        chars[byte] = chr(256 + offset)
    return [chars[byte] for byte in range(256)]
