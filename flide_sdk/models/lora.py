"""peft LoRA adapters, as transformers' decision pipeline loads them, merged into the weights at load.

A decision config may name a subfolder that holds a LoRA adapter (`decision.json`'s `adapter`, a JEV's
`adapter_subfolder`): the pipeline runs the model with it (`model.load_adapter`). flide_sdk merges it instead, as the
checkpoint is read: each targeted projection's weight becomes W + scale * B @ A, in float32, before it is cast to the
engine's dtype and fused, so rounds run the base model's kernels unchanged (docs/decisions/lora-adapters.md).
`read_adapter` validates `adapter_config.json` and `MergePlan.of` matches `adapter_model.safetensors`' header to the
model's projections; what peft can express and this does not merge is a CheckpointError naming the file and the
field, raised before any weight is read.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from flide_sdk.errors import CheckpointError
from flide_sdk.models.qwen35 import Linear, Qwen35Model, RMSNorm, SparseMoE, Weight

CONFIG_FILE, WEIGHTS_FILE, PICKLED_FILE = "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"
KEY_PREFIX = "base_model.model."  # what peft's save_pretrained puts before a module's name
FACTOR_KEY = re.compile(r"(?P<module>.+)\.(?P<factor>lora_A|lora_B)\.weight")
FLOATING_DTYPES = ("BF16", "F16", "F32", "F64")

Fail = Callable[[str, str], CheckpointError]
"""An adapter config's error for a field and its problem."""

SERVED_INITS = (True, False, "gaussian", "orthogonal", "eva", "mica")
"""`init_lora_weights` values whose adapters are plain W + scale * B @ A on the unchanged base weight (the others,
PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA, rewrite the base weight when peft loads the adapter)."""

SERVED_FIELDS = frozenset({
    "peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules",
    "exclude_modules", "layers_to_transform", "layers_pattern", "fan_in_fan_out", "bias", "init_lora_weights",
})
"""Fields that say what the merge computes (`fan_in_fan_out` is moot: peft ignores it for nn.Linear layers)."""


INERT_FIELDS = frozenset({
    "base_model_name_or_path", "revision", "task_type", "inference_mode", "peft_version", "auto_mapping",
    "lora_dropout", "megatron_core", "qalora_group_size", "loftq_config", "eva_config", "corda_config",
    "lora_ga_config", "ensure_weight_tying", "runtime_config",
})
"""Fields that do not change what a loaded adapter computes (training, initialisation, provenance)."""

UNSERVED_FIELDS = {
    "use_dora": "DoRA (a magnitude vector per module)",
    "modules_to_save": "whole modules saved with the adapter",
    "trainable_token_indices": "trained embedding rows",
    "lora_bias": "a bias on lora_B",
    "target_parameters": "LoRA on bare parameters (the MoE routed experts)",
    "layer_replication": "replicated layers",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QA-LoRA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
    "megatron_config": "Megatron parallel layers",
}
"""Fields peft can set that flide_sdk does not merge: any value but null, false or empty is refused."""


@dataclass(frozen=True)
class Targets:
    """Which modules an adapter targets, as peft matches module names: `names` (a module whose name is one, or ends
    with "." + one; "all-linear": every linear layer but the language-model head) or `pattern` (a regex the whole name
    matches); none excluded by `exclude_names` / `exclude_pattern`; with `layers`, only the layers of those indices
    (the index after one of `layers_patterns` in the name, or else the first index in it)."""

    names: frozenset[str] | None
    pattern: str | None
    all_linear: bool
    exclude_names: frozenset[str]
    exclude_pattern: str | None
    layers: frozenset[int] | None
    layers_patterns: tuple[str, ...]

    def matches(self, module: Module) -> bool:
        name = module.name
        if self.exclude_pattern is not None and re.fullmatch(self.exclude_pattern, name):
            return False
        if _named(name, self.exclude_names):
            return False
        if self.all_linear:
            return module.linear
        if self.pattern is not None:
            return re.fullmatch(self.pattern, name) is not None
        if not _named(name, self.names or frozenset()):
            return False
        if self.layers is None:
            return True
        index = self._layer_index(name)
        return index is not None and index in self.layers

    def _layer_index(self, name: str) -> int | None:
        patterns = [rf"(?:^|.*?\.){pattern}\.(\d+)\." for pattern in self.layers_patterns] or [r".*?\.[^.]*\.(\d+)\."]
        for pattern in patterns:
            match = re.match(pattern, name)
            if match is not None:
                return int(match.group(1))
        return None


def _named(name: str, names: frozenset[str]) -> bool:
    return name in names or any(name.endswith("." + target) for target in names)


