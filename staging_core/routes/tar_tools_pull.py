"""Pull over the tar-tools route: the far side's own ``tar -c`` streams what differs here, md5sum checks it."""
from __future__ import annotations

import os
import stat
import threading
from collections import defaultdict
from collections.abc import Sequence

from bundles.codecs import get_codec
from bundles.errors import BundleError, DestinationError, SourceError, StreamError
from bundles.plain import StreamedArchive, extract_plain
from bundles.progress import Progress
from bundles.safety import safe_mode
from bundles.state import finish, mark_incomplete
from mpi_stager.wire import FarEntry, check_tar_tools_line, tar_tools_script

from staging_core.routes.tar_tools import (COMPRESSORS, ROUNDS, FarTree, TarToolsOutcome, TarToolsRoute, far_tree,
                                           md5_of)
from staging_core.transports.base import Endpoint, Transport
from staging_core.transports.errors import classify

def pull_tar_tools(transport: Transport, endpoint: Endpoint, route: TarToolsRoute, dest: str, jobs: int,
                   progress: Progress, items: Sequence[str] | None = None) -> TarToolsOutcome:
    """Make local ``dest`` (locked by the caller) equal the tree at ``endpoint`` with the far side's own tools.

    The far side lists its tree and hashes every file; entries missing here
    or different (type, size, mode, mtime, link target, md5, hard-link
    group) come as one tar stream from its ``tar -c`` (with their parent
    directories), kept in DEST/.pallet/incoming and extracted by pallet's
    safe extractor as it arrives; what was received is hashed again here. What still
    differs is fetched once more, then it is an error naming the files.
    Directories whose mode or mtime alone differ are fixed here. ``items``
    (relative paths of files) limits all this to those and their parents.
    """
    far = far_tree(transport, endpoint.path, [])
    if items is not None:
        far = _selected(far, items)
    _refuse_special(far, endpoint)
    same = unchanged_here(far, dest)
    if same:
        far.md5 = far_tree(transport, endpoint.path, same).md5
    outcome = TarToolsOutcome()
    wanted = local_differences(far, dest, jobs)
    _count_files(far, wanted, outcome)
    while wanted:
        if outcome.rounds == ROUNDS:
            raise DestinationError(f"{len(wanted)} file(s) differ from the source after {ROUNDS} fetches: "
                                   f"{', '.join(os.fsdecode(p) for p in wanted[:5])}", dest,
                                   "check this file system and the source; rerun to try again")
        outcome.rounds += 1
        names = _with_parents(far, wanted)
        _unlink_non_directories(far, dest, names)
        outcome.bytes_sent += _fetch(transport, endpoint, route, dest, names, progress)
        fetched = [path for path in wanted if far.entries[path].kind == "f"]
        far.md5.update(far_tree(transport, endpoint.path, fetched).md5)      # what the far side holds now
        _fix_directories(far, dest, set(names))
        wanted = local_differences(far, dest, jobs, only=set(wanted))
    _fix_directories(far, dest, set())
    return outcome


def _count_files(far: FarTree, wanted: list[bytes], outcome: TarToolsOutcome) -> None:
    """Count the source's regular files missing or different here (``wanted``) as fetched, the others as in
    place, as every route counts them."""
    fetching = set(wanted)
    for path, there in far.entries.items():
        if there.kind == "f":
            if path in fetching:
                outcome.files_sent += 1
                outcome.file_bytes += there.size
            else:
                outcome.in_place += 1


def unchanged_here(far: FarTree, dest: str) -> list[bytes]:
    """Far files that ``dest`` holds with the same size, mtime and mode: only their content is in doubt."""
    here = local_entries(dest)
    return [path for path, there in far.entries.items() if there.kind == "f" and (mine := here.get(path)) is not None
            and mine.kind == "f" and (mine.size, mine.mtime_ns, mine.mode) == (there.size, there.mtime_ns, there.mode)]


