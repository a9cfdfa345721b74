"""The conventions a user expects of a Python SDK: metadata, exports, typed answers with a dict form, a blocking
ask that withdraws on timeout, a library that prints nothing, errors naming the in-process endpoint, the CLI."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.resources
import io
import json
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import typesafe_sdk as ts

import flide_sdk as fl
from flide_sdk.__main__ import main as cli
from flide_sdk.adapters.typesafe import LOCAL_BASE_URL, as_typesafe_error, async_client, client

from .conftest import gated_engine

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = {
    "urgent": fl.Noul("Does this need a reply within the hour?"),
    "action": fl.Choice("What next?", {"refund": "refund the order", "replace": None}),
    "severity": fl.Score("How severe?", ["low", "mid", "high"]),
}


def test_package_metadata_version_license_and_type_marker():
    assert fl.__version__ == importlib.metadata.version("flide_sdk")
    assert importlib.metadata.metadata("flide_sdk")["License-Expression"] == "Apache-2.0"
    assert (importlib.resources.files("flide_sdk") / "py.typed").is_file()
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert f"## {fl.__version__}" in (ROOT / "CHANGELOG.md").read_text()


def test_public_names_are_exported(engine):
    assert isinstance(engine.session(), fl.Session)
    for name in ("Session", "Decision", "NoulAnswer", "ChoiceAnswer", "ScoreAnswer", "Answer", "State", "Questions",
                 "AskTimeoutError", "SystemOneResponse", "Usage"):
        assert name in fl.__all__ and hasattr(fl, name)


def test_answers_and_questions_carry_their_type_and_a_dict_form(engine):
    response = engine.ask_sync("Customer: my order arrived broken.", QUESTIONS)
    wire = response.to_dict()
    assert {name: answer.type for name, answer in response.items()} == {"urgent": "noul", "action": "choice",
                                                                          "severity": "score"}
    for name, answer in response.items():
        assert answer.to_dict() == wire["answers"][name]
        assert answer.to_dict()["type"] == answer.type
    assert json.loads(json.dumps(wire)) == wire  # plain JSON data
    assert set(wire["answers"]["severity"]["legend"]) == {"0", "1", "2"}
    assert [q.type for q in QUESTIONS.values()] == ["noul", "choice", "score"]
    assert QUESTIONS["action"].to_dict() == {"type": "choice", "instructions": "What next?",
                                             "criteria": {"refund": "refund the order", "replace": None}}


def test_a_timed_out_blocking_ask_is_withdrawn_before_any_round_takes_it(tiny_path):
    with gated_engine(tiny_path) as (engine, gate), ThreadPoolExecutor(1) as other_thread:
        session = engine.session()
        session.append("The agent ran the tests.")
        with gate.closed():
            busy = other_thread.submit(engine.ask_sync, "a round that holds the device", QUESTIONS)
            gate.wait_held()
            with pytest.raises(fl.AskTimeoutError, match="withdrawn") as timed_out:
                engine.ask_sync("a one-off state", QUESTIONS, timeout=0.05)
            assert timed_out.value.withdrawn and isinstance(timed_out.value, TimeoutError)
            with pytest.raises(fl.AskTimeoutError, match="withdrawn"):
                session.ask_sync(QUESTIONS, timeout=0.05)
        # the device is free again: the withdrawn asks are never computed, and the next asks are
        assert set(busy.result(30)) == set(QUESTIONS)
        answered = engine.ask_sync("a one-off state", QUESTIONS)
        assert set(answered) == set(QUESTIONS)
        assert set(session.ask_sync(QUESTIONS)) == set(QUESTIONS)
        stats = engine.stats()
        assert stats["asks"] == 3 and stats["rounds"] == 3


def test_the_library_prints_nothing_when_a_round_fails(tmp_path):
    """A bug in a round fails that ask's future alone; the library logs it to the `flide_sdk` logger (a
    NullHandler), so an application that configured no logging sees nothing on stderr."""
    script = textwrap.dedent("""
        import torch
        import flide_sdk as fl
        from flide_sdk.models.checkpoint import load_model
        from flide_sdk.prompt.chat import ChatFormat
        from flide_sdk.testing import tiny_checkpoint

        class BrokenFormat(ChatFormat):  # a seam: the engine takes its prompt format in its constructor
            def trunk(self, state):
                raise RuntimeError("a bug in tokenizing")

        path = tiny_checkpoint()
        engine = fl.Engine(load_model(path, "cpu", torch.float32), BrokenFormat.from_checkpoint(path, 4096),
                           torch.device("cpu"))
        try:
            engine.ask_sync("state", {"q": fl.Noul("ok?")})
        except RuntimeError as error:
            print("failed:", error)
        print("answered:", sorted(engine.session().ask_sync({"q": fl.Noul("ok?")})))
        engine.close()
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["failed: a bug in tokenizing", "answered: ['q']"]
    assert result.stderr == ""


