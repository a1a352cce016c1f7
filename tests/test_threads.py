"""The library from many threads at once: per-operation state, no fork from a threaded process, exact trees."""
from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bundles.reader import Bundle
from bundles.unpacking import UnpackOptions, unpack
from bundles.verify import verify_bundle, verify_tree
from bundles.writer import PackOptions, pack
from mpi_stager.comm import SerialComm
from mpi_stager.unpack import StagerOptions, unpack_parallel
from staging_core.operations.push_pull import pull, push
from staging_core.options import StagingOptions
from staging_core.operations.selection import fetch, send
from staging_core.testing import normalize_groups, snapshot

PACKAGES = ("bundles", "mpi_stager", "staging_core", "snakemake_storage_plugin_pallet", "pallet_parsl")
THREADS = 8
ROUNDS = 2


def package_files(name: str) -> list[Path]:
    """The .py files of an installed package (wherever the installation put them)."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"{name} is not installed as a package"
    return sorted(p for location in spec.submodule_search_locations for p in Path(location).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_rebinds_a_module_global(package):
    offenders = [f"{path.name}:{node.lineno}: global {', '.join(node.names)}"
                 for path in package_files(package)
                 for node in ast.walk(ast.parse(path.read_text(), str(path)))
                 if isinstance(node, ast.Global)]
    assert not offenders, "per-operation state must not live in module globals:\n" + "\n".join(offenders)


@pytest.mark.parametrize("plugin", ("snakemake_storage_plugin_pallet", "pallet_parsl"))
def test_the_plugins_import_only_the_public_api(plugin):
    ours = ("bundles", "mpi_stager", "staging_core")
    offenders = [f"{path.name}:{node.lineno}: {node.module}"
                 for path in package_files(plugin)
                 for node in ast.walk(ast.parse(path.read_text(), str(path)))
                 if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ours
                 and node.module != "staging_core"]
    offenders += [f"{path.name}:{node.lineno}: import {alias.name}"
                  for path in package_files(plugin)
                  for node in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(node, ast.Import)
                  for alias in node.names if alias.name.split(".")[0] in ours]
    assert not offenders, "plugins use `from staging_core import ...` only:\n" + "\n".join(offenders)


def test_every_public_name_resolves_even_after_every_submodule_is_imported():
    import pkgutil

    import staging_core
    for info in pkgutil.walk_packages(staging_core.__path__, "staging_core."):
        importlib.import_module(info.name)          # a submodule import binds its name on the package
    shadowed = [name for name in staging_core.__all__ if type(getattr(staging_core, name)).__name__ == "module"]
    assert not shadowed, f"public names hidden by submodules of the same name: {shadowed}"


@pytest.mark.parametrize("package", PACKAGES)
def test_nothing_forks_or_uses_multiprocessing(package):
    offenders = []
    for path in package_files(package):
        text = path.read_text()
        for word in ("os.fork", "multiprocessing", "preexec_fn"):
            if word in text:
                offenders.append(f"{path.name}: {word}")
    assert not offenders, "no fork from a process that may run threads:\n" + "\n".join(offenders)


def make_tree(root: Path, seed: int, files: int = 240) -> str:
    """A tree whose every byte, mode and mtime depends on ``seed``, with a symlink and a hard link."""
    for n in range(files):
        path = root / f"d{n % 6}" / f"s{n % 2}" / f"f{n:04d}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"tree {seed} file {n}\n".encode() * (1 + (n * seed) % 40))
        path.chmod((0o644, 0o600, 0o755)[(n + seed) % 3])
        os.utime(path, ns=(1_600_000_000_000_000_000 + seed * 1_000_003 + n,) * 2)
    (root / "d0" / "link").symlink_to("s0/f0000.csv")
    os.link(root / "d1" / "s1" / "f0001.csv", root / "d1" / "hard")
    for directory in sorted(root.rglob("*"), reverse=True):
        if directory.is_dir():
            os.utime(directory, ns=(1_500_000_000_000_000_000 + seed,) * 2)
    return str(root)


def assert_tree_equal(src: str, dest: str) -> None:
    """Byte, mode, mtime and link equality, and no other name in DEST (nothing of pallet's either)."""
    expected, found = normalize_groups(snapshot(src)), normalize_groups(snapshot(dest))
    assert sorted(found) == sorted(expected), f"{dest}: other names than {src}"
    wrong = [os.fsdecode(rel) for rel in expected if expected[rel] != found[rel]]
    assert not wrong, f"{dest}: {len(wrong)} entries differ from {src}, e.g. {wrong[:5]}"


def items_of(src: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), src) for d, _, files in os.walk(src) for f in files)


