"""One far-side shell session for a tar-tools push: lock, list, extract shard by shard and check, on one channel."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from bundles.errors import DestinationError, StreamError
from mpi_stager.wire import LOCKED, check_tar_tools_line, tar_tools_script

from staging_core.locking import DestinationLock, locked_error
from staging_core.transports.base import Endpoint, Transport
from staging_core.transports.errors import classify

FRAME_BYTES = 4 << 20     # stream bytes gathered into one frame (one `head -c` there)


@dataclass
class FrameWriter:
    """Shard bytes as frames on the session's input, gathered to :data:`FRAME_BYTES` so `head -c` runs seldom."""

    write_raw: Callable[[bytes], None]
    pending: list[bytes] = field(default_factory=list)
    size: int = 0

    def write(self, data) -> None:
        self.pending.append(bytes(data))
        self.size += len(data)
        if self.size >= FRAME_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.size:
            self.write_raw(b"%d\n" % self.size)
            for piece in self.pending:          # one by one: gathering them would copy the frame twice
                self.write_raw(piece)
        self.pending, self.size = [], 0


@dataclass(frozen=True)
class CheckReply:
    """What the far side's ``md5sum -c`` of the queued lines said (``status``; the 1-based numbers of the lines
    that ``failed``; ``count``: the lines it checked), and the md5sum lines of the names it hashed instead."""

    status: int
    failed: list[int]
    count: int
    sums: bytes


class FarSession:
    """The far side's end of a tar-tools push into ``endpoint``: the tar-tools "session" script
    (mpi_stager.wire, docs/wire.md); a context manager.

    ``lock``: "held" (the caller holds DEST's lock), "try" or "wait" (the
    session takes it there, a flock on DEST itself: DestinationLocked when
    another run holds it, or it waits). Every method writes one command;
    those that expect a reply block until it arrives. When the far side
    fails, the next call raises the TransportError its status and message
    give (a DestinationError for the script's own refusals). Closing without
    :meth:`finish` leaves DEST marked incomplete and resumable.
    """

    def __init__(self, transport: Transport, endpoint: Endpoint, decoder: str, lock: str = "held"):
        self.endpoint = endpoint
        self.far = transport.stream_into(["sh", "-c", tar_tools_script("session"), "pallet-session", endpoint.path,
                                          decoder, lock])
        self._errors: list[bytes] = []
        self._listing: bytes | None = None
        self._drain = threading.Thread(target=lambda: self._errors.append(self.far.stderr.read()),
                                       name="pallet-session-stderr", daemon=True)
        self._drain.start()

    def __enter__(self) -> FarSession:
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            self._abandon()                         # SIGINT, SIGTERM: the far side is not waited for
        self.close(failed=kind is not None)

    def listing(self) -> bytes:
        """The listing records the session opened with, after its version line (checked): once it is read, DEST's
        lock is held (with ``lock`` "try" or "wait")."""
        if self._listing is None:
            self._to_far_side(self.far.stdin.flush)
            line = self.far.stdout.readline()
            if not line:
                raise self._failure(self._ended())
            try:
                check_tar_tools_line(line, self.endpoint.url())
            except StreamError:
                self._abandon()
                raise
            self._listing = self._reply()
        return self._listing

    def shard(self) -> FrameWriter:
        """Start one tar run there; write its shards' bytes to the FrameWriter, then call :meth:`end_shard`."""
        self._send(b"T\n")
        return FrameWriter(self._send)

    def end_shard(self, frames: FrameWriter) -> None:
        """End the run there."""
        frames.flush()
        self._send(b"0\n")

    def queue_check(self, lines: bytes, names: bytes) -> None:
        """Queue md5sum check ``lines`` (``HEX  ./NAME\\n``, of files already there) for the far side's background
        ``md5sum -c``, and NUL-separated ``./names`` to hash there at the next :meth:`checked`."""
        if lines or names:
            self._send(b"V %d %d\n" % (len(lines), len(names)) + lines + names)

    def checked(self) -> CheckReply:
        """Wait for the far side's checks of everything queued since the last call: what they found."""
        self._send(b"W\n")
        numbers = [int(word) for word in self._reply().split()]
        sums = self._reply()
        if not numbers:
            raise self._failure(self._ended())
        return CheckReply(numbers[0], numbers[1:-1], numbers[-1] if len(numbers) > 1 else 0, sums)

    def finish(self, clear_state: bool, mtime_ns: int | None = None) -> None:
        """Take the INCOMPLETE mark away (and DEST/.pallet with ``clear_state``) and give DEST the mtime
        ``mtime_ns`` (None: leave it). A session that holds DEST's lock keeps it until it is closed."""
        stamp = b"" if mtime_ns is None else b" %d.%09d" % divmod(mtime_ns, 1_000_000_000)
        self._send(b"F %d%s\n" % (clear_state, stamp))
        self._reply()

    def close(self, failed: bool = False) -> None:
        """End the session, waiting for the far side to exit; raise if it failed before finishing, unless
        ``failed``: an error here (a source file that changed while read, say) is on its way, and the far side's
        failure is only its echo (its tar saw the stream end in the middle of a frame)."""
        if self.far.returncode is not None:
            return
        code = self._ended()
        self.far.stdout.close()
        if code not in (0, 9) and not failed:
            raise self._failure(code)

    def _abandon(self) -> None:
        """End our input (the far side's script ends as it reads its end), stop ssh and our reads of its output."""
        with contextlib.suppress(OSError):
            self.far.stdin.close()
        self.far.stop()
        self.far.wait()
        self.far.stdout.close()

    def _send(self, data: bytes) -> None:
        self._to_far_side(self.far.stdin.write, data)

    def _to_far_side(self, operation, *args) -> None:
        """Write to (or flush) the session's input; a far side that has gone raises what its status says."""
        try:
            operation(*args)
        except (BrokenPipeError, ConnectionResetError):
            raise self._failure(self._ended()) from None

    def _reply(self) -> bytes:
        self._to_far_side(self.far.stdin.flush)
        line = self.far.stdout.readline()
        body = self.far.stdout.read(int(line)) if line.strip().isdigit() else b""
        if not line.strip().isdigit() or len(body) != int(line):
            raise self._failure(self._ended())
        return body

    def _ended(self) -> int:
        """Close the session's input and wait for the far side: its exit status."""
        with contextlib.suppress(OSError):
            self.far.stdin.close()
        code = self.far.wait()
        self._drain.join()
        return code

    def _failure(self, code: int):
        message = b"".join(self._errors).decode(errors="replace").strip()
        if code == LOCKED:
            return locked_error(self.endpoint)
        if code in (5, 6, 8):
            return DestinationError(message.removeprefix("pallet: ") or f"the far side stopped ({code})",
                                    self.endpoint.url(), "fix that, then rerun: what landed intact is kept")
        return classify(message, code, ["tar", "-x"], self.endpoint.url(),
                        f"the far side's tar session failed with status {code}")