def test_an_engine_left_open_is_closed_at_exit():
    """A script that never closes its engine exits cleanly: its round thread is stopped before the interpreter
    finalizes (a round thread still running then aborted the process about one exit in three)."""
    script = textwrap.dedent("""
        import atexit, threading
        # registered before flide_sdk is imported, so it runs after flide_sdk's own exit handler
        atexit.register(lambda: print("round threads at exit:", [t.name for t in threading.enumerate()
                                                                 if t.name == "flide-rounds"]))
        import flide_sdk as fl
        engine = fl.Engine.tiny()
        engine.ask_sync("a state", {"q": fl.Noul("ok?")})
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["round threads at exit: []"]


def test_typesafe_errors_name_the_in_process_endpoint(engine):
    bad = {"q": ts.Choice(instructions="Which?", criteria={f"option {i}": None for i in range(30)})}  # > 26 labels
    with client(engine, retry=ts.RetryPolicy(max_retries=0)) as typesafe:
        with pytest.raises(ts.TypeSafeUnprocessableEntityError) as raised:
            typesafe.system_one(state="a ticket", questions=bad)
        answered = typesafe.system_one(state="a ticket", questions={"q": ts.Noul(instructions="ok?")})
    assert LOCAL_BASE_URL in str(raised.value) and "api.typesafe.ai" not in str(raised.value)
    assert 0.0 <= answered.nouls["q"].noul <= 1.0
    mapped = as_typesafe_error(fl.InvalidStateError("bad state"))
    assert LOCAL_BASE_URL in str(mapped) and "api.typesafe.ai" not in str(mapped)


@pytest.mark.asyncio
async def test_the_async_typesafe_client_answers_in_process(engine):
    async with async_client(engine) as typesafe:
        answered = await typesafe.system_one(state="a ticket", questions={"q": ts.Noul(instructions="ok?")})
    assert answered.nouls["q"].noul == pytest.approx(engine.ask_sync("a ticket", {"q": fl.Noul("ok?")})["q"].noul,
                                                      abs=1e-6)


def test_cli_ask_prints_the_answers_as_json(tiny_path, engine, monkeypatch, capsys, tmp_path):
    state = "Customer: my order arrived broken."
    questions = {name: q.to_dict() for name, q in QUESTIONS.items()}
    monkeypatch.setattr(sys, "stdin", io.StringIO(state))
    assert cli(["ask", str(tiny_path), "--state", "-", "--questions", json.dumps(questions)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == engine.ask_sync(state, QUESTIONS).to_dict()

    (tmp_path / "state.json").write_text(json.dumps({"ticket": state}))
    (tmp_path / "questions.json").write_text(json.dumps(questions))
    assert cli(["ask", "tiny", "--state", str(tmp_path / "state.json"), "--json-state",
                "--questions", f"@{tmp_path / 'questions.json'}"]) == 0
    assert json.loads(capsys.readouterr().out) == engine.ask_sync({"ticket": state}, QUESTIONS).to_dict()

    with fl.Engine.tiny(batch_invariant=True) as invariant:  # the flag loads the batch-invariant mode
        monkeypatch.setattr(sys, "stdin", io.StringIO(state))
        assert cli(["ask", "tiny", "--batch-invariant", "--state", "-", "--questions", json.dumps(questions)]) == 0
        assert json.loads(capsys.readouterr().out) == invariant.ask_sync(state, QUESTIONS).to_dict()


def test_cli_rendering_writes_questions_as_the_engine_option_does(monkeypatch, capsys):
    # mutation: `--rendering` parsed but not passed to the engine -> the flide prompt's answers -> fails
    state = "Customer: my order arrived broken."
    questions = {name: q.to_dict() for name, q in QUESTIONS.items()}
    printed = {}
    for rendering in ("transformers", "flide"):
        monkeypatch.setattr(sys, "stdin", io.StringIO(state))
        assert cli(["ask", "tiny", "--rendering", rendering, "--state", "-", "--questions", json.dumps(questions)]) == 0
        printed[rendering] = json.loads(capsys.readouterr().out)
        with fl.Engine.tiny(rendering=rendering) as engine:
            assert printed[rendering] == engine.ask_sync(state, QUESTIONS).to_dict()
    assert printed["transformers"]["answers"] != printed["flide"]["answers"]  # the option changed the prompt
    assert cli(["info", "tiny", "--rendering", "transformers"]) == 0
    assert json.loads(capsys.readouterr().out)["rendering"] == "transformers"


DEEP_JSON = "[" * 100_000 + "]" * 100_000  # past the JSON decoder's recursion


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        (["ask", "tiny", "--rendering", "vllm", "--state", "-", "--questions", "{}"], "InvalidOptionError"),
        (["ask", "tiny", "--state", "-", "--questions", DEEP_JSON], "InvalidQuestionError"),
        (["ask", "tiny", "--state", "-", "--json-state", "--questions", "{}"], "InvalidStateError"),
        (["ask", "tiny", "--state", "-", "--questions", "{not json"], "InvalidQuestionError"),
        (["ask", "tiny", "--state", "-", "--questions", '{"q": {"type": "box"}}'], "InvalidQuestionError"),
        (["ask", "tiny", "--state", "/no/such/file", "--questions", "{}"], "InvalidStateError"),
        (["info", "/no/such/checkpoint"], "CheckpointError"),
    ],
)
def test_cli_errors_are_one_line_and_status_2(arguments, error, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(DEEP_JSON if "--json-state" in arguments else "a state"))
    assert cli(arguments) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"error: {error}: ") and captured.err.count("\n") == 1


def test_cli_info_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "flide_sdk", "info", "tiny"], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["device"] == "cpu" and info["dtype"] == "float32" and info["layers"] == 8
    assert info["capacities"] == [] and set(info["memory_bytes"]) == {
        "weights_bytes", "graph_memory_bytes", "pool_reserved_bytes", "pool_used_bytes", "workspace_bytes"}
    assert info["memory_bytes"]["weights_bytes"] > 0


def test_the_kernels_import_nothing_of_the_sdk():
    """The kernels package reads plain tensors in its own structs: no module of it imports another SDK module
    (the bundle command that drives an engine is the SDK's CLI, `python -m flide_sdk bundle`)."""
    outside = {}
    for path in sorted((ROOT / "flide_sdk" / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found = [name for name in names if name.split(".")[:2] != ["flide_sdk", "kernels"]
                     and name.split(".")[0] == "flide_sdk"]
            if found:
                outside[path.name] = found
    assert outside == {}
