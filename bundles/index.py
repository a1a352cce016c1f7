"""The bundle index: a columnar table of shards and entries, its binary encoding and validation."""
from __future__ import annotations

import json
import os
import struct
from array import array
from dataclasses import dataclass, field

import xxhash
import zstandard

from .errors import BundleError, CorruptBundleError
from .tarformat import Kind

FORMAT_VERSION = 2                  # what this pallet writes (docs/bundle-format.md, "Versions")
READABLE_FORMATS = (1, 2)           # what it reads: format 1 differs only in its tar headers' mtimes
HASH_NAME = "xxh3-128"
HASH_SIZE = 16
_MAGIC = b"PALLETIX"
_HEAD = struct.Struct("<8sII")
_LEN = struct.Struct("<Q")
_REPACK_HINT = "the bundle was damaged in transit or on disk: fetch it again, or repack the source"
_LYING_HINT = ("its index does not describe its shards: the bundle was damaged or crafted; fetch it again, or "
               "repack the source with `pallet pack`")
# (name, array typecode or "blob" for NUL-joined bytes or "hash" for packed digests)
ENTRY_COLUMNS = (
    ("path", "blob"), ("kind", "B"), ("mode", "I"), ("mtime_ns", "q"), ("size", "Q"),
    ("link", "blob"), ("link_group", "q"), ("hash", "hash"), ("shard", "I"),
    ("offset", "Q"), ("data_offset", "Q"),
)
_KINDS = dict(ENTRY_COLUMNS)
_ATTRIBUTES = {"path": "paths", "kind": "kinds", "mode": "modes", "mtime_ns": "mtimes", "size": "sizes",
               "link": "links", "link_group": "link_groups", "hash": "hashes", "shard": "shard_of",
               "offset": "offsets", "data_offset": "data_offsets"}


def content_hash(data) -> bytes:
    """Return the index's content hash (xxh3-128, big-endian digest) of ``data``."""
    return xxhash.xxh3_128_digest(data)


def new_hasher():
    """Return an incremental hasher matching :func:`content_hash`."""
    return xxhash.xxh3_128()


@dataclass(frozen=True)
class Shard:
    """One independently compressed piece of the bundle.

    ``offset``/``length`` locate the compressed bytes in the bundle file,
    ``raw_size`` is the uncompressed tar size, entries
    ``first_entry .. first_entry+entry_count-1`` live in it, ``file_bytes`` is
    their file content, and ``hash`` is the content hash of the compressed bytes.
    """

    number: int
    offset: int
    length: int
    raw_size: int
    first_entry: int
    entry_count: int
    file_bytes: int
    hash: bytes

    def to_json(self) -> dict:
        return {"offset": self.offset, "length": self.length, "raw_size": self.raw_size,
                "first_entry": self.first_entry, "entry_count": self.entry_count,
                "file_bytes": self.file_bytes, "hash": self.hash.hex()}


@dataclass(frozen=True)
class Entry:
    """One member of a bundle, as the index records it (paths are raw bytes)."""

    number: int
    path: bytes
    kind: Kind
    mode: int
    mtime_ns: int
    size: int
    link: bytes
    link_group: int
    hash: bytes
    shard: int
    offset: int
    data_offset: int

    @property
    def name(self) -> str:
        return os.fsdecode(self.path)

    def to_json(self) -> dict:
        doc = {"path": self.name, "type": self.kind.name.lower(), "mode": f"{self.mode:04o}",
               "mtime_ns": self.mtime_ns, "size": self.size, "shard": self.shard}
        if self.link:
            doc["link"] = os.fsdecode(self.link)
        if self.kind == Kind.FILE:
            doc["hash"] = self.hash.hex()
        return doc


