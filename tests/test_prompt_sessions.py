"""Sessions resume on every prompt format: an agent's message list replayed step by step through a JEV head and a
template that prints the messages one by one computes per step only its new tokens and a short tail, and answers
as transformers' `pipeline("decision")` does on the whole state at every step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import flide_sdk as fl

from .test_decision_models import copy_tiny, jev_model, jev_next_to_weights
from .test_decision_pipeline import assert_as_pipeline

STEPS = json.loads((Path(__file__).parent / "data" / "mini_swe_agent_steps.json").read_text())["messages"]
QUESTIONS = {
    "stuck": {"type": "noul", "instructions": "Is the agent stuck in a loop?"},
    "next": {"type": "choice", "instructions": "What comes next?",
             "criteria": {"read": "inspect code", "edit": None, "test": "run the tests"}},
    "progress": {"type": "score", "instructions": "How far along is the fix?", "criteria": ["none", "some", "done"]},
}
ITEM_BY_ITEM = """<|im_start|>user
{% for m in state %}[{{ m.role }}] {{ m.content }}
{% endfor %}<|im_end|>
<|im_start|>assistant
{{ question.type }}: {{ question.instructions }} ({{ question.labels | join('/') }})<|mark|>"""
TAIL = 64  # tokens a resumed trunk may recompute before its new ones (`text.history.TAIL_TOKENS`)


def build(kind: str, tiny_path: Path, root: Path):
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, pipeline

    if kind == "jev":
        path = jev_next_to_weights(tiny_path, root / kind)
        model = jev_model(path)
    else:
        path = copy_tiny(tiny_path, root / kind)
        (path / "decision_template.jinja").write_text(ITEM_BY_ITEM)
        (path / "decision.json").write_text(json.dumps({"labels": {"noul": ["yes", "no"]}}))
        model = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, pipeline("decision", model=model, tokenizer=AutoTokenizer.from_pretrained(path))


def fresh_tokens(previous: dict[str, np.ndarray], current: dict[str, np.ndarray]) -> int:
    """Tokens of this step's trunks past what the previous step's same trunk (a question's) held as a prefix."""
    fresh = 0
    for trunk in {tuple(ids.tolist()) for ids in current.values()}:
        shared = 0
        for before in previous.values():
            n = min(len(before), len(trunk))
            same = np.asarray(before[:n]) == np.asarray(trunk[:n])
            shared = max(shared, n if same.all() else int(np.argmin(same)))
        fresh += len(trunk) - shared
    return fresh


@pytest.mark.parametrize("kind", ["jev", "item_by_item"])
def test_an_agent_replay_computes_its_new_tokens_and_a_short_tail(kind, tiny_path, tmp_path):
    # mutation: `with_save_mark` returning None (no save point inside the state: the trunk saved at its end) ->
    # every step recomputes its whole history -> the token bound fails from the second step on
    path, decide = build(kind, tiny_path, tmp_path)
    with fl.Engine.load(path, device="cpu", dtype="float32") as engine:
        session, state, previous, steps = engine.session(), [], {}, 0
        for message in STEPS:
            session.append(message)
            state.append(message)
            if message["role"] == "assistant":
                continue
            before = engine.stats()["tokens_computed"]
            answers = session.ask_sync(QUESTIONS)
            computed = engine.stats()["tokens_computed"] - before
            assert_as_pipeline(decide, state, QUESTIONS, answers)
            rendered = engine.render(state, QUESTIONS)
            trunks = {name: rendered.trunks.get(name, rendered.state_ids) for name in QUESTIONS}
            copies = len({tuple(ids.tolist()) for ids in trunks.values()})
            branches = sum(len(q.ids) for q in rendered.questions.values())
            if previous:
                assert computed <= fresh_tokens(previous, trunks) + branches + TAIL * copies, steps
            previous, steps = trunks, steps + 1
        assert steps >= 20
