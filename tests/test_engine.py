"""Engine behaviour: bad input fails alone, concurrent asks share rounds, cancellation, closing."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import flide_sdk as fl

from .conftest import answer_probabilities

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
    assert engine.stats()["checkpoints"] == 1 and engine.pool.kv.numel() > 0
    await engine.aclose()
    assert engine.closed
    stats = engine.stats()  # the pool's device memory is released
    assert stats["pool_bytes"] == stats["pool_capacity_bytes"] == stats["checkpoints"] == 0
    assert engine.pool.kv.numel() == engine.pool.states.numel() == 0
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
        with engine.admission_paused():
            tasks = [asyncio.ensure_future(engine.ask(state, GOOD)) for state in states]
            await asyncio.sleep(0.05)  # all four queued before admission resumes
        answers = await asyncio.gather(*tasks)
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


def test_stats_account_for_the_time_an_ask_waits_for_its_round(tiny_path):
    """queue_seconds sums, per ask, the time from queueing to its round's start: with a round deadline, a
    lone ask waits at least that long; admission is part of that wait."""
    with fl.Engine.load(tiny_path, device="cpu", round_deadline_ms=200) as engine:
        engine.ask_sync("state", GOOD)
        stats = engine.stats()
    assert stats["queue_seconds"] >= 0.2
    assert 0 < stats["select_seconds"] < stats["queue_seconds"]


@pytest.mark.asyncio
async def test_internal_round_loop_error_fails_asks_instead_of_hanging(tiny_path):
    """A bug on the round thread (here: admission raising) closes the engine and fails queued asks."""
    engine = fl.Engine.load(tiny_path)

    def broken(pending):
        raise RuntimeError("admission bug")

    engine._loop._select = broken
    with engine.admission_paused():  # queued, so admitted by the round loop (a lone ask is launched alone)
        task = asyncio.ensure_future(engine.ask("state", {"q": fl.Noul("ok?")}))
        await asyncio.sleep(0.05)
    with pytest.raises(fl.EngineClosedError, match="admission bug"):
        await asyncio.wait_for(task, timeout=30)
    assert engine.closed
    with pytest.raises(fl.EngineClosedError):
        await engine.ask("state", {"q": fl.Noul("ok?")})


async def ask_prepared(engine, state: str, questions=GOOD):
    """An ask whose trunk is tokenized by the asking thread (`Engine.prepare`, as sessions ask): the kind an
    idle engine lets the asking thread launch."""
    return await engine.submit(engine.prepare(engine.renderer.trunk(state), questions))


def _record_calls(owner, method: str, entry) -> list:
    """Wraps `owner.<method>` (one argument) so that each call first appends `entry(argument)` to the list returned."""
    calls: list = []
    original = getattr(owner, method)

    def recording(argument):
        calls.append(entry(argument))
        return original(argument)

    setattr(owner, method, recording)
    return calls


def _thread_name(_argument) -> str:
    return threading.current_thread().name


def _launch_threads(engine) -> list[str]:
    """Turns on launching in the caller for every ask (CPU engines launch eagerly, so it is off by default)
    and records the thread each round is launched on."""
    engine._loop.launch_in_caller = lambda ask: True
    return _record_calls(engine._loop, "_launch", _thread_name)


@pytest.mark.asyncio
async def test_an_idle_engine_launches_an_ask_on_the_asking_thread(tiny_path):
    """A lone ask is launched by the thread that asks (no hand-off to the round thread) and answers as the
    round thread's launch does; asks queued while admission is held still go to the round thread."""
    async with fl.Engine.load(tiny_path, device="cpu") as plain, fl.Engine.load(tiny_path, device="cpu") as engine:
        names = _launch_threads(engine)
        states = [f"lone ask {i} about a late order" for i in range(3)]
        for state in states:
            got, expected = await ask_prepared(engine, state), await plain.ask(state, GOOD)
            for name in GOOD:
                assert np.abs(answer_probabilities(got[name]) - answer_probabilities(expected[name])).max() < 1e-6
        assert names == [threading.current_thread().name] * 3
        with engine.admission_paused():
            tasks = [asyncio.ensure_future(ask_prepared(engine, f"held {i}")) for i in range(2)]
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        assert names[3:] == ["flide-rounds"] and engine.stats()["rounds"] == 4


