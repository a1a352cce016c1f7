"""Test helpers shipped with pallet: exact tree comparison, a nasty tree, and the transport conformance suite.

Transport authors subclass TransportConformance in a pytest module, set
``scheme`` and provide a ``conformance_target`` fixture; every registered
scheme must have such a subclass (tests/test_transport_conformance.py checks).
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import ClassVar

import pytest

from staging_core.transports.base import Direction, Transport, local_tree_items as tree_items, name_crosses
from staging_core.transports.errors import NotSupportedError

MTIME_NS = 1_700_000_000_123_456_789


def snapshot(root: str | os.PathLike, ignore: tuple[str, ...] = ()) -> dict:
    """Map each relative path under ``root`` to (type, mode, mtime_ns, content or link target, inode group)."""
    top = os.fsencode(root)
    result: dict[bytes, tuple[str, int | None, int, bytes | None, bytes | None]] = {}
    inodes: dict[int, bytes] = {}
    for current, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(current, name)
            rel = os.path.relpath(path, top)
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


def _in_ustar(mtime_ns: int) -> int:
    """``mtime_ns`` as a format 2 tar header restores it: whole seconds when ustar's field holds them."""
    seconds = mtime_ns // 10**9
    return seconds * 10**9 if 0 <= seconds < 8**11 else mtime_ns


def assert_same_snapshot(expected: dict, landed: dict, whole_seconds: bool = False, what: str = "") -> None:
    """Assert that two normalized snapshots (:func:`snapshot`, :func:`normalize_groups`) are equal. With
    ``whole_seconds``, an mtime in ``landed`` may also be the expected one as GNU tar restores it from a format 2
    bundle (cut to whole seconds where ustar holds it): the far side's own tar wrote that entry."""
    assert sorted(expected) == sorted(landed), what
    for rel, value in expected.items():
        if whole_seconds and landed[rel][2] == _in_ustar(value[2]):
            value = value[:2] + (landed[rel][2],) + value[3:]
        assert value == landed[rel], f"{what} {rel!r}"


def assert_same_tree(a, b, whole_seconds: bool = False) -> None:
    """Assert that trees ``a`` and ``b`` hold the same entries, types, modes, mtimes, contents, link targets and
    hard-link groups (``whole_seconds``: see :func:`assert_same_snapshot`)."""
    assert_same_snapshot(normalize_groups(snapshot(a)), normalize_groups(snapshot(b)), whole_seconds)


def make_nasty_tree(root: str) -> str:
    """A fixed tree with the cases every round trip must survive."""
    os.makedirs(root)

    def write(rel: str, data: bytes = b"x", mode: int = 0o644) -> None:
        _write(root, rel, data, mode)

    write("empty.txt", b"")
    os.makedirs(os.path.join(root, "empty_dir"))
    write("with space.txt", b"spaces")
    write("new\nline.txt", b"newline")
    write("ünïcødé-日本.txt", b"unicode")
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


@dataclass
class ConformanceTarget:
    """A transport under test and an absolute path on its far side that the test may fill."""

    transport: Transport
    remote_root: str


