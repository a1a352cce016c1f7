"""Sequential, safe extraction and listing of plain archives that carry no pallet index."""
from __future__ import annotations

import os
import stat
import tarfile
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Iterator

from .errors import BundleError, UnsafeMemberError
from .extract import destination_error, remove_stale, write_chunks
from .progress import Progress
from .safety import path_problem, safe_mode, symlink_problem

_TRUNCATED_HINT = "the archive is incomplete or not a tar file: transfer it again or check what it is"


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


def iter_members(bundle) -> Iterator[tuple[tarfile.TarInfo, tarfile.TarFile]]:
    """Yield the members of a plain archive (an opened Bundle, or a StreamedArchive) in stream order; BundleError
    if it is not one."""
    raw = bundle.raw if isinstance(bundle, StreamedArchive) else _FdReader(bundle.fd)
    stream = bundle.codec.open_stream(raw)
    try:
        archive = tarfile.open(fileobj=stream, mode="r|", errorlevel=2)
    except tarfile.ReadError as exc:
        raise BundleError(f"not a tar archive or pallet bundle ({exc})", bundle.path, _TRUNCATED_HINT) from None
    try:
        for member in archive:
            yield member, archive
        ended_on_zero_block = archive.fileobj.tell() - archive.offset == tarfile.BLOCKSIZE
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise BundleError(f"archive is damaged or truncated ({exc})", bundle.path, _TRUNCATED_HINT) from None
    if not ended_on_zero_block:
        raise BundleError("archive is truncated (it ends without end-of-archive blocks)", bundle.path,
                          _TRUNCATED_HINT)


_MEMBER_CHUNK = 8 << 20


def _member_chunks(archive: tarfile.TarFile, member: tarfile.TarInfo, bundle) -> Iterator[bytes]:
    """A member's data in chunks of at most 8 MiB, whatever its size; BundleError if the archive ends early."""
    data, remaining = archive.extractfile(member), member.size
    while remaining:
        try:
            chunk = data.read(min(remaining, _MEMBER_CHUNK))
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise BundleError(f"archive is damaged or truncated at {member.name!r} ({exc})", bundle.path,
                              _TRUNCATED_HINT) from None
        if not chunk:
            raise BundleError(f"archive is truncated inside {member.name!r}", bundle.path, _TRUNCATED_HINT)
        remaining -= len(chunk)
        yield chunk


def extract_plain(bundle, dest: str, progress: Progress) -> PlainStats:
    """Extract every safe member; after the last one, raise UnsafeMemberError naming the refused ones.

    Links are created after all files (so nothing is written through them),
    directory metadata last. Members are read in stream order only. Symlink
    targets are checked once every symlink name is known, and any name under
    a symlink member (refused or not) is refused.
    """
    progress.start("unpack (no index: files not verified)", 0, 0)
    root = os.fsencode(dest)
    stats, refused = PlainStats(), []
    directories: dict[bytes, tarfile.TarInfo] = {}
    links: list[tuple[tarfile.TarInfo, bytes]] = []
    files: set[bytes] = set()
    symlink_names = set()
    for member, archive in iter_members(bundle):
        name = _normalized(os.fsencode(member.name))
        if not name:
            continue                      # the archive's root, "./"
        if member.issym():
            symlink_names.add(name)
        reason = _member_problem(member, name, files, symlink_names)
        if reason:
            refused.append((member.name, reason))
            continue
        stats.entries += 1
        path = os.path.join(root, name)
        _make_parents(root, name)
        if member.isdir():
            _make_parents(root, name + b"/x")
            directories[name] = member
        elif member.isfile():
            size = write_chunks(path, _member_chunks(archive, member, bundle), member.mode, mtime_ns(member))
            files.add(name)
            stats.files, stats.file_bytes = stats.files + 1, stats.file_bytes + size
            progress.advance(1, size)
        else:
            links.append((member, name))
    _finish_links(root, links, symlink_names, refused)
    for name in sorted(directories, key=lambda n: n.count(b"/"), reverse=True):
        member = directories[name]
        os.chmod(os.path.join(root, name), safe_mode(member.mode))
        os.utime(os.path.join(root, name), ns=(mtime_ns(member),) * 2)
    if refused:
        raise UnsafeMemberError(refused, bundle.path)
    return stats


def _normalized(name: bytes) -> bytes:
    """Drop '.' and empty components (tar writes './a/b'); keep a leading '/' so it is refused."""
    if name.startswith(b"/"):
        return name
    return b"/".join(p for p in name.split(b"/") if p not in (b"", b"."))


def mtime_ns(member: tarfile.TarInfo) -> int:
    """A member's mtime in nanoseconds, exact when a pax header carries it (a float would round it)."""
    text = member.pax_headers.get("mtime")
    try:
        return int(Decimal(text) * 1_000_000_000) if text else int(member.mtime) * 1_000_000_000
    except (InvalidOperation, ValueError):
        return int(member.mtime) * 1_000_000_000


def _member_problem(member: tarfile.TarInfo, name: bytes, files: set, symlinks: set) -> str | None:
    reason = path_problem(name)
    if reason:
        return reason
    parts = name.split(b"/")
    if symlinks and any(b"/".join(parts[:n]) in symlinks for n in range(1, len(parts))):
        return "written through a symlink"
    if member.isdev() or member.isfifo():
        return "device node or FIFO"
    if member.islnk():
        if _normalized(os.fsencode(member.linkname)) not in files:
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
                os.mkdir(current, 0o700)
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


def _finish_links(root: bytes, links: list, symlinks: set, refused: list) -> None:
    for member, name in links:
        reason = _link_problem(root, member, name, symlinks)
        if reason:
            refused.append((member.name, reason))
            continue
        path = os.path.join(root, name)
        try:
            remove_stale(path)
            if member.issym():
                os.symlink(os.fsencode(member.linkname), path)
                os.utime(path, ns=(mtime_ns(member),) * 2, follow_symlinks=False)
            else:
                os.link(os.path.join(root, _normalized(os.fsencode(member.linkname))), path,
                        follow_symlinks=False)
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
