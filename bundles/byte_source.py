"""Random-access byte sources: what a bundle reader needs from the file that holds the bundle."""
from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

from .errors import BundleError


@runtime_checkable
class ByteSource(Protocol):
    """A read-only sequence of ``size`` bytes that can be read at any offset, from any thread.

    ``pread(length, offset)`` returns the bytes at ``offset``: exactly
    ``length`` of them unless the range passes ``size`` (then fewer, and
    ``b""`` at or past the end). It raises a PalletError (never a bare
    OSError) when the bytes cannot be had. ``name`` names the source in
    messages; ``close()`` releases what it holds and may be called twice.
    """

    name: str
    size: int

    def pread(self, length: int, offset: int) -> bytes: ...

    def close(self) -> None: ...


class Readable(Protocol):
    """A sequential stream of bytes (a file, a codec's decoded stream): ``read(size)`` returns at most ``size``
    bytes, ``b""`` only at its end."""

    def read(self, size: int, /) -> bytes: ...


class FileSource:
    """A ByteSource over an open file descriptor (not closed by ``close``: its owner closes it)."""

    def __init__(self, fd: int, name: str, size: int | None = None):
        self.fd, self.name = fd, name
        self.size = os.fstat(fd).st_size if size is None else size

    def pread(self, length: int, offset: int) -> bytes:
        try:
            return os.pread(self.fd, length, offset)
        except OSError as exc:
            raise BundleError(f"cannot read the bundle ({exc.strerror})", self.name,
                              "check the disk it is on, or copy the bundle elsewhere") from None

    def close(self) -> None:
        """Nothing to release: the descriptor belongs to whoever opened it."""


def pread_from(source: int | ByteSource, length: int, offset: int) -> bytes:
    """``length`` bytes at ``offset`` of a file descriptor or a ByteSource."""
    if isinstance(source, int):
        return os.pread(source, length, offset)
    return source.pread(length, offset)
