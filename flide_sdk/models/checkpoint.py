"""Reading Qwen3.5 and Gemma 4 checkpoints in Hugging Face format, and building random ones of any shape.

Two layouts load, dense or MoE: the text-only one written by `Qwen3_5ForCausalLM.save_pretrained`
(`model_type` `qwen3_5_text` / `qwen3_5_moe_text`, decoder keys under `model.`, `lm_head.weight` unless tied;
one tensor per routed expert's projection) and the published release (`model_type` `qwen3_5` / `qwen3_5_moe`,
`text_config` nested, decoder keys under `model.language_model.`, vision tower `model.visual.*` and `mtp.*`
ignored); a saved `JevForDecision` (`model_type` `jev`) reads as its base model, without a language-model head.
Gemma 4 the same way: `gemma4_text` (`Gemma4ForCausalLM.save_pretrained`, decoder keys under `model.`) and the
`gemma4` release (`Gemma4ForConditionalGeneration`: `text_config` nested, decoder keys under
`model.language_model.`, the vision and audio towers and their embedders ignored). The family, and so the decoder
class, follows the config (`model_class`).
Weights come from `*.safetensors` files, sharded or not; only the text decoder's tensors (and a decision head's,
`models.decision.HeadSpec`) are read, straight to the target device and dtype. Whatever is wrong with a checkpoint
(unreadable JSON or safetensors, a config out of range, a tensor of the wrong shape or dtype or not finite)
raises CheckpointError naming the file and the field or tensor, before the weights are allocated where it can.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from flide_sdk.errors import CheckpointError
from flide_sdk.kernels.fp8 import quantize_rows
from flide_sdk.models.config import MOE_TYPES, Gemma4Config, Qwen35Config
from flide_sdk.models.decision import HeadSpec
from flide_sdk.models.fp8 import Fp8Layout, attach, check_weights, dequantized, quantized, read_layout, scale_key
from flide_sdk.models.gemma4 import Gemma4Model
from flide_sdk.models.lora import LoraAdapter, MergePlan
from flide_sdk.models.qwen35 import DecisionHead, Qwen35Model

FLOAT32_PARAMETERS = ("A_log", "dt_bias")
"""Parameters kept in float32 whatever the engine dtype (they feed exp/softplus of the decay)."""


FLOATING_DTYPES = ("BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2")
"""safetensors dtypes a weight may be stored in (cast to the engine's dtype as it is read); integers, bools and
others are refused."""


def read_json(file: Path) -> Any:
    """The JSON value in `file`; CheckpointError naming the file when it cannot be read or is not JSON."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{file}: not readable as JSON ({error})") from error


ModelConfig = Qwen35Config | Gemma4Config
DecoderModel = Qwen35Model | Gemma4Model


def model_class(config: ModelConfig) -> type[DecoderModel]:
    """The decoder a config describes."""
    return Gemma4Model if isinstance(config, Gemma4Config) else Qwen35Model