@dataclass
class Index:
    """The table of contents of a bundle, stored column by column.

    Columns hold one value per entry, in stream order (directories first).
    ``link`` is the symlink target or, for hard links, the path of the group's
    first member; ``link_group`` is that member's entry number or -1.
    ``format`` is the bundle format version whose tar headers the shards
    hold: 2 (whole-second mtimes in ustar, nanoseconds in ``mtimes`` only) for
    what this pallet writes, 1 for a bundle read from an earlier pallet.
    """

    codec: str
    level: int
    shard_size: int
    paths: list = field(default_factory=list)
    kinds: array = field(default_factory=lambda: array("B"))
    modes: array = field(default_factory=lambda: array("I"))
    mtimes: array = field(default_factory=lambda: array("q"))
    sizes: array = field(default_factory=lambda: array("Q"))
    links: list = field(default_factory=list)
    link_groups: array = field(default_factory=lambda: array("q"))
    hashes: bytearray = field(default_factory=bytearray)
    shard_of: array = field(default_factory=lambda: array("I"))
    offsets: array = field(default_factory=lambda: array("Q"))
    data_offsets: array = field(default_factory=lambda: array("Q"))
    shards: list = field(default_factory=list)
    format: int = FORMAT_VERSION

    @property
    def nanosecond_headers(self) -> bool:
        """True when the shards' tar headers carry sub-second mtimes in pax records (format 1)."""
        return self.format < 2

    def __len__(self) -> int:
        return len(self.paths)

    def entry(self, i: int) -> Entry:
        return Entry(i, self.paths[i], Kind(self.kinds[i]), self.modes[i], self.mtimes[i], self.sizes[i],
                     self.links[i], self.link_groups[i], bytes(self.hashes[i * HASH_SIZE:(i + 1) * HASH_SIZE]),
                     self.shard_of[i], self.offsets[i], self.data_offsets[i])

    def __iter__(self):
        return (self.entry(i) for i in range(len(self.paths)))

    def shard_entries(self, shard: Shard):
        return (self.entry(i) for i in range(shard.first_entry, shard.first_entry + shard.entry_count))

    def slice(self, first: int, count: int) -> Index:
        """A new Index of entries ``first .. first+count-1`` only, renumbered from 0, with no shards.

        It carries exactly what a worker needs to build, extract or check one
        shard; ``link_group`` values still name entries of the whole index.
        """
        end = first + count
        part = Index(self.codec, self.level, self.shard_size, format=self.format)
        for name in ("paths", "kinds", "modes", "mtimes", "sizes", "links", "link_groups", "shard_of",
                     "offsets", "data_offsets"):
            setattr(part, name, getattr(self, name)[first:end])
        part.hashes = self.hashes[first * HASH_SIZE:end * HASH_SIZE]
        return part

    @property
    def total_file_bytes(self) -> int:
        return sum(s.file_bytes for s in self.shards)

    def count(self, kind: Kind) -> int:
        return self.kinds.count(int(kind))

    def positions(self, *kinds: Kind) -> list[int]:
        """The positions of the entries of ``kinds``, in index order (found by byte search, not a Python loop
        over every entry)."""
        column = self.kinds.tobytes()
        found: list[int] = []
        for kind in kinds:
            at = column.find(int(kind))
            while at != -1:
                found.append(at)
                at = column.find(int(kind), at + 1)
        return sorted(found) if len(kinds) > 1 else found

    def to_bytes(self) -> bytes:
        """Encode as the ``.pidx`` payload: a zstd frame of header and columns, self-hashed. The parts are fed to
        the compressor one by one, so that encoding holds the compressed payload and one column at a time, not
        the whole blob besides (the frame may differ from a one-shot compression's: indexes are compared
        decoded, :meth:`to_blob`)."""
        parts = self._blob_parts()
        size = sum(memoryview(part).nbytes for part in parts)
        compressor = zstandard.ZstdCompressor(level=3, write_checksum=True).compressobj(size=size)
        chunks = [compressor.compress(part) for part in parts]
        chunks.append(compressor.flush())
        return b"".join(chunks)

    def to_blob(self) -> bytes:
        """The ``.pidx`` payload before compression: header and columns, self-hashed. Two indexes are equal
        exactly when their blobs are (their compressed payloads may differ between zstd versions)."""
        return b"".join(self._blob_parts())

    def _blob_parts(self) -> list:
        """The parts that make up :meth:`to_blob`, its digest last (views of the columns where they need no
        conversion)."""
        header = json.dumps({
            "format": self.format, "hash": HASH_NAME, "codec": self.codec, "level": self.level,
            "shard_size": self.shard_size, "entries": len(self),
            "columns": [name for name, _ in ENTRY_COLUMNS],
            "shards": [s.to_json() for s in self.shards],
        }, sort_keys=True, separators=(",", ":")).encode()
        parts = [_HEAD.pack(_MAGIC, self.format, len(header)), header,
                 *self.column_parts([name for name, _ in ENTRY_COLUMNS])]
        hasher = new_hasher()
        for part in parts:
            hasher.update(part)
        parts.append(hasher.digest())
        return parts

    def column_parts(self, names: list[str]) -> list:
        """The named entry columns in their ``.pidx`` encoding: per column a u64 LE byte length, then the bytes."""
        parts = []
        for name in names:
            column = self._column_bytes(getattr(self, _ATTRIBUTES[name]), _KINDS[name])
            parts += [_LEN.pack(memoryview(column).nbytes), column]
        return parts

    @staticmethod
    def _column_bytes(values, kind: str):
        if kind == "blob":
            return b"\0".join(values)
        if kind == "hash":
            return memoryview(values)
        return memoryview(little_endian(values)).cast("B")

    @staticmethod
    def blob_of(payload: bytes, source: str | None = None) -> bytes:
        """The blob (:meth:`to_blob`) a ``.pidx`` payload holds, decompressed within a bound; CorruptBundleError
        naming ``source`` if it is damaged or would decode to far more than an index of its size can."""
        return _decode_bounded(payload, source)

    @classmethod
    def from_bytes(cls, payload: bytes, source: str | None = None) -> Index:
        """Decode a ``.pidx`` payload; raise CorruptBundleError naming ``source`` if damaged, BundleError if it
        does not fit in this process's memory."""
        try:
            return cls._decode(payload, source)
        except MemoryError:
            raise _out_of_memory(payload, source) from None

    @classmethod
    def _decode(cls, payload: bytes, source: str | None) -> Index:
        blob = _decode_bounded(payload, source)
        if len(blob) < _HEAD.size + HASH_SIZE or content_hash(memoryview(blob)[:-HASH_SIZE]) != blob[-HASH_SIZE:]:
            raise CorruptBundleError("index is damaged (its hash does not match)", source, _REPACK_HINT)
        magic, version, header_len = _HEAD.unpack_from(blob)
        if magic != _MAGIC:
            raise BundleError("not a pallet index", source, "pass a bundle written by `pallet pack`")
        if version not in READABLE_FORMATS:
            raise BundleError(f"index format {version} is not supported (this pallet reads formats "
                              f"{READABLE_FORMATS[0]} to {READABLE_FORMATS[-1]})",
                              source, "upgrade pallet, or repack the data with this version")
        try:
            index, entries = cls._from_header(json.loads(blob[_HEAD.size:_HEAD.size + header_len]), version)
            index.load_columns(memoryview(blob)[_HEAD.size + header_len:-HASH_SIZE],
                               [name for name, _ in ENTRY_COLUMNS], entries, source)
        except (ValueError, KeyError, TypeError, IndexError, OverflowError, struct.error) as exc:
            raise CorruptBundleError(f"index is damaged (its header or columns are not valid: {exc})", source,
                                     _REPACK_HINT) from None
        index.check_shard_ranges(source)
        return index

    def check_shard_ranges(self, source: str | None) -> None:
        """Raise CorruptBundleError naming ``source`` and the first entry at fault unless every entry lies in
        exactly one shard's entry range, and its ``shard`` column names that shard.

        The shards' ranges must follow each other from entry 0 to the last
        entry, without gap or overlap, and none may be empty unless the index
        has no entries; otherwise an entry would be listed (and mounted, or
        linked by unpack) although no shard's check ever reads it. One pass
        over the shards, each shard's column compared in one step.
        """
        expected = 0
        for n, shard in enumerate(self.shards):
            if shard.number != n or shard.first_entry != expected:
                raise self._uncovered(shard, expected, source)
            end = expected + shard.entry_count
            if end > len(self) or (not shard.entry_count and len(self)):
                claims = f"entries {expected}..{end - 1}" if shard.entry_count else "no entries"
                raise CorruptBundleError(f"shard {shard.number} claims {claims}, but the index has {len(self)} "
                                         "entries", source, _LYING_HINT)
            if self.shard_of[expected:end] != array("I", [shard.number]) * shard.entry_count:
                i = next(i for i in range(expected, end) if self.shard_of[i] != shard.number)
                raise CorruptBundleError(f"index entry {self._name(i)!r} lies in shard {shard.number}'s entry "
                                         f"range, but its shard column says {self.shard_of[i]}", source, _LYING_HINT)
            expected = end
        if expected != len(self):
            raise CorruptBundleError(f"index entry {self._name(expected)!r} (entry {expected}) lies past the last "
                                     f"shard's entry range: no shard holds it", source, _LYING_HINT)

    def _uncovered(self, shard: Shard, expected: int, source: str | None) -> CorruptBundleError:
        """The error for ``shard`` starting elsewhere than right after the previous shard's range (``expected``)."""
        if shard.first_entry > expected:
            where = f"index entry {self._name(expected)!r} (entry {expected}) lies in no shard's entry range"
        elif shard.first_entry < expected:
            where = f"index entry {self._name(shard.first_entry)!r} lies in two shards' entry ranges"
        else:
            where = "the shards are not numbered in order"
        return CorruptBundleError(f"{where} (shard {shard.number} starts at entry {shard.first_entry})", source,
                                  _LYING_HINT)

    def _name(self, i: int) -> str:
        """Entry ``i``'s path for a message (its number when there is no such entry)."""
        return os.fsdecode(self.paths[i]) if 0 <= i < len(self.paths) else f"#{i}"

    @classmethod
    def _from_header(cls, header, version: int) -> tuple[Index, int]:
        """An empty Index of format ``version`` with the shards a decoded JSON header lists, and its entry count;
        ValueError, KeyError or TypeError when a field is missing or of the wrong type, or the header names
        another format than the binary head."""
        if not isinstance(header, dict) or not isinstance(header["shards"], list):
            raise TypeError("the header is not an object with a list of shards")
        if header["format"] != version:
            raise ValueError(f"the header says format {header['format']!r}, the head {version}")
        numbers = ("shard_size", "entries")
        if not isinstance(header["codec"], str) or not all(_natural(header[key]) for key in numbers) \
                or not _level(header["level"]):
            raise ValueError("codec, level, shard_size or entries is not valid")
        index = cls(header["codec"], header["level"], header["shard_size"], format=version)
        fields = ("offset", "length", "raw_size", "first_entry", "entry_count", "file_bytes")
        for n, shard in enumerate(header["shards"]):
            if not isinstance(shard, dict) or not all(_natural(shard[key]) for key in fields) \
                    or not isinstance(shard["hash"], str):
                raise ValueError(f"shard {n} is not valid")
            index.shards.append(Shard(n, **{key: shard[key] for key in fields}, hash=bytes.fromhex(shard["hash"])))
        return index, header["entries"]

    def load_columns(self, view: memoryview, names: list[str], count: int, source: str | None) -> int:
        """Decode the named columns (as :meth:`column_parts` wrote them) of ``count`` entries from ``view``.

        Returns the number of bytes consumed; raises CorruptBundleError naming
        ``source`` when a column is cut short or holds the wrong number of values.
        """
        pos = 0
        for name in names:
            kind = _KINDS[name]
            if pos + _LEN.size > len(view):
                raise CorruptBundleError(f"index column {name!r} is missing", source, _REPACK_HINT)
            (length,) = _LEN.unpack_from(view, pos)
            if pos + _LEN.size + length > len(view):
                raise CorruptBundleError(f"index column {name!r} is cut short", source, _REPACK_HINT)
            raw = view[pos + _LEN.size:pos + _LEN.size + length]
            pos += _LEN.size + length
            values: list[bytes] | bytearray | array
            if kind == "blob":
                values = bytes(raw).split(b"\0") if count else []
            elif kind == "hash":
                values = bytearray(raw)
            else:
                column = array(kind)
                if length % column.itemsize:
                    raise CorruptBundleError(f"index column {name!r} has the wrong length", source, _REPACK_HINT)
                column.frombytes(raw)
                values = little_endian(column)
            if len(values) != count * (HASH_SIZE if kind == "hash" else 1):
                raise CorruptBundleError(f"index column {name!r} has the wrong length", source, _REPACK_HINT)
            setattr(self, _ATTRIBUTES[name], values)
        return pos


