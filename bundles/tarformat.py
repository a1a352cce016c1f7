"""Byte-exact ustar/pax member headers of both bundle formats: the one writer and checker of tar headers in pallet."""
from __future__ import annotations

from enum import IntEnum
from functools import lru_cache

BLOCK = 512
END_OF_ARCHIVE = bytes(2 * BLOCK)
_MAX_OCTAL_11 = 8**11 - 1          # largest value of a 12-byte ustar numeric field
_PAX_NAME = b"././@PaxHeader"
_ZEROS = bytes(BLOCK)
_TYPEFLAG = {0: b"0", 1: b"5", 2: b"2", 3: b"1"}


class Kind(IntEnum):
    """Entry types a bundle may hold (values are stored in the index)."""

    FILE = 0
    DIR = 1
    SYMLINK = 2
    HARDLINK = 3


def padding(size: int) -> int:
    """Bytes of zero padding that follow ``size`` bytes of member data."""
    return -size % BLOCK


def _pax_record(key: bytes, value: bytes) -> bytes:
    body = b" " + key + b"=" + value + b"\n"
    length = len(body) + 1
    while len(b"%d" % length) + len(body) != length:
        length += 1
    return b"%d" % length + body


def _split_ustar_name(name: bytes) -> tuple[bytes, bytes] | None:
    """Return (prefix, name) fitting the ustar fields, or None if impossible."""
    if len(name) <= 100:
        return b"", name
    if len(name) > 256:
        return None
    cut = name.find(b"/", max(0, len(name) - 101))
    while cut != -1 and cut <= 155:
        if len(name) - cut - 1 <= 100 and cut > 0:
            return name[:cut], name[cut + 1:]
        cut = name.find(b"/", cut + 1)
    return None


def _mtime_record(mtime_ns: int, seconds: int, nanos: int) -> bytes:
    if 0 <= seconds < 10**12:           # fast path: the record's length has two digits
        body = b" mtime=%d.%09d\n" % (seconds, nanos)
        return b"%d" % (len(body) + 2) + body
    return _pax_record(b"mtime", _format_mtime(mtime_ns))


def _format_mtime(mtime_ns: int) -> bytes:
    sign = b"-" if mtime_ns < 0 else b""
    seconds, nanos = divmod(abs(mtime_ns), 1_000_000_000)
    return sign + b"%d.%09d" % (seconds, nanos)


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


_IDS = b"0000000\0" * 2                                  # uid and gid 0
_BLANK_CHECKSUM = b" " * 8
_TAIL = b"ustar\x0000" + bytes(64) + b"0000000\0" * 2    # magic, version, names, device numbers
_CONSTANT_SUM = sum(_BLANK_CHECKSUM) + sum(_TAIL)


def _ustar_block(name: bytes, prefix: bytes, mode: int, size: int, mtime: int,
                 typeflag: bytes, link: bytes) -> bytes:
    numbers = b"%07o\0" % mode + _IDS + b"%011o\0%011o\0" % (size, mtime)
    checksum = _CONSTANT_SUM + sum(name) + sum(numbers) + typeflag[0] + sum(link) + sum(prefix)
    return b"".join((name.ljust(100, b"\0"), numbers, b"%06o\0 " % checksum, typeflag, link.ljust(100, b"\0"),
                     _TAIL, prefix.ljust(155, b"\0"), bytes(12)))


@lru_cache(maxsize=256)
def _pax_block(payload_size: int) -> bytes:
    return _ustar_block(_PAX_NAME, b"", 0o644, payload_size, 0, b"x", b"")


_FAST_MTIME_LIMIT = (_MAX_OCTAL_11 + 1) * 1_000_000_000     # the ustar mtime field holds it


_FILE_SUM = _CONSTANT_SUM + ord("0")                      # a regular file: typeflag "0", no link, no prefix
_FILE_BLOCK_END = bytes(100) + _TAIL + bytes(155 + 12)    # link name, magic .. device numbers, prefix, padding


