"""`python -m flide_sdk.kernels bundle ...`: build, add and inspect kernel bundles (`kernels.bundle`).

    python -m flide_sdk.kernels bundle build CHECKPOINT [CHECKPOINT ...] [--out FILE]   # on a GPU machine
    python -m flide_sdk.kernels bundle add FILE      # check a bundle and put it where engines look for it
    python -m flide_sdk.kernels bundle info          # this machine's key and the bundles it has

`build` compiles every kernel an engine on each checkpoint runs (all CUDA-graph capacities) into an empty
Triton cache and packs it (default: into the bundle directory, where the next engine on this machine finds it).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path


def build(checkpoints: list[str], out: str | None) -> Path:
    from flide_sdk.kernels.bundle import bundle_dir

    target_dir = bundle_dir()  # before the build points the engine's bundle directory elsewhere
    cache = Path(tempfile.mkdtemp(prefix="flide-kernel-build-"))
    os.environ["TRITON_CACHE_DIR"] = str(cache / "triton")  # before anything compiles
    os.environ["FLIDE_SDK_CACHE"] = str(cache / "no-bundles")  # compile everything: no bundle is loaded
    import torch

    from flide_sdk.engine import Engine
    from flide_sdk.kernels.bundle import current_key, write_bundle

    if not torch.cuda.is_available():
        raise SystemExit("bundle build needs a CUDA device: kernels are compiled for the GPU they run on")
    key = current_key(torch.cuda.get_device_capability())
    target = Path(out) if out else target_dir / key.file_name
    started = time.perf_counter()
    for path in checkpoints:
        with Engine.load(path, device="cuda", progress=False) as engine:
            engine.wait_for_graphs()
            if engine.stats()["graphs_captured"] < len(engine.info()["capacities"]):
                raise SystemExit(f"{path}: capturing the CUDA graphs failed (see the log); no bundle written")
            print(f"compiled the kernels of {path} ({engine.stats()['graphs_captured']:.0f} graphs) "
                  f"in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    write_bundle(cache / "triton", key, target, [str(path) for path in checkpoints])
    print(f"bundle for {key.describe()}: {target} ({target.stat().st_size / 2**20:.1f} MiB)", file=sys.stderr)
    return target


def info() -> None:
    from flide_sdk.kernels.bundle import BundleError, bundle_dir, current_key, read_bundle, triton_cache_dir

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flide_sdk.kernels", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="group", required=True)
    bundle = commands.add_parser("bundle", help="kernel bundles").add_subparsers(dest="command", required=True)
    built = bundle.add_parser("build", help="compile every kernel of these checkpoints and pack them")
    built.add_argument("checkpoints", nargs="+")
    built.add_argument("--out", help="bundle file to write (default: the bundle directory)")
    added = bundle.add_parser("add", help="check a bundle and copy it into the bundle directory")
    added.add_argument("file")
    bundle.add_parser("info", help="this machine's bundle key and the bundles found")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.command == "build":
        build(args.checkpoints, args.out)
    elif args.command == "add":
        from flide_sdk.kernels.bundle import BundleError, add_bundle

        try:
            print(add_bundle(Path(args.file)))
        except BundleError as error:
            raise SystemExit(f"error: {error}") from None
    else:
        info()


if __name__ == "__main__":
    main()
