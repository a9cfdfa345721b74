"""Bounded mutable tail: texts with no character-class boundary near their end (runs of one symbol, base64,
minified JSON, CJK, emoji, white space, real tool output) keep a tail of at most TAIL_TOKENS tokens, and the trunk
stays the tokenizer's ids of the whole prompt at every step; the BPE frontier holds for every continuation tried
(tiny tokenizer, and the real Qwen3.5 one when ../shared has it)."""

from __future__ import annotations

import base64
import json
import random
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import flide_sdk as fl
from flide_sdk.prompt.chat import ChatFormat, load_chat_template
from flide_sdk.text.history import TAIL_TOKENS
from flide_sdk.text.pretokenizer import PATTERN_SPACE, byte_level_chars
from flide_sdk.text.tokens import Tokens

from .conftest import TOLERANCE, answer_probabilities, reference_probabilities

QWEN35_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "data" / "tokenizer" / "qwen3.5"
OBSERVATIONS = [o["text"] for o in json.loads(
    (Path(__file__).parent / "data" / "swe_agent_observations.json").read_text(encoding="utf-8"))["observations"]]
BYTES = byte_level_chars()


@pytest.fixture(scope="module")
def renderers(tiny_path) -> list[ChatFormat]:
    found = [ChatFormat.from_checkpoint(tiny_path, 1 << 22)]
    if QWEN35_TOKENIZER.is_dir():
        tokenizer = Tokenizer.from_file(str(QWEN35_TOKENIZER / "tokenizer.json"))
        found.append(ChatFormat(Tokens(tokenizer, 1 << 22), load_chat_template(QWEN35_TOKENIZER)))
    return found


def grow(renderer: ChatFormat, pieces: list, messages: bool = False) -> list[int]:
    """Append the pieces one by one, asserting at every step that the trunk is the tokenizer's ids of the whole
    prompt and that the stable part only grew; the tails."""
    history = renderer.new_state()
    appended, stable, tails = [], np.zeros(0, np.int64), []
    for step, piece in enumerate(pieces):
        history.append(piece)
        appended.append(piece)
        trunk = history.snapshot()
        body = json.dumps(appended, ensure_ascii=False) if messages else "".join(appended)
        whole = renderer.tokens.tokenizer.encode(renderer.head + body + "\n\n", add_special_tokens=False).ids
        assert trunk.tokens().tolist() == whole, step
        assert np.array_equal(trunk.stable[: len(stable)], stable), step
        stable = trunk.stable.copy()
        tails.append(len(trunk.tail))
    assert renderer.tokens.boundaries.tokens.refuted == 0
    return tails


def chunks(text: str, rng: random.Random, sizes=(1, 7, 60, 400)) -> list[str]:
    out, at = [], 0
    while at < len(text):
        size = rng.choice(sizes)
        out.append(text[at : at + size])
        at += size
    return out


def _texts() -> dict[str, list[str]]:
    rng = random.Random(0)
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    record = {"id": 17, "tags": ["a", "b"], "nested": {"k": [1, 2.5, None, True], "s": "x=y&z"}, "v": "ok"}
    return {
        "equals signs (issue 29)": ["=" * 400] * 12,
        "dashes and equals": ["-=" * 150 + "=-" * 50] * 12,
        "base64": chunks(base64.b64encode(rng.randbytes(3600)).decode(), rng),
        "base64 without digits": chunks("".join(rng.choice(letters + "+/") for _ in range(4000)), rng),
        "minified JSON": chunks(json.dumps([record] * 60, separators=(",", ":")), rng),
        "CJK without spaces": chunks("".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(3000)), rng),
        "Thai without spaces": chunks("สวัสดีครับผมชื่อสมชายยินดีที่ได้รู้จักสัมภาษณ์" * 60, rng),
        "emoji": chunks("🙂👍🏽✅🔥👨‍👩‍👧❤️" * 150, rng),
        "spaces": [" " * 400] * 12,
        "line break, then spaces": ["\n"] + [" " * 400] * 12,
        "line breaks": ["\n" * 200] * 12,
        "spaces and line breaks": chunks("".join(rng.choice([" ", "\n", "\t", "\r\n", "  \n"]) for _ in range(3000)), rng),
        "ideographic and no-break spaces": chunks("\u3000\xa0" * 1500, rng),
        "tool output": [piece for text in OBSERVATIONS for piece in chunks(text, rng)],
    }


TEXTS = _texts()


@pytest.mark.parametrize("name", list(TEXTS))
def test_tail_stays_bounded_and_exact(renderers, name):
    for renderer in renderers:
        tails = grow(renderer, TEXTS[name])
        assert max(tails) <= TAIL_TOKENS, (name, tails)


