"""Engine behaviour: bad input fails alone, concurrent asks share rounds, cancellation, closing."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import flide_sdk as fl

from .conftest import answer_probabilities, gated_engine

GOOD = {"n": fl.Noul("Is it late?"), "c": fl.Choice("Next?", {"wait": None, "act": None})}


@pytest.mark.parametrize(
    ("state", "questions", "error"),
    [
        ("s", {}, fl.InvalidQuestionError),
        ("s", {"q": {"type": "choice", "criteria": {}}}, fl.InvalidQuestionError),
        ("s", {"q": fl.Choice("?", {f"o{i}": None for i in range(27)})}, fl.InvalidQuestionError),
        ("s", {"q": fl.Score("?", [str(i) for i in range(27)])}, fl.InvalidQuestionError),
        ("s", {"q": {"type": "choice", "criteria": {1: "one"}}}, fl.InvalidQuestionError),
        ("s", {"q": {"type": "rank", "criteria": ["a"]}}, fl.InvalidQuestionError),
        ({"not json": object()}, GOOD, fl.InvalidStateError),
    ],
)
def test_bad_input_raises_and_engine_stays_usable(engine, state, questions, error):
    with pytest.raises(error):
        engine.ask_sync(state, questions)
    assert set(engine.ask_sync("s", GOOD)) == {"n", "c"}


def test_state_longer_than_maximum(tiny_path):
    with fl.Engine.load(tiny_path, device="cpu", max_prompt_tokens=200) as engine:
        with pytest.raises(fl.StateTooLongError, match="max_prompt_tokens=200") as info:
            engine.ask_sync("word " * 400, GOOD)
        assert info.value.tokens > 200
        assert engine.stats()["asks"] == 0
        assert set(engine.ask_sync("short", GOOD)) == {"n", "c"}


def test_prompt_limit_past_the_models_positions_is_refused(tiny_path):
    """Prompts longer than the model's positions would read past its rotary tables: refused at load."""
    with pytest.raises(fl.InvalidOptionError, match="max_prompt_tokens=40000 is more than the model's 32768 positions"):
        fl.Engine.load(tiny_path, device="cpu", max_prompt_tokens=40_000)


@pytest.mark.parametrize(
    ("option", "value"),
    [("max_prompt_tokens", 0), ("max_round_tokens", -1), ("max_round_requests", 0), ("max_pending", 0),
     ("pool_bytes", -1), ("pool_checkpoints", 0), ("round_deadline_ms", -1.0), ("round_deadline_ms", float("nan")),
     ("max_round_tokens", 100.5), ("max_pending", True), ("pool_bytes", "1GB")],
)
def test_options_out_of_range_are_refused_before_loading(tiny_path, option, value):
    with pytest.raises(fl.InvalidOptionError, match=option):
        fl.Engine.load(tiny_path, device="cpu", **{option: value})


def test_graphs_on_cpu_are_a_device_error(tiny_path):
    with pytest.raises(fl.DeviceError, match="CUDA graphs need a CUDA device"):
        fl.Engine.load(tiny_path, device="cpu", graphs=True)


@pytest.mark.asyncio
async def test_closed_engine_refuses_asks(tiny_path):
    engine = fl.Engine.load(tiny_path, device="cpu")
    await engine.ask("s", GOOD)
    assert engine.stats()["checkpoints"] == 1 and engine.stats()["pool_reserved_bytes"] > 0
    await engine.aclose()
    assert engine.closed
    stats = engine.stats()  # the pool's device memory is released
    assert stats["pool_bytes"] == stats["pool_capacity_bytes"] == stats["checkpoints"] == 0
    assert stats["pool_reserved_bytes"] == 0
    with pytest.raises(fl.EngineClosedError):
        await engine.ask("s", GOOD)
    with pytest.raises(fl.EngineClosedError):
        engine.ask_sync("s", GOOD)


@pytest.mark.asyncio
async def test_concurrent_asks_share_rounds_and_answer_like_alone(tiny_path):
    async with fl.Engine.load(tiny_path, device="cpu", round_deadline_ms=50) as engine:
        states = [f"customer {i} says the order is late" for i in range(32)]
        together = await asyncio.gather(*(engine.ask(state, GOOD) for state in states))
        stats = engine.stats()
        assert stats["asks"] == 32 and stats["rounds"] < 32
        for state, answers in zip(states[:4], together):
            alone = await engine.ask(state, GOOD)
            for name in GOOD:
                assert np.abs(answer_probabilities(alone[name]) - answer_probabilities(answers[name])).max() < 1e-5


