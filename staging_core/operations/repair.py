"""What a whole-tree push must change at DEST: its tree compared with the source's (type, size, mtime, mode, link)."""
from __future__ import annotations

import contextlib
import errno
import os
import shlex
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from bundles.errors import DestinationError, UsageError
from bundles.safety import safe_mode
from bundles.scan import SourceTree
from bundles.state import STATE_DIR
from bundles.tarformat import Kind
from mpi_stager.wire import FIND_RECORDS, FarEntry, parse_records

from staging_core.transports.registry import capable, declared_capabilities
from staging_core.routes.tar_tools import (FarTree, differing, far_tree, hash_local_files, link_groups, md5_of,
                                           regrouped, unchanged_files, with_link_groups)
from staging_core.transports.base import Endpoint, RemoteEntry, Transport
from bundles.safe_tree import SafeTree

_KIND_LETTERS = {stat.S_IFREG: "f", stat.S_IFDIR: "d", stat.S_IFLNK: "l"}


@runtime_checkable
class DirectorySetter(Protocol):
    """Sets DEST's directories' mode and mtime itself (a push's far-side session)."""

    def set_directories(self, entries: list[tuple[bytes, int, int]]) -> None: ...


@dataclass
class Comparison:
    """DEST against the source: what to send (source paths, with whole hard-link groups; a directory only
    when DEST lacks it, as it is sent whole), the directories DEST holds with another mode or mtime, how
    many source entries DEST already holds as they are, and DEST's entries the source lacks (topmost only)."""

    to_send: list[bytes] = field(default_factory=list)
    dirs_to_fix: list[int] = field(default_factory=list)
    in_place: int = 0
    extra: list[bytes] = field(default_factory=list)
    stale: list[bytes] = field(default_factory=list)    # same size, mtime and mode, other content: removed first

    @property
    def nothing_to_send(self) -> bool:
        return not self.to_send


def compare_with_dest(transport: Transport, endpoint: Endpoint, tree: SourceTree,
                      checksum: bool = False, own_mark: bool = False, whole_seconds: bool = False
                      ) -> Comparison | None:
    """Compare ``tree`` with the tree at ``endpoint`` (DEST/.pallet left out): None when DEST cannot be listed
    with its metadata here (only local paths and ssh hosts can), or when it is empty or missing. With
    ``checksum`` the files whose metadata match are compared by md5 too (md5sum there over ssh); those that
    differ are ``stale``: removed before they are sent again, since a transport that skips files whose size
    and mtime match would skip them. ``own_mark``: DEST's INCOMPLETE marker is this operation's own (it is
    finishing), so DEST is listed all the same. ``whole_seconds``: DEST is written by the far side's own tar
    (the tar-tools route), so an mtime of the source's whole seconds there is the same (tar_tools.same_mtime)."""
    return compare_with_dest_entries(dest_entries(transport, endpoint, own_mark), transport, endpoint, tree,
                                     checksum, whole_seconds)


def compare_with_dest_entries(entries: dict[bytes, FarEntry] | None, transport: Transport, endpoint: Endpoint,
                              tree: SourceTree, checksum: bool = False, whole_seconds: bool = False
                              ) -> Comparison | None:
    """:func:`compare_with_dest` with DEST's ``entries`` already listed (a push's far-side session lists them)."""
    if not entries:
        return None
    index, far = tree.index, FarTree(entries)
    same = unchanged_files(tree, far, whole_seconds) if checksum else []
    if same:
        far.md5 = dest_md5(transport, endpoint, same)
    local_md5 = hash_local_files(tree, 0, set(same)) if same else {}
    stale = {path for path in same if far.md5.get(path) != local_md5.get(path)}
    groups = link_groups(tree)
    changed = set(differing(tree, local_md5, far, set(same), whole_seconds)) | regrouped(groups, entries)
    numbers = {path: i for i, path in enumerate(index.paths) if path in changed}
    dirs_to_fix = [i for path, i in numbers.items() if index.kinds[i] == Kind.DIR and entries.get(path)
                   and entries[path].kind == "d"]
    fixed = {index.paths[i] for i in dirs_to_fix}
    to_send = sorted(with_link_groups(tree, [path for path in changed if path not in fixed]))
    linked = {name for names in groups for name in names}
    stale.update(path for path in to_send if path in linked and path in entries and entries[path].kind == "f")
    sources = set(index.paths)
    extra = [path for path in entries if path not in sources]
    extra_set = set(extra)
    topmost = [path for path in extra if os.path.dirname(path) not in extra_set]
    sending = set(to_send)
    in_place = sum(1 for i, path in enumerate(index.paths)        # regular files, counted as `files` counts them
                   if index.kinds[i] == Kind.FILE and path not in sending)
    return Comparison(to_send, sorted(dirs_to_fix), in_place, sorted(topmost), sorted(stale))


