"""Walk a local source tree into the entry columns of a new index, in bundle stream order."""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from .errors import SourceError
from .index import Index
from .tarformat import Kind


@dataclass
class SourceTree:
    """A walked source: ``root`` (bytes) joined with each index path gives the file to read."""

    root: bytes
    index: Index


def scan(src: str | os.PathLike, codec: str, level: int) -> SourceTree:
    """Walk ``src`` (a directory or one file) into an Index holding its entries, directories first.

    Only entry columns are filled (hashes, shards and offsets come from the
    writer). Raises SourceError for a missing or unreadable source, and one
    SourceError listing every special file (device, FIFO, socket) and every
    symlink pointing outside the tree, since no bundle may carry those.
    """
    top = os.fsencode(src)
    try:
        st = os.stat(top)
    except FileNotFoundError:
        raise SourceError("does not exist", src, "check the path") from None
    except OSError as exc:
        raise SourceError(f"cannot read ({exc.strerror})", src, "check its permissions") from None
    index = Index(codec, level, 0)
    if stat.S_ISDIR(st.st_mode):
        root, dirs, others = top, [], []
        _walk(top, b"", dirs, others)
    else:
        root, name = os.path.split(os.path.abspath(top))
        dirs, others = [], [(name, os.lstat(top))]
    problems: list[str] = []
    for rel, entry_stat in dirs:
        _append(index, rel, Kind.DIR, entry_stat, b"", -1)
    leaders: dict[tuple[int, int], int] = {}
    for rel, entry_stat in others:
        _append_other(index, root, rel, entry_stat, leaders, problems)
    if problems:
        raise SourceError("cannot be packed:\n" + "\n".join(f"  - {p}" for p in problems), src,
                          "remove or replace these entries, or pack a directory that does not hold them")
    return SourceTree(root, index)


def _walk(root: bytes, rel: bytes, dirs: list, others: list) -> None:
    stack = [rel]
    while stack:
        current = stack.pop()
        full = os.path.join(root, current) if current else root
        try:
            with os.scandir(full) as it:
                children = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            raise SourceError(f"cannot list directory ({exc.strerror})", full,
                              "make it readable (chmod u+rx) or leave it out of the source") from None
        subdirs = []
        for child in children:
            child_rel = current + b"/" + child.name if current else child.name
            try:
                child_stat = child.stat(follow_symlinks=False)
            except OSError as exc:
                raise SourceError(f"cannot stat ({exc.strerror})", child.path, "check its permissions") from None
            if stat.S_ISDIR(child_stat.st_mode):
                dirs.append((child_rel, child_stat))
                subdirs.append(child_rel)
            else:
                others.append((child_rel, child_stat))
        stack.extend(reversed(subdirs))


def _append(index: Index, rel: bytes, kind: Kind, st: os.stat_result, link: bytes, group: int) -> None:
    index.paths.append(rel)
    index.kinds.append(int(kind))
    index.modes.append(stat.S_IMODE(st.st_mode))
    index.mtimes.append(st.st_mtime_ns)
    index.sizes.append(st.st_size if kind == Kind.FILE else 0)
    index.links.append(link)
    index.link_groups.append(group)


def _append_other(index: Index, root: bytes, rel: bytes, st: os.stat_result,
                  leaders: dict, problems: list[str]) -> None:
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        target = os.readlink(os.path.join(root, rel))
        if not link_stays_inside(rel, target):
            problems.append(f"{os.fsdecode(rel)!r}: symlink to {os.fsdecode(target)!r} points outside the tree")
        _append(index, rel, Kind.SYMLINK, st, target, -1)
    elif stat.S_ISREG(mode):
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in leaders:
            leader = leaders[key]
            index.link_groups[leader] = leader
            _append(index, rel, Kind.HARDLINK, st, index.paths[leader], leader)
        else:
            if st.st_nlink > 1:
                leaders[key] = len(index.paths)
            _append(index, rel, Kind.FILE, st, b"", -1)
    else:
        problems.append(f"{os.fsdecode(rel)!r}: special file (device, FIFO or socket)")


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
