"""Plain archives written by GNU tar unpack as GNU tar extracts them, with either engine; damaged ones fail
in one line."""
from __future__ import annotations

import io
import os
import subprocess
import tarfile
import threading

import pytest
import zstandard

from bundles import PalletError, pax_check, unpack

from staging_core.testing import assert_same_tree, normalize_groups, snapshot
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


@pytest.mark.parametrize("order, needle", [(("dir", "file"), "is a directory in the destination")])
def test_a_file_over_an_extracted_directory_fails_naming_it(tmp_path, order, needle):
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


def _raw_header(name: bytes, typeflag: bytes, size: int = 0, size_field: bytes | None = None) -> bytes:
    """A ustar header written byte by byte, so fields tarfile would not write (negative sizes) can be set."""
    block = bytearray(512)
    block[:len(name)], block[100:108], block[108:124] = name, b"0000644\0", b"0000000\0" * 2
    block[124:136] = size_field or b"%011o\0" % size
    block[136:148], block[156:157], block[257:265] = b"13576543200\0", typeflag, b"ustar\x0000"
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


def _padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def test_a_negative_extended_header_size_cannot_hide_members(tmp_path):
    """A pax header of negative (base-256) size must not move the reader past members to bytes after the
    end-of-archive blocks."""
    visible = _raw_header(b"a", b"0", 5) + _padded(b"hello") + bytes(1024)
    hidden = _raw_header(b"evil", b"0", 9) + _padded(b"EVIL DATA") + bytes(1024)
    negative = -(512 + len(hidden))
    pax = _raw_header(b"././@PaxHeader", b"x", size_field=b"\xff" + (negative % 256 ** 11).to_bytes(11, "big"))
    (tmp_path / "neg.tar").write_bytes(pax + _padded(b"15 path=evil1\n") + visible + hidden)
    _one_line_failure(tmp_path / "neg.tar", tmp_path / "out", "negative")
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


@pytest.mark.parametrize("mtime", ["inf", "nan", "1e30", "-1e30"])
def test_a_modification_time_no_file_can_have_is_refused_by_name(tmp_path, mtime):
    record = f" mtime={mtime}\n".encode()
    record = str(len(record) + len(str(len(record) + 2))).encode() + record
    members = (_raw_header(b"./PaxHeaders/bad", b"x", len(record)) + _padded(record) + _raw_header(b"bad", b"0", 2)
               + _padded(b"no") + _raw_header(b"good", b"0", 3) + _padded(b"yes"))
    (tmp_path / "t.tar").write_bytes(members + bytes(1024))
    done = run_pallet("unpack", str(tmp_path / "t.tar"), str(tmp_path / "out"))
    assert done.returncode == 1 and "'bad': modification time out of range" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "defect" not in done.stderr
    assert sorted(os.listdir(tmp_path / "out")) == [".pallet", "good"]      # .pallet: marked incomplete


DIGITS_RECORD = b"100000 comment=" + b"1" * 99_984 + b"\n"


@pytest.mark.parametrize("body", [b"2 " * 20_000 + b"=", b"1 hdrcharset=" * 8_000, DIGITS_RECORD * 2],
                         ids=["no-equals", "hdrcharset", "digit-runs"])
def test_pax_records_tarfile_would_parse_in_quadratic_time_are_refused(tmp_path, body):
    """tarfile's pax regexes take quadratic time and memory on these (CVE-2024-6232 on older Pythons)."""
    (tmp_path / "d.tar").write_bytes(_raw_header(b"x", b"x", len(body)) + _padded(body)
                                     + _raw_header(b"a", b"0", 1) + _padded(b"a") + bytes(1024))
    _one_line_failure(tmp_path / "d.tar", tmp_path / "out", "pax header", "malformed")


def _python_tar(path, members, **options) -> None:
    """Members (name, type, data or link target) written by Python's tarfile, in order."""
    with tarfile.open(path, "w", **options) as archive:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            info.type, info.mtime, info.mode = kind, 1_700_000_000, 0o644
            if kind == tarfile.REGTYPE:
                info.size = len(payload)
                archive.addfile(info, io.BytesIO(payload))
            else:
                info.linkname = payload if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
                info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o777
                archive.addfile(info)


