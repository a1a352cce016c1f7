"""Files written from a streamed shard: into DEST/.pallet/writing first, renamed into place once checked."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .byte_source import Readable
from .errors import CorruptBundleError, DestinationError
from .extract_common import (NEW_FILE_FLAGS, REFETCH_HINT, SHARD_WINDOW, STREAM_CHUNK, RangeReader, ShardOutcome,
                             damaged_shard, destination_error, hash_range, members_differ, read_up_to, write_all)
from .index import Index, Shard, new_hasher
from .reader import Bundle
from .reserved import STATE_DIR, WRITING_DIR
from .safety import safe_mode
from .shards import entry_header
from .state_fd import open_private_dir, state_dir_fd
from .tarformat import END_OF_ARCHIVE, Kind, padding


@dataclass(frozen=True)
class StreamedFile:
    """A file written from a stream into DEST/.pallet/writing (``writing``: that directory's descriptor) under
    ``temp``, with its mode and mtime, and not yet in place: ``digest`` is its content hash. :meth:`commit`
    renames it to ``path``, replacing what is there (never writing through it); :meth:`discard` removes it."""

    writing: int
    temp: str
    path: bytes
    digest: bytes

    def commit(self) -> None:
        try:
            os.replace(self.temp, self.path, src_dir_fd=self.writing)
        except IsADirectoryError:
            raise DestinationError("is a directory in the destination, but a file in the bundle",
                                   os.fsdecode(self.path), "remove it or unpack into an empty destination") from None
        except OSError as exc:
            raise destination_error(exc, self.path) from None

    def discard(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temp, dir_fd=self.writing)


@contextmanager
def writing_directory(dest: str) -> Iterator[int]:
    """DEST/.pallet/writing as a descriptor, for the block (made if needed, reached without following links)."""
    with state_dir_fd(dest) as state:
        writing = open_private_dir(WRITING_DIR, state, os.path.join(dest, STATE_DIR, WRITING_DIR))
    try:
        yield writing
    finally:
        os.close(writing)


def write_streamed_file(reader: Readable, index: Index, i: int, dest: str, writing: int, shard_number: int,
                        source: str | None) -> StreamedFile:
    """Write file entry ``i`` from ``reader`` into the ``writing`` directory (see :func:`writing_directory`)
    and return it, hashed, with its mode and mtime, for the caller to check and then commit or discard.

    ``reader`` yields decompressed tar bytes and must stand at the entry's
    data; exactly its size is read, in chunks of at most 8 MiB, so a file of
    any size passes through bounded memory. Raises CorruptBundleError naming
    ``source`` and shard ``shard_number`` if the data ends early (nothing is
    left in place of the user's file then).
    """
    temp = f"shard-{shard_number}-entry-{i}"
    path, size = os.path.join(os.fsencode(dest), index.paths[i]), index.sizes[i]
    hasher = new_hasher()
    fd = _create_in(writing, temp, path)
    try:
        remaining = size
        while remaining:
            chunk = reader.read(min(STREAM_CHUNK, remaining))
            if not chunk:
                raise CorruptBundleError(f"shard {shard_number} ends early", source, REFETCH_HINT,
                                         [os.fsdecode(index.paths[i])])
            hasher.update(chunk)
            write_all(fd, chunk, path)
            remaining -= len(chunk)
        os.fchmod(fd, safe_mode(index.modes[i]))
        os.utime(fd, ns=(index.mtimes[i], index.mtimes[i]))
    except BaseException:
        os.close(fd)
        StreamedFile(writing, temp, path, b"").discard()
        raise
    os.close(fd)
    return StreamedFile(writing, temp, path, hasher.digest())


def _create_in(directory: int, name: str, shown: bytes) -> int:
    """A new, empty file ``name`` in ``directory`` (a stale one of an earlier run is replaced)."""
    try:
        try:
            return os.open(name, NEW_FILE_FLAGS, 0o600, dir_fd=directory)
        except FileExistsError:
            os.unlink(name, dir_fd=directory)
            return os.open(name, NEW_FILE_FLAGS, 0o600, dir_fd=directory)
    except OSError as exc:
        raise destination_error(exc, shown) from None


def extract_streamed(bundle: Bundle, index: Index, shard: Shard, dest: str, verify: bool,
                     last: bool = True) -> ShardOutcome:
    """extract_shard for a shard not held whole: hashed first, then decoded once, member by member, each file
    written in chunks into DEST/.pallet/writing and hashed as written, then renamed into place only when its
    hash matches (a user's file is never replaced by bytes that did not check)."""
    if verify and hash_range(bundle.fd, shard) != shard.hash:
        raise damaged_shard(bundle.path, index, shard)
    reader = bundle.codec.open_stream(RangeReader(bundle.fd, shard.offset, shard.length), SHARD_WINDOW)
    with writing_directory(dest) as writing:
        return _extract_members(reader, bundle, index, shard, dest, writing, verify, last)


def _extract_members(reader: Readable, bundle: Bundle, index: Index, shard: Shard, dest: str, writing: int,
                     verify: bool, last: bool) -> ShardOutcome:
    """The members of ``shard`` from the stream ``reader``, for :func:`extract_streamed`."""
    position, files, nbytes = 0, 0, 0
    bad: list[str] = []
    for i in range(shard.first_entry, shard.first_entry + shard.entry_count):
        header = entry_header(index, i)       # its size, not the index's offsets, says how much to read
        if index.offsets[i] != position or index.data_offsets[i] != position + len(header) or \
                (read_up_to(reader, len(header)) != header and verify):
            raise members_differ(bundle.path, index, shard, i)
        position = index.data_offsets[i]
        if index.kinds[i] != Kind.FILE:
            continue
        size, pad = index.sizes[i], padding(index.sizes[i])
        written = write_streamed_file(reader, index, i, dest, writing, shard.number, bundle.path)
        if verify and written.digest != index.hashes[i * 16:i * 16 + 16]:
            written.discard()
            bad.append(os.fsdecode(index.paths[i]))
        else:
            written.commit()
            files, nbytes = files + 1, nbytes + size
        read_up_to(reader, pad)                     # as when held whole, padding bytes are the shard hash's
        position += size + pad
    if verify and read_up_to(reader, len(END_OF_ARCHIVE) + 1) not in ((b"", END_OF_ARCHIVE) if last else (b"",)):
        raise members_differ(bundle.path, index, shard, shard.first_entry + shard.entry_count - 1)
    if bad:
        raise CorruptBundleError(f"shard {shard.number}: content hash mismatch", bundle.path, REFETCH_HINT, bad)
    return ShardOutcome(shard.number, files, nbytes)
