"""What extracting a shard held whole (bundles.extract) and streamed (bundles.streamed) share: errors, reads, writes."""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from .byte_source import ByteSource, Readable, pread_from
from .errors import CorruptBundleError, DestinationError
from .index import Index, Shard, new_hasher
from .tarformat import Kind

NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
STREAM_CHUNK = 8 << 20
SHARD_WINDOW = 8 << 20            # the largest zstd window a shard streamed from a bundle may need (level 19's)
REFETCH_HINT = "the bundle was damaged in transit or on disk: fetch it again, or repack the source"


@dataclass(frozen=True)
class ShardOutcome:
    """What extracting one shard did: files written and their bytes."""

    shard: int
    files: int
    file_bytes: int


def destination_error(exc: OSError, path: bytes) -> DestinationError:
    """The DestinationError, naming ``path``, for an OSError met writing there."""
    name = os.fsdecode(path)
    if exc.errno == errno.ENOSPC:
        return DestinationError("no space left on device", name, "free space, or unpack to another file system")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return DestinationError(f"cannot write ({exc.strerror})", name, "fix the destination's permissions")
    return DestinationError(f"cannot write ({exc.strerror})", name, "check the destination")


def write_all(fd: int, content: bytes | bytearray | memoryview, path: bytes) -> None:
    """Write all of ``content`` to ``fd``; DestinationError naming ``path`` if that fails."""
    view = memoryview(content)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as exc:
        raise destination_error(exc, path) from None


def read_up_to(reader: Readable, count: int) -> bytes:
    """``count`` bytes from a stream reader (fewer only at its end); ``count`` is a header's or tail's size."""
    parts = []
    while count:
        chunk = reader.read(count)
        if not chunk:
            break
        parts.append(chunk)
        count -= len(chunk)
    return b"".join(parts)


def hash_range(source: int | ByteSource, shard: Shard) -> bytes:
    """Content hash of a shard's compressed bytes in a file descriptor or a ByteSource, read in chunks."""
    hasher, done = new_hasher(), 0
    while done < shard.length:
        chunk = pread_from(source, min(STREAM_CHUNK, shard.length - done), shard.offset + done)
        if not chunk:
            break
        hasher.update(chunk)
        done += len(chunk)
    return hasher.digest()


class RangeReader:
    """File-like reader over one byte range of a file descriptor or a ByteSource."""

    def __init__(self, source: int | ByteSource, offset: int, length: int):
        self.source, self.position, self.end = source, offset, offset + length

    def read(self, size: int = -1) -> bytes:
        size = self.end - self.position if size < 0 else min(size, self.end - self.position)
        data = pread_from(self.source, size, self.position) if size > 0 else b""
        self.position += len(data)
        return data


def damaged_shard(source: str | None, index: Index, shard: Shard) -> CorruptBundleError:
    """The error for a shard whose compressed bytes do not match its hash; it names the shard's files."""
    names = [os.fsdecode(index.paths[i]) for i in range(shard.first_entry, shard.first_entry + shard.entry_count)
             if index.kinds[i] == Kind.FILE]
    return CorruptBundleError(f"shard {shard.number} is damaged (hash of its bytes does not match the index); "
                              f"it holds {len(names)} file(s)", source, REFETCH_HINT, names)


def members_differ(source: str | None, index: Index, shard: Shard, i: int) -> CorruptBundleError:
    """The error for a shard whose tar members are not the index's, naming entry ``i`` where they part."""
    if not 0 <= i < len(index):         # a shard of no entries holds more than the end-of-archive blocks
        return CorruptBundleError(f"shard {shard.number}: holds tar members the index does not list", source,
                                  REFETCH_HINT)
    return CorruptBundleError(f"shard {shard.number}: its tar members do not match the index at "
                              f"{os.fsdecode(index.paths[i])!r} (a member added, missing or altered)", source,
                              REFETCH_HINT, [os.fsdecode(index.paths[i])])
