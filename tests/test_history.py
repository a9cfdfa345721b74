"""History: incremental tokenization equals tokenizing the whole state, the stable part never changes,
the mutable tail stays short, and block hashes chain."""

from __future__ import annotations

import bisect
import json
import random
from pathlib import Path

import numpy as np
import pytest

from flide_sdk.errors import InvalidStateError
from flide_sdk.prompt.chat import ChatFormat, load_chat_template
from flide_sdk.text import tokens as render
from flide_sdk.text.history import BLOCK, HASH_SEED, chain_hashes
from flide_sdk.text.tokens import Tokens

QWEN35_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "data" / "tokenizer" / "qwen3.5"
PIECES = [
    "the", " agent", " read", "ing", " file", ".", ",", " ", "  ", "\n", "\n\n", "\t", "12", "3", "4.5", "'s", "'re",
    "don", "'t", "café", "e\u0301", "東京", "🙂", "<|im_", "end|>", "<|im_end|>", "<think>", "</thi", "nk>", "!!!",
    '{"a": [1, 2]}', "x" * 30, " " * 7, "\r\n", "-", "_", "ü", "ß", "Ω", "٣", "\u200b", "#", "\\", '"',
]


def renderers(tiny_path):
    yield ChatFormat.from_checkpoint(tiny_path, 1 << 20)
    if QWEN35_TOKENIZER.is_dir():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(QWEN35_TOKENIZER / "tokenizer.json"))
        yield ChatFormat(Tokens(tokenizer, 1 << 20), load_chat_template(QWEN35_TOKENIZER))


def check_growth(renderer, steps, make_piece, expected_text) -> list[int]:
    history = renderer.new_state()
    previous_stable = np.zeros(0, dtype=np.int64)
    tails = []
    for step in range(steps):
        for _ in range(random.randint(1, 3)):
            history.append(make_piece(step))
        trunk = history.snapshot()
        whole = renderer.tokens.encode(renderer.head + expected_text(history) + "\n\n")
        assert trunk.tokens().tolist() == whole.tolist(), f"step {step}"
        assert trunk.stable[: len(previous_stable)].tolist() == previous_stable.tolist()
        previous_stable = trunk.stable.copy()
        assert trunk.hashes[: len(trunk.stable) // BLOCK] == chain_hashes(trunk.stable)
        tails.append(len(trunk.tail))
    assert len(previous_stable) > len(whole) - 65  # the boundary really advances
    return tails


def test_text_appends_tokenize_like_the_whole(tiny_path):
    for renderer in renderers(tiny_path):
        random.seed(0)
        appended: list[str] = []

        def piece(step):
            text = "".join(random.choice(PIECES) for _ in range(random.randint(1, 6)))
            appended.append(text)
            return text

        tails = check_growth(renderer, 120, piece, lambda h: "".join(appended))
        assert max(tails) <= 64


def test_message_appends_tokenize_like_json_list(tiny_path):
    for renderer in renderers(tiny_path):
        random.seed(1)
        messages: list[dict] = []

        def piece(step):
            content = "".join(random.choice(PIECES) for _ in range(random.randint(0, 8)))
            message = {"role": random.choice(["user", "assistant", "tool"]), "content": content}
            messages.append(message)
            return message

        tails = check_growth(renderer, 60, piece, lambda h: json.dumps(messages, ensure_ascii=False))
        assert max(tails) <= 64


def test_prose_keeps_a_short_tail(tiny_path):
    renderer = ChatFormat.from_checkpoint(tiny_path, 1 << 20)
    history = renderer.new_state()
    words = ["the", "agent", "read", "the", "file", "and", "found", "an", "error", "in", "line", "12", "then", "ran", "the", "test", "again"]
    for step in range(40):
        history.append(" " + " ".join(words[(step + i) % len(words)] for i in range(25)) + ".")
        assert len(history.snapshot().tail) <= 8


def test_fork_diverges_without_touching_the_parent(tiny_path):
    renderer = ChatFormat.from_checkpoint(tiny_path, 1 << 20)
    parent = renderer.new_state()
    parent.append("shared start of the story. ")
    parent.snapshot()
    child = parent.fork()
    parent.append("the parent goes left.")
    child.append("the child goes right.")
    left, right = parent.snapshot(), child.snapshot()
    assert left.tokens().tolist() == renderer.tokens.encode(renderer.head + "shared start of the story. the parent goes left.\n\n").tolist()
    assert right.tokens().tolist() == renderer.tokens.encode(renderer.head + "shared start of the story. the child goes right.\n\n").tolist()
    assert left.buffer is not right.buffer


def test_mixing_text_and_messages_is_refused(tiny_path):
    renderer = ChatFormat.from_checkpoint(tiny_path, 1 << 20)
    text = renderer.new_state()
    text.append("hello")
    with pytest.raises(InvalidStateError):
        text.append({"role": "user", "content": "hi"})
    messages = renderer.new_state()
    messages.append({"role": "user", "content": "hi"})
    with pytest.raises(InvalidStateError):
        messages.append("hello")
    with pytest.raises(InvalidStateError):
        messages.append({"content": "no role"})


def test_trunk_prefix_checks_and_hashes(tiny_path):
    renderer = ChatFormat.from_checkpoint(tiny_path, 1 << 20)
    a = renderer.trunk("word " * 200)
    b = renderer.trunk("word " * 200 + "and more")
    assert a.block_hash(0) == HASH_SEED
    blocks = len(a) // BLOCK
    assert a.block_hash(blocks) == b.block_hash(blocks) == chain_hashes(a.tokens()[: blocks * BLOCK])[-1]
    assert b.prefix_equals(a.buffer, a.boundary)
    assert not renderer.trunk("other " * 200).prefix_equals(a.buffer, a.boundary)


@pytest.mark.parametrize("cpus", [1, 2, 64])
def test_texts_encode_in_pieces_like_the_whole(tiny_path, monkeypatch, cpus):
    """encode_cut cuts texts at stable boundaries (about one piece per CPU, 128 to 512 characters each) and
    encodes the pieces in parallel; the ids are those of encoding the whole text at once, and at every stable
    boundary a token of the whole text starts, the count encode_cut reports before it (adversarial pieces
    included), for short texts and long ones, whatever the host's CPU count. (The parallel path: the word
    encoder, which takes most texts first, is off here; test_word_cache compares the two.)"""
    monkeypatch.setattr(render, "ENCODE_PIECES", cpus)
    rng = random.Random(7 + cpus)
    for renderer in renderers(tiny_path):
        renderer.tokens.words.enabled = False
        for trial in range(6):
            text = "".join(rng.choice(PIECES) for _ in range(rng.choice([rng.randint(60, 400), rng.randint(2000, 6000)])))
            cuts = renderer.tokens.boundaries.cuts(text, 2048)
            assert len(text) < 4096 or cuts, "a long text is encoded in more than one piece"
            whole = renderer.tokens.tokenizer.encode(text, add_special_tokens=False)
            starts = [start for start, _ in whole.offsets]
            for cut in [0, *renderer.tokens.boundaries.cuts(text, 61)[trial::6]]:
                ids, before = renderer.tokens.encode_cut(text, cut)
                assert ids.tolist() == whole.ids
                assert before == bisect.bisect_left(starts, cut) and (cut == 0 or starts[before] == cut)
