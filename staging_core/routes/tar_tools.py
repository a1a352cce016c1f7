"""The tar-tools route: a bundle streamed into the far side's own tar (zstd or gzip there), checked with md5sum."""
from __future__ import annotations

import hashlib
import os
from binascii import unhexlify
from dataclasses import dataclass, field
from typing import cast

from bundles.errors import SourceError
from bundles.scan import SourceTree
from bundles.tarformat import Kind
from mpi_stager.wire import MANIFEST_END, FarEntry, parse_records, strip_tar_tools_line, tar_tools_script

from staging_core.locking import DestinationLock
from staging_core.routes.base import TAR_TOOLS, Route, carries, declaring
from staging_core.routes.tar_tools_session import SessionLock, SessionSlot
from staging_core.transports.base import Endpoint, Transport

MD5_CHUNK = 256                  # files per local hashing task
SECOND = 1_000_000_000
ROUNDS = 2                       # a file still wrong after this many sends is an error

DECODERS = {"zstd": "zstd -dc", "gzip": "gzip -dc", "none": "cat"}
COMPRESSORS = {"zstd": "zstd -q -c", "gzip": "gzip -c", "none": "cat"}


@dataclass
class FarTree:
    """The far side's entries (relative paths as bytes) and the md5 digests it computed."""

    entries: dict[bytes, FarEntry] = field(default_factory=dict)
    md5: dict[bytes, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class TarToolsRoute(Route):
    """Bundles go into the far side's own ``tar -x``, decoded there with ``codec``'s standard tool."""

    host: str
    codec: str
    pulling: bool = False
    # The far-side session of a push that holds DEST's lock (session_lock): per operation, as the route is.
    sessions: SessionSlot = field(default_factory=SessionSlot, compare=False, repr=False)
    # What it declares (staging_core.routes.base.Route): only the tar-tools strategy carries a bundle through it,
    # which compares DEST itself and clears DEST/.pallet itself, over a transport that runs sh and streams.
    strategies = frozenset({TAR_TOOLS})
    needs = frozenset({"remote_exec", "posix_shell", "streaming"})
    compares_dest_itself = True
    clears_state_itself = True

    @property
    def description(self) -> str:
        tools = (f"tar -c | {COMPRESSORS[self.codec]} at {self.host}" if self.pulling
                 else f"{DECODERS[self.codec]} | tar -x at {self.host}")
        return f"tar tools ({tools}, checked with md5sum; `pallet remote install {self.host}` gives the faster " \
               "pallet route)"

    def cleanup(self) -> None:
        """Nothing is left at the far side to remove (a pull's stream is never stored there)."""

    def close(self) -> None:
        """End a far-side session still open (its lock's exit ends it first; the route runs through the push's own
        transport)."""
        self.sessions.close(failed=True)

    def __exit__(self, *exc) -> None:
        self.close()


def session_lock(route: Route | None, endpoint: Endpoint, transport: Transport, wait: bool = False
                 ) -> DestinationLock | None:
    """DEST's lock for a push through the tar-tools ``route``, taken by the route's far-side session (which then
    lists DEST while the source is walked) instead of a separate lock command; None for other routes, pulls and
    local destinations (staging_core.locking.DestinationLock as before)."""
    if not carries(route, TAR_TOOLS) or endpoint.is_local or not transport.capabilities.remote_exec:
        return None
    tools = cast(TarToolsRoute, declaring(route, TAR_TOOLS))       # what listing tar-tools promises
    if tools.pulling:
        return None
    return SessionLock(tools.sessions, endpoint, transport, DECODERS[tools.codec], wait)


@dataclass
class TarToolsOutcome:
    """What a tar-tools push or pull did: the regular files it found differing and sent (``files_sent``, of
    ``file_bytes``; a file sent again in a later round counts once) and those it found in place, bytes moved,
    rounds run, seconds per stage."""

    files_sent: int = 0
    file_bytes: int = 0
    in_place: int = 0
    bytes_sent: int = 0
    rounds: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def route(self) -> str | None:
        """'already in place' when the run sent nothing (DEST held the source already), else None: the route's
        own description stands."""
        return None if self.rounds or self.bytes_sent else "already in place"


def unchanged_files(tree: SourceTree, far: FarTree, whole_seconds: bool = False) -> list[bytes]:
    """Files of ``tree`` the far side holds with the same size, mtime and mode: only their content is in doubt.
    ``whole_seconds``: a far mtime of the source's whole seconds is the same (see :func:`same_mtime`)."""
    index, entries = tree.index, far.entries
    same: list[bytes] = []
    if not entries:
        return same
    kinds, mtimes, modes = index.kinds, index.mtimes, index.modes
    for i, path in enumerate(index.paths):
        there = entries.get(path)
        if there is not None and there.kind == "f" and kinds[i] in _FILE_KINDS \
                and (there.size, there.mode) == (_size(index, i), modes[i] & 0o7777) \
                and same_mtime(there.mtime_ns, mtimes[i], whole_seconds):
            same.append(path)
    return same


def same_mtime(there_ns: int, source_ns: int, whole_seconds: bool) -> bool:
    """Whether a far mtime is the source's: equal, or with ``whole_seconds`` (a DEST written by the far side's
    own tar, which restores the whole seconds the bundle's tar headers carry) equal to its whole seconds,
    floor(source) (the nanoseconds restored from a pax record are equal too)."""
    return there_ns == source_ns or (whole_seconds and there_ns == source_ns - source_ns % SECOND)


def far_tree(transport: Transport, dest: str, hashed: list[bytes]) -> FarTree:
    """List the tree at ``dest`` there, with the md5 of the files ``hashed`` names (relative paths), by the
    tar-tools "list" script (mpi_stager.wire)."""
    names = b"".join(b"./" + path + b"\0" for path in hashed)
    output = transport.run(["sh", "-c", tar_tools_script("list"), "pallet-list", dest], stdin=names)
    return parse_far_tree(strip_tar_tools_line(output, dest))


def parse_far_tree(output: bytes) -> FarTree:
    """The FarTree that the "list" script printed after its version line: listing records, an "E" record, md5sum
    lines."""
    records, _, sums = output.partition(MANIFEST_END)
    return FarTree(parse_records(records), parse_md5_lines(sums))


def parse_md5_lines(text: bytes) -> dict[bytes, bytes]:
    """Relative path -> digest, from md5sum's lines for ``./name`` arguments."""
    digests = {}
    for line in text.split(b"\n"):         # only newlines end lines (older md5sum leaves a \r in names)
        if not line:
            continue
        if line[32:36] == b"  ./" and not line.startswith(b"\\"):     # the usual line: DIGEST  ./NAME
            digests[line[36:]] = unhexlify(line[:32])
        else:
            digest, name = _md5_line(line)
            digests[name.removeprefix(b"./")] = digest
    return digests


def differing(tree: SourceTree, local_md5: dict[bytes, bytes], far: FarTree, checked: set[bytes],
              whole_seconds: bool = False) -> list[bytes]:
    """Source entries the far tree lacks or holds otherwise (content compared for ``checked`` files only; a
    directory differs in mode or mtime; ``whole_seconds``: see :func:`same_mtime`)."""
    index, entries = tree.index, far.entries
    if not entries:
        return list(index.paths)
    wanted, kinds, mtimes, modes = [], index.kinds, index.mtimes, index.modes
    for i, path in enumerate(index.paths):
        there = entries.get(path)
        kind = kinds[i]
        if there is None or there.kind != _FIND_KIND[kind]:
            wanted.append(path)
        elif kind == Kind.SYMLINK:
            if there.target != index.links[i]:
                wanted.append(path)
        elif kind == Kind.DIR:
            if there.mode != modes[i] & 0o7777 or not same_mtime(there.mtime_ns, mtimes[i], whole_seconds):
                wanted.append(path)
        elif (there.size != _size(index, i) or not same_mtime(there.mtime_ns, mtimes[i], whole_seconds)
              or there.mode != modes[i] & 0o7777
              or (path in checked and far.md5.get(path) != local_md5.get(path))):
            wanted.append(path)
    return wanted


_FIND_KIND = {Kind.FILE: "f", Kind.HARDLINK: "f", Kind.DIR: "d", Kind.SYMLINK: "l"}   # by kind code (ints hash alike)
_FILE_KINDS = frozenset((Kind.FILE, Kind.HARDLINK))


def hash_local_files(tree: SourceTree, jobs: int, wanted: set[bytes]) -> dict[bytes, bytes]:
    """md5 of the ``wanted`` files of ``tree`` (a hard link shares its group's), hashed by ``jobs`` workers."""
    if not wanted:
        return {}
    index = tree.index
    first = {index.paths[i]: (index.paths[index.link_groups[i]] if index.kinds[i] == Kind.HARDLINK else index.paths[i])
             for i in range(len(index)) if index.paths[i] in wanted}
    digests = md5_of(tree.root, sorted(set(first.values())), jobs)
    return {path: digests[source] for path, source in first.items()}


def md5_of(root: bytes, paths: list[bytes], jobs: int) -> dict[bytes, bytes]:
    """md5 of each file ``paths`` (relative) names under ``root``, by ``jobs`` workers (0: automatic)."""
    from bundles.parallel import jobs_for, pool_for
    chunks = [MD5Chunk(root, paths[at:at + MD5_CHUNK]) for at in range(0, len(paths), MD5_CHUNK)]
    workers = jobs_for(len(paths) * 2e-5, jobs)
    digests: dict[bytes, bytes] = {}
    with pool_for(None, workers) as pool:
        for chunk, hashed in zip(chunks, pool.map(md5_files, chunks, workers == 1), strict=True):
            digests.update(zip(chunk.paths, hashed, strict=True))
    return digests


@dataclass(frozen=True)
class MD5Chunk:
    """A hashing task: files (relative, bytes) under ``root``."""

    root: bytes
    paths: list[bytes]


def md5_files(chunk: MD5Chunk) -> list[bytes]:
    """The md5 digests of ``chunk``'s files, read in 1 MiB pieces; a file that cannot be read is a SourceError."""
    digests = []
    for path in chunk.paths:
        full = os.path.join(chunk.root, path)
        hasher = hashlib.md5(usedforsecurity=False)
        try:
            with open(full, "rb") as handle:
                while piece := handle.read(1 << 20):
                    hasher.update(piece)
        except OSError as exc:
            raise SourceError(f"cannot read ({exc.strerror})", os.fsdecode(full), "check its permissions") from None
        digests.append(hasher.digest())
    return digests


def _size(index, i: int) -> int:
    return index.sizes[i] if index.kinds[i] == Kind.FILE else index.sizes[index.link_groups[i]]


def _md5_line(line: bytes) -> tuple[bytes, bytes]:
    """md5sum's ``DIGEST  NAME``; a leading backslash means NAME has \\\\, \\n or \\r escaped."""
    escaped = line.startswith(b"\\")
    digest, name = line[escaped:].split(b"  ", 1)
    if escaped:
        name = name.replace(b"\\\\", b"\0").replace(b"\\n", b"\n").replace(b"\\r", b"\r").replace(b"\0", b"\\")
    return bytes.fromhex(digest.decode()), name


def shown_names(paths: list[bytes]) -> str:
    shown = ", ".join(os.fsdecode(p) for p in paths[:5])
    return shown + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")


def with_link_groups(tree: SourceTree, wanted: list[bytes]) -> set[bytes]:
    """``wanted`` plus every member of the hard-link groups it touches (tar links them only together)."""
    index, chosen = tree.index, set(wanted)
    if Kind.HARDLINK not in index.kinds:
        return chosen
    groups = {index.link_groups[i] if index.kinds[i] == Kind.HARDLINK else i
              for i, path in enumerate(index.paths) if path in chosen}
    for i in range(len(index)):
        if index.kinds[i] == Kind.HARDLINK and index.link_groups[i] in groups:
            chosen.update((index.paths[i], index.paths[index.link_groups[i]]))
    return chosen

def link_groups(tree: SourceTree) -> list[list[bytes]]:
    """The names of each regular file of ``tree``, the first name first: one name, or a hard-link group's."""
    index = tree.index
    groups: dict[int, list[bytes]] = {i: [index.paths[i]] for i in index.positions(Kind.FILE)}
    for i in index.positions(Kind.HARDLINK):
        groups[index.link_groups[i]].append(index.paths[i])
    return list(groups.values())


def regrouped(groups: list[list[bytes]], entries: dict[bytes, FarEntry]) -> set[bytes]:
    """The names of the files DEST holds linked otherwise than the source: a hard-link group's names on more
    than one inode there, or an inode there with more (or fewer) names than the group, inside DEST or out of
    it (a file sharing its inode with one outside DEST is written through when changed). A name DEST lacks, or
    holds as another kind, is :func:`differing`'s; a listing without inodes says nothing here."""
    wrong: set[bytes] = set()
    for names in groups:
        found = [entries.get(name) for name in names]
        there = [entry for entry in found if entry is not None and entry.kind == "f" and entry.inode]
        if len(there) != len(names):
            continue
        if len({entry.inode for entry in there}) != 1 or there[0].links != len(names):
            wrong.update(names)
    return wrong