def dirs_to_restore(tree: SourceTree, comparison: Comparison, deleted: bool) -> list[int]:
    """The directories whose mode and mtime a push sets last: those found different, the parents of what
    was sent (a transport may write through a temporary name beside it), and with ``deleted`` the parents
    of the entries --delete removed."""
    parents = {os.path.dirname(path) for path in comparison.to_send}
    if deleted:
        parents.update(os.path.dirname(path) for path in comparison.extra)
    numbers = set(comparison.dirs_to_fix)
    numbers.update(i for i, path in enumerate(tree.index.paths) if path in parents and tree.index.kinds[i] == Kind.DIR)
    return sorted(numbers)


def fix_directories(transport: Transport | DirectorySetter, endpoint: Endpoint, tree: SourceTree,
                    numbers: list[int]) -> None:
    """Give DEST's directories ``numbers`` (entries of ``tree``) the source's mode and mtime: through
    ``transport`` (a shell script over ssh), or a far-side session's ``set_directories``."""
    index = tree.index
    if isinstance(transport, DirectorySetter):
        transport.set_directories([(index.paths[i], safe_mode(index.modes[i]), index.mtimes[i]) for i in numbers])
        return
    if endpoint.is_local:
        dest = SafeTree(endpoint.path)
        for i in numbers:
            _set_directory(dest, os.fsdecode(index.paths[i]), safe_mode(index.modes[i]), index.mtimes[i])
        return
    lines = []
    for i in numbers:
        name = shlex.quote(os.fsdecode(b"./" + index.paths[i]))
        seconds, nanos = divmod(index.mtimes[i], 1_000_000_000)
        lines.append(f"if [ -d {name} ] && [ ! -L {name} ]; then chmod {safe_mode(index.modes[i]):o} -- {name} && "
                     f"touch -m -d @{seconds}.{nanos:09d} -- {name} || exit 1; fi")
    if lines:
        script = f"cd -- {shlex.quote(endpoint.path)} || exit 1\n" + "\n".join(lines) + "\n"
        transport.run(["sh", "-s"], stdin=os.fsencode(script))


def stamp_top(transport: Transport, endpoint: Endpoint, mtime_ns: int) -> None:
    """Give DEST itself the source root's mtime, last (removing DEST/.pallet touched it): here, or with touch where
    the transport runs a POSIX shell there (``posix_shell``: ssh). Where the time cannot be set (DEST is not the
    user's, or nothing can run there) it is left as it is."""
    if endpoint.is_local:
        with contextlib.suppress(OSError):  # setting a time needs DEST's owner: a DEST shared with others keeps its own
            os.utime(endpoint.path, ns=(mtime_ns, mtime_ns))
    elif transport.capabilities.posix_shell:
        seconds, nanos = divmod(mtime_ns, 1_000_000_000)
        transport.run(["sh", "-c", 'touch -m -d "$1" -- "$2" 2>/dev/null || true', "pallet-stamp",
                       f"@{seconds}.{nanos:09d}", endpoint.path])


