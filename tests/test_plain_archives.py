"""Plain archives written by GNU tar unpack as GNU tar extracts them, with either engine; damaged ones fail
in one line."""
from __future__ import annotations

import io
import os
import subprocess
import tarfile
import threading

import pytest

from bundles import PalletError, unpack

from staging_core.testing import assert_same_tree
from tests.conftest import run_pallet

# the shared tests of both engines (see tests/test_native_parity.py)
pytestmark = pytest.mark.usefixtures("each_engine")

WHOLE_SECOND_NS = 1_700_000_000 * 10**9   # what every tar format stores exactly
LONG_PATH = os.path.join("p" * 60, "q" * 60, "r" * 20 + ".txt")      # 143 bytes: prefix field, L or pax header


def _tree(root) -> str:
    """Files, directories and links in the shapes that take every path of the reader: hundreds of small files
    (native runs), sizes that cross the window and its refills, long and non-UTF-8 names, links."""
    def write(rel, data: bytes, mode: int = 0o644):
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(data)
        os.chmod(path, mode)

    for n in range(300):
        write(os.path.join(f"many{n % 3}", f"f{n:03d}"), os.urandom(n * 7))
    write("big/nine_mib.bin", os.urandom(9 << 20))            # data beyond one run: streamed in chunks
    write("big/one_and_a_half_mib.bin", os.urandom(3 << 19))  # a run refills its window for it
    write("empty", b"")
    write("tool.sh", b"#!/bin/sh\n", 0o755)
    write(LONG_PATH, b"long path")
    write(os.fsdecode(b"bad\xffname"), b"not utf-8")
    os.makedirs(os.path.join(root, "empty_dir"))
    os.symlink("../tool.sh", os.path.join(root, "many0", "link"))
    os.link(os.path.join(root, "many1", "f001"), os.path.join(root, "many2", "hard"))
    for current, dirs, files in os.walk(root, topdown=False):
        for name in files + dirs:
            os.utime(os.path.join(current, name), ns=(WHOLE_SECOND_NS, WHOLE_SECOND_NS), follow_symlinks=False)
    os.chmod(os.path.join(root, "empty_dir"), 0o555)
    return root


def _gnu_tar(tree, archive, fmt: str, *extra: str) -> None:
    subprocess.run(["tar", f"--format={fmt}", *extra, "-cf", str(archive), "-C", str(tree), "."], check=True)


@pytest.mark.parametrize("fmt", ["gnu", "posix", "ustar"])
def test_an_archive_of_gnu_tar_unpacks_as_gnu_tar_extracts_it(tmp_path, fmt):
    tree = _tree(str(tmp_path / "src"))
    archive = tmp_path / "a.tar.zst"
    _gnu_tar(tree, archive, fmt, "--zstd")
    (tmp_path / "by-tar").mkdir()
    subprocess.run(["tar", "--zstd", "-xf", str(archive), "-C", str(tmp_path / "by-tar")], check=True)
    done = run_pallet("unpack", "--quiet", str(archive), str(tmp_path / "by-pallet"))
    assert done.returncode == 0, done.stderr
    assert_same_tree(tmp_path / "by-tar", tmp_path / "by-pallet")
    assert_same_tree(tree, tmp_path / "by-pallet")