def _plain_file_header(path: bytes, mode: int, mtime_ns: int, size: int, nanoseconds: bool) -> bytes:
    """The common case of member_header: a short name, a regular file, an mtime after 1970 (the same bytes as
    ``_ustar_block(path, b"", mode & 0o7777, size, seconds, b"0", b"")``, built with fewer steps: every tar
    member pallet packs, unpacks or verifies goes through here)."""
    seconds, nanos = divmod(mtime_ns, 1_000_000_000)
    numbers = b"%07o\0" % (mode & 0o7777) + _IDS + b"%011o\0%011o\0" % (size, seconds)
    ustar = b"".join((path.ljust(100, b"\0"), numbers, b"%06o\0 0" % (_FILE_SUM + sum(path) + sum(numbers)),
                      _FILE_BLOCK_END))
    if not nanos or not nanoseconds:
        return ustar
    body = b" mtime=%d.%09d\n" % (seconds, nanos)
    record = b"%d" % (len(body) + 2) + body
    if not path.isascii() and not _is_utf8(path):
        record = _pax_record(b"hdrcharset", b"BINARY") + record
    return b"".join((_pax_block(len(record)), record, _ZEROS[:-len(record) % BLOCK], ustar))


def member_header(path: bytes, kind: int, mode: int, mtime_ns: int, size: int, link: bytes,
                  nanoseconds: bool = False) -> bytes:
    """Return the header bytes (pax extended header if needed, then ustar) of one member.

    ``path`` is relative, without a trailing slash; directories get one. Owner
    and group are always 0 with empty names, so the bytes depend only on the
    arguments. A pax header carries whatever ustar cannot: out-of-range
    mtimes, sizes of 8 GiB and more, long paths and link targets. An mtime
    ustar can hold is written as its whole seconds (bundle format 2: the
    index keeps the nanoseconds), or, with ``nanoseconds`` (format 1), with a
    pax ``mtime`` record whenever it has a fraction of a second. Data of
    ``size`` bytes (files only) and its padding follow the header.
    """
    if kind == 0 and len(path) <= 100 and size <= _MAX_OCTAL_11 and 0 <= mtime_ns < _FAST_MTIME_LIMIT:
        return _plain_file_header(path, mode, mtime_ns, size, nanoseconds)
    name = path + b"/" if kind == 1 else path       # Kind.DIR
    data_size = size if kind == 0 else 0             # Kind.FILE
    records = []
    if len(name) <= 100:
        prefix = b""
    else:
        split = _split_ustar_name(name)
        if split is None:
            records.append(_pax_record(b"path", name))
            split = (b"", name[-100:].lstrip(b"/") if _is_utf8(name) else b"@PaxPath")
        prefix, name = split
    if len(link) > 100:
        records.append(_pax_record(b"linkpath", link))
    seconds, nanos = divmod(mtime_ns, 1_000_000_000)
    if not 0 <= seconds <= _MAX_OCTAL_11 or nanos and nanoseconds:
        records.append(_mtime_record(mtime_ns, seconds, nanos))
        seconds = min(max(seconds, 0), _MAX_OCTAL_11)
    if data_size > _MAX_OCTAL_11:
        records.append(_pax_record(b"size", b"%d" % data_size))
    ustar = _ustar_block(name, prefix, mode & 0o7777, 0 if data_size > _MAX_OCTAL_11 else data_size,
                         seconds, _TYPEFLAG[kind], link[:100])
    if not records:
        return ustar
    if not (path.isascii() and link.isascii()) and not (_is_utf8(path) and _is_utf8(link)):
        records.insert(0, _pax_record(b"hdrcharset", b"BINARY"))
    payload = b"".join(records)
    return b"".join((_pax_block(len(payload)), payload, _ZEROS[:-len(payload) % BLOCK], ustar))