def dest_md5(transport: Transport, endpoint: Endpoint, paths: list[bytes]) -> dict[bytes, bytes]:
    """md5 of the files ``paths`` (relative) under ``endpoint``: hashed here when it is local, by md5sum
    over ssh."""
    if endpoint.is_local:
        return md5_of(os.fsencode(endpoint.path), paths, 0)
    return far_tree(transport, endpoint.path, paths).md5


# $1 DEST, $2 "own" when its marker is the caller's: its find records (type, mode, mtime, size, link target, inode,
# links, path), or INCOMPLETE.
_LISTING = r"""
cd -- "$1" 2>/dev/null || exit 0
if [ "$2" != own ] && { [ -e .pallet/INCOMPLETE ] || [ -L .pallet/INCOMPLETE ]; }; then printf INCOMPLETE; exit 0; fi
""" + FIND_RECORDS + "\n"


def dest_entries(transport: Transport, endpoint: Endpoint, own_mark: bool = False) -> dict[bytes, FarEntry] | None:
    """DEST's entries (relative paths) with type, mode, mtime, size and link target (here, or by a ``find`` where
    the transport runs a POSIX shell: ``posix_shell``); None if they cannot be listed this way, or if DEST is
    marked INCOMPLETE (an interrupted operation resumes from its journal) by another run than the caller's
    (``own_mark``)."""
    if endpoint.is_local:
        if not own_mark and os.path.lexists(os.path.join(endpoint.path, STATE_DIR, "INCOMPLETE")):
            return None
        return _local_entries(os.fsencode(endpoint.path))
    if transport.capabilities.posix_shell:
        listed = transport.run(["sh", "-c", _LISTING, "pallet-listing", endpoint.path, "own" if own_mark else ""])
        return None if listed == b"INCOMPLETE" else parse_records(listed)
    return None


def _local_entries(root: bytes) -> dict[bytes, FarEntry]:
    entries: dict[bytes, FarEntry] = {}
    if not os.path.isdir(root):
        return entries
    for top, dirs, files in os.walk(root):
        relative = os.path.relpath(top, root) if top != root else b""
        if not relative:
            dirs[:] = [d for d in dirs if d != STATE_DIR.encode()]
        for name in dirs + files:
            path = os.path.join(relative, name) if relative else name
            try:
                info = os.lstat(os.path.join(root, path))
                link = os.readlink(os.path.join(root, path)) if stat.S_ISLNK(info.st_mode) else b""
            except OSError as exc:      # changed while listed (gone, or no longer a link): not counted as there
                if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EINVAL):
                    continue
                raise
            entries[path] = FarEntry(_KIND_LETTERS.get(stat.S_IFMT(info.st_mode), "?"), stat.S_IMODE(info.st_mode),
                                     info.st_mtime_ns, info.st_size, link, info.st_ino, info.st_nlink)
    return entries


def delete_extra(transport: Transport, endpoint: Endpoint, extra: list[bytes],
                 run_there: Callable[..., bytes] | None = None, broad_ok: bool = False) -> None:
    """Remove DEST's entries ``extra`` (relative; directories with what they hold), never following a link:
    here, over ssh, or with ``run_there`` (a route's host that mounts DEST). UsageError where none can. At a
    far side, DEST is resolved there first: one that leads to / or to the home directory there is refused
    (exit 5, as a DestinationError) unless ``broad_ok`` (--allow-root-dest)."""
    if not extra:
        return
    if endpoint.is_local:
        tree = SafeTree(endpoint.path)
        for path in extra:
            _remove_local(tree, path)
        return
    names = b"".join(b"./" + path + b"\0" for path in extra)
    argv = ["sh", "-c", _DELETE, "pallet-delete", endpoint.path, "broad-ok" if broad_ok else ""]
    if transport.capabilities.remote_exec:
        transport.run(argv, stdin=names)
    elif run_there is not None:
        run_there(argv, stdin=names)
    else:
        raise UsageError(f"--delete: nothing can remove files at {endpoint.url()}",
                         os.fsdecode(os.path.join(os.fsencode(endpoint.path), extra[0])),
                         "add --unpack-via ssh://HOST (a host that mounts it), or push without --delete")