def _selected(far: FarTree, items: Sequence[str]) -> FarTree:
    """The part of ``far`` that ``items`` name, with their parent directories."""
    wanted = {os.fsencode(item).strip(b"/") for item in items}
    parents = {b"/".join(p.split(b"/")[:n]) for p in wanted for n in range(1, p.count(b"/") + 1)}
    missing = sorted(wanted - far.entries.keys())
    if missing:
        raise SourceError(f"{len(missing)} selected file(s) do not exist there: "
                          f"{', '.join(os.fsdecode(p) for p in missing[:5])}", hint="check the names")
    return FarTree({p: e for p, e in far.entries.items() if p in wanted or p in parents}, far.md5)


def local_differences(far: FarTree, dest: str, jobs: int, only: set[bytes] | None = None) -> list[bytes]:
    """Far entries (of ``only``, when given) that ``dest`` lacks or holds otherwise, whole hard-link groups."""
    here = local_entries(dest)
    wanted, compare = [], []
    for path, there in far.entries.items():
        if only is not None and path not in only or there.kind == "d":
            continue
        mine = here.get(path)
        if mine is None or mine.kind != there.kind or (there.kind == "l" and mine.target != there.target):
            wanted.append(path)
        elif there.kind == "f":
            if (mine.size, mine.mtime_ns, mine.mode) != (there.size, there.mtime_ns, there.mode):
                wanted.append(path)
            else:
                compare.append(path)
    digests = md5_of(os.fsencode(dest), compare, jobs)
    wanted += [path for path in compare if digests[path] != far.md5.get(path)]
    wanted += [path for path, there in far.entries.items() if there.kind == "d" and path not in here
               and (only is None or path in only)]
    return sorted(_whole_groups(far, here, wanted), key=lambda p: p.split(b"/"))


def local_entries(dest: str) -> dict[bytes, FarEntry]:
    """The tree under ``dest`` (without DEST/.pallet) in the form of the far side's listing."""
    root, found = os.fsencode(dest), {}
    for top, dirs, files in os.walk(root):
        if top == root and b".pallet" in dirs:
            dirs.remove(b".pallet")
        for name in dirs + files:
            path = os.path.join(top, name)
            st = os.lstat(path)
            kind = _KINDS.get(stat.S_IFMT(st.st_mode), "?")
            found[os.path.relpath(path, root)] = FarEntry(kind, st.st_mode & 0o7777, st.st_mtime_ns, st.st_size,
                                                          os.readlink(path) if kind == "l" else b"", st.st_ino,
                                                          st.st_nlink)
    return found


_KINDS = {stat.S_IFREG: "f", stat.S_IFDIR: "d", stat.S_IFLNK: "l"}


def _whole_groups(far: FarTree, here: dict[bytes, FarEntry], wanted: list[bytes]) -> set[bytes]:
    """``wanted`` plus every member of a far hard-link group that is wanted or is not one inode here."""
    groups: dict[int, list[bytes]] = defaultdict(list)
    for path, there in far.entries.items():
        if there.kind == "f" and there.links > 1:
            groups[there.inode].append(path)
    chosen = set(wanted)
    for members in groups.values():
        inodes = {here[m].inode if m in here else None for m in members}
        if len(inodes) > 1 or None in inodes or chosen.intersection(members):
            chosen.update(members)
    return chosen


def _with_parents(far: FarTree, wanted: list[bytes]) -> list[bytes]:
    """``wanted`` and every directory above them, parents first (tar then restores their metadata)."""
    names = set(wanted)
    for path in wanted:
        parts = path.split(b"/")
        names.update(b"/".join(parts[:n]) for n in range(1, len(parts)))
    return sorted(names, key=lambda p: p.split(b"/"))