@dataclass(frozen=True)
class LoraAdapter:
    """A validated LoRA adapter, its weights not read: its files, the modules it targets, and per module its rank
    (`r`, or the first `rank_pattern` key that ends the module's name) and scale (alpha / rank, or alpha / sqrt(rank)
    with rsLoRA; alpha likewise from `alpha_pattern`)."""

    config_file: Path
    weights_file: Path
    r: int
    alpha: float
    rslora: bool
    rank_pattern: Mapping[str, int]
    alpha_pattern: Mapping[str, float]
    targets: Targets

    def rank(self, module: str) -> int:
        return _by_pattern(self.rank_pattern, module, self.r)

    def scale(self, module: str) -> float:
        alpha, rank = _by_pattern(self.alpha_pattern, module, self.alpha), self.rank(module)
        return alpha / math.sqrt(rank) if self.rslora else alpha / rank


def _by_pattern(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def adapter_in(path: Path, name: Any, where: str, optional: bool = False) -> LoraAdapter | None:
    """The adapter in the subfolder `name` of the checkpoint at `path`, as a decision config names it (`where`: the
    file and field); None when it names none, or when `optional` (a default name) and the folder is absent: a JEV
    whose LoRA is merged into its weights."""
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{where}: must name a subfolder, got {name!r}")
    folder = path / name
    if not folder.is_dir():
        if optional and not folder.exists():
            return None
        raise CheckpointError(f"{where}: names the adapter folder {folder}, which is not a directory")
    if not (folder / CONFIG_FILE).is_file():
        raise CheckpointError(f"{where}: {folder} holds no {CONFIG_FILE} (a peft LoRA adapter's config)")
    return read_adapter(folder, where)


def read_adapter(folder: Path, where: str = "the adapter") -> LoraAdapter:
    """The LoRA adapter in `folder` (`adapter_config.json` + `adapter_model.safetensors`), its config validated: a
    CheckpointError names the file and field of what is not served. No weight is read."""
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not weights_file.is_file():
        if (folder / PICKLED_FILE).is_file():
            raise CheckpointError(f"{folder / PICKLED_FILE}: a pickled adapter is not read; save it as {WEIGHTS_FILE} "
                                  "(peft's save_pretrained writes safetensors by default)")
        raise CheckpointError(f"{weights_file}: missing (the weights of the adapter {where} names)")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        raise CheckpointError(f"{config_file}: not readable as JSON ({error})") from error
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_file}: must hold a JSON object, got a {type(raw).__name__}")

    def fail(field: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{config_file}: {field} {problem}")

    if raw.get("peft_type") != "LORA":
        raise fail("peft_type", f"{raw.get('peft_type')!r} is not served (flide_sdk merges LORA adapters)")
    for field, value in raw.items():
        if field in UNSERVED_FIELDS and value not in (None, False, [], {}, ""):
            raise fail(field, f"= {value!r}: {UNSERVED_FIELDS[field]} is not merged by flide_sdk")
        if field not in INERT_FIELDS and field not in UNSERVED_FIELDS and field not in SERVED_FIELDS \
                and value not in (None, False, [], {}, ""):
            raise fail(field, f"= {value!r} is not known to flide_sdk (written by peft {raw.get('peft_version')})")
    if raw.get("bias", "none") != "none":
        raise fail("bias", f"{raw['bias']!r} is not served: only 'none' (the adapter trains no biases)")
    init = raw.get("init_lora_weights", True)
    if init not in SERVED_INITS:
        raise fail("init_lora_weights", f"{init!r} is not served: peft rewrites the base weights for it when it "
                   "loads the adapter; convert the adapter first (path_initial_model_for_weight_conversion)")
    if not isinstance(raw.get("fan_in_fan_out", False), bool):
        raise fail("fan_in_fan_out", f"must be true or false, got {raw['fan_in_fan_out']!r}")
    if not isinstance(raw.get("use_rslora", False), bool):
        raise fail("use_rslora", f"must be true or false, got {raw['use_rslora']!r}")
    return LoraAdapter(
        config_file, weights_file,
        r=_rank(raw.get("r", 8), fail, "r"),
        alpha=_alpha(raw.get("lora_alpha", 8), fail, "lora_alpha"),
        rslora=raw.get("use_rslora", False),
        rank_pattern=_patterns(raw.get("rank_pattern"), fail, "rank_pattern", _rank),
        alpha_pattern=_patterns(raw.get("alpha_pattern"), fail, "alpha_pattern", _alpha),
        targets=_targets(raw, fail),
    )


def _rank(value: Any, fail: Fail, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise fail(field, f"must be a positive integer rank, got {value!r}")
    return value


def _alpha(value: Any, fail: Fail, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise fail(field, f"must be a finite number, got {value!r}")
    return float(value)


def _regex(value: str, fail: Fail, field: str) -> str:
    try:
        re.compile(value)
    except re.error as error:
        raise fail(field, f"{value!r} is not a regular expression ({error})") from error
    return value


def _patterns(value: Any, fail: Fail, field: str, read: Callable[[Any, Fail, str], Any]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise fail(field, f"must map module name patterns to values, got {type(value).__name__}")
    return {_regex(key, fail, field): read(item, fail, f"{field}[{key!r}]") for key, item in value.items()}


def _names(value: Any, fail: Fail, field: str) -> tuple[frozenset[str] | None, str | None]:
    """(names, None) of a list, (None, regex) of a string."""
    if isinstance(value, str):
        return None, _regex(value, fail, field)
    if isinstance(value, list) and all(isinstance(name, str) and name for name in value):
        return frozenset(value), None
    raise fail(field, f"must be a list of module names or a regular expression, got {value!r}")


def _targets(raw: dict[str, Any], fail: Fail) -> Targets:
    target = raw.get("target_modules")
    if target is None or target == []:
        raise fail("target_modules", "names no module (peft's per-architecture defaults are not served: "
                   "save the adapter with its target_modules)")
    all_linear = isinstance(target, str) and target.lower() == "all-linear"
    names, pattern = (None, None) if all_linear else _names(target, fail, "target_modules")
    exclude = raw.get("exclude_modules")
    exclude_names, exclude_pattern = (frozenset(), None) if exclude is None else _names(exclude, fail,
                                                                                           "exclude_modules")
    layers, layers_patterns = raw.get("layers_to_transform"), raw.get("layers_pattern")
    if layers is not None:
        if names is None:
            raise fail("layers_to_transform", "needs target_modules as a list of names (peft ignores it otherwise)")
        layers = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
        if not isinstance(layers, list) or not all(type(i) is int and i >= 0 for i in layers):
            raise fail("layers_to_transform", f"must be a layer index or a list of them, got {layers!r}")
        layers = frozenset(layers) if layers else None
    if layers_patterns in (None, "", []):
        layers_patterns = ()
    elif layers is None:
        raise fail("layers_pattern", "needs layers_to_transform")
    else:
        layers_patterns = (layers_patterns,) if isinstance(layers_patterns, str) else layers_patterns
        if not isinstance(layers_patterns, list) or not all(isinstance(p, str) for p in layers_patterns):
            raise fail("layers_pattern", f"must be a name or a list of names, got {layers_patterns!r}")
        layers_patterns = tuple(_regex(p, fail, "layers_pattern") for p in layers_patterns)
    return Targets(names, pattern, all_linear, exclude_names, exclude_pattern, layers, tuple(layers_patterns))


@dataclass(frozen=True)
class Module:
    """A module of the model as transformers names it (`model.layers.0.mlp.gate_proj`): the weight (our parameter
    name) a LoRA on it merges into, or None with `what` it is when none is merged; `linear`: a linear layer of
    transformers' model that "all-linear" targets."""

    name: str
    weight: str | None
    what: str
    linear: bool


def modules_of(model: Qwen35Model, prefix: str) -> list[Module]:
    """The modules of the model `model` stands for, as transformers names them (decoder names after `prefix`)."""
    modules = []
    experts = {id(m) for layer in model.layers if isinstance(layer.mlp, SparseMoE) for m in layer.mlp.experts.modules()}
    for name, module in model.named_modules():
        hf = prefix + name
        if name in ("lm_head", "decision_head") or id(module) in experts and not name.endswith(".experts"):
            continue
        if name.endswith(".mlp.experts"):
            modules.append(Module(hf, None, "the MoE routed experts (a 3D parameter in transformers)", False))
        elif isinstance(module, Linear) and name.endswith(".mlp.gate"):
            modules.append(Module(hf, None, "the MoE router", False))
        elif isinstance(module, Linear):
            modules.append(Module(hf, name + ".weight", "a projection", True))
        elif isinstance(module, RMSNorm) or name.endswith(".norm"):
            modules.append(Module(hf, None, "a norm", False))
        elif isinstance(module, Weight):
            modules.append(Module(hf, None, "an embedding" if name == "embed_tokens" else "a convolution", False))
    if model.decision_head is not None:  # a JEV's head, `proj` of JevForDecision
        modules.append(Module("proj", None, "the decision head", True))
    else:  # a causal LM's, tied or not; "all-linear" leaves it out
        modules.append(Module("lm_head", None, "the language-model head", False))
    return modules


@dataclass(frozen=True)
class Factors:
    """A module's LoRA factors, float32 on the device: its merged weight is W + scale * B @ A."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass(frozen=True)
class MergePlan:
    """The factors of every projection an adapter targets, by the weight (our name) they merge into."""

    factors: Mapping[str, Factors]

    @classmethod
    def of(cls, adapter: LoraAdapter, model: Qwen35Model, prefix: str, device: torch.device) -> MergePlan:
        """Match the adapter to `model` (on the meta device: its shapes) and read its factors; everything is checked
        from the config and the weights file's header before a tensor is read."""
        modules = modules_of(model, prefix)
        targeted = {m.name: m for m in modules if adapter.targets.matches(m)}
        for module in targeted.values():
            if module.weight is None:
                raise CheckpointError(f"{adapter.config_file}: target_modules targets {module.name}, {module.what}: "
                                      "flide_sdk merges LoRA into the decoder's linear projections only")
        if not targeted:
            raise CheckpointError(f"{adapter.config_file}: target_modules matches no module of the model")
        known = {m.name for m in modules}
        shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        file = adapter.weights_file
        try:
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                keys = _factor_keys(adapter, reader, known, targeted, prefix)
                for name, module in targeted.items():
                    rank = adapter.rank(name)
                    out_features, in_features = shapes[module.weight]
                    for factor, expected in (("lora_A", (rank, in_features)), ("lora_B", (out_features, rank))):
                        key = keys[name, factor]
                        view = reader.get_slice(key)
                        shape, dtype = tuple(view.get_shape()), view.get_dtype()
                        if shape != expected:
                            raise CheckpointError(f"{file}: {key} has shape {shape}, expected {expected} (rank "
                                                  f"{rank}: r or rank_pattern of {adapter.config_file})")
                        if dtype not in FLOATING_DTYPES:
                            raise CheckpointError(f"{file}: {key} has dtype {dtype}; LoRA factors must be floating "
                                                  f"point ({', '.join(FLOATING_DTYPES)})")
                plan = {module.weight: Factors(*(reader.get_tensor(keys[name, f]).to(device=device, dtype=torch.float32)
                                                 for f in ("lora_A", "lora_B")), adapter.scale(name))
                        for name, module in targeted.items()}
        except (OSError, SafetensorError) as error:
            raise CheckpointError(f"{file}: not a readable safetensors file ({error})") from error
        finite = torch.stack([torch.isfinite(t).all() for f in plan.values() for t in (f.a, f.b)]).tolist()
        if not all(finite):
            weight = list(plan)[finite.index(False) // 2]
            raise CheckpointError(f"{file}: the factors of {prefix}{weight.removesuffix('.weight')} have NaN or "
                                  "infinite values")
        return cls(plan)

    def merged(self, weight: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`, the weight named `weight` as stored, with its LoRA merged in float32 (itself when untargeted)."""
        factors = self.factors.get(weight)
        if factors is None:
            return tensor
        return torch.addmm(tensor.to(torch.float32), factors.b, factors.a, alpha=factors.scale)


def _factor_keys(adapter: LoraAdapter, reader: Any, known: set[str], targeted: Mapping[str, Module],
                 prefix: str) -> dict[tuple[str, str], str]:
    """The key of each targeted module's lora_A and lora_B in the weights file; any other key is an error."""
    file, keys = adapter.weights_file, {}
    for key in reader.keys():  # noqa: SIM118 (a safe_open reader is not iterable)
        match = FACTOR_KEY.fullmatch(key.removeprefix(KEY_PREFIX)) if key.startswith(KEY_PREFIX) else None
        if match is None:
            raise CheckpointError(f"{file}: {key} is not a LoRA factor flide_sdk merges "
                                  f"({KEY_PREFIX}<module>.lora_A.weight or .lora_B.weight)")
        module = match["module"]
        if module not in known:
            raise CheckpointError(f"{file}: {key} targets {module}, no weight of this model's text decoder (its "
                                  f"layers are named {prefix}layers.N)")
        if module not in targeted:
            raise CheckpointError(f"{file}: {key} is for {module}, which target_modules of {adapter.config_file} "
                                  "does not target")
        keys[module, match["factor"]] = key
    for name in targeted:
        for factor in ("lora_A", "lora_B"):
            if (name, factor) not in keys:
                raise CheckpointError(f"{file}: no {KEY_PREFIX}{name}.{factor}.weight, and {adapter.config_file} "
                                      f"targets {name}")
    return keys
