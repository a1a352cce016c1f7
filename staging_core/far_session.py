"""A push's far side over one ssh channel: `mpi_stager session` holds DEST's lock, lists DEST, then receives."""
from __future__ import annotations

import shlex
from contextlib import contextmanager
from typing import Iterator

from bundles.errors import DestinationLocked, PalletError, StreamError
from mpi_stager.session import CLEARED, HELLO, LISTING_TAG, NOT_COMPARABLE, SessionCommand

from .locking import DestinationLock
from .options import StagingOptions
from .plain import FarEntry, parse_records
from .streaming import FarStager
from .transports.base import Endpoint, Transport

_USAGE_ERROR = 2
_MAX_LISTING_HEADER = 64


class SessionUnavailable(PalletError):
    """The far side's pallet has no `mpi_stager session` (an older version): the caller locks and lists with
    separate commands instead."""


class FarSession:
    """``remote_python -m mpi_stager session DEST`` over ``transport`` (ssh): DEST's lock, its listing, then one
    receive or a hold, all on one channel (docs/bundle-format.md §8).

    Entering it makes DEST and locks it (DestinationLocked at once if another
    operation holds it, or with ``wait`` once free); with ``listing`` the
    far side's listing of DEST is read too (:meth:`entries`). The lock is
    held until the session ends: after :meth:`receiver`'s stream, or when
    the session is closed. :meth:`receiver` may be called again after a
    failed stream (a retry): a new session is started, locking DEST again.
    SessionUnavailable when the far side's pallet predates sessions;
    FarStagerError or TransportError for other failures to start.
    ``supported`` is always True: it stands in for a DestinationLock.
    """

    supported = True

    def __init__(self, transport: Transport, endpoint: Endpoint, options: StagingOptions, wait: bool = False,
                 listing: bool = False):
        self.transport, self.endpoint, self.options, self.wait = transport, endpoint, options, wait
        self.cleared = False
        self._listing: bytes | None = None
        self._far = self._start(listing)
        self._command: SessionCommand | None = None

    def entries(self) -> dict[bytes, FarEntry] | None:
        """DEST's entries as the session listed them (DEST/.pallet left out); None when DEST is marked
        INCOMPLETE (it resumes from its journal) or was not listed."""
        if self._listing is None or self._listing == NOT_COMPARABLE:
            return None
        return parse_records(self._listing)

    def receiver(self, verify: bool, clear: bool) -> FarStager:
        """Ask the session to receive a bundle stream (``clear``: and remove DEST/.pallet after it); the returned
        FarStager's stdin takes the stream (:func:`staging_core.streaming.stream_push`)."""
        if self._command is not None:
            self._far.close()
            self._far = self._start(False)          # a retry: the last session ended with its stream
        self._send(SessionCommand("receive", verify, clear))
        self.cleared = clear
        return self._far

    def clear(self) -> None:
        """Remove DEST/.pallet now, the lock still held (holding it from now until the session closes)."""
        if self._command is None:
            self._send(SessionCommand("hold"))
        if self._command.op != "hold":
            raise StreamError("the session has already received its stream", self.endpoint.url())
        try:
            self._far.process.stdin.write(b"clear\n")
            self._far.process.stdin.flush()
            answer = self._far.process.stdout.readline()
        except (BrokenPipeError, ConnectionResetError):
            answer = b""
        if answer != CLEARED:
            raise self._far.failure()
        self.cleared = True

    def close(self, failed: bool = False) -> None:
        """End the session: the far side releases DEST's lock and exits. Unless ``failed``, a far-side failure
        that nothing reported yet is raised."""
        self._far.close()
        if not failed and self._far.process.returncode != 0 and (self._command is None or self._command.op == "hold"):
            raise self._far.failure()

    def __enter__(self) -> "FarSession":
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(failed=kind is not None)

    def _start(self, listing: bool) -> FarStager:
        far = FarStager(self.transport, session_argv(self.options, self.endpoint.path, self.wait, listing),
                        self.endpoint.url())
        try:
            if far.process.stdout.readline() != HELLO:
                raise self._refused(far)
            if listing:
                self._listing = _read_listing(far)
        except BaseException:
            far.close(0)
            raise
        return far

    def _refused(self, far: FarStager) -> PalletError:
        far.close()
        status = far.process.returncode
        stderr = far.stderr_text()
        if status == DestinationLocked.exit_code:
            return DestinationLocked("another pallet push/pull is writing this destination", self.endpoint.url(),
                                     f"wait for it to finish (it holds a flock on {self.endpoint.path}), then rerun")
        if status == _USAGE_ERROR and "invalid choice: 'session'" in stderr:
            return SessionUnavailable("the far side's pallet has no sessions", self.endpoint.url())
        return far.failure()

    def _send(self, command: SessionCommand) -> None:
        self._command = command
        try:
            self._far.process.stdin.write(command.encode())
            self._far.process.stdin.flush()
        except (BrokenPipeError, ConnectionResetError):
            raise self._far.failure() from None


def session_argv(options: StagingOptions, dest: str, wait: bool, listing: bool) -> list[str]:
    """The far-side command: ``remote_python -m mpi_stager session [--wait] [--list] DEST``."""
    flags = (["--wait"] if wait else []) + (["--list"] if listing else [])
    return [*shlex.split(options.remote_python), "-m", "mpi_stager", "session", *flags, dest]


def _read_listing(far: FarStager) -> bytes:
    header = far.process.stdout.readline(_MAX_LISTING_HEADER)
    tag, _, size = header.strip().partition(b" ")
    if tag != LISTING_TAG or not size.isdigit():
        raise far.failure() if not header else StreamError(f"unexpected session reply {header[:40]!r}", far.url,
                                                            "run the same pallet version on both sides")
    block = far.process.stdout.read(int(size))
    if len(block) != int(size):
        raise far.failure()
    return block


@contextmanager
def destination_lock(endpoint: Endpoint, transport: Transport, options: StagingOptions, session: bool,
                     wait: bool, listing: bool) -> Iterator[FarSession | DestinationLock]:
    """DEST locked for one push: by a :class:`FarSession` when ``session`` (an ssh far side with pallet that
    streams) and its pallet has sessions, else by a :class:`DestinationLock`."""
    if session:
        try:
            opened = FarSession(transport, endpoint, options, wait, listing)
        except SessionUnavailable:
            opened = None
        if opened is not None:
            with opened:
                yield opened
            return
    with DestinationLock(endpoint, transport, wait) as lock:
        yield lock
