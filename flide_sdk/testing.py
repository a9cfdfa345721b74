"""Tiny random Qwen3.5 checkpoints with a real tokenizer, so tests and the demo need no download.

`make_tiny_checkpoint(path)` writes a text-only (`qwen3_5_text`) checkpoint that transformers'
`Qwen3_5ForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load as well: random weights
(`random_state_dict`), a byte-level BPE trained on the fly with the Qwen3.5 pre-tokenizer pattern, and a
Qwen-style chat template with the `enable_thinking` switch. `tiny_checkpoint()` caches one per seed in the
temp dir; `Engine.tiny()` uses it. The weights are random: answers show the machinery, not judgement.
`write_gemma_tokenizer(path)` writes a tiny Gemma-style tokenizer (SentencePiece-style BPE, Gemma 4's chat
template and special tokens) for tiny Gemma 4 checkpoints.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from flide_sdk.models.checkpoint import random_state_dict, save_text_checkpoint
from flide_sdk.models.config import FULL_ATTENTION, LINEAR_ATTENTION, Qwen35Config
from flide_sdk.text.pretokenizer import QWEN_PRETOKENIZER_PATTERN

TINY_FORMAT = 1  # bump when the tiny checkpoint's contents change, to invalidate caches
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
GENERATION_PROMPT = (  # the tiny chat templates' ending: Qwen3.5's reply opening, thinking off on request
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
TINY_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    + GENERATION_PROMPT
)
_WORDS = ["the", "a", "an", "of", "to", "and", "in", "is", "it", "that", "for", "on", "with", "as", "was", "be", "this", "by", "at", "or", "from", "are", "not", "have", "has", "had", "but", "all", "can", "will", "one", "more", "if", "no", "yes", "out", "so", "what", "when", "which", "there", "their", "they", "we", "you", "he", "she", "his", "her", "them", "then", "than", "into", "up", "down", "over", "after", "before", "about", "time", "work", "step", "file", "test", "error", "run", "agent", "tool", "action", "next", "state", "question", "answer", "option", "level", "score", "choice", "reply", "letter", "number", "only", "with", "yes", "no", "true", "false", "open", "close", "read", "write", "edit", "patch", "fix", "bug", "issue", "code", "line", "function", "class", "module", "import", "return", "value", "list", "dict", "string", "json", "key", "name", "type", "order", "refund", "replace", "customer", "message", "urgent", "severity", "low", "mid", "high", "done", "stuck", "loop", "fail", "pass", "check", "search", "find", "look", "think", "plan", "need", "want", "make", "use", "get", "set", "new", "old", "big", "small", "good", "bad", "first", "last", "other", "same", "each", "every", "some", "many", "most", "few", "very", "also", "just", "still", "again", "here", "now", "today", "week", "hour", "day", "reply", "within", "need", "should", "could", "would", "must", "may", "might", "article", "story", "passage", "reader", "writer", "people", "city", "water", "school", "book", "year", "world", "house", "family", "child", "man", "woman", "friend", "teacher"]


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


GEMMA_SPECIAL_TOKENS = {  # id -> token: the release's ids for those its configs name (pad, eos, bos, <turn|>,
    # <|tool_response>); the other turn and channel tokens placed next to them, the rest of the range <unused*>
    0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 46: "<|tool>", 47: "<tool|>", 48: "<|tool_call>",
    49: "<tool_call|>", 50: "<|tool_response>", 51: "<tool_response|>", 52: '<|"|>', 98: "<|think|>",
    100: "<|channel>", 101: "<channel|>", 105: "<|turn>", 106: "<turn|>",
}
GEMMA_CHAT_TEMPLATE = (  # Gemma 4's turns: content trimmed, an empty thought channel when thinking is off
    "{{- bos_token -}}"
    "{%- set loop_messages = messages -%}"
    "{%- if (enable_thinking is defined and enable_thinking) or messages[0]['role'] in ['system', 'developer'] -%}"
    "{{- '<|turn>system\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking -%}{{- '<|think|>\\n' -}}{%- endif -%}"
    "{%- if messages[0]['role'] in ['system', 'developer'] -%}"
    "{{- messages[0]['content'] | trim -}}{%- set loop_messages = messages[1:] -%}"
    "{%- endif -%}"
    "{{- '<turn|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<|turn>' + role + '\\n' + message['content'] | trim + '<turn|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|turn>model\\n' -}}"
    "{%- if not enable_thinking | default(false) -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}"
    "{%- endif -%}"
)
# SentencePiece's training splits (by white space, digits apart, by script): "▁" starts a piece, never ends one
_GEMMA_TRAINING_SPLIT = "\u2581?\\p{L}+|\u2581?[^\\p{L}\\p{N}\u2581\\n]+|\u2581+|\\p{N}|\\n+"


def gemma_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    """A tokenizer with the layout transformers' Gemma converter writes (and `GemmaTokenizer` builds): spaces
    replaced by "▁", a split at " " (none is left), BPE with byte fallback over the whole text, `<bos>` added by
    the post-processor, the special tokens of `GEMMA_SPECIAL_TOKENS` added. `vocab` holds the special and byte
    tokens at their ids."""
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", vocab["<bos>"])])
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for _, token in sorted(GEMMA_SPECIAL_TOKENS.items())])
    return tokenizer


def gemma_base_vocab() -> dict[str, int]:
    """The special tokens at their ids, `<unused*>` between them, then the 256 byte tokens."""
    first_free = max(GEMMA_SPECIAL_TOKENS) + 1
    vocab = {GEMMA_SPECIAL_TOKENS.get(i, f"<unused{i}>"): i for i in range(first_free)}
    vocab.update((f"<0x{byte:02X}>", first_free + byte) for byte in range(256))
    return vocab


def train_gemma_tokenizer(seed: int = 0, vocab_size: int = 1024) -> Tokenizer:
    """A SentencePiece-style BPE in Gemma's layout (`gemma_tokenizer`), its merges trained on the generated corpus
    of the Qwen tokenizer as SentencePiece trains (pieces split at white space, digits and scripts)."""
    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(_GEMMA_TRAINING_SPLIT), behavior="isolated")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    trainer_tokenizer.train_from_iterator(_training_corpus(seed), trainer)
    learned = json.loads(trainer_tokenizer.model.__getstate__())
    vocab = gemma_base_vocab()
    for token, _ in sorted(learned["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    return gemma_tokenizer(vocab, merges)


def write_gemma_tokenizer(path: str | Path, tokenizer: Tokenizer | None = None,
                          chat_template: str = GEMMA_CHAT_TEMPLATE) -> Path:
    """Write a Gemma-style tokenizer.json (`train_gemma_tokenizer()` unless `tokenizer` is given) and a
    tokenizer_config.json with a Gemma 4 chat template and the named special tokens into `path`, for tiny
    Gemma 4 checkpoints; transformers' `AutoTokenizer` loads them as a `GemmaTokenizer`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or train_gemma_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "GemmaTokenizer",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path


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
    return cached_checkpoint(f"flide_sdk-tiny-v{TINY_FORMAT}-seed{seed}", lambda path: make_tiny_checkpoint(path, seed))


def cached_checkpoint(name: str, make: Callable[[Path], Any]) -> Path:
    """The checkpoint directory `name` in the temp dir, written by `make(path)` on first use: into a staging
    directory moved into place when complete, so concurrent test processes never read a partial one."""
    target = Path(tempfile.gettempdir()) / name
    if (target / ".complete").is_file():
        return target
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    make(staging)
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
