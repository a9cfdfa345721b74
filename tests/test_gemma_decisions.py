"""Decision models on a Gemma 4 base answer as `pipeline("decision")` does (float32 on CPU): a JEV head next to
the weights and saved as `JevForDecision` (its prompt after `<bos>`), a `decision.json` + template written in
Gemma 4's turns, and a decision config without a template (the generic prompt through Gemma's chat template,
its final-logit soft cap in the label softmax), and a JEV whose LoRA adapter (as Gemma-based deciders ship) the
engine merges at load; lone, over states far past the sliding window, and in sessions with forks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import flide_sdk as fl

from .conftest import text_of_tokens
from .test_decision_models import CALIBRATION, GENERIC_CONFIG, JUDGE, REPO_CONFIG, head_tensors, jev_model
from .test_decision_pipeline import QUESTIONS, assert_as_pipeline, assert_session_and_fork_as_pipeline
from .test_gemma4 import FEATURES, make_gemma_checkpoint
from .test_lora import save_adapter

GEMMA_QUESTION_TEMPLATE = """<bos><|turn>user
{{ state if state is string else state|tojson }}

Q: {{ question.instructions }}
{% for o in question.options %}{{ question.labels[loop.index0] }}) {{ o }}
{% endfor %}<turn|>
<|turn>model
Answer:<|mark|><turn|>"""
KINDS = ("jev", "jev_saved", "jev_lora", "question", "generic")
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"]}


def build(kind: str, root: Path):
    """(the checkpoint directory of `kind` on a tiny Gemma 4 base with KV sharing and per-layer inputs,
    transformers' decision pipeline on it)."""
    from transformers import AutoTokenizer, Gemma4ForCausalLM, JevForDecision, pipeline

    path = root / kind
    source = root / "jev_source" if kind == "jev_saved" else path
    make_gemma_checkpoint(source, **FEATURES["shared"])
    if kind.startswith("jev"):
        hidden = json.loads((source / "config.json").read_text())["hidden_size"]
        (source / "judge_config.json").write_text(json.dumps(JUDGE))
        (source / "calibration.json").write_text(json.dumps(CALIBRATION))
        save_file(head_tensors(hidden, 24), str(source / "head.safetensors"))
        if kind == "jev_lora":  # in the default `adapter/`, which the pipeline loads with peft, unmerged
            save_adapter(Gemma4ForCausalLM.from_pretrained(source, dtype=torch.float32), source / "adapter", seed=5,
                         **LORA)
        model = JevForDecision.from_pretrained(source, dtype=torch.float32).eval() if kind == "jev_lora" else (
            jev_model(source))
        if kind == "jev_saved":
            model.save_pretrained(path)
            AutoTokenizer.from_pretrained(source).save_pretrained(path)
            model = JevForDecision.from_pretrained(path, dtype=torch.float32).eval()
    else:
        if kind == "question":
            (path / "decision_template.jinja").write_text(GEMMA_QUESTION_TEMPLATE)
        (path / "decision.json").write_text(json.dumps(REPO_CONFIG if kind == "question" else GENERIC_CONFIG))
        model = Gemma4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, pipeline("decision", model=model, tokenizer=AutoTokenizer.from_pretrained(path))


@pytest.fixture(scope="module", params=KINDS)
def served(request, tmp_path_factory):
    path, decide = build(request.param, tmp_path_factory.mktemp("gemma-decision"))
    with fl.Engine.load(path, device="cpu", dtype="float32") as engine:
        yield request.param, engine, decide


@pytest.mark.parametrize("tokens", [1, 600])
def test_lone_asks_give_the_pipelines_probabilities(served, tokens):
    # mutations: the JEV prompt without its <bos> -> fails jev, jev_saved; the adapter not merged
    # (`MergePlan.merged` returning its input) -> fails jev_lora; a JEV on a gemma4_text base refused as before
    # -> the fixture fails
    _, engine, decide = served
    state = text_of_tokens(engine.tokens, tokens, seed=tokens)
    assert_as_pipeline(decide, state, QUESTIONS, engine.ask_sync(state, QUESTIONS))


def test_the_prompt_ids_are_the_pipelines(served):
    # mutation: Gemma's template trimming ignored for the generic prompt (the state's leading space kept) -> fails
    # generic
    kind, engine, decide = served
    state = "  I was charged twice for my order and want a refund. "
    prompts = decide.decision_config.prepare_inputs({"state": state, "questions": QUESTIONS}, decide.tokenizer)
    rendered = engine.render(state, QUESTIONS)
    for inputs, questions in prompts:
        for question, mark in zip(questions, inputs["marks"].tolist(), strict=True):
            want = inputs["input_ids"][0, :mark].tolist()
            assert rendered.prompt_ids(question.name).tolist() == want, (kind, question.name)


def test_sessions_and_forks_stay_as_the_pipeline(served):
    # mutation: the sliding layers' window ignored when a session resumes (every history key read) -> fails
    _, engine, decide = served
    engine.clear_pool()
    assert_session_and_fork_as_pipeline(engine, decide, seed=7, steps=4, fork_at=1)