@pytest.mark.asyncio
async def test_asks_launched_by_their_threads_race_safely(tiny_path):
    """Many threads asking at once, each launching when it finds the engine idle and queueing otherwise:
    every ask is answered once, as alone, and askers launched rounds themselves."""
    async with fl.Engine.load(tiny_path, device="cpu") as plain, fl.Engine.load(tiny_path, device="cpu") as engine:
        names = _launch_threads(engine)
        results: dict[int, dict] = {}

        def worker(index: int) -> None:
            for step in range(4):
                results[4 * index + step] = asyncio.run(ask_prepared(engine, f"thread {index} step {step}"))

        threads = [threading.Thread(target=worker, args=(i,), name=f"asker-{i}") for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert sorted(results) == list(range(24))
        assert engine.stats()["asks"] == 24 and sum(1 for n in names if n.startswith("asker")) >= 1
        for key in (0, 7, 23):
            expected = await plain.ask(f"thread {key // 4} step {key % 4}", GOOD)
            assert np.abs(answer_probabilities(results[key]["n"]) - answer_probabilities(expected["n"])).max() < 1e-6


def _tokenizing_threads(engine) -> list[tuple[str, str]]:
    """Records (thread, state) of each one-off state tokenized."""
    return _record_calls(engine.renderer, "trunk", lambda state: (threading.current_thread().name, state))


def _rendering_threads(engine) -> list[str]:
    """Records the thread of each call rendering questions."""
    return _record_calls(engine.renderer, "render_questions", _thread_name)


@pytest.mark.asyncio
async def test_an_idle_engine_tokenizes_a_one_off_state_on_its_round_thread(tiny_path):
    """An ask about a one-off state that finds the engine idle has its questions rendered and its state tokenized,
    and is admitted and launched, by the round thread, and answers exactly as an ask tokenized by its caller;
    asks queued behind others (here: while admission is held) are rendered and tokenized by their callers."""
    async with fl.Engine.load(tiny_path, device="cpu") as plain, fl.Engine.load(tiny_path, device="cpu") as engine:
        tokenized = _tokenizing_threads(engine)
        rendered = _rendering_threads(engine)
        launched = _launch_threads(engine)
        for i in range(3):
            state = f"lone ask {i} about a late order"
            got, expected = await engine.ask(state, GOOD), await ask_prepared(plain, state)
            for name in GOOD:
                assert np.array_equal(answer_probabilities(got[name]), answer_probabilities(expected[name]))
        assert [name for name, _ in tokenized] == ["flide-rounds"] * 3 and launched == ["flide-rounds"] * 3
        with engine.admission_paused():
            tasks = [asyncio.ensure_future(engine.ask(f"held {i}", GOOD)) for i in range(2)]
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        assert [name for name, _ in tokenized[3:]] == [threading.current_thread().name] * 2
        assert rendered == ["flide-rounds"] * 3 + [threading.current_thread().name] * 2
        assert engine.stats()["asks"] == 5


@pytest.mark.asyncio
async def test_questions_refused_at_rendering_fail_their_ask_only_on_either_thread(tiny_path):
    """A question with more options than single-token labels is refused when rendered: by the round thread for an
    ask that finds the engine idle (its future fails), by the caller for one queued behind others (it raises
    there); neither ask is counted, and the asks around them are answered."""
    too_many = {"q": fl.Choice("Which?", {f"o{i}": None for i in range(27)})}
    async with fl.Engine.load(tiny_path, device="cpu") as engine:
        rendered = _rendering_threads(engine)
        with pytest.raises(fl.InvalidQuestionError, match="27 options"):
            await asyncio.wait_for(engine.ask("idle engine", too_many), timeout=30)
        with engine.admission_paused():
            good = asyncio.ensure_future(engine.ask("held", GOOD))
            await asyncio.sleep(0.05)
            with pytest.raises(fl.InvalidQuestionError, match="27 options"):
                await asyncio.wait_for(engine.ask("busy engine", too_many), timeout=30)
        assert set(await asyncio.wait_for(good, timeout=30)) == {"n", "c"}
        assert rendered[0] == "flide-rounds" and rendered[2] == threading.current_thread().name
        assert engine.stats()["asks"] == 1 and not engine.closed


@pytest.mark.asyncio
async def test_a_state_too_long_tokenized_by_the_round_thread_fails_its_ask_only(tiny_path):
    async with fl.Engine.load(tiny_path, device="cpu", max_prompt_tokens=200) as engine:
        tokenized = _tokenizing_threads(engine)
        with pytest.raises(fl.StateTooLongError, match="max_prompt_tokens=200"):
            await asyncio.wait_for(engine.ask("word " * 400, GOOD), timeout=30)
        assert tokenized == [("flide-rounds", "word " * 400)] and engine.stats()["asks"] == 0 and not engine.closed
        assert set(await asyncio.wait_for(engine.ask("short", GOOD), timeout=30)) == {"n", "c"}


@pytest.mark.asyncio
async def test_an_ask_cancelled_before_the_round_thread_tokenizes_it_is_dropped(tiny_path):
    async with fl.Engine.load(tiny_path, device="cpu") as engine:
        tokenized = _tokenizing_threads(engine)
        gate = threading.Event()
        launch = engine._loop._launch_here

        def held_launch(ask):
            gate.wait(30)
            launch(ask)

        engine._loop._launch_here = held_launch
        task = asyncio.ensure_future(engine.ask("never tokenized", GOOD))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.05)
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        engine._loop._launch_here = launch
        assert set(await asyncio.wait_for(engine.ask("after", GOOD), timeout=30)) == {"n", "c"}
        assert [state for _, state in tokenized] == ["after"] and engine.stats()["asks"] == 1


