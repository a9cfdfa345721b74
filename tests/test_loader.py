"""Checkpoint loading on directories written by transformers itself, in both layouts, and their exactness."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import flide_sdk as fl
from flide_sdk.models.checkpoint import random_state_dict, read_config
from flide_sdk.models.config import MAX_POSITIONS, Qwen35Config
from flide_sdk.testing import tiny_config_json, train_tiny_tokenizer, write_tokenizer_files

from .test_exactness import assert_exact, mixed_requests

RELEASE_CONFIGS = Path(__file__).resolve().parents[2] / "shared" / "data" / "configs"
VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64,
          "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tiny_tokenizer(seed=0)


def _text_config(tokenizer, **overrides) -> dict:
    vocab = -(-tokenizer.get_vocab_size() // 64) * 64
    return tiny_config_json(vocab, tokenizer.token_to_id("<|im_end|>"), **overrides)


def _hf_model(config_json: dict, seed: int):
    """A transformers Qwen3_5ForCausalLM carrying our random weights (so the answers are not near-uniform)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**config_json)).eval()
    ours = random_state_dict(Qwen35Config.from_text_config(config_json), seed=seed)
    state = {("model." + k if k != "lm_head.weight" else k): v for k, v in ours.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model


def save_causal_lm(path, tokenizer, seed=1, shard=None, **overrides):
    model = _hf_model(_text_config(tokenizer, **overrides), seed)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    write_tokenizer_files(path, tokenizer)
    return model


def save_release_layout(path, tokenizer, seed=2):
    """A tiny Qwen3_5ForConditionalGeneration (vision tower included) with our decoder weights."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = _text_config(tokenizer)
    text.pop("architectures")
    config = Qwen3_5Config(text_config=text, vision_config=VISION, tie_word_embeddings=True)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    ours = random_state_dict(Qwen35Config.from_text_config(text), seed=seed)
    missing, unexpected = model.load_state_dict({"model.language_model." + k: v for k, v in ours.items()}, strict=False)
    assert not unexpected and all(k.startswith("model.visual.") or k == "lm_head.weight" for k in missing)
    model.save_pretrained(path)
    write_tokenizer_files(path, tokenizer)
    causal = _hf_model(text, seed)  # the same decoder as a Qwen3_5ForCausalLM: the reference
    return model, causal


def _check_exact(path, reference) -> None:
    with fl.Engine.load(path, device="cpu") as engine:
        for state, questions in mixed_requests(engine.tokens)[:3]:
            answers = engine.ask_sync(state, questions)
            assert_exact(reference, engine, state, questions, answers)


def test_text_layout_written_by_transformers(tmp_path, tokenizer):
    model = save_causal_lm(tmp_path, tokenizer)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5_text"
    config, prefix = read_config(tmp_path)
    assert prefix == "model." and config.tie_word_embeddings
    _check_exact(tmp_path, model)


def test_sharded_untied_text_layout(tmp_path, tokenizer):
    model = save_causal_lm(tmp_path, tokenizer, seed=3, shard="100KB", tie_word_embeddings=False)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    config, _ = read_config(tmp_path)
    assert not config.tie_word_embeddings
    _check_exact(tmp_path, model)


def test_release_layout_written_by_transformers(tmp_path, tokenizer):
    release, reference = save_release_layout(tmp_path, tokenizer)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5" and "text_config" in raw
    _, prefix = read_config(tmp_path)
    assert prefix == "model.language_model."
    with safe_open(str(next(tmp_path.glob("*.safetensors"))), framework="pt") as reader:
        keys = list(reader.keys())
    assert any(k.startswith("model.visual.") for k in keys)  # present in the file, ignored by the loader
    # the release model itself (not only our CausalLM twin) gives the same next-token logits
    ids = torch.arange(1, 40)[None]
    with torch.no_grad():
        assert torch.allclose(release(input_ids=ids).logits, reference(ids).logits, atol=1e-5)
    _check_exact(tmp_path, reference)


def test_loader_errors(tmp_path, tokenizer):
    with pytest.raises(fl.CheckpointError, match="config.json"):
        fl.Engine.load(tmp_path, device="cpu")
    save_causal_lm(tmp_path, tokenizer)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(fl.CheckpointError, match="not supported"):
        fl.Engine.load(tmp_path, device="cpu")
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 12, "layer_types": None}))
    with pytest.raises(fl.CheckpointError, match="missing"):
        fl.Engine.load(tmp_path, device="cpu")


# ------------------------------------------------------------------------------- config validation (units)
@pytest.mark.skipif(not RELEASE_CONFIGS.is_dir(), reason="the released configs live in ../shared/data")
@pytest.mark.parametrize("size", ["0.8B", "2B", "4B"])
def test_released_configs_pass_validation(tmp_path, size):
    shutil.copy(RELEASE_CONFIGS / f"Qwen3.5-{size}.json", tmp_path / "config.json")
    config, prefix = read_config(tmp_path)
    assert prefix == "model.language_model." and config.tie_word_embeddings
    assert config.rotary_dim == 64 and config.max_position_embeddings == 262_144 <= MAX_POSITIONS
    assert config.layer_types.count("full_attention") * 4 == config.num_layers
    config.check_cuda_kernels()


def test_a_config_is_validated_however_it_is_built():
    config = Qwen35Config.from_text_config(tiny_config_json(1024, 5))
    for change, message in [
        ({"layer_types": ("linear_attention",) * 8}, "no full_attention layer"),
        ({"layer_types": ()}, "layer_types must list"),
        ({"hidden_size": 0}, "hidden_size must be a positive integer, got 0"),
        ({"num_kv_heads": 3}, "must be a multiple of num_key_value_heads"),
        ({"max_position_embeddings": MAX_POSITIONS + 1}, "max_position_embeddings must be at most"),
        ({"rotary_dim": 34}, "even number of rotary channels in \\[2, head_dim=32\\], got 34"),
        ({"rms_norm_eps": float("inf")}, "rms_norm_eps must be a positive finite number"),
        ({"eos_token_id": -1}, "eos_token_id must be a token id"),
    ]:
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(config, **change)
    assert dataclasses.replace(config, max_position_embeddings=MAX_POSITIONS).max_position_embeddings == MAX_POSITIONS


def test_integral_float_sizes_and_eos_lists_are_taken():
    config = Qwen35Config.from_text_config(tiny_config_json(1024, [7, 8], hidden_size=64.0))
    assert type(config.hidden_size) is int and config.hidden_size == 64 and config.eos_token_id == 7
    with pytest.raises(ValueError, match="hidden_size must be a positive integer, got inf"):
        Qwen35Config.from_text_config(tiny_config_json(1024, 5, hidden_size=float("inf")))


def test_cuda_kernel_sizes():
    config = Qwen35Config.from_text_config(tiny_config_json(1024, 5, linear_value_head_dim=32))
    config.check_cuda_kernels()
    for change, message in [
        ({"head_dim": 48}, "head_dim must be a power of two for the CUDA attention kernel, got 48"),
        ({"gdn_key_dim": 8}, "linear_key_head_dim must be a power of two >= 16 for the CUDA Gated DeltaNet kernel"),
        ({"gdn_value_dim": 16}, "linear_value_head_dim must be a power of two >= 32 .* got 16"),  # the tiny model's
        ({"gdn_value_dim": 48}, "linear_value_head_dim must be a power of two >= 32 .* got 48"),
    ]:
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(config, **change).check_cuda_kernels()