def pack_unpack_verify(work: Path, src: str, ssh) -> None:
    bundle = str(work / "b.tar.zst")
    pack(src, bundle, PackOptions(jobs=2, shard_size=8192))
    unpack(bundle, work / "dest", UnpackOptions(jobs=2))
    with Bundle.open(bundle) as opened:
        assert verify_bundle(opened, jobs=2).ok
        assert verify_tree(opened.index, str(work / "dest")).ok
    assert_tree_equal(src, str(work / "dest"))


def mpi_stager_pool(work: Path, src: str, ssh) -> None:
    bundle = str(work / "b.tar.zst")
    pack(src, bundle, PackOptions(jobs=1, shard_size=8192))
    unpack_parallel(SerialComm(), bundle, str(work / "dest"), StagerOptions(workers=2))
    assert_tree_equal(src, str(work / "dest"))


def fetch_local(work: Path, src: str, ssh) -> None:
    fetch("file://" + src, items_of(src), str(work / "dest"), StagingOptions(strategy="bundle", jobs=2,
                                                                            shard_size=8192))
    assert_tree_equal(src, str(work / "dest"))


def push_local(work: Path, src: str, ssh) -> None:
    push(src, str(work / "dest"), StagingOptions(strategy="bundle", jobs=2, shard_size=8192))
    assert_tree_equal(src, str(work / "dest"))


def push_ssh(work: Path, src: str, ssh) -> None:
    push(src, ssh.url(str(work / "dest")), ssh_options(ssh))
    assert_tree_equal(src, str(work / "dest"))


def send_ssh(work: Path, src: str, ssh) -> None:
    send(src, items_of(src), ssh.url(str(work / "dest")), ssh_options(ssh))
    assert_tree_equal(src, str(work / "dest"))


def fetch_ssh(work: Path, src: str, ssh) -> None:
    fetch(ssh.url(src), items_of(src), str(work / "dest"), ssh_options(ssh))
    assert_tree_equal(src, str(work / "dest"))


def pull_ssh(work: Path, src: str, ssh) -> None:
    pull(ssh.url(src), str(work / "dest"), ssh_options(ssh))
    assert_tree_equal(src, str(work / "dest"))


def ssh_options(ssh) -> StagingOptions:
    return StagingOptions(strategy="bundle", jobs=2, shard_size=8192, remote_python=sys.executable,
                          ssh_options=tuple(ssh.ssh_options))


OPERATIONS = (pack_unpack_verify, mpi_stager_pool, fetch_local, push_local, push_ssh, send_ssh, fetch_ssh, pull_ssh)


@pytest.mark.slow
def test_eight_threads_of_mixed_operations_give_exact_trees_and_never_fork(sshd, tmp_path, monkeypatch):
    forks: list[int] = []
    real_fork = os.fork

    def fork_only_when_alone():
        if threading.active_count() > 1:
            forks.append(threading.active_count())
            raise AssertionError("os.fork called while other threads run")
        return real_fork()

    monkeypatch.setattr(os, "fork", fork_only_when_alone)
    sources = [make_tree(tmp_path / f"src{n}", seed=n + 1) for n in range(THREADS)]
    for round_number in range(ROUNDS):
        works = [tmp_path / f"round{round_number}" / f"op{n}" for n in range(THREADS)]
        for work in works:
            work.mkdir(parents=True)
        with ThreadPoolExecutor(THREADS) as pool:
            rotated = sources[round_number:] + sources[:round_number]     # each operation meets a new tree
            futures = [pool.submit(op, work, src, sshd)
                       for op, work, src in zip(OPERATIONS, works, rotated, strict=True)]
            failures = [f"{op.__name__}: {future.exception()!r}" for op, future in zip(OPERATIONS, futures, strict=True)
                        if future.exception() is not None]
        assert not failures, "\n".join(failures)
        for work in works:
            shutil.rmtree(work)
    assert forks == []


def children(pid: int) -> set[int]:
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found |= {int(c) for c in (task / "children").read_text().split()}
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_workers_die_with_a_killed_pallet(tmp_path):
    """kill -9 of `pallet pack` while its workers build shards: no worker outlives it. The Python engine
    packs on worker processes (the native engine on threads of its own process, which leave nothing behind)."""
    src = tmp_path / "src"
    for n in range(20_000):
        path = src / f"d{n % 50}" / f"f{n:05d}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(64))
    pallet = shutil.which("pallet", path=os.path.dirname(sys.executable))
    process = subprocess.Popen([pallet, "pack", "--jobs", "2", "--shard-size", "64K", str(src),
                                str(tmp_path / "b.tar.zst")], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL,
                               env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PALLET_ENGINE": "python"})
    workers: set[int] = set()
    while process.poll() is None and len(workers) < 2:
        workers = children(process.pid)
        time.sleep(0.005)
    assert len(workers) == 2, "the pack ended before its two workers were seen"
    process.send_signal(signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 2
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in workers), "a worker outlived the killed pallet"
    assert not (tmp_path / "b.tar.zst").exists()