@pytest.mark.asyncio
async def test_asks_from_several_threads_and_event_loops(engine):
    results: dict[int, dict] = {}

    def worker(index: int) -> None:
        results[index] = asyncio.run(engine.ask(f"thread {index}", GOOD))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(results) == [0, 1, 2, 3]
    assert all(isinstance(r["n"], fl.NoulAnswer) for r in results.values())


@pytest.mark.asyncio
async def test_cancelled_pending_ask_is_removed(tiny_path):
    async with fl.Engine.load(tiny_path, device="cpu", round_deadline_ms=300) as engine:
        keep = asyncio.ensure_future(engine.ask("keep me", GOOD))
        drop = asyncio.ensure_future(engine.ask("drop me", GOOD))
        await asyncio.sleep(0.05)  # both queued, round not started (deadline 300 ms)
        drop.cancel()
        answers = await keep
        with pytest.raises(asyncio.CancelledError):
            await drop
        stats = engine.stats()
        assert stats["asks"] == 1 and stats["questions"] == 2
        alone = await engine.ask("keep me", GOOD)
        assert answers["n"].noul == pytest.approx(alone["n"].noul, abs=1e-6)


@pytest.mark.asyncio
async def test_aclose_fails_pending_asks(tiny_path):
    engine = fl.Engine.load(tiny_path, device="cpu", round_deadline_ms=5000)
    pending = [asyncio.ensure_future(engine.ask(f"s{i}", GOOD)) for i in range(3)]
    await asyncio.sleep(0.05)
    await engine.aclose()
    for task in pending:
        with pytest.raises(fl.EngineClosedError):
            await task


@pytest.mark.asyncio
async def test_large_rounds_split_at_request_boundaries(tiny_path):
    async with fl.Engine.load(tiny_path, device="cpu", max_round_tokens=200) as engine:
        states = [f"request {i} " + "word " * 60 for i in range(4)]
        answers = await asyncio.gather(*(engine.ask(state, GOOD) for state in states))
        stats = engine.stats()
        assert all(set(a) == {"n", "c"} for a in answers)
        assert stats["rounds"] == 4  # each request is ~130 tokens: two never fit in 200
        assert stats["tokens_computed"] == sum(engine.render(s, GOOD).state_ids.size for s in states) + 4 * sum(
            q.ids.size for q in engine.render("x", GOOD).questions.values()
        )


def test_render_and_stats(engine):
    rendered = engine.render("state", GOOD)
    assert set(rendered.questions) == {"n", "c"}
    assert rendered.questions["c"].labels == ("A", "B")
    engine.ask_sync("state", GOOD)
    stats = engine.stats()
    assert stats["rounds"] == 1 and stats["asks"] == 1 and stats["questions"] == 2
    assert stats["tokens_computed"] == rendered.state_ids.size + sum(q.ids.size for q in rendered.questions.values())
    for stage in ("submit", "plan", "launch"):  # the thread's CPU time in a stage is within its wall time
        assert 0 < stats[f"{stage}_cpu_seconds"] <= stats[f"{stage}_seconds"] + 1e-4, stage
    assert 0 < stats["spec_seconds"] <= stats["plan_seconds"]  # the checkpoint reservation is part of planning
    assert stats["pad_seconds"] == stats["replay_call_seconds"] == 0  # no graphs on CPU: nothing staged
    assert engine.wait_for_graphs(timeout=0) and stats["graphs_captured"] == 0  # none to capture on CPU


