"""pallet's state in a destination: one hidden directory, DEST/.pallet, that exists only while work is unfinished."""
from __future__ import annotations

import errno
import os
import shutil

from .extract import create_file

STATE_DIR = ".pallet"
INCOMPLETE = "INCOMPLETE"       # file in STATE_DIR: says what is unfinished and that a rerun finishes it


def state_path(dest: str, *parts: str) -> str:
    """A path under ``dest``'s state directory."""
    return os.path.join(dest, STATE_DIR, *parts)


def mark_incomplete(dest: str, text: str) -> str:
    """Create DEST/.pallet (if needed) and write ``text`` to DEST/.pallet/INCOMPLETE; return the marker's path.

    The marker is created anew (a file or link already there is unlinked,
    never written through), so it always tells the current operation.
    """
    os.makedirs(state_path(dest), mode=0o700, exist_ok=True)
    marker = state_path(dest, INCOMPLETE)
    with os.fdopen(create_file(os.fsencode(marker)), "w") as handle:
        handle.write(text if text.endswith("\n") else text + "\n")
    return marker


def is_incomplete(dest: str) -> bool:
    """True while DEST carries pallet's state directory (an operation there has not finished)."""
    return os.path.lexists(state_path(dest))


def finish(dest: str, *owned: str) -> None:
    """After a success: remove ``owned`` (paths under DEST/.pallet this operation made, files or directories)
    and the INCOMPLETE marker, then DEST/.pallet itself if nothing else is left in it.

    State of other unfinished work in the same directory (a bundle waiting
    to be unpacked, say) is left alone, and so is the directory holding it.
    """
    for path in (*owned, state_path(dest, INCOMPLETE)):
        remove_path(path)
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
