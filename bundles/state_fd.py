"""State files reached only through directory descriptors: DEST/.pallet and what is under it, never through a link."""
from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import DestinationError
from .extract_common import destination_error
from .reserved import STATE_DIR

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# an existing state file is opened without blocking (a FIFO planted there would wait for a writer or reader
# forever) and without following a link, and used only if it is a regular file
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def state_dir_problem(st: os.stat_result) -> str | None:
    """Why a directory pallet keeps state in cannot be trusted (None: it can): a link, not a directory, another
    user's, or writable by others (who could then plant links in it)."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return "is writable by other users"
    return None


def open_private_dir(name: str, parent_fd: int | None, shown: str, create: bool = True) -> int:
    """Open the directory ``name`` relative to ``parent_fd`` (a path when it is None), made first (mode 0700)
    with ``create``, and return its descriptor. A link there is never followed, and the directory must be
    this user's and writable by nobody else. DestinationError naming ``shown`` otherwise; FileNotFoundError
    when it is missing and ``create`` is False."""
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass
        except OSError as exc:
            raise destination_error(exc, os.fsencode(shown)) from None
    try:
        fd = os.open(name, _DIRECTORY, dir_fd=parent_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _untrusted(shown, "is a symbolic link or not a directory") from None
        raise destination_error(exc, os.fsencode(shown)) from None
    problem = state_dir_problem(os.fstat(fd))
    if problem:
        os.close(fd)
        raise _untrusted(shown, problem)
    return fd


def _untrusted(shown: str, problem: str) -> DestinationError:
    return DestinationError(f"{problem}: pallet keeps its state there and will not write through it", shown,
                            f"remove it (rm -r {shown}) if you did not make it, then run again")


@contextmanager
def state_dir_fd(dest: str, create: bool = True) -> Iterator[int]:
    """DEST/.pallet (made with ``create``) as a descriptor, reached from a descriptor of DEST, for the block.
    DestinationError when DEST cannot be opened or the state directory cannot be trusted."""
    shown = os.path.join(dest, STATE_DIR)
    try:
        dest_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)    # DEST itself is the user's word
    except FileNotFoundError:
        if not create:
            raise
        raise DestinationError("does not exist", dest, "check the destination") from None
    except OSError as exc:
        raise destination_error(exc, os.fsencode(dest)) from None
    try:
        fd = open_private_dir(STATE_DIR, dest_fd, shown, create)
    finally:
        os.close(dest_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def write_new(dir_fd: int, name: str, text: str) -> None:
    """Write ``text`` to a new file ``name`` in ``dir_fd``; whatever had that name is unlinked first, never
    written through."""
    try:
        fd = os.open(name, _NEW_FILE, 0o600, dir_fd=dir_fd)
    except FileExistsError:
        os.unlink(name, dir_fd=dir_fd)
        fd = os.open(name, _NEW_FILE, 0o600, dir_fd=dir_fd)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def append_text(dir_fd: int, name: str, text: str, shown: str) -> None:
    """Append ``text`` to the file ``name`` in ``dir_fd`` (made if missing); DestinationError naming ``shown``
    when anything but a regular file is there (a link, a FIFO: never written through, never waited on)."""
    with os.fdopen(open_regular(dir_fd, name, _APPEND, shown), "a") as handle:
        handle.write(text)


def read_text(dir_fd: int, name: str, shown: str) -> str:
    """The text of the file ``name`` in ``dir_fd``, stripped; "" when it is missing or unreadable.
    DestinationError naming ``shown`` when anything but a regular file is there (a link, a FIFO, a device)."""
    try:
        fd = open_regular(dir_fd, name, _READ, shown)
    except (FileNotFoundError, PermissionError):
        return ""
    try:
        with os.fdopen(fd) as handle:
            return handle.read().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def open_regular(dir_fd: int, name: str, flags: int, shown: str) -> int:
    """``os.open`` of the state file ``name`` in ``dir_fd`` with ``flags`` (which hold O_NOFOLLOW and
    O_NONBLOCK), refused by name unless it is a regular file: looked at before it is opened (a device is
    never opened) and after (it may have been swapped meanwhile). OSError as ``os.open`` raises it otherwise."""
    try:
        kind = _file_kind(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise
        kind = None
    if kind:
        raise _not_regular(shown, kind)
    try:
        fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):     # a link, or a FIFO with no reader, put there meanwhile
            raise _not_regular(shown, "a symbolic link" if exc.errno == errno.ELOOP else "a FIFO") from None
        raise
    kind = _file_kind(os.fstat(fd).st_mode)
    if kind:
        os.close(fd)
        raise _not_regular(shown, kind)
    return fd


def _file_kind(mode: int) -> str | None:
    """What a file of ``mode`` is when it is not a regular file (None for one)."""
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
             (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "a device node")


def _not_regular(shown: str, kind: str) -> DestinationError:
    return DestinationError(f"is {kind}, not a regular file: pallet keeps its state there and will not read or "
                            "write through it", shown, f"remove it (rm -r {shown}) if you did not make it, then run "
                            "again")


def remove_entry(dir_fd: int, name: str) -> None:
    """Remove the entry ``name`` of ``dir_fd``: a file or link itself, or a directory tree (shutil.rmtree,
    relative to the descriptor); nothing there is fine."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)
