"""Small files carried inline in one message: read stably, written through a SafeTree via `.pallet-partial`."""
from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

from .errors import DestinationError, SourceError, StreamError
from .reserved import PARTIAL_DIR
from .safe_tree import SafeTree
from .safety import safe_mode

STABLE_TRIES = 3            # a file that changes while read is read again, this many times at most


@dataclass(frozen=True)
class InlineFile:
    """One entry carried inline: path relative to the operation's root, mode, mtime (ns), size and the
    xxh3-128 digest (hex) of its bytes; ``kind`` ``f`` (a file, its bytes follow) or ``d`` (a directory of a
    selection, no bytes)."""

    path: str
    mode: int
    mtime_ns: int
    size: int
    digest: str
    kind: str = "f"

    def row(self) -> list:
        return [self.path, self.kind, self.mode, self.mtime_ns, self.size, self.digest]

    @classmethod
    def from_row(cls, row: list) -> InlineFile:
        path, kind, mode, mtime_ns, size, digest = row
        if kind not in ("f", "d") or int(size) < 0:
            raise ValueError(f"not an inline entry: {row!r}")
        return cls(str(path), int(mode), int(mtime_ns), int(size) if kind == "f" else 0, str(digest), str(kind))


@dataclass(frozen=True)
class InlineDirectory:
    """A directory made if missing and given this mode and mtime (ns) once the files are in."""

    path: str
    mode: int
    mtime_ns: int


def selection_entries(root: str, items: Iterable[str]) -> tuple[list[tuple[str, os.stat_result]], list[str]]:
    """What a selection of ``items`` below ``root`` holds, each entry with its lstat, never following a link:
    for each item its parent directories below ``root`` (outermost first, once each), the item, and, for a
    directory, everything below it; and the items that do not exist."""
    entries: list[tuple[str, os.stat_result]] = []
    missing: list[str] = []
    parents: set[str] = set()
    for rel in items:
        full = os.path.join(root, rel)
        try:
            info = os.lstat(full)
        except (FileNotFoundError, NotADirectoryError):
            missing.append(rel)
            continue
        entries += _parents(root, rel, parents)
        entries.append((rel, info))
        if stat.S_ISDIR(info.st_mode):
            for top, names, filenames in os.walk(full):
                for name in names + filenames:
                    path = os.path.join(top, name)
                    entries.append((os.path.join(rel, os.path.relpath(path, full)), os.lstat(path)))
    return entries, missing


def _parents(root: str, rel: str, seen: set[str]) -> list[tuple[str, os.stat_result]]:
    """The directories between ``root`` and ``rel`` not in ``seen`` (added to it), outermost first."""
    found, head = [], os.path.dirname(rel)
    while head and head not in seen:
        seen.add(head)
        found.append((head, os.lstat(os.path.join(root, head))))
        head = os.path.dirname(head)
    return found[::-1]


def digest(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def stable_read(path: str) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file ``path`` (never through a final link) and its stat, read again while its
    size or mtime changes during the read; SourceError when it keeps changing."""
    for _ in range(STABLE_TRIES):
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            before = os.fstat(fd)
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            after = os.fstat(fd)
        finally:
            os.close(fd)
        data = b"".join(chunks)
        if (before.st_size, before.st_mtime_ns) == (after.st_size, after.st_mtime_ns) and len(data) == after.st_size:
            if not stat.S_ISREG(after.st_mode):
                raise SourceError("not a regular file", path, "select regular files and directories")
            return data, after
    raise SourceError("the file keeps changing while it is read", path, "rerun once whatever writes it is done")


def write_inline(root: str, files: Iterable[InlineFile], body: memoryview, dirs: Iterable[InlineDirectory],
                 where: str) -> tuple[int, int]:
    """Write ``files`` (their bytes one after another in ``body``) under ``root``, then give ``dirs`` their mode
    and mtime; ``(files, bytes)`` written.

    Each file's bytes are checked against its digest (StreamError naming it,
    ``where`` the peer, when they differ) and written into
    ``.pallet-partial/`` of its directory under a name of this process,
    given its mode (without setuid/setgid) and mtime, then renamed over its
    name: a name holds its old content or the whole new one, never a part.
    Every directory is entered through descriptors (bundles.safe_tree), so
    nothing is written through a link. Temporaries a dead process left in a
    ``.pallet-partial`` this call uses are removed, and so is the directory
    once empty. The caller holds ``root``'s lock.
    """
    tree, heads, at, written, nbytes = SafeTree(root), set(), 0, 0, 0
    token = f"{os.getpid()}x{_host_tag()}"
    for number, entry in enumerate(files):
        if entry.kind == "d":
            tree.directory(entry.path)
            continue
        content = body[at:at + entry.size]
        at += entry.size
        if digest(content) != entry.digest:
            raise StreamError(f"{entry.path} arrived damaged (its digest differs)", where, "rerun the operation")
        head = entry.path.rpartition("/")[0]
        if head not in heads:
            heads.add(head)
            _sweep_partial(tree, head)
        _write_one(tree, entry, content, f"{_partial(head)}/{token}.{number}")
        written, nbytes = written + 1, nbytes + entry.size
    for head in heads:
        _remove_partial(tree, head)
    for directory in sorted(dirs, key=lambda d: d.path.count("/"), reverse=True):
        tree.directory(directory.path)
        tree.set_directory(directory.path, safe_mode(directory.mode), directory.mtime_ns, directory.mtime_ns)
    return written, nbytes


def _partial(head: str) -> str:
    return f"{head}/{PARTIAL_DIR}" if head else PARTIAL_DIR


def _write_one(tree: SafeTree, entry: InlineFile, content: memoryview, temporary: str) -> None:
    fd = tree.create(temporary)
    try:
        while content:
            content = content[os.write(fd, content):]
        os.fchmod(fd, safe_mode(entry.mode))
        os.utime(fd, ns=(entry.mtime_ns, entry.mtime_ns))
    finally:
        os.close(fd)
    with tree.parent(temporary) as (holding, name), tree.parent(entry.path) as (directory, final):
        try:
            os.rename(name, final, src_dir_fd=holding, dst_dir_fd=directory)
        except OSError as exc:
            os.unlink(name, dir_fd=holding)
            raise DestinationError(f"cannot put a file in place ({exc.strerror})", tree.path(entry.path),
                                   "remove or rename what stands there (a directory?), then rerun") from None


def _sweep_partial(tree: SafeTree, head: str) -> None:
    """Remove the temporaries that dead processes of this host left in ``head``'s ``.pallet-partial`` (named
    PIDxHOST.N, HOST a tag of the host's name: a shared file system's other hosts have processes of their own)."""
    try:
        fd = tree.open_directory(_partial(head), make=False)
    except OSError:
        return
    try:
        for name in os.listdir(fd):
            owner, _, host = name.partition(".")[0].partition("x")
            if owner.isdigit() and host == _host_tag() and not _alive(int(owner)):
                os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)


def _remove_partial(tree: SafeTree, head: str) -> None:
    """Remove ``head``'s ``.pallet-partial`` when empty (another operation's temporaries keep it)."""
    try:
        with tree.parent(_partial(head), make=False) as (directory, name):
            os.rmdir(name, dir_fd=directory)
    except OSError:
        pass


def _host_tag() -> str:
    return xxhash.xxh32_hexdigest(socket.gethostname().encode())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
