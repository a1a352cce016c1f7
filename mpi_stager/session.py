"""`mpi_stager session DEST`: one far-side process for a whole push — the lock, DEST's listing, then a stream or a hold."""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, Iterator

from bundles.errors import DestinationError, DestinationLocked, StreamError
from bundles.state import INCOMPLETE, STATE_DIR, remove_state, state_path

from .receive import ReceiveSummary, receive

SESSION_VERSION = 1
HELLO = b"pallet-session %d\n" % SESSION_VERSION
LISTING_TAG = b"listing"
NOT_COMPARABLE = b"INCOMPLETE"      # the listing of a DEST marked incomplete: it resumes from its journal
CLEARED = b"cleared\n"

# Every entry under DEST except DEST/.pallet as 8 NUL-terminated fields: type, mode, mtime, size, link target,
# inode, links, path (staging_core.plain.parse_records reads them; its far-side scripts run the same find).
LISTING_ARGV = ("find", ".", "-mindepth", "1", "-path", "./" + STATE_DIR, "-prune", "-o",
                "-printf", r"%y\0%m\0%T@\0%s\0%l\0%i\0%n\0%P\0")


@dataclass(frozen=True)
class SessionCommand:
    """The one command a session takes after its listing: ``receive`` (the rest of stdin is a bundle stream,
    checked with ``verify``) or ``hold`` (keep the lock until stdin ends; a ``clear`` line meanwhile removes
    DEST/.pallet). With ``clear`` a receive removes DEST/.pallet once it has succeeded."""

    op: str
    verify: bool = True
    clear: bool = False

    def encode(self) -> bytes:
        words = [self.op] + (["noverify"] if not self.verify else []) + (["clear"] if self.clear else [])
        return " ".join(words).encode() + b"\n"

    @classmethod
    def decode(cls, line: bytes, source: str) -> "SessionCommand | None":
        """The command on ``line``; None for an empty line (stdin ended: the caller went away or had nothing
        to ask). StreamError for anything else."""
        if not line:
            return None
        op, *flags = line.decode(errors="replace").split()
        if op not in ("receive", "hold") or not set(flags) <= {"noverify", "clear"}:
            raise StreamError(f"unknown session command {line[:80]!r}", source,
                              "run the same pallet version on both sides")
        return cls(op, "noverify" not in flags, "clear" in flags)


def run_session(dest: str, inp: BinaryIO, out: BinaryIO, wait: bool = False,
                listing: bool = False) -> ReceiveSummary | None:
    """Serve one push into ``dest`` over ``inp``/``out`` (session protocol v1, docs/bundle-format.md §8).

    DEST is made if missing and locked (the flock `pallet push` takes;
    DestinationLocked at once if another operation holds it, or with
    ``wait`` once it is free) for as long as the session runs, so the lock
    dies with it. Then ``HELLO`` is written, and with ``listing`` one block
    ``listing N\\n`` + N bytes: DEST's entries as :data:`LISTING_ARGV`
    prints them, or ``INCOMPLETE`` for a DEST marked incomplete. One
    :class:`SessionCommand` line follows on ``inp``: ``receive`` runs
    :func:`mpi_stager.receive.receive` on the rest of ``inp`` and returns its
    summary; ``hold`` reads ``clear`` lines (each removes DEST/.pallet and
    answers ``cleared``) until ``inp`` ends and returns None, as does a
    session whose ``inp`` ends before any command.
    """
    source = f"session at {dest}"
    with _locked(dest, wait):
        out.write(HELLO)
        if listing:
            block = _listing(dest)
            out.write(b"%s %d\n" % (LISTING_TAG, len(block)) + block)
        out.flush()
        command = SessionCommand.decode(inp.readline(), source)
        if command is None:
            return None
        if command.op == "hold":
            _hold(dest, inp, out)
            return None
        summary = receive(inp, out, dest, command.verify, lock_held=True)
        if command.clear:
            remove_state(dest)
        return summary


@contextmanager
def _locked(dest: str, wait: bool) -> Iterator[None]:
    try:
        os.makedirs(dest, exist_ok=True)
        fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise DestinationError(f"cannot create or open the destination ({exc.strerror})", dest,
                               "check that DEST is a directory you can write, or can be made") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise DestinationLocked("another pallet push/pull is writing this destination", dest,
                                    f"wait for it to finish (it holds a flock on {dest}), then rerun") from None
        yield
    finally:
        os.close(fd)


def _listing(dest: str) -> bytes:
    if os.path.lexists(state_path(dest, INCOMPLETE)):
        return NOT_COMPARABLE
    found = subprocess.run(LISTING_ARGV, cwd=dest, stdin=subprocess.DEVNULL, capture_output=True)
    if found.returncode != 0:
        said = found.stderr.decode(errors="replace").strip().splitlines()
        raise DestinationError(f"cannot list the destination ({said[-1] if said else found.returncode})", dest,
                               "make everything under DEST readable to you, then rerun")
    return found.stdout


def _hold(dest: str, inp: BinaryIO, out: BinaryIO) -> None:
    for line in iter(inp.readline, b""):
        if line.strip() != b"clear":
            raise StreamError(f"unknown session request {line[:80]!r}", f"session at {dest}",
                              "run the same pallet version on both sides")
        remove_state(dest)
        out.write(CLEARED)
        out.flush()


def summary_line(summary: ReceiveSummary | None) -> str:
    """The session's last stdout line: the receive's JSON summary, or ``{"held": true}``."""
    return json.dumps(summary.to_json() if summary is not None else {"held": True})
