"""Options scored by their text (`Choice(scoring="text")`): each option's probability is the softmax over the
options of the log-likelihood of `prompt + option tokens + <|im_end|>`, teacher-forced, as transformers gives it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import flide_sdk as fl
from flide_sdk.prompt.chat import MAX_REPLY_TOKENS

from .conftest import TOLERANCE, answer_probabilities, text_of_tokens

LONG = "open the module to look at the function that returns the value and then run the test again because"


def options(tokens) -> dict[str, list[str]]:
    """Option sets: 1-token options, options that are prefixes of others, and ~40-token options sharing most
    of their tokens."""
    long_base = text_of_tokens(tokens, 35, seed=5)
    sets = {
        "short": ["a", "b", "c d", "the"],
        "prefix": ["the test", "the test failed", "the test failed again", "the refund"],
        "long": [long_base + ending for ending in (" the test", " the refund", " a", " b c")],
    }
    lengths = [len(tokens.encode(option)) for option in sets["long"]]
    assert min(lengths) >= 36 and max(lengths) <= 40, lengths
    return sets


def text_choice(names: list[str], instructions: str = "What does the agent do next?") -> fl.Choice:
    return fl.Choice(instructions, {name: None for name in names}, scoring="text")


def teacher_forced(hf_model, engine, state, name: str, question: fl.Choice) -> np.ndarray:
    """softmax over the options of log p(option tokens + <|im_end|> | prompt), each option run alone (float64)."""
    prompt = engine.render(state, {name: question}).prompt_ids(name)
    end = engine.tokens.tokenizer.token_to_id("<|im_end|>")
    scores = []
    for option in question.option_names():
        reply = np.append(engine.tokens.encode(option), end)
        ids = torch.as_tensor(np.concatenate([prompt, reply]))[None]
        with torch.no_grad():
            logprobs = torch.log_softmax(hf_model(ids).logits[0].double(), dim=-1)
        reading = logprobs[len(prompt) - 1 : len(prompt) - 1 + len(reply)]
        scores.append(float(reading.gather(1, torch.as_tensor(reply)[:, None]).sum()))
    return torch.softmax(torch.tensor(scores, dtype=torch.float64), dim=0).numpy()


def worst_error(hf_model, engine, state, questions: dict, answers) -> float:
    worst = 0.0
    for name, question in questions.items():
        if isinstance(question, fl.Choice) and question.scoring == "text":
            expected = teacher_forced(hf_model, engine, state, name, question)
            worst = max(worst, float(np.abs(answer_probabilities(answers[name]) - expected).max()))
    return worst


@pytest.mark.asyncio
async def test_text_scores_match_teacher_forced_transformers_in_one_round(tiny_path, hf_tiny):
    async with fl.Engine.load(tiny_path, device="cpu", dtype="float32", round_deadline_ms=500) as engine:
        sets = options(engine.tokens)
        states = ["the agent read the file", text_of_tokens(engine.tokens, 301, seed=1)]
        asks = [(states[0], {"short": text_choice(sets["short"]), "prefix": text_choice(sets["prefix"]),
                             "label": fl.Noul("Is the agent stuck?")}),
                (states[1], {"long": text_choice(sets["long"]), "prefix": text_choice(sets["prefix"], "Which?")})]
        answers = await asyncio.gather(*(engine.ask(state, questions) for state, questions in asks))
        assert engine.stats()["rounds"] == 1, "the asks must share one round for this test to mean anything"
        spread = [name for response in answers for name, answer in response.items()
                  if isinstance(answer, fl.ChoiceAnswer) and sorted(answer.probabilities.values())[-2] > 0.01]
        assert len(spread) >= 2, "the options' probabilities must spread for |dp| to mean anything"
        for (state, questions), response in zip(asks, answers):
            assert worst_error(hf_tiny, engine, state, questions, response) <= TOLERANCE
            assert response["prefix"].choice in sets["prefix"]
        # the label question of the same ask is answered as it is alone
        alone = await engine.ask(states[0], {"label": fl.Noul("Is the agent stuck?")})
        assert abs(answers[0]["label"].noul - alone["label"].noul) <= TOLERANCE


def test_text_scores_stay_exact_in_a_resumed_session(engine, hf_tiny):
    question = {"next": text_choice(["the test", "the test failed", "a", "b c"])}
    session = engine.session()
    state = ""
    for step in range(3):
        growth = text_of_tokens(engine.tokens, 70 + 30 * step, seed=10 + step) + "\n"
        session.append(growth)
        state += growth
        response = session.ask_sync(question)
        assert worst_error(hf_tiny, engine, state, question, response) <= TOLERANCE
    assert engine.stats()["checkpoint_hits"] >= 2


def test_usage_counts_each_question_text_once_and_every_reply_token(engine):
    question = text_choice(["a", "the test failed"])
    response = engine.ask_sync("the agent ran the tests", {"next": question, "stuck": fl.Noul("Stuck?")})
    rendered = engine.render("the agent ran the tests", {"next": question, "stuck": fl.Noul("Stuck?")})
    replies = rendered.questions["next"].replies
    assert [len(reply) for reply in replies] == [len(engine.tokens.encode(o)) + 1 for o in question.option_names()]
    assert response.usage.output_tokens == sum(len(reply) for reply in replies) + 1
    assert response.usage.input_tokens == len(rendered.state_ids) + sum(len(q.ids) for q in rendered.questions.values())


def test_text_rendering_lists_options_as_written(engine):
    question = fl.Choice("Which command?", {"ls -la": None, "pytest": "run the tests"}, scoring="text")
    prompt = engine.prompt.prompt_text("state", question)
    assert "Question: Which command?\n- ls -la\n- pytest: run the tests\nAnswer with one option exactly as written." in prompt
    label = fl.Choice("Which command?", {"ls -la": None, "pytest": "run the tests"})
    assert "A: ls -la\nB: pytest - run the tests" in engine.prompt.prompt_text("state", label)
    # the two scorings of one question never share a cached rendering
    rendered = engine.render("state", {"text": question, "label": label}).questions
    assert rendered["text"].replies and not rendered["label"].replies and len(rendered["label"].label_ids) == 2


def test_dict_questions_take_scoring_and_bad_scoring_raises(single):
    engine = single  # no checkpoints: both asks computed alike, so their answers are equal, not just close
    as_dict = {"type": "choice", "instructions": "Which?", "criteria": {"a": None, "b c": None}, "scoring": "text"}
    response = engine.ask_sync("the agent", {"q": as_dict})
    direct = engine.ask_sync("the agent", {"q": fl.Choice("Which?", {"a": None, "b c": None}, scoring="text")})
    assert response["q"] == direct["q"]
    assert fl.Choice("Which?", {"a": None}, scoring="text").to_dict()["scoring"] == "text"
    assert "scoring" not in fl.Choice("Which?", {"a": None}).to_dict()  # the TypeSafe wire form, unchanged
    with pytest.raises(fl.InvalidQuestionError, match="scoring"):
        fl.Choice("Which?", {"a": None}, scoring="tokens")
    with pytest.raises(fl.InvalidQuestionError, match="scoring"):
        engine.ask_sync("the agent", {"q": {**as_dict, "scoring": "labels"}})
    with pytest.raises(fl.InvalidQuestionError, match="unknown field"):
        engine.ask_sync("the agent", {"q": {"type": "noul", "instructions": "?", "scoring": "text"}})


def test_replies_past_the_budget_raise_and_many_options_need_no_labels(engine):
    words = text_of_tokens(engine.tokens, 300, seed=3)
    too_long = text_choice([f"{words} {i}" for i in range(4)])
    with pytest.raises(fl.InvalidQuestionError, match=f"at most {MAX_REPLY_TOKENS}"):
        engine.ask_sync("the agent", {"q": too_long})
    many = text_choice([f"option {i}" for i in range(30)])  # more options than letters: text needs no labels
    response = engine.ask_sync("the agent", {"q": many})
    assert len(response["q"].probabilities) == 30
    assert abs(sum(response["q"].probabilities.values()) - 1.0) < 1e-9


def test_a_round_counts_each_option_piece_against_its_branch_limit(engine):
    """A text-scored question takes a piece per option and per shared prefix: the scheduler splits rounds by
    pieces, so a round fits its graph capacity's branch rows; and by scratch state rows (a trunk's, and one per
    piece others continue: the question's, a shared prefix's)."""
    from flide_sdk.serve.scheduler import RoundLimits, schedule

    question = {"next": text_choice(["a", "b c", "the test", "run the test again", "the refund"])}
    asks = [engine.prepare(f"state {i}", question) for i in range(3)]
    pieces = len(asks[0].branches.lengths)
    assert pieces == 7, "the question, 'a', 'b c', 'the' and its two rests, 'run the test again'"
    batch = schedule(asks, lambda trunk: None, RoundLimits(tokens=10_000, requests=64, questions=2 * pieces))
    assert len(batch.asks) == 2 and batch.kept == asks[2:], "a third ask passes the branch limit"
    batch = schedule(asks, lambda trunk: None, RoundLimits(tokens=10_000, requests=6, questions=99))
    assert len(batch.asks) == 2 and batch.kept == asks[2:], "3 state rows each: a third ask passes 6"


def test_options_with_a_first_token_in_common_share_their_prefix():
    """The options' token tree: options starting alike share a piece of their common prefix, each option's rest
    a piece under it; every option is read along its own path (its first token at the question's last)."""
    from flide_sdk.plan.requests import Branches

    question = np.array([7, 7, 7])
    replies = [np.array(r) for r in ([1, 2, 9], [1, 2, 3, 4, 9], [1, 5, 9], [6, 9], [1, 2, 9])]
    branches = Branches.of([question], [np.zeros(0, np.int64)], [replies])
    assert branches.lengths.tolist() == [3, 1, 1, 3, 1, 1, 1]  # question, [1], [2], [2 3 4], [5], [2], [6]
    assert branches.parents.tolist() == [-1, 0, 1, 1, 1, 1, 0]
    assert branches.ids.tolist() == [7, 7, 7, 1, 2, 2, 3, 4, 5, 2, 6]
    assert branches.inner == 2 and branches.counts.tolist() == [7] and branches.readout.tolist() == [2]
    reads = branches.reads
    for option, reply in enumerate(replies):
        mine = reads.option == option
        assert reads.target[mine].tolist() == reply.tolist()
        # each read row holds the token before its target: the question's last, then the option's own tokens
        assert branches.ids[reads.offset[mine]].tolist() == [7] + reply[:-1].tolist()