class TransportConformance:
    """The contract of staging_core.transports.base.Transport, as tests; skips follow capabilities."""

    scheme: ClassVar[str] = ""
    tested_schemes: ClassVar[set[str]] = set()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.scheme:
            TransportConformance.tested_schemes.add(cls.scheme)

    def _items(self, src: str, caps) -> list[str]:
        """tree_items of ``src`` without the symlinks a transport that cannot carry them would refuse."""
        return [i for i in tree_items(src) if caps.symlinks or not os.path.islink(os.path.join(src, i))]

    def _nasty(self, target: ConformanceTarget, tmp_path) -> str:
        """make_nasty_tree without the names the transport declares it cannot carry (Capabilities.names)."""
        src = make_nasty_tree(str(tmp_path / "src"))
        for rel in reversed(tree_items(src)):
            path = os.path.join(src, rel)
            if not name_crosses(rel, target.transport.capabilities.names) and os.path.lexists(path):
                os.rmdir(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
        return src

    def _round_trip(self, target: ConformanceTarget, src: str, tmp_path, name: str) -> str:
        remote = os.path.join(target.remote_root, name)
        target.transport.mkdir(remote)
        items = self._items(src, target.transport.capabilities)
        pushed = target.transport.transfer(Direction.PUSH, src, remote, items)
        assert pushed.ok, pushed.failed
        back = str(tmp_path / f"{name}-back")
        pulled = target.transport.transfer(Direction.PULL, back, remote, items)
        assert pulled.ok, pulled.failed
        return back

    def _expected(self, snap: dict, caps) -> dict:
        result = {}
        for rel, (kind, mode, mtime, content, group) in normalize_groups(snap).items():
            if kind == "l" and not caps.symlinks:
                continue
            result[rel] = (kind, mode if caps.preserves_mode or kind == "l" else None,
                           mtime if caps.preserves_mtime and kind in "fd" else None, content,
                           group if caps.hardlinks else None)
        return result

    def test_round_trip_of_a_nasty_tree(self, conformance_target, tmp_path):
        src = self._nasty(conformance_target, tmp_path)
        back = self._round_trip(conformance_target, src, tmp_path, "nasty")
        caps = conformance_target.transport.capabilities
        assert self._expected(snapshot(back), caps) == self._expected(snapshot(src), caps)

    def test_listing_sees_what_was_pushed(self, conformance_target, tmp_path):
        src = self._nasty(conformance_target, tmp_path)
        remote = os.path.join(conformance_target.remote_root, "listed")
        conformance_target.transport.mkdir(remote)
        items = self._items(src, conformance_target.transport.capabilities)
        conformance_target.transport.transfer(Direction.PUSH, src, remote, items)
        listed = {e.path: e for e in conformance_target.transport.list(remote)}
        assert set(listed) == set(items)
        big = listed["big.bin"]
        assert big.kind == "f" and big.size == os.path.getsize(os.path.join(src, "big.bin"))
        assert conformance_target.transport.stat(os.path.join(remote, "big.bin")).size == big.size
        assert conformance_target.transport.stat(os.path.join(remote, "no-such-file")) is None

    def test_missing_source_item_fails_alone(self, conformance_target, tmp_path):
        src = tmp_path / "src"
        src.mkdir()
        (src / "present.txt").write_bytes(b"here")
        remote = os.path.join(conformance_target.remote_root, "missing")
        conformance_target.transport.mkdir(remote)
        result = conformance_target.transport.transfer(Direction.PUSH, str(src), remote, ["present.txt", "absent.txt"])
        assert result.done == ["present.txt"] and list(result.failed) == ["absent.txt"]
        assert "absent.txt" in str(result.failed["absent.txt"]) or result.failed["absent.txt"].path

    def test_existing_destination_is_replaced(self, conformance_target, tmp_path):
        src = tmp_path / "src"
        src.mkdir()
        (src / "f.txt").write_bytes(b"old content, longer")
        remote = os.path.join(conformance_target.remote_root, "replace")
        conformance_target.transport.mkdir(remote)
        conformance_target.transport.transfer(Direction.PUSH, str(src), remote, ["f.txt"])
        (src / "f.txt").write_bytes(b"new")
        os.utime(src / "f.txt", ns=(MTIME_NS + 10**9, MTIME_NS + 10**9))
        conformance_target.transport.transfer(Direction.PUSH, str(src), remote, ["f.txt"])
        back = tmp_path / "back"
        conformance_target.transport.transfer(Direction.PULL, str(back), remote, ["f.txt"])
        assert (back / "f.txt").read_bytes() == b"new"

    def test_unicode_and_awkward_names(self, conformance_target, tmp_path):
        src = tmp_path / "src"
        names = ["ünïcødé.txt", "日本語/ファイル.csv", "-dash", "with space", "semi;colon", "quote'and\"double"]
        transport = conformance_target.transport
        crossing = [name for name in names if name_crosses(name, transport.capabilities.names)]
        for n, name in enumerate(crossing):
            path = src / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"%d" % n)
        back = self._round_trip(conformance_target, str(src), tmp_path, "unicode")
        for n, name in enumerate(crossing):
            assert (tmp_path / "unicode-back" / name).read_bytes() == b"%d" % n
        assert os.path.isdir(back)
        refused = [name for name in names if name not in crossing]     # must fail, never be renamed
        for name in refused:
            (tmp_path / "odd" / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "odd" / name).write_bytes(b"odd")
        if refused:
            result = transport.transfer(Direction.PUSH, str(tmp_path / "odd"), conformance_target.remote_root, refused)
            assert result.done == [] and all(isinstance(result.failed[n], NotSupportedError) for n in refused)

    def test_whole_tree_with_items_none(self, conformance_target, tmp_path):
        src = self._nasty(conformance_target, tmp_path)
        remote = os.path.join(conformance_target.remote_root, "whole")
        conformance_target.transport.mkdir(remote)
        assert conformance_target.transport.transfer(Direction.PUSH, src, remote, None).ok
        back = tmp_path / "whole-back"
        assert conformance_target.transport.transfer(Direction.PULL, str(back), remote, None).ok
        caps = conformance_target.transport.capabilities
        assert self._expected(snapshot(back), caps) == self._expected(snapshot(src), caps)

    def test_ten_thousand_files_in_one_batch(self, conformance_target, tmp_path):
        src = tmp_path / "src"
        for n in range(10_000):
            path = src / f"d{n // 500:02d}" / f"f{n:05d}"
            if n % 500 == 0:
                path.parent.mkdir(parents=True)
            path.write_bytes(b"%d\n" % n)
        remote = os.path.join(conformance_target.remote_root, "many")
        conformance_target.transport.mkdir(remote)
        items = tree_items(str(src))
        result = conformance_target.transport.transfer(Direction.PUSH, str(src), remote, items)
        assert result.ok and len(result.done) == len(items)
        listed = [e for e in conformance_target.transport.list(remote) if e.kind == "f"]
        assert len(listed) == 10_000

    def test_capabilities_are_honest_about_remote_commands(self, conformance_target):
        transport = conformance_target.transport
        if transport.capabilities.remote_exec:
            assert transport.run(["echo", "pallet"]).strip() == b"pallet"
        else:
            with pytest.raises(NotSupportedError):
                transport.run(["echo", "pallet"])
