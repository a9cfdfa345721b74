"""One error boundary for checkpoints (issue 29): whatever is broken in a checkpoint directory, `Engine.load` raises
CheckpointError naming the file and the field, tensor or value; a bad device or dtype raises DeviceError.

Each case copies the tiny checkpoint into tmp_path, breaks one thing, and loads it on the CPU.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import flide_sdk as fl

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
DELETE = object()  # a config change that removes the field


# ------------------------------------------------------------------------------------------ corruptions
def config(**changes: Any) -> Callable[[Path], None]:
    """Set (or, with DELETE, remove) top-level fields of config.json."""

    def corrupt(path: Path) -> None:
        raw = json.loads((path / "config.json").read_text())
        for key, value in changes.items():
            if value is DELETE:
                raw.pop(key, None)
            else:
                raw[key] = value
        (path / "config.json").write_text(json.dumps(raw))

    return corrupt


def rope(**changes: Any) -> Callable[[Path], None]:
    """Set fields of config.json's rope_parameters."""

    def corrupt(path: Path) -> None:
        raw = json.loads((path / "config.json").read_text())
        raw["rope_parameters"].update(changes)
        (path / "config.json").write_text(json.dumps(raw))

    return corrupt


def release(text_config: Any) -> Callable[[Path], None]:
    """config.json in the release layout (`qwen3_5`) with this `text_config` (a callable edits the real one)."""

    def corrupt(path: Path) -> None:
        raw = json.loads((path / "config.json").read_text())
        text = text_config(dict(raw, model_type="qwen3_5_text")) if callable(text_config) else text_config
        (path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text}))

    return corrupt


def write(name: str, content: str | bytes) -> Callable[[Path], None]:
    def corrupt(path: Path) -> None:
        target = path / name
        target.write_bytes(content if isinstance(content, bytes) else content.encode())

    return corrupt


def edit_json(name: str, edit: Callable[[Any], Any]) -> Callable[[Path], None]:
    def corrupt(path: Path) -> None:
        (path / name).write_text(json.dumps(edit(json.loads((path / name).read_text()))))

    return corrupt


def template(source: str) -> Callable[[Path], None]:
    """The chat template in tokenizer_config.json replaced by `source`."""
    return edit_json("tokenizer_config.json", lambda raw: {**raw, "chat_template": source})


def weights(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    """model.safetensors rewritten with `edit` applied to its tensors."""

    def corrupt(path: Path) -> None:
        tensors = load_file(str(path / WEIGHTS))
        edit(tensors)
        save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})

    return corrupt


def set_tensor(key: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Path], None]:
    return weights(lambda tensors: tensors.__setitem__(key, make(tensors[key])))


