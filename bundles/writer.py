"""Write a bundle: walk the source, cut it into shards, build and compress them in parallel."""
from __future__ import annotations

import os
import time
from array import array
from dataclasses import dataclass
from typing import Iterator

from . import container
from .codecs import Codec, get_codec
from .errors import DestinationError, PalletError, SourceError
from .index import HASH_SIZE, Index, Shard, content_hash, new_hasher
from .parallel import default_jobs, ordered_map
from .progress import NoProgress, Progress
from .scan import SourceTree, scan
from .tarformat import BLOCK, END_OF_ARCHIVE, Kind, member_header, padding

MIN_AUTO_SHARD = 4 << 20
MAX_AUTO_SHARD = 64 << 20
_READ_CHUNK = 8 << 20
_ZERO_HASH = bytes(HASH_SIZE)
_ZERO_BLOCK = bytes(BLOCK)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class PackOptions:
    """How to pack: codec and level, target uncompressed shard size (None: automatic), workers."""

    codec: str = "zstd"
    level: int | None = None
    shard_size: int | None = None
    jobs: int = 0


@dataclass(frozen=True)
class ShardPlan:
    """Entries ``first .. first+count-1`` form one shard; ``big`` shards are streamed."""

    number: int
    first: int
    count: int
    big: bool
    last: bool


@dataclass(frozen=True)
class PackResult:
    """What pack wrote: the bundle, its sidecar index and the index itself."""

    bundle: str
    sidecar: str
    index: Index
    bundle_bytes: int
    seconds: float


@dataclass(frozen=True)
class _BuiltShard:
    compressed: bytes
    raw_size: int
    file_bytes: int
    hashes: bytes
    offsets: array
    data_offsets: array


