"""Sessions: resumed answers stay exact, each step computes only what is new, the pool evicts and shares,
asks continuing another's trunk fork from it in the same round (or wait for its checkpoint), and errors stay
local."""

from __future__ import annotations

import asyncio
import random
import sys
import threading

import numpy as np
import pytest
import torch

import flide_sdk as fl
from flide_sdk.device.pool import CheckpointPool
from flide_sdk.serve.scheduler import DEFER_MIN_TOKENS, RoundLimits, schedule

from .conftest import TOLERANCE, answer_probabilities, gated_engine, reference_probabilities

QUESTIONS = {
    "stuck": fl.Noul("Is the agent stuck in a loop?"),
    "next": fl.Choice("What comes next?", {"read": "inspect code", "edit": None, "test": "run tests", "submit": None}),
    "done": fl.Score("How close to done?", ["far", "halfway", "close", "done"]),
}
WORDS = ["the", "agent", "opened", "the", "file", "read", "line", "12", "found", "an", "error", "edited", "the", "function", "and", "ran", "the", "tests", "again"]


def growth(rng: random.Random) -> str:
    """20 to 200 tokens of text; often ends mid-word so the next append changes the last merge."""
    text = " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 120)))
    return text + rng.choice(["", "", "ing", " test", ".", "\n"])


def probabilities(answers: dict) -> np.ndarray:
    return np.concatenate([answer_probabilities(answers[name]) for name in sorted(answers)])


def check(answers, fresh_engine, hf_model, state, against_transformers: bool = True) -> float:
    """The answers equal a fresh engine's (no checkpoints) and, unless told otherwise, transformers' on the
    standalone prompts (the costly part: a long session checks it at some steps only)."""
    fresh = fresh_engine.ask_sync(state, QUESTIONS)
    worst = float(np.abs(probabilities(answers) - probabilities(fresh)).max())
    rendered = fresh_engine.render(state, QUESTIONS)
    for name in QUESTIONS if against_transformers else ():
        expected = reference_probabilities(hf_model, rendered, name)
        worst = max(worst, float(np.abs(answer_probabilities(answers[name]) - expected).max()))
    assert worst <= TOLERANCE, worst
    return worst


@pytest.fixture
def fresh(tiny_path):
    with fl.Engine.load(tiny_path, device="cpu", pool_bytes=0) as engine:  # no checkpoints: computes everything
        yield engine


