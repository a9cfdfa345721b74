"""LoRA adapters as transformers' `pipeline("decision")` loads them (peft's `adapter_config.json` +
`adapter_model.safetensors` in the subfolder a decision config names: `decision.json`'s `adapter`, a JEV's
`adapter_subfolder`), merged at load. Float32 on CPU the engine answers as the pipeline running peft's unmerged
adapter; what peft can express and flide_sdk does not merge is a CheckpointError naming the file and the field, raised
before any weight is read."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import flide_sdk as fl
from flide_sdk.testing import train_tiny_tokenizer

from .conftest import TOLERANCE, text_of_tokens
from .test_decision_models import GENERIC_CONFIG, QUESTION_TEMPLATE, REPO_CONFIG, copy_tiny, jev_next_to_weights
from .test_decision_pipeline import QUESTIONS, assert_as_pipeline, probabilities
from .test_loader import save_release_layout
from .test_moe import save_moe

GDN = ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]  # the Gated DeltaNet's projections
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
KEY = "base_model.model.model.layers.{}.{}.lora_{}.weight"

ADAPTERS: dict[str, dict[str, Any]] = {
    # decision.json's `adapter`: every projection, per-module ranks and alphas
    "repo": {"r": 4, "lora_alpha": 8, "target_modules": GDN + ATTENTION + MLP,
             "rank_pattern": {"layers.1.linear_attn.in_proj_qkv": 2, "o_proj": 6}, "alpha_pattern": {"down_proj": 3}},
    # rsLoRA (alpha / sqrt(r)) and a regex of target modules, on the generic prompt
    "rslora": {"r": 8, "lora_alpha": 4, "use_rslora": True, "rank_pattern": {"in_proj_z": 2},
               "target_modules": r".*\.linear_attn\.(in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj)|.*\.up_proj"},
    # a list of targets in some layers only, one module excluded
    "layers": {"r": 4, "lora_alpha": 16, "target_modules": GDN + ATTENTION + MLP, "layers_to_transform": [1, 3, 6],
               "exclude_modules": ["model.layers.3.mlp.down_proj"]},
    # a JEV head next to the weights, its LoRA in the default `adapter/` (judge_config.json names none)
    "jev": {"r": 4, "lora_alpha": 8, "target_modules": GDN + ATTENTION + ["gate_proj", "down_proj"]},
    # the release layout (Qwen3_5ForConditionalGeneration): peft names its decoder model.language_model.layers.N
    "release": {"r": 4, "lora_alpha": 8, "target_modules": GDN + ["q_proj", "down_proj"]},
    # "all-linear" as a config may say it (peft saves the names it expands it to): every projection, not lm_head
    "all_linear": {"r": 2, "lora_alpha": 4, "target_modules": "all-linear"},
    # Qwen3.5-MoE: the shared expert and its gate (the routed experts are not nn.Linear modules in transformers)
    "moe": {"r": 4, "lora_alpha": 8, "target_modules": GDN + ["o_proj", "shared_expert.gate_proj",
                                                              "shared_expert.down_proj", "shared_expert_gate"]},
}


def save_adapter(model, folder: Path, seed: int = 0, **config: Any) -> None:
    """A peft LoRA of `config` over the transformers `model`, saved by peft into `folder`. Its factors are random:
    peft starts lora_B at zero, and an adapter that changes nothing could not fail a test."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(**config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:  # A ~ N(0, 1/fan_in), B ~ N(0, 0.3^2)
                std = parameter.shape[1] ** -0.5 if ".lora_A." in name else 0.3
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    model.save_pretrained(folder)
    if config["target_modules"] == "all-linear":  # peft saved the names it expanded the shorthand to: put it back
        raw = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**raw, "target_modules": "all-linear"}))


