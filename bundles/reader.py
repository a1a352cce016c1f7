"""Open a bundle file: find its codec and index (embedded or sidecar) and read shard bytes."""
from __future__ import annotations

import os
from dataclasses import dataclass

from . import container
from .codecs import Codec, get_codec
from .errors import BundleError, CorruptBundleError
from .index import Index, Shard

_NOT_FOUND_HINT = "check the path; bundles are written by `pallet pack SRC BUNDLE`"


@dataclass
class Bundle:
    """An open bundle file. ``index`` is None for a plain archive without a pallet index.

    ``sidecar_index`` is the ``BUNDLE.pidx`` next to it when one exists and
    could be read (None otherwise); ``index`` prefers the embedded copy.
    """

    path: str
    fd: int
    size: int
    codec: Codec
    index: Index | None
    sidecar_index: Index | None = None

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Bundle":
        path = os.fspath(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise BundleError("does not exist", path, _NOT_FOUND_HINT) from None
        except IsADirectoryError:
            raise BundleError("is a directory, not a bundle", path, _NOT_FOUND_HINT) from None
        except OSError as exc:
            raise BundleError(f"cannot open ({exc.strerror})", path, "check its permissions") from None
        try:
            return cls._load(path, fd)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def _load(cls, path: str, fd: int) -> "Bundle":
        size = os.fstat(fd).st_size
        if size == 0:
            raise BundleError("is empty, not a bundle", path, "the copy is incomplete: transfer it again")
        codec_name = container.sniff_file(fd)
        try:
            locator = container.read_locator(fd, size, codec_name)
        except BundleError as exc:
            exc.path = path
            raise
        index = container.read_index_section(fd, locator, codec_name, path) if locator else None
        sidecar = _read_sidecar(path, index is None)
        index = index or sidecar
        if index is not None and index.codec != codec_name:
            raise CorruptBundleError(f"index says codec {index.codec}, data is {codec_name}", path)
        codec = get_codec(index.codec, index.level) if index else get_codec(codec_name)
        return cls(path, fd, size, codec, index, sidecar)

    def read_shard(self, shard: Shard) -> bytes:
        """Return the compressed bytes of ``shard`` (raise BundleError if the file is too short)."""
        data = os.pread(self.fd, shard.length, shard.offset)
        if len(data) != shard.length:
            raise BundleError(f"shard {shard.number} is cut short: the bundle is truncated", self.path,
                              "the copy is incomplete: transfer it again")
        return data

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Bundle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_sidecar(path: str, needed: bool) -> Index | None:
    sidecar = path + container.SIDECAR_SUFFIX
    try:
        with open(sidecar, "rb") as handle:
            payload = handle.read()
    except OSError:
        return None
    try:
        return Index.from_bytes(payload, sidecar)
    except BundleError:
        if needed:
            raise
        return None
