"""The ``pallet://`` fsspec file system: the files of a bundle, read in place by byte ranges."""
from __future__ import annotations

import errno
import os
import posixpath
import threading
import weakref

import fsspec
from fsspec import AbstractFileSystem
from fsspec.spec import AbstractBufferedFile

from bundles.errors import PalletError, UsageError
from bundles.tarformat import Kind
from bundles.view import DEFAULT_CACHE_BYTES, BundleView, Node

from staging_core.in_place.remote_bytes import RemoteRanges, open_view

_SSH_PROTOCOLS = ("ssh", "sftp")
_MAX_LINK_HOPS = 40
_TYPES = {Kind.FILE: "file", Kind.DIR: "directory", Kind.SYMLINK: "link"}


class PalletFileSystem(AbstractFileSystem):
    """Read-only file system over one pallet bundle (``fo``), registered as ``pallet``.

    ``fo`` is a local path, an ssh URL (``ssh://[user@]host[:port]/abs`` or
    ``host:/abs``, read through pallet's ssh transport, one far-side process,
    range by range), or any path with ``target_protocol`` and
    ``target_options`` naming another fsspec file system to read it from
    (``pallet::ssh://host/b.tar.zst`` and ``pallet::s3://...`` arrive that
    way), or an open binary file object. Paths are relative to the bundle's
    root. Symlinks inside the bundle are followed when opening (they cannot
    leave it: unsafe entries are never shown). Every byte served has passed
    its shard's hash; a damaged shard raises OSError(EIO) for its files only.
    ``bytes_fetched`` counts the bytes read from a remote bundle.
    """

    protocol = "pallet"
    root_marker = ""
    cachable = False

    def __init__(self, fo="", target_protocol: str | None = None, target_options: dict | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, ssh_options: tuple[str, ...] = (), **kwargs):
        super().__init__(**kwargs)
        source = _open_source(fo, target_protocol, dict(target_options or {}), tuple(ssh_options))
        self.view = (open_view(os.fspath(fo), cache_bytes, tuple(ssh_options)) if source is None
                     else BundleView.from_source(source, cache_bytes))
        self.fo = self.view.name
        weakref.finalize(self, self.view.close)        # fsspec.open makes one per call and never closes it

    @classmethod
    def _strip_protocol(cls, path):
        path = super()._strip_protocol(path)
        return path.strip("/")

    @property
    def bytes_fetched(self) -> int:
        return getattr(self.view.source, "bytes_fetched", 0)

    def ukey(self, path):
        return f"{self.fo}:{self._strip_protocol(path)}"

    # ------------------------------------------------------------ listing

    def info(self, path, **kwargs):
        """What ``os.lstat`` would say: links on the way are followed, a link at the end is reported as one."""
        path = self._strip_protocol(path)
        return _info(path, self._resolve(path, follow_last=False)[1])

    def ls(self, path, detail=True, **kwargs):
        path = self._strip_protocol(path)
        where, node = self._resolve(path, follow_last=False)
        if node.kind == Kind.SYMLINK:           # listing a link to a directory lists the directory, as ls does
            where, node = self._resolve(path)
        if node.kind != Kind.DIR:
            entries = [_info(path, node)]
        else:
            entries = [_info(posixpath.join(path, name) if path else name,
                             self._resolve(posixpath.join(where, name) if where else name, follow_last=False)[1])
                       for name in self.view.listdir(where)]
        return entries if detail else [entry["name"] for entry in entries]

    def get_file(self, rpath, lpath, callback=None, outfile=None, **kwargs):
        """Copy one entry out; a symlink is copied as a symlink (a link to a directory is not followed)."""
        rpath = self._strip_protocol(rpath)
        node = self._resolve(rpath, follow_last=False)[1]
        if node.kind != Kind.SYMLINK or outfile is not None:
            return super().get_file(rpath, lpath, callback=callback, outfile=outfile, **kwargs)
        if os.path.lexists(lpath) and not os.path.isdir(lpath):
            os.unlink(lpath)
        os.symlink(os.fsdecode(node.link), lpath)
        return None

    # ------------------------------------------------------------ reading

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kwargs):
        if "r" not in mode or any(c in mode for c in "wax+"):
            raise PermissionError(f"pallet:// is read-only: cannot open {path!r} with mode {mode!r}")
        path = self._strip_protocol(path)
        node = self._resolve(path)[1]
        if node.kind == Kind.DIR:
            raise IsADirectoryError(path)
        return _BundleFile(self, path, node, mode, block_size or "default", cache_options=cache_options, **kwargs)

    def cat_file(self, path, start=None, end=None, **kwargs):
        path = self._strip_protocol(path)
        node = self._resolve(path)[1]
        if node.kind == Kind.DIR:
            raise IsADirectoryError(path)
        size = node.size
        start = 0 if start is None else (start if start >= 0 else max(0, size + start))
        end = size if end is None else (end if end >= 0 else max(0, size + end))
        return self.read_node(node, start, max(0, end - start))

    def read_node(self, node: Node, offset: int, length: int) -> bytes:
        """``length`` bytes of ``node`` from ``offset``; a pallet error becomes OSError (EIO)."""
        try:
            return self.view.read(node, offset, length)
        except PalletError as exc:
            raise OSError(errno.EIO, str(exc)) from None

    def _resolve(self, path: str, follow_last: bool = True) -> tuple[str, Node]:
        """The path in the bundle that ``path`` names, and its node, following symlinks inside the bundle (the
        last one only with ``follow_last``); FileNotFoundError, or ELOOP past 40 links."""
        node = self.view.lookup(path)
        if node is not None and (node.kind != Kind.SYMLINK or not follow_last):
            return path, node       # an entry of the index: none of its parents is a symlink (those are refused)
        parts, done, hops = path.split("/") if path else [], "", 0
        while parts:
            done = posixpath.join(done, parts.pop(0)) if done else parts.pop(0)
            node = self.view.lookup(done)
            if node is None:
                raise FileNotFoundError(path)
            if node.kind == Kind.SYMLINK and (parts or follow_last):
                hops += 1
                if hops > _MAX_LINK_HOPS:
                    raise OSError(errno.ELOOP, f"too many levels of symbolic links: {path}")
                target = posixpath.normpath(posixpath.join(posixpath.dirname(done), os.fsdecode(node.link)))
                parts = ([] if target == "." else target.split("/")) + parts
                done = ""
        node = self.view.lookup(done)
        if node is None:
            raise FileNotFoundError(path)
        return done, node

    # ------------------------------------------------------------ read-only

    def _refuse(self, *args, **kwargs):
        raise PermissionError("pallet:// is read-only: repack the source with pallet pack to change a bundle")

    mkdir = makedirs = rm = rm_file = rmdir = mv = cp_file = pipe_file = put_file = touch = _refuse

    def close(self) -> None:
        """Release the bundle (and the ssh session of a remote one)."""
        self.view.close()


