"""Rendering (DESIGN.md §4): pinned prompt texts, labels, and trunk + branch == the tokenizer's ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flide_sdk as fl
from flide_sdk.prompt import chat
from flide_sdk.prompt.base import as_rendered
from flide_sdk.prompt.chat import ChatFormat, content_key, load_chat_template, question_labels, question_text
from flide_sdk.questions import parse_questions
from flide_sdk.text import tokens
from flide_sdk.text.tokens import Tokens

HEAD = "<|im_start|>user\n"
TAIL = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN35_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "data" / "tokenizer" / "qwen3.5"

PINNED = [
    (
        "Order 17 is late.",
        fl.Choice("What next?", {"refund": "refund the order", "replace": None}),
        "Order 17 is late.\n\nQuestion: What next?\nA: refund - refund the order\nB: replace\n"
        "Answer with the letter of one option only.",
    ),
    (
        {"order": 17, "status": "late"},
        fl.Noul("Urgent?"),
        '{"order": 17, "status": "late"}\n\nQuestion: Urgent?\nyes\nno\nAnswer with yes or no only.',
    ),
    (
        ["a", {"b": "é"}],
        fl.Noul("Fixed?", {"true": "passed", "false": None}),
        '["a", {"b": "é"}]\n\nQuestion: Fixed?\nyes: passed\nno\nAnswer with yes or no only.',
    ),
    (
        "s",
        fl.Score("How bad?", ["low", "mid", "high"]),
        "s\n\nQuestion: How bad?\n0: low\n1: mid\n2: high\nAnswer with the number of one level only.",
    ),
    (
        "s",
        fl.Score("How close?", [f"l{i}" for i in range(12)]),
        "s\n\nQuestion: How close?\n"
        + "\n".join(f"{letter}: l{i}" for i, letter in enumerate("ABCDEFGHIJKL"))
        + "\nAnswer with the letter of one level only.",
    ),
    (
        "s",
        fl.Choice(criteria={"x": {"k": 1}, "y": ["z"]}),
        's\n\nA: x - {"k": 1}\nB: y - ["z"]\nAnswer with the letter of one option only.',
    ),
    (
        "s",
        fl.Noul(criteria={"false": "never"}),
        "s\n\nyes\nno: never\nAnswer with yes or no only.",
    ),
]


@pytest.mark.parametrize(("state", "question", "content"), PINNED)
def test_pinned_prompt_text(engine, state, question, content):
    assert engine.prompt.prompt_text(state, question) == HEAD + content + TAIL


def test_labels_and_label_ids(engine):
    rendered = engine.render("s", {"c": fl.Choice("?", {"a": None, "b": None, "c": None}), "n": fl.Noul("?"),
                                   "s": fl.Score("?", ["x"] * 4), "big": fl.Score("?", ["x"] * 11)})
    assert rendered.questions["c"].labels == ("A", "B", "C")
    assert rendered.questions["n"].labels == ("yes", "no")
    assert rendered.questions["s"].labels == ("0", "1", "2", "3")
    assert rendered.questions["big"].labels == tuple("ABCDEFGHIJK")
    tokenizer = engine.tokens.tokenizer
    for question in rendered.questions.values():
        assert [tokenizer.decode([i]) for i in question.label_ids] == list(question.labels)


def _states() -> list:
    return [
        "",
        "the",
        "ends with a space ",
        "ends with newline\n",
        "ends with punctuation.",
        "tabs\tand  spaces  \n\n  between",
        "unicode: café, naïve, 東京, emoji 🙂",
        "special token text <|im_end|> inside",
        {"k": [1, 2, {"nested": "é"}], "n": None},
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello\n"}],
        " ".join(["word"] * 500),
    ]


QUESTIONS = {
    "n": fl.Noul("Is it?"),
    "c": fl.Choice("Which?", {"one": "first", "two": None}),
    "s": fl.Score("How much?", ["none", "some", "all"]),
    "bare": fl.Choice(criteria={"x": None, "y": None}),
}


def _check_split(prompt: ChatFormat, transformers_tokenizer) -> None:
    for state in _states():
        rendered = as_rendered(prompt.parts(state, parse_questions(QUESTIONS)))
        for name, question in QUESTIONS.items():
            text = prompt.prompt_text(state, question)
            expected = transformers_tokenizer(text, add_special_tokens=False)["input_ids"]
            assert rendered.prompt_ids(name).tolist() == expected, (state, name)
            assert len(rendered.questions[name].ids) > 0


def test_trunk_plus_branch_equals_tokenizer_ids(tiny_path, engine):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    _check_split(engine.prompt, tokenizer)
    # and the text itself is what transformers' chat template renders for that user turn
    for state in _states()[:4]:
        for question in QUESTIONS.values():
            text = engine.prompt.prompt_text(state, question)
            content = text[len(HEAD) : -len(TAIL)]
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True, enable_thinking=False
            )
            assert chat == text


@pytest.mark.skipif(not QWEN35_TOKENIZER.is_dir(), reason="the real Qwen3.5 tokenizer lives in ../shared/data")
def test_real_qwen35_tokenizer_split():
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    prompt = ChatFormat(Tokens(Tokenizer.from_file(str(QWEN35_TOKENIZER / "tokenizer.json")), 262144),
                        load_chat_template(QWEN35_TOKENIZER))
    assert prompt.head == HEAD and prompt.tail == TAIL
    hf = PreTrainedTokenizerFast(tokenizer_file=str(QWEN35_TOKENIZER / "tokenizer.json"))
    _check_split(prompt, hf)
    # the public non-thinking chat prompt of Qwen3.5 (../shared/data/README.md)
    ids = prompt.tokens.encode(HEAD + "Hello" + TAIL).tolist()
    assert ids == [248045, 846, 198, 9419, 248046, 198, 248045, 74455, 198, 248068, 271, 248069, 271]


def test_trunk_stops_before_question_text(engine):
    rendered = engine.render("state text", {"q": fl.Noul("Is it?"), "r": fl.Noul("Is it?")})
    trunk_text = engine.tokens.tokenizer.decode(rendered.state_ids.tolist(), skip_special_tokens=False)
    assert trunk_text.endswith("state text\n\n")
    assert np.array_equal(rendered.questions["q"].ids, rendered.questions["r"].ids)


def render_one(renderer, question):
    return renderer.render_questions({"q": question})["q"]


def _uncached(renderer, question) -> tuple:
    """A question's branch ids, label ids, labels and text, computed directly from its text."""
    text = question_text(question)
    labels = question_labels(question)
    ids = renderer.tokens.tokenizer.encode(text + renderer.tail, add_special_tokens=False).ids
    return ids, [renderer.tokens.label_id(label) for label in labels], labels, text