def auto_shard_size(index: Index) -> int:
    """Target shard size: about 1/64 of the stream, between 4 and 64 MiB, in whole MiB."""
    estimate = sum(index.sizes) + BLOCK * 2 * len(index)
    return min(MAX_AUTO_SHARD, max(MIN_AUTO_SHARD, (estimate // 64) >> 20 << 20))


def plan_shards(index: Index, shard_size: int) -> list[ShardPlan]:
    """Cut the entries into shards at entry boundaries; a file of ``shard_size`` or more stands alone."""
    cuts: list[tuple[int, int, bool]] = []
    first, filled = 0, 0
    for i, size in enumerate(index.sizes):
        if size >= shard_size:
            if i > first:
                cuts.append((first, i - first, False))
            cuts.append((i, 1, True))
            first, filled = i + 1, 0
            continue
        filled += BLOCK + size + padding(size)
        if filled >= shard_size:
            cuts.append((first, i + 1 - first, False))
            first, filled = i + 1, 0
    if first < len(index) or not cuts:
        cuts.append((first, len(index) - first, False))
    return [ShardPlan(n, f, c, big, n == len(cuts) - 1) for n, (f, c, big) in enumerate(cuts)]


def pack(src: str | os.PathLike, bundle: str | os.PathLike, options: PackOptions = PackOptions(),
         progress: Progress | None = None) -> PackResult:
    """Pack ``src`` into ``bundle`` (and ``bundle.pidx``) and return what was written.

    The bundle is written under a temporary name in the same directory and
    renamed at the end, so a failed or interrupted pack never leaves a partial
    file under the final name; the source is only read. The output bytes
    depend only on the source tree and the codec, level and shard size —
    never on ``jobs``.
    """
    started = time.monotonic()
    codec = get_codec(options.codec, options.level)
    jobs = options.jobs or default_jobs()
    bundle = os.fspath(bundle)
    _check_destination(bundle)
    tree = scan(src, codec.name, codec.level, jobs)
    index = tree.index
    index.shard_size = options.shard_size or auto_shard_size(index)
    plans = plan_shards(index, index.shard_size)
    progress = progress or NoProgress()
    progress.start("pack", len(index), sum(index.sizes))
    tmp = _temp_name(bundle)
    try:
        with open(tmp, "w+b") as out:     # read back to hash streamed shards
            _write_shards(tree, plans, codec, jobs, out, progress)
            out.write(container.index_section(codec.name, index.to_bytes(), out.tell()))
            size = out.tell()
        sidecar = _write_sidecar(bundle, index)
        os.replace(tmp, bundle)
    except OSError as exc:
        raise _write_error(exc, bundle) from exc
    finally:
        progress.finish()
        if os.path.exists(tmp):
            os.unlink(tmp)
    return PackResult(bundle, sidecar, index, size, time.monotonic() - started)


def _write_shards(tree: SourceTree, plans: list[ShardPlan], codec: Codec, jobs: int, out, progress) -> None:
    index = tree.index
    n = len(index)
    index.hashes = bytearray(HASH_SIZE * n)
    index.shard_of, index.offsets, index.data_offsets = array("I", [0]) * n, array("Q", [0]) * n, array("Q", [0]) * n
    small = ordered_map(_build_small_shard, [p for p in plans if not p.big], jobs, _init_worker, (tree, codec))
    for plan in plans:
        offset = out.tell()
        built = _build_big_shard(tree, plan, codec, jobs, out) if plan.big else next(small)
        if not plan.big:
            out.write(built.compressed)
        length = out.tell() - offset
        digest = content_hash(built.compressed) if not plan.big else _hash_region(out, offset, length)
        _record(index, plan, built, Shard(plan.number, offset, length, built.raw_size, plan.first,
                                          plan.count, built.file_bytes, digest))
        progress.advance(plan.count, built.file_bytes)


def _record(index: Index, plan: ShardPlan, built: _BuiltShard, shard: Shard) -> None:
    lo, hi = plan.first, plan.first + plan.count
    index.hashes[lo * HASH_SIZE:hi * HASH_SIZE] = built.hashes
    index.shard_of[lo:hi] = array("I", [plan.number]) * plan.count
    index.offsets[lo:hi] = built.offsets
    index.data_offsets[lo:hi] = built.data_offsets
    index.shards.append(shard)


_worker_state: tuple[SourceTree, Codec] | None = None


def _init_worker(tree: SourceTree, codec: Codec) -> None:
    global _worker_state
    _worker_state = (tree, codec)


def _build_small_shard(plan: ShardPlan) -> _BuiltShard:
    tree, codec = _worker_state
    index, parts = tree.index, []
    paths, kinds, modes, mtimes, sizes, links = (index.paths, index.kinds, index.modes, index.mtimes,
                                                 index.sizes, index.links)
    root = tree.root + b"/"
    hashes, offsets, data_offsets = [], array("Q"), array("Q")
    position = file_bytes = 0
    for i in range(plan.first, plan.first + plan.count):
        header = member_header(paths[i], kinds[i], modes[i], mtimes[i], sizes[i], links[i])
        offsets.append(position)
        position += len(header)
        data_offsets.append(position)
        parts.append(header)
        if kinds[i] == Kind.FILE:
            size = sizes[i]
            data = _read_file(root + paths[i], size)
            hashes.append(content_hash(data))
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
    return _BuiltShard(codec.compress(b"".join(parts)), position, file_bytes, b"".join(hashes), offsets, data_offsets)


def _build_big_shard(tree: SourceTree, plan: ShardPlan, codec: Codec, jobs: int, out) -> _BuiltShard:
    index, i = tree.index, plan.first
    header = _header(index, i)
    hasher = new_hasher()
    size = index.sizes[i]

    def chunks() -> Iterator[bytes]:
        yield header
        for chunk in _iter_file(os.path.join(tree.root, index.paths[i]), size):
            hasher.update(chunk)
            yield chunk
        yield bytes(padding(size)) + tail

    tail = END_OF_ARCHIVE if plan.last else b""
    out.flush()
    codec.compress_stream(chunks(), out, jobs)
    raw = len(header) + size + padding(size) + len(tail)
    return _BuiltShard(b"", raw, size, hasher.digest(), array("Q", [0]), array("Q", [len(header)]))


def _header(index: Index, i: int) -> bytes:
    return member_header(index.paths[i], index.kinds[i], index.modes[i], index.mtimes[i],
                         index.sizes[i], index.links[i])


def _read_file(path: bytes, size: int) -> bytes:
    """Return the whole content of a file expected to hold ``size`` bytes (it fits in a shard)."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError:
        return b"".join(_iter_file(path, size))     # raises the explained error
    try:
        data = os.read(fd, size + 1)
    finally:
        os.close(fd)
    return data if len(data) == size else b"".join(_iter_file(path, size))


def _iter_file(path: bytes, size: int) -> Iterator[bytes]:
    """Yield exactly ``size`` bytes of the file, or raise SourceError if it changed or cannot be read."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        raise SourceError(f"cannot read ({exc.strerror})", path,
                          "make it readable (chmod u+r) or remove it from the source") from None
    try:
        remaining = size
        while remaining > 0:
            chunk = os.read(fd, min(remaining, _READ_CHUNK))
            if not chunk:
                break
            remaining -= len(chunk)
            yield chunk
        if remaining or os.read(fd, 1):
            raise SourceError("changed size while being packed", path,
                              "pack again when nothing is writing to the source")
    except OSError as exc:
        raise SourceError(f"read failed ({exc.strerror})", path, "check the file system holding the source") from None
    finally:
        os.close(fd)


def _hash_region(out, offset: int, length: int) -> bytes:
    out.flush()
    hasher, fd, done = new_hasher(), out.fileno(), 0
    while done < length:
        chunk = os.pread(fd, min(_READ_CHUNK, length - done), offset + done)
        hasher.update(chunk)
        done += len(chunk)
    return hasher.digest()


def _write_sidecar(bundle: str, index: Index) -> str:
    sidecar = bundle + container.SIDECAR_SUFFIX
    tmp = _temp_name(sidecar)
    try:
        with open(tmp, "wb") as out:
            out.write(index.to_bytes())
        os.replace(tmp, sidecar)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return sidecar


def _check_destination(bundle: str) -> None:
    parent = os.path.dirname(os.path.abspath(bundle))
    if not os.path.isdir(parent):
        raise DestinationError("directory for the bundle does not exist", parent, "create it first (mkdir -p)")
    if os.path.isdir(bundle):
        raise DestinationError("is a directory", bundle, "give the bundle a file name, e.g. data.tar.zst")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DestinationError("directory is not writable", parent, "write the bundle somewhere you may write")


def _temp_name(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.part-{os.getpid()}")


def _write_error(exc: OSError, bundle: str) -> PalletError:
    if exc.errno == 28:
        return DestinationError("no space left while writing the bundle", bundle,
                                "free space or write the bundle to another file system")
    return DestinationError(f"cannot write the bundle ({exc.strerror})", bundle, "check the destination directory")