def with_nan(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[7] = float("nan")
    return t


def with_inf(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[-1] = -float("inf")
    return t


def beyond_float32(t: torch.Tensor) -> torch.Tensor:
    t = t.double()
    t.view(-1)[0] = 1e300
    return t


def _header(data: bytes) -> tuple[int, dict]:
    length = struct.unpack("<Q", data[:8])[0]
    return length, json.loads(data[8 : 8 + length])


def raw_weights(edit: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def corrupt(path: Path) -> None:
        file = path / WEIGHTS
        file.write_bytes(edit(file.read_bytes()))

    return corrupt


def truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def header_length_2_62(data: bytes) -> bytes:
    return struct.pack("<Q", 1 << 62) + data[8:]


def header_not_json(data: bytes) -> bytes:
    length, _ = _header(data)
    return data[:8] + b"{not json" + b" " * (length - 9) + data[8 + length :]


def overlapping_offsets(data: bytes) -> bytes:
    """The second tensor's data starts 4 bytes inside the first's."""
    length, header = _header(data)
    second = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])[1]
    start, end = header[second]["data_offsets"]
    header[second]["data_offsets"] = [start - 4, end - 4]
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + data[8 + length :]


def sharded(edit: Callable[[dict], Any] | None = None, drop: str | None = None) -> Callable[[Path], None]:
    """The weights split over two shards with an index (edited by `edit`); `drop` deletes one shard file."""

    def corrupt(path: Path) -> None:
        tensors = load_file(str(path / WEIGHTS))
        (path / WEIGHTS).unlink()
        keys = sorted(tensors)
        halves = {SHARDS[0]: keys[: len(keys) // 2], SHARDS[1]: keys[len(keys) // 2 :]}
        for shard, names in halves.items():
            save_file({k: tensors[k] for k in names}, str(path / shard), metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {k: shard for shard, names in halves.items() for k in names}}
        if edit is not None:
            index = edit(index)
        (path / INDEX).write_text(json.dumps(index))
        if drop is not None:
            (path / drop).unlink()

    return corrupt


def duplicate_across_shards(path: Path) -> None:
    sharded()(path)
    first = load_file(str(path / SHARDS[0]))
    second = load_file(str(path / SHARDS[1]))
    key = min(first)
    save_file({**second, key: first[key]}, str(path / SHARDS[1]), metadata={"format": "pt"})


def only_kind(kind: str) -> Callable[[Path], None]:
    """Every layer of one kind, with weights for it (copied from a layer of that kind): loadable but degenerate."""
    source = 3 if kind == "full_attention" else 0
    mixer = "self_attn" if kind == "full_attention" else "linear_attn"

    def corrupt(path: Path) -> None:
        raw = json.loads((path / "config.json").read_text())
        config(layer_types=[kind] * raw["num_hidden_layers"])(path)

        def copy(tensors: dict[str, torch.Tensor]) -> None:
            prefix = f"model.layers.{source}.{mixer}."
            for key in [k for k in tensors if k.startswith(prefix)]:
                for layer in range(raw["num_hidden_layers"]):
                    tensors[key.replace(f"layers.{source}.", f"layers.{layer}.")] = tensors[key].clone()

        weights(copy)(path)

    return corrupt


def small_vocab(path: Path) -> None:
    """vocab_size 960, below the tokenizer's ids, with an embedding of 960 rows: the shapes agree."""
    config(vocab_size=960)(path)
    set_tensor("model.embed_tokens.weight", lambda t: t[:960].contiguous())(path)


def other_pretokenizer(raw: dict) -> dict:
    return {**raw, "pre_tokenizer": {"type": "Whitespace"}}


def huge_size(path: Path) -> None:
    config(hidden_size=2**70)(path)


F = re.escape
# (id, corruption, pattern the CheckpointError message must match): the file first, then the field or tensor
CASES = [
    # safetensors
    ("truncated-safetensors", raw_weights(truncated), F(f"{WEIGHTS}: not a readable safetensors file")),
    ("overlapping-offsets", raw_weights(overlapping_offsets), F(WEIGHTS) + ": .*invalid offset"),
    ("header-length-2^62", raw_weights(header_length_2_62), F(WEIGHTS) + ": .*header too large"),
    ("header-not-json", raw_weights(header_not_json), F(WEIGHTS) + ": .*invalid JSON in header"),
    ("int32-weight", set_tensor("model.embed_tokens.weight", lambda t: t.to(torch.int32)),
     F(f"{WEIGHTS}: model.embed_tokens.weight has dtype I32; weights must be floating point")),
    ("bool-weight", set_tensor("model.norm.weight", lambda t: t > 0), F("model.norm.weight has dtype BOOL")),
    ("int64-weight", set_tensor("model.layers.0.linear_attn.A_log", lambda t: t.long()),
     F("model.layers.0.linear_attn.A_log has dtype I64")),
    ("nan-weight", set_tensor("model.layers.2.mlp.down_proj.weight", with_nan),
     F(f"{WEIGHTS}: model.layers.2.mlp.down_proj.weight has NaN or infinite values (as float32)")),
    ("inf-weight", set_tensor("model.layers.3.self_attn.q_norm.weight", with_inf),
     F("model.layers.3.self_attn.q_norm.weight has NaN or infinite values")),
    ("float64-beyond-float32", set_tensor("model.norm.weight", beyond_float32),
     F("model.norm.weight has NaN or infinite values (as float32)")),
    ("wrong-shape", set_tensor("model.norm.weight", lambda t: t[:-1].contiguous()),
     F(f"{WEIGHTS}: model.norm.weight has shape (63,), expected (64,)")),
    ("missing-tensor", weights(lambda tensors: tensors.pop("model.layers.5.mlp.up_proj.weight")),
     F("1 decoder tensors missing, e.g. model.layers.5.mlp.up_proj.weight")),
    ("no-weights", lambda path: (path / WEIGHTS).unlink(), F("no *.safetensors weight files")),
    # the shard index
    ("index-not-json", write(INDEX, '{"weight_map": {'), F(f"{INDEX}: not readable as JSON")),
    ("index-missing-shard", sharded(drop=SHARDS[1]), F(f"{INDEX}: weight_map names {SHARDS[1]}, which is not in")),
    ("index-without-weight-map", sharded(lambda index: {"metadata": {}}), F(f"{INDEX}: no weight_map")),
    ("index-a-list", sharded(lambda index: [index]), F(f"{INDEX}: no weight_map")),
    ("index-path-outside", sharded(lambda index: {"weight_map": {"model.norm.weight": "../model.safetensors"}}),
     F(f"{INDEX}: weight_map names '../model.safetensors', not a file name")),
    ("tensor-in-two-shards", duplicate_across_shards, F(SHARDS[1]) + ": .* is also in .*" + F(SHARDS[0])),
    # config.json
    ("config-not-json", write("config.json", '{"model_type": "qwen3_5_text",'), F("config.json: not readable as JSON")),
    ("config-not-utf8", write("config.json", b'{"model_type": "\xff"}'), F("config.json: not readable as JSON")),
    ("config-a-list", write("config.json", "[1, 2]"), F("config.json: must hold a JSON object, got a list")),
    ("hidden-size-null", config(hidden_size=None), F("config.json: hidden_size must be a positive integer, got None")),
    ("hidden-size-64.5", config(hidden_size=64.5), F("config.json: hidden_size must be a positive integer, got 64.5")),
    ("hidden-size-string", config(hidden_size="64"), F("hidden_size must be a positive integer, got '64'")),
    ("hidden-size-bool", config(hidden_size=True), F("hidden_size must be a positive integer, got True")),
    ("hidden-size-2^70", huge_size, F("config.json: its sizes make tensors too large to describe")),
    ("negative-heads", config(num_attention_heads=-4), F("num_attention_heads must be a positive integer, got -4")),
    ("zero-intermediate", config(intermediate_size=0), F("intermediate_size must be a positive integer, got 0")),
    ("vocab-size-missing", config(vocab_size=DELETE), F("config.json: vocab_size is missing")),
    ("zero-layers", config(num_hidden_layers=0, layer_types=[]),
     F("num_hidden_layers must be a positive integer, got 0")),
    ("no-gated-deltanet-layers", only_kind("full_attention"),
     F("layer_types has no linear_attention layer: every Qwen3.5 model has both")),
    ("no-attention-layers", only_kind("linear_attention"),
     F("layer_types has no full_attention layer: every Qwen3.5 model has both")),
    ("layer-types-short", config(layer_types=["linear_attention", "full_attention"]),
     F("layer_types must list 8 (num_hidden_layers)")),
    ("layer-type-unknown", config(layer_types=["sliding_attention"] * 7 + ["full_attention"]),
     F("layer_types must list 8")),
    ("heads-not-grouped", config(num_key_value_heads=3),
     F("num_attention_heads (4) must be a multiple of num_key_value_heads (3)")),
    ("gdn-heads-not-grouped", config(linear_num_key_heads=3),
     F("linear_num_value_heads (4) must be a multiple of linear_num_key_heads (3)")),
    ("conv-kernel-1", config(linear_conv_kernel_dim=1), F("linear_conv_kernel_dim must be at least 2, got 1")),
    ("max-positions-1e8", config(max_position_embeddings=100_000_000),
     F("max_position_embeddings must be at most 1,048,576 (the rotary tables cover every position), got 100,000,000")),
    ("rms-norm-eps-negative", config(rms_norm_eps=-1), F("rms_norm_eps must be a positive finite number, got -1.0")),
    ("rms-norm-eps-nan", config(rms_norm_eps=float("nan")), F("rms_norm_eps must be a finite number, got nan")),
    ("rope-theta-zero", rope(rope_theta=0), F("rope_theta must be a positive finite number, got 0.0")),
    ("partial-rotary-4.0", rope(partial_rotary_factor=4.0), F("partial_rotary_factor must be in (0, 1], got 4.0")),
    ("partial-rotary-odd", rope(partial_rotary_factor=0.1),
     F("head_dim x partial_rotary_factor must be an even number of rotary channels in [2, head_dim=32], got 3")),
    ("rope-type-yarn", rope(rope_type="yarn"), F("unsupported rope_type 'yarn'")),
    ("rope-parameters-list", config(rope_parameters=[1]), F("rope_parameters must be a JSON object, got [1]")),
    ("tie-embeddings-string", config(tie_word_embeddings="yes"), F("tie_word_embeddings must be true or false")),
    ("attention-bias", config(attention_bias=True), F("attention_bias must be false")),
    ("activation-gelu", config(hidden_act="gelu"), F("hidden_act must be 'silu', got 'gelu'")),
    ("eos-not-an-id", config(eos_token_id="<|im_end|>"), F("eos_token_id must be a token id")),
    ("model-type-llama", config(model_type="llama"), F("config.json: model_type 'llama' is not supported")),
    ("release-text-config-number", release(5), F("config.json: text_config: must be a JSON object, got int")),
    ("release-hidden-size-64.5", release(lambda text: {**text, "hidden_size": 64.5}),
     F("config.json: text_config: hidden_size must be a positive integer, got 64.5")),
    ("vocab-below-tokenizer-ids", small_vocab,
     F("tokenizer.json: token id 1023 is past the model's vocab_size 960 (config.json)")),
    ("no-config", lambda path: (path / "config.json").unlink(), F("no config.json")),
    # tokenizer and chat template
    ("tokenizer-garbage", write("tokenizer.json", b"\x00\x01garbage"), F("tokenizer.json: not a readable tokenizer")),
    ("tokenizer-empty", write("tokenizer.json", b""), F("tokenizer.json: not a readable tokenizer")),
    ("tokenizer-empty-object", write("tokenizer.json", "{}"), F("tokenizer.json: not a readable tokenizer")),
    ("tokenizer-other-pretokenizer", edit_json("tokenizer.json", other_pretokenizer),
     F("tokenizer.json: unsupported tokenizer")),
    ("no-tokenizer", lambda path: (path / "tokenizer.json").unlink(), F("no tokenizer.json")),
    ("tokenizer-config-not-json", write("tokenizer_config.json", "{chat_template"),
     F("tokenizer_config.json: not readable as JSON")),
    ("tokenizer-config-a-list", write("tokenizer_config.json", "[]"),
     F("tokenizer_config.json: must hold a JSON object, got a list")),
    ("no-chat-template", edit_json("tokenizer_config.json", lambda raw: {"eos_token": raw["eos_token"]}),
     F("no chat template")),
    ("template-syntax-error", template("{% for message in messages %}{{ message.content }"),
     F("tokenizer_config.json (chat_template): the chat template does not render a user turn (TemplateSyntaxError")),
    ("template-raises", template("{{ raise_exception('no user turns here') }}"),
     F("does not render a user turn (TemplateError: no user turns here)")),
    ("template-divides-by-zero", template("{{ messages[0].content }}{{ 1 // 0 }}"),
     F("does not render a user turn (ZeroDivisionError")),
    ("template-drops-content", template("<|im_start|>user\n<|im_end|>\n"),
     F("tokenizer_config.json (chat_template): the chat template does not place the user content exactly once")),
    ("template-jinja-file-syntax-error", write("chat_template.jinja", "{% if %}"),
     F("chat_template.jinja: the chat template does not render a user turn (TemplateSyntaxError")),
    ("template-jinja-file-not-utf8", write("chat_template.jinja", b"\xff\xfe{{"), F("chat_template.jinja: unreadable")),
]


@pytest.fixture
def checkpoint(tiny_path: Path, tmp_path: Path) -> Path:
    """A fresh copy of the tiny checkpoint (built once per session) to break."""
    target = tmp_path / "checkpoint"
    shutil.copytree(tiny_path, target, ignore=shutil.ignore_patterns(".complete"))
    return target


@pytest.mark.parametrize(("corrupt", "pattern"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_a_corrupt_checkpoint_raises_checkpoint_error(checkpoint: Path, corrupt, pattern: str) -> None:
    corrupt(checkpoint)
    with pytest.raises(fl.CheckpointError, match=pattern) as raised:
        fl.Engine.load(checkpoint, device="cpu")
    assert str(checkpoint) in str(raised.value)  # every message names the file (or the directory) it is about


def test_the_intact_copy_loads(checkpoint: Path) -> None:
    """The cases above break one thing each: the copy they start from loads and answers."""
    with fl.Engine.load(checkpoint, device="cpu") as engine:
        assert 0 < engine.ask_sync("The test passed.", {"done": fl.Noul("Is it done?")})["done"].noul < 1


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_floating_weights_of_any_width_load(checkpoint: Path, tiny_path: Path, stored: torch.dtype) -> None:
    """Weights stored in another floating dtype are cast to the engine's as they are read (float32 -> float64 ->
    float32 is exact: the same weights, the same answers up to the last bits of the logits: the cast tensors are
    64-byte aligned where the float32 file's are read at their file offsets, and CPU kernels may then sum in
    another order, which the answers' float64 softmax of the float32 log-probabilities shows)."""
    weights(lambda tensors: tensors.update({k: t.to(stored) for k, t in tensors.items()}))(checkpoint)
    state, questions = "The agent ran the tests twice.", {"stuck": fl.Noul("Is the agent stuck?")}
    with fl.Engine.load(checkpoint, device="cpu") as engine:
        assert engine.model.embed_tokens.weight.dtype == torch.float32
        got = engine.ask_sync(state, questions)["stuck"].noul
    assert 0 < got < 1
    if stored == torch.float64:
        with fl.Engine.load(tiny_path, device="cpu") as engine:
            assert got == pytest.approx(engine.ask_sync(state, questions)["stuck"].noul, rel=0, abs=1e-6)


DEVICE_CASES = [
    ("unknown-device", {"device": "bogus"}, F("device 'bogus' is not a device name: give 'cpu', 'cuda' or 'cuda:N'")),
    ("device-number", {"device": 5.5}, F("device 5.5 is not a device name")),
    ("meta-device", {"device": "meta"}, F("device 'meta' is not supported: flide_sdk runs on 'cpu' or 'cuda'")),
    ("mps-device", {"device": "mps"}, F("device 'mps' is not supported")),
    ("dtype-name", {"device": "cpu", "dtype": "float8"}, F("dtype must be one of ['bfloat16', 'float16', 'float32']")),
    ("dtype-int32", {"device": "cpu", "dtype": torch.int32}, F("got torch.int32")),
    ("dtype-not-a-name", {"device": "cpu", "dtype": ["float32"]}, F("got ['float32']")),
]


@pytest.mark.parametrize(("options", "pattern"), [case[1:] for case in DEVICE_CASES], ids=[c[0] for c in DEVICE_CASES])
def test_a_bad_device_or_dtype_raises_device_error(tiny_path: Path, options: dict, pattern: str) -> None:
    with pytest.raises(fl.DeviceError, match=pattern) as raised:
        fl.Engine.load(tiny_path, **options)
    assert isinstance(raised.value, fl.FlideError) and isinstance(raised.value, ValueError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda")], ids=["cuda", "cuda:1", "torch.device"])
def test_cuda_without_cuda_raises_device_error(tiny_path: Path, device) -> None:
    with pytest.raises(fl.DeviceError, match="(this torch build has no CUDA|no CUDA device is visible).*load on 'cpu'"):
        fl.Engine.load(tiny_path, device=device)


def test_engine_tiny_has_the_same_boundary() -> None:
    with pytest.raises(fl.DeviceError, match="not supported"):
        fl.Engine.tiny(device="meta")