_MAX_INDEX_BYTES = 1 << 34          # 16 GiB: far above any real index (1M entries take ~100 MB)
MAX_DECODE_RATIO = 1024             # an index or stream skeleton decodes to at most this many times its stored size
_DECODE_FLOOR = 64 << 20            # ... or to this much, whichever is more
_DECODE_PIECE = 16 << 20


def _decode_bounded(payload: bytes, source: str | None) -> bytes:
    """The decompressed ``.pidx`` payload, refused as a bomb past decoded_size_limit (nothing larger is held)."""
    return decode_zstd_bounded(payload, source, "index")


def decode_zstd_bounded(payload: bytes, source: str | None, what: str, error: type[BundleError] = CorruptBundleError,
                        hint: str = _REPACK_HINT) -> bytes:
    """The one zstd frame ``payload`` (``what``: the index, a far side's listing) decoded, but never to more than
    decoded_size_limit of its stored size: a frame claiming more is refused before anything is allocated, one
    without a claim as soon as it passes the limit. ``error`` (naming ``source``, with ``hint``) for a damaged
    or refused frame, and for one that does not fit in this process's memory."""
    limit = decoded_size_limit(len(payload))
    try:
        declared = zstandard.frame_content_size(payload)
        if 0 <= declared <= limit:
            return zstandard.ZstdDecompressor().decompress(payload, max_output_size=declared, allow_extra_data=False)
        if declared < 0:            # no size in the frame: decode in pieces, at most ``limit`` bytes
            parts, total = [], 0
            with zstandard.ZstdDecompressor().stream_reader(payload) as reader:
                while total <= limit and (part := reader.read(_DECODE_PIECE)):
                    parts.append(part)
                    total += len(part)
            if total <= limit:
                return b"".join(parts)
    except zstandard.ZstdError as exc:
        raise error(f"{what} is damaged ({exc})", source, hint) from exc
    except MemoryError:
        raise _out_of_memory(payload, source, what, error) from None
    claimed = f"claims {declared} bytes" if declared >= 0 else f"decodes to more than {limit} bytes"
    raise error(f"{what} is refused: it {claimed}, more than {MAX_DECODE_RATIO} times its {len(payload)} stored "
                "bytes", source, hint)


