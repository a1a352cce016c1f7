"""Extract indexed bundles: directory tree, shards (by any worker or MPI rank), then links and metadata."""
from __future__ import annotations

import os
from collections.abc import Iterator
from types import ModuleType

from . import native
from .errors import CorruptBundleError, DestinationError, UnsafeMemberError
from .extract_common import (NEW_FILE_FLAGS, REFETCH_HINT, ShardOutcome, damaged_shard, destination_error,
                             members_differ, write_all)
from .index import Index, Shard, content_hash
from .reader import Bundle
from .safety import index_problems, safe_mode
from .shards import stands_alone
from .streamed import extract_streamed
from .tarformat import BLOCK, END_OF_ARCHIVE, Kind, member_header

HOLD_LIMIT = 256 << 20            # a shard's compressed plus decoded bytes that unpack and verify hold at most


def check_index(index: Index, bundle_path: str) -> None:
    """Raise UnsafeMemberError naming every member that must not be extracted."""
    problems = unsafe_entries(index)
    if problems:
        raise UnsafeMemberError(problems, bundle_path)


def unsafe_entries(index: Index) -> list[tuple[str, str]]:
    """(name, reason) of every entry that must not be extracted: the native engine first tries to prove the
    common plain tree safe; whatever it cannot prove, the rules of bundles/safety.py decide."""
    engine = native.module()
    if engine is not None and engine.trivially_safe(len(index), native.blob(index.paths), native.raw(index.kinds)):
        return []
    return index_problems(index)


def prepare_destination(dest: str) -> None:
    """Create ``dest`` if needed; raise DestinationError unless it is a writable directory."""
    try:
        os.makedirs(dest, exist_ok=True)
    except FileExistsError:
        raise DestinationError("exists and is not a directory", dest, "choose another destination") from None
    except OSError as exc:
        raise DestinationError(f"cannot create ({exc.strerror})", dest,
                               "create it yourself or pick a writable location") from None
    if not os.path.isdir(dest):
        raise DestinationError("exists and is not a directory", dest, "choose another destination")
    if not os.access(dest, os.W_OK | os.X_OK):
        raise DestinationError("is not writable", dest, "fix its permissions or pick a writable location")


def make_directories(index: Index, dest: str) -> None:
    """Create every directory of the index under ``dest`` (owner-writable until finish_tree)."""
    root = os.fsencode(dest)
    for i in index.positions(Kind.DIR):
        path = os.path.join(root, index.paths[i])
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            if os.path.islink(path) or not os.path.isdir(path):
                raise DestinationError("exists and is not a directory", os.fsdecode(path),
                                       "remove it or unpack into an empty destination") from None
            os.chmod(path, 0o700 | safe_mode(index.modes[i]))
        except OSError as exc:
            raise destination_error(exc, path) from None


def extract_shard(bundle: Bundle, index: Index, shard: Shard, dest: str, verify: bool = True,
                  last: bool = True) -> ShardOutcome:
    """Write the regular files of one shard under ``dest``, with mode and mtime.

    The contract MPI ranks and worker processes rely on: directories already
    exist (make_directories), links and directory metadata are left to
    finish_tree; only this shard's byte range is read; with ``verify`` the
    compressed bytes and every file's content hash are checked, and a
    mismatch raises CorruptBundleError naming the files. Only the ``last``
    shard may end with end-of-archive blocks (a verified shard before it
    that holds them is refused: plain tar would stop there). Rerunning a
    shard rewrites the same files, so it is idempotent.
    """
    if not held_whole(index, shard):
        return extract_streamed(bundle, index, shard, dest, verify, last)
    compressed = bundle.read_shard(shard)
    if verify and content_hash(compressed) != shard.hash:
        raise damaged_shard(bundle.path, index, shard)
    data = bundle.codec.decompress(compressed, shard.raw_size)
    return extract_shard_data(data, index, shard, dest, verify, bundle.path, last)


