"""Local scratch directories named after their owner's PID, swept once that process is gone (e.g. after kill -9)."""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Iterator


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