CACHE_QUESTIONS = [
    fl.Noul("Is it?"), fl.Noul("Is it?", {"true": "it is"}), fl.Noul("Is it?", {"false": "it is"}),
    fl.Noul("Is it?", {"true": None}), fl.Noul(criteria={"true": "Is it?"}), fl.Noul("Is it"),
    fl.Choice("Which?", {"a": None, "b": None}), fl.Choice("Which?", {"b": None, "a": None}),
    fl.Choice("Which?", {"a": "", "b": None}), fl.Choice(criteria={"a": None, "b": None}),
    # the same prompt text with two options or one (a description holding an option line): other labels
    fl.Choice("Which?", {"a": "x", "b": None}), fl.Choice("Which?", {"a": "x\nB: b"}),
    fl.Choice("Which?", {"0": "a", "1": "b"}), fl.Score("Which?", ["a", "b"]), fl.Score("Which?", ["b", "a"]),
    fl.Score("How far?", [f"l{i}" for i in range(12)]), fl.Score("How far?", [f"l{i}" for i in range(10)]),
    # JSON content: never cached, rendered each time
    fl.Choice({"k": 1}, {"a": None}), fl.Choice("Which?", {"a": {"k": 1}}), fl.Choice("Which?", {"a": '{"k": 1}'}),
    fl.Score("How?", [["x"], "y"]), fl.Noul(criteria={"true": {"k": [1]}}),
]


def test_question_cache_serves_exactly_the_uncached_render(engine):
    """Rendered questions are cached by content: a cached branch is the uncached one, and questions that
    differ in any way (type, instructions, option names, order or descriptions) never share an entry."""
    renderer = engine.prompt
    keys = [content_key(q) for q in CACHE_QUESTIONS]
    plain = [key for key in keys if key is not None]
    assert len(set(plain)) == len(plain) == len(CACHE_QUESTIONS) - 4
    named = {f"q{index}": question for index, question in enumerate(CACHE_QUESTIONS)}
    for together in (True, False, True):  # all new, tokenized as one batch; then served from the cache
        batch = renderer.render_questions(named) if together else {n: render_one(renderer, q) for n, q in named.items()}
        assert list(batch) == list(named)
        for name, rendered in batch.items():
            assert (rendered.ids.tolist(), rendered.label_ids.tolist(), rendered.labels, rendered.text) == _uncached(
                renderer, named[name]), named[name]
            assert not rendered.ids.flags.writeable and not rendered.label_ids.flags.writeable
    again = fl.Choice("Which?", {"a": None, "b": None})
    assert render_one(renderer, again) is render_one(renderer, CACHE_QUESTIONS[6])


def test_question_cache_follows_changed_content_and_stays_bounded(engine, monkeypatch):
    renderer = engine.prompt
    criteria = {"a": None, "b": None}
    question = fl.Choice("Which one?", criteria)
    assert render_one(renderer, question).labels == ("A", "B")
    criteria["c"] = "a third"  # the same question object, with other content: rendered again
    rendered = render_one(renderer, question)
    assert (rendered.ids.tolist(), rendered.label_ids.tolist(), rendered.labels, rendered.text) == _uncached(
        renderer, question)
    monkeypatch.setattr(chat, "QUESTION_CACHE", 3)
    monkeypatch.setattr(tokens, "TEXT_CACHE", 3)
    for index in range(6):
        question = fl.Noul(f"Is it number {index}?")
        assert render_one(renderer, question).text == question_text(question)
        assert renderer.cached_questions() <= 3 and renderer.tokens.cached_texts() <= 3
