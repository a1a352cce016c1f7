"""Sequential, safe extraction and listing of plain archives that carry no pallet index."""
from __future__ import annotations

import os
import stat
import tarfile
from dataclasses import dataclass
from decimal import Decimal, DecimalException
from typing import Iterator

from . import native as native_engine
from .errors import BundleError, UnsafeMemberError
from .extract import current_umask, destination_error, remove_stale, write_chunks
from .plain_reader import DecodedAhead, PlainReader

_VOLUME_LABEL = b"V"          # GNU tar -V: not a file; GNU tar skips it too
from .progress import Progress
from .safety import path_problem, safe_mode, symlink_problem

@dataclass
class PlainStats:
    """Counts of what a plain extraction wrote."""

    entries: int = 0
    files: int = 0
    file_bytes: int = 0


@dataclass(frozen=True)
class StreamedArchive:
    """A plain archive read from a pipe (e.g. a far side's ``tar -c``): what it is called, its codec, the reader."""

    path: str
    codec: object
    raw: object


def iter_members(bundle) -> Iterator[tuple[tarfile.TarInfo, PlainReader]]:
    """Yield the members of a plain archive (an opened Bundle, or a StreamedArchive) in stream order, with the
    reader that reads their data; BundleError if it is not one."""
    reader = _reader(bundle)
    while (member := reader.next_member()) is not None:
        yield member, reader


def _reader(bundle) -> PlainReader:
    raw = bundle.raw if isinstance(bundle, StreamedArchive) else _FdReader(bundle.fd)
    return PlainReader(bundle.path, bundle.codec.open_stream(raw))


class _WrittenFiles:
    """The names of the regular files an extraction wrote (what the pure-Python engine keeps of what
    ``bundles._native.PlainExtraction`` keeps)."""

    def __init__(self):
        self.files = set()

    def add_file(self, name: bytes) -> None:
        self.files.add(name)

    def has_file(self, name: bytes) -> bool:
        return name in self.files


def extract_plain(bundle, dest: str, progress: Progress) -> PlainStats:
    """Extract every safe member; after the last one, raise UnsafeMemberError naming the refused ones.

    Symlinks are created after all files (so nothing is written through
    them; a later member of a symlink's name replaces it), hard links when
    read (to the regular file written earlier), directory metadata last. Members are read in stream order only. Symlink
    targets are checked once every symlink name is known, and any name under
    a symlink member (refused or not) is refused. With the native engine,
    runs of plain files and directories are written by it; every other
    member, and every one it cannot write, is read here by the same rules.
    """
    progress.start("unpack (no index: files not verified)", 0, 0)
    if isinstance(bundle, StreamedArchive):
        return _extract_members(bundle, bundle.codec.open_stream(bundle.raw), dest, progress)
    with DecodedAhead(bundle.codec.open_stream(_FdReader(bundle.fd))) as stream:
        return _extract_members(bundle, stream, dest, progress)


