"""A checkpoint's decision-model files: how its questions are prompted and read (`DecisionSpec`).

Three layouts of transformers' decision API are read: a repo's `decision.json` (+ `decision_template.jinja`);
a JEV head next to the weights (`judge_config.json`, `calibration.json`, `head.safetensors`), or saved as
`JevForDecision` (`config.json` of model_type `jev`, `proj.*` tensors); and vLLM-style decision repos
(`decision_config.json` with `codes` and a temperature, `readout.safetensors`). A LoRA adapter the config names
(`adapter`, JEV's `adapter_subfolder`) is read by `models.lora` and merged at load. What the engine cannot serve
(another head type, noncausal attention, an adapter beyond plain LoRA) is a CheckpointError naming the file and
field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flide_sdk.errors import CheckpointError
from flide_sdk.models.lora import LoraAdapter, adapter_in
from flide_sdk.questions import unencodable

QUESTION_TYPES = ("noul", "choice", "score")
DECISION_CONFIG, DECISION_TEMPLATE = "decision.json", "decision_template.jinja"
JUDGE_CONFIG, CALIBRATION, HEAD_FILE = "judge_config.json", "calibration.json", "head.safetensors"
VLLM_CONFIG, READOUT_FILE = "decision_config.json", "readout.safetensors"
HEAD_TYPES = ("jev",)
DECIDER_FAMILIES = ("pplx", "d3")  # the vLLM deciders' prompts (`decision_config.json`'s `prompt`)


@dataclass(frozen=True)
class HeadSpec:
    """A linear decision head over the final hidden state: `rows` scores, question type t's options read from
    row `offsets[t]` on, soft-capped (`softcap * tanh(x / softcap)`) when `softcap` is set. Its tensors:
    `weight_key` (and `bias_key`, None: no bias) in `file` (None: the checkpoint's weight files)."""

    rows: int
    offsets: Mapping[str, int]
    softcap: float | None
    weight_key: str
    bias_key: str | None
    file: Path | None


@dataclass(frozen=True)
class DecisionSpec:
    """How a decision model asks and reads: its template (`template`, the repo's; else `builtin`, a prompt
    the SDK writes as transformers does: "jev" or a decider family; neither: transformers' generic prompt in
    the chat template) and where it came from, labels and temperature per question type, the order a noul's
    two options reach the template, whether control tokens in requests are encoded as text, its head
    (None: the label tokens' logits), the LoRA adapter merged into its weights (None: none), and the text a
    builtin prompt starts with (a JEV on a Gemma base: `<bos>`, as transformers writes it)."""

    template: str | None
    source: str
    builtin: str | None = None
    labels: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    temperature: Mapping[str, float] = field(default_factory=dict)
    noul_options: tuple[str, str] = ("true", "false")
    sanitize: bool = True
    head: HeadSpec | None = None
    adapter: LoraAdapter | None = None
    builtin_prefix: str = ""


def _json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        raise CheckpointError(f"{file}: not readable as JSON ({error})") from error


def _object(file: Path) -> dict[str, Any]:
    raw = _json(file)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: must hold a JSON object, got a {type(raw).__name__}")
    return raw


def _temperature(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"{where}: a temperature must be a positive number, got {value!r}")
    return float(value)


def _labels(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(label, str) and label for label in value):
        raise CheckpointError(f"{where}: must be a non-empty list of label strings, got {value!r}")
    if any(unencodable(label) is not None for label in value):
        raise CheckpointError(f"{where}: a label holds a lone surrogate, which no tokenizer encodes: {value!r}")
    if len(set(value)) != len(value):
        raise CheckpointError(f"{where}: labels must be distinct, got {value!r}")
    return tuple(value)


def _per_type(raw: Any, where: str, read: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: must map question types to values, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(QUESTION_TYPES))
    if unknown:
        raise CheckpointError(f"{where}: unknown question type {unknown[0]!r} (types: {', '.join(QUESTION_TYPES)})")
    return {kind: read(value, f"{where}.{kind}") for kind, value in raw.items()}


def _repo_config(path: Path, head: HeadSpec | None) -> DecisionSpec:
    """`decision.json` and/or `decision_template.jinja` of a repo."""
    file = path / DECISION_CONFIG
    raw = _object(file) if file.is_file() else {}
    template, source = raw.get("chat_template"), f"{file} (chat_template)"
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{file}: chat_template must be a string, got {type(template).__name__}")
    template_file = path / DECISION_TEMPLATE
    if template_file.is_file():
        try:
            template, source = template_file.read_text(encoding="utf-8"), str(template_file)
        except (OSError, ValueError) as error:
            raise CheckpointError(f"{template_file}: unreadable ({error})") from error
    noul = raw.get("noul_options", ["true", "false"])
    if not isinstance(noul, list) or sorted(map(str, noul)) != ["false", "true"]:
        raise CheckpointError(f"{file}: noul_options must order 'true' and 'false', got {noul!r}")
    sanitize = raw.get("sanitize_control_tokens", True)
    if not isinstance(sanitize, bool):
        raise CheckpointError(f"{file}: sanitize_control_tokens must be true or false, got {sanitize!r}")
    adapter = adapter_in(path, raw.get("adapter"), f"{file}: adapter")
    return DecisionSpec(template, source if template is not None else str(file), None,
                        _per_type(raw.get("labels", {}), f"{file}: labels", _labels),
                        _per_type(raw.get("temperature", {}), f"{file}: temperature", _temperature),
                        (noul[0], noul[1]), sanitize, head, adapter)


def _jev_head(path: Path, judge_file: Path) -> tuple[HeadSpec, dict[str, tuple[str, ...]], dict[str, Any]]:
    """The head of `judge_config.json` (and its labels per type, and the judge config)."""
    judge = _object(judge_file)
    kind = judge.get("head_type", "jev")
    if kind not in HEAD_TYPES:
        raise CheckpointError(f"{judge_file}: head_type {kind!r} is not served (flide_sdk serves {', '.join(HEAD_TYPES)})")
    slots = judge.get("slots")
    if not isinstance(slots, dict):
        raise CheckpointError(f"{judge_file}: slots must be an object with num_slots, ranges and verbalizers")
    rows, ranges, verbalizers = slots.get("num_slots"), slots.get("ranges"), slots.get("verbalizers")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise CheckpointError(f"{judge_file}: slots.num_slots must be a positive integer, got {rows!r}")
    verbalizers = _labels(verbalizers, f"{judge_file}: slots.verbalizers")

    def span(value: Any, where: str) -> tuple[int, int]:
        if (not isinstance(value, list) or len(value) != 2 or not all(type(v) is int for v in value)
                or not 0 <= value[0] < value[1] <= min(rows, len(verbalizers))):
            raise CheckpointError(f"{where}: must be [start, end) rows within num_slots {rows}, got {value!r}")
        return value[0], value[1]

    spans = _per_type(ranges, f"{judge_file}: slots.ranges", span)
    softcap = judge.get("softcap")
    if softcap is not None:
        softcap = _temperature(softcap, f"{judge_file}: softcap")
    head = HeadSpec(rows, {kind: start for kind, (start, _) in spans.items()}, softcap, "proj.weight", "proj.bias",
                    path / HEAD_FILE)
    labels = {kind: verbalizers[start:end] for kind, (start, end) in spans.items()}
    return head, labels, judge


def _jev_next_to_weights(path: Path, judge_file: Path, config: dict[str, Any]) -> DecisionSpec:
    head, labels, judge = _jev_head(path, judge_file)
    if not head.file.is_file():
        raise CheckpointError(f"{judge_file}: the JEV head's weights ({HEAD_FILE}) are not in {path}")
    calibration = path / CALIBRATION
    if not calibration.is_file():
        raise CheckpointError(f"{judge_file}: a JEV head needs its {CALIBRATION} (per_kind temperatures)")
    per_kind = _object(calibration).get("per_kind")
    temperature = _per_type(per_kind, f"{calibration}: per_kind", _temperature)
    adapter = adapter_in(path, judge.get("adapter_subfolder", "adapter"), f"{judge_file}: adapter_subfolder",
                         optional="adapter_subfolder" not in judge)  # no adapter/: a JEV with its LoRA merged
    text = config.get("text_config", config)
    bos = "gemma" in str(text.get("model_type"))  # as transformers' JEV config: a Gemma base reads it after <bos>
    return DecisionSpec(None, f"{judge_file} (the JEV prompt)", "jev", labels, temperature, ("false", "true"),
                        True, head, adapter, "<bos>" if bos else "")


def _vllm(path: Path, file: Path) -> DecisionSpec:
    raw = _object(file)
    mode = raw.get("attention_mode")
    if mode not in (None, "causal"):
        raise CheckpointError(f"{file}: attention_mode {mode!r} cannot be served (a round forks questions from "
                              "their trunk's causal state)")
    if "codes" not in raw:
        raise CheckpointError(f"{file}: a decision config without codes is not served")
    codes = _labels(raw["codes"], f"{file}: codes")
    temperature = _temperature(raw.get("temperature"), f"{file}: temperature")
    family = raw.get("prompt", "pplx")
    if family not in DECIDER_FAMILIES:
        raise CheckpointError(f"{file}: prompt {family!r} is not known (known: {', '.join(DECIDER_FAMILIES)})")
    readout = path / READOUT_FILE
    head = HeadSpec(len(codes), dict.fromkeys(QUESTION_TYPES, 0), None, "weight", None, readout) \
        if readout.is_file() else None
    return DecisionSpec(None, f"{file} (the {family} decider prompt)", family,
                        dict.fromkeys(QUESTION_TYPES, codes), dict.fromkeys(QUESTION_TYPES, temperature),
                        ("false", "true"), True, head)


def saved_jev_head(config_file: Path, raw: dict[str, Any]) -> HeadSpec:
    """The head of a saved `JevForDecision` (config.json of model_type `jev`): `proj.*` in its weight files."""
    rows = raw.get("num_verbalizers", 24)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise CheckpointError(f"{config_file}: num_verbalizers must be a positive integer, got {rows!r}")
    offsets = raw.get("offsets") or {"noul": 0, "score": 2, "choice": 8}

    def start(value: Any, where: str) -> int:
        if type(value) is not int or not 0 <= value < rows:
            raise CheckpointError(f"{where}: must be a row below num_verbalizers {rows}, got {value!r}")
        return value

    offsets = _per_type(offsets, f"{config_file}: offsets", start)
    softcap = raw.get("softcap")
    if softcap is not None:
        softcap = _temperature(softcap, f"{config_file}: softcap")
    return HeadSpec(rows, offsets, softcap, "proj.weight", "proj.bias", None)


def read_decision(path: Path, config: dict[str, Any]) -> DecisionSpec | None:
    """The decision spec of the checkpoint at `path` (whose config.json holds `config`), None for a plain
    language model. Precedence as transformers': vLLM codes, then a JEV head next to the weights, then a
    saved JEV or a repo's decision config."""
    vllm = path / VLLM_CONFIG
    if vllm.is_file():
        return _vllm(path, vllm)
    judge = path / JUDGE_CONFIG
    if judge.is_file():
        return _jev_next_to_weights(path, judge, config)
    for name in (CALIBRATION, HEAD_FILE, READOUT_FILE):
        if (path / name).is_file():
            raise CheckpointError(f"{path / name}: a decision head's file without its config "
                                  f"({JUDGE_CONFIG} or {VLLM_CONFIG}); cannot tell how to read it")
    head = saved_jev_head(path / "config.json", config) if config.get("model_type") == "jev" else None
    if head is None and not (path / DECISION_CONFIG).is_file() and not (path / DECISION_TEMPLATE).is_file():
        return None
    return _repo_config(path, head)
