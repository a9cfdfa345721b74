"""Gemma 4 on the engine: tiny random checkpoints written by transformers' own classes (`Gemma4ForCausalLM`, and
`Gemma4ForConditionalGeneration` for the release layout), each switching features on, answer as transformers does
on every question's standalone prompt, in mixed rounds, with forks and resumed sessions, over states far longer
than the sliding window. The tokenizer is the tiny Gemma-layout one of `flide_sdk.testing` (SentencePiece-style BPE,
Gemma 4's chat template), so the whole Gemma stack runs: its tokenization, its prompt, its decoder."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import flide_sdk as fl
from flide_sdk.engine import Engine
from flide_sdk.errors import CheckpointError
from flide_sdk.models.checkpoint import read_config
from flide_sdk.models.ops import kernel_ops
from flide_sdk.testing import train_gemma_tokenizer, write_gemma_tokenizer

from .conftest import TOLERANCE, answer_probabilities, reference_probabilities, text_of_tokens
from .test_exactness import assert_exact, assert_mixed_round_exact, pick
from .test_sessions import QUESTIONS, WORDS

TOKENIZER = train_gemma_tokenizer()
WINDOW = 12  # the sliding window, in tokens: the states below run to 900
SLIDING, FULL = "sliding_attention", "full_attention"

FEATURES = {
    # sliding and full layers (full: their own head dim and proportional RoPE turning a quarter of the pairs),
    # q/k norms and the value norm, GeGLU, embedding scaling, a soft cap that matters (logits of order 3)
    "sliding": {},
    # per-layer inputs; the last two layers (one of each type) read layers 3 and 2's keys and values; their
    # MLPs twice as wide
    "shared": {"hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2, "use_double_wide_mlp": True},
    # full layers' values are their keys' projection, with one key/value head of their own
    "k_eq_v": {"attention_k_eq_v": True, "num_global_key_value_heads": 1},
    # 26B-A4B's FFN: the dense MLP plus routed experts, each with its own norms
    "moe": {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16,
            "attention_k_eq_v": True, "num_global_key_value_heads": 1},
}


def text_config(**overrides) -> dict:
    """A tiny `gemma4_text` config over the tiny Gemma tokenizer's vocabulary: 6 layers (sliding, sliding, full) x 2."""
    vocab = TOKENIZER.get_vocab_size()
    config = {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
              "sliding_window": WINDOW, "layer_types": [SLIDING, SLIDING, FULL] * 2,
              "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": vocab, "final_logit_softcapping": 3.0,
              "max_position_embeddings": 4096, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
    return config | overrides


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights that make every part count: projections ~ N(0, 1/fan_in), norm scales near 1, layer scalars and
    expert scales spread around 1, embeddings giving tied logits of order one or more."""
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in model.named_parameters():
        shape = parameter.shape
        if "norm" in name or name.endswith("router.scale"):
            value = torch.randn(shape, generator=generator) * 0.1 + 1.0
        elif name.endswith("per_expert_scale"):
            value = torch.rand(shape, generator=generator) + 0.5
        elif "embed_tokens" in name:
            value = torch.randn(shape, generator=generator) * 2.0 / shape[-1] ** 0.5
        else:
            value = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
        parameter.data.copy_(value)
    for name, buffer in model.named_buffers():
        if name.endswith("layer_scalar"):
            buffer.data.copy_(torch.rand(buffer.shape, generator=generator) * 0.5 + 0.75)


def make_gemma_checkpoint(path: Path, release: bool = False, seed: int = 0, **overrides) -> torch.nn.Module:
    """Write a tiny Gemma 4 checkpoint with transformers (`gemma4_text`, or with `release` the `gemma4` layout
    with a one-layer vision tower) plus the tiny tokenizer's files; returns transformers' float32 model."""
    from transformers import (
        Gemma4Config as HfGemma4Config,
    )
    from transformers import (
        Gemma4ForCausalLM,
        Gemma4ForConditionalGeneration,
        Gemma4TextConfig,
        Gemma4VisionConfig,
    )

    text = Gemma4TextConfig(**text_config(**overrides))
    if release:
        vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=2, head_dim=8)
        config = HfGemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None)
        model = Gemma4ForConditionalGeneration(config)
    else:
        model = Gemma4ForCausalLM(text)
    model = model.float().eval()
    randomize(model, seed)
    model.save_pretrained(path)
    write_gemma_tokenizer(path, TOKENIZER)
    return model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Per feature set (and the release layout), a checkpoint path and transformers' model of it."""
    made: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(name: str) -> tuple[Path, torch.nn.Module]:
        if name not in made:
            path = tmp_path_factory.mktemp(f"gemma-{name}")
            release = name == "release"
            overrides = FEATURES["shared"] if release else FEATURES[name]
            made[name] = path, make_gemma_checkpoint(path, release=release, **overrides)
        return made[name]

    return get


@pytest.mark.asyncio
@pytest.mark.parametrize("feature", [*FEATURES, "release"])
async def test_mixed_round_matches_transformers(gemma, feature):
    """States of 1, 301 and 899 tokens (past the 12-token window) and 1 to 8 questions of every type in one
    round, each answer within 1e-4 of transformers. Mutations caught: sliding layers attending every key (or the
    window off by one), scores scaled by 1/sqrt(D), the norms' 1 + w, the value norm dropped, RoPE pairing
    i with i + R/2, a KV-shared layer reading the wrong layer's keys, the double-wide MLP narrow, PLE's
    1/sqrt(2) or its norm, k = v using the normed keys, the router's per-expert scale, the soft cap dropped,
    the release's text weights read from the wrong prefix."""
    path, hf_model = gemma(feature)
    await assert_mixed_round_exact(path, hf_model)


def check(answers: dict, hf_model, engine: Engine, state) -> None:
    rendered = engine.render(state, QUESTIONS)
    worst = max(float(np.abs(answer_probabilities(answers[name]) - reference_probabilities(hf_model, rendered,
                                                                                           name)).max())
                for name in QUESTIONS)
    assert worst <= TOLERANCE, f"max |dp| = {worst:.2e}"


@pytest.mark.asyncio
@pytest.mark.parametrize("feature", ["sliding", "shared"])
async def test_session_and_nested_forks_in_one_round_then_resumed(gemma, feature):
    """A session, a fork of it and a fork of the fork, asked together (one round: the forks continue their
    parent's stream keys), then each resumed from the checkpoint that round saved (history keys from the pool,
    their positions in the window's distances), every answer as transformers'. Mutations caught: history keys
    seen past the window (positions from the stream instead of the history), a KV-shared layer's pool arenas
    its own instead of its source's, a checkpoint missing a layer's keys."""
    path, hf_model = gemma(feature)
    async with fl.Engine.load(path, device="cpu", dtype="float32") as engine:
        parent = engine.session()
        texts = {"parent": " ".join(WORDS * 8)}
        parent.append(texts["parent"])
        child = parent.fork()
        child.append(" then the child " + " ".join(WORDS * 5))
        texts["child"] = texts["parent"] + " then the child " + " ".join(WORDS * 5)
        grandchild = child.fork()
        grandchild.append(" and the grandchild " + " ".join(WORDS * 4))
        texts["grandchild"] = texts["child"] + " and the grandchild " + " ".join(WORDS * 4)
        sessions = {"parent": parent, "child": child, "grandchild": grandchild}
        answers = await asyncio.gather(*(s.ask(QUESTIONS) for s in sessions.values()))
        assert engine.stats()["rounds"] == 1
        for name, got in zip(sessions, answers):
            check(got, hf_model, engine, texts[name])
        for name, session in sessions.items():
            session.append(f" {name} again and " + " ".join(WORDS))
            texts[name] += f" {name} again and " + " ".join(WORDS)
            before = engine.stats()["checkpoint_hits"]
            got = await session.ask(QUESTIONS)
            assert engine.stats()["checkpoint_hits"] - before == 1, "the step must resume for this test to mean it"
            check(got, hf_model, engine, texts[name])


def test_batch_invariant_mode_matches_transformers(gemma):
    """The batch-invariant mode (fixed-order ops, windowed attention in fixed key blocks) on a Gemma model with
    KV sharing and PLE: a session resumed at a 64-token checkpoint answers as transformers and as the question
    asked alone. Mutation caught: the fixed-order attention ignoring the window."""
    path, hf_model = gemma("shared")
    with fl.Engine.load(path, device="cpu", batch_invariant=True) as engine, \
            fl.Engine.load(path, device="cpu", pool_bytes=0, batch_invariant=True) as alone:
        session = engine.session()
        text = ""
        for step in range(3):
            addition = " " + " ".join(WORDS * (3 + step))
            session.append(addition)
            text += addition
            got = session.ask_sync(QUESTIONS)
            check(got, hf_model, engine, text)
            assert got.answers == alone.ask_sync(text, QUESTIONS).answers
        assert engine.stats()["checkpoint_hits"] >= 1


@pytest.mark.asyncio
@pytest.mark.parametrize("feature", ["shared", "moe"])
async def test_kernel_ops_match_transformers(gemma, feature):
    """The Triton kernels (interpreted): attention front with Gemma's norm offset, ForkAttention with the window
    and scale 1 (full heads twice the sliding ones' width), the GeGLU kernel (MLP, per-layer inputs, and the
    routed experts' grouped GEMMs), soft-capped label softmax, on a round with a resumed session. Mutations
    caught: the kernel's window test on history keys or stream keys dropped; the GeGLU kernel's cubic term."""
    path, hf_model = gemma(feature)
    base = fl.Engine.load(path, device="cpu")
    base.close()
    async with Engine(base.model, base.prompt, base.device, ops=kernel_ops(), round_deadline_ms=300) as engine:
        session = engine.session()
        state = text_of_tokens(engine.tokens, 40, seed=6)
        session.append(state)
        other = text_of_tokens(engine.tokens, 30, seed=4)
        first, answers = await asyncio.gather(session.ask(pick(["urgent"])),
                                              engine.ask(other, pick(["action", "severity"])))
        assert_exact(hf_model, engine, state, pick(["urgent"]), first)
        assert_exact(hf_model, engine, other, pick(["action", "severity"]), answers)
        addition = " and " + text_of_tokens(engine.tokens, 20, seed=7)
        session.append(addition)
        resumed = await session.ask(pick(["described"]))
        assert engine.stats()["checkpoint_hits"] == 1
        assert_exact(hf_model, engine, state + addition, pick(["described"]), resumed)


def test_checkpoint_bytes_per_token(gemma):
    """A checkpointed token holds keys and values of the layers that compute their own: in the shared config
    sliding layers 0, 1 and 3 (2 heads of 16) and full layer 2 (2 heads of 32), keys and values, nothing for the
    two KV-shared layers (float32). Every layer attends: 6 attention layers, 4 of them sliding. Mutations caught:
    the pool giving KV-shared layers arenas of their own; attention layers counted as full layers alone."""
    path, _ = gemma("shared")
    with fl.Engine.load(path, device="cpu", dtype="float32") as engine:
        info = engine.info()
        assert info["checkpoint_token_bytes"] == (3 * 2 * 2 * 16 + 2 * 2 * 32) * 4
        assert (info["layers"], info["attention_layers"], info["sliding_attention_layers"]) == (6, 6, 4)


def test_release_configs_checkpoint_bytes(tmp_path):
    """The release configs load (`read_config`), and a checkpointed token (bf16) holds the keys and values of the
    layers that keep their own: E2B's first 15 of 35 (the rest are KV-shared). Mutation caught: KV-shared layers
    counted."""
    data = Path("/work/shared/data/configs")
    if not (data / "Gemma-4-E2B.json").is_file():
        pytest.skip("no release configs here")
    (tmp_path / "config.json").write_text((data / "Gemma-4-E2B.json").read_text())
    config, prefix = read_config(tmp_path)
    assert prefix == "model.language_model." and config.first_shared_layer == 15
    own = [config.attention(i) for i in range(15)]
    assert config.state_layout().token_bytes(torch.bfloat16) == sum(2 * a.kv_heads * a.head_dim * 2 for a in own)


@pytest.mark.parametrize("field, value, message", [
    ("attention_bias", True, "attention_bias"),
    ("hidden_activation", "gelu", "hidden_activation"),
    ("use_bidirectional_attention", "all", "use_bidirectional_attention"),
    ("rope_parameters", {SLIDING: {"rope_type": "yarn", "rope_theta": 1e4}, FULL: {"rope_type": "default"}},
     "rope_type"),
    ("sliding_window", 0, "sliding_window"),
])
def test_unserved_configs_are_checkpoint_errors(tmp_path, field, value, message):
    """A config the engine cannot run fails at load naming the field (CheckpointError), before weights are read.
    Mutation caught: a validation dropped (the engine would load and answer wrongly)."""
    config = text_config() | {"model_type": "gemma4_text", field: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        fl.Engine.load(tmp_path, device="cpu")


@pytest.mark.asyncio
@pytest.mark.parametrize("kernels", [False, True], ids=["reference", "triton"])
async def test_sliding_pages_far_past_the_window(gemma, kernels):
    """A session resumed step after step far past the 12-token window (2,000+ tokens with the reference ops; a
    shorter run through the interpreted Triton kernels), a fork from a step's checkpoint whose trunk ends
    mid-page and then grows, each answer within 1e-4 of transformers; the sliding layers' pages in use stop
    growing with the history (public stats) while the full layers' grow. Mutations caught: a checkpoint keeping
    a sliding page its window still sees too few (keep_from one page later), the sliding page table or KV
    slots of the full layers' used for sliding layers, sliding pages kept for the whole history."""
    path, hf_model = gemma("shared")
    base = fl.Engine.load(path, device="cpu", dtype="float32")
    engine = base if not kernels else Engine(base.model, base.prompt, base.device, ops=kernel_ops(),
                                             round_deadline_ms=300)
    if kernels:
        base.close()
    window_pages = -(-WINDOW // 64) + 1
    steps, words = (4, 60) if kernels else (6, 400)
    async with engine:
        session = engine.session()
        text, sliding, full = "", [], []
        fork, fork_text = None, ""
        for step in range(steps):
            addition = " " + text_of_tokens(engine.tokens, words, seed=10 + step)
            session.append(addition)
            text += addition
            before = engine.stats()["checkpoint_hits"]
            check(await session.ask(QUESTIONS), hf_model, engine, text)
            if step:
                assert engine.stats()["checkpoint_hits"] - before == 1, "each step resumes"
            stats = engine.stats()
            sliding.append(stats["pool_sliding_pages"])
            full.append(stats["pool_pages"])
            if step == 1:  # a fork of this step's checkpoint (mid-page: its length is no multiple of 64)
                fork, fork_text = session.fork(), text
        assert full[-1] > full[0] and full == sorted(full)
        checkpoints = engine.stats()["checkpoints"]
        assert max(sliding) <= checkpoints * window_pages, (sliding, checkpoints)
        for step in range(2):
            addition = f" the fork {step} " + text_of_tokens(engine.tokens, words // 2, seed=40 + step)
            fork.append(addition)
            fork_text += addition
            check(await fork.ask(QUESTIONS), hf_model, engine, fork_text)
        session.append(" and the session again")
        check(await session.ask(QUESTIONS), hf_model, engine, text + " and the session again")
        assert engine.stats()["pool_sliding_pages"] <= engine.stats()["checkpoints"] * window_pages


@pytest.mark.asyncio
async def test_a_capped_pool_holds_the_history_its_bytes_allow(gemma):
    """The pool's cap is bytes the page kinds share: a cap of 1.3 checkpoints of a 1,500-token history (its full
    pages for every token, its sliding pages for the window only) keeps that checkpoint, so the next step resumes
    from it, exactly; a second such session evicts the first, and the pool never holds more than its cap.
    Mutations caught: the cap counted as a full plus a sliding page per page (the 1,500 tokens' pages did not fit:
    nothing saved, no step resumed); the full pages growing ahead of need into all the room (none left for the
    sliding pages: nothing saved)."""
    path, hf_model = gemma("sliding")
    with fl.Engine.load(path, device="cpu", dtype="float32", pool_bytes=0) as probe:
        cap = int(1.3 * probe.model.config.state_layout().checkpoint_bytes(1_500, torch.float32))
    async with fl.Engine.load(path, device="cpu", dtype="float32", pool_bytes=cap) as engine:
        fixed = engine.stats()["pool_reserved_bytes"]  # the sinks
        texts = [text_of_tokens(engine.tokens, 1_500, seed=70 + i) for i in range(2)]
        sessions = [engine.session() for _ in texts]
        for session, text in zip(sessions, texts):
            session.append(text)
            check(await session.ask(QUESTIONS), hf_model, engine, text)
            stats = engine.stats()
            assert stats["checkpoints"] == 1 and stats["pool_pages"] >= 1_400 // 64, stats
            assert stats["pool_reserved_bytes"] - fixed <= cap
        assert engine.stats()["evictions"] == 1
        sessions[1].append(" and then the agent stopped")
        check(await sessions[1].ask(QUESTIONS), hf_model, engine, texts[1] + " and then the agent stopped")
        assert engine.stats()["checkpoint_hits"] == 1


def test_checkpoint_bytes_of_a_long_history(gemma):
    """`Engine.info()["checkpoint_bytes"]`: a checkpoint's bytes grow with the history by the full layers' bytes per
    token only; the sliding layers hold at most ceil(window / 64) + 1 pages. Mutation caught: sliding layers
    counted for the whole history."""
    path, _ = gemma("sliding")
    with fl.Engine.load(path, device="cpu", dtype="float32") as engine:
        info = engine.info()
        layout = engine.model.config.state_layout()
        full, sliding = layout.token_bytes(torch.float32, sliding=False), layout.token_bytes(torch.float32, sliding=True)
        assert full + sliding == info["checkpoint_token_bytes"]
        growth = info["checkpoint_bytes"][200_000] - info["checkpoint_bytes"][20_000]
        assert growth == (-(-200_000 // 64) - -(-20_000 // 64)) * 64 * full
        assert info["checkpoint_bytes"][20_000] <= (-(-20_000 // 64) * full + (-(-WINDOW // 64) + 1) * sliding) * 64
