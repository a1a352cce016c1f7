"""Local scratch directories named after their owner's PID, swept once that process is gone (e.g. after kill -9)."""
from __future__ import annotations

import os
import shutil
import stat
import tempfile
from contextlib import contextmanager
from collections.abc import Iterator

from bundles.errors import DestinationError


def private_directory(path: str, hint: str) -> str:
    """Make ``path`` (and its parents) if missing, mode 0700, and return it once it is a real directory of this
    user's that nobody else can write into: a link, or another user's directory planted there, is refused with
    DestinationError (``hint`` says what to pass instead) and never written through."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    found = os.lstat(path)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.geteuid() or found.st_mode & 0o022:
        raise DestinationError("is not a directory of this user's that only this user can write into", path, hint)
    return path


def scratch_dir(prefix: str, root: str | None = None) -> str:
    """A new directory ``ROOT/PREFIX<pid>-XXXX`` (ROOT: $TMPDIR); first removes any left by dead owners."""
    root = root or tempfile.gettempdir()
    sweep_stale(prefix, root)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root)


@contextmanager
def scratch(prefix: str, root: str | None = None) -> Iterator[str]:
    """A :func:`scratch_dir` removed when the block ends."""
    path = scratch_dir(prefix, root)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def sweep_stale(prefix: str, root: str) -> None:
    """Remove ``ROOT/PREFIX<pid>-*`` directories whose process no longer exists."""
    for name in os.listdir(root):
        owner = name[len(prefix):].split("-", 1)[0] if name.startswith(prefix) else ""
        if owner.isdigit() and not _alive(int(owner)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:       # exists, owned by someone else
        return True
    return True
