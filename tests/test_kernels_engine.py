"""The whole engine with its Triton kernels (interpreted on CPU) stays exact against transformers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

import flide_sdk as fl
from flide_sdk.engine import Engine
from flide_sdk.models.ops import kernel_ops
from flide_sdk.testing import make_tiny_checkpoint

from .conftest import text_of_tokens
from .test_exactness import assert_exact, pick

# The interpreter's cost is programs x layers: the tiny model cut to 4 layers, two of each kind in turn (so
# each kind's per-layer caches are told apart), with one key head and two value heads in its Gated DeltaNet
# (still grouped, Hv = 2 Hk); its attention keeps 4 query heads over 2 key/value heads.
SMALL_TINY = {"num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention"] * 2,
              "linear_num_key_heads": 1, "linear_num_value_heads": 2}


def small_tiny_checkpoint(path: Path) -> Path:
    return make_tiny_checkpoint(path, **SMALL_TINY)


@pytest.fixture(scope="module")
def small_tiny_path(tmp_path_factory) -> Path:
    return small_tiny_checkpoint(tmp_path_factory.mktemp("small-tiny"))


@pytest.fixture(scope="module")
def hf_small_tiny(small_tiny_path):
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(small_tiny_path, dtype=torch.float32).eval()


@pytest.mark.asyncio
async def test_kernel_engine_mixed_round_and_resumed_session(small_tiny_path, hf_small_tiny):
    """One round of four requests (a 1-token state, trunks over one and two Gated DeltaNet chunks, none a
    multiple of 64: the unfused trunk scan), questions of every type, one of them a session's first ask; then
    the session (one trunk: the fused scan) resumed from that round's checkpoint after a history of two pages,
    the last one partial."""
    base = fl.Engine.load(small_tiny_path, device="cpu")
    base.close()
    async with Engine(base.model, base.prompt, base.device, ops=kernel_ops(), round_deadline_ms=300) as engine:
        session = engine.session()
        state = text_of_tokens(engine.tokens, 80, seed=6)
        session.append(state)
        requests = [
            ("the", pick(["urgent"])),
            (text_of_tokens(engine.tokens, 100, seed=4), pick(["action", "severity", "described"])),
            (text_of_tokens(engine.tokens, 40, seed=5), pick(["json"])),
        ]
        *answers, first = await asyncio.gather(*(engine.ask(state, questions) for state, questions in requests),
                                               session.ask(pick(["urgent"])))
        assert engine.stats()["rounds"] == 1
        for (asked, questions), got in zip([*requests, (state, pick(["urgent"]))], [*answers, first]):
            assert_exact(hf_small_tiny, engine, asked, questions, got)
        session.append(" and then the agent ran the tests again")
        before = engine.stats()["checkpoint_hits"]
        resumed = await session.ask(pick(["action", "severity"]))
        assert engine.stats()["checkpoint_hits"] == before + 1
        assert engine.stats()["rounds"] == 2
        assert_exact(hf_small_tiny, engine, state + " and then the agent ran the tests again",
                     pick(["action", "severity"]), resumed)


@pytest.mark.asyncio
async def test_kernel_engine_session_and_nested_forks_in_one_round(small_tiny_path, hf_small_tiny):
    """A session, its fork and the fork's fork asked together on the kernels: one round (forks continuing
    their parents' states at their save points: attention up to the fork point, six Gated DeltaNet levels in
    two launch groups), each exact."""
    base = fl.Engine.load(small_tiny_path, device="cpu")
    base.close()
    async with Engine(base.model, base.prompt, base.device, ops=kernel_ops(), round_deadline_ms=300) as engine:
        texts = [text_of_tokens(engine.tokens, 90, seed=7)]
        texts += [texts[0] + " " + text_of_tokens(engine.tokens, 80, seed=8)]
        texts += [texts[1] + " " + text_of_tokens(engine.tokens, 70, seed=9)]
        parent = engine.session()
        parent.append(texts[0])
        child = parent.fork()
        child.append(texts[1][len(texts[0]):])
        grandchild = child.fork()
        grandchild.append(texts[2][len(texts[1]):])
        questions = pick(["urgent", "action"])
        answers = await asyncio.gather(*(s.ask(questions) for s in (parent, child, grandchild)))
        assert engine.stats()["rounds"] == 1 and engine.stats()["deferred"] == 0
        for text, got in zip(texts, answers):
            assert_exact(hf_small_tiny, engine, text, questions, got)


@pytest.mark.asyncio
async def test_kernel_engine_scores_options_by_their_text(small_tiny_path, hf_small_tiny):
    """A text-scored Choice and a label question in one round on the kernels (the readout rows of both kinds
    through the last layer's attention tiles, the reads' log-probabilities through their own kernels)."""
    from .test_text_scoring import text_choice, worst_error

    base = fl.Engine.load(small_tiny_path, device="cpu")
    base.close()
    async with Engine(base.model, base.prompt, base.device, ops=kernel_ops(), round_deadline_ms=300) as engine:
        state = text_of_tokens(engine.tokens, 90, seed=8)
        questions = {"next": text_choice(["a", "b c", "the test failed", "the test"]), **pick(["urgent"])}
        response = await engine.ask(state, questions)
        assert worst_error(hf_small_tiny, engine, state, questions, response) <= 1e-4
        assert_exact(hf_small_tiny, engine, state, pick(["urgent"]), response)
