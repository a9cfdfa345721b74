"""Tiny random Qwen3.5 checkpoints with a real tokenizer, so tests and the demo need no download.

`make_tiny_checkpoint(path)` writes a text-only (`qwen3_5_text`) checkpoint that transformers'
`Qwen3_5ForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load as well: random weights
(`random_state_dict`), a byte-level BPE trained on the fly with the Qwen3.5 pre-tokenizer pattern, and a
Qwen-style chat template with the `enable_thinking` switch. `tiny_checkpoint()` caches one per seed in the
temp dir; `Engine.tiny()` uses it. The weights are random: answers show the machinery, not judgement.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from flide_sdk.models.checkpoint import random_state_dict, save_text_checkpoint
from flide_sdk.models.config import FULL_ATTENTION, LINEAR_ATTENTION, Qwen35Config
from flide_sdk.text.pretokenizer import QWEN_PRETOKENIZER_PATTERN

TINY_FORMAT = 1  # bump when the tiny checkpoint's contents change, to invalidate caches
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
TINY_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
_WORDS = (
    "the a an of to and in is it that for on with as was be this by at or from are not have has had but all "
    "can will one more if no yes out so what when which there their they we you he she his her them then "
    "than into up down over after before about time work step file test error run agent tool action next "
    "state question answer option level score choice reply letter number only with yes no true false open "
    "close read write edit patch fix bug issue code line function class module import return value list "
    "dict string json key name type order refund replace customer message urgent severity low mid high "
    "done stuck loop fail pass check search find look think plan need want make use get set new old big "
    "small good bad first last other same each every some many most few very also just still again here "
    "now today week hour day reply within need should could would must may might article story passage "
    "reader writer people city water school book year world house family child man woman friend teacher"
).split()


def _training_corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    corpus = []
    for _ in range(4000):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ",", ":", ""])
        if rng.random() < 0.2:
            sentence += f" {rng.randint(0, 9999)}"
        corpus.append(sentence)
    for _ in range(400):
        key, value = rng.choice(_WORDS), rng.choice(_WORDS)
        corpus.append(json.dumps({"role": rng.choice(["user", "assistant"]), key: value, "n": rng.randint(0, 99)}))
    corpus += ["Question: Answer with yes or no only.\nyes\nno\n"] * 200
    corpus += ["A: B: C: D: 0: 1: 2: 3: Answer with the letter of one option only."] * 100
    return corpus


def train_tiny_tokenizer(seed: int = 0, vocab_size: int = 1024) -> Tokenizer:
    """A byte-level BPE with the Qwen3.5 pre-tokenizer, trained on a generated English-like corpus."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZER_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(seed), trainer)
    return tokenizer


def tiny_config_json(vocab_size: int, eos_token_id: int, **overrides: Any) -> dict[str, Any]:
    """A small `qwen3_5_text` config.json (8 layers, 3:1 pattern, grouped GDN heads); overrides win."""
    config: dict[str, Any] = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "eos_token_id": eos_token_id,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        "dtype": "float32",
    }
    config.update(overrides)
    if "layer_types" not in overrides:
        config["layer_types"] = [
            FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(config["num_hidden_layers"])
        ]
    return config


def write_tokenizer_files(path: Path, tokenizer: Tokenizer, chat_template: str = TINY_CHAT_TEMPLATE) -> None:
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def make_tiny_checkpoint(path: str | Path, seed: int = 0, **config_overrides: Any) -> Path:
    """Write a tiny random Qwen3.5 checkpoint (config, weights, tokenizer, chat template) to `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tiny_tokenizer(seed)
    vocab = -(-tokenizer.get_vocab_size() // 64) * 64
    config_json = tiny_config_json(vocab, tokenizer.token_to_id("<|im_end|>"), **config_overrides)
    config = Qwen35Config.from_text_config(config_json)
    save_text_checkpoint(path, config_json, random_state_dict(config, seed=seed))
    write_tokenizer_files(path, tokenizer)
    return path


def tiny_checkpoint(seed: int = 0) -> Path:
    """The cached tiny checkpoint for `seed` in the temp dir, built on first use."""
    target = Path(tempfile.gettempdir()) / f"flide_sdk-tiny-v{TINY_FORMAT}-seed{seed}"
    if (target / ".complete").is_file():
        return target
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    make_tiny_checkpoint(staging, seed=seed)
    (staging / ".complete").touch()
    try:
        os.replace(staging, target)
    except OSError:  # another process finished first, or a stale partial directory is in the way
        if not (target / ".complete").is_file():
            shutil.rmtree(target, ignore_errors=True)
            os.replace(staging, target)
        else:
            shutil.rmtree(staging, ignore_errors=True)
    return target