class _BundleFile(AbstractBufferedFile):
    """A file of the bundle, read by ranges through the view."""

    def __init__(self, fs: PalletFileSystem, path: str, node: Node, mode, block_size, **kwargs):
        self.node = node
        super().__init__(fs, path, mode, block_size, size=node.size, **kwargs)

    def _fetch_range(self, start, end):
        return self.fs.read_node(self.node, start, end - start)


def _info(name: str, node: Node) -> dict:
    info = {"name": name, "size": node.size, "type": _TYPES[node.kind], "mode": node.mode | _mode_type(node.kind),
            "mtime": node.mtime_ns / 1e9, "mtime_ns": node.mtime_ns, "nlink": node.nlink, "ino": node.inode}
    if node.kind == Kind.SYMLINK:
        info["islink"] = True
        info["destination"] = os.fsdecode(node.link)
    return info


def _mode_type(kind: Kind) -> int:
    return {Kind.FILE: 0o100000, Kind.DIR: 0o040000, Kind.SYMLINK: 0o120000}[kind]


def _open_source(fo, target_protocol: str | None, target_options: dict, ssh_options: tuple[str, ...]):
    """The ByteSource for ``fo`` when it is a file object or names another fsspec file system; None for a local
    path or an ssh URL, which open_view opens."""
    if hasattr(fo, "read") and hasattr(fo, "seek"):
        return _FileObjectSource(fo, getattr(fo, "name", "bundle"))
    if not isinstance(fo, (str, os.PathLike)) or not os.fspath(fo):
        raise UsageError("no bundle given", None,
                         'pass fo="PATH" (or an ssh://HOST/PATH URL) to the pallet file system')
    fo = os.fspath(fo)
    if target_protocol in _SSH_PROTOCOLS:
        return RemoteRanges.open_url(_ssh_url(fo, target_options), ssh_options)
    if target_protocol not in (None, "file", "local"):
        handle = fsspec.open(fo, mode="rb", protocol=target_protocol, **target_options).open()
        return _FileObjectSource(handle, f"{target_protocol}://{fo}", owned=True)
    return None


def _ssh_url(path: str, options: dict) -> str:
    """An ssh URL from fsspec's sftp options (host, port, username) and the path."""
    host = options.get("host")
    if not host:
        raise UsageError("an ssh bundle needs a host", path, "write pallet::ssh://HOST/PATH")
    user = options.get("username")
    port = options.get("port")
    netloc = (f"{user}@" if user else "") + host + (f":{port}" if port and int(port) != 22 else "")
    return f"ssh://{netloc}/{path.lstrip('/')}"


class _FileObjectSource:
    """A ByteSource over a seekable binary file object; reads are serialised (one position)."""

    def __init__(self, handle, name: str, owned: bool = False):
        self.handle, self.name, self.owned = handle, str(name), owned
        self._lock = threading.Lock()
        self.bytes_fetched = 0
        with self._lock:
            self.size = handle.seek(0, os.SEEK_END)

    def pread(self, length: int, offset: int) -> bytes:
        with self._lock:
            self.handle.seek(offset)
            data = self.handle.read(max(0, min(length, self.size - offset)))
            self.bytes_fetched += len(data)
        return data

    def close(self) -> None:
        if self.owned:
            self.handle.close()