def read_config(path: str | Path) -> tuple[ModelConfig, str]:
    """The decoder config of a checkpoint directory, and the key prefix of its decoder weights."""
    config_path = Path(path) / "config.json"
    raw = read_raw_config(Path(path))
    model_type = raw.get("model_type")
    where = config_path
    try:
        if model_type == "jev":  # a saved JevForDecision: its base model's config nested, its decoder under model.
            where = f"{config_path}: text_config"
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise TypeError(f"must be a JSON object, got {type(text).__name__}")
            base = text.get("model_type")
            if base in ("qwen3_5", "qwen3_5_moe", "gemma4"):  # a release-layout base: its decoder's config nested
                where = f"{config_path}: text_config.text_config"
                inner = text.get("text_config")
                if not isinstance(inner, dict):
                    raise TypeError(f"must be a JSON object, got {type(inner).__name__}")
                if base == "gemma4":
                    tie = text.get("tie_word_embeddings", inner.get("tie_word_embeddings", True))
                    return Gemma4Config.from_text_config(inner, tie_word_embeddings=tie), "model.language_model."
                tie = text.get("tie_word_embeddings", inner.get("tie_word_embeddings", False))
                return (Qwen35Config.from_text_config(inner, tie_word_embeddings=tie, moe=base in MOE_TYPES),
                        "model.language_model.")
            if base == "gemma4_text":
                return Gemma4Config.from_text_config(text), "model."
            if base not in ("qwen3_5_text", "qwen3_5_moe_text"):
                raise ValueError(f"model_type {base!r}: a JEV head is served on qwen3_5, qwen3_5_text, qwen3_5_moe, "
                                 "qwen3_5_moe_text, gemma4 or gemma4_text")
            return Qwen35Config.from_text_config(text, moe=base in MOE_TYPES), "model."
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{where}: {error}") from error
    moe = model_type in MOE_TYPES
    try:
        if model_type in ("qwen3_5", "qwen3_5_moe"):
            where = f"{config_path}: text_config"
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise TypeError(f"must be a JSON object, got {type(text).__name__}")
            tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            return Qwen35Config.from_text_config(text, tie_word_embeddings=tie, moe=moe), "model.language_model."
        if model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
            return Qwen35Config.from_text_config(raw, moe=moe), "model."
        if model_type == "gemma4":  # the release: the text decoder's config nested, the towers' ignored
            where = f"{config_path}: text_config"
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise TypeError(f"must be a JSON object, got {type(text).__name__}")
            tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
            return Gemma4Config.from_text_config(text, tie_word_embeddings=tie), "model.language_model."
        if model_type == "gemma4_text":
            return Gemma4Config.from_text_config(raw), "model."
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{where}: {error}") from error
    raise CheckpointError(f"{config_path}: model_type {model_type!r} is not supported (expected qwen3_5, "
                          "qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text, gemma4, gemma4_text or jev)")