def _out_of_memory(payload: bytes, source: str | None, what: str = "index",
                   error: type[BundleError] = BundleError) -> BundleError:
    return error(f"the {what} ({len(payload):,} bytes stored) does not fit in this process's memory", source,
                 "raise the memory limit (ulimit -v), or check where it comes from: one this large for its stored "
                 "size is likely crafted")


def decoded_size_limit(stored: int) -> int:
    """The most bytes an index (or a stream skeleton) stored in ``stored`` compressed bytes may decode to.

    Real indexes decode to about 4 times their stored size (W1) and at most
    about 200 times (hundreds of thousands of empty directories under one
    long name); a frame claiming more than MAX_DECODE_RATIO times, beyond
    the first 64 MiB, is refused as a bomb before anything is allocated.
    """
    return min(_MAX_INDEX_BYTES, max(_DECODE_FLOOR, stored * MAX_DECODE_RATIO))


def little_endian(values: array) -> array:
    """``values`` in little-endian byte order (the array itself on little-endian machines)."""
    if array("H", [1]).tobytes()[0] == 1:
        return values
    swapped = array(values.typecode, values)
    swapped.byteswap()
    return swapped


def _level(value) -> bool:
    """True for a compression level a bundle may record: an int within zstd's range (its fast levels are negative;
    a stream fitted to its link may start at one)."""
    return isinstance(value, int) and not isinstance(value, bool) and -(1 << 17) <= value <= 22


def _natural(value) -> bool:
    """True for a non-negative int that fits 64 bits (JSON's booleans are not numbers here)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 64