@dataclass
class SessionSlot:
    """The session of one tar-tools push that holds DEST's lock there (``lock``: "try" or "wait"), opened by
    :class:`SessionLock` before the push plans and used by its first attempt; a later attempt (a retry) opens a
    new one, which takes the lock again. Without a SessionLock (``lock`` None) each attempt opens a session of
    its own under the caller's lock and closes it."""

    lock: str | None = None
    session: FarSession | None = None
    fresh: bool = False

    def open(self, transport: Transport, endpoint: Endpoint, decoder: str, lock: str) -> None:
        """Open the session that takes DEST's lock; return once it holds it (its listing has come)."""
        self.lock = lock
        self._start(transport, endpoint, decoder)

    @contextlib.contextmanager
    def attempt(self, transport: Transport, endpoint: Endpoint, decoder: str) -> Iterator[FarSession]:
        """The session one attempt of a push works in."""
        if self.lock is None:
            with FarSession(transport, endpoint, decoder) as own:
                yield own
            return
        if not self.fresh:
            self.close(failed=True)
            self._start(transport, endpoint, decoder)
        self.fresh = False
        assert self.session is not None
        try:
            yield self.session
        except KeyboardInterrupt:
            self.session._abandon()             # SIGINT, SIGTERM: the far side is not waited for
            raise

    def close(self, failed: bool = False) -> None:
        """End the session (releasing DEST's lock there); see :meth:`FarSession.close`."""
        session, self.session, self.fresh = self.session, None, False
        if session is not None:
            if failed:
                with contextlib.suppress(Exception):
                    session.close(failed=True)
            else:
                session.close()

    def _start(self, transport: Transport, endpoint: Endpoint, decoder: str) -> None:
        assert self.lock is not None
        session = FarSession(transport, endpoint, decoder, self.lock)
        try:
            session.listing()
        except BaseException as exc:
            session.__exit__(type(exc), exc, None)
            raise
        self.session, self.fresh = session, True


class SessionLock(DestinationLock):
    """DEST's lock for a push through the tar-tools route, taken by the route's own far-side session
    (:class:`SessionSlot`) instead of a separate lock command: the same flock on DEST itself, held by the far
    side's shell for the whole push (through every attempt) and gone when this process is; DestinationLocked at
    once when another run holds it, or with ``wait`` waiting for it."""

    def __init__(self, slot: SessionSlot, endpoint: Endpoint, transport: Transport, decoder: str,
                 wait: bool = False):
        super().__init__(endpoint, transport, wait)
        self.slot, self.decoder = slot, decoder

    def _lock_there(self) -> None:
        self.slot.open(self.transport, self.endpoint, self.decoder, "wait" if self.wait else "try")

    def __exit__(self, kind, *exc) -> None:
        try:
            if kind is not None and issubclass(kind, KeyboardInterrupt) and self.slot.session is not None:
                self.slot.session._abandon()
            self.slot.close(failed=kind is not None)
        finally:
            self.slot.lock = None
            super().__exit__(kind, *exc)
