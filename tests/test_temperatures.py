"""A decision model's temperatures (issue 61): any T > 0 answers as transformers' `pipeline("decision")` within
1e-4 in float32, a tiny T (whose p ** (1 / T) underflowed to 0 / 0) and a large T over far-apart logits (whose
options underflowed to probability 0 before T was applied) included; no answer is ever NaN. A temperature that
is not a positive finite number is a CheckpointError naming its file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import flide_sdk as fl

from .conftest import text_of_tokens
from .test_decision_models import JUDGE, QUESTION_TEMPLATE, copy_tiny, head_tensors, jev_model
from .test_decision_pipeline import QUESTIONS, assert_as_pipeline, probabilities

FAR = 40.0  # the heads' weights scaled so that a question's logits lie hundreds apart
TINY_T = {"labels": {"noul": ["yes", "no"]}, "noul_options": ["false", "true"],
          "temperature": {"noul": 1e-4, "choice": 1e-4, "score": 50.0}}
JEV_T = {"noul": 50.0, "choice": 50.0, "score": 1e-4}
KINDS = ("tiny_t", "jev_far", "decider_far")


def far_head(hidden: int, rows: int, bias: bool) -> dict[str, torch.Tensor]:
    return {name: tensor * FAR for name, tensor in head_tensors(hidden, rows, bias).items()}


def build(kind: str, tiny_path: Path, root: Path, temperature: float = 50.0):
    """(the checkpoint directory of `kind`, transformers' decision pipeline on it)."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, pipeline

    path = copy_tiny(tiny_path, root / kind)
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    if kind == "tiny_t":  # a template with the label tokens' logits
        (path / "decision_template.jinja").write_text(QUESTION_TEMPLATE)
        (path / "decision.json").write_text(json.dumps(TINY_T))
        model = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    elif kind == "jev_far":  # a JEV head without a soft cap: nothing bounds its scores
        (path / "judge_config.json").write_text(json.dumps({key: v for key, v in JUDGE.items() if key != "softcap"}))
        (path / "calibration.json").write_text(json.dumps({"per_kind": JEV_T}))
        save_file(far_head(hidden, 24, bias=True), str(path / "head.safetensors"))
        model = jev_model(path)
    else:
        write_decider(path, far_head(hidden, 6, bias=False)["proj.weight"], temperature)
        model = jev_model(path)
    return path, pipeline("decision", model=model, tokenizer=AutoTokenizer.from_pretrained(path))


def write_decider(path: Path, weight: torch.Tensor, temperature: float) -> None:
    """A vLLM-style decider's files in checkpoint `path`: codes A to F, its temperature, its readout's weight."""
    (path / "decision_config.json").write_text(json.dumps({"codes": list("ABCDEF"), "temperature": temperature}))
    save_file({"weight": weight}, str(path / "readout.safetensors"))


@pytest.fixture(scope="module", params=KINDS)
def served(request, tiny_path, tmp_path_factory):
    """(kind, engine, pipeline) of each checkpoint with extreme temperatures."""
    path, decide = build(request.param, tiny_path, tmp_path_factory.mktemp("temperatures"))
    with fl.Engine.load(path, device="cpu", dtype="float32") as engine:
        yield request.param, engine, decide


def logit_spread(answer: dict, temperature: float) -> float:
    """How far apart a pipeline answer's logits lie: T * (log p_max - log p_min) over its options."""
    values = probabilities(answer)
    values = [*values, 1.0 - values[0]] if answer["type"] == "noul" else list(values)
    return temperature * (math.log(max(values)) - math.log(min(values)))


def test_extreme_temperatures_give_the_pipelines_probabilities(served):
    # mutations: `executor.tempered` back to p ** (1 / T) renormalised -> NaN for tiny_t (0 / 0), and the options
    # that underflowed stay 0 for jev_far and decider_far (|dp| up to 0.3) -> fails; the readout's log_softmax
    # replaced by a softmax (log of the probabilities on the host) -> the same underflow -> fails jev_far/decider
    kind, engine, decide = served
    states = ["The build failed at step 3.", text_of_tokens(engine.tokens, 300, seed=4),
              {"ticket": 4411, "log": ["charged twice", "refund"]}]
    for state in states:
        answers = engine.ask_sync(state, QUESTIONS)
        for answer in answers.values():
            assert not any(math.isnan(p) for p in probabilities(answer)), (kind, answer)
        assert_as_pipeline(decide, state, QUESTIONS, answers)
    if kind != "tiny_t":  # the case needs logits far enough apart that float32 probabilities underflow (< e^-104)
        expected = decide({"state": states[0], "questions": QUESTIONS})
        temperature = {"jev_far": JEV_T, "decider_far": dict.fromkeys(JEV_T, 50.0)}[kind]
        assert max(logit_spread(a, temperature[a["type"]]) for a in expected.values()
                   if temperature[a["type"]] > 1) > 110


def test_sessions_keep_extreme_temperatures_exact(served):
    # mutation: `executor.tempered` back to p ** (1 / T) -> every kind fails at its first step (checked)
    _, engine, decide = served
    session, state = engine.session(), ""
    for step in range(3):
        piece = f" step {step}: the agent ran the tests and they failed again with a refund total of {step * 17}."
        session.append(piece)
        state += piece
        assert_as_pipeline(decide, state, QUESTIONS, session.ask_sync(QUESTIONS))


@pytest.mark.parametrize("temperature", [1e-6, 1e3])
def test_a_deciders_temperature_from_tiny_to_huge_stays_as_the_pipeline(tiny_path, tmp_path, temperature):
    # mutation: `executor.tempered` back to p ** (1 / T) -> fails 1e3 (the options that underflowed stay 0);
    # 1e-6 guards the tiny end (the best option's float32 probability is 1 there, so p ** (1 / T) survives it)
    path, decide = build("decider_far", tiny_path, tmp_path, temperature)
    with fl.Engine.load(path, device="cpu", dtype="float32") as engine:
        state = "I was charged twice for my order and want a refund."
        assert_as_pipeline(decide, state, QUESTIONS, engine.ask_sync(state, QUESTIONS))


BAD_TEMPERATURES = [0, -0.5, float("nan"), float("inf"), float("-inf"), "hot", True, None, [1.0]]


def write_bad(path: Path, file: str, value) -> str:
    """Write a decision file whose temperature (or soft cap) is `value`; the field the error must name."""
    if file == "decision.json":
        (path / "decision_template.jinja").write_text(QUESTION_TEMPLATE)
        (path / file).write_text(json.dumps({"temperature": {"choice": 1.0, "noul": value}}))
        return "temperature.noul"
    if file == "decision_config.json":
        (path / file).write_text(json.dumps({"codes": ["A", "B"], "temperature": value}))
        return "temperature"
    (path / "judge_config.json").write_text(json.dumps({**JUDGE, "softcap": value} if file == "judge_config.json"
                                                       else JUDGE))
    (path / "calibration.json").write_text(json.dumps({"per_kind": {"noul": 1.0, "score": value}}))
    save_file(head_tensors(64, 24), str(path / "head.safetensors"))
    return "softcap" if file == "judge_config.json" else "per_kind.score"


@pytest.mark.parametrize("value", BAD_TEMPERATURES, ids=repr)
@pytest.mark.parametrize("file", ["decision.json", "decision_config.json", "calibration.json", "judge_config.json"])
def test_a_temperature_that_is_not_a_positive_number_is_a_checkpoint_error(tiny_path, tmp_path, file, value):
    # mutation: `models.decision._temperature` accepting 0 or NaN -> loads (and answers NaN) -> fails
    if file == "judge_config.json" and value is None:
        pytest.skip("a soft cap of null is no soft cap")
    path = copy_tiny(tiny_path, tmp_path / "m")
    field = write_bad(path, file, value)
    (path / "model.safetensors").write_bytes(b"not read")  # refused before any weight is read
    with pytest.raises(fl.CheckpointError, match="must be a positive number") as refused:
        fl.Engine.load(path, device="cpu")
    assert file in str(refused.value) and field in str(refused.value)
