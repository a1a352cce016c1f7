"""A destination tree written only through directory descriptors: no write into it ever follows a link there."""
from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from bundles.state_fd import remove_entry

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class SafeTree:
    """The entries under one destination root, each reached from the root one directory descriptor at a time.

    Every directory on the way to an entry is opened relative to its
    parent's descriptor with ``O_NOFOLLOW``: a symbolic link there, planted
    before the run or swapped in while it runs, is never followed. When
    directories are made (``make``), a missing one is created (mode 0777
    less the umask; a copied directory gets its own mode later) and a link
    or file standing where a directory belongs is unlinked (the link
    itself, never what it points to) and the directory made in its place.
    Entries are then created, linked, changed and removed relative to their
    parent's descriptor, a stale non-directory at a name unlinked first. The
    root itself is the caller's word (it may be a link) and is made if
    missing. An OSError names the path under the root that it concerns.
    """

    def __init__(self, root: str):
        self.root = root
        self._made: set[str] = set()

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel not in ("", ".") else self.root

    def directory(self, rel: str) -> str:
        """Make ``rel`` and its parents as described above; return its path (for messages only)."""
        os.close(self.open_directory(rel))
        return self.path(rel)

    def open_directory(self, rel: str, make: bool = True) -> int:
        """A descriptor (the caller closes it) of the directory ``rel``, made first with ``make``."""
        rel = rel.strip("/")
        if not self._made:
            os.makedirs(self.root, exist_ok=True)
            self._made.add("")
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        parts = [part for part in rel.split("/") if part not in ("", ".")]
        try:
            for depth, name in enumerate(parts):
                child = self._enter(fd, name, "/".join(parts[:depth + 1]), make)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _enter(self, parent: int, name: str, rel: str, make: bool) -> int:
        try:
            try:
                child = os.open(name, _DIRECTORY, dir_fd=parent)
            except FileNotFoundError:
                if not make:
                    raise
                _make_directory(parent, name)
                child = os.open(name, _DIRECTORY, dir_fd=parent)
            except OSError as exc:
                if not make or exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                os.unlink(name, dir_fd=parent)          # a link or file where the source has a directory
                _make_directory(parent, name)
                child = os.open(name, _DIRECTORY, dir_fd=parent)
        except OSError as exc:
            exc.filename = self.path(rel)
            raise
        self._made.add(rel)
        return child

    @contextmanager
    def parent(self, item: str, make: bool = True) -> Iterator[tuple[int, str]]:
        """The open parent directory of ``item`` (made with ``make``) and the item's own name, for the block."""
        head, _, name = item.strip("/").rpartition("/")
        fd = self.open_directory(head, make)
        try:
            yield fd, name
        finally:
            os.close(fd)

    def create(self, item: str) -> int:
        """A new, empty file at ``item`` (mode 0600 until its own is set), opened for writing."""
        with self.parent(item) as (directory, name):
            try:
                return os.open(name, _NEW_FILE, 0o600, dir_fd=directory)
            except FileExistsError:
                self._unlink_stale(directory, name, item)
            return os.open(name, _NEW_FILE, 0o600, dir_fd=directory)

    def symlink(self, target: str | bytes, item: str, atime_ns: int, mtime_ns: int) -> None:
        """Make ``item`` a symbolic link to ``target`` with the given times."""
        with self.parent(item) as (directory, name):
            self._unlink_stale(directory, name, item)
            os.symlink(target, name, dir_fd=directory)
            os.utime(name, ns=(atime_ns, mtime_ns), dir_fd=directory, follow_symlinks=False)

    def link(self, existing: str, item: str) -> None:
        """Make ``item`` a hard link to the tree's ``existing`` entry."""
        with self.parent(existing, make=False) as (there, old), self.parent(item) as (directory, name):
            self._unlink_stale(directory, name, item)
            os.link(old, name, src_dir_fd=there, dst_dir_fd=directory, follow_symlinks=False)

    def link_from(self, source: str, item: str) -> None:
        """Make ``item`` a hard link to ``source``, a file outside the tree (``link_mode`` hardlink)."""
        with self.parent(item) as (directory, name):
            self._unlink_stale(directory, name, item)
            os.link(source, name, dst_dir_fd=directory, follow_symlinks=False)

    def set_directory(self, rel: str, mode: int, atime_ns: int, mtime_ns: int) -> None:
        """Give the directory ``rel`` ``mode`` and times, through its own descriptor."""
        fd = self.open_directory(rel, make=False)
        try:
            os.chmod(fd, mode)
            os.utime(fd, ns=(atime_ns, mtime_ns))
        finally:
            os.close(fd)

    def remove(self, item: str) -> None:
        """Remove ``item`` (a directory with what it holds), never following a link; missing is fine."""
        try:
            with self.parent(item, make=False) as (directory, name):
                remove_entry(directory, name)
        except FileNotFoundError:
            return

    def _unlink_stale(self, directory: int, name: str, item: str) -> None:
        """Remove the file or link at ``name`` if there is one; a real directory there is an error naming it."""
        try:
            if stat.S_ISDIR(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode):
                raise IsADirectoryError(errno.EISDIR, "a directory stands where the source has no directory",
                                        self.path(item))
            os.unlink(name, dir_fd=directory)
        except FileNotFoundError:
            pass


def _make_directory(parent: int, name: str) -> None:
    with suppress(FileExistsError):
        os.mkdir(name, 0o777, dir_fd=parent)
