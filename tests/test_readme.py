"""The README cannot drift from the code: every Python block runs as written (in order, in one namespace as the
README reads, a block with a top-level await run as the body of an async function; the README defines every name
it uses: nothing is supplied here), every `python -m flide_sdk` command runs, and its
results table (and benchmarks/README.md's) is the one generated from the latest benchmark results. Its two set-up
commands are what CI runs (`test_examples.test_ci_runs_the_readme_test_command`)."""

from __future__ import annotations

import ast
import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.readme_results import BENCHMARKS_README, README, index, table, with_table

BLOCK = re.compile(r"```(python|bash)\n(.*?)\n```", flags=re.DOTALL)


def blocks(kind: str) -> list[str]:
    return [code for language, code in BLOCK.findall(README.read_text()) if language == kind]


def test_every_python_block_of_the_readme_runs_as_written(capsys):
    # mutation: drop the README's `def ask_a_human` -> NameError -> fails
    namespace: dict[str, object] = {}
    codes = blocks("python")
    assert len(codes) >= 4
    for number, code in enumerate(codes):
        compiled = compile(code, f"README.md python block {number}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
                           dont_inherit=True)
        result = eval(compiled, namespace)  # a block with a top-level await evaluates to a coroutine
        if asyncio.iscoroutine(result):
            asyncio.run(result)
    printed = capsys.readouterr().out
    assert "'answers'" in printed and "urgent=" in printed


def test_every_cli_command_of_the_readme_runs():
    commands = [line for code in blocks("bash") for line in code.splitlines() if "python -m flide_sdk" in line]
    assert len(commands) >= 2
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command in commands:
        result = subprocess.run(command, shell=True, capture_output=True, text=True, env=env, timeout=120, check=False)
        assert result.returncode == 0, (command, result.stderr)
        assert result.stdout.lstrip().startswith("{")


def test_the_results_tables_are_the_generated_ones():
    for readme, generated in ((README, table()), (BENCHMARKS_README, index())):
        text = readme.read_text()
        assert with_table(text, generated) == text, f"{readme.name} stale: run python benchmarks/readme_results.py"
