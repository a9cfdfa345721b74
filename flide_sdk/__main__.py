"""`python -m flide_sdk`: try a checkpoint without writing code.

    python -m flide_sdk info PATH                                  # model, device, capacities, memory split
    python -m flide_sdk ask PATH --state FILE|- --questions JSON   # the answers as JSON on stdout
    python -m flide_sdk bundle build CHECKPOINT... [--out FILE]    # on a GPU machine: pack compiled kernels
    python -m flide_sdk bundle add FILE                            # check a bundle, put it where engines look
    python -m flide_sdk bundle info                                # this machine's key and its bundles

PATH is a Hugging Face Qwen3.5 checkpoint directory, or `tiny` for the embedded random-weight model. The
questions are a JSON object of name -> question dict (`{"ok": {"type": "noul", "instructions": "..."}}`),
given inline or as `@file.json`. A state file holding a JSON object or array is asked as JSON data with
`--json-state`; otherwise its text is the state. `--rendering transformers` writes questions as transformers'
`pipeline("decision")` does (`Engine.load(rendering=...)`; default `flide`). `bundle build` compiles every kernel an engine on each
checkpoint runs (all CUDA-graph capacities) into an empty Triton cache and packs it (`kernels.bundle`; default:
into the bundle directory, where the next engine on this machine finds it). Errors print one line on stderr and
exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flide_sdk.errors import FlideError, InvalidQuestionError, InvalidStateError
from flide_sdk.kernels.bundle import (BundleError, add_bundle, bundle_dir, current_key, read_bundle, triton_cache_dir,
                                     write_bundle)


def _engine(args: argparse.Namespace) -> Any:
    from flide_sdk.engine import Engine

    options: dict[str, Any] = {"device": args.device, "dtype": args.dtype, "batch_invariant": args.batch_invariant,
                               "rendering": args.rendering}
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
    except RecursionError:  # deeper than the JSON decoder goes: far past the questions' nesting limit
        raise InvalidQuestionError("--questions is nested too deeply to read") from None


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
    except RecursionError:  # deeper than the JSON decoder goes: far past the state's nesting limit
        raise InvalidStateError(f"--state {value} is nested too deeply to read (--json-state)") from None


def build_bundle(checkpoints: list[str], out: str | None) -> Path:
    """Compile every kernel of engines on `checkpoints` into an empty Triton cache and pack it; the bundle's path."""
    target_dir = bundle_dir()  # before the build points the engine's bundle directory elsewhere
    cache = Path(tempfile.mkdtemp(prefix="flide-kernel-build-"))
    os.environ["TRITON_CACHE_DIR"] = str(cache / "triton")  # before anything compiles
    os.environ["FLIDE_SDK_CACHE"] = str(cache / "no-bundles")  # compile everything: no bundle is loaded
    import torch

    from flide_sdk.engine import Engine

    if not torch.cuda.is_available():
        raise BundleError("bundle build needs a CUDA device: kernels are compiled for the GPU they run on")
    key = current_key(torch.cuda.get_device_capability())
    target = Path(out) if out else target_dir / key.file_name
    started = time.perf_counter()
    for path in checkpoints:
        with Engine.load(path, device="cuda", progress=False) as engine:
            engine.wait_for_graphs()
            if engine.stats()["graphs_captured"] < len(engine.info()["capacities"]):
                raise BundleError(f"{path}: capturing the CUDA graphs failed (see the log); no bundle written")
            print(f"compiled the kernels of {path} ({engine.stats()['graphs_captured']:.0f} graphs) "
                  f"in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    write_bundle(cache / "triton", key, target, [str(path) for path in checkpoints])
    print(f"bundle for {key.describe()}: {target} ({target.stat().st_size / 2**20:.1f} MiB)", file=sys.stderr)
    return target


def describe_bundles() -> None:
    """Print the bundle directory, this machine's key and every bundle found there."""
    directory = bundle_dir()
    print(f"bundle directory: {directory}\nTriton cache: {triton_cache_dir()}")
    try:
        import torch

        key = current_key(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None
    except Exception as error:  # no Triton installed, a driver error
        key = None
        print(f"this machine: no key ({error})")
    if key is not None:
        print(f"this machine: {key.describe()} -> {key.file_name}")
    for path in sorted(directory.glob("*.tar")):
        try:
            found, manifest, files = read_bundle(path)
        except BundleError as error:
            print(f"  {path.name}: unusable ({error})")
            continue
        mark = "matches this machine" if found == key else "another machine"
        print(f"  {path.name}: {found.describe()}, {len(files)} files, built {manifest.get('built')} ({mark})")


def _bundle(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        if args.bundle_command == "build":
            build_bundle(args.checkpoints, args.out)
        elif args.bundle_command == "add":
            print(add_bundle(Path(args.file)))
        else:
            describe_bundles()
    except BundleError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


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
        command.add_argument("--rendering", default="flide",
                             help="how questions are written: flide (default) or transformers (as transformers' "
                                  "pipeline('decision') writes them; not for decision models)")
        if name == "ask":
            command.add_argument("--state", required=True, help="a file with the state, or - for stdin")
            command.add_argument("--json-state", action="store_true", help="parse the state file as JSON data")
            command.add_argument("--questions", required=True, help="a JSON object of questions, or @file.json")
    bundle = commands.add_parser("bundle", help="kernel bundles: compiled kernels saved and loaded at start")
    bundles = bundle.add_subparsers(dest="bundle_command", required=True)
    built = bundles.add_parser("build", help="compile every kernel of these checkpoints and pack them")
    built.add_argument("checkpoints", nargs="+")
    built.add_argument("--out", help="bundle file to write (default: the bundle directory)")
    bundles.add_parser("add", help="check a bundle and copy it into the bundle directory").add_argument("file")
    bundles.add_parser("info", help="this machine's bundle key and the bundles found")
    args = parser.parse_args(argv)
    if args.command == "bundle":
        return _bundle(args)
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
