"""One push or pull at a time per destination.

A flock on DEST itself, held for the whole operation, released if pallet dies.
"""
from __future__ import annotations

import fcntl
import os
import subprocess

from bundles.errors import DestinationLocked, PalletError

from staging_core.transports.base import Endpoint, Transport

_BUSY = 75


class DestinationLock:
    """Hold a ``flock(2)`` on the directory DEST itself while the operation runs (it is created first).

    No lock file is made, so nothing of the lock is ever left in DEST, and
    removing pallet's state there at the end cannot break it. Local
    destinations lock in this process; ssh destinations run
    ``mkdir -p DEST && flock -n DEST sh -c 'echo held; exec cat'`` there (one command), whose stdin is our
    pipe, so the lock dies with this process even after ``kill -9`` (no
    stale lock to clean up). Destinations without remote execution are not
    locked (``supported`` is False) — see docs/staging.md. Entering raises
    DestinationLocked at once if another operation holds it, or with
    ``wait`` blocks until it is free (selections: many small batches into
    one destination queue up instead of failing).
    """

    def __init__(self, endpoint: Endpoint, transport: Transport, wait: bool = False):
        self.endpoint = endpoint
        self.transport = transport
        self.wait = wait
        self.path = endpoint.path
        self.supported = endpoint.is_local or transport.capabilities.remote_exec
        self._fd: int | None = None
        self._holder: subprocess.Popen | None = None

    def __enter__(self) -> DestinationLock:
        if not self.supported:
            return self
        if self.endpoint.is_local:
            self.transport.mkdir(self.path)
            self._lock_here()
        else:
            self._lock_there()
        return self

    def _lock_here(self) -> None:
        self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | (0 if self.wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            raise locked_error(self.endpoint) from None

    def _lock_there(self) -> None:
        flock = "flock" if self.wait else "flock -n"
        argv = ["sh", "-c", f'mkdir -p -- "$1" && exec {flock} -E {_BUSY} "$1" sh -c "echo held; exec cat >/dev/null"',
                "pallet-lock", self.path]
        holder: subprocess.Popen = self.transport.stream_into(argv)
        self._holder = holder
        assert holder.stdout is not None and holder.stderr is not None       # stream_into's pipes
        line = holder.stdout.readline()
        if line.strip() == b"held":
            return
        status = holder.wait()
        stderr = holder.stderr.read().decode(errors="replace").strip()
        self._holder = None
        if status == _BUSY:
            raise locked_error(self.endpoint)
        raise PalletError(f"cannot create or lock the destination ({stderr or f'status {status}'})",
                          self.endpoint.url(), "check that DEST can be made there and that `flock` (util-linux) "
                                               "is installed")

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._holder is not None:
            if self._holder.stdin is not None:
                self._holder.stdin.close()
            self._holder.wait()
            self._holder = None


def locked_error(endpoint: Endpoint) -> DestinationLocked:
    """The error of a push or pull that finds ``endpoint``'s DEST locked by another operation."""
    return DestinationLocked("another pallet push/pull is writing this destination", endpoint.url(),
                             f"wait for it to finish (it holds a flock on {endpoint.path}), then rerun")