def test_message_contents_stay_bounded_and_exact(renderers):
    rng = random.Random(1)
    messages = [{"role": "tool", "content": "=" * 300}, {"role": "assistant", "content": "東京" * 200}]
    messages += [{"role": "tool", "content": piece} for piece in chunks(OBSERVATIONS[1], rng, (200, 800))]
    for renderer in renderers:
        assert max(grow(renderer, messages, messages=True)) <= TAIL_TOKENS


def test_one_long_append_is_cut_near_its_end(renderers):
    for renderer in renderers:
        for text in ("=" * 30_000, "東京都" * 5000, " " * 30_000, "\n" + " " * 30_000):
            trunk = renderer.trunk(text)
            assert trunk.tokens().tolist() == renderer.tokens.tokenizer.encode(
                renderer.head + text + "\n\n", add_special_tokens=False).ids
            assert len(trunk.tail) <= TAIL_TOKENS


# a few alphabets each; they mix runs, marks, jamo, added-token pieces, control and white-space characters
ALPHABET = ["=", "-", " ", "  ", "\n", "\t", "\r", "\r\n", "東", "京", "の", "a", "Z", "+", "/", "0", '"', "{", ":",
            "🙂", "🏽", "\u200d", "\ufe0f", "é", "e\u0301", "'", "s", "<", "|", "im_", "end", ">", "<|im_end|>",
            "<think>", "\u3000", "\xa0", "\x0b", "\x85", "\u2028", "\x1c", "한", "\u1100\u1161", "ก", "\u0e31", "Ð",
            "\x1b[0m", "\x00", "…"]


def test_random_appends_stay_exact_and_bounded(renderers):
    """Fuzz with a fixed seed: exact at every step; bounded unless the text's end is not in NFC (decomposed
    letters or jamo) or is a run of combining marks with no base, which no cut can bound (the design note)."""
    rng = random.Random(2)
    trials = [(rng.sample(ALPHABET, rng.randint(1, 3)), rng.randrange(1 << 30)) for _ in range(24)]
    for renderer in renderers:
        for alphabet, seed in trials:
            steps = random.Random(seed)
            weights = [steps.random() for _ in alphabet]
            pieces = ["".join(steps.choices(alphabet, weights, k=steps.choice([1, 5, 40, 300, 900])))
                      for _ in range(steps.randint(3, 12))]
            tails = grow(renderer, pieces)
            text = "".join(pieces)
            if unicodedata.is_normalized("NFC", text) and not any(unicodedata.category(c)[0] == "M" for c in text):
                assert max(tails) <= TAIL_TOKENS, alphabet


def test_every_cut_holds_for_every_continuation(renderers):
    """Each stable boundary R that TokenCuts proves for a text T (not only the last one, which sessions take),
    against random continuations S: the tokenizer's ids of T + S are those of (T + S)[:R], which are the ids
    given with R, followed by those of (T + S)[R:]."""
    rng = random.Random(4)
    texts = [TEXTS[name][0] * 2 for name in TEXTS] + [TEXTS["tool output"][i] for i in range(0, 40, 4)]
    texts += ["".join(rng.choices(rng.sample(ALPHABET, rng.randint(1, 4)), k=rng.choice([30, 300])))
              for _ in range(40)]
    # and the edges of each rule: a symbol run before a letter, contractions, white space around line breaks,
    # jamo that NFC joins, an added token's start
    texts += ["x:::a::", "a===b==", "they're  \n  \n   ", "'reading'''x", "they'llama and", "=== \n\n  ",
              "東京\u3000\u3000\u3000", "a\n\n\n    ", "  \n    ", "\t\n  x", "가\u1100\u1161", "아\u11a8아", "ab<|im_"]
    for renderer in renderers:
        encode = renderer.tokens.tokenizer.encode
        for text in texts:
            found = list(renderer.tokens.boundaries.tokens.cuts(text))
            for cut, before in found[:4] + rng.sample(found[4:], min(4, len(found[4:]))):
                for _ in range(6):
                    more = "".join(rng.choices(ALPHABET + ["x", "\n", " ", "s", "\u0301"], k=rng.choice([1, 2, 9])))
                    whole = encode(text + more, add_special_tokens=False).ids
                    assert whole[: len(before)] == before.tolist(), (text, cut, more)
                    assert whole[len(before) :] == encode((text + more)[cut:], add_special_tokens=False).ids