def listed_extra(transport: Transport, endpoint: Endpoint, sources: set[bytes] | frozenset[bytes]) -> list[bytes]:
    """The topmost entries of the tree at ``endpoint`` (DEST/.pallet left out) not in ``sources``, from the
    transport's listing: names alone decide what --delete removes, so any listing serves."""
    listed = {os.fsencode(entry.path): entry for entry in transport.list(endpoint.path)}
    kept = {path: entry for path, entry in listed.items()
            if path != STATE_DIR.encode() and not path.startswith(STATE_DIR.encode() + b"/")}
    extra = {path for path in kept if path not in sources}
    return sorted(path for path in extra if os.path.dirname(path) not in extra)


# $1 DEST, $2 "broad-ok" to allow a DEST that resolves to / or $HOME there: remove the NUL-separated ./names on stdin.
_DELETE = r"""
cd -- "$1" || exit 1
here=$(pwd -P)
if [ "$2" != broad-ok ] && { [ "$here" = / ] || [ "$here" = "$(cd ~ 2>/dev/null && pwd -P)" ]; }; then
  echo "pallet: $1 leads to $here there: --delete will not empty it (pass --allow-root-dest if you mean it)" >&2
  exit 5
fi
xargs -0 -r rm -rf --
"""


def _remove_local(tree: SafeTree, path: bytes) -> None:
    """Remove the entry ``path`` of ``tree`` (relative), never following a link on the way to it."""
    try:
        tree.remove(os.fsdecode(path))
    except OSError as exc:
        raise DestinationError(f"cannot delete ({exc.strerror})", tree.path(os.fsdecode(path)),
                               "check its permissions, or push without --delete") from None


def _set_directory(tree: SafeTree, path: str, mode: int, mtime_ns: int) -> None:
    """Give DEST's directory ``path`` (relative) ``mode`` and ``mtime_ns`` if it is one, through its descriptor."""
    try:
        tree.set_directory(path, mode, mtime_ns, mtime_ns)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        if exc.errno != errno.ELOOP:        # a link there: not the source's directory, left alone
            raise DestinationError(f"cannot set its mode and time ({exc.strerror})", tree.path(path),
                                   "check the destination's permissions") from None


@dataclass
class PullComparison:
    """A local DEST against a pull's source listing: the files and links to fetch (with their sizes), the
    source's directories DEST lacks or holds with another mode or mtime, the files already in place, and
    DEST's entries the source lacks (topmost only)."""

    to_fetch: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    dirs_to_fix: list[RemoteEntry] = field(default_factory=list)
    in_place: int = 0
    extra: list[bytes] = field(default_factory=list)
    source_dirs: dict[bytes, RemoteEntry] = field(default_factory=dict)


EXACT_LISTING = frozenset({"exact_listing"})


def lists_exactly(endpoint: Endpoint) -> bool:
    """Whether the transport registered for ``endpoint``'s scheme declares ``exact_listing`` (local and ssh do):
    its listing carries exact mtimes, so a tree there can be compared with another entry by entry (a pull's
    DEST with its source, ``--dry-run``, ``pallet plan``). Read from its class, without connecting; an open
    transport's own ``capabilities.exact_listing`` says the same."""
    return capable(declared_capabilities(endpoint.scheme), EXACT_LISTING)


