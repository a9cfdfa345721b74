"""Kernel bundles: the compiled Triton kernels of this package, saved once and loaded at start.

A bundle is a tar file holding a manifest and the files Triton's cache wrote while an engine compiled every
kernel it runs (`python -m flide_sdk bundle build`). Its key is the Triton version, the GPU
architecture and a hash of this package's kernel sources; an engine on a matching machine copies the
bundle's files into Triton's cache before its first kernel runs, so nothing compiles. Triton itself finds
a kernel's files by a hash of its source, options and target, so a file is only ever used for the kernel it
was compiled from. Bundles live in the user cache directory (`bundle_dir`); a bundle whose key does not
match, or whose files fail their checksums, is ignored with a warning. The kernels pick their launch
parameters from the shapes (there is no autotuning), so compiled files are all a bundle needs.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import logging
import os
import re
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

LOG = logging.getLogger(__name__)
FORMAT = 1
MANIFEST = "manifest.json"
ENTRY = re.compile(r"^[A-Za-z0-9_\-]+/[A-Za-z0-9_.\-]+$")  # <kernel hash dir>/<file name>, nothing else
GROUP_PREFIX = "__grp__"  # Triton's group files list their members by absolute path


class BundleError(ValueError):
    """A bundle that cannot be used: unreadable, of another key, or with a file failing its checksum."""


@dataclass(frozen=True)
class BundleKey:
    """What a bundle's kernels were compiled for."""

    triton: str
    arch: str  # e.g. "sm_90"
    source: str  # sha256 of this package's kernel sources (first 16 hex digits)

    @property
    def file_name(self) -> str:
        return f"kernels-triton{self.triton}-{self.arch}-{self.source}.tar"

    def describe(self) -> str:
        return f"triton {self.triton}, {self.arch}, kernel sources {self.source}"


@dataclass(frozen=True)
class InstallReport:
    """What loading a bundle did: files copied into Triton's cache and files it already had."""

    bundle: Path
    copied: int
    present: int
    seconds: float


def source_hash() -> str:
    """A hash of every kernel source of this package (a changed kernel changes it)."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def current_key(capability: tuple[int, int]) -> BundleKey:
    """The key of the bundle this machine can use: its Triton, the GPU's compute capability, these sources."""
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:  # Triton installed under another name (pytorch-triton)
        import triton

        version = triton.__version__
    return BundleKey(version, f"sm_{capability[0]}{capability[1]}", source_hash())


def bundle_dir() -> Path:
    """Where bundles are kept: $FLIDE_SDK_CACHE, else $XDG_CACHE_HOME/flide_sdk, else ~/.cache/flide_sdk."""
    if os.environ.get("FLIDE_SDK_CACHE"):
        return Path(os.environ["FLIDE_SDK_CACHE"]) / "kernels"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "flide_sdk" / "kernels"


def triton_cache_dir() -> Path:
    """The directory Triton's file cache reads and writes ($TRITON_CACHE_DIR, else Triton's default)."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    try:
        from triton import knobs

        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):
        return Path.home() / ".triton" / "cache"


def write_bundle(cache: Path, key: BundleKey, target: Path, models: list[str]) -> Path:
    """Pack the kernel files of Triton cache directory `cache` into a bundle at `target`."""
    files = {}
    for path in sorted(cache.glob("*/*")):
        name = f"{path.parent.name}/{path.name}"
        if path.is_file() and ENTRY.match(name) and not path.parent.name.startswith("tmp."):
            files[name] = path.read_bytes()
    manifest = {
        "format": FORMAT, "triton": key.triton, "arch": key.arch, "source": key.source, "models": models,
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cache_root": str(cache),
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with tarfile.open(partial, "w") as tar:
        for name, data in [(MANIFEST, json.dumps(manifest, indent=1).encode()), *files.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    partial.replace(target)
    return target


def read_bundle(path: Path, key: BundleKey | None = None) -> tuple[BundleKey, dict, dict[str, bytes]]:
    """The key, manifest and files of a bundle, checked: BundleError if it is unreadable, not of `key` (when
    given), or a file is missing, unexpected or fails its checksum."""
    try:
        with tarfile.open(path, "r") as tar:
            members = {member.name: member for member in tar.getmembers() if member.isfile()}
            if MANIFEST not in members:
                raise BundleError(f"{path}: no {MANIFEST}")
            manifest = json.loads(tar.extractfile(members.pop(MANIFEST)).read())
            found = BundleKey(str(manifest.get("triton")), str(manifest.get("arch")), str(manifest.get("source")))
            if manifest.get("format") != FORMAT or (key is not None and found != key):
                raise BundleError(f"{path} was built for {found.describe()}, this machine needs {key.describe()}")
            expected = manifest.get("files", {})
            if set(expected) != set(members) or not all(ENTRY.match(name) for name in expected):
                raise BundleError(f"{path}: its files do not match its manifest")
            files = {name: tar.extractfile(member).read() for name, member in members.items()}
    except (OSError, tarfile.TarError, json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
        raise BundleError(f"{path}: unreadable ({error})") from error
    for name, data in files.items():
        if hashlib.sha256(data).hexdigest() != expected[name]:
            raise BundleError(f"{path}: {name} fails its checksum")
    return found, manifest, files


def install(path: Path, key: BundleKey, cache: Path) -> InstallReport:
    """Copy a checked bundle's files into Triton cache directory `cache` (files already there are kept; group
    files are rewritten to point into `cache`). BundleError, copying nothing, if the bundle is unusable."""
    started = time.perf_counter()
    _, manifest, files = read_bundle(path, key)
    root = manifest["cache_root"].rstrip("/") + "/"
    copied = present = 0
    for name, data in files.items():
        target = cache / name
        if target.exists():
            present += 1
            continue
        if Path(name).name.startswith(GROUP_PREFIX):
            group = json.loads(data)
            group["child_paths"] = {child: str(cache / p.removeprefix(root)) if p.startswith(root) else p
                                    for child, p in group.get("child_paths", {}).items()}
            data = json.dumps(group).encode()
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as handle:  # Triton may read meanwhile
            handle.write(data)
        os.replace(handle.name, target)
        copied += 1
    return InstallReport(path, copied, present, time.perf_counter() - started)


def add_bundle(path: Path, directory: Path | None = None) -> Path:
    """Check a bundle and copy it into `directory` (default `bundle_dir()`) under its key's name, where engines
    on machines of that key find it (no GPU needed: for images built ahead)."""
    key, _, _ = read_bundle(path)
    target = (directory or bundle_dir()) / key.file_name
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.write_bytes(Path(path).read_bytes())
    partial.replace(target)
    return target


def load_bundle(key: BundleKey, cache: Path | None = None, directory: Path | None = None) -> InstallReport | None:
    """Install this machine's bundle from `directory` (default `bundle_dir()`) into Triton's cache, if there is
    one; logs why not otherwise. A bundle that is there but unusable is ignored with a warning."""
    path = (directory or bundle_dir()) / key.file_name
    if not path.exists():
        LOG.info("no kernel bundle for %s in %s: kernels compile on first use "
                 "(build one: python -m flide_sdk bundle build CHECKPOINT)", key.describe(), path.parent)
        return None
    try:
        report = install(path, key, cache or triton_cache_dir())
    except (BundleError, OSError) as error:
        LOG.warning("kernel bundle ignored, kernels compile on first use: %s", error)
        return None
    LOG.info("kernel bundle %s: %d files copied into Triton's cache, %d already there (%.2f s)", path.name,
             report.copied, report.present, report.seconds)
    return report
