"""Kernel bundles on CPU, on a stand-in Triton cache: a bundle installs its files (group files pointing into
the new cache), a bundle of another key or with a corrupted file is ignored with a warning and copies
nothing, and the command line adds and lists bundles."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import tarfile

import pytest

from flide_sdk.__main__ import main as cli
from flide_sdk.kernels.bundle import (
    BundleError,
    BundleKey,
    add_bundle,
    install,
    load_bundle,
    source_hash,
    write_bundle,
)

KEY = BundleKey("3.6.0", "sm_90", source_hash())


def fake_triton_cache(root):
    """Two compiled kernels as Triton's cache lays them out: a directory per kernel hash, its files and a group
    file listing them by absolute path."""
    for kernel in ("AAAA", "BBBB"):
        folder = root / kernel
        folder.mkdir(parents=True)
        (folder / "k.cubin").write_bytes(bytes(range(256)) * 4 + kernel.encode())
        (folder / "k.json").write_text(json.dumps({"name": "k", "hash": kernel}))
        children = {name: str(folder / name) for name in ("k.cubin", "k.json")}
        (folder / "__grp__k.json").write_text(json.dumps({"child_paths": children}))
    return root


@pytest.fixture
def bundle(tmp_path):
    return write_bundle(fake_triton_cache(tmp_path / "built"), KEY, tmp_path / "bundles" / KEY.file_name, ["m"])


def test_a_bundle_installs_its_files_into_a_fresh_cache(bundle, tmp_path):
    cache = tmp_path / "fresh"
    report = install(bundle, KEY, cache)
    assert (report.copied, report.present) == (6, 0)
    assert (cache / "AAAA" / "k.cubin").read_bytes() == (tmp_path / "built" / "AAAA" / "k.cubin").read_bytes()
    group = json.loads((cache / "BBBB" / "__grp__k.json").read_text())
    assert group["child_paths"] == {"k.cubin": str(cache / "BBBB" / "k.cubin"), "k.json": str(cache / "BBBB" / "k.json")}
    again = install(bundle, KEY, cache)
    assert (again.copied, again.present) == (0, 6)


def test_the_engine_start_finds_the_bundle_of_its_key(bundle, tmp_path):
    cache = tmp_path / "fresh"
    report = load_bundle(KEY, cache, bundle.parent)
    assert report is not None and report.copied == 6 and (cache / "AAAA" / "k.json").exists()


def test_a_machine_without_its_bundle_compiles(tmp_path, caplog):
    caplog.set_level(logging.INFO, "flide_sdk")
    assert load_bundle(KEY, tmp_path / "cache", tmp_path / "none") is None
    assert "kernels compile on first use" in caplog.text


@pytest.mark.parametrize("other", [BundleKey("3.5.0", "sm_90", KEY.source), BundleKey("3.6.0", "sm_100", KEY.source),
                                   BundleKey("3.6.0", "sm_90", "0" * 16)])
def test_a_bundle_of_another_key_is_ignored_with_a_warning(bundle, tmp_path, caplog, other):
    renamed = bundle.parent / other.file_name
    renamed.write_bytes(bundle.read_bytes())  # a bundle under the name another machine looks for
    assert load_bundle(other, tmp_path / "cache", bundle.parent) is None
    assert "ignored" in caplog.text and "built for triton 3.6.0, sm_90" in caplog.text
    assert not (tmp_path / "cache").exists()


def rewrite(bundle, change):
    """The bundle with one member's bytes changed by `change` (its manifest untouched)."""
    with tarfile.open(bundle) as tar:
        members = [(member, tar.extractfile(member).read()) for member in tar.getmembers()]
    with tarfile.open(bundle, "w") as tar:
        for member, data in members:
            data = change(member.name, data)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))


@pytest.mark.parametrize("change", [
    lambda name, data: data[:-1] + b"x" if name == "AAAA/k.cubin" else data,  # a flipped byte
    lambda name, data: data[:10] if name == "BBBB/k.cubin" else data,  # a truncated file
])
def test_a_corrupted_bundle_is_ignored_with_a_warning(bundle, tmp_path, caplog, change):
    rewrite(bundle, change)
    assert load_bundle(KEY, tmp_path / "cache", bundle.parent) is None
    assert "fails its checksum" in caplog.text
    assert not (tmp_path / "cache").exists()  # nothing copied, not even the files that were fine
    with pytest.raises(BundleError):
        add_bundle(bundle, tmp_path / "elsewhere")


def test_a_truncated_bundle_file_is_ignored(bundle, tmp_path, caplog):
    bundle.write_bytes(bundle.read_bytes()[:700])
    assert load_bundle(KEY, tmp_path / "cache", bundle.parent) is None
    assert "unreadable" in caplog.text or "manifest" in caplog.text


def test_the_command_line_adds_and_lists_bundles(bundle, tmp_path):
    env = {"FLIDE_SDK_CACHE": str(tmp_path / "sdk"), "PATH": "", "HOME": str(tmp_path)}
    run = [sys.executable, "-m", "flide_sdk", "bundle"]
    added = subprocess.run([*run, "add", str(bundle)], capture_output=True, text=True, env=env, check=False)
    assert added.returncode == 0, added.stderr
    assert (tmp_path / "sdk" / "kernels" / KEY.file_name).exists()
    listed = subprocess.run([*run, "info"], capture_output=True, text=True, env=env, check=False)
    assert listed.returncode == 0, listed.stderr
    assert KEY.file_name in listed.stdout and "6 files" in listed.stdout


def test_the_command_line_rejects_a_corrupted_bundle_in_one_line(bundle, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLIDE_SDK_CACHE", str(tmp_path / "sdk"))
    bundle.write_bytes(bundle.read_bytes()[:700])
    assert cli(["bundle", "add", str(bundle)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
    assert not (tmp_path / "sdk" / "kernels").exists() or not any((tmp_path / "sdk" / "kernels").iterdir())