def _extract_members(bundle, stream, dest: str, progress: Progress) -> PlainStats:
    root, reader = os.fsencode(dest), PlainReader(bundle.path, stream)
    native = native_engine.module()
    written = native.PlainExtraction(root + b"/", current_umask()) if native else _WrittenFiles()
    stats, refused, symlink_names = PlainStats(), [], set()
    links: dict[bytes, tarfile.TarInfo] = {}            # by name: a later member of that name replaces a link
    directories: dict[bytes, tuple[int, int]] = {}
    while True:
        if native:
            _take_native_run(reader, written, stats, directories, progress)
        member = reader.next_member()
        if member is None:
            break
        name = _normalized(os.fsencode(member.name))
        if not name or member.type == _VOLUME_LABEL:
            continue                      # the archive's root, "./", or its label
        if member.issym():
            symlink_names.add(name)
            if native:
                written.add_symlink(name)
        reason = _member_problem(member, name, written, symlink_names)
        if reason:
            refused.append((member.name, reason))
            continue
        if member.islnk() and _normalized(os.fsencode(member.linkname)) == name:
            continue                      # GNU tar stores a file archived twice as a link to itself
        stats.entries += 1 - (links.pop(name, None) is not None)
        _make_parents(root, name)
        if not member.issym() and name in symlink_names:
            symlink_names.discard(name)   # a later member took a symlink's name: nothing can be written through it
            if native:
                written.drop_link(name)
        if member.isdir():
            _make_directory(os.path.join(root, name), replace=written.has_file(name))
            directories[name] = (member.mode, mtime_ns(member))
        elif member.isfile():
            size = write_chunks(os.path.join(root, name), reader.data_chunks(member), member.mode, mtime_ns(member))
            written.add_file(name)
            stats.files, stats.file_bytes = stats.files + 1, stats.file_bytes + size
            progress.advance(1, size)
        elif member.islnk() and not _pending_symlink(links, _normalized(os.fsencode(member.linkname))):
            _make_link(root, member, name, symlink_names, written, refused)   # now, to the file as it is now
        else:
            links[name] = member          # a symlink (or a hard link to a symlink's name): once all are known
            if native:
                written.add_link(name)
    _finish_links(root, links, symlink_names, written, refused)
    _finish_directories(root, directories)
    if refused:
        raise UnsafeMemberError(refused, bundle.path)
    return stats


def _take_native_run(reader: PlainReader, extraction, stats: PlainStats, directories: dict,
                     progress: Progress) -> None:
    done = reader.run_native(extraction)
    stats.entries, stats.files = stats.entries + done.entries, stats.files + done.files
    stats.file_bytes += done.file_bytes
    directories.update((name, (mode, mtime)) for name, mode, mtime in done.directories)
    if done.files:
        progress.advance(done.files, done.file_bytes)


def _pending_symlink(links: dict, name: bytes) -> bool:
    member = links.get(name)
    return member is not None and member.issym()


def _make_directory(path: bytes, replace: bool) -> None:
    """Make directory member ``path`` (its parents are real directories); an existing directory is kept. With
    ``replace`` (the file there is an earlier member's), the file is replaced, as GNU tar does; anything else
    there (a link planted in DEST) is an error."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            return
        if not replace:
            raise BundleError("a member would be written through a non-directory", os.fsdecode(path),
                              "unpack into an empty destination")
        remove_stale(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise destination_error(exc, path) from None
    try:
        os.mkdir(path, 0o700)
    except OSError as exc:
        raise destination_error(exc, path) from None


def _finish_directories(root: bytes, directories: dict[bytes, tuple[int, int]]) -> None:
    """Apply directory members' modes and mtimes, deepest first (so a read-only parent is set last)."""
    for name in sorted(directories, key=lambda n: n.count(b"/"), reverse=True):
        mode, mtime = directories[name]
        os.chmod(os.path.join(root, name), safe_mode(mode))
        os.utime(os.path.join(root, name), ns=(mtime, mtime))


def _normalized(name: bytes) -> bytes:
    """Drop '.' and empty components (tar writes './a/b'); keep a leading '/' so it is refused."""
    if name.startswith(b"/"):
        return name
    return b"/".join(p for p in name.split(b"/") if p not in (b"", b"."))


def mtime_ns(member: tarfile.TarInfo) -> int | None:
    """A member's mtime in nanoseconds, exact when a pax header carries it (a float would round it); None when
    it is no time a file can have (infinite, NaN, beyond 64-bit nanoseconds)."""
    text = member.pax_headers.get("mtime")
    try:
        seconds = Decimal(text) if text else Decimal(member.mtime)
    except DecimalException:
        seconds = Decimal(member.mtime)         # tarfile read it as 0
    if not seconds.is_finite() or seconds.adjusted() > 10:
        return None
    return int(seconds * 1_000_000_000)