def test_session_tail_is_bounded_through_the_engine(engine, tiny_path, hf_tiny):
    """The issue's case through the public path: 12 appends of 400 '=' left a 4,802-token tail to recompute at
    every ask; now each ask recomputes at most TAIL_TOKENS tail tokens, and answers stay exact."""
    questions = {"stuck": fl.Noul("Is the agent stuck?"), "next": fl.Choice("Next?", {"read": None, "edit": None})}
    session = engine.session()
    state, previous = "", (0, 0)  # (trunk tokens, mutable tail) of the previous ask
    for _ in range(12):
        session.append("=" * 400)
        state += "=" * 400
        before = engine.stats()
        answers = session.ask_sync(questions)
        after = engine.stats()
        rendered = engine.render(state, questions)
        tail = after["mutable_tail_tokens"]
        assert tail <= TAIL_TOKENS
        branches = sum(len(q.ids) for q in rendered.questions.values())
        new = len(rendered.state_ids) - previous[0]
        assert after["tokens_computed"] - before["tokens_computed"] <= new + previous[1] + branches
        previous = (len(rendered.state_ids), tail)
    assert engine.stats()["max_mutable_tail_tokens"] <= TAIL_TOKENS
    assert rendered.state_ids.tolist() == engine.tokens.tokenizer.encode(
        engine.prompt.head + state + "\n\n", add_special_tokens=False).ids
    with fl.Engine.load(tiny_path, device="cpu", pool_bytes=0) as fresh:
        alone = fresh.ask_sync(state, questions)
    for name in questions:
        expected = reference_probabilities(hf_tiny, rendered, name)
        assert np.abs(answer_probabilities(answers[name]) - expected).max() <= TOLERANCE
        assert np.abs(answer_probabilities(answers[name]) - answer_probabilities(alone[name])).max() <= TOLERANCE


def _tokens(tokenizer: Tokenizer, word: str) -> list[int]:
    return [token.id for token in tokenizer.model.tokenize(word)]


def test_frontier_holds_for_every_continuation(renderers):
    """MergeTable.frontier against brute force: for words of runs, scripts and, on Qwen3.5, the parts of its
    merges that run out of rank order, every continuation keeps the tokens before the frontier."""
    rng = random.Random(3)
    scripts = ["=", "=-", " ", " \n", "ab", "東京都大阪府日本の", "🙂👍🏽✅", "{}[]\":,", "привет", "สวัสดีสัม", "いっぱい"]
    for renderer in renderers:
        table = renderer.tokens.boundaries.tokens.table
        alphabets = [[BYTES[b] for b in s.encode()] for s in scripts]
        late = np.flatnonzero(table.made_high > np.floor(table.made_high))  # made by merges out of rank order
        alphabets += [[table.tokenizer.id_to_token(int(t)) for t in (table.left[m], table.right_part[m], m)]
                      for m in late]
        for alphabet in alphabets:
            for _ in range(6):
                word = "".join(rng.choices(alphabet, k=rng.choice([3, 40, 400])))
                ids = _tokens(table.tokenizer, word)
                frontier = table.frontier(word, ids)
                if frontier is None:
                    continue
                lengths = np.cumsum(table.length[ids])
                kept = ids[: int(np.searchsorted(lengths, frontier, side="right"))]
                for _ in range(12):
                    more = "".join(rng.choices(alphabet + [BYTES[ord("x")], BYTES[ord(" ")]], k=rng.choice([1, 3, 50])))
                    assert _tokens(table.tokenizer, word + more)[: len(kept)] == kept, (word, more)


def test_pattern_white_space_is_the_tokenizers(renderers):
    """The \\s of the pre-tokenizer's pattern is Unicode White_Space: three of a character between digits split
    as white space (two, then one) exactly for PATTERN_SPACE, among every character Python, Unicode or the
    pattern could count as space."""
    candidates = {chr(c) for c in range(0x110000) if chr(c).isspace() or unicodedata.category(chr(c))[0] in "ZC"
                  and c < 0x3100 and not 0xD800 <= c < 0xE000} | {"\u180e", "\u200b", "\ufeff"}
    for renderer in renderers:
        split = renderer.tokens.tokenizer.pre_tokenizer.pre_tokenize_str
        spaces = {c for c in candidates if [o for _, o in split(f"1{c * 3}1")] == [(0, 1), (1, 3), (3, 4), (4, 5)]}
        assert spaces | set("\r\n") == PATTERN_SPACE


def test_composition_seconds_that_are_no_marks_are_hangul_jamo():
    """The premise of the NFC check at a cut: every character that canonical composition joins to the one
    before it, and that has combining class 0, is a mark, or a Hangul vowel or trailing jamo."""
    seconds = set()
    for point in range(0x110000):
        parts = unicodedata.decomposition(chr(point)).split()
        if len(parts) == 2 and not parts[0].startswith("<"):
            seconds.add(chr(int(parts[1], 16)))
    plain = [c for c in seconds if unicodedata.combining(c) == 0 and unicodedata.category(c)[0] != "M"]
    assert plain == []  # Hangul syllables compose algorithmically, outside the decomposition table


def test_merge_table_knows_the_out_of_order_merges(renderers):
    for renderer in renderers:
        table = renderer.tokens.boundaries.tokens.table
        assert table.unique
        assert table.out_of_order == (31 if table.size > 200_000 else 0)  # 27 with a part made later, 4 on those
