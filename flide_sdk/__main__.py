"""`python -m flide_sdk`: try a checkpoint without writing code.

    python -m flide_sdk info PATH                                  # model, device, capacities, memory split
    python -m flide_sdk ask PATH --state FILE|- --questions JSON   # the answers as JSON on stdout

PATH is a Hugging Face Qwen3.5 checkpoint directory, or `tiny` for the embedded random-weight model. The
questions are a JSON object of name -> question dict (`{"ok": {"type": "noul", "instructions": "..."}}`),
given inline or as `@file.json`. A state file holding a JSON object or array is asked as JSON data with
`--json-state`; otherwise its text is the state. Errors print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from flide_sdk.engine import Engine
from flide_sdk.errors import FlideError, InvalidQuestionError, InvalidStateError


def _engine(args: argparse.Namespace) -> Engine:
    options: dict[str, Any] = {"device": args.device, "dtype": args.dtype, "batch_invariant": args.batch_invariant}
    if args.path == "tiny":
        return Engine.tiny(**options)
    return Engine.load(args.path, **options)


def _read_questions(value: str) -> Any:
    text = value
    if value.startswith("@"):
        try:
            text = Path(value[1:]).read_text(encoding="utf-8")
        except OSError as error:
            raise InvalidQuestionError(f"--questions {value}: {error.strerror}") from error
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidQuestionError(f"--questions is not JSON: {error}") from error


def _read_state(value: str, as_json: bool) -> Any:
    try:
        text = sys.stdin.read() if value == "-" else Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidStateError(f"--state {value}: {error}") from error
    if not as_json:
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidStateError(f"--state {value} is not JSON (--json-state): {error}") from error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flide_sdk", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("info", "describe the engine a checkpoint loads into"), ("ask", "answer questions")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("path", help="checkpoint directory, or 'tiny' for the embedded model")
        command.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when available)")
        command.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: per device)")
        command.add_argument("--batch-invariant", action="store_true",
                             help="the same bits whatever shares a round (Engine.load(batch_invariant=True))")
        if name == "ask":
            command.add_argument("--state", required=True, help="a file with the state, or - for stdin")
            command.add_argument("--json-state", action="store_true", help="parse the state file as JSON data")
            command.add_argument("--questions", required=True, help="a JSON object of questions, or @file.json")
    args = parser.parse_args(argv)
    try:
        if args.command == "ask":
            state, questions = _read_state(args.state, args.json_state), _read_questions(args.questions)
        with _engine(args) as engine:
            if args.command == "info":
                result: Any = engine.info()
            else:
                response = engine.ask_sync(state, questions)
                result = response.to_dict()
    except FlideError as error:
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    json.dump(result, sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
