"""What a worker needs to handle one shard of a bundle: where to reopen the file, and the shard's own entries."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass

from .codecs import Codec
from .errors import BundleError
from .index import Index, Shard
from .reader import Bundle


@dataclass(frozen=True)
class BundleRef:
    """A bundle file a worker reopens by ``path``; ``device``, ``inode`` and ``size`` prove it is the same file."""

    path: str
    device: int
    inode: int
    size: int
    codec: Codec

    @classmethod
    def of(cls, bundle: Bundle) -> BundleRef:
        st = os.fstat(bundle.fd)
        return cls(bundle.path, st.st_dev, st.st_ino, st.st_size, bundle.codec)

    def open(self) -> Bundle:
        """Open the file again (without reading its index); raise BundleError if it was replaced or changed."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise BundleError(f"cannot open again ({exc.strerror})", self.path,
                              "leave the bundle in place until the operation ends") from None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino, st.st_size) != (self.device, self.inode, self.size):
            os.close(fd)
            raise BundleError("was replaced or changed while being read", self.path,
                              "leave the bundle in place until the operation ends, then run it again")
        return Bundle(self.path, fd, self.size, self.codec, None)


@dataclass(frozen=True)
class ShardJob:
    """One shard to extract or check: ``entries`` holds only its entries and ``shard.first_entry`` is 0."""

    bundle: BundleRef
    entries: Index
    shard: Shard
    last: bool


def shard_jobs(bundle: Bundle, shards: list[Shard]) -> Iterator[ShardJob]:
    """A job per shard of the open, indexed ``bundle``, in the order given, made as they are drawn."""
    ref, index = BundleRef.of(bundle), bundle.index
    assert index is not None, "shard_jobs needs an indexed bundle"
    final = len(index.shards) - 1
    for shard in shards:
        yield ShardJob(ref, index.slice(shard.first_entry, shard.entry_count),
                       dataclasses.replace(shard, first_entry=0), shard.number == final)
