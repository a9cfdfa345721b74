"""The checkpoint pool takes memory by need: it starts with none for checkpoints, grows as sessions save
(lowest slots and pages first, never past its cap, where the least recently used checkpoints are evicted),
and gives memory back once its checkpoints are gone and the device is idle; answers stay exact throughout."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

import flide_sdk as fl
from flide_sdk.device.pool import CheckpointPool
from flide_sdk.serve.loop import IDLE_WORK_AFTER_S

from .conftest import TOLERANCE, answer_probabilities

QUESTION = {"q": fl.Noul("Did the agent run the tests?")}
WORDS = ["the", "agent", "opened", "the", "file", "read", "line", "12", "found", "an", "error", "edited", "the", "function", "and", "ran", "the", "tests", "again"]


def history(i: int, words: int) -> str:
    return f"session {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))


def wait_until(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(IDLE_WORK_AFTER_S / 4)
    return condition()


def test_the_pool_grows_with_its_sessions_and_gives_memory_back(tiny_path):
    with fl.Engine.load(tiny_path, device="cpu") as engine, fl.Engine.load(tiny_path, device="cpu") as fresh:
        start = engine.stats()
        assert start["pool_reserved_bytes"] < 0.05 * start["pool_capacity_bytes"]  # scratch rows and sinks only
        reserved = [start["pool_reserved_bytes"]]
        sessions = [engine.session() for _ in range(12)]
        for i, session in enumerate(sessions):
            session.append(history(i, 400))
            answers = session.ask_sync(QUESTION)
            alone = fresh.ask_sync(history(i, 400), QUESTION)
            assert np.abs(answer_probabilities(answers["q"]) - answer_probabilities(alone["q"])).max() <= TOLERANCE
            reserved.append(engine.stats()["pool_reserved_bytes"])
        assert reserved[-1] > reserved[0] and reserved == sorted(reserved)  # grown step by step, never shrunk
        stats = engine.stats()
        assert stats["checkpoints"] == 12 and stats["evictions"] == 0
        assert stats["pool_bytes"] <= stats["pool_reserved_bytes"] <= stats["pool_capacity_bytes"]
        engine.clear_pool()
        assert wait_until(lambda: engine.stats()["pool_reserved_bytes"] == start["pool_reserved_bytes"])
        session = sessions[0]  # its checkpoint is gone: the next ask recomputes its state, exactly
        session.append(" and then it stopped")
        answers = session.ask_sync(QUESTION)
        alone = fresh.ask_sync(history(0, 400) + " and then it stopped", QUESTION)
        assert np.abs(answer_probabilities(answers["q"]) - answer_probabilities(alone["q"])).max() <= TOLERANCE
        assert engine.stats()["pool_reserved_bytes"] > start["pool_reserved_bytes"]


def test_a_capped_pool_never_holds_more_than_its_cap(tiny_path):
    with fl.Engine.load(tiny_path, device="cpu", pool_bytes=0) as probe:
        slot_bytes, page_bytes = probe.pool.slot_bytes, probe.pool.page_bytes
    cap = 4 * slot_bytes + 40 * page_bytes
    with fl.Engine.load(tiny_path, device="cpu", pool_bytes=cap, pool_checkpoints=4) as engine:
        fixed = engine.stats()["pool_reserved_bytes"]
        for i in range(10):
            engine.ask_sync(history(i, 400), QUESTION)
            stats = engine.stats()
            assert stats["pool_reserved_bytes"] - fixed <= cap
            assert stats["checkpoints"] <= 4
        assert engine.stats()["evictions"] > 0


@pytest.mark.asyncio
async def test_scratch_rows_are_held_by_need(tiny_path):
    """A round keeps its distinct trunks' states in scratch rows, held by need: a few after load (a lone ask uses
    one; rounds of two long states use two), as many as a round of 24 gathered states needs (still one round),
    the extra given back once the device idles; every answer as alone. No checkpoints (pool_bytes=0), so the
    pool's memory is its scratch rows and sinks. Mutations caught: rows never taken (rounds keep to the four
    held: more rounds); all of them held from the start (memory flat); never given back."""
    texts = [history(i, 30 + 3 * i) for i in range(24)]
    long_texts = [history(i, 1_400) for i in range(6)]  # two to a round by its tokens
    with fl.Engine.load(tiny_path, device="cpu", pool_bytes=0) as fresh:
        alone = [fresh.ask_sync(text, QUESTION) for text in texts]
    async with fl.Engine.load(tiny_path, device="cpu", pool_bytes=0) as engine:
        start = engine.stats()["pool_reserved_bytes"]
        await asyncio.gather(*(engine.ask(text, QUESTION) for text in long_texts))
        assert engine.stats()["pool_reserved_bytes"] == start
        rounds = engine.stats()["rounds"]
        answers = await asyncio.gather(*(engine.ask(text, QUESTION) for text in texts))
        for answer, reference in zip(answers, alone):
            difference = np.abs(answer_probabilities(answer["q"]) - answer_probabilities(reference["q"])).max()
            assert difference <= TOLERANCE
        stats = engine.stats()
        assert stats["pool_reserved_bytes"] > start and stats["rounds"] == rounds + 1, stats
        engine.clear_pool()
        assert await asyncio.to_thread(wait_until, lambda: engine.stats()["pool_reserved_bytes"] == start)
        single = await engine.ask(texts[5], QUESTION)
        assert np.abs(answer_probabilities(single["q"]) - answer_probabilities(alone[5]["q"])).max() <= TOLERANCE
        assert engine.stats()["pool_reserved_bytes"] == start


def test_slots_and_pages_are_taken_lowest_first_and_trimmed_past_the_highest_in_use(engine):
    pool = CheckpointPool(engine.model.config, torch.device("cpu"), torch.float32, 64 << 20, 16)
    assert pool.backed == (0, 0)
    trunks = [engine.prompt.trunk(history(i, 300)) for i in range(6)]
    for trunk in trunks:
        pool.commit(pool.plan_save(trunk, None, 256))
    assert sorted(c.slot for c in pool.checkpoints()) == list(range(6))
    assert sorted(p for c in pool.checkpoints() for p in c.pages) == list(range(24))
    assert pool.backed == (8, 64) and not pool.trimmable  # grown by doubling from its least steps
    pool.clear()
    assert pool.num_checkpoints == 0 and pool.trimmable
    pool.trim()
    assert pool.backed == (0, 0) and pool.used_bytes == 0
    pool.commit(pool.plan_save(trunks[0], None, 256))  # grows again from nothing
    assert pool.backed == (4, 64) and pool.checkpoints()[0].pages == [0, 1, 2, 3]