def compare_with_local(listed: list[RemoteEntry], dest: str, source_md5=None,
                       dry_run: bool = False, own_mark: bool = False) -> PullComparison | None:
    """Compare a pull source's listing with the local ``dest``: None when DEST is missing, empty or marked
    INCOMPLETE (an interrupted pull resumes from its journal). With ``source_md5`` (relative paths -> md5
    of those files at the source) the files whose metadata match are compared by md5 too, and those that
    differ are removed here so the fetch cannot skip them (not with ``dry_run``). ``own_mark``: DEST's marker
    is the caller's own (it is finishing)."""
    if not own_mark and os.path.lexists(os.path.join(dest, STATE_DIR, "INCOMPLETE")):
        return None
    local = _local_entries(os.fsencode(dest))
    if not local:
        return None
    found = PullComparison()
    for entry in listed:
        here = local.get(os.fsencode(entry.path))
        if entry.kind == "d":
            found.source_dirs[os.fsencode(entry.path)] = entry
            if here is None or here.kind != "d" or (here.mode, here.mtime_ns) != (entry.mode & 0o7777,
                                                                                  entry.mtime_ns):
                found.dirs_to_fix.append(entry)
        elif here is not None and here.kind == entry.kind and _same_entry(here, entry):
            found.in_place += entry.kind == "f"
        else:
            found.to_fetch.append(entry.path)
            found.sizes.append(entry.size if entry.kind == "f" else 0)
    if source_md5 is not None:
        _fetch_differing_content(found, listed, dest, source_md5, dry_run)
    found.extra = extra_entries(dest, {os.fsencode(entry.path) for entry in listed}, local)
    return found


def extra_entries(dest: str, sources: set[bytes] | frozenset[bytes],
                  local: dict[bytes, FarEntry] | None = None) -> list[bytes]:
    """The topmost entries of the local ``dest`` (``local``: its listing, made here when None) that are not in
    ``sources`` (relative paths)."""
    if local is None:
        local = _local_entries(os.fsencode(dest))
    extra = {path for path in local if path not in sources}
    return sorted(path for path in extra if os.path.dirname(path) not in extra)


def _fetch_differing_content(found: PullComparison, listed: list[RemoteEntry], dest: str, source_md5,
                             dry_run: bool) -> None:
    """Move the files in place whose md5 here differs from the source's to ``found.to_fetch``."""
    fetching = set(found.to_fetch)
    files = [entry for entry in listed if entry.kind == "f" and entry.path not in fetching]
    there = source_md5([os.fsencode(entry.path) for entry in files])
    here = md5_of(os.fsencode(dest), [os.fsencode(entry.path) for entry in files], 0)
    for entry in files:
        name = os.fsencode(entry.path)
        if there.get(name) != here.get(name):
            if not dry_run:       # or a fetch skipping equal metadata would skip it
                _remove_local(SafeTree(dest), name)
            found.to_fetch.append(entry.path)
            found.sizes.append(entry.size)
            found.in_place -= 1


def _same_entry(here: FarEntry, there: RemoteEntry) -> bool:
    if there.kind == "l":
        return here.target == os.fsencode(there.link)
    return (here.size, here.mtime_ns, here.mode) == (there.size, there.mtime_ns, there.mode & 0o7777)


def finish_local_pull(dest: str, comparison: PullComparison, delete: bool) -> int:
    """After a repairing pull into ``dest``: with ``delete`` remove the extras, then make the directories the
    source has (missing ones too) with its modes and mtimes, parents of what changed included; the number
    of entries deleted."""
    tree = SafeTree(dest)
    if delete:
        for path in comparison.extra:
            _remove_local(tree, path)
    for entry in comparison.dirs_to_fix:
        try:
            tree.directory(entry.path)      # a link or file there is replaced, never followed
        except OSError as exc:
            raise DestinationError(f"cannot create directory ({exc.strerror})", os.fsdecode(exc.filename or dest),
                                   "check the destination's permissions") from None
    touched = {os.path.dirname(os.fsencode(p)) for p in comparison.to_fetch}
    if delete:
        touched.update(os.path.dirname(p) for p in comparison.extra)
    touched.update(os.fsencode(entry.path) for entry in comparison.dirs_to_fix)
    for path in sorted(touched, key=len, reverse=True):
        source_dir = comparison.source_dirs.get(path)
        if source_dir is not None:
            _set_directory(tree, os.fsdecode(path), safe_mode(source_dir.mode), source_dir.mtime_ns)
    return len(comparison.extra) if delete else 0