def _fetch(transport: Transport, endpoint: Endpoint, route: TarToolsRoute, dest: str, names: list[bytes],
           progress: Progress) -> int:
    """Extract ``names`` from the far side's tar stream into ``dest`` as it arrives; return the bytes received."""
    far = transport.stream_into(["sh", "-c", tar_tools_script("send"), "pallet-send", endpoint.path,
                                 COMPRESSORS[route.codec]])
    feeder = threading.Thread(target=_feed, args=(far.stdin, names), name="pallet-tar-names", daemon=True)
    feeder.start()
    errors: list[bytes] = []
    drain = threading.Thread(target=lambda: errors.append(far.stderr.read()), name="pallet-tar-stderr", daemon=True)
    drain.start()
    _check_version(far, endpoint)
    wire = _CountingReader(far.stdout)
    archive = StreamedArchive(f"{endpoint.url()} (its tar -c)", get_codec(route.codec), wire)
    try:
        mark_incomplete(dest, f"pallet is pulling {endpoint.url()} here; if this file remains, the pull did not "
                              "finish: run it again")
        extract_plain(archive, dest, progress)
    except BundleError:
        far.kill()                              # the far side's own message, if it has one, says more
        if far.wait() == 0:
            raise
    except BaseException:                       # an interrupt, or an error here: its tar is read no more
        far.stop()                              # (with our end of its output closed, its channel closes)
        far.stdout.close()
        raise
    finally:
        code = far.wait()
        if not far.stdout.closed:               # else its threads end as the channel closes: not waited for
            feeder.join()
            drain.join()
            far.stdout.close()
    if code != 0:
        raise classify(b"".join(errors).decode(errors="replace"), code, ["tar", "-c"], endpoint.url(),
                       f"the far side's tar failed with status {code}")
    finish(dest)
    return wire.count


def _check_version(far, endpoint: Endpoint) -> None:
    """Read the "send" script's version line (mpi_stager.wire); one that is not this version's stops it there."""
    try:
        check_tar_tools_line(far.stdout.readline(), endpoint.url())
    except StreamError:
        far.stop()
        far.stdout.close()
        far.wait()
        raise


class _CountingReader:
    """A pipe's reader that counts the bytes read through it."""

    def __init__(self, pipe):
        self.pipe, self.count = pipe, 0

    def read(self, size: int = -1) -> bytes:
        data = self.pipe.read(1 << 20 if size < 0 else size)
        self.count += len(data)
        return data


def _unlink_non_directories(far: FarTree, dest: str, names: list[bytes]) -> None:
    """Remove files and links here that stand where the source has a directory (a link is removed, never
    followed), so that the extraction can make the directory."""
    root = os.fsencode(dest)
    for name in names:
        if far.entries[name].kind != "d":
            continue
        path = os.path.join(root, name)
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                os.unlink(path)
        except FileNotFoundError:
            pass


def _feed(pipe, names: list[bytes]) -> None:
    try:
        for name in names:
            pipe.write(b"./" + name + b"\0")
        pipe.close()
    except BrokenPipeError:
        pass                                    # the far side stopped; its status says why


def _fix_directories(far: FarTree, dest: str, extracted: set[bytes]) -> None:
    """Give directories here the far side's mode and mtime (deepest first), except those tar just restored."""
    root = os.fsencode(dest)
    for path in sorted((p for p, e in far.entries.items() if e.kind == "d" and p not in extracted),
                       key=lambda p: p.count(b"/"), reverse=True):
        there, full = far.entries[path], os.path.join(root, path)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            continue
        if st.st_mode & 0o7777 != there.mode:
            os.chmod(full, safe_mode(there.mode))
        if st.st_mtime_ns != there.mtime_ns:
            os.utime(full, ns=(there.mtime_ns, there.mtime_ns), follow_symlinks=False)


def _refuse_special(far: FarTree, endpoint: Endpoint) -> None:
    special = [os.fsdecode(p) for p, e in far.entries.items() if e.kind not in ("f", "d", "l")]
    if special:
        raise SourceError(f"{len(special)} special file(s) (devices, FIFOs, sockets) cannot be pulled: "
                          f"{', '.join(special[:5])}", endpoint.url(), "remove them or pull a directory without them")