def causal_lm(path: Path, kind: str = "text"):
    """transformers' float32 model of the checkpoint at `path` (of the release layout: the multimodal model)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM

    model = {"release": Qwen3_5ForConditionalGeneration, "moe": Qwen3_5MoeForCausalLM}.get(kind, Qwen3_5ForCausalLM)
    return model.from_pretrained(path, dtype=torch.float32).eval()


def build(kind: str, tiny_path: Path, root: Path):
    """(the checkpoint directory of `kind` with its adapter, transformers' decision pipeline on it: the pipeline
    loads the adapter itself, with peft)."""
    from transformers import AutoTokenizer, JevForDecision, pipeline

    path = root / kind
    if kind == "jev":
        jev_next_to_weights(tiny_path, path)
        save_adapter(causal_lm(tiny_path), path / "adapter", seed=3, **ADAPTERS[kind])
        model = JevForDecision.from_pretrained(path, dtype=torch.float32).eval()
        assert model.decision_config.adapter == "adapter"  # the JEV default the pipeline loads
        return path, pipeline("decision", model=model, tokenizer=AutoTokenizer.from_pretrained(path))
    if kind == "release":
        save_release_layout(path, train_tiny_tokenizer(seed=0))
    elif kind == "moe":
        save_moe(tiny_path, path)
    else:
        copy_tiny(tiny_path, path)
    if kind == "rslora":
        (path / "decision.json").write_text(json.dumps({**GENERIC_CONFIG, "adapter": "tuned"}))
    else:
        (path / "decision_template.jinja").write_text(QUESTION_TEMPLATE)
        (path / "decision.json").write_text(json.dumps({**REPO_CONFIG, "adapter": "tuned"}))
    save_adapter(causal_lm(path, kind), path / "tuned", seed=len(kind), **ADAPTERS[kind])
    return path, pipeline("decision", model=causal_lm(path, kind), tokenizer=AutoTokenizer.from_pretrained(path))


@dataclass(frozen=True)
class Served:
    """An adapter's checkpoint as the engine serves it and as transformers' pipeline (peft, unmerged) does."""

    kind: str
    engine: fl.Engine
    decide: Any


@pytest.fixture(scope="module", params=list(ADAPTERS))
def served(request, tiny_path, tmp_path_factory) -> Iterator[Served]:
    path, decide = build(request.param, tiny_path, tmp_path_factory.mktemp("lora"))
    with fl.Engine.load(path, device="cpu", dtype="float32") as engine:
        yield Served(request.param, engine, decide)


@pytest.mark.parametrize("tokens", [1, 300])
def test_answers_are_the_pipelines_with_its_adapter(served, tokens):
    # mutations: the merge skipped (`MergePlan.merged` returning its input) -> fails every kind; the scale
    # alpha / r under rsLoRA -> fails rslora; alpha_pattern ignored -> fails repo; rank_pattern ignored -> the
    # factors' shapes are refused -> fails repo, rslora; layers_to_transform or exclude_modules ignored -> the
    # factors the file lacks for the modules then targeted are refused -> fails layers; "all-linear" taking in
    # lm_head -> refused as the language-model head -> fails all_linear
    state = text_of_tokens(served.engine.tokens, tokens, seed=tokens)
    answers = served.engine.ask_sync(state, QUESTIONS)
    assert_as_pipeline(served.decide, state, QUESTIONS, answers)
    # the adapter matters: the pipeline without it answers otherwise, so an adapter left out could not pass
    base = answers_without_adapter(served.decide, state)
    moved = max(np.abs(probabilities(base[name]) - probabilities(answers[name])).max() for name in QUESTIONS)
    assert moved > 100 * TOLERANCE, served.kind


def answers_without_adapter(decide, state: Any) -> dict:
    """The pipeline's answers with its peft layers switched off (transformers' `disable_adapters` needs peft 0.22)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in decide.model.modules() if isinstance(m, BaseTunerLayer)]
    assert layers, "the pipeline loaded no adapter"
    for layer in layers:
        layer.enable_adapters(False)
    try:
        return decide({"state": state, "questions": QUESTIONS})
    finally:
        for layer in layers:
            layer.enable_adapters(True)


