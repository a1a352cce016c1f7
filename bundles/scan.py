"""Walk a local source tree into the entry columns of a new index, in bundle stream order."""
from __future__ import annotations

import os
import stat
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from . import native
from .errors import SourceError
from .index import Index
from .parallel import WorkerPool, default_jobs, jobs_for
from .reserved import reserved_problem
from .tarformat import Kind


@dataclass
class SourceTree:
    """A walked source: ``root`` (bytes) joined with each index path gives the file to read."""

    root: bytes
    index: Index


def scan(src: str | os.PathLike, codec: str, level: int, exclude: frozenset[bytes] = frozenset(),
         include: frozenset[bytes] | None = None, pool: WorkerPool | None = None) -> SourceTree:
    """Walk ``src`` (a directory or one file) into an Index holding its entries in stream order.

    Only entry columns are filled (hashes, shards and offsets come from the
    writer). Names are listed by this thread. A ``pool`` (the packer's) is
    started as soon as the walk has found enough names for packing them to
    use workers, so that the workers start while the walk goes on; they
    then share the ``lstat`` calls. Otherwise those run in this thread. Raises SourceError for a missing or
    unreadable source, and one SourceError listing every special file
    (device, FIFO, socket) and every symlink pointing outside the tree,
    since no bundle may carry those. ``exclude`` holds relative names
    (bytes, as the index stores them) of non-directories to leave out —
    e.g. the large files a hybrid push sends individually. ``include``,
    when given, selects relative names instead of the whole tree: those
    files (a directory brings everything under it) and their parent
    directories, in the same stream order; SourceError lists names that do
    not exist or leave the tree.
    """
    top = os.fsencode(src)
    try:
        st = os.stat(top)
    except FileNotFoundError:
        raise SourceError("does not exist", src, "check the path") from None
    except OSError as exc:
        raise SourceError(f"cannot read ({exc.strerror})", src, "check its permissions") from None
    engine = native.module()
    if stat.S_ISDIR(st.st_mode) and include is None and not exclude and engine is not None:
        return _scan_natively(engine, src, top, Index(codec, level, 0), pool)
    if stat.S_ISDIR(st.st_mode):
        root, names = top, (_walk(top, _warm_up(pool)) if include is None else _selected(top, include))
        if exclude:
            names = [name for name in names if name not in exclude]
    else:
        root, name = os.path.split(os.path.abspath(top))
        names = [name]
    index = Index(codec, level, 0)
    index.paths = names
    problems: list[str] = []
    multi_linked: list[tuple[int, int, int]] = []
    if pool is not None:
        _warm_up(pool)(len(names))
    chunks = (StatChunk(root, start, names[start:start + _STAT_CHUNK]) for start in range(0, len(names), _STAT_CHUNK))
    stats = pool.map(_stat_chunk, chunks) if pool is not None and pool.started else map(_stat_chunk, chunks)
    for chunk in stats:
        _add_chunk(index, chunk, multi_linked, problems)
    _link_hard_links(index, multi_linked)
    if problems:
        raise SourceError("cannot be packed:\n" + "\n".join(f"  - {p}" for p in problems), src,
                          "remove or replace these entries, or pack a directory that does not hold them")
    return SourceTree(root, index)


def _scan_natively(engine, src, top: bytes, index: Index, pool: WorkerPool | None) -> SourceTree:
    """scan() of a whole directory by the native engine: walk and lstat on native threads; the entries it
    leaves to Python (symlinks, special files, reserved names, failed lstat calls) go through _stat_entry."""
    try:
        names, kinds, modes, mtimes, sizes, multi, attention = engine.scan_tree(top, default_jobs())
    except engine.NativeFailure as failure:
        _, path, number = failure.args
        raise SourceError(f"cannot list directory ({os.strerror(number)})", path,
                          "make it readable (chmod u+rx) or leave it out of the source") from None
    index.paths = names.split(b"\0") if names else []
    _warm_up(pool)(len(index.paths))
    index.kinds, index.modes, index.mtimes, index.sizes = (array(code, raw) for code, raw in
                                                          (("B", kinds), ("I", modes), ("q", mtimes), ("Q", sizes)))
    index.links = [b""] * len(index.paths)
    triples = array("Q", multi)
    multi_linked = [tuple(triples[k:k + 3]) for k in range(0, len(triples), 3)]
    problems: list[str] = []
    for n in array("Q", attention):
        rel = index.paths[n]
        one = _ChunkStats(n, array("B"), array("I"), array("q"), array("Q"), [], multi_linked, problems)
        _stat_entry(top + b"/" + rel, rel, n, one)
        index.kinds[n], index.modes[n], index.mtimes[n], index.sizes[n] = \
            one.kinds[0], one.modes[0], one.mtimes[0], one.sizes[0]
        index.links[n] = one.links[0]
    multi_linked.sort()
    _link_hard_links(index, multi_linked)
    if problems:
        raise SourceError("cannot be packed:\n" + "\n".join(f"  - {p}" for p in problems), src,
                          "remove or replace these entries, or pack a directory that does not hold them")
    return SourceTree(top, index)


_WHOLE = object()      # an included directory: everything under it