def _as_gnu_tar_extracts(tmp_path, archive) -> None:
    """pallet's tree is GNU tar's, strictly, but for the mtimes of directories the archive does not list (each
    tool makes those when it extracts)."""
    (tmp_path / "by-tar").mkdir()
    subprocess.run(["tar", "-xf", str(archive), "-C", str(tmp_path / "by-tar")], check=True)
    done = run_pallet("unpack", "--quiet", str(archive), str(tmp_path / "by-pallet"))
    assert done.returncode == 0, done.stderr
    with tarfile.open(archive) as listing:
        listed = {os.fsencode(os.path.normpath(name)) for name in listing.getnames()}
    trees = [normalize_groups(snapshot(tmp_path / tool)) for tool in ("by-tar", "by-pallet")]
    for tree in trees:
        for rel, value in tree.items():
            if value[0] == "d" and rel not in listed:
                tree[rel] = value[:2] + (None,) + value[3:]
    assert trees[0] == trees[1]


def test_long_digit_names_and_xattrs_in_pax_headers_are_read(tmp_path):
    _python_tar(tmp_path / "p.tar", [("d", tarfile.DIRTYPE, ""),
                                     ("d/" + "x" * 40 + "/" + "1" * 200, tarfile.REGTYPE, b"a"),
                                     ("d/é" + "1" * 65, tarfile.REGTYPE, b"b")],
                format=tarfile.PAX_FORMAT, pax_headers={"SCHILY.xattr.user.n": "1" * 300})
    _as_gnu_tar_extracts(tmp_path, tmp_path / "p.tar")


S, F, L, D = tarfile.SYMTYPE, tarfile.REGTYPE, tarfile.LNKTYPE, tarfile.DIRTYPE


@pytest.mark.parametrize("members", [
    [("s", S, "t"), ("s", F, b"AAA"), ("h", L, "s"), ("s", F, b"BBB")],             # h is the AAA file
    [("f", F, b"hi"), ("f", L, "f")],                                               # a file archived twice
    [("d", S, "sub"), ("d", D, ""), ("d/x", F, b"in d")],                            # a directory replaces a link
    [("f", F, b"file"), ("f", D, ""), ("f/x", F, b"in f")],                          # a directory replaces a file
    [("a/b/f", F, b"no directory members")],                                        # parents made as mkdir -p
], ids=["hard-link-when-read", "self-link", "dir-over-symlink", "dir-over-file", "implicit-parents"])
def test_member_sequences_end_as_gnu_tar_leaves_them(tmp_path, members):
    _python_tar(tmp_path / "seq.tar", members)
    _as_gnu_tar_extracts(tmp_path, tmp_path / "seq.tar")


def test_a_symlink_over_an_extracted_directory_is_refused_and_directory_modes_still_set(tmp_path):
    _python_tar(tmp_path / "ds.tar", [("ro", D, ""), ("d", D, ""), ("d", S, "ro")])
    done = run_pallet("unpack", str(tmp_path / "ds.tar"), str(tmp_path / "out"))
    assert done.returncode == 1 and "'d': a directory of that name is in the destination" in done.stderr, done.stderr
    assert os.stat(tmp_path / "out" / "ro").st_mode & 0o777 == 0o755


