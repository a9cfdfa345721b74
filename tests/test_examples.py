"""The examples run on the embedded model (the main job, the routing guard, the TypeSafe swap), and CI runs the
README's test command."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_agent_loop_prints_answers_for_every_step():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "agent_loop.py")], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "RANDOM weights" in result.stdout
    steps = re.findall(
        r"^step (\d+): +(\d+) tokens resumed, +(\d+) computed, +([\d.]+) ms \| stuck P\(yes\)=([\d.]+) \| next=(\w+)",
        result.stdout,
        flags=re.MULTILINE,
    )
    assert [int(s[0]) for s in steps] == [1, 2, 3, 4]
    resumed = [int(s[1]) for s in steps]
    assert resumed[0] == 0 and all(b > a for a, b in zip(resumed, resumed[1:]))  # each step resumes further
    assert all(0.0 <= float(s[4]) <= 1.0 for s in steps)
    assert all(s[5] in {"inspect", "edit", "test", "submit"} for s in steps)


def run_example(name: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "RANDOM weights" in result.stdout
    return result.stdout


def test_routing_guard_blocks_above_its_threshold_resumes_its_session_and_batches_routes():
    out = run_example("routing_guard.py")
    steps = re.findall(r"^guard step (\d+): +(\d+) resumed, +(\d+) computed \| .+ -> (ran|blocked P\(yes\)=([\d.]+) > ([\d.]+))",
                       out, flags=re.MULTILINE)
    assert [int(s[0]) for s in steps] == [1, 2, 3, 4]
    resumed = [int(s[1]) for s in steps]
    assert resumed[0] == 0 and all(b > a for a, b in zip(resumed, resumed[1:]))  # one session, each step resumes
    for *_, outcome, probability, threshold in steps:
        assert outcome == "ran" or float(probability) > float(threshold)
    routes = re.findall(r"^route: (\S+) +<- ", out, flags=re.MULTILINE)
    assert len(routes) == 8 and set(routes) <= {"billing", "bugs", "sales", "human-triage"}
    rounds = re.search(r"^routed 8 tickets in (\d+) rounds", out, flags=re.MULTILINE)
    assert rounds and 1 <= int(rounds.group(1)) < 8


def test_typesafe_swap_runs_unchanged_typesafe_code_with_engine_parity():
    out = run_example("typesafe_swap.py")
    tickets = re.findall(r"^sync ticket (\d): billing P\(yes\)=([\d.]+) \| tone=(\w+) \(conf ([\d.]+)\) \| urgency=([\d.]+)/2",
                         out, flags=re.MULTILINE)
    assert [int(t[0]) for t in tickets] == [0, 1, 2, 3]
    for _, billing, tone, confidence, urgency in tickets:
        assert 0 <= float(billing) <= 1 and tone in {"calm", "frustrated", "angry"} and 0 <= float(urgency) <= 2
    assert re.search(r"^models: \['flide_sdk-tiny", out, flags=re.MULTILINE)
    rounds = re.search(r"^async: 4 requests in (\d+) rounds", out, flags=re.MULTILINE)
    assert rounds and 1 <= int(rounds.group(1)) <= 4
    parity = re.search(r"^parity with engine.ask: max \|dp\| = ([\d.e+-]+) over 4 tickets", out, flags=re.MULTILINE)
    assert parity and float(parity.group(1)) <= 1e-5


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- test-command -->\s*```(?:bash|sh)?\n(.+?)\n```", readme, flags=re.DOTALL)
    assert match, "README must mark its test command with <!-- test-command -->"
    assert match.group(1).strip() in (ROOT / ".ci" / "run").read_text()


def test_next_command_scores_each_candidate_by_its_text_and_resumes():
    out = run_example("next_command.py")
    steps = re.findall(r"^step (\d+): +[\d.]+ ms \| runs (.+) \(conf ([\d.]+)\) \| (.+)$", out, flags=re.MULTILINE)
    assert [int(s[0]) for s in steps] == [1, 2, 3, 4]
    for _, chosen, confidence, ranked in steps:
        probabilities = [float(p) for p in re.findall(r"['\"] ([\d.]+)(?:,|$)", ranked)]  # after each quoted command
        assert ranked.startswith(chosen) and 0.0 <= float(confidence) <= 1.0
        assert abs(sum(probabilities) - 1.0) < 0.02 and probabilities == sorted(probabilities, reverse=True)
    assert re.search(r"^done: 4 rounds, \d+ tokens resumed from 3 checkpoint hits", out, flags=re.MULTILINE)