@pytest.fixture
def eager_round_thread():
    """The GIL handed over every microsecond: asks queued one by one would let the round thread take the first
    alone, so a test of asks admitted together fails if they are not."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def test_text_session_and_fork_stay_exact_and_compute_only_new_tokens(engine, fresh, hf_tiny):
    rng = random.Random(0)
    session = engine.session()
    state = ""
    fork = fork_state = None
    previous = None  # (trunk tokens, mutable tail) of the previous step
    for step in range(30):
        piece = growth(rng)
        session.append(piece)
        state += piece
        before = engine.stats()
        answers = session.ask_sync(QUESTIONS)
        after = engine.stats()
        check(answers, fresh, hf_tiny, state, against_transformers=step % 6 == 0 or step == 29)
        rendered = engine.render(state, QUESTIONS)
        trunk_tokens = len(rendered.state_ids)
        branch_tokens = sum(len(q.ids) for q in rendered.questions.values())
        computed = after["tokens_computed"] - before["tokens_computed"]
        tail = after["mutable_tail_tokens"]
        assert tail <= 64
        if previous is not None:
            new_tokens = trunk_tokens - previous[0]
            assert computed <= new_tokens + previous[1] + branch_tokens, (step, computed)
            assert after["tokens_resumed"] - before["tokens_resumed"] >= previous[0] - previous[1]
        previous = (trunk_tokens, tail)
        if step == 10:
            fork, fork_state = session.fork(), state
        if fork is not None and step >= 10:
            piece = growth(rng)
            fork.append(piece)
            fork_state += piece
            check(fork.ask_sync(QUESTIONS), fresh, hf_tiny, fork_state, against_transformers=step % 6 == 3)
    assert engine.stats()["checkpoint_hits"] >= 48


def test_message_session_stays_exact(engine, fresh, hf_tiny):
    rng = random.Random(1)
    session = engine.session()
    messages: list[dict] = []
    for step in range(12):
        message = {"role": rng.choice(["assistant", "tool", "user"]), "content": growth(rng).strip()}
        session.append(message)
        messages.append(message)
        check(session.ask_sync(QUESTIONS), fresh, hf_tiny, messages)
    stats = engine.stats()
    assert stats["checkpoint_hits"] == 11 and stats["max_mutable_tail_tokens"] <= 64


def test_any_request_with_the_same_start_resumes(engine, fresh, hf_tiny):
    document = " ".join(WORDS * 20)
    engine.ask_sync(document, QUESTIONS)
    before = engine.stats()
    answers = engine.ask_sync(document + " and one more line", QUESTIONS)
    after = engine.stats()
    assert after["checkpoint_hits"] - before["checkpoint_hits"] == 1
    assert after["tokens_resumed"] - before["tokens_resumed"] > 200
    check(answers, fresh, hf_tiny, document + " and one more line")


def test_lru_eviction_and_pool_bytes(tiny_path, fresh, hf_tiny):
    with fl.Engine.load(tiny_path, device="cpu", pool_checkpoints=3) as engine:
        start_bytes = engine.stats()["pool_bytes"]
        sessions = [engine.session() for _ in range(4)]
        states = [f"session {i}: " + " ".join(WORDS * 3) for i in range(4)]
        for session, state in zip(sessions, states):
            session.append(state)
            session.ask_sync(QUESTIONS)
        stats = engine.stats()
        assert stats["checkpoints"] == 3 and stats["evictions"] == 1
        # session 0 was least recently used: its checkpoint is gone, it recomputes, still exactly
        sessions[0].append(" more")
        before = engine.stats()
        answers = sessions[0].ask_sync(QUESTIONS)
        after = engine.stats()
        assert after["checkpoint_misses"] - before["checkpoint_misses"] == 1
        check(answers, fresh, hf_tiny, states[0] + " more")
        # session 3 was used recently: it still resumes
        sessions[3].append(" more")
        before = engine.stats()
        sessions[3].ask_sync(QUESTIONS)
        assert engine.stats()["checkpoint_hits"] - before["checkpoint_hits"] == 1
        for session in sessions:
            session.close()
        engine.clear_pool()
        stats = engine.stats()
        assert stats["pool_bytes"] == start_bytes and stats["checkpoints"] == 0


def test_fork_shares_pages_without_copies(engine):
    parent = engine.session()
    parent.append(" ".join(WORDS * 10))
    parent.ask_sync(QUESTIONS)
    (parent_checkpoint,) = engine.pool.checkpoints()
    child = parent.fork()
    child.append(" the child goes on alone")
    copies = engine.stats()["page_copies"]
    child.ask_sync(QUESTIONS)
    assert engine.stats()["page_copies"] == copies
    child_checkpoint = engine.pool.checkpoints()[-1]
    shared = parent_checkpoint.length // 64
    assert child_checkpoint.pages[:shared] == parent_checkpoint.pages[:shared]
    parent.append(" the parent goes elsewhere")
    parent.ask_sync(QUESTIONS)  # diverging from the same partial page copies at most that page
    assert engine.stats()["page_copies"] - copies <= 1


@pytest.mark.asyncio
async def test_eight_sessions_gathered_take_one_round_and_answer_as_alone(tiny_path, fresh, hf_tiny, eager_round_thread):
    """Asks created in one event-loop iteration are admitted together, with no round deadline: each of four
    agent steps of eight sessions is one round."""
    async with fl.Engine.load(tiny_path, device="cpu") as engine:
        sessions = [engine.session() for _ in range(8)]
        texts = [""] * len(sessions)
        for step in range(4):
            for i, session in enumerate(sessions):
                session.append(f" step {step} of agent {i} " + " ".join(WORDS[i + step:]))
                texts[i] += f" step {step} of agent {i} " + " ".join(WORDS[i + step:])
            before = engine.stats()["rounds"]
            answers = await asyncio.gather(*(s.ask(QUESTIONS) for s in sessions))
            assert engine.stats()["rounds"] - before == 1, f"step {step}"
        assert engine.stats()["asks"] == 32
        for text, got in zip(texts, answers):
            check(got, fresh, hf_tiny, text, against_transformers=text is texts[-1])


@pytest.mark.asyncio
async def test_many_sessions_share_rounds(tiny_path):
    async with fl.Engine.load(tiny_path, device="cpu") as engine:
        sessions = [engine.session() for _ in range(64)]
        for i, session in enumerate(sessions):
            session.append(f"agent {i} " + " ".join(WORDS[i % 5 :]))
        answers = await asyncio.gather(*(s.ask(QUESTIONS) for s in sessions))
        stats = engine.stats()
        assert len(answers) == 64 and stats["asks"] == 64
        fewest = -(-stats["tokens_computed"] // engine.max_round_tokens)  # the stream exceeds one round's tokens
        assert fewest == 2 and stats["rounds"] == fewest


@pytest.mark.asyncio
async def test_a_session_and_two_nested_forks_asked_together_take_one_round(tiny_path, fresh, hf_tiny,
                                                                            eager_round_thread):
    """A parent session, a fork of it and a fork of the fork, each appended to and all asked at once, are
    computed in one round (each fork continues its parent's state at the parent's save point) and answer as
    fresh engines and transformers do; each then resumes from the checkpoint the round saved for it."""
    async with fl.Engine.load(tiny_path, device="cpu") as engine:
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
        answers = dict(zip(sessions, await asyncio.gather(*(s.ask(QUESTIONS) for s in sessions.values()))))
        stats = engine.stats()
        assert stats["rounds"] == 1 and stats["deferred"] == 0
        assert stats["checkpoints_saved"] == 3, "each of the three saves its checkpoint in the round"
        alone = sum(len(engine.render(text, QUESTIONS).state_ids) for text in texts.values())
        branches = 3 * sum(len(q.ids) for q in engine.render("x", QUESTIONS).questions.values())
        shared = [len(session.trunk().stable) for session in (parent, child)]  # what each fork did not compute
        assert stats["tokens_computed"] == alone + branches - sum(shared)
        for name in sessions:
            check(answers[name], fresh, hf_tiny, texts[name])
        for name, session in sessions.items():  # the next step resumes from the round's checkpoints
            session.append(f" {name} again")
            texts[name] += f" {name} again"
            before = engine.stats()
            answers = await session.ask(QUESTIONS)
            assert engine.stats()["checkpoint_hits"] - before["checkpoint_hits"] == 1
            check(answers, fresh, hf_tiny, texts[name], against_transformers=name == "grandchild")


@pytest.mark.asyncio
async def test_a_second_fork_of_one_save_point_waits_for_its_checkpoint(tiny_path, fresh, hf_tiny):
    """Two forks continuing one session's save point in its round: the first forks in the round, the second
    waits for the checkpoint (a round's save point extends in place once); both answer exactly."""
    async with fl.Engine.load(tiny_path, device="cpu") as engine:
        session = engine.session()
        base = " ".join(WORDS * 8)
        session.append(base)
        forks = [session.fork() for _ in range(2)]
        for i, fork in enumerate(forks):
            fork.append(f" fork {i} " + " ".join(WORDS * 2))
        others = [engine.session() for _ in range(2)]
        for i, other in enumerate(others):
            other.append(f"independent {i} " + " ".join(WORDS))
        finished: list[str] = []

        def track(name: str, task: asyncio.Future) -> asyncio.Future:
            task.add_done_callback(lambda _: finished.append(name))
            return task

        first = track("session", asyncio.ensure_future(session.ask(QUESTIONS)))
        tasks = [track(f"fork{i}", asyncio.ensure_future(fork.ask(QUESTIONS))) for i, fork in enumerate(forks)]
        independent = [track(f"other{i}", asyncio.ensure_future(o.ask(QUESTIONS))) for i, o in enumerate(others)]
        results = await asyncio.gather(first, *tasks, *independent)
        stats = engine.stats()
        assert stats["rounds"] == 2 and stats["deferred"] == 1
        assert finished[-1] == "fork1" and set(finished[:-1]) == {"session", "fork0", "other0", "other1"}
        assert stats["checkpoint_hits"] == 1  # the second fork resumed from the session's checkpoint
        for i in range(2):
            check(results[1 + i], fresh, hf_tiny, base + f" fork {i} " + " ".join(WORDS * 2))


@pytest.mark.asyncio
async def test_identical_trunks_in_a_round_are_computed_once(tiny_path):
    async with fl.Engine.load(tiny_path, device="cpu") as engine:
        state = " ".join(WORDS * 4)
        await asyncio.gather(*(engine.ask(state, {name: q}) for name, q in QUESTIONS.items()))
        stats = engine.stats()
        rendered = engine.render(state, QUESTIONS)
        assert stats["rounds"] == 1 and stats["merged_trunks"] == 2
        assert stats["tokens_computed"] == len(rendered.state_ids) + sum(len(q.ids) for q in rendered.questions.values())


@pytest.mark.asyncio
async def test_cancel_bad_ask_and_backpressure_with_sessions(tiny_path):
    """While a round holds the device: a queue of 2 makes a third ask wait for room, a cancelled ask is
    withdrawn, a bad question raises in its caller; the rest are answered once the round ends."""
    with gated_engine(tiny_path, max_pending=2) as (engine, gate):
        a, b, c = engine.session(), engine.session(), engine.session()
        for s in (a, b, c):
            s.append("a short history of the agent")
        with gate.closed():
            busy = asyncio.ensure_future(engine.ask("a round that holds the device", QUESTIONS))
            await asyncio.to_thread(gate.wait_held)
            keep = asyncio.ensure_future(a.ask(QUESTIONS))
            drop = asyncio.ensure_future(b.ask(QUESTIONS))
            waiting = asyncio.ensure_future(c.ask(QUESTIONS))  # the queue holds 2: this one waits for room
            await asyncio.sleep(0.05)
            assert not waiting.done()
            drop.cancel()
            with pytest.raises(fl.InvalidQuestionError):
                await a.ask({"bad": fl.Choice("?", {f"o{i}": None for i in range(30)})})
        results = await asyncio.gather(keep, waiting, busy)
        with pytest.raises(asyncio.CancelledError):
            await drop
        assert all(set(r) == set(QUESTIONS) for r in results)
        assert engine.stats()["asks"] == 3, "the cancelled ask was never computed"
        alone = await a.ask(QUESTIONS)
        assert np.abs(probabilities(alone) - probabilities(results[0])).max() < 1e-5


def test_sessions_on_several_threads_resolve_on_their_own_loops(engine):
    outcome: dict[int, tuple[int, int, dict]] = {}

    def worker(index: int) -> None:
        async def run() -> tuple[int, int, dict]:
            session = engine.session()
            session.append(f"thread {index} history")
            answers = await session.ask(QUESTIONS)
            return threading.get_ident(), id(asyncio.get_running_loop()), answers

        outcome[index] = asyncio.run(run())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(outcome) == list(range(6))
    assert len({ident for ident, _, _ in outcome.values()}) == 6
    assert all(set(answers) == set(QUESTIONS) for _, _, answers in outcome.values())


@pytest.mark.asyncio
async def test_aclose_fails_queued_session_asks_and_answers_the_round_in_flight(tiny_path):
    with gated_engine(tiny_path) as (engine, gate):
        session = engine.session()
        session.append("history")
        with gate.closed():
            running = asyncio.ensure_future(engine.ask("a round that holds the device", QUESTIONS))
            await asyncio.to_thread(gate.wait_held)
            pending = [asyncio.ensure_future(session.ask(QUESTIONS)) for _ in range(3)]
            await asyncio.sleep(0.05)
            closing = asyncio.ensure_future(engine.aclose())
            for task in pending:  # failed at once, while the round still holds the device
                with pytest.raises(fl.errors.EngineClosed):
                    await asyncio.wait_for(task, timeout=30)
        await asyncio.wait_for(closing, timeout=30)
        assert set(await running) == set(QUESTIONS)
        with pytest.raises(fl.errors.EngineClosed):
            await session.ask(QUESTIONS)


def test_closed_session_refuses(engine):
    session = engine.session()
    session.close()
    with pytest.raises(fl.InvalidStateError):
        session.append("x")
    with pytest.raises(fl.InvalidStateError):
        session.ask_sync(QUESTIONS)


def test_a_session_holds_one_checkpoint_and_forks_keep_theirs(engine, fresh, hf_tiny):
    """Each step supersedes the session's previous checkpoint: after many steps the session holds one slot
    and the pages of its history. A checkpoint a fork shares survives the parent's next steps."""
    rng = random.Random(5)
    session = engine.session()
    state = ""
    for _ in range(12):
        piece = growth(rng)
        session.append(piece)
        state += piece
        session.ask_sync(QUESTIONS)
    stats = engine.stats()
    assert stats["checkpoints"] == 1 and stats["superseded"] == stats["checkpoints_saved"] - 1
    (kept,) = engine.pool.checkpoints()
    pages = -(-kept.length // 64)
    assert stats["pool_bytes"] == engine.pool.slot_bytes + pages * engine.pool.page_bytes
    child = session.fork()
    for _ in range(3):  # the parent moves on before the child asks anything
        session.append(growth(rng))
        session.ask_sync(QUESTIONS)
    child.append(" the child asks late")
    before = engine.stats()
    answers = child.ask_sync(QUESTIONS)
    after = engine.stats()
    assert after["checkpoint_hits"] - before["checkpoint_hits"] == 1
    assert after["tokens_resumed"] - before["tokens_resumed"] >= kept.length
    check(answers, fresh, hf_tiny, state + " the child asks late")


def _scan_schedule(pending: list, lookup, limits: RoundLimits) -> tuple[list, list, int, int, int]:
    """Admission by the definitions, comparing each queued ask with every trunk selected so far: the selected
    asks, the asks left queued, how many were deferred, merged with a selected trunk and forked from one (an ask
    continuing a selected trunk past its save point forks from it in the round, one fork per save point and none
    in the batch-invariant mode; a second waits for the checkpoint)."""

    def same(a, b) -> bool:
        x, y = a.trunk, b.trunk
        return (len(x) == len(y) and x.boundary == y.boundary and np.array_equal(x.tail, y.tail)
                and x.prefix_equals(y.buffer, y.boundary))

    def resumed(ask) -> int:
        return 0 if resumes[id(ask)] is None else resumes[id(ask)].length

    def save_point(ask) -> int:
        return ask.trunk.boundary // limits.save_align * limits.save_align

    def waits(ask, lead) -> bool:
        at = save_point(lead)
        if not resumed(ask) + DEFER_MIN_TOKENS <= at < len(ask.trunk) or at <= starts[id(lead)]:
            return False
        return ask.trunk.prefix_equals(lead.trunk.buffer, at) and not same(ask, lead)

    selected, kept, resumes, leads, starts, forked = [], [], {}, [], {}, set()
    tokens = requests = questions = pages = deferred = merges = forks = 0
    for ask in pending:
        resumes[id(ask)] = lookup(ask.trunk)
        merged = any(same(ask, lead) for lead in leads)
        producer = None if merged else max((lead for lead in leads if waits(ask, lead)), key=save_point, default=None)
        if producer is not None and (id(producer) in forked or limits.batch_invariant):
            kept.append(ask)
            deferred += 1
            continue
        start = resumed(ask) if producer is None else save_point(producer)
        cost = ask.branch_tokens + (0 if merged else len(ask.trunk) - start)
        history = 0 if merged or producer is not None else -(-resumed(ask) // 64)
        rows = (not merged) + (producer is not None) + ask.branches.inner
        pieces = len(ask.branches.lengths) + 2 * (producer is not None)
        full = (tokens + cost > limits.tokens or requests + rows > limits.requests
                or questions + pieces > limits.questions
                or limits.pages is not None and pages + history > limits.pages)
        if selected and full:
            kept.append(ask)
            continue
        selected.append(ask)
        if not merged:
            leads.append(ask)
            starts[id(ask)] = start
        if producer is not None:
            forked.add(id(producer))
        tokens, questions, requests = tokens + cost, questions + pieces, requests + rows
        pages += history
        merges += merged
        forks += producer is not None
    return selected, kept, deferred, merges, forks


def test_indexed_admission_matches_the_scan_over_every_selected_ask(engine):
    """`schedule` looks selected asks up by trunk key and first block instead of comparing with each: it
    admits, defers, merges and leaves queued exactly the asks the plain scan does."""
    rng = random.Random(3)
    base = " ".join(WORDS * 6)
    resumed = engine.session()
    resumed.append(base)
    resumed.ask_sync(QUESTIONS)  # a checkpoint in the pool
    trunks = []
    for step in range(4):
        fork = resumed.fork()
        fork.append(growth(rng))
        trunks += [fork.trunk(), fork.trunk()]
        resumed.append(growth(rng))
        trunks.append(resumed.trunk())
    for index in range(6):
        trunks += [engine.prompt.trunk(base), engine.prompt.trunk(base + growth(rng)),
                   engine.prompt.trunk(f"{index}{growth(rng)}"), engine.prompt.trunk(f"short {index}")]
    exercised = np.zeros(4, dtype=int)  # deferred, merged, left queued for room, forked
    assert len(resumed.trunk().stable) >= 64  # its asks resume with history pages
    paged_out = 0
    for limits in (RoundLimits(100_000, 64, 100_000), RoundLimits(400, 64, 100_000), RoundLimits(100_000, 3, 100_000),
                   RoundLimits(100_000, 64, 100_000, 3), RoundLimits(100_000, 64, 100_000, save_align=64),
                   RoundLimits(100_000, 64, 100_000, save_align=64, batch_invariant=True)):
        for _ in range(5):
            rng.shuffle(trunks)
            asks = [engine.prepare(trunk, {"q": QUESTIONS["stuck"]} if i % 3 else QUESTIONS)
                    for i, trunk in enumerate(trunks)]
            batch = schedule(asks, engine.pool.lookup, limits)
            expected, expected_kept, expected_deferred, merges, forks = _scan_schedule(asks, engine.pool.lookup,
                                                                                       limits)
            assert sorted(asks.index(a) for a in batch.asks) == sorted(asks.index(a) for a in expected)
            assert [asks.index(a) for a in batch.kept] == [asks.index(a) for a in expected_kept]
            assert batch.deferred == expected_deferred
            tree = [request for root in batch.requests for request in root.tree()]
            assert sum(len(r.asks) - 1 for r in tree) == merges
            assert sum(r.parent is not None for r in tree) == forks
            exercised += [batch.deferred, merges, len(batch.kept) - batch.deferred, forks]
            if limits.pages is not None:  # only the history pages limit the round
                paged_out += len(batch.kept) - batch.deferred
    assert exercised.all() and paged_out


def test_pool_takes_and_frees_pages_in_bulk(tiny_path):
    """Saves take the pages they need at once, evicting least recently used checkpoints for room; a save that
    cannot fit even then takes nothing and leaves every page free, unreferenced and empty."""
    with fl.Engine.load(tiny_path, device="cpu", pool_bytes=0) as probe:
        slot_bytes, page_bytes = probe.pool.slot_bytes, probe.pool.page_bytes
    with fl.Engine.load(tiny_path, device="cpu") as engine:
        # a pool of its own: the engine's round thread trims its pool when idle
        pool = CheckpointPool(engine.model.config, torch.device("cpu"), torch.float32,
                              8 * slot_bytes + 6 * page_bytes, 8)
        prompt = engine.prompt
        assert pool.num_pages == 6
        trunks = [prompt.trunk(f"text {i}: " + " ".join(WORDS * 12)) for i in range(2)]
        at = min(256, min(len(t) for t in trunks))  # four pages each
        saves = []
        for trunk in trunks:
            save = pool.plan_save(trunk, None, at)
            assert save is not None and len(save.checkpoint.pages) == 4
            assert (save.kv_slots == np.asarray(save.checkpoint.pages)[np.arange(at) // 64] * 64
                    + np.arange(at) % 64).all()
            pool.commit(save)
            saves.append(save)
        assert pool.counters["evictions"] == 1 and pool.num_checkpoints == 1  # the first made room for the second
        usage = pool.page_usage()
        assert (usage.refs[saves[1].checkpoint.pages] == 1).all() and (usage.fill[saves[1].checkpoint.pages] == 64).all()
        assert sorted(usage.free + saves[1].checkpoint.pages) == list(range(6))
        long_trunk = prompt.trunk("too long: " + " ".join(WORDS * 40))
        assert len(long_trunk) > 7 * 64
        assert pool.plan_save(long_trunk, None, 7 * 64) is None  # seven pages: more than the pool holds
        usage = pool.page_usage()
        assert pool.num_checkpoints == 0 and usage.free == list(range(6))
        assert not usage.refs.any() and not usage.fill.any()
        assert pool.plan_save(long_trunk, None, 6 * 64) is not None  # the whole pool fits
