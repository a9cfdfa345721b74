"""Reading Qwen3.5 checkpoints in Hugging Face format, and building random ones of any shape.

Two layouts load: the text-only one written by `Qwen3_5ForCausalLM.save_pretrained` (`model_type`
`qwen3_5_text`, decoder keys under `model.`, `lm_head.weight` unless tied) and the published release
(`model_type` `qwen3_5`, `text_config` nested, decoder keys under `model.language_model.`, vision tower
`model.visual.*` and `mtp.*` ignored). Weights come from `*.safetensors` files, sharded or not; only the
text decoder's tensors are read, straight to the target device and dtype.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flide_sdk.errors import CheckpointError
from flide_sdk.models.qwen35 import Qwen35Config, Qwen35Model

FLOAT32_PARAMETERS = ("A_log", "dt_bias")
"""Parameters kept in float32 whatever the engine dtype (they feed exp/softplus of the decay)."""


def read_config(path: str | Path) -> tuple[Qwen35Config, str]:
    """The decoder config of a checkpoint directory, and the key prefix of its decoder weights."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
    raw = json.loads(config_path.read_text())
    model_type = raw.get("model_type")
    try:
        if model_type == "qwen3_5":
            text = raw.get("text_config") or {}
            tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            return Qwen35Config.from_text_config(text, tie_word_embeddings=tie), "model.language_model."
        if model_type == "qwen3_5_text":
            return Qwen35Config.from_text_config(raw), "model."
    except (KeyError, ValueError) as error:
        raise CheckpointError(f"{config_path}: invalid Qwen3.5 config: {error}") from error
    raise CheckpointError(f"{config_path}: model_type {model_type!r} is not supported (expected qwen3_5 or qwen3_5_text)")


def _tensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weight files")
    return files


def _target_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.rsplit(".", 1)[-1] in FLOAT32_PARAMETERS else dtype


def load_model(path: str | Path, device: torch.device | str, dtype: torch.dtype) -> Qwen35Model:
    """Build the decoder of the checkpoint at `path` on `device` in `dtype`, reading only its tensors."""
    path = Path(path)
    config, prefix = read_config(path)
    with torch.device("meta"):
        model = Qwen35Model(config)
    wanted = {prefix + name: name for name in model.state_dict()}
    if not config.tie_word_embeddings:
        wanted["lm_head.weight"] = "lm_head.weight"
    expected_shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    found: dict[str, torch.Tensor] = {}
    for file in _tensor_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for key in reader.keys():
                name = wanted.get(key)
                if name is None:
                    continue
                tensor = reader.get_tensor(key)
                if tuple(tensor.shape) != expected_shapes[name]:
                    raise CheckpointError(f"{file.name}: {key} has shape {tuple(tensor.shape)}, expected {expected_shapes[name]}")
                found[name] = tensor.to(device=device, dtype=_target_dtype(name, dtype))
    missing = sorted(set(expected_shapes) - set(found))
    if missing:
        shown = ", ".join(prefix + name if name != "lm_head.weight" else name for name in missing[:5])
        raise CheckpointError(f"{path}: {len(missing)} decoder tensors missing, e.g. {shown}")
    model.load_state_dict(found, assign=True)
    model.fuse_projections()
    return model.eval()


def random_state_dict(
    config: Qwen35Config, seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Random decoder weights (our names, no prefix) with activations of order one and spread-out logits.

    Linear layers ~ N(0, 1/fan_in); embeddings small enough that tied head logits have std ~2; norm
    weights near their identity; decays between 0.7 and 0.99 per token so the recurrent state remembers.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in Qwen35Model(config).state_dict().items()}

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
    tensors = {("lm_head.weight" if name == "lm_head.weight" else "model." + name): t.contiguous() for name, t in weights.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
