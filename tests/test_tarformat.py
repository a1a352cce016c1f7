"""Unit tests of the member header writer against Python's independent tar reader."""
from __future__ import annotations

import io
import tarfile

import pytest

from bundles.tarformat import BLOCK, Kind, member_header


def read_header(header: bytes, data_size: int = 0) -> tarfile.TarInfo:
    stream = io.BytesIO(header + bytes(data_size + -data_size % BLOCK) + bytes(2 * BLOCK))
    with tarfile.open(fileobj=stream, mode="r:") as archive:
        return archive.next()


def test_sizes_beyond_8_gib_use_a_pax_size_record():
    size = 9 * 1024**3 + 7
    header = member_header(b"huge.bin", Kind.FILE, 0o644, 1_700_000_000_000_000_000, size, b"")
    assert b" size=%d\n" % size in header
    stream = io.BytesIO(header)
    info = tarfile.TarInfo.frombuf(header[-BLOCK:], "utf-8", "surrogateescape")
    assert info.size == 0                     # the ustar field defers to the pax record
    pax = tarfile.TarInfo.frombuf(stream.read(BLOCK), "utf-8", "surrogateescape")
    assert pax.type == tarfile.XHDTYPE


def test_size_just_below_the_ustar_limit_needs_no_pax():
    header = member_header(b"f", Kind.FILE, 0o644, 5_000_000_000, 8**11 - 1, b"")
    assert len(header) == BLOCK


@pytest.mark.parametrize("mtime_ns,format_2,format_1", [
    (1_700_000_000_000_000_000, 1_700_000_000, 1_700_000_000),
    (1_700_000_000_123_456_789, 1_700_000_000, 1_700_000_000.123456789),
    (-5_500_000_000, -5.5, -5.5),                       # out of ustar's range: a pax record in both formats
    (2**34 * 1_000_000_000, 2**34, 2**34),
    (2**34 * 1_000_000_000 + 7, 2**34 + 7e-9, 2**34 + 7e-9),
])
def test_mtimes_round_trip_through_tarfile(mtime_ns, format_2, format_1):
    """Format 2 cuts an mtime ustar can hold to its whole seconds; format 1 kept its nanoseconds in pax."""
    for nanoseconds, expected in ((False, format_2), (True, format_1)):
        info = read_header(member_header(b"f", Kind.FILE, 0o640, mtime_ns, 3, b"", nanoseconds), 3)
        assert info.mtime == pytest.approx(expected, abs=1e-6)
        assert info.mode == 0o640 and info.size == 3


def test_format_2_writes_one_ustar_block_where_ustar_holds_every_value():
    for kind, link in ((Kind.FILE, b""), (Kind.DIR, b""), (Kind.SYMLINK, b"target"), (Kind.HARDLINK, b"lead")):
        header = member_header(b"entry", kind, 0o755, 1_700_000_000_999_999_999, 0, link)
        assert len(header) == BLOCK and header[257:263] == b"ustar\0"
        assert len(member_header(b"entry", kind, 0o755, 1_700_000_000_999_999_999, 0, link, True)) == 3 * BLOCK


@pytest.mark.parametrize("path", [b"a" * 100, b"d" * 150 + b"/" + b"f" * 100, b"x/" * 200 + b"end",
                                  "ünï/日本.txt".encode(), b"bad\xffname" * 30])
def test_long_and_non_ascii_paths(path):
    info = read_header(member_header(path, Kind.FILE, 0o644, 0, 0, b""))
    assert info.name.encode("utf-8", "surrogateescape") == path


def test_directories_get_a_trailing_slash_and_links_keep_long_targets():
    info = read_header(member_header(b"dir", Kind.DIR, 0o755, 0, 0, b""))
    assert info.isdir() and info.name == "dir"
    target = b"../" * 60 + b"target"
    link = read_header(member_header(b"l", Kind.SYMLINK, 0o777, 0, 0, target))
    assert link.issym() and link.linkname.encode() == target
    hard = read_header(member_header(b"h", Kind.HARDLINK, 0o644, 0, 0, b"leader"))
    assert hard.islnk() and hard.linkname == "leader"


def test_headers_are_blocks_with_valid_checksums():
    header = member_header(b"f", Kind.FILE, 0o644, 1_700_000_000_5, 10, b"", True)
    assert len(header) == 3 * BLOCK           # pax header, its records, the ustar header
    for block in (header[:BLOCK], header[-BLOCK:]):
        stored = int(block[148:154], 8)
        assert stored == sum(block[:148]) + 8 * 32 + sum(block[156:])
