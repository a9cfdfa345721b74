"""The whole engine with its Triton kernels (interpreted on CPU) stays exact against transformers."""

from __future__ import annotations

import asyncio

import pytest

import flide_sdk as fl
from flide_sdk.engine import Engine
from flide_sdk.ops import kernel_ops

from .conftest import text_of_tokens
from .test_exactness import assert_exact, pick


@pytest.mark.asyncio
async def test_kernel_engine_mixed_round_and_resumed_session(tiny_path, hf_tiny):
    base = fl.Engine.load(tiny_path, device="cpu")
    base.close()
    async with Engine(base.model, base.renderer, base.device, ops=kernel_ops(), round_deadline_ms=300) as engine:
        requests = [
            ("the", pick(["urgent"])),
            (text_of_tokens(engine.renderer, 130, seed=4), pick(["action", "severity", "described"])),
            (text_of_tokens(engine.renderer, 70, seed=5), pick(["tool", "json"])),
        ]
        answers = await asyncio.gather(*(engine.ask(state, questions) for state, questions in requests))
        assert engine.stats()["rounds"] == 1
        for (state, questions), got in zip(requests, answers):
            assert_exact(hf_tiny, engine, state, questions, got)
        session = engine.session()
        state = text_of_tokens(engine.renderer, 140, seed=6)
        session.append(state)
        await session.ask(pick(["urgent"]))
        session.append(" and then the agent ran the tests again")
        before = engine.stats()["checkpoint_hits"]
        resumed = await session.ask(pick(["action", "severity"]))
        assert engine.stats()["checkpoint_hits"] == before + 1
        assert_exact(hf_tiny, engine, state + " and then the agent ran the tests again", pick(["action", "severity"]), resumed)