def extract_shard_data(data: bytes, index: Index, shard: Shard, dest: str, verify: bool,
                       source: str | None, last: bool = True) -> ShardOutcome:
    """Write the regular files of one shard from its decompressed tar bytes ``data``.

    Each file's content is found at its ``data_offset`` in ``data``; the
    contract is that of :func:`extract_shard` (directories exist, links and
    directory metadata are left to finish_tree). A file whose content lies
    outside ``data``, or, with ``verify``, does not match its content hash,
    is not written; all such files are named in one CorruptBundleError
    about ``source``, raised after the others are written.
    """
    root = os.fsencode(dest) + b"/"
    engine = native.module()
    if engine is not None:
        return _extract_natively(engine, native.as_bytes(data), index, shard, root, verify, source, last)
    view = memoryview(data)
    if verify:
        check_members(view, index, shard, source, last)
    files = nbytes = 0
    bad: list[str] = []
    umask = current_umask()
    for i in range(shard.first_entry, shard.first_entry + shard.entry_count):
        if index.kinds[i] != Kind.FILE:
            continue
        start, size = index.data_offsets[i], index.sizes[i]
        content = view[start:start + size]
        if len(content) != size or (verify and content_hash(content) != index.hashes[i * 16:i * 16 + 16]):
            bad.append(os.fsdecode(index.paths[i]))
            continue
        write_file(root + index.paths[i], content, index.modes[i], index.mtimes[i], umask)
        files, nbytes = files + 1, nbytes + size
    if bad:
        raise CorruptBundleError(f"shard {shard.number}: content hash mismatch", source, REFETCH_HINT, bad)
    return ShardOutcome(shard.number, files, nbytes)


def _extract_natively(engine: ModuleType, data: bytes, index: Index, shard: Shard, root: bytes, verify: bool,
                      source: str | None, last: bool) -> ShardOutcome:
    """extract_shard_data in the native engine: the same checks, files and errors, the per-file loop compiled."""
    part = index.slice(shard.first_entry, shard.entry_count)
    if verify:
        _check_natively(engine, data, part, index, shard, source, last)
    try:
        files, nbytes, bad = engine.extract_files(data, root, native.entry_columns(part), native.raw(part.data_offsets),
                                                  bytes(part.hashes), verify, current_umask())
    except engine.NativeFailure as failure:
        kind, i, number = failure.args
        path = root + part.paths[i]
        if kind == "directory":
            raise DestinationError("is a directory in the destination, but a file in the bundle", os.fsdecode(path),
                                   "remove it or unpack into an empty destination") from None
        raise destination_error(OSError(number, os.strerror(number)), path) from None
    if bad:
        raise CorruptBundleError(f"shard {shard.number}: content hash mismatch", source, REFETCH_HINT,
                                 [os.fsdecode(part.paths[i]) for i in bad])
    return ShardOutcome(shard.number, files, nbytes)


def _check_natively(engine: ModuleType, data: bytes, part: Index, index: Index, shard: Shard, source: str | None,
                    last: bool) -> None:
    """check_members in the native engine, for the entries of ``shard`` sliced out as ``part``."""
    first_bad = engine.check_members(data, native.entry_columns(part), native.raw(part.offsets),
                                     native.raw(part.data_offsets))
    if first_bad is not None:       # len(part): the bytes after the last entry
        raise members_differ(source, index, shard, shard.first_entry + min(first_bad, len(part) - 1))
    if not last and len(data) != members_end(index, shard):       # end-of-archive blocks before the last shard
        raise members_differ(source, index, shard, shard.first_entry + shard.entry_count - 1)


def members_end(index: Index, shard: Shard) -> int:
    """Where the last member of ``shard`` ends in its decoded bytes, as the index says (0: no entries)."""
    if not shard.entry_count:
        return 0
    i = shard.first_entry + shard.entry_count - 1
    size = index.sizes[i] if index.kinds[i] == Kind.FILE else 0
    return index.data_offsets[i] + size + -size % BLOCK


def is_streamed(index: Index, shard: Shard) -> bool:
    """True for a shard holding one file too large to handle in memory."""
    return shard.entry_count == 1 and index.kinds[shard.first_entry] == Kind.FILE and \
        stands_alone(index.sizes[shard.first_entry], index.shard_size)


def held_whole(index: Index, shard: Shard) -> bool:
    """True when unpack and verify hold ``shard`` in memory (compressed and decoded, at most HOLD_LIMIT bytes
    together); any other shard, a one-file shard or one cut at a large ``--shard-size``, is read as a stream."""
    return not is_streamed(index, shard) and shard.length + shard.raw_size <= HOLD_LIMIT


def check_members(data: memoryview, index: Index, shard: Shard, source: str | None, last: bool = True) -> None:
    """Raise CorruptBundleError unless the shard's tar bytes ``data`` are exactly the index's members: each
    entry's header, byte for byte as pallet writes it, at its offset, its data and padding, the next entry
    right after, and nothing but the end-of-archive zeros after the last. An extra member, one the index
    omits, or a header that says something else (which plain tar would obey) cannot pass."""
    engine = native.module()
    if engine is not None:
        _check_natively(engine, native.as_bytes(data), index.slice(shard.first_entry, shard.entry_count), index, shard,
                        source, last)
        return
    paths, kinds, modes, mtimes, sizes, links = (index.paths, index.kinds, index.modes, index.mtimes, index.sizes,
                                                 index.links)
    offsets, data_offsets, nanoseconds = index.offsets, index.data_offsets, index.nanosecond_headers
    blob, position = native.as_bytes(data), 0        # bytes.startswith compares ~15x faster than a view slice
    for i in range(shard.first_entry, shard.first_entry + shard.entry_count):
        start, data_start, size = offsets[i], data_offsets[i], sizes[i]
        if kinds[i] > Kind.HARDLINK or start != position:
            raise members_differ(source, index, shard, i)
        header = member_header(paths[i], kinds[i], modes[i], mtimes[i], size, links[i], nanoseconds)
        if data_start - start != len(header) or not blob.startswith(header, start):
            raise members_differ(source, index, shard, i)
        position = data_start + (size + -size % BLOCK if kinds[i] == Kind.FILE else 0)
    if position > len(data) or not _only_end_zeros(data[position:], 0) or (position != len(data) and not last):
        raise members_differ(source, index, shard, shard.first_entry + shard.entry_count - 1)


