"""The worker-process side of :class:`bundles.parallel.WorkerPool`: call pickled tasks read from a pipe."""
from __future__ import annotations

import ctypes
import os
import pickle
import signal
import struct
import sys
from typing import Any

_LENGTH = struct.Struct("<Q")
_PR_SET_PDEATHSIG = 1


def send_message(fd: int, message: object) -> None:
    """Write one length-prefixed pickle onto ``fd`` (blocking until all of it is written)."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    for part in (_LENGTH.pack(len(payload)), payload):
        view = memoryview(part)
        while view:
            view = view[os.write(fd, view):]


def receive_message(fd: int) -> Any:
    """Read one message written by :func:`send_message` (unpickled: of whatever type was sent); raise EOFError
    if the pipe closes first."""
    (length,) = _LENGTH.unpack(_read_exactly(fd, _LENGTH.size))
    return pickle.loads(_read_exactly(fd, length))


def _read_exactly(fd: int, count: int) -> bytes:
    parts, remaining = [], count
    while remaining:
        chunk = os.read(fd, min(remaining, 1 << 24))
        if not chunk:
            raise EOFError("pipe closed")
        parts.append(chunk)
        remaining -= len(chunk)
    return b"".join(parts)


def die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when the thread that started it ends, and exit at once if process
    ``parent`` is already gone (this process was reparented before the request took effect)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def serve(task_fd: int, result_fd: int, parent: int) -> None:
    """Answer ``(func, item)`` messages with ``(True, func(item))`` or ``(False, exception)`` until EOF.

    The worker asks Linux to kill it when the thread that started it ends
    (so a ``kill -9`` of the host leaves no orphan), and exits at once if
    that already happened.
    """
    die_with_parent(parent)
    while True:
        try:
            func, item = receive_message(task_fd)
        except EOFError:
            return
        try:
            reply = (True, func(item))
        except Exception as exc:     # every failure goes back to the caller, which re-raises it
            reply = (False, _portable(exc))
        send_message(result_fd, reply)


def _portable(exc: Exception) -> Exception:
    """``exc`` if it survives pickling, else a plain RuntimeError carrying its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
