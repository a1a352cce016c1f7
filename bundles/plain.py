"""Sequential, safe extraction and listing of plain archives that carry no pallet index."""
from __future__ import annotations

import os
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal, DecimalException

from . import native as native_engine
from .byte_source import Readable
from .codecs import Codec
from .errors import BundleError, UnsafeMemberError
from .extract import current_umask, destination_error, remove_stale, write_chunks
from .plain_reader import DecodedAhead, PlainReader
from .progress import Progress
from .safety import path_problem, safe_mode, symlink_problem

_VOLUME_LABEL = b"V"          # GNU tar -V: not a file; GNU tar skips it too


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
    codec: Codec
    raw: Readable


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

    # Link names matter only to the native engine's runs (it must not write through a symlink member's name);
    # the pure-Python engine keeps them itself (_PlainExtraction.symlink_names and .links), so these do nothing.
    def add_symlink(self, name: bytes) -> None:
        pass

    def add_link(self, name: bytes) -> None:
        pass

    def drop_link(self, name: bytes) -> None:
        pass


def extract_plain(bundle, dest: str, progress: Progress) -> PlainStats:
    """Extract every safe member; after the last one, raise UnsafeMemberError naming the refused ones.

    Members are read in stream order only. Symlinks are created after all
    files (so nothing is written through them; a later member of a symlink's
    name replaces it), hard links when read (to the regular file written
    earlier), directory metadata last. Symlink targets are checked once every
    symlink name is known, and any name under a symlink member (refused or
    not) is refused. With the native engine, runs of plain files and
    directories are written by it; every other member, and every one it
    cannot write, is read here by the same rules.
    """
    progress.start("unpack (no index: files not verified)", 0, 0)
    if isinstance(bundle, StreamedArchive):
        return _PlainExtraction(bundle, bundle.codec.open_stream(bundle.raw), dest, progress).run()
    with DecodedAhead(bundle.codec.open_stream(_FdReader(bundle.fd))) as stream:
        return _PlainExtraction(bundle, stream, dest, progress).run()


class _PlainExtraction:
    """One extraction of a plain archive into DEST: what it has written and what waits for the end."""

    def __init__(self, bundle, stream, dest: str, progress: Progress):
        self.path, self.progress = bundle.path, progress
        self.root, self.reader = os.fsencode(dest), PlainReader(bundle.path, stream)
        self.native = native_engine.module()
        self.written = (self.native.PlainExtraction(self.root + b"/", current_umask()) if self.native
                        else _WrittenFiles())
        self.stats = PlainStats()
        self.refused: list[tuple[str, str]] = []
        self.symlink_names: set[bytes] = set()
        self.links: dict[bytes, tarfile.TarInfo] = {}       # by name: a later member of that name replaces a link
        self.directories: dict[bytes, tuple[int, int]] = {}

    def run(self) -> PlainStats:
        while True:
            if self.native:
                self._take_native_run()
            member = self.reader.next_member()
            if member is None:
                break
            self._take(member)
        _finish_links(self.root, self.links, self.symlink_names, self.written, self.refused)
        _finish_directories(self.root, self.directories)
        if self.refused:
            raise UnsafeMemberError(self.refused, self.path)
        return self.stats

    def _take(self, member: tarfile.TarInfo) -> None:
        name = _normalized(os.fsencode(member.name))
        if not name or member.type == _VOLUME_LABEL:
            return                        # the archive's root, "./", or its label
        if member.issym():
            self.symlink_names.add(name)
            if self.native:
                self.written.add_symlink(name)
        reason = _member_problem(member, name, self.written, self.symlink_names)
        if reason:
            self.refused.append((member.name, reason))
            return
        target = _normalized(os.fsencode(member.linkname))
        if member.islnk() and target == name:
            return                        # GNU tar stores a file archived twice as a link to itself
        self.stats.entries += 1 - (self.links.pop(name, None) is not None)
        _make_parents(self.root, name)
        if not member.issym() and name in self.symlink_names:
            self.symlink_names.discard(name)  # a later member took a symlink's name: nothing is written through it
            if self.native:
                self.written.drop_link(name)
        if member.isdir():
            _make_directory(os.path.join(self.root, name), 0o700, replace=self.written.has_file(name))
            self.directories[name] = (member.mode, _kept_mtime_ns(member))
        elif member.isfile():
            self._write_file(member, name)
        elif member.islnk() and not _pending_symlink(self.links, target):
            _make_link(self.root, member, name, self.symlink_names, self.written, self.refused)  # to the file now
        else:
            self.links[name] = member     # a symlink (or a hard link to a symlink's name): once all are known
            if self.native:
                self.written.add_link(name)

    def _write_file(self, member: tarfile.TarInfo, name: bytes) -> None:
        size = write_chunks(os.path.join(self.root, name), self.reader.data_chunks(member), member.mode,
                            _kept_mtime_ns(member))
        self.written.add_file(name)
        self.stats.files, self.stats.file_bytes = self.stats.files + 1, self.stats.file_bytes + size
        self.progress.advance(1, size)

    def _take_native_run(self) -> None:
        done, stats = self.reader.run_native(self.written), self.stats
        stats.entries, stats.files = stats.entries + done.entries, stats.files + done.files
        stats.file_bytes += done.file_bytes
        self.directories.update((name, (mode, mtime)) for name, mode, mtime in done.directories)
        if done.files:
            self.progress.advance(done.files, done.file_bytes)


def _pending_symlink(links: dict, name: bytes) -> bool:
    member = links.get(name)
    return member is not None and member.issym()


def _make_directory(path: bytes, mode: int, replace: bool = False) -> None:
    """Make directory ``path`` (its parents are real directories) with ``mode`` less the umask; an existing
    directory is kept (one lstat, the usual case). With ``replace`` (the file there is an earlier member's) the
    file is replaced, as GNU tar does; anything else there (a link planted in DEST) is an error."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            return
        if not replace:
            raise _through_non_directory(path)
        remove_stale(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise destination_error(exc, path) from None
    try:
        os.mkdir(path, mode)
    except FileExistsError:               # made meanwhile: look again
        _make_directory(path, mode)
    except OSError as exc:
        raise destination_error(exc, path) from None


def _through_non_directory(path: bytes) -> BundleError:
    return BundleError("a member would be written through a non-directory", os.fsdecode(path),
                       "unpack into an empty destination")


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


def _kept_mtime_ns(member: tarfile.TarInfo) -> int:
    """mtime_ns of a member :func:`_member_problem` let through: it refuses those whose time is None."""
    mtime = mtime_ns(member)
    assert mtime is not None
    return mtime


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
    """Make the directories above ``name`` under ``root`` as ``mkdir -p`` and GNU tar make them (0777 less the
    umask); each that exists must be a directory, not a link to one."""
    current = root
    for part in name.split(b"/")[:-1]:
        current = current + b"/" + part
        _make_directory(current, 0o777)


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
                os.utime(path, ns=(_kept_mtime_ns(member),) * 2, follow_symlinks=False)
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
