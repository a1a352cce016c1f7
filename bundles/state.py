"""pallet's state in a destination: one hidden directory, DEST/.pallet, that exists only while work is unfinished."""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from .errors import DestinationError, DestinationLocked
from .extract_common import destination_error
from .journal import untrusted_journals
from .reserved import STATE_DIR, TRANSFER_DIR, WRITING_DIR
from .state_fd import read_text, remove_entry, state_dir_fd, write_new

INCOMPLETE = "INCOMPLETE"       # file in STATE_DIR: says what is unfinished and that a rerun finishes it
_NEW_MARKER = INCOMPLETE + ".new"


def state_path(dest: str, *parts: str) -> str:
    """A path under ``dest``'s state directory."""
    return os.path.join(dest, STATE_DIR, *parts)


@contextmanager
def holding_lock(dest: str, held_by_caller: bool = False, wait: bool = False) -> Iterator[None]:
    """Hold an flock on the directory ``dest`` itself (the lock `pallet push` and `pull` take) while the block
    runs; raise DestinationLocked (exit status 4) at once if another operation holds it, or with ``wait``
    block until it is free. With ``held_by_caller`` the caller already holds it (for this operation) and
    nothing is done. DestinationError if ``dest`` cannot be opened."""
    if held_by_caller:
        yield
        return
    try:
        fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise DestinationError(f"cannot open the destination ({exc.strerror})", dest,
                               "check that DEST is a directory you can read and write") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise DestinationLocked("another pallet operation is writing this destination", dest,
                                    "wait for it to finish, then run again") from None
        yield
    finally:
        os.close(fd)


def ensure_state_dir(dest: str) -> str:
    """Create DEST/.pallet (mode 0700), or check the one there; return its path.

    An existing one must be a real directory (not a symbolic link), owned by
    this user and writable by nobody else: otherwise someone else could have
    made it, or could put links in it, and pallet would write through them.
    It is reached through a descriptor of DEST, never through a link.
    Raises DestinationError naming it and the fix.
    """
    with state_dir_fd(dest):
        return state_path(dest)


def mark_incomplete(dest: str, text: str, journal: str | None = None) -> str:
    """Create DEST/.pallet (if needed) and write ``text`` to DEST/.pallet/INCOMPLETE; return the marker's path.

    First the journals this writer cannot trust are removed (see
    :func:`bundles.journal.untrusted_journals`; ``journal``: the name in
    DEST/.pallet of the writer's own journal, None when it keeps none there:
    then every journal goes, as its files would make them lie). The marker is
    created anew under another name and renamed over the old one, relative to
    the state directory's descriptor (a file or link already there is
    replaced, never written through), so DEST is never unmarked meanwhile
    and the marker always tells the current operation.
    """
    marker = state_path(dest, INCOMPLETE)
    with state_dir_fd(dest) as state:
        try:
            for name in untrusted_journals(os.listdir(state), journal, _marked(state)):
                remove_entry(state, name)
            try:
                write_new(state, _NEW_MARKER, text if text.endswith("\n") else text + "\n")
            finally:        # even a marker the disk had no room to fill marks DEST
                _rename_if_there(state, _NEW_MARKER, INCOMPLETE)
        except OSError as exc:
            raise destination_error(exc, os.fsencode(marker)) from None
    return marker


def marker_text(dest: str) -> str:
    """The text of DEST's INCOMPLETE marker ("" when there is none), read without following a link."""
    if not os.path.lexists(state_path(dest)):
        return ""
    with state_dir_fd(dest, create=False) as state:
        return read_text(state, INCOMPLETE, state_path(dest, INCOMPLETE))


def _marked(state: int) -> bool:
    """Whether the state directory ``state`` holds the INCOMPLETE marker (of any kind: it is not read)."""
    try:
        os.stat(INCOMPLETE, dir_fd=state, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _rename_if_there(state: int, name: str, new_name: str) -> None:
    with suppress(FileNotFoundError):
        os.replace(name, new_name, src_dir_fd=state, dst_dir_fd=state)


def finish(dest: str, *owned: str) -> None:
    """After a success: remove ``owned`` (paths under DEST/.pallet this operation made, files or directories)
    and the INCOMPLETE marker, then DEST/.pallet itself if nothing else is left in it. Entries of the state
    directory are removed relative to its descriptor; other paths (a ``--journal`` elsewhere) by path.

    State of other unfinished work in the same directory (a bundle waiting
    to be unpacked, say) is left alone, and so is the directory holding it.
    """
    top = os.path.abspath(state_path(dest))
    inside = [os.path.relpath(os.path.abspath(p), top) for p in owned if os.path.dirname(os.path.abspath(p)) == top]
    for path in owned:
        if os.path.dirname(os.path.abspath(path)) != top:
            remove_path(path)
    try:
        with state_dir_fd(dest, create=False) as state:
            for name in (*inside, WRITING_DIR, TRANSFER_DIR, INCOMPLETE):   # what a killed stream or rsync left
                remove_entry(state, name)
    except FileNotFoundError:
        return
    try:
        os.rmdir(state_path(dest))
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
            raise


def prune(dest: str, directory: str) -> None:
    """Remove ``directory`` (inside DEST/.pallet) and its parents up to DEST/.pallet while they are empty."""
    top = os.path.abspath(state_path(dest))
    current = os.path.abspath(directory)
    while current == top or current.startswith(top + os.sep):
        try:
            os.rmdir(current)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return
            if exc.errno != errno.ENOENT:
                raise
        current = os.path.dirname(current)


def remove_state(dest: str) -> None:
    """Remove DEST/.pallet with everything in it (a whole-tree operation has succeeded)."""
    remove_path(state_path(dest))


def remove_path(path: str) -> None:
    """Remove a file, a link (never what it points to) or a directory tree; nothing there is fine."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
