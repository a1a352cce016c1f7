"""Shared fixtures: nasty source trees and helpers to compare trees exactly."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

MTIME_NS = 1_700_000_000_123_456_789


def snapshot(root: str | os.PathLike, ignore: tuple[str, ...] = (".pallet-incomplete",)) -> dict:
    """Map each relative path under ``root`` to (type, mode, mtime_ns, content or link target, inode group)."""
    root = os.fsencode(root)
    result, inodes = {}, {}
    for current, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(current, name)
            rel = os.path.relpath(path, root)
            if os.fsdecode(rel) in ignore:
                continue
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                result[rel] = ("l", None, st.st_mtime_ns, os.readlink(path), None)
            elif stat.S_ISDIR(st.st_mode):
                result[rel] = ("d", stat.S_IMODE(st.st_mode), st.st_mtime_ns, None, None)
            else:
                with open(path, "rb") as handle:
                    content = handle.read()
                group = inodes.setdefault(st.st_ino, rel) if st.st_nlink > 1 else None
                result[rel] = ("f", stat.S_IMODE(st.st_mode), st.st_mtime_ns, content, group)
    return result


def normalize_groups(snap: dict) -> dict:
    """Replace hard-link group leaders by the sorted member set so two trees compare equal."""
    groups: dict = {}
    for rel, value in snap.items():
        if value[4] is not None:
            groups.setdefault(value[4], []).append(rel)
    members = {rel: tuple(sorted(v)) for v in groups.values() for rel in v}
    return {rel: value[:4] + (members.get(rel),) for rel, value in snap.items()}


def assert_same_tree(a, b) -> None:
    left, right = normalize_groups(snapshot(a)), normalize_groups(snapshot(b))
    assert sorted(left) == sorted(right)
    for rel in left:
        assert left[rel] == right[rel], rel


def make_nasty_tree(root: str) -> str:
    """A fixed tree with the cases every round trip must survive."""
    os.makedirs(root)
    write = lambda rel, data=b"x", mode=0o644: _write(root, rel, data, mode)
    write("empty.txt", b"")
    os.makedirs(os.path.join(root, "empty_dir"))
    write("with space.txt", b"spaces")
    write("new\nline.txt", b"newline")
    write("ünïcødé-日本.txt", "unicode".encode())
    write("-leading-dash", b"dash")
    write("private.key", b"secret", 0o700)
    write("script.sh", b"#!/bin/sh\n", 0o755)
    deep = os.path.join(*[f"level{n:02d}" for n in range(40)])
    write(os.path.join(deep, "bottom.txt"), b"deep")
    long_dir = os.path.join("long", "d" * 120, "e" * 120)
    write(os.path.join(long_dir, "f" * 200 + ".txt"), b"long path")
    write("links/target.txt", b"target")
    os.symlink("target.txt", os.path.join(root, "links", "rel_link"))
    os.symlink("../links/target.txt", os.path.join(root, "links", "up_and_back"))
    os.symlink("t" * 150, os.path.join(root, "links", "long_dangling_link"))
    write("links/hard_a", b"shared inode")
    os.link(os.path.join(root, "links", "hard_a"), os.path.join(root, "links", "hard_b"))
    os.makedirs(os.path.join(root, "sub", "dir"))
    os.link(os.path.join(root, "links", "hard_a"), os.path.join(root, "sub", "dir", "hard_c"))
    write("big.bin", os.urandom(300_000))
    _set_times(root)
    return root


def _write(root: str, rel: str, data: bytes, mode: int) -> None:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)
    os.chmod(path, mode)


def _set_times(root: str) -> None:
    for current, dirs, files in os.walk(root, topdown=False):
        for name in files + dirs:
            os.utime(os.path.join(current, name), ns=(MTIME_NS, MTIME_NS), follow_symlinks=False)
    os.utime(root, ns=(MTIME_NS, MTIME_NS))


@pytest.fixture
def nasty_tree(tmp_path) -> str:
    return make_nasty_tree(str(tmp_path / "src"))


def run_pallet(*args: str, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """Run the real `pallet` command line in a subprocess."""
    done = subprocess.run([sys.executable, "-m", "staging_core.cli", *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, **kwargs)
    if check and done.returncode != 0:
        raise AssertionError(f"pallet {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return done
