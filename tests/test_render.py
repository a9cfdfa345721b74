"""Rendering (DESIGN.md §4): pinned prompt texts, labels, and trunk + branch == the tokenizer's ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flide_sdk as fl
from flide_sdk.render import Renderer, load_chat_template

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
    assert engine.renderer.prompt_text(state, question) == HEAD + content + TAIL


def test_labels_and_label_ids(engine):
    rendered = engine.render("s", {"c": fl.Choice("?", {"a": None, "b": None, "c": None}), "n": fl.Noul("?"),
                                   "s": fl.Score("?", ["x"] * 4), "big": fl.Score("?", ["x"] * 11)})
    assert rendered.questions["c"].labels == ("A", "B", "C")
    assert rendered.questions["n"].labels == ("yes", "no")
    assert rendered.questions["s"].labels == ("0", "1", "2", "3")
    assert rendered.questions["big"].labels == tuple("ABCDEFGHIJK")
    tokenizer = engine.renderer.tokenizer
    for question in rendered.questions.values():
        assert [tokenizer.decode([i]) for i in question.label_ids] == list(question.labels)


def _states(renderer) -> list:
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


def _check_split(renderer, transformers_tokenizer) -> None:
    for state in _states(renderer):
        rendered = renderer.render(state, QUESTIONS)
        for name, question in QUESTIONS.items():
            text = renderer.prompt_text(state, question)
            expected = transformers_tokenizer(text, add_special_tokens=False)["input_ids"]
            assert rendered.prompt_ids(name).tolist() == expected, (state, name)
            assert len(rendered.questions[name].ids) > 0


def test_trunk_plus_branch_equals_tokenizer_ids(tiny_path, engine):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    _check_split(engine.renderer, tokenizer)
    # and the text itself is what transformers' chat template renders for that user turn
    for state in _states(engine.renderer)[:4]:
        for question in QUESTIONS.values():
            text = engine.renderer.prompt_text(state, question)
            content = text[len(HEAD) : -len(TAIL)]
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True, enable_thinking=False
            )
            assert chat == text


@pytest.mark.skipif(not QWEN35_TOKENIZER.is_dir(), reason="the real Qwen3.5 tokenizer lives in ../shared/data")
def test_real_qwen35_tokenizer_split():
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    renderer = Renderer(
        Tokenizer.from_file(str(QWEN35_TOKENIZER / "tokenizer.json")), load_chat_template(QWEN35_TOKENIZER), 262144
    )
    assert renderer.head == HEAD and renderer.tail == TAIL
    hf = PreTrainedTokenizerFast(tokenizer_file=str(QWEN35_TOKENIZER / "tokenizer.json"))
    _check_split(renderer, hf)
    # the public non-thinking chat prompt of Qwen3.5 (../shared/data/README.md)
    ids = renderer._encode(HEAD + "Hello" + TAIL).tolist()
    assert ids == [248045, 846, 198, 9419, 248046, 198, 248045, 74455, 198, 248068, 271, 248069, 271]


def test_trunk_stops_before_question_text(engine):
    rendered = engine.render("state text", {"q": fl.Noul("Is it?"), "r": fl.Noul("Is it?")})
    trunk_text = engine.renderer.tokenizer.decode(rendered.state_ids.tolist(), skip_special_tokens=False)
    assert trunk_text.endswith("state text\n\n")
    assert np.array_equal(rendered.questions["q"].ids, rendered.questions["r"].ids)
