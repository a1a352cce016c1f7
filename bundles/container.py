"""Where the index lives in a bundle file: an index section and a fixed-size locator at the end."""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from . import codecs
from .byte_source import ByteSource, pread_from
from .errors import BundleError, CorruptBundleError
from .index import FORMAT_VERSION, READABLE_FORMATS, content_hash

SIDECAR_SUFFIX = ".pidx"
_SKIPPABLE_MAGIC = 0x184D2A5A
_FRAME = struct.Struct("<II")
_LOCATOR = struct.Struct("<8sIQQ16s8s")      # magic, version, index offset, index length, hash, self-check
_LOCATOR_MAGIC = b"PALLETLC"
# Gzip member with an FEXTRA field "PX" carrying the locator and an empty deflate body.
_GZIP_LOCATOR_HEAD = (b"\x1f\x8b\x08\x04" + bytes(4) + b"\x00\xff"
                      + struct.pack("<H", 4 + _LOCATOR.size) + b"PX" + struct.pack("<H", _LOCATOR.size))
_GZIP_LOCATOR_TAIL = b"\x03\x00" + bytes(8)
_TAIL_SIZE = {"zstd": _FRAME.size + _LOCATOR.size, "none": _LOCATOR.size,
              "gzip": len(_GZIP_LOCATOR_HEAD) + _LOCATOR.size + len(_GZIP_LOCATOR_TAIL)}


@dataclass(frozen=True)
class Locator:
    """Position and hash of the stored index section; ``data_end`` is where shards end."""

    index_offset: int
    index_length: int
    index_hash: bytes

    @property
    def data_end(self) -> int:
        return self.index_offset


def index_section(codec_name: str, payload: bytes, offset: int, format_version: int = FORMAT_VERSION) -> bytes:
    """Return the bytes that follow the last shard: the wrapped index, then the locator (of bundle format
    ``format_version``, the index's own).

    zstd: two skippable frames (ignored by zstd and tar). gzip: a gzip member
    holding the index, stored (deflate level 0: it inflates to less than its
    stored size, which readers check), which decompresses to bytes after tar's
    end-of-archive that tar ignores, and an empty member whose FEXTRA field
    holds the locator. none: the index and the locator, raw, after
    end-of-archive.
    """
    if codec_name == "zstd":
        stored = _FRAME.pack(_SKIPPABLE_MAGIC, len(payload)) + payload
    elif codec_name == "gzip":
        deflate = zlib.compressobj(0, zlib.DEFLATED, 31)
        stored = deflate.compress(payload) + deflate.flush()
    else:
        stored = payload
    return located(codec_name, stored, offset, format_version)


def located(codec_name: str, stored: bytes, offset: int, format_version: int = FORMAT_VERSION) -> bytes:
    """``stored`` (an index section as stored, its frame or member included) followed by the locator that points
    to it at ``offset``."""
    check = _locator_bytes(Locator(offset, len(stored), content_hash(stored)), format_version)
    if codec_name == "zstd":
        tail = _FRAME.pack(_SKIPPABLE_MAGIC, len(check)) + check
    elif codec_name == "gzip":
        tail = _GZIP_LOCATOR_HEAD + check + _GZIP_LOCATOR_TAIL
    else:
        tail = check
    return stored + tail


def _locator_bytes(loc: Locator, format_version: int) -> bytes:
    body = _LOCATOR.pack(_LOCATOR_MAGIC, format_version, loc.index_offset, loc.index_length, loc.index_hash, bytes(8))
    return body[:-8] + content_hash(body[:-8])[:8]


def read_locator(fd: int | ByteSource, file_size: int, codec_name: str) -> Locator | None:
    """Return the locator at the end of the file, or None if there is none (a plain archive).

    The locator counts only inside exactly the wrapper ``index_section`` writes
    for ``codec_name``, so a damaged wrapper byte is not silently accepted.
    """
    tail_size = _TAIL_SIZE[codec_name]
    if file_size < tail_size:
        return None
    raw = _unwrap_locator(codec_name, pread_from(fd, tail_size, file_size - tail_size))
    if raw is None or not raw.startswith(_LOCATOR_MAGIC):
        return None
    _, version, offset, length, digest, check = _LOCATOR.unpack(raw)
    if content_hash(raw[:-8])[:8] != check:
        raise CorruptBundleError("the index locator at the end of the bundle is damaged", hint=_HINT)
    if version not in READABLE_FORMATS:
        raise BundleError(f"bundle format {version} is not supported (this pallet reads formats "
                          f"{READABLE_FORMATS[0]} to {READABLE_FORMATS[-1]})",
                          hint="upgrade pallet, or repack the data with this version")
    if offset + length + tail_size != file_size:
        raise CorruptBundleError("the index locator does not fit the file: the bundle is truncated, has bytes "
                                 "appended, or its end is damaged", hint=_HINT)
    return Locator(offset, length, digest)