def read_raw_config(path: Path) -> dict[str, Any]:
    """The JSON object of a checkpoint's config.json."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
    raw = read_json(config_path)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_path}: must hold a JSON object, got a {type(raw).__name__}")
    return raw


def tensor_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: its index's shards, else every *.safetensors (CheckpointError if none)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        raw = read_json(index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map (a JSON object of tensor name -> shard file)")
        names = set()
        for name in weight_map.values():
            if not isinstance(name, str) or Path(name).name != name:
                raise CheckpointError(f"{index}: weight_map names {name!r}, not a file name in {path}")
            names.add(name)
        missing = sorted(name for name in names if not (path / name).is_file())
        if missing:
            raise CheckpointError(f"{index}: weight_map names {missing[0]}, which is not in {path}"
                                  f" ({len(missing)} of {len(names)} shards missing)")
        return [path / name for name in sorted(names)]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weight files")
    return files


def load_module_weights(module: torch.nn.Module, path: Path, files: list[Path], prefix: str,
                        device: torch.device | str, dtype: torch.dtype, what: str) -> torch.nn.Module:
    """`module` (built on the meta device) with its weights read from `files`, each under `prefix` + its own name,
    shapes and floating point checked as read; CheckpointError naming the file, or what is missing."""
    expected = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    found: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                for key in reader.keys():  # noqa: SIM118 (a safe_open reader is not iterable)
                    name = key.removeprefix(prefix)
                    if not key.startswith(prefix) or name not in expected:
                        continue
                    tensor = reader.get_tensor(key)
                    if tuple(tensor.shape) != expected[name] or not tensor.is_floating_point():
                        raise CheckpointError(f"{file}: {key} has shape {tuple(tensor.shape)} and dtype "
                                              f"{tensor.dtype}, expected {expected[name]} floating point")
                    found[name] = tensor.to(device=device, dtype=dtype)
        except (OSError, SafetensorError) as error:
            raise CheckpointError(f"{file}: not a readable safetensors file ({error})") from error
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} {what} tensors missing, e.g. {prefix}{missing[0]}")
    module.load_state_dict(found, assign=True)
    return module.eval()


def _target_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.rsplit(".", 1)[-1] in FLOAT32_PARAMETERS else dtype


def load_model(path: str | Path, device: torch.device | str, dtype: torch.dtype,
               head: HeadSpec | None = None, adapter: LoraAdapter | None = None, weights: str = "auto") -> DecoderModel:
    """Build the decoder of the checkpoint at `path` on `device` in `dtype`, reading only its tensors, and its
    decision head when `head` says where it is (a saved JEV has no language-model head: it is not read), with the
    LoRA `adapter` merged into the projections it targets (in float32, each as it is read, before the cast).
    weights "fp8", or "auto" on an FP8 checkpoint: the projections `models.fp8.quantized` names are held in FP8
    (quantized per row from float32 after the merge; an FP8 checkpoint's weights dequantized first).

    The config is validated first (nothing is allocated for a bad one), then the adapter against the model's
    projections; each tensor's shape and dtype are checked before it is read, and all are checked finite on the
    device with one read of the device at the end."""
    check_weights(weights)
    path = Path(path)
    device = torch.device(device)
    config, prefix = read_config(path)
    raw_config = read_raw_config(path)
    saved_jev = raw_config.get("model_type") == "jev"
    layout = read_layout(raw_config, path / "config.json")
    fp8 = weights == "fp8" or layout is not None
    if device.type == "cuda":
        try:
            config.check_cuda_kernels()
        except ValueError as error:
            raise CheckpointError(f"{path / 'config.json'}: {error}") from error
    try:
        with torch.device("meta"):  # shapes only, no memory
            decision_head = None if head is None else DecisionHead(config.hidden_size, head.rows, head.softcap)
            model = model_class(config)(config, decision_head, lm_head=not saved_jev)
    except (OverflowError, RuntimeError, TypeError) as error:  # a shape past int64
        first_line = str(error).splitlines()[0]
        message = f"{path / 'config.json'}: its sizes make tensors too large to describe ({first_line})"
        raise CheckpointError(message) from error

    head_keys = {} if head is None else {head.weight_key: "decision_head.weight"}
    if head is not None and head.bias_key is not None:
        head_keys[head.bias_key] = "decision_head.bias"
    if saved_jev and head is not None:  # transformers renames a saved JEV's top-level `weight` to `proj.weight`
        head_keys.setdefault("weight", "decision_head.weight")

    def key_of(name: str) -> str:
        keys = {"lm_head.weight": "lm_head.weight", **{ours: key for key, ours in head_keys.items()}}
        return keys.get(name, prefix + name)

    lora = None if adapter is None else MergePlan.of(adapter, model, prefix, device)
    expected_shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    wanted = {key_of(name): name for name in expected_shapes if not name.startswith("decision_head.")}
    files = tensor_files(path)
    head_files = files if head is None or head.file is None else [head.file]
    found: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}  # an FP8 projection's row scales (its float8 values are in `found`)
    checkpoint_scales = {} if layout is None else _scale_tensors(files)
    sources: dict[str, Path] = {}
    finite: list[torch.Tensor] = []  # per tensor found, whether it is all finite (on the device, read once)
    for file in dict.fromkeys([*files, *head_files]):
        in_head = file in head_files
        if in_head and head is not None and head.file is not None:  # a head's own file holds only the head
            _check_head_file(file, head_keys)
        try:
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                for key in reader.keys():  # noqa: SIM118 (a safe_open reader is not iterable)
                    name = head_keys.get(key) if in_head and key in head_keys else wanted.get(key)
                    if name is None:
                        continue
                    if name in found:
                        raise CheckpointError(f"{file}: {key} is also in {sources[name]}")
                    view = reader.get_slice(key)
                    shape, stored = tuple(view.get_shape()), view.get_dtype()
                    if shape != expected_shapes[name]:
                        raise CheckpointError(f"{file}: {key} has shape {shape}, expected {expected_shapes[name]}")
                    if stored not in FLOATING_DTYPES:
                        raise CheckpointError(f"{file}: {key} has dtype {stored}; weights must be floating point "
                                              f"({', '.join(FLOATING_DTYPES)})")
                    tensor = reader.get_tensor(key)
                    if layout is not None and stored.startswith("F8_"):
                        tensor = _dequantized(tensor.to(device), checkpoint_scales, layout, key, file)
                    if lora is not None:
                        tensor = lora.merged(name, tensor.to(device))
                    sources[name] = file
                    if fp8 and quantized(name):
                        wide = tensor.to(device=device, dtype=torch.float32)
                        finite.append(torch.isfinite(wide).all())
                        held = quantize_rows(wide)
                        found[name], scales[name] = held.values, held.scale
                        continue
                    tensor = tensor.to(device=device, dtype=_target_dtype(name, dtype))
                    found[name] = tensor
                    finite.append(torch.isfinite(tensor).all())
        except (OSError, SafetensorError) as error:
            raise CheckpointError(f"{file}: not a readable safetensors file ({error})") from error
    if head is not None and "decision_head.bias" not in found:  # none stored: zeros, transformers' init
        found["decision_head.bias"] = torch.zeros(head.rows, device=device, dtype=dtype)
        finite.append(torch.isfinite(found["decision_head.bias"]).all())
    missing = sorted(set(expected_shapes) - set(found))
    if missing:
        shown = ", ".join(key_of(name) for name in missing[:5])
        raise CheckpointError(f"{path}: {len(missing)} decoder tensors missing, e.g. {shown}")
    flags = torch.stack(finite).tolist()  # the one read of the device
    if not all(flags):
        bad = [name for name, ok in zip(found, flags) if not ok]
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise CheckpointError(f"{sources[bad[0]]}: {key_of(bad[0])} has NaN or infinite values "
                              f"(as {str(found[bad[0]].dtype).removeprefix('torch.')}){more}")
    model.load_state_dict(found, assign=True)
    attach(model, scales)
    model.fuse_projections()
    return model.eval()


def _scale_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint's scales (`*_scale_inv`), by key, from every shard (a weight's may be in another)."""
    scales = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                for key in reader.keys():  # noqa: SIM118 (a safe_open reader is not iterable)
                    if key.endswith("_scale_inv"):
                        scales[key] = reader.get_tensor(key)
        except (OSError, SafetensorError) as error:
            raise CheckpointError(f"{file}: not a readable safetensors file ({error})") from error
    return scales


def _dequantized(values: torch.Tensor, scales: dict[str, torch.Tensor], layout: Fp8Layout, key: str,
                 file: Path) -> torch.Tensor:
    scale = scales.get(scale_key(key))
    if scale is None:
        raise CheckpointError(f"{file}: {key} is float8 but no shard holds {scale_key(key)}")
    return dequantized(values, scale.to(values.device), layout, key, file)


def _check_head_file(file: Path, head_keys: dict[str, str]) -> None:
    """A head file holds the head's tensors and nothing else (another tensor would be one it cannot read)."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            keys = list(reader.keys())
    except (OSError, SafetensorError) as error:
        raise CheckpointError(f"{file}: not a readable safetensors file ({error})") from error
    unknown = [key for key in keys if key not in head_keys]
    if unknown:
        raise CheckpointError(f"{file}: tensor {unknown[0]!r} is not a decision head's (expected "
                              f"{', '.join(head_keys)})")


def random_state_dict(
    config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Random decoder weights (our names, no prefix) with activations of order one and spread-out logits.

    Linear layers ~ N(0, 1/fan_in); embeddings small enough that tied head logits have std ~2; norm
    weights near their identity; decays between 0.7 and 0.99 per token so the recurrent state remembers.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in model_class(config)(config).state_dict().items()}

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device) * std + mean

    weights: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name.endswith("A_log"):
            value = torch.empty(shape, device=device).uniform_(0.02, 1.0, generator=generator).log()
        elif name.endswith("dt_bias"):
            value = normal(shape, 0.5, mean=-1.0)
        elif name.endswith("linear_attn.norm.weight"):
            value = normal(shape, 0.1, mean=1.0)
        elif name.endswith("norm.weight"):
            value = normal(shape, 0.1)
        elif name.endswith("conv1d.weight"):
            value = normal(shape, 1.0 / math.sqrt(shape[-1]))
        elif name == "embed_tokens.weight":
            value = normal(shape, 2.0 / math.sqrt(config.hidden_size))
        else:
            value = normal(shape, 1.0 / math.sqrt(shape[-1]))
        weights[name] = value.to(_target_dtype(name, dtype))
    return weights


def save_text_checkpoint(path: str | Path, config_json: dict, weights: dict[str, torch.Tensor]) -> None:
    """Write `weights` (our names) as a text-only (`qwen3_5_text`) checkpoint: config.json + model.safetensors."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_json, indent=2))
    tensors = {("lm_head.weight" if name == "lm_head.weight" else "model." + name): t.contiguous()
               for name, t in weights.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
