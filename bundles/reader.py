"""Open a bundle file: find its codec and index (embedded or sidecar) and read shard bytes."""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from . import container
from .byte_source import ByteSource
from .codecs import Codec, get_codec
from .errors import BundleError, CorruptBundleError
from .index import Index, Shard

_NOT_FOUND_HINT = "check the path; bundles are written by `pallet pack SRC BUNDLE`"


@dataclass
class Bundle:
    """An open bundle file. ``index`` is None for a plain archive without a pallet index.

    ``sidecar_index`` is the ``BUNDLE.pidx`` next to it when one exists and
    could be read (None otherwise); ``index`` prefers the embedded copy, and
    a sidecar that differs from it in any byte counts as unreadable.
    """

    path: str
    fd: int
    size: int
    codec: Codec
    index: Index | None
    sidecar_index: Index | None = None

    @classmethod
    def open(cls, path: str | os.PathLike, use_index: bool = True) -> Bundle:
        """Open ``path``; without ``use_index`` it is read as a plain archive (no index, nothing verified)."""
        path = os.fspath(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise BundleError("does not exist", path, _NOT_FOUND_HINT) from None
        except OSError as exc:
            raise BundleError(f"cannot open ({exc.strerror})", path, "check its permissions") from None
        try:
            return cls._load(path, fd) if use_index else cls._plain(path, fd)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def _load(cls, path: str, fd: int) -> Bundle:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):            # opening a directory read-only succeeds on Linux
            raise BundleError("is a directory, not a bundle", path, _NOT_FOUND_HINT)
        size = st.st_size
        if size == 0:
            raise BundleError("is empty, not a bundle", path, "the copy is incomplete: transfer it again")
        has_sidecar = os.path.exists(path + container.SIDECAR_SUFFIX)
        codec_name, payload = _embedded_payload(path, fd, size, has_sidecar)
        index = Index.from_bytes(payload, path) if payload is not None else None
        sidecar = _read_sidecar(path, index, payload)
        index = index or sidecar
        if index is not None:
            _check_matches_data(path, index, codec_name, size)
        codec = get_codec(index.codec, index.level, path) if index else get_codec(codec_name, source=path)
        return cls(path, fd, size, codec, index, sidecar)

    @classmethod
    def _plain(cls, path: str, fd: int) -> Bundle:
        size = os.fstat(fd).st_size
        return cls(path, fd, size, get_codec(container.sniff_file(fd), source=path), None)

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

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_embedded_index(source: ByteSource) -> tuple[Codec, Index]:
    """The codec and the embedded index of the bundle held by ``source`` (no sidecar is looked for).

    Raises BundleError naming ``source.name`` for a plain archive (no index)
    or a bundle too short for its shards, CorruptBundleError for a damaged
    locator or index.
    """
    codec_name, payload = _embedded_payload(source.name, source, source.size, False)
    if payload is None:
        raise BundleError("has no pallet index: it is a plain archive", source.name,
                          "unpack it (pallet unpack), or repack it with pallet pack to read it in place")
    index = Index.from_bytes(payload, source.name)
    _check_matches_data(source.name, index, codec_name, source.size)
    return get_codec(index.codec, index.level, source.name), index


def _embedded_payload(path: str, fd: int | ByteSource, size: int, has_sidecar: bool) -> tuple[str, bytes | None]:
    """The codec and the embedded index bytes (None for a plain archive); indexed, the codec comes from the tail."""
    try:
        found = container.find_locator(fd, size)
    except BundleError as exc:
        exc.path = path
        raise
    if found is None:
        if container.damaged_locator(fd, size) and not has_sidecar:
            raise CorruptBundleError("the index locator at the end of the bundle is damaged, so its index "
                                     "cannot be found", path,
                                     "fetch the bundle again, or put its .pidx beside it; to extract it anyway "
                                     "as a plain archive, unverified: pallet unpack --no-index")
        return container.sniff_file(fd), None
    codec_name, locator = found
    return codec_name, container.read_index_payload(fd, locator, codec_name, path)


def _check_matches_data(path: str, index: Index, codec_name: str, size: int) -> None:
    """Raise unless the data is in the index's codec and long enough for all its shards."""
    if index.codec != codec_name:
        raise CorruptBundleError(f"the index says codec {index.codec}, but the bundle's data is {codec_name}: "
                                 "its first shard is damaged, or the index belongs to another bundle", path,
                                 "fetch the bundle and its .pidx again, or repack the source")
    data_end = max((s.offset + s.length for s in index.shards), default=0)
    if size < data_end:
        raise BundleError(f"is truncated: {size} bytes, but its shards end at byte {data_end}", path,
                          "the copy is incomplete: transfer it again")


def _read_sidecar(path: str, embedded: Index | None, payload: bytes | None) -> Index | None:
    """The sidecar ``.pidx``: None if missing, or if not byte-identical to the embedded index ``payload``."""
    sidecar = path + container.SIDECAR_SUFFIX
    try:
        with open(sidecar, "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    if embedded is not None:
        return embedded if data == payload else None
    return Index.from_bytes(data, sidecar)