def test_short_questions_share_gdn_chunks_except_in_the_batch_invariant_mode(tiny_path):
    """`gdn_chunks` counts a round's Gated DeltaNet chunk rows: six short questions of one state pack two to a
    chunk row beside the state's; the batch-invariant mode gives each its own."""
    questions = {f"q{i}": fl.Noul(f"Is it {i}?") for i in range(6)}
    for invariant, branch_rows in ((False, 3), (True, 6)):
        with fl.Engine.load(tiny_path, device="cpu", pool_bytes=0, batch_invariant=invariant) as engine:
            rendered = engine.render("state", questions)
            assert all(22 <= q.ids.size <= 32 for q in rendered.questions.values())  # two fit a chunk, not three
            engine.ask_sync("state", questions)
            trunk_rows = -(-rendered.state_ids.size // 64)
            assert engine.stats()["gdn_chunks"] == trunk_rows + branch_rows


def test_stats_account_for_the_time_an_ask_waits_for_its_round(tiny_path):
    """queue_seconds sums, per ask, the time from queueing to its round's start: with a round deadline, a
    lone ask waits at least that long; admission is part of that wait."""
    with fl.Engine.load(tiny_path, device="cpu", round_deadline_ms=200) as engine:
        engine.ask_sync("state", GOOD)
        stats = engine.stats()
    assert stats["queue_seconds"] >= 0.2
    assert 0 < stats["select_seconds"] < stats["queue_seconds"]


def _record_calls(owner, method: str, entry) -> list:
    """Wraps `owner.<method>` so that each call first appends `entry(first argument)` to the list returned."""
    calls: list = []
    original = getattr(owner, method)

    def recording(argument, *rest):
        calls.append(entry(argument))
        return original(argument, *rest)

    setattr(owner, method, recording)
    return calls


def _thread_name(_argument) -> str:
    return threading.current_thread().name


@pytest.mark.asyncio
async def test_asks_are_rendered_and_tokenized_on_the_asking_thread(tiny_path):
    """The asking thread renders an ask's questions and tokenizes its state, idle engine or busy; the round
    thread only schedules and launches."""
    async with fl.Engine.load(tiny_path, device="cpu") as engine:
        tokenized = _record_calls(engine.prompt, "trunk", _thread_name)
        rendered = _record_calls(engine.prompt, "render_questions", _thread_name)
        for i in range(2):
            assert set(await engine.ask(f"lone ask {i}", GOOD)) == {"n", "c"}
        await asyncio.gather(*(engine.ask(f"gathered {i}", GOOD) for i in range(2)))
        me = threading.current_thread().name
        assert tokenized == [me] * 4 and rendered == [me] * 4 and engine.stats()["asks"] == 4


@pytest.mark.asyncio
async def test_questions_refused_at_rendering_raise_in_the_caller(tiny_path):
    """A question with more options than single-token labels raises in the caller, idle engine or busy; it is
    not counted, and the asks around it are answered."""
    too_many = {"q": fl.Choice("Which?", {f"o{i}": None for i in range(27)})}
    with gated_engine(tiny_path) as (engine, gate):
        with pytest.raises(fl.InvalidQuestionError, match="27 options"):
            await engine.ask("idle engine", too_many)
        with gate.closed():
            good = asyncio.ensure_future(engine.ask("held", GOOD))
            await asyncio.to_thread(gate.wait_held)
            with pytest.raises(fl.InvalidQuestionError, match="27 options"):
                await engine.ask("busy engine", too_many)
        assert set(await asyncio.wait_for(good, timeout=30)) == {"n", "c"}
        assert engine.stats()["asks"] == 1 and not engine.closed


@pytest.mark.asyncio
async def test_an_ask_cancelled_in_the_iteration_it_was_made_takes_no_room(tiny_path):
    """Cancelled before its event loop's iteration ends, an ask is never queued: in a full queue, the ask
    staged after it takes the room."""
    with gated_engine(tiny_path, max_pending=1) as (engine, gate):
        with gate.closed():
            busy = asyncio.ensure_future(engine.ask("holds the device", GOOD))
            await asyncio.to_thread(gate.wait_held)
            dropped = asyncio.ensure_future(engine.ask("dropped", GOOD))
            kept = asyncio.ensure_future(engine.ask("kept", GOOD, queue_timeout=0.05))
            await asyncio.sleep(0)  # both tasks have staged their asks; the iteration's flush has not run yet
            dropped.cancel()
            await asyncio.sleep(0.2)
            assert not kept.done(), "queued, not refused for want of room"
        assert set(await kept) == set(await busy) == {"n", "c"}
        with pytest.raises(asyncio.CancelledError):
            await dropped
        assert engine.stats()["asks"] == 2


@pytest.mark.asyncio
async def test_a_state_too_long_raises_in_the_caller(tiny_path):
    async with fl.Engine.load(tiny_path, device="cpu", max_prompt_tokens=200) as engine:
        with pytest.raises(fl.StateTooLongError, match="max_prompt_tokens=200"):
            await engine.ask("word " * 400, GOOD)
        assert engine.stats()["asks"] == 0 and not engine.closed
        assert set(await asyncio.wait_for(engine.ask("short", GOOD), timeout=30)) == {"n", "c"}


@pytest.mark.asyncio
async def test_one_off_asks_from_many_threads_are_each_answered_once_as_alone(tiny_path):
    """Threads asking about one-off states at once: every ask is answered once, as alone."""
    async with fl.Engine.load(tiny_path, device="cpu") as plain, fl.Engine.load(tiny_path, device="cpu") as engine:
        results: dict[int, dict] = {}

        def worker(index: int) -> None:
            for step in range(4):
                results[4 * index + step] = asyncio.run(engine.ask(f"thread {index} step {step}", GOOD))

        threads = [threading.Thread(target=worker, args=(i,), name=f"asker-{i}") for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert sorted(results) == list(range(24)) and engine.stats()["asks"] == 24
        for key in (0, 9, 23):
            expected = await plain.ask(f"thread {key // 4} step {key % 4}", GOOD)
            assert np.abs(answer_probabilities(results[key]["n"]) - answer_probabilities(expected["n"])).max() < 1e-6


@pytest.mark.asyncio
async def test_chunks_of_a_new_state_are_cached_once_its_round_is_launched(tiny_path):
    """A long state of new text has its chunks cached by the round thread once its round is launched (while the
    device computes); asking about it again under another first line then reads the chunks, and every answer
    equals the answer of an engine whose word encoder is off."""
    words = [f"w{i}{chr(97 + i % 26)}" for i in range(600)]
    body = " ".join(words) + ". The end"
    async with fl.Engine.load(tiny_path, device="cpu") as plain, fl.Engine.load(tiny_path, device="cpu") as engine:
        plain.tokens.words.enabled = False
        encoder = engine.tokens.words
        filled = []
        fill = encoder.fill_chunks
        encoder.fill_chunks = lambda: filled.append(threading.current_thread().name) or fill()
        for first in ("One", "Two"):
            state = f"{first}: {body}"
            got, expected = await engine.ask(state, GOOD), await plain.ask(state, GOOD)
            for name in GOOD:
                assert np.array_equal(answer_probabilities(got[name]), answer_probabilities(expected[name]))
            assert set(words[:-1]) <= encoder.chunks.keys()
        assert filled == ["flide-rounds"] * 2


def test_start_up_is_shown_when_asked_and_timed_in_stats(tiny_path, capsys):
    """progress=True prints each start-up stage with its time on stderr; progress=False prints nothing; both
    report load and first-answer times and the memory split in stats()."""
    with fl.Engine.load(tiny_path, device="cpu", progress=True) as engine:
        shown = capsys.readouterr().err
        assert "flide_sdk: weights:" in shown and "flide_sdk: serving:" in shown
        assert engine.stats()["first_answer_ready_seconds"] == 0  # no answer yet
        engine.ask_sync("a state", GOOD)
        stats = engine.stats()
        assert 0 < stats["load_seconds"] <= stats["first_answer_ready_seconds"]
        assert stats["weights_bytes"] > 0 and stats["pool_used_bytes"] <= stats["pool_reserved_bytes"]
    with fl.Engine.load(tiny_path, device="cpu", progress=False) as engine:
        engine.ask_sync("a state", GOOD)
    assert capsys.readouterr().err == ""
    with fl.Engine.load(tiny_path, device="cpu:0", progress=True):  # a numbered device: engines loaded together
        shown = capsys.readouterr().err
        assert "flide_sdk cpu:0: weights:" in shown and "flide_sdk cpu:0: serving:" in shown


def test_info_counts_the_layers_that_attend(single):
    """The tiny Qwen3.5 model: 2 of its 8 layers attend (the rest are Gated DeltaNet), none in a sliding window
    (Gemma 4's counts: tests/test_gemma4.py). Mutation caught: Gated DeltaNet layers counted as attending."""
    info = single.info()
    assert (info["layers"], info["attention_layers"], info["sliding_attention_layers"]) == (8, 2, 0)
