"""Read a bundle in place: its directory tree from the index, and verified reads of single files."""
from __future__ import annotations

import os
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import IO

from .byte_source import ByteSource, FileSource, Readable
from .codecs import Codec
from .errors import BundleError, CorruptBundleError
from .extract import check_members, damaged_shard, is_streamed, unsafe_entries
from .extract_common import RangeReader, read_up_to
from .index import Index, Shard, content_hash, new_hasher
from .reader import Bundle, read_embedded_index
from .safety import safe_mode
from .tarformat import Kind

DEFAULT_CACHE_BYTES = 256 << 20
_SPOOL_CHUNK = 8 << 20
_ROOT = b""
_OPEN_CURSORS = 8


@dataclass(frozen=True)
class Node:
    """What ``stat`` shows for one path of the view.

    ``kind`` is FILE, DIR or SYMLINK (a hard link shows as the FILE it links
    to, with the group's ``inode`` and ``nlink``); ``entry`` is the index
    entry whose bytes a read returns (-1 for the root directory); ``mode``
    has setuid, setgid and sticky bits removed, as extraction would.
    """

    entry: int
    kind: Kind
    mode: int
    mtime_ns: int
    size: int
    link: bytes
    inode: int
    nlink: int


class BundleView:
    """Random access to the files of an indexed bundle without unpacking it; safe to share between threads.

    Listings, stat and readlink come from the index alone. A read fetches
    and decompresses only the shard that holds the file, checks the shard's
    hash and its tar members against the index before serving a byte, and
    keeps decoded shards in an LRU of at most ``cache_bytes``, or one shard
    if that is larger (plus the shards being decoded, one per reading
    thread). A file too large to share a shard is copied once, compressed,
    into an unnamed temporary file while its shard's hash is checked, and is
    decoded as a stream from that copy (at most 8 such copies at a time, the
    least recently read dropped first). Entries that extraction would refuse (unsafe
    names or links, and everything under them) are not shown; ``hidden``
    lists them with the reason. A damaged shard raises CorruptBundleError
    naming the shard and its files, every time it is read; other shards
    stay readable.
    """

    def __init__(self, source: ByteSource, codec: Codec, index: Index, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 owner: Bundle | None = None):
        self.source, self.codec, self.index = source, codec, index
        self.cache_bytes = cache_bytes
        self._owner = owner
        self._lock = threading.Lock()
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._cached_bytes = 0
        self._loading: dict[int, threading.Lock] = {}
        self._cursors: OrderedDict[int, _StreamCursor] = OrderedDict()
        self.hidden = unsafe_entries(index)
        self._entries, self._children = _build_tree(index, {os.fsencode(name) for name, _ in self.hidden})
        self._group_sizes = _hard_link_group_sizes(index)
        self._root = Node(-1, Kind.DIR, 0o755, max(index.mtimes, default=0), 0, b"", 1, 2)

    @classmethod
    def open(cls, path: str | os.PathLike, cache_bytes: int = DEFAULT_CACHE_BYTES) -> BundleView:
        """The view of a local bundle file (its ``.pidx`` sidecar is used as ``pallet unpack`` uses it)."""
        bundle = Bundle.open(path)
        try:
            if bundle.index is None:
                raise BundleError("has no pallet index: it is a plain archive", bundle.path,
                                  "unpack it (pallet unpack), or repack it with pallet pack to read it in place")
            return cls(FileSource(bundle.fd, bundle.path, bundle.size), bundle.codec, bundle.index, cache_bytes,
                       owner=bundle)
        except BaseException:
            bundle.close()
            raise

    @classmethod
    def from_source(cls, source: ByteSource, cache_bytes: int = DEFAULT_CACHE_BYTES) -> BundleView:
        """The view of the bundle held by ``source`` (its embedded index; no sidecar); the view owns ``source``
        and closes it, also when the view cannot be made."""
        try:
            codec, index = read_embedded_index(source)
            return cls(source, codec, index, cache_bytes)
        except BaseException:
            source.close()
            raise

    @property
    def name(self) -> str:
        return self.source.name

    # ------------------------------------------------------------ the tree

    def lookup(self, path: str) -> Node | None:
        """The node at ``path`` (relative, or absolute from the view's root; "" and "/" are the root)."""
        key = _key(path)
        if not key:
            return self._root
        i = self._entries.get(key)
        return None if i is None else self._node(i)

    def _node(self, i: int) -> Node:
        index = self.index
        kind = Kind(index.kinds[i])
        if kind == Kind.SYMLINK:
            link = index.links[i]
            return Node(i, kind, 0o777, index.mtimes[i], len(link), link, i + 2, 1)
        source = index.link_groups[i] if kind == Kind.HARDLINK else i
        return Node(source, Kind.FILE if kind == Kind.HARDLINK else kind, safe_mode(index.modes[source]),
                    index.mtimes[source], index.sizes[source] if kind != Kind.DIR else 0, b"", source + 2,
                    self._group_sizes.get(source, 2 if kind == Kind.DIR else 1))

    def listdir(self, path: str) -> list[str]:
        """Names in the directory at ``path``; raises NotADirectoryError or FileNotFoundError like os.listdir."""
        key = _key(path)
        node = self.lookup(path)
        if node is None:
            raise FileNotFoundError(path)
        if node.kind != Kind.DIR:
            raise NotADirectoryError(path)
        return [os.fsdecode(name) for name in self._children.get(key, ())]

    # ------------------------------------------------------------ by inode number (FUSE's low-level API)

    def by_inode(self, inode: int) -> Node | None:
        """The node with this ``inode`` number (1 is the root), as ``lookup`` gives it; None if there is none."""
        if inode == 1:
            return self._root
        return self._node(inode - 2) if 2 <= inode < len(self.index) + 2 else None

    def child(self, directory: Node, name: bytes) -> Node | None:
        """The node called ``name`` in ``directory``, or None (also for a hidden entry)."""
        i = self._entries.get(self._path(directory) + b"/" + name if directory.entry >= 0 else name)
        return None if i is None else self._node(i)

    def children(self, directory: Node) -> list[bytes]:
        """The names in ``directory``, in the index's order."""
        return self._children.get(self._path(directory), [])

    def _path(self, node: Node) -> bytes:
        return _ROOT if node.entry < 0 else self.index.paths[node.entry]

    def cached_shard(self, node: Node) -> tuple[int, bytes | None]:
        """The number of the shard holding the file ``node``, and that shard decoded and verified if it is in the
        cache now (None: not read yet, dropped, or a large file's shard, which is never held whole)."""
        number = self.index.shard_of[node.entry]
        with self._lock:
            return number, self._cache.get(number)

    # ------------------------------------------------------------ reads

    def read(self, node: Node, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes of the file ``node`` from ``offset`` (b"" at or past its end)."""
        if node.kind != Kind.FILE:
            raise IsADirectoryError("is a directory") if node.kind == Kind.DIR else BundleError("not a regular file")
        if offset < 0:
            raise ValueError(f"a negative offset ({offset}) reads nothing of a file")
        size = max(0, min(size, node.size - offset))
        if size == 0:
            return b""
        shard = self.index.shards[self.index.shard_of[node.entry]]
        if is_streamed(self.index, shard):
            return self._cursor(shard).read(self.index.data_offsets[node.entry] + offset, size)
        start = self.index.data_offsets[node.entry] + offset
        return self._shard_bytes(shard)[start:start + size]

    def _shard_bytes(self, shard: Shard) -> bytes:
        with self._lock:
            data = self._cache.get(shard.number)
            if data is not None:
                self._cache.move_to_end(shard.number)
                return data
            loading = self._loading.setdefault(shard.number, threading.Lock())
        with loading:                   # one thread decodes a shard; the others wait for it, then hit the cache
            with self._lock:
                data = self._cache.get(shard.number)
            if data is None:
                data = self._decode(shard)
                self._remember(shard.number, data)
        with self._lock:
            self._loading.pop(shard.number, None)
        return data

    def _decode(self, shard: Shard) -> bytes:
        compressed = self.source.pread(shard.length, shard.offset)
        if len(compressed) != shard.length:
            raise BundleError(f"shard {shard.number} is cut short: the bundle is truncated", self.name,
                              "the copy is incomplete: transfer it again")
        if content_hash(compressed) != shard.hash:
            raise damaged_shard(self.name, self.index, shard)
        data = self.codec.decompress(compressed, shard.raw_size)
        check_members(memoryview(data), self.index, shard, self.name, shard.number == len(self.index.shards) - 1)
        return data

    def _remember(self, number: int, data: bytes) -> None:
        """Cache a decoded shard, dropping the least recently used; the newest is kept even when it alone is
        larger than ``cache_bytes`` (else such a shard would be decoded again on every read)."""
        with self._lock:
            if number in self._cache:
                return
            self._cache[number] = data
            self._cached_bytes += len(data)
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                _, dropped = self._cache.popitem(last=False)
                self._cached_bytes -= len(dropped)

    def _cursor(self, shard: Shard) -> _StreamCursor:
        with self._lock:
            cursor = self._cursors.get(shard.number)
            if cursor is None:
                cursor = self._cursors[shard.number] = _StreamCursor(self, shard)
                if len(self._cursors) > _OPEN_CURSORS:
                    self._cursors.popitem(last=False)[1].close()
            self._cursors.move_to_end(shard.number)
            return cursor

    def close(self) -> None:
        """Release the cache and the bundle file (or the source)."""
        with self._lock:
            self._cache.clear()
            cursors, self._cursors = list(self._cursors.values()), OrderedDict()
            self._cached_bytes = 0
        for cursor in cursors:
            cursor.close()
        if self._owner is not None:
            self._owner.close()
        else:
            self.source.close()

    def __enter__(self) -> BundleView:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _StreamCursor:
    """A large-file shard, copied once into a private spool file while its hash is checked, then decoded from that
    copy: no byte is served that was not hashed, and the decoder stays at its position so sequential reads do
    not start over (a read behind it decodes again from the spool, not from the source)."""

    def __init__(self, view: BundleView, shard: Shard):
        self.view, self.shard = view, shard
        self.lock = threading.Lock()
        self.spool: IO[bytes] | None = None
        self.reader: Readable | None = None
        self.position = 0

    def read(self, start: int, size: int) -> bytes:
        """``size`` decompressed bytes of the shard's tar stream from ``start``."""
        with self.lock:
            try:
                if self.spool is None:
                    self.spool = self._spool()
                if self.reader is None or start < self.position:
                    self.reader = self.view.codec.open_stream(RangeReader(self.spool.fileno(), 0, self.shard.length))
                    self.position = 0
                self._skip(self.reader, start - self.position)
                data = read_up_to(self.reader, size)
            except BaseException:
                self.reader = None          # the next read starts over rather than from a broken decoder
                raise
            self.position += len(data)
            if len(data) != size:
                raise CorruptBundleError(f"shard {self.shard.number} ends early", self.view.name,
                                         "fetch the bundle again, or repack the source")
            return data

    def _spool(self) -> IO[bytes]:
        """An unnamed temporary file holding the shard's compressed bytes, hashed on the way in."""
        spool = tempfile.TemporaryFile(prefix="pallet-view-")      # noqa: SIM115 (kept open: close() closes it)
        hasher, done, shard = new_hasher(), 0, self.shard
        try:
            while done < shard.length:
                chunk = self.view.source.pread(min(_SPOOL_CHUNK, shard.length - done), shard.offset + done)
                if not chunk:
                    break
                hasher.update(chunk)
                spool.write(chunk)
                done += len(chunk)
            if done != shard.length or hasher.digest() != shard.hash:
                raise damaged_shard(self.view.name, self.view.index, shard)
            spool.flush()
        except BaseException:
            spool.close()
            raise
        return spool

    def _skip(self, reader: Readable, count: int) -> None:
        while count > 0:
            chunk = reader.read(min(count, _SPOOL_CHUNK))
            if not chunk:
                raise CorruptBundleError(f"shard {self.shard.number} ends early", self.view.name,
                                         "fetch the bundle again, or repack the source")
            count -= len(chunk)
            self.position += len(chunk)

    def close(self) -> None:
        with self.lock:
            if self.spool is not None:
                self.spool.close()
                self.spool, self.reader = None, None


def _key(path: str) -> bytes:
    return os.fsencode(path).strip(b"/")


def _build_tree(index: Index, refused: set[bytes]) -> tuple[dict[bytes, int], dict[bytes, list[bytes]]]:
    """Entry numbers by path and names by directory, leaving out ``refused`` entries and everything under them."""
    entries: dict[bytes, int] = dict(zip(index.paths, range(len(index)), strict=True))
    children: dict[bytes, list[bytes]] = {_ROOT: []}
    kinds, directory = index.kinds, Kind.DIR
    for i, path in enumerate(index.paths):
        parent, _, name = path.rpartition(b"/")
        siblings = children.get(parent)
        if siblings is None or (refused and path in refused):
            entries.pop(path, None)
            continue
        siblings.append(name)
        if kinds[i] == directory:
            children[path] = []
    return entries, children


def _hard_link_group_sizes(index: Index) -> dict[int, int]:
    """Members per hard-link group, by the entry number of the group's first member."""
    sizes: dict[int, int] = {}
    if Kind.HARDLINK in index.kinds:
        for i, leader in enumerate(index.link_groups):
            if leader >= 0 and index.kinds[i] == Kind.HARDLINK:
                sizes[leader] = sizes.get(leader, 1) + 1
    return sizes