def test_members_appended_later_replace_earlier_links_as_gnu_tar_does(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("original")
    os.link(src / "f", src / "h")
    os.symlink("f", src / "s")
    _gnu_tar(src, tmp_path / "upd.tar", "gnu")
    for name in ("h", "s"):
        os.unlink(src / name)
        (src / name).write_text(f"updated {name}")
    subprocess.run(["tar", "-rf", str(tmp_path / "upd.tar"), "-C", str(src), "./h", "./s"], check=True)
    (tmp_path / "by-tar").mkdir()
    subprocess.run(["tar", "-xf", str(tmp_path / "upd.tar"), "-C", str(tmp_path / "by-tar")], check=True)
    done = run_pallet("unpack", "--quiet", str(tmp_path / "upd.tar"), str(tmp_path / "by-pallet"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "by-pallet" / "h").read_text() == "updated h" and not os.path.islink(tmp_path / "by-pallet/s")
    assert_same_tree(tmp_path / "by-tar", tmp_path / "by-pallet")


def test_a_volume_label_is_skipped_and_an_incremental_archive_refused(tmp_path):
    (tmp_path / "src" / "d").mkdir(parents=True)
    (tmp_path / "src" / "d" / "f").write_text("in d")
    subprocess.run(["tar", "-V", "LABEL", "-cf", str(tmp_path / "v.tar"), "-C", str(tmp_path / "src"), "d"], check=True)
    done = run_pallet("unpack", "--quiet", str(tmp_path / "v.tar"), str(tmp_path / "v"))
    assert done.returncode == 0 and sorted(os.listdir(tmp_path / "v")) == ["d"], done.stderr
    subprocess.run(["tar", "--format=gnu", "-G", "-cf", str(tmp_path / "g.tar"), "-C", str(tmp_path / "src"), "d/f"],
                   check=True)
    _one_line_failure(tmp_path / "g.tar", tmp_path / "g", "GNU incremental archive")


def test_a_file_shorter_than_one_header_is_not_a_tar_archive(tmp_path):
    (tmp_path / "short.tar").write_bytes(b"hello, not a tar")
    _one_line_failure(tmp_path / "short.tar", tmp_path / "out", "not a tar archive")


def test_members_across_decoded_chunks_are_written_or_refused_as_elsewhere(tmp_path):
    """12 MiB of small members: some straddle the decoder's 4 MiB chunks, those under a symlink among them."""
    members = [("s", S, "d"), ("d", D, ""), ("e", D, "")]             # 1,536 bytes: the files' members straddle
    members += [(f"d/f{n:05d}", F, bytes([n % 251]) * 1000) for n in range(5000)]
    members += [(f"s/x{n:05d}", F, b"through the link" * 60) for n in range(3000)]
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as archive:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            info.type, info.mtime = kind, 1_700_000_000
            info.mode = 0o755 if kind != F else 0o644
            if kind == F:
                info.size = len(payload)
            elif kind == S:
                info.linkname = payload
            archive.addfile(info, io.BytesIO(payload) if kind == F else None)
    (tmp_path / "many.tar.zst").write_bytes(zstandard.ZstdCompressor().compress(raw.getvalue()))
    done = run_pallet("unpack", str(tmp_path / "many.tar.zst"), str(tmp_path / "out"))
    assert done.returncode == 1 and "refusing to extract 3000 unsafe member(s)" in done.stderr, done.stderr[:500]
    written = sorted(os.listdir(tmp_path / "out" / "d"))
    assert written == [f"f{n:05d}" for n in range(5000)]
    assert all((tmp_path / "out" / "d" / name).read_bytes() == bytes([n % 251]) * 1000
               for n, name in enumerate(written))


def test_the_digit_budget_counts_only_long_runs_so_big_posix_archives_pass():
    """GNU tar's posix format writes three times per member (runs of 10 and 9 digits): those cost nothing, so an
    archive of any number of members stays within the budget; a run of 40 digits costs its square."""
    times = b"30 mtime=1795706646.183813051\n30 atime=1795706646.183813051\n30 ctime=1795706646.183813051\n"
    assert pax_check.framing_problem(times) is None and pax_check.digit_cost(times) == 0
    assert pax_check.digit_cost(b"58 path=" + b"7" * 40 + b"/" + b"8" * 8 + b"\n") == 1600


def test_an_archive_cut_inside_a_pax_header_is_truncated(tmp_path):
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as archive:
        info = tarfile.TarInfo("n" * 3000)
        info.size = 1
        archive.addfile(info, io.BytesIO(b"x"))
    (tmp_path / "cut.tar").write_bytes(raw.getvalue()[:512 + 1500])
    _one_line_failure(tmp_path / "cut.tar", tmp_path / "out", "truncated")
