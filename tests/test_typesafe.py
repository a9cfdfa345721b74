"""TypeSafe System One parity: question objects, the response shape, the in-process transport, errors."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx2
import msgspec
import numpy as np
import pytest
import typesafe_sdk as ts
from backports import zstd

import flide_sdk as fl
from flide_sdk.adapters.typesafe import as_typesafe_error, transport

from .conftest import gated_engine

ROOT = Path(__file__).resolve().parents[1]
NO_RETRY = ts.RetryPolicy(max_retries=0)
STATE = "Customer: my order #17 arrived broken and I need it for tomorrow's party. " * 20  # > 1 KiB: zstd body
TS_QUESTIONS = {
    "urgent": ts.Noul(instructions="Does this need a reply within the hour?", criteria={"true": "a reply is due now"}),
    "action": ts.Choice(instructions="What next?", criteria={"refund": "refund the order", "replace": None}),
    "severity": ts.Score(instructions="How severe?", criteria=["low", "mid", "high"]),
}
FL_QUESTIONS = {
    "urgent": fl.Noul("Does this need a reply within the hour?", {"true": "a reply is due now"}),
    "action": fl.Choice("What next?", {"refund": "refund the order", "replace": None}),
    "severity": fl.Score("How severe?", ["low", "mid", "high"]),
}
DICT_QUESTIONS = {name: msgspec.to_builtins(q) for name, q in FL_QUESTIONS.items()}


def probabilities(answer) -> list[float]:
    """Option probabilities of an answer of either SDK, in option order."""
    return [answer.noul, 1.0 - answer.noul] if hasattr(answer, "noul") else list(answer.probabilities.values())


def assert_same_answers(got, expected) -> None:
    assert set(got) == set(expected)
    for name in expected:
        assert type(got[name]).__name__ == type(expected[name]).__name__
        np.testing.assert_allclose(probabilities(got[name]), probabilities(expected[name]), atol=1e-6)


def test_question_objects_of_both_sdks_render_to_the_same_ids(engine):
    ours = engine.render(STATE, FL_QUESTIONS)
    for questions in (TS_QUESTIONS, DICT_QUESTIONS):
        theirs = engine.render(STATE, questions)
        np.testing.assert_array_equal(theirs.state_ids, ours.state_ids)
        for name in FL_QUESTIONS:
            np.testing.assert_array_equal(theirs.questions[name].ids, ours.questions[name].ids)
            np.testing.assert_array_equal(theirs.questions[name].label_ids, ours.questions[name].label_ids)


def test_box_questions_are_refused_as_unsupported(engine):
    for box in (ts.Box(instructions="the dog"), {"type": "box", "instructions": "the dog"}):
        with pytest.raises(fl.InvalidQuestionError, match="Box questions"):
            engine.ask_sync("a photo", {"where": box})
    assert set(engine.ask_sync("still fine", {"n": fl.Noul("ok?")})) == {"n"}


def test_engine_ask_returns_a_typesafe_system_one_response(engine):
    response = engine.ask_sync(STATE, TS_QUESTIONS)
    assert isinstance(response, dict) and isinstance(response, fl.SystemOneResponse)
    assert response["urgent"].noul == response.nouls["urgent"].noul == response.answers["urgent"].noul
    assert set(response.nouls) == {"urgent"} and set(response.choices) == {"action"} and set(response.scores) == {"severity"}
    rendered = engine.render(STATE, TS_QUESTIONS)
    prompt_tokens = len(rendered.state_ids) + sum(len(q.ids) for q in rendered.questions.values())
    assert response.usage == fl.Usage(input_tokens=prompt_tokens, output_tokens=3)
    assert response.model == engine.name

    wire = response.to_dict()
    assert set(wire["answers"]["severity"]["legend"]) == {"0", "1", "2"}  # string-keyed score maps on the wire
    assert set(wire["answers"]["severity"]["probabilities"]) == {"0", "1", "2"}
    assert wire["usage"] == {"input_tokens": prompt_tokens, "output_tokens": 3}
    parsed = ts.SystemOneResponse.model_validate_json(response.to_json())
    assert parsed.model == engine.name and parsed.usage.input_tokens == prompt_tokens
    assert parsed.nouls["urgent"].noul == response["urgent"].noul
    assert parsed.choices["action"].probabilities == response["action"].probabilities
    assert parsed.scores["severity"].legend == {0: "low", 1: "mid", 2: "high"}
    assert parsed.scores["severity"].probabilities == response["severity"].probabilities


def test_sync_client_through_the_transport_equals_engine_ask(engine):
    with ts.TypeSafeClient(api_key="local", transport=transport(engine), retry=NO_RETRY) as client:
        through = client.system_one(state=STATE, questions=TS_QUESTIONS)
        assert through.raw_http_response.request.headers["content-encoding"] == "zstd"
        models = client.models.list()
    native = engine.ask_sync(STATE, FL_QUESTIONS)
    assert isinstance(through, ts.SystemOneResponse)
    assert through.model == native.model == engine.name
    assert through.usage.input_tokens == native.usage.input_tokens and through.usage.output_tokens == 3
    assert through.choices["action"].choice == native["action"].choice
    assert through.scores["severity"].score == pytest.approx(native["severity"].score, abs=1e-6)
    assert_same_answers(through.answers, native)
    assert [m.name for m in models.models] == [engine.name]


@pytest.mark.asyncio
async def test_async_client_through_the_transport_equals_engine_ask(engine):
    state = {"message": "I was charged twice. Please help.", "plan": "pro"}
    async with ts.AsyncTypeSafeClient(api_key="local", transport=transport(engine), retry=NO_RETRY) as client:
        through = await asyncio.gather(*(client.system_one(state=state, questions=DICT_QUESTIONS) for _ in range(4)))
    native = await engine.ask(state, TS_QUESTIONS)
    for response in through:
        assert_same_answers(response.answers, native)
        assert response.usage.input_tokens == native.usage.input_tokens


@pytest.mark.asyncio
async def test_engine_validation_errors_surface_as_the_matching_typesafe_exceptions(tiny_path):
    with fl.Engine.load(tiny_path, device="cpu", dtype="float32", max_prompt_tokens=200) as engine:
        async with ts.AsyncTypeSafeClient(api_key="local", transport=transport(engine), retry=NO_RETRY) as client:
            with pytest.raises(ts.TypeSafeUnprocessableEntityError) as bad_question:
                await client.system_one(state="s", questions={"c": {"type": "choice", "criteria": {" ": None}}})
            assert bad_question.value.status == 422 and "must not be empty" in str(bad_question.value)
            with pytest.raises(ts.TypeSafeUnprocessableEntityError, match="Box questions"):
                await client.system_one(state="a photo", questions={"b": ts.Box(instructions="the dog")})
            with pytest.raises(ts.TypeSafeBadRequestError, match="max_prompt_tokens"):
                await client.system_one(state="word " * 400, questions=TS_QUESTIONS)
            ok = await client.system_one(state="short", questions=TS_QUESTIONS)  # the engine stays usable
            assert set(ok.answers) == set(TS_QUESTIONS)
        engine.close()
        with ts.TypeSafeClient(api_key="local", transport=transport(engine), retry=NO_RETRY) as client:
            with pytest.raises(ts.TypeSafeInternalServerError) as closed:
                client.system_one(state="s", questions=TS_QUESTIONS)
            assert closed.value.status == 503 and "closed" in str(closed.value)


def test_malformed_bodies_and_other_routes_answer_http_errors(engine):
    with httpx2.Client(transport=transport(engine), base_url="http://local") as http:
        assert http.post("/v1/systemone", content=b"{not json").status_code == 400
        assert http.post("/v1/systemone", content=b"[1, 2]").status_code == 400
        broken_zstd = http.post("/v1/systemone", content=b"\x28\xb5\x2f\xfd garbage", headers={"content-encoding": "zstd"})
        assert broken_zstd.status_code == 400 and "zstd" in broken_zstd.json()["detail"]
        assert http.post("/v1/systemone", content=b"{}", headers={"content-encoding": "br"}).status_code == 400
        missing_state = http.post("/v1/systemone", json={"questions": DICT_QUESTIONS})
        assert missing_state.status_code == 422 and missing_state.json()["detail"][0]["loc"] == ["body", "state"]
        assert http.post("/v1/systemone", json={"state": "s", "questions": DICT_QUESTIONS, "assets": {}}).status_code == 400
        no_close = http.post("/v1/systemone", content=b"--b\r\nContent-Disposition: form-data; name=\"request\"\r\n\r\n{}",
                             headers={"content-type": "multipart/form-data; boundary=b"})
        assert no_close.status_code == 400 and "boundary" in no_close.json()["detail"]
        image = {"state": "see <a>", "questions": DICT_QUESTIONS, "assets": {"<a>": {"format": "png", "data_base64": ""}}}
        unserved = http.post("/v1/systemone", json=image)  # mutation: InvalidAssetError answered 500
        assert unserved.status_code == 422 and unserved.json()["detail"][0]["loc"] == ["body", "assets"]
        assert http.get("/v1/systemone").status_code == 405
        assert http.get("/v1/nothing").status_code == 404
        compressed = zstd.compress(msgspec.json.encode({"state": "s", "model": "jev-latest", "questions": DICT_QUESTIONS}))
        answered = http.post("/v1/systemone", content=compressed, headers={"content-encoding": "zstd"})
        assert answered.status_code == 200 and answered.headers["x-typesafe-request-id"].startswith("local-")
        assert set(answered.json()["answers"]) == set(DICT_QUESTIONS)


@pytest.mark.asyncio
async def test_a_full_queue_is_a_rate_limit_with_retry_after(tiny_path):
    questions = {"n": fl.Noul("ok?")}
    with gated_engine(tiny_path, max_pending=1) as (engine, gate):
        with gate.closed():
            busy = asyncio.ensure_future(engine.ask("holds the device", questions))
            await asyncio.to_thread(gate.wait_held)
            first = asyncio.ensure_future(engine.ask("fills the queue", questions))
            await asyncio.sleep(0.01)
            with pytest.raises(fl.QueueFullError) as native:
                await engine.ask("no room", questions, queue_timeout=0.02)
            assert native.value.retry_after_ms >= 1
            async with ts.AsyncTypeSafeClient(
                api_key="local", transport=transport(engine, queue_timeout=0.02), retry=NO_RETRY
            ) as client:
                with pytest.raises(ts.TypeSafeRateLimitError) as limited:
                    await client.system_one(state="no room", questions={"n": ts.Noul(instructions="ok?")})
            assert limited.value.status == 429 and limited.value.retry_after_ms >= 1
        assert set(await first) == set(await busy) == {"n"}  # the queued ask runs once the device is free
        answered = await engine.ask("room again", questions, queue_timeout=0.02)
        assert 0.0 <= answered["n"].noul <= 1.0


def test_a_full_queue_is_a_rate_limit_for_the_sync_client_too(tiny_path):
    questions = {"n": ts.Noul(instructions="ok?")}
    loop = asyncio.new_event_loop()
    try:
        with gated_engine(tiny_path, max_pending=1) as (engine, gate):
            with gate.closed():
                busy = loop.create_task(engine.ask("holds the device", questions))
                loop.run_until_complete(asyncio.to_thread(gate.wait_held))
                first = loop.create_task(engine.ask("fills the queue", questions))
                loop.run_until_complete(asyncio.sleep(0.01))  # the task has queued its ask
                with pytest.raises(fl.QueueFullError):
                    engine.ask_sync("no room", questions, queue_timeout=0.02)
                with ts.TypeSafeClient(api_key="local", transport=transport(engine, queue_timeout=0.02), retry=NO_RETRY) as client:
                    with pytest.raises(ts.TypeSafeRateLimitError) as limited:
                        client.system_one(state="no room", questions=questions)
                assert limited.value.retry_after_ms >= 1
            assert set(loop.run_until_complete(first)) == set(loop.run_until_complete(busy)) == {"n"}
    finally:
        loop.close()


def test_flide_errors_map_onto_the_typesafe_hierarchy():
    cases = [
        (fl.InvalidQuestionError("bad"), ts.TypeSafeUnprocessableEntityError, 422),
        (fl.InvalidStateError("bad"), ts.TypeSafeUnprocessableEntityError, 422),
        (fl.StateTooLongError(10, 5), ts.TypeSafeBadRequestError, 400),
        (fl.QueueFullError(1.0, 250), ts.TypeSafeRateLimitError, 429),
        (fl.EngineClosedError("closed"), ts.TypeSafeInternalServerError, 503),
    ]
    for error, kind, status in cases:
        mapped = as_typesafe_error(error)
        assert type(mapped) is kind and mapped.status == status
    assert as_typesafe_error(fl.QueueFullError(1.0, 250)).retry_after_ms == 250


def test_importing_flide_sdk_imports_neither_typesafe_sdk_nor_pydantic():
    code = (
        "import sys, flide_sdk, flide_sdk.adapters.typesafe, flide_sdk.adapters.decide, flide_sdk.adapters.guard; "
        "print(sorted(m for m in ('typesafe_sdk', 'pydantic', 'httpx2') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_text_scoring_passes_through_the_typesafe_client_as_a_dict_field(single):
    engine = single  # no checkpoints: both asks computed alike, so their answers are equal, not just close
    question = {"type": "choice", "instructions": "Which?", "criteria": {"a": None, "b c": None}, "scoring": "text"}
    with ts.TypeSafeClient(api_key="local", transport=transport(engine), retry=NO_RETRY) as client:
        through = client.system_one(state="the agent", questions={"q": question})
    native = engine.ask_sync("the agent", {"q": fl.Choice("Which?", {"a": None, "b c": None}, scoring="text")})
    assert through.answers["q"].probabilities == native["q"].probabilities
    labelled = engine.ask_sync("the agent", {"q": {**question, "scoring": "label"}})
    assert labelled["q"].probabilities != native["q"].probabilities  # the field is read, not dropped