def _member_problem(member: tarfile.TarInfo, name: bytes, written, symlinks: set) -> str | None:
    reason = path_problem(name)
    if reason:
        return reason
    parts = name.split(b"/")
    if symlinks and any(b"/".join(parts[:n]) in symlinks for n in range(1, len(parts))):
        return "written through a symlink"
    if member.isdev() or member.isfifo():
        return "device node or FIFO"
    if member.issparse():
        return "sparse file (pallet does not extract these: use GNU tar)"
    if mtime_ns(member) is None:
        return "modification time out of range"
    if member.islnk():
        if not written.has_file(_normalized(os.fsencode(member.linkname))):
            return f"hard link to {member.linkname!r}, which is not a file extracted earlier"
    elif not (member.isfile() or member.isdir() or member.issym()):
        return f"unsupported member type {member.type!r}"
    return None


def _make_parents(root: bytes, name: bytes) -> None:
    """Make the directories above ``name`` under ``root``; each that exists must be a directory, not a link to one
    (one lstat for an existing directory, the usual case)."""
    current = root
    for part in name.split(b"/")[:-1]:
        current = current + b"/" + part
        try:
            if stat.S_ISDIR(os.lstat(current).st_mode):
                continue
        except FileNotFoundError:
            try:
                os.mkdir(current, 0o777)        # less the umask, as mkdir -p and GNU tar make it
                continue
            except FileExistsError:         # made meanwhile: look again
                if stat.S_ISDIR(os.lstat(current).st_mode):
                    continue
            except OSError as exc:
                raise destination_error(exc, current) from None
        except OSError as exc:
            raise destination_error(exc, current) from None
        raise BundleError("a member would be written through a non-directory", os.fsdecode(current),
                          "unpack into an empty destination")


def _finish_links(root: bytes, links: dict, symlinks: set, written, refused: list) -> None:
    for name, member in links.items():
        _make_link(root, member, name, symlinks, written, refused)


def _make_link(root: bytes, member: tarfile.TarInfo, name: bytes, symlinks: set, written, refused: list) -> None:
    """Create link member ``name`` in place of whatever non-directory is there, or add it to ``refused``."""
    reason = _link_problem(root, member, name, symlinks)
    if not reason and os.path.isdir(os.path.join(root, name)) and not os.path.islink(os.path.join(root, name)):
        reason = "a directory of that name is in the destination"
    if reason:
        refused.append((member.name, reason))
    else:
        path = os.path.join(root, name)
        try:
            remove_stale(path)
            if member.issym():
                os.symlink(os.fsencode(member.linkname), path)
                os.utime(path, ns=(mtime_ns(member),) * 2, follow_symlinks=False)
            else:
                os.link(os.path.join(root, _normalized(os.fsencode(member.linkname))), path,
                        follow_symlinks=False)
                written.add_file(name)        # a regular file of this archive, as its target is
        except OSError as exc:
            refused.append((member.name, f"cannot create link ({exc.strerror})"))


def _link_problem(root: bytes, member: tarfile.TarInfo, name: bytes, symlinks: set) -> str | None:
    """Why link member ``name`` must not be created, checked once the whole stream is known.

    A symlink is checked against every symlink of the archive; a hard link
    against what its target is now (a later symlink member may have replaced
    the file it named).
    """
    target = os.fsencode(member.linkname)
    if member.issym():
        return symlink_problem(name, target, symlinks)
    try:
        regular = stat.S_ISREG(os.lstat(os.path.join(root, _normalized(target))).st_mode)
    except OSError:
        regular = False
    return None if regular else f"hard link to {member.linkname!r}, which is no longer a regular file"


class _FdReader:
    """Sequential reader over a file descriptor from offset 0."""

    def __init__(self, fd: int):
        self.fd, self.position = fd, 0

    def read(self, size: int = -1) -> bytes:
        size = 1 << 20 if size < 0 else size
        data = os.pread(self.fd, size, self.position)
        self.position += len(data)
        return data