def _selected(root: bytes, include: frozenset[bytes]) -> list[bytes]:
    """Relative names of the ``include`` selection and its parent directories, in :func:`_walk`'s order."""
    tree: dict = {}
    problems = []
    for name in sorted(include):
        clean = os.path.normpath(name)
        if os.path.isabs(clean) or clean == b".." or clean.startswith(b"../") or clean == b".":
            problems.append(f"{os.fsdecode(name)}: not a relative path inside the source")
            continue
        try:
            is_dir = stat.S_ISDIR(os.lstat(os.path.join(root, clean)).st_mode)
        except OSError as exc:
            problems.append(f"{os.fsdecode(name)}: {exc.strerror}")
            continue
        *parents, last = clean.split(b"/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
            if node is _WHOLE:
                break
        else:
            node[last] = _WHOLE if is_dir else None
    if problems:
        raise SourceError("cannot select:\n" + "\n".join(f"  - {p}" for p in problems), os.fsdecode(root),
                          "list files that exist under the source, relative to it")
    names: list[bytes] = []
    _emit(root, tree, b"", names)
    return names


def _emit(root: bytes, node: dict, prefix: bytes, names: list[bytes]) -> None:
    names.extend(prefix + name for name in sorted(k for k, v in node.items() if v is None))
    for name in sorted(k for k, v in node.items() if v is not None):
        path = prefix + name
        names.append(path)
        if node[name] is _WHOLE:
            names.extend(path + b"/" + below for below in _walk(os.path.join(root, path)))
        else:
            _emit(root, node[name], path + b"/", names)


def _warm_up(pool: WorkerPool | None) -> Callable[[int], None]:
    """A callback that starts ``pool`` once a walk has found enough names for packing to use workers."""
    def found(count: int) -> None:
        if pool is not None and not pool.started and jobs_for(count * PACK_SECONDS_PER_ENTRY, 0) > 1:
            pool.start()
    return found


def _walk(root: bytes, found: Callable[[int], None] = lambda count: None) -> list[bytes]:
    """Relative names under ``root`` in stream order: each directory, then its files, then its subdirectories.

    This is depth-first preorder with names sorted, the order tar itself
    writes, so every directory precedes its contents and tar restores
    directory times correctly. ``found`` is told the number of names after
    each directory.
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
        found(len(names))
    return names


_STAT_CHUNK = 4096
PACK_SECONDS_PER_ENTRY = 12e-6      # lstat, header, open/read/close and hash of one small file, in Python
_MIN_MTIME, _MAX_MTIME = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class StatChunk:
    """Names to lstat, relative to ``root``; ``start`` is the entry number of the first one."""

    root: bytes
    start: int
    names: list[bytes]


@dataclass
class _ChunkStats:
    """Columns for names[start:start+len(kinds)]; ``multi_linked`` holds (entry, dev, ino) of nlink > 1 files."""

    start: int
    kinds: array
    modes: array
    mtimes: array
    sizes: array
    links: list
    multi_linked: list
    problems: list


def _stat_chunk(chunk: StatChunk) -> _ChunkStats:
    """lstat (and readlink) one chunk of names, in a worker or inline."""
    root = chunk.root + b"/"
    out = _ChunkStats(chunk.start, array("B"), array("I"), array("q"), array("Q"), [], [], [])
    for n, rel in enumerate(chunk.names, chunk.start):
        _stat_entry(root + rel, rel, n, out)
    return out


def _stat_entry(path: bytes, rel: bytes, n: int, out: _ChunkStats) -> None:
    """lstat (and readlink) entry ``n``, named ``rel``, and append its columns and problems to ``out``."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise SourceError(f"cannot stat ({exc.strerror})", path,
                          "check its permissions, or pack again when nothing is changing the source") from None
    if b".pallet" in rel and reserved_problem(rel):
        out.problems.append(f"{os.fsdecode(rel)!r}: {reserved_problem(rel)}")
    mode, size, link = st.st_mode, 0, b""
    if stat.S_ISREG(mode):
        kind, size = Kind.FILE, st.st_size
        if st.st_nlink > 1:
            out.multi_linked.append((n, st.st_dev, st.st_ino))
    elif stat.S_ISDIR(mode):
        kind = Kind.DIR
    elif stat.S_ISLNK(mode):
        kind, link = Kind.SYMLINK, os.readlink(path)
        if not link_stays_inside(rel, link):
            out.problems.append(f"{os.fsdecode(rel)!r}: symlink to {os.fsdecode(link)!r} points outside the tree")
    else:
        kind = Kind.FILE
        out.problems.append(f"{os.fsdecode(rel)!r}: special file (device, FIFO or socket)")
    mtime = st.st_mtime_ns
    if not _MIN_MTIME <= mtime <= _MAX_MTIME:
        out.problems.append(f"{os.fsdecode(rel)!r}: mtime is beyond the year 2262 (not representable)")
        mtime = 0
    out.kinds.append(kind)
    out.modes.append(stat.S_IMODE(mode))
    out.mtimes.append(mtime)
    out.sizes.append(size)
    out.links.append(link)


def _add_chunk(index: Index, chunk: _ChunkStats, multi_linked: list, problems: list) -> None:
    index.kinds.extend(chunk.kinds)
    index.modes.extend(chunk.modes)
    index.mtimes.extend(chunk.mtimes)
    index.sizes.extend(chunk.sizes)
    index.links.extend(chunk.links)
    multi_linked.extend(chunk.multi_linked)
    problems.extend(chunk.problems)


def _link_hard_links(index: Index, multi_linked: list[tuple[int, int, int]]) -> None:
    """Turn every later file sharing an inode into a hard link to the first one."""
    index.link_groups = array("q", [-1]) * len(index.paths)
    leaders: dict[tuple[int, int], int] = {}
    for n, dev, ino in multi_linked:
        leader = leaders.setdefault((dev, ino), n)
        if leader != n:
            index.link_groups[leader] = leader
            index.link_groups[n] = leader
            index.kinds[n] = Kind.HARDLINK
            index.sizes[n] = 0
            index.links[n] = index.paths[leader]


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