def test_a_global_pax_header_reaches_every_member(tmp_path):
    """A global header changes how members read, so no member is written before it is applied."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"mtime": "1600000000.5"}) as tar:
        for n in range(20):
            info = tarfile.TarInfo(f"d/f{n}")
            info.size, info.mtime = 1, 1_700_000_000
            tar.addfile(info, io.BytesIO(b"x"))
    (tmp_path / "g.tar").write_bytes(raw.getvalue())
    done = run_pallet("unpack", "--quiet", str(tmp_path / "g.tar"), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert {os.stat(tmp_path / "out" / "d" / f"f{n}").st_mtime_ns for n in range(20)} == {1_600_000_000_500_000_000}


def _one_line_failure(archive, dest, *needles: str) -> str:
    done = run_pallet("unpack", str(archive), str(dest))
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) <= 2, done.stderr
    for needle in needles:
        assert needle in done.stderr, done.stderr
    return done.stderr


def test_an_archive_cut_inside_a_run_of_small_files_is_truncated(tmp_path):
    tree = _tree(str(tmp_path / "src"))
    _gnu_tar(tree, tmp_path / "whole.tar", "gnu")
    data = (tmp_path / "whole.tar").read_bytes()
    cut = data.index(b"many1/f100") + 700            # inside a file's data, amid small files
    (tmp_path / "cut.tar").write_bytes(data[:cut])
    _one_line_failure(tmp_path / "cut.tar", tmp_path / "out", "truncated")


def _header(name: bytes, typeflag: bytes, size: int) -> bytes:
    info = tarfile.TarInfo(os.fsdecode(name))
    info.type, info.size = typeflag, size
    return info.tobuf(tarfile.GNU_FORMAT)


def test_headers_longer_than_pallet_reads_are_refused(tmp_path):
    """A GNU long-name header claiming 2 MiB is not held in memory."""
    name = b"n" * (2 << 20)
    archive = _header(b"././@LongLink", tarfile.GNUTYPE_LONGNAME, len(name))[:512] + name + bytes(1024)
    (tmp_path / "long.tar").write_bytes(archive)
    _one_line_failure(tmp_path / "long.tar", tmp_path / "out", "longer than pallet reads")
    assert not (tmp_path / "out" / "n").exists()


def test_a_chain_of_extended_headers_is_refused_in_one_line(tmp_path):
    record = b"19 comment=chained\n"
    header = tarfile.TarInfo("x")
    header.type, header.size = tarfile.XHDTYPE, len(record)
    link = header.tobuf(tarfile.USTAR_FORMAT) + record.ljust(512, b"\0")
    (tmp_path / "chain.tar").write_bytes(_header(b"first", tarfile.REGTYPE, 0) + link * 600 + bytes(1024))
    _one_line_failure(tmp_path / "chain.tar", tmp_path / "out", "damaged")


@pytest.mark.parametrize("fmt", ["gnu", "posix"])
def test_a_sparse_member_is_refused_by_name(tmp_path, fmt):
    (tmp_path / "src").mkdir()
    with open(tmp_path / "src" / "holes", "wb") as handle:
        handle.truncate(4 << 20)
        handle.write(b"start")
    (tmp_path / "src" / "plain.txt").write_bytes(b"fine")
    _gnu_tar(tmp_path / "src", tmp_path / "s.tar", fmt, "--sparse")
    done = run_pallet("unpack", str(tmp_path / "s.tar"), str(tmp_path / "out"))
    assert done.returncode == 1 and "refusing to extract 1 unsafe member" in done.stderr, done.stderr
    assert "'./holes'" in done.stderr and "sparse file" in done.stderr and "Traceback" not in done.stderr
    assert (tmp_path / "out" / "plain.txt").read_bytes() == b"fine"
    assert not (tmp_path / "out" / "holes").exists()


@pytest.mark.parametrize("order, needle", [(("dir", "file"), "is a directory in the destination"),
                                           (("file", "dir"), "through a non-directory")])
def test_a_name_that_is_both_file_and_directory_fails_naming_it(tmp_path, order, needle):
    members = {"dir": _header(b"x/", tarfile.DIRTYPE, 0), "file": _header(b"x", tarfile.REGTYPE, 3) + b"abc"}
    body = b"".join(members[kind].ljust(512 * (1 + (kind == "file")), b"\0") for kind in order)
    (tmp_path / "both.tar").write_bytes(_header(b"before", tarfile.REGTYPE, 0) + body + bytes(1024))
    stderr = _one_line_failure(tmp_path / "both.tar", tmp_path / "out", needle)
    assert os.path.join("out", "x") in stderr


def test_damage_found_by_the_read_ahead_thread_fails_in_one_line_and_stops_it(tmp_path):
    """The decoder runs in its own thread: its error reaches the user as pallet's, and the thread ends."""
    tree = _tree(str(tmp_path / "src"))
    _gnu_tar(tree, tmp_path / "a.tar.zst", "gnu", "--zstd")
    data = bytearray((tmp_path / "a.tar.zst").read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(64)
    (tmp_path / "bad.tar.zst").write_bytes(bytes(data))
    _one_line_failure(tmp_path / "bad.tar.zst", tmp_path / "out", "bad.tar.zst")
    with pytest.raises(PalletError):
        unpack(tmp_path / "bad.tar.zst", tmp_path / "in-process")
    assert not [t for t in threading.enumerate() if t.name == "pallet-plain-decode"]
