"""Shards: where the stream is cut, and how one shard is built from the source and compressed."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from stat import S_ISREG

from .codecs import Codec
from .errors import SourceError
from . import native
from .index import HASH_SIZE, Index, Shard, content_hash, new_hasher
from .scan import SourceTree
from .tarformat import BLOCK, END_OF_ARCHIVE, Kind, member_header, padding

MIN_AUTO_SHARD = 4 << 20
MAX_AUTO_SHARD = 64 << 20
HELD_RAW_LIMIT = 1 << 30           # a shard built whole (not big) decodes to at most this, whatever --shard-size says
_CUTS_PER_TARGET = 4               # content-defined cut points per target shard size (see cuts_after)
_READ_CHUNK = 8 << 20
_ZERO_HASH = bytes(HASH_SIZE)
_ZERO_BLOCK = bytes(BLOCK)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK     # a FIFO put in its place never blocks


@dataclass(frozen=True)
class ShardPlan:
    """Entries ``first .. first+count-1`` form one shard; ``big`` shards are streamed."""

    number: int
    first: int
    count: int
    big: bool
    last: bool


@dataclass(frozen=True)
class BuiltShard:
    """One built shard: compressed bytes (empty if streamed to a file), sizes and per-entry columns."""

    compressed: bytes
    raw_size: int
    file_bytes: int
    hashes: bytes
    offsets: array
    data_offsets: array
    md5s: bytes = b""           # with ``md5`` asked for: the md5 digests of the shard's files, in entry order


def auto_shard_size(index: Index) -> int:
    """Target shard size: about 1/64 of the stream, between 4 and 64 MiB, in whole MiB."""
    estimate = sum(index.sizes) + BLOCK * 2 * len(index)
    return min(MAX_AUTO_SHARD, max(MIN_AUTO_SHARD, (estimate // 64) >> 20 << 20))


def plan_shards(index: Index, shard_size: int) -> list[ShardPlan]:
    """Cut the entries into shards at entry boundaries chosen by content (docs/bundle-format.md §2), so that
    adding or removing entries moves only the cuts near them: the other shards keep their entries, and so
    their bytes and hashes. A file of ``shard_size`` (or half HELD_RAW_LIMIT) or more stands alone; any other
    shard closes after an entry that :func:`cuts_after` picks once the shard holds half the target, and at
    the latest once it holds the target — or before an entry that could take its tar bytes (headers counted
    at their largest, :func:`entry_bound`) past HELD_RAW_LIMIT. The native engine makes the same cuts."""
    engine = native.module()
    if engine is None:
        cuts = _cuts_in_python(index, shard_size)
    else:
        firsts, counts, bigs = engine.plan_cuts(native.blob(index.paths), native.blob(index.links), len(index),
                                                native.raw(index.sizes), shard_size, HELD_RAW_LIMIT, _CUTS_PER_TARGET)
        cuts = list(zip(array("Q", firsts), array("Q", counts), map(bool, bigs), strict=True))
    return [ShardPlan(n, f, c, big, n == len(cuts) - 1) for n, (f, c, big) in enumerate(cuts)]


def _cuts_in_python(index: Index, shard_size: int) -> list[tuple[int, int, bool]]:
    """plan_shards' cuts (first, count, big) in the Python engine."""
    cuts: list[tuple[int, int, bool]] = []
    first, filled, bound, half = 0, 0, 2 * BLOCK, max(1, shard_size // 2)
    paths, links = index.paths, index.links
    for i, size in enumerate(index.sizes):
        if stands_alone(size, shard_size):
            if i > first:
                cuts.append((first, i - first, False))
            cuts.append((i, 1, True))
            first, filled, bound = i + 1, 0, 2 * BLOCK
            continue
        entry = BLOCK + size + padding(size)
        most = entry + 3 * BLOCK + len(paths[i]) + len(links[i])
        if i > first and bound + most > HELD_RAW_LIMIT:
            cuts.append((first, i - first, False))
            first, filled, bound = i, 0, 2 * BLOCK
        filled, bound = filled + entry, bound + most
        if filled >= shard_size or (filled >= half and cuts_after(paths[i], entry, shard_size)):
            cuts.append((first, i + 1 - first, False))
            first, filled, bound = i + 1, 0, 2 * BLOCK
    if first < len(index) or not cuts:
        cuts.append((first, len(index) - first, False))
    return cuts


def stands_alone(size: int, shard_size: int) -> bool:
    """Whether a file of ``size`` bytes gets a shard of its own (a big shard, streamed wherever it is read)."""
    return size >= min(shard_size, HELD_RAW_LIMIT // 2)


def entry_bound(index: Index, i: int) -> int:
    """The most tar bytes entry ``i`` takes in a shard: its header with every pax record it may need, its data
    and padding (a regular file's; other kinds carry none)."""
    size = index.sizes[i] if index.kinds[i] == Kind.FILE else 0
    return 4 * BLOCK + len(index.paths[i]) + len(index.links[i]) + size + padding(size)


def cuts_after(path: bytes, entry_bytes: int, shard_size: int) -> bool:
    """Whether a shard past half its target may close after this entry: the CRC-32 of its path falls below
    its share of ``_CUTS_PER_TARGET`` cuts per ``shard_size`` bytes, so cuts come at the same entries
    whatever precedes them, on average every quarter target."""
    return zlib.crc32(path) * shard_size < entry_bytes * _CUTS_PER_TARGET << 32


def build_shard(tree: SourceTree, codec: Codec, plan: ShardPlan, threads: int, out, offset: int) -> Shard:
    """Build shard ``plan``, append its compressed bytes to ``out`` at ``offset``, record it in the index."""
    built = build_streamed_shard(tree, plan, codec, threads, out) if plan.big else build_small_shard(tree, codec, plan)
    return place_shard(tree.index, plan, built, out, offset)


def place_shard(index: Index, plan: ShardPlan, built: BuiltShard, out, offset: int,
                streamed_hash: bytes | None = None) -> Shard:
    """Write a built shard (unless it was streamed there) and record it with its position and hash
    (``streamed_hash``: the hash of a streamed shard's bytes, taken as they were written; else they are read
    back to hash them)."""
    if not plan.big:
        out.write(built.compressed)
    length = out.tell() - offset
    digest = content_hash(built.compressed) if not plan.big else (streamed_hash or hash_region(out, offset, length))
    shard = Shard(plan.number, offset, length, built.raw_size, plan.first, plan.count, built.file_bytes, digest)
    record_shard(index, plan, built, shard)
    return shard


def reset_columns(index: Index) -> None:
    """Size the columns the shard builder fills (hashes, shard numbers, offsets)."""
    n = len(index)
    index.hashes = bytearray(HASH_SIZE * n)
    index.shard_of, index.offsets, index.data_offsets = array("I", [0]) * n, array("Q", [0]) * n, array("Q", [0]) * n
    index.shards = []


def record_shard(index: Index, plan: ShardPlan, built: BuiltShard, shard: Shard) -> None:
    """Store a built shard's entry columns and its Shard record in ``index``."""
    lo, hi = plan.first, plan.first + plan.count
    index.hashes[lo * HASH_SIZE:hi * HASH_SIZE] = built.hashes
    index.shard_of[lo:hi] = array("I", [plan.number]) * plan.count
    index.offsets[lo:hi] = built.offsets
    index.data_offsets[lo:hi] = built.data_offsets
    index.shards.append(shard)


@dataclass(frozen=True)
class ShardSource:
    """What a worker needs to build one small shard: the source root, only the shard's entries, codec, plan.

    ``plan.first`` is 0: entries are numbered within ``tree.index``, a slice
    of the whole index (see :meth:`bundles.index.Index.slice`).
    """

    tree: SourceTree
    codec: Codec
    plan: ShardPlan
    md5: bool = False


def shard_source(tree: SourceTree, codec: Codec, plan: ShardPlan, md5: bool = False) -> ShardSource:
    """The self-contained description of shard ``plan`` of ``tree`` (``md5``: also hash its files with md5)."""
    part = SourceTree(tree.root, tree.index.slice(plan.first, plan.count))
    return ShardSource(part, codec, dataclasses.replace(plan, first=0), md5)


def build_from_source(source: ShardSource) -> BuiltShard:
    """Build a small shard from its self-contained description, in a worker or inline."""
    return build_small_shard(source.tree, source.codec, source.plan, source.md5)


def build_small_shard(tree: SourceTree, codec: Codec, plan: ShardPlan, md5: bool = False) -> BuiltShard:
    """Read the shard's files, write their headers and data, compress; all in memory. With ``md5`` the files'
    md5 digests come too (for checks by standard tools at the far side)."""
    engine = native.module()
    if engine is not None:
        return _build_natively(engine, tree, codec, plan, md5)
    return _build_in_python(tree, codec, plan, md5)


def _build_in_python(tree: SourceTree, codec: Codec, plan: ShardPlan, md5: bool) -> BuiltShard:
    """build_small_shard in the Python engine."""
    index, parts = tree.index, []
    paths, kinds, modes, mtimes, sizes, links = (index.paths, index.kinds, index.modes, index.mtimes,
                                                 index.sizes, index.links)
    root, nanoseconds = tree.root + b"/", index.nanosecond_headers
    hashes, offsets, data_offsets, md5s = [], array("Q"), array("Q"), []
    position = file_bytes = 0
    for i in range(plan.first, plan.first + plan.count):
        header = member_header(paths[i], kinds[i], modes[i], mtimes[i], sizes[i], links[i], nanoseconds)
        offsets.append(position)
        position += len(header)
        data_offsets.append(position)
        parts.append(header)
        if kinds[i] == Kind.FILE:
            size = sizes[i]
            data = _read_file(root + paths[i], size, mtimes[i])
            hashes.append(content_hash(data))
            if md5:
                md5s.append(hashlib.md5(data, usedforsecurity=False).digest())
            parts.append(data)
            parts.append(_ZERO_BLOCK[:-size % BLOCK])
            position += size + -size % BLOCK
            file_bytes += size
        else:
            hashes.append(_ZERO_HASH)
    if plan.last:
        tail = END_OF_ARCHIVE
        parts.append(tail)
        position += len(tail)
    return BuiltShard(codec.compress(b"".join(parts)), position, file_bytes, b"".join(hashes), offsets, data_offsets,
                      b"".join(md5s))


def _build_natively(engine, tree: SourceTree, codec: Codec, plan: ShardPlan, md5: bool) -> BuiltShard:
    """build_small_shard in the native engine: the same bytes and columns, the per-file loop compiled."""
    part = tree.index.slice(plan.first, plan.count) if (plan.first, plan.count) != (0, len(tree.index)) else tree.index
    try:
        raw, file_bytes, hashes, offsets, data_offsets, md5s = engine.build_shard(
            tree.root + b"/", native.entry_columns(part), plan.last, md5)
    except engine.NativeFailure as failure:
        kind, i = failure.args[:2]
        if kind == "too large":
            raise SourceError("does not fit in a shard held in memory", tree.root + b"/" + part.paths[i],
                              "pack with a smaller --shard-size") from None
        if kind == "changing":
            raise _changing(tree.root + b"/" + part.paths[i]) from None
        return _build_in_python(tree, codec, plan, md5)     # explains the unreadable file (or it was transient)
    return BuiltShard(codec.compress(raw), len(raw), file_bytes, hashes, array("Q", offsets),
                      array("Q", data_offsets), md5s)


def build_streamed_shard(tree: SourceTree, plan: ShardPlan, codec: Codec, threads: int, out,
                         md5: bool = False) -> BuiltShard:
    """Stream a one-file shard, compressed with ``threads`` threads, onto ``out`` (``md5``: hash it with md5 too)."""
    index, i = tree.index, plan.first
    header = entry_header(index, i)
    hasher, md5er = new_hasher(), hashlib.md5(usedforsecurity=False)
    size = index.sizes[i]

    def chunks() -> Iterator[bytes]:
        yield header
        for chunk in _iter_file(os.path.join(tree.root, index.paths[i]), size):
            hasher.update(chunk)
            if md5:
                md5er.update(chunk)
            yield chunk
        yield bytes(padding(size)) + tail

    tail = END_OF_ARCHIVE if plan.last else b""
    out.flush()
    codec.compress_stream(chunks(), out, threads)
    raw = len(header) + size + padding(size) + len(tail)
    return BuiltShard(b"", raw, size, hasher.digest(), array("Q", [0]), array("Q", [len(header)]),
                      md5er.digest() if md5 else b"")


def entry_header(index: Index, i: int) -> bytes:
    """The header block(s) (pax, then ustar) that precede entry ``i``'s data in the tar stream."""
    return member_header(index.paths[i], index.kinds[i], index.modes[i], index.mtimes[i],
                         index.sizes[i], index.links[i], index.nanosecond_headers)


def _read_file(path: bytes, size: int, mtime_ns: int) -> bytes:
    """Return the whole content of a file the scan saw with ``size`` bytes and ``mtime_ns`` (it fits in a shard).

    One fstat after the read must still show the scan's size and mtime;
    otherwise the file is read twice more between two fstat calls, and if its
    size, mtime or ctime moves meanwhile, or the two reads differ, SourceError
    (the bytes read may be a mix of two versions, never a state the file was
    in). Comparing the two reads catches writes the clock does not show: the
    kernel stamps mtime with a coarse clock, so writes within one tick leave
    it unchanged.
    """
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError:
        return b"".join(_iter_file(path, size))     # raises the explained error
    try:
        data = os.read(fd, size + 1)
        after = os.fstat(fd)
        if len(data) == size and after.st_size == size and after.st_mtime_ns == mtime_ns and S_ISREG(after.st_mode):
            return data
        os.lseek(fd, 0, os.SEEK_SET)
        before = os.fstat(fd)
        data = os.read(fd, size + 1)
        again = os.pread(fd, size + 1, 0)
        after = os.fstat(fd)
        moved = _moved(before, after) or again != data
    except OSError:
        data, after = b"", None         # explained below
    finally:
        os.close(fd)
    if after is None or len(data) != size or not S_ISREG(after.st_mode):
        return b"".join(_iter_file(path, size))
    if moved:
        raise _changing(path)
    return data


def _iter_file(path: bytes, size: int) -> Iterator[bytes]:
    """Yield exactly ``size`` bytes of the file, or raise SourceError if it changed (size, mtime or ctime moved
    while it was read) or cannot be read."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        raise SourceError(f"cannot read ({exc.strerror})", path,
                          "make it readable (chmod u+r) or remove it from the source") from None
    try:
        before, remaining = os.fstat(fd), size
        if not S_ISREG(before.st_mode):
            raise SourceError("is no longer a regular file (replaced while being packed)", path,
                              "pack again when nothing is changing the source")
        while remaining > 0:
            chunk = os.read(fd, min(remaining, _READ_CHUNK))
            if not chunk:
                break
            remaining -= len(chunk)
            yield chunk
        if remaining or os.read(fd, 1):
            raise SourceError("changed size while being packed", path,
                              "pack again when nothing is writing to the source")
        if _moved(before, os.fstat(fd)):
            raise _changing(path)
    except OSError as exc:
        raise SourceError(f"read failed ({exc.strerror})", path, "check the file system holding the source") from None
    finally:
        os.close(fd)


def _moved(before: os.stat_result, after: os.stat_result) -> bool:
    """True when a file's size, mtime or ctime differ between two fstat calls on one descriptor."""
    return (before.st_size, before.st_mtime_ns, before.st_ctime_ns) != \
        (after.st_size, after.st_mtime_ns, after.st_ctime_ns)


def _changing(path: bytes) -> SourceError:
    return SourceError("changed while being read (its size, mtime or ctime moved), so its bytes may mix two "
                       "versions", path, "pack or push again when nothing is writing to it")


class HashingWriter:
    """A file-like wrapper that hashes what is written through it to ``out`` (for shards streamed by a codec
    that writes to a file object, not to a descriptor)."""

    def __init__(self, out):
        self.out, self.hasher = out, new_hasher()

    def write(self, data) -> int:
        self.hasher.update(data)
        return self.out.write(data)

    def flush(self) -> None:
        self.out.flush()

    def digest(self) -> bytes:
        return self.hasher.digest()


def hash_region(out, offset: int, length: int) -> bytes:
    """Content hash of ``length`` bytes of ``out`` (opened for reading too) from ``offset``."""
    out.flush()
    hasher, fd, done = new_hasher(), out.fileno(), 0
    while done < length:
        chunk = os.pread(fd, min(_READ_CHUNK, length - done), offset + done)
        hasher.update(chunk)
        done += len(chunk)
    return hasher.digest()
