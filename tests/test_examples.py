"""The main job (examples/agent_loop.py) runs on the embedded model, and CI runs the README's test command."""

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


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- test-command -->\s*```(?:bash|sh)?\n(.+?)\n```", readme, flags=re.DOTALL)
    assert match, "README must mark its test command with <!-- test-command -->"
    assert match.group(1).strip() in (ROOT / ".ci" / "run").read_text()