def find_locator(fd: int | ByteSource, file_size: int) -> tuple[str, Locator] | None:
    """Return (codec name, locator) read from the shape of the file's end, or None for a plain archive.

    The codec is taken from the tail rather than from the first bytes, so
    damage at the start of the first shard is caught by that shard's hash
    instead of making the bundle look like another format.
    """
    for codec_name in ("zstd", "gzip", "none"):        # "none" has no wrapper: try it last
        locator = read_locator(fd, file_size, codec_name)
        if locator is not None:
            return codec_name, locator
    return None


def damaged_locator(fd: int | ByteSource, file_size: int) -> bool:
    """True when the file ends like a pallet locator whose wrapper or magic bytes are damaged.

    A plain archive's last bytes match neither the exact wrapper of any codec
    nor six of the eight magic bytes at the locator's place, so a bundle
    whose locator was hit is not mistaken for a plain archive.
    """
    for codec_name, tail_size in _TAIL_SIZE.items():
        if file_size < tail_size:
            continue
        tail = pread_from(fd, tail_size, file_size - tail_size)
        raw = _raw_locator_place(codec_name, tail)
        near_magic = sum(a != b for a, b in zip(raw[:len(_LOCATOR_MAGIC)], _LOCATOR_MAGIC, strict=False)) <= 2
        if near_magic or (codec_name != "none" and _unwrap_locator(codec_name, tail) is not None):
            return True
    return False


def _raw_locator_place(codec_name: str, tail: bytes) -> bytes:
    """The bytes of ``tail`` where the locator sits for ``codec_name``, whatever the wrapper holds."""
    if codec_name == "zstd":
        return tail[_FRAME.size:]
    if codec_name == "gzip":
        return tail[len(_GZIP_LOCATOR_HEAD):-len(_GZIP_LOCATOR_TAIL)]
    return tail


def _unwrap_locator(codec_name: str, tail: bytes) -> bytes | None:
    """The raw locator inside ``tail``, or None if the wrapper around it is not the expected one."""
    if codec_name == "zstd":
        head, raw = tail[:_FRAME.size], tail[_FRAME.size:]
        return raw if head == _FRAME.pack(_SKIPPABLE_MAGIC, _LOCATOR.size) else None
    if codec_name == "gzip":
        head, raw = tail[:len(_GZIP_LOCATOR_HEAD)], tail[len(_GZIP_LOCATOR_HEAD):-len(_GZIP_LOCATOR_TAIL)]
        return raw if head == _GZIP_LOCATOR_HEAD and tail.endswith(_GZIP_LOCATOR_TAIL) else None
    return tail


def read_index_payload(fd: int | ByteSource, loc: Locator, codec_name: str, source: str) -> bytes:
    """Read and check the embedded index that ``loc`` points to; return its ``.pidx`` bytes."""
    stored = pread_from(fd, loc.index_length, loc.index_offset)
    if content_hash(stored) != loc.index_hash:
        raise CorruptBundleError("the embedded index is damaged (hash mismatch)", source, _HINT)
    if codec_name == "zstd":
        magic, size = _FRAME.unpack_from(stored)
        if magic != _SKIPPABLE_MAGIC or size != len(stored) - _FRAME.size:
            raise CorruptBundleError("the embedded index frame is malformed", source, _HINT)
        return stored[_FRAME.size:]
    if codec_name == "gzip":
        return _inflate_index_member(stored, source)
    return stored


def _inflate_index_member(stored: bytes, source: str) -> bytes:
    """The content of the gzip member that holds the index. pallet stores it (deflate level 0), so it inflates
    to less than its stored size: a member inflating to more is refused as soon as it passes that size,
    never held (a few MB of deflate can inflate to gigabytes)."""
    inflate = zlib.decompressobj(31)
    try:
        payload = inflate.decompress(stored, len(stored) + 1)
    except zlib.error as exc:
        raise CorruptBundleError(f"the embedded index member is damaged ({exc})", source, _HINT) from None
    if len(payload) > len(stored) or inflate.unconsumed_tail:
        raise CorruptBundleError(f"the embedded index member inflates to more than its {len(stored)} stored bytes "
                                 "(pallet stores it uncompressed): refused as a decompression bomb", source, _HINT)
    if not inflate.eof or inflate.unused_data:
        raise CorruptBundleError("the embedded index member is cut short or followed by other bytes", source, _HINT)
    return payload


def sniff_file(fd: int | ByteSource) -> str:
    """Return the codec name of the stream in ``fd`` from its first bytes."""
    return codecs.sniff(pread_from(fd, 4, 0))


_HINT = "the bundle was damaged in transit or on disk: fetch it again, or repack the source"
