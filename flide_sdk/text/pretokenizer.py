"""What the text layer assumes of the tokenizer: the Qwen3.5 pre-tokenizer pattern, its white space, the byte-level
alphabet, and the checks that a tokenizer is that one.

The stable boundaries (`cuts`), the token-level cuts and the word encoder (`word_cache`) are exact only for a
byte-level BPE tokenizer whose pre-tokenizer splits by this pattern; they share these definitions here, so that
none of them imports another for them.
"""

from __future__ import annotations

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


def check_pretokenizer(tokenizer: Tokenizer) -> None:
    """Refuse tokenizers whose pre-tokenizer is not Qwen3.5's: the stable-boundary rules depend on it."""
    pre = component_settings(tokenizer.pre_tokenizer)
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    split = next((s for s in steps if s.get("type") == "Split"), {})
    byte_level = next((s for s in steps if s.get("type") == "ByteLevel"), {})
    normalizer = component_settings(tokenizer.normalizer).get("type")
    if (
        split.get("pattern", {}).get("Regex") != QWEN_PRETOKENIZER_PATTERN
        or byte_level.get("use_regex", True)
        or normalizer not in (None, "NFC")
    ):
        raise CheckpointError("unsupported tokenizer: flide_sdk needs the Qwen3.5 byte-level BPE pre-tokenizer")


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
