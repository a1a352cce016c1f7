"""Walk a local source tree into the entry columns of a new index, in bundle stream order."""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from .errors import SourceError
from .index import Index
from .parallel import ordered_map
from .tarformat import Kind


@dataclass
class SourceTree:
    """A walked source: ``root`` (bytes) joined with each index path gives the file to read."""

    root: bytes
    index: Index


def scan(src: str | os.PathLike, codec: str, level: int, jobs: int = 1) -> SourceTree:
    """Walk ``src`` (a directory or one file) into an Index holding its entries in stream order.

    Only entry columns are filled (hashes, shards and offsets come from the
    writer). Names are listed by one process, their ``lstat`` calls are
    shared by ``jobs`` workers. Raises SourceError for a missing or
    unreadable source, and one SourceError listing every special file
    (device, FIFO, socket) and every symlink pointing outside the tree,
    since no bundle may carry those.
    """
    top = os.fsencode(src)
    try:
        st = os.stat(top)
    except FileNotFoundError:
        raise SourceError("does not exist", src, "check the path") from None
    except OSError as exc:
        raise SourceError(f"cannot read ({exc.strerror})", src, "check its permissions") from None
    if stat.S_ISDIR(st.st_mode):
        root, names = top, _walk(top)
    else:
        root, name = os.path.split(os.path.abspath(top))
        names = [name]
    stats = _lstat_all(root, names, jobs)
    index = Index(codec, level, 0)
    problems: list[str] = []
    leaders: dict[tuple[int, int], int] = {}
    for rel, entry_stat in zip(names, stats):
        _append_entry(index, root, rel, entry_stat, leaders, problems)
    if problems:
        raise SourceError("cannot be packed:\n" + "\n".join(f"  - {p}" for p in problems), src,
                          "remove or replace these entries, or pack a directory that does not hold them")
    return SourceTree(root, index)


def _walk(root: bytes) -> list[bytes]:
    """Relative names under ``root`` in stream order: each directory, then its files, then its subdirectories.

    This is depth-first preorder with names sorted, the order tar itself
    writes, so every directory precedes its contents and tar restores
    directory times correctly.
    """
    names, stack = [], [b""]
    while stack:
        current = stack.pop()
        full = os.path.join(root, current) if current else root
        if current:
            names.append(current)
        try:
            with os.scandir(full) as it:
                children = sorted((e.name, e.is_dir(follow_symlinks=False)) for e in it)
        except OSError as exc:
            raise SourceError(f"cannot list directory ({exc.strerror})", full,
                              "make it readable (chmod u+rx) or leave it out of the source") from None
        prefix = current + b"/" if current else b""
        names.extend(prefix + name for name, is_dir in children if not is_dir)
        stack.extend(prefix + name for name, is_dir in reversed(children) if is_dir)
    return names


_STAT_CHUNK = 4096
_stat_state: tuple[bytes, list[bytes]] | None = None


def _lstat_all(root: bytes, names: list[bytes], jobs: int) -> list[tuple]:
    chunks = range(0, len(names), _STAT_CHUNK)
    jobs = jobs if len(names) > 4 * _STAT_CHUNK else 1
    results: list[tuple] = []
    for part in ordered_map(_lstat_chunk, chunks, jobs, _init_stat, (root, names)):
        results += part
    return results


def _init_stat(root: bytes, names: list[bytes]) -> None:
    global _stat_state
    _stat_state = (root, names)


def _lstat_chunk(start: int) -> list[tuple]:
    root, names = _stat_state
    out = []
    for rel in names[start:start + _STAT_CHUNK]:
        path = os.path.join(root, rel)
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise SourceError(f"cannot stat ({exc.strerror})", path,
                              "check its permissions, or pack again when nothing is changing the source") from None
        out.append((st.st_mode, st.st_mtime_ns, st.st_size, st.st_nlink, st.st_dev, st.st_ino))
    return out


def _append_entry(index: Index, root: bytes, rel: bytes, st: tuple, leaders: dict, problems: list[str]) -> None:
    mode, mtime_ns, size, nlink, dev, ino = st
    if stat.S_ISDIR(mode):
        _append(index, rel, Kind.DIR, mode, mtime_ns, 0, b"", -1)
    elif stat.S_ISLNK(mode):
        target = os.readlink(os.path.join(root, rel))
        if not link_stays_inside(rel, target):
            problems.append(f"{os.fsdecode(rel)!r}: symlink to {os.fsdecode(target)!r} points outside the tree")
        _append(index, rel, Kind.SYMLINK, mode, mtime_ns, 0, target, -1)
    elif stat.S_ISREG(mode):
        if nlink > 1 and (dev, ino) in leaders:
            leader = leaders[(dev, ino)]
            index.link_groups[leader] = leader
            _append(index, rel, Kind.HARDLINK, mode, mtime_ns, 0, index.paths[leader], leader)
        else:
            if nlink > 1:
                leaders[(dev, ino)] = len(index.paths)
            _append(index, rel, Kind.FILE, mode, mtime_ns, size, b"", -1)
    else:
        problems.append(f"{os.fsdecode(rel)!r}: special file (device, FIFO or socket)")


def _append(index: Index, rel: bytes, kind: Kind, mode: int, mtime_ns: int, size: int, link: bytes,
            group: int) -> None:
    index.paths.append(rel)
    index.kinds.append(kind)
    index.modes.append(stat.S_IMODE(mode))
    index.mtimes.append(mtime_ns)
    index.sizes.append(size)
    index.links.append(link)
    index.link_groups.append(group)


def link_stays_inside(rel: bytes, target: bytes) -> bool:
    """True if symlink ``rel`` (relative to the tree root) with ``target`` resolves inside the tree."""
    if not target or target.startswith(b"/"):
        return False
    depth = rel.count(b"/")
    for part in target.split(b"/"):
        if part == b"..":
            depth -= 1
            if depth < 0:
                return False
        elif part not in (b"", b"."):
            depth += 1
    return True
