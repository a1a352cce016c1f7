"""The local transport: copies on this host (files on a pool of native threads), preserving mode, mtime and symlinks."""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from bundles import native
from bundles.parallel import default_jobs

from . import parallel_copy
from .base import Capabilities, Direction, Endpoint, RemoteEntry, Transport, TransferResult
from .declarations import LOCAL_OPTIONS
from .errors import RemotePathMissingError, TransportError, classify
from bundles.safe_tree import SafeTree


class LocalTransport(Transport):
    """Copies between two local paths; ``link_mode`` 'copy' (default), 'hardlink' or 'reflink'; ``threads``
    copy regular files at once with the native engine (0: one per CPU)."""

    scheme = "file"
    capabilities = Capabilities(batch=True, streaming=False, remote_exec=False, parallel_streams=False,
                                checksums=(), preserves_mtime=True, preserves_mode=True, symlinks=True,
                                hardlinks=True, per_file_overhead_s=3e-5, concurrency=1,
                                exact_listing=True, local_copy=True)
    declared_options = LOCAL_OPTIONS

    def __init__(self, endpoint: Endpoint, link_mode: str = "copy", threads: int = 0):
        super().__init__(endpoint)
        if link_mode not in ("copy", "hardlink", "reflink"):
            raise ValueError(f"link_mode must be copy, hardlink or reflink, not {link_mode!r}")
        if threads < 0:
            raise ValueError(f"threads must be 0 (one per CPU) or more, not {threads}")
        self.link_mode = link_mode
        self.threads = threads or default_jobs()

    def transfer(self, direction: Direction, local_root: str, remote_root: str,
                 items: Sequence[str] | None = None, temp_dir: str | None = None) -> TransferResult:
        """Copy ``items``; with the native engine (and ``link_mode`` copy) regular files are copied by a pool
        of native threads once their directories exist, the rest one by one as before."""
        if items is None:
            items = self.all_items(direction, local_root, remote_root)
        source, target = (local_root, remote_root) if direction is Direction.PUSH else (remote_root, local_root)
        result = TransferResult()
        state = _Copying(SafeTree(target), [], {})
        engine = native.module() if self.link_mode == "copy" else None
        files = parallel_copy.plan(engine, source, items, self.threads) if engine is not None else None
        for item in items if files is None else files.one_by_one:
            self._copy_item(source, target, item, state, result)
        if files is not None:
            parallel_copy.copy(engine, source, state.tree, files, result, self.threads)
        self._finish_directories(state.tree, state.directories, result)
        return result

    def _copy_item(self, source: str, target: str, item: str, state: _Copying, result: TransferResult) -> None:
        try:
            self._copy_one(os.path.join(source, item), item, state)
            result.done.append(item)
        except OSError as exc:
            result.failed[item] = classify(f"{exc.strerror}", exc.errno, None, _failed_path(exc, target, item),
                                           "copy failed")

    @staticmethod
    def _finish_directories(tree: SafeTree, directories: list[tuple[str, os.stat_result]],
                            result: TransferResult) -> None:
        """Give the copied directories their modes and times, deepest first; a failure is the item's."""
        for item, st in sorted(directories, key=lambda pair: pair[0].count("/"), reverse=True):
            try:
                tree.set_directory(item, stat.S_IMODE(st.st_mode), st.st_atime_ns, st.st_mtime_ns)
            except OSError as exc:
                result.failed[item] = classify(f"{exc.strerror}", exc.errno, None,
                                               _failed_path(exc, tree.root, item), "cannot set its mode and time")

    def _copy_one(self, src: str, item: str, state: _Copying) -> None:
        st = os.lstat(src)
        if stat.S_ISDIR(st.st_mode):
            state.tree.directory(item)
            state.directories.append((item, st))
            return
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and self.link_mode == "copy":
            first = state.first_names.setdefault((st.st_dev, st.st_ino), item)
            if first != item:
                state.tree.link(first, item)
                return
        if stat.S_ISLNK(st.st_mode):
            state.tree.symlink(os.readlink(src), item, st.st_atime_ns, st.st_mtime_ns)
        elif self.link_mode == "hardlink":
            state.tree.link_from(src, item)
        else:
            self._copy_file(src, item, st, state.tree)

    def _copy_file(self, src: str, item: str, st: os.stat_result, tree: SafeTree) -> None:
        """Copy the regular file ``src`` (lstat ``st``) to a new file ``item`` of ``tree`` (whatever stood there
        is unlinked, never written through), with its mode and times."""
        with open(src, "rb", opener=_no_follow) as fin:
            fd = tree.create(item)
            with open(fd, "wb") as fout:
                if not (self.link_mode == "reflink" and _cloned(fin, fout)):
                    shutil.copyfileobj(fin, fout, _COPY_CHUNK)
                fout.flush()
                os.fchmod(fd, stat.S_IMODE(st.st_mode))
                os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))

    def list(self, path: str) -> list[RemoteEntry]:
        if not os.path.isdir(path):
            raise RemotePathMissingError("directory does not exist", path, "check the path")
        entries = []
        for current, dirs, files in os.walk(path):
            for name in sorted(dirs) + sorted(files):
                full = os.path.join(current, name)
                entries.append(_entry(os.path.relpath(full, path), full))
        return entries

    def stat(self, path: str) -> RemoteEntry | None:
        return _entry("", path) if os.path.lexists(path) else None

    def mkdir(self, path: str) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise classify(exc.strerror or "", exc.errno, None, path, "cannot create directory") from None


@dataclass
class _Copying:
    """What one transfer has done so far: the destination's directories as checked, directories to finish,
    first names of inodes."""

    tree: SafeTree
    directories: list[tuple[str, os.stat_result]]
    first_names: dict[tuple[int, int], str]


_COPY_CHUNK = 1 << 20


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)


def _cloned(fin, fout) -> bool:
    """Whether ``fout`` could be made a reflink of ``fin`` (FICLONE); False where the file system cannot."""
    try:
        fcntl.ioctl(fout.fileno(), 0x40049409, fin.fileno())
        return True
    except OSError:
        return False


def _entry(rel: str, full: str) -> RemoteEntry:
    try:
        st = os.lstat(full)
    except OSError as exc:
        raise TransportError(f"cannot stat ({exc.strerror})", full) from None
    kind = "l" if stat.S_ISLNK(st.st_mode) else "d" if stat.S_ISDIR(st.st_mode) else "f"
    link = os.readlink(full) if kind == "l" else ""
    return RemoteEntry(rel, kind, st.st_size if kind == "f" else 0, stat.S_IMODE(st.st_mode), st.st_mtime_ns, link)


def _failed_path(exc: OSError, target: str, item: str) -> str:
    """The path a failed copy names: the destination when its file system is full or read-only (shutil puts the
    source in ``filename`` and the destination in ``filename2``), else the path the error carries."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return os.fsdecode(exc.filename2) if exc.filename2 else os.path.join(target, item)
    return os.fsdecode(exc.filename) if exc.filename else os.path.join(target, item)