# ----------------------------------------------------------------------------------------------- refusals
REFUSED_ADAPTER = {"r": 4, "lora_alpha": 8, "target_modules": GDN + ["q_proj", "gate_proj"]}


@pytest.fixture(scope="module")
def adapter_folder(tiny_path, tmp_path_factory) -> Path:
    """A valid adapter (GDN projections, q_proj and gate_proj), copied into each refusal case."""
    folder = tmp_path_factory.mktemp("refused") / "adapter"
    save_adapter(causal_lm(tiny_path), folder, **REFUSED_ADAPTER)
    return folder


def config(**changes: Any) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        raw = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**raw, **changes}))
    return change


def tensors(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def rewrite(folder: Path) -> None:
        weights = load_file(folder / "adapter_model.safetensors")
        change(weights)
        save_file(weights, str(folder / "adapter_model.safetensors"))
    return rewrite


def unlink(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).unlink()


def pickled(folder: Path) -> None:
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")


NOWHERE = KEY.format(99, "mlp.gate_proj", "A")
UNTARGETED = KEY.format(0, "mlp.up_proj", "A")
MAGNITUDE = "base_model.model.model.layers.0.mlp.gate_proj.lora_magnitude_vector"  # DoRA's
REFUSALS = [  # (id, change to the adapter folder, what the error says)
    ("dora", config(use_dora=True), "adapter_config.json: use_dora = True: DoRA"),
    ("modules_to_save", config(modules_to_save=["lm_head"]), "adapter_config.json: modules_to_save = "),
    ("r_zero", config(r=0), "adapter_config.json: r must be a positive integer rank, got 0"),
    ("r_text", config(r="4"), "adapter_config.json: r must be a positive integer rank, got '4'"),
    ("rank_pattern", config(rank_pattern={"q_proj": -1}), r"adapter_config.json: rank_pattern\['q_proj'\] must be"),
    ("bias", config(bias="lora_only"), "adapter_config.json: bias 'lora_only' is not served"),
    ("peft_type", config(peft_type="IA3"), "adapter_config.json: peft_type 'IA3' is not served"),
    ("pissa", config(init_lora_weights="pissa"), "adapter_config.json: init_lora_weights 'pissa' is not served"),
    ("experts", config(target_parameters=["experts.gate_up_proj"]), "adapter_config.json: target_parameters = "),
    ("unknown", config(lora_new_feature={"on": 1}), "adapter_config.json: lora_new_feature = .* is not known"),
    ("conv", config(target_modules=GDN + ["conv1d"]),
     "adapter_config.json: target_modules targets model.layers.0.linear_attn.conv1d, a convolution"),
    ("embedding", config(target_modules=["embed_tokens", "q_proj"]),
     "adapter_config.json: target_modules targets model.embed_tokens, an embedding"),
    ("lm_head", config(target_modules=["lm_head", "q_proj"]),
     "adapter_config.json: target_modules targets lm_head, the language-model head"),
    ("no_match", config(target_modules=["qkv_proj"]), "adapter_config.json: target_modules matches no module"),
    ("key_nowhere", tensors(lambda w: w.update({NOWHERE: torch.zeros(4, 64)})),
     f"adapter_model.safetensors: {NOWHERE} targets model.layers.99.mlp.gate_proj, no weight"),
    ("key_untargeted", tensors(lambda w: w.update({UNTARGETED: torch.zeros(4, 64)})),
     f"adapter_model.safetensors: {UNTARGETED} is for model.layers.0.mlp.up_proj, which target_modules"),
    ("magnitude", tensors(lambda w: w.update({MAGNITUDE: torch.ones(128)})), f"{MAGNITUDE} is not a LoRA factor"),
    ("factor_missing", tensors(lambda w: w.pop(KEY.format(2, "linear_attn.in_proj_b", "B"))),
     f"adapter_model.safetensors: no {KEY.format(2, 'linear_attn.in_proj_b', 'B')}"),
    ("rank_mismatch", config(rank_pattern={"in_proj_z": 2}),
     r"adapter_model.safetensors: .*layers.0.linear_attn.in_proj_z.lora_A.weight has shape \(4, 64\), expected \(2, "),
    ("nan", tensors(lambda w: w[KEY.format(3, "self_attn.q_proj", "B")].fill_(float("nan"))),
     "adapter_model.safetensors: the factors of model.layers.3.self_attn.q_proj have NaN"),
    ("no_weights", unlink("adapter_model.safetensors"), "tuned/adapter_model.safetensors: missing"),
    ("pickled", pickled, "tuned/adapter_model.bin: a pickled adapter is not read"),
    ("no_config", unlink("adapter_config.json"), "decision.json: adapter: .*tuned holds no adapter_config.json"),
    ("no_folder", lambda folder: shutil.rmtree(folder), "decision.json: adapter: names the adapter folder"),
]


@pytest.mark.parametrize(("change", "message"), [case[1:] for case in REFUSALS], ids=[case[0] for case in REFUSALS])
def test_what_is_not_merged_is_refused_before_weights_are_read(tiny_path, tmp_path, adapter_folder, change, message):
    # mutations: any check of models.lora removed -> its case loads (or fails later, reading the unreadable
    # model.safetensors) -> fails; a key of no targeted module skipped instead of refused -> fails key_nowhere,
    # key_untargeted; the adapter's folder checked only when it exists -> fails no_folder
    path = copy_tiny(tiny_path, tmp_path / "m")
    (path / "decision_template.jinja").write_text(QUESTION_TEMPLATE)
    (path / "decision.json").write_text(json.dumps({**REPO_CONFIG, "adapter": "tuned"}))
    shutil.copytree(adapter_folder, path / "tuned")
    change(path / "tuned")
    (path / "model.safetensors").write_bytes(b"not read")  # refused before the weights are opened
    with pytest.raises(fl.CheckpointError, match=message):
        fl.Engine.load(path, device="cpu")


def test_a_jev_without_its_default_adapter_folder_is_served_as_merged(tiny_path, tmp_path):
    # mutation: the default `adapter/` required (optional=False in `_jev_next_to_weights`) -> fails; naming the
    # folder in judge_config.json makes it required -> the second load must fail
    path = jev_next_to_weights(tiny_path, tmp_path / "jev")
    with fl.Engine.load(path, device="cpu") as engine:
        assert engine.info()["decision"] is not None
    judge = json.loads((path / "judge_config.json").read_text())
    (path / "judge_config.json").write_text(json.dumps({**judge, "adapter_subfolder": "adapter"}))
    with pytest.raises(fl.CheckpointError, match="judge_config.json: adapter_subfolder: names the adapter folder"):
        fl.Engine.load(path, device="cpu")


@pytest.mark.parametrize(("target", "what"), [("gate", "the MoE router"), ("experts", "the MoE routed experts")])
def test_the_moe_router_and_routed_experts_are_refused(tiny_path, tmp_path, target, what):
    # mutation: `modules_of` listing the router (a Linear of ours) as a projection -> the adapter is read and fails
    # on its keys instead -> fails; the experts left out of the modules -> "matches no module" -> fails
    path = tmp_path / "moe"
    save_moe(tiny_path, path)
    (path / "decision.json").write_text(json.dumps({"adapter": "tuned"}))
    (path / "tuned").mkdir()
    (path / "tuned" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": [target]}))
    save_file({"unread": torch.zeros(1)}, str(path / "tuned" / "adapter_model.safetensors"))
    for weights in path.glob("model*.safetensors"):
        weights.write_bytes(b"not read")
    with pytest.raises(fl.CheckpointError, match=f"adapter_config.json: target_modules targets model.layers.0.mlp."
                                                 f"{target}, {what}"):
        fl.Engine.load(path, device="cpu")
