"""Byte-exact pax/ustar member headers: the one writer and checker of tar headers in pallet."""
from __future__ import annotations

from enum import IntEnum

BLOCK = 512
END_OF_ARCHIVE = bytes(2 * BLOCK)
_MAX_OCTAL_11 = 8**11 - 1          # largest value of a 12-byte ustar numeric field
_PAX_NAME = b"././@PaxHeader"
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


def _octal(value: int, width: int) -> bytes:
    return b"%0*o\0" % (width - 1, value)


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


def _ustar_block(name: bytes, prefix: bytes, mode: int, size: int, mtime: int,
                 typeflag: bytes, link: bytes) -> bytes:
    head = (name.ljust(100, b"\0") + _octal(mode, 8) + _octal(0, 8) + _octal(0, 8)
            + _octal(size, 12) + _octal(mtime, 12))
    tail = (typeflag + link.ljust(100, b"\0") + b"ustar\x0000" + bytes(64)
            + _octal(0, 8) + _octal(0, 8) + prefix.ljust(155, b"\0") + bytes(12))
    checksum = sum(head) + sum(tail) + 8 * 32
    return head + b"%06o\0 " % checksum + tail


def member_header(path: bytes, kind: int, mode: int, mtime_ns: int, size: int, link: bytes) -> bytes:
    """Return the header bytes (pax extended header if needed, then ustar) of one member.

    ``path`` is relative, without a trailing slash; directories get one. Owner
    and group are always 0 with empty names, so the bytes depend only on the
    arguments. A pax header carries whatever ustar cannot: sub-second or
    out-of-range mtimes, sizes of 8 GiB and more, long paths and link targets.
    Data of ``size`` bytes (files only) and its padding follow the header.
    """
    name = path + b"/" if kind == Kind.DIR else path
    data_size = size if kind == Kind.FILE else 0
    records = []
    split = _split_ustar_name(name)
    if split is None:
        records.append(_pax_record(b"path", name))
        split = (b"", name[-100:].lstrip(b"/") if _is_utf8(name) else b"@PaxPath")
    if len(link) > 100:
        records.append(_pax_record(b"linkpath", link))
    seconds, nanos = divmod(mtime_ns, 1_000_000_000)
    if nanos or not 0 <= seconds <= _MAX_OCTAL_11:
        records.append(_pax_record(b"mtime", _format_mtime(mtime_ns)))
        seconds = min(max(seconds, 0), _MAX_OCTAL_11)
    if data_size > _MAX_OCTAL_11:
        records.append(_pax_record(b"size", b"%d" % data_size))
    if any(not _is_utf8(v) for v in (name, link)) and records:
        records.insert(0, _pax_record(b"hdrcharset", b"BINARY"))
    ustar = _ustar_block(split[1], split[0], mode & 0o7777, 0 if data_size > _MAX_OCTAL_11 else data_size,
                         seconds, _TYPEFLAG[kind], link if len(link) <= 100 else link[:100])
    if not records:
        return ustar
    payload = b"".join(records)
    pax = _ustar_block(_PAX_NAME, b"", 0o644, len(payload), 0, b"x", b"")
    return pax + payload + bytes(padding(len(payload))) + ustar