def _only_end_zeros(rest, pad: int) -> bool:
    """True when ``rest`` is ``pad`` zero bytes, optionally followed by the end-of-archive blocks."""
    return len(rest) in (pad, pad + len(END_OF_ARCHIVE)) and not any(rest)


def finish_tree(index: Index, dest: str) -> None:
    """Create hard links and symlinks, then apply directory modes and mtimes, deepest first."""
    root = os.fsencode(dest) + b"/"
    for i in index.positions(Kind.HARDLINK, Kind.SYMLINK):
        kind, path = index.kinds[i], root + index.paths[i]
        try:
            if kind == Kind.HARDLINK:
                remove_stale(path)
                os.link(root + index.links[i], path, follow_symlinks=False)
            elif kind == Kind.SYMLINK:
                remove_stale(path)
                os.symlink(index.links[i], path)
                os.utime(path, ns=(index.mtimes[i], index.mtimes[i]), follow_symlinks=False)
        except OSError as exc:
            raise destination_error(exc, path) from None
    for i in sorted(index.positions(Kind.DIR), key=lambda i: index.paths[i].count(b"/"), reverse=True):
        path = root + index.paths[i]
        os.chmod(path, safe_mode(index.modes[i]))
        os.utime(path, ns=(index.mtimes[i], index.mtimes[i]))


def create_file(path: bytes, mode: int = 0o600) -> int:
    """Open a new, empty file at ``path`` (``mode``, less the umask) for writing and return its descriptor.

    Whatever is already there (a stale file, or a symlink or hard link that
    may lead outside the destination) is unlinked first, never written through.
    """
    try:
        return os.open(path, NEW_FILE_FLAGS, mode)
    except FileExistsError:
        remove_stale(path)
    except OSError as exc:
        raise destination_error(exc, path) from None
    try:
        return os.open(path, NEW_FILE_FLAGS, mode)
    except OSError as exc:
        raise destination_error(exc, path) from None


def write_file(path: bytes, content: memoryview, mode: int, mtime_ns: int, umask: int | None = None) -> None:
    """Create ``path`` holding ``content`` with the safe form of ``mode`` and ``mtime_ns``.

    With the process's ``umask`` known (see :func:`current_umask`), a mode the
    umask leaves intact is given at creation and no ``fchmod`` is needed.
    """
    wanted = safe_mode(mode)
    direct = umask is not None and not wanted & umask
    fd = create_file(path, wanted if direct else 0o600)
    try:
        write_all(fd, content, path)
        if not direct:
            os.fchmod(fd, wanted)
        os.utime(fd, ns=(mtime_ns, mtime_ns))
    except OSError as exc:
        os.close(fd)
        raise destination_error(exc, path) from None
    try:
        os.close(fd)
    except OSError as exc:
        raise destination_error(exc, path) from None


def write_chunks(path: bytes, chunks: Iterator[bytes], mode: int, mtime_ns: int) -> int:
    """Create ``path`` from ``chunks`` (one at a time in memory) with the safe form of ``mode`` and ``mtime_ns``;
    return the bytes written. The file is created anew, as :func:`create_file` does."""
    fd = create_file(path)
    written = 0
    try:
        for chunk in chunks:
            write_all(fd, chunk, path)
            written += len(chunk)
        os.fchmod(fd, safe_mode(mode))
        os.utime(fd, ns=(mtime_ns, mtime_ns))
    finally:
        os.close(fd)
    return written


def current_umask() -> int | None:
    """This process's umask, read from /proc without changing it (so safe with threads); None if unknown."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return None


def remove_stale(path: bytes) -> None:
    """Remove a non-directory at ``path`` (a stale file or link from an earlier run)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            raise DestinationError("is a directory in the destination, but a file in the bundle",
                                   os.fsdecode(path), "remove it or unpack into an empty destination")
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise destination_error(exc, path) from None