@pytest.mark.asyncio
async def test_one_off_asks_from_many_threads_are_each_answered_once_as_alone(tiny_path):
    """Threads asking about one-off states at once: some asks find the engine idle and are tokenized by the
    round thread, the rest by their own threads; every ask is answered once, as alone."""
    async with fl.Engine.load(tiny_path, device="cpu") as plain, fl.Engine.load(tiny_path, device="cpu") as engine:
        tokenized = _tokenizing_threads(engine)
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
        assert sorted(state for _, state in tokenized) == sorted(f"thread {i} step {j}" for i in range(6) for j in range(4))
        assert any(name == "flide-rounds" for name, _ in tokenized)
        for key in (0, 9, 23):
            expected = await plain.ask(f"thread {key // 4} step {key % 4}", GOOD)
            assert np.abs(answer_probabilities(results[key]["n"]) - answer_probabilities(expected["n"])).max() < 1e-6


def _closing_first(engine, call):
    """(the closing thread, `call` wrapped so that it first starts closing `engine` on that thread and waits
    until the engine is closed)."""
    closer = threading.Thread(target=engine.close)

    def close_first(*args):
        closer.start()
        while not engine.closed:
            threading.Event().wait(0.001)
        return call(*args)

    return closer, close_first


@pytest.mark.asyncio
async def test_closing_while_the_round_thread_tokenizes_an_ask_still_answers_it(tiny_path):
    """An ask the round thread has taken to tokenize is a launched ask: closing the engine meanwhile lets it
    finish and refuses later asks."""
    engine = fl.Engine.load(tiny_path, device="cpu")
    closer, engine.renderer.trunk = _closing_first(engine, engine.renderer.trunk)
    answers = await asyncio.wait_for(engine.ask("closing time", GOOD), timeout=60)
    closer.join(60)
    assert set(answers) == {"n", "c"} and not engine._loop.running
    with pytest.raises(fl.EngineClosedError):
        await engine.ask("after", GOOD)


@pytest.mark.asyncio
async def test_a_failed_launch_on_the_asking_thread_fails_that_ask_only(tiny_path):
    async with fl.Engine.load(tiny_path, device="cpu") as engine:
        _launch_threads(engine)
        select = engine._loop._select

        def broken(pending):
            raise RuntimeError("admission bug")

        engine._loop._select = broken
        with pytest.raises(RuntimeError, match="admission bug"):
            await asyncio.wait_for(ask_prepared(engine, "state"), timeout=30)
        engine._loop._select = select
        answers = await asyncio.wait_for(ask_prepared(engine, "state"), timeout=30)
        assert not engine.closed and set(answers) == {"n", "c"}


@pytest.mark.asyncio
async def test_closing_while_an_ask_is_launched_on_its_thread_still_answers_it(tiny_path):
    """A round launched by the asking thread is a launched round: closing the engine meanwhile lets it finish
    (the round thread waits for the launch before it exits) and refuses later asks."""
    engine = fl.Engine.load(tiny_path, device="cpu")
    names = _launch_threads(engine)
    closer, engine._loop._launch = _closing_first(engine, engine._loop._launch)
    answers = await asyncio.wait_for(ask_prepared(engine, "closing time"), timeout=60)
    closer.join(60)
    assert set(answers) == {"n", "c"} and names == [threading.current_thread().name] and not engine._loop.running
    with pytest.raises(fl.EngineClosedError):
        await engine.ask("after", GOOD)


@pytest.mark.asyncio
async def test_chunks_of_a_new_state_are_cached_once_its_round_is_launched(tiny_path):
    """A long state of new text is tokenized by one regex split, its chunks cached by the launching thread once its
    round is launched (while the device computes); asking about it again under another first line then reads
    the chunks, and every answer equals the answer of an engine whose word encoder is off."""
    words = [f"w{i}{chr(97 + i % 26)}" for i in range(600)]
    body = " ".join(words) + ". The end"
    async with fl.Engine.load(tiny_path, device="cpu") as plain, fl.Engine.load(tiny_path, device="cpu") as engine:
        plain.renderer.words.enabled = False
        encoder = engine.renderer.words
        filled = []
        fill = encoder.fill_chunks
        encoder.fill_chunks = lambda: filled.append((threading.current_thread().name, len(encoder._unfilled))) or fill()
        for first in ("One", "Two"):
            state = f"{first}: {body}"
            got, expected = await engine.ask(state, GOOD), await plain.ask(state, GOOD)
            for name in GOOD:
                assert np.array_equal(answer_probabilities(got[name]), answer_probabilities(expected[name]))
        assert filled[0] == ("flide-rounds", 1) and all(pending == 0 for _, pending in filled[1:])
        assert set(words[:-1]) <= encoder.chunks.keys() and not encoder._unfilled
