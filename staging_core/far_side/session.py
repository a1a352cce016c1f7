"""A push's far side over one ssh channel: `mpi_stager session` holds DEST's lock, lists DEST, receives, tidies."""
from __future__ import annotations

import shlex
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from bundles.errors import PalletError, StreamError
from mpi_stager.send import BegunStream, StreamSource, begin_stream
from mpi_stager.wire import (DECLINED, LOCKED, MAX_LISTING_HEADER, NOT_COMPARABLE, OK, USAGE_ERROR, Agreement,
                             FarEntry, Hello, ReceiveSummary, SessionRequest, WireVersionError, agree, client_hello,
                             decode_listing, decode_resume_reply, decode_summary, encode_dirs, hello_env, install_hint,
                             listing_size, parse_records)

from staging_core.locking import DestinationLock, locked_error
from staging_core.options import StagingOptions
from staging_core.far_side.far_process import FarStager
from staging_core.transports.base import Endpoint, Transport

_OFFER_GRACE_S = 5


class SessionUnavailable(PalletError):
    """The far side's pallet is older than this one's session protocol (its hello says so, or it has no
    `mpi_stager session` at all: status 2 and no hello), or lacks a capability the push wants: the caller
    locks, lists and receives with separate commands instead, which that pallet has."""


class FarSession:
    """``remote_python -m mpi_stager session DEST`` over ``transport`` (ssh): DEST's lock, its listing, bundle
    streams, directory times and the final clean-up, all on one channel (docs/wire.md, "The session").

    The client's hello (its versions and the capabilities it wants) rides
    in the command's environment, the far side's is its first line; what
    they agree on is checked before anything else is read, and
    :attr:`hello` keeps the far side's.

    Entering it makes DEST and locks it (DestinationLocked at once if another
    operation holds it, or with ``wait`` once free); with ``listing`` the
    far side's listing of DEST is read too (:meth:`entries`). The lock is
    held until the session is closed. A stream that fails ends the session
    there; the next :meth:`receiver` (a retry) starts a new one, locking
    DEST again. The finishing requests (:meth:`set_directories`,
    :meth:`clear`) are queued and sent with the session's end in one write,
    so that they cost one round trip between them, not one each; their
    errors are raised by :meth:`close`, and a session closed as failed
    drops them unsent. When a stream is the push's last request and
    ``clear`` its only finishing (:meth:`end_with_stream`), that ``clear``
    and the end of the input go right after the stream, costing no round
    trip after it. SessionUnavailable when the far side's pallet is older
    (see there); WireVersionError, naming both sides' versions and the fix,
    when it is newer and no longer speaks this session version, or shares
    no bundle stream or summary version; FarStagerError or TransportError
    for other failures. ``supported`` is always True: it
    stands in for a DestinationLock.

    ``offer`` gives the stream a push would send into an empty DEST (None:
    none), and is called once the far side is being started. That stream
    is sent as ``receive-new`` at once, before the hello is read, so that its
    skeleton travels while the far side starts and lists DEST;
    :attr:`offer_taken` then says whether the far side found DEST empty and
    receives it (the first :meth:`receiver` goes on with it) or declined
    it; :attr:`declined_bytes` counts what a declined offer sent.
    """

    supported = True

    def __init__(self, transport: Transport, endpoint: Endpoint, options: StagingOptions, wait: bool = False,
                 listing: bool = False, offer: Callable[[], StreamSource | None] | None = None):
        self.transport, self.endpoint, self.options, self.wait = transport, endpoint, options, wait
        self._listing: bytes | None = None
        self._begun: BegunStream | None = None
        self.declined_bytes = 0
        self.hello: Hello | None = None
        self._far = self._start(listing, offer)
        self.offer_taken = self._begun is not None
        self._broken = False
        self._streams = 0
        self._queued: list[bytes] = []
        self._last_stream = False       # the next stream ends the session's input (end_with_stream)
        self._answers_due = 0           # answers of requests sent with the session's end, read by close()

    def entries(self) -> dict[bytes, FarEntry] | None:
        """DEST's entries as the session listed them (DEST/.pallet left out); None when DEST is marked
        INCOMPLETE (it resumes from its journal) or was not listed."""
        if self._listing is None or self._listing == NOT_COMPARABLE:
            return None
        return parse_records(self._listing)

    def receiver(self, verify: bool) -> SessionStream:
        """Ask the session to receive a bundle stream; the returned stager's stdin takes it
        (:func:`staging_core.far_side.streaming.stream_push`), and its summary is the session's answer."""
        if self._broken:
            self._far.close()
            self._far = self._start(False)          # a retry: the last stream ended that session
            self._answers_due = 0
        self._broken = True                         # until the stream's summary has come back
        begun, self._begun = self._begun, None
        if begun is None:
            self._send(SessionRequest("receive", verify))
        self._streams += 1
        unmarked = self._listing is not None and self._listing != NOT_COMPARABLE
        return SessionStream(self, holds_no_shards=self._streams == 1 and unmarked, begun=begun)

    def set_directories(self, entries: list[tuple[bytes, int, int]]) -> None:
        """Queue: give DEST's directories ``entries`` (relative path, mode, mtime ns) that mode and mtime."""
        if entries:
            payload = encode_dirs(entries)
            self._queue(SessionRequest("dirs", size=len(payload)), payload)

    def clear(self) -> None:
        """Queue: remove DEST/.pallet, the lock still held (nothing when the last stream's end asked for it)."""
        if not self._answers_due:
            self._queue(SessionRequest("clear"))

    def end_with_stream(self) -> None:
        """Declare that a stream is the last thing the push asks of the far side, and that its finishing is only
        :meth:`clear`: once its index is written, ``clear`` and the end of the session's input follow at once
        (requests are served in order, each only after the one before succeeded), so that the far side answers
        the summary, clears and ends without a further round trip. :meth:`close` reads that answer."""
        self._last_stream = True

    def _end_after(self, stream: SessionStream) -> None:
        """After ``stream``'s index, when it is the last one: ``clear`` and the end of the input."""
        if not self._last_stream:
            return
        stream.stdin.write(SessionRequest("clear").encode())
        stream.stdin.flush()
        self._far.close_input()
        self._answers_due = 1

    def close(self, failed: bool = False) -> None:
        """End the session: unless ``failed``, send the queued requests and check their answers; the far side
        then releases DEST's lock and exits. Unless ``failed``, a far-side failure that nothing reported yet is
        raised."""
        queued, self._queued = self._queued, []
        if not failed and queued:
            if self._answers_due:       # set_directories after end_with_stream: the caller's defect
                raise StreamError("a request queued after the far-side session's input ended", self.endpoint.url())
            self._send_all(queued)
        if not failed:
            self._far.close_input()
            for _ in range(len(queued) + self._answers_due):
                if self._far.stdout.readline() != OK:
                    raise self._far.failure()
        self._far.close()
        if not failed and self._far.process.returncode != 0:
            raise self._far.failure()

    def __enter__(self) -> FarSession:
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            self._far.interrupt()                   # SIGINT, SIGTERM: the far side is not waited for
        self.close(failed=kind is not None or self._broken)

    def _start(self, listing: bool, offer: Callable[[], StreamSource | None] | None = None) -> FarStager:
        mine = client_hello(wanted_caps(listing, self.wait, offer is not None))
        far = FarStager(self.transport, session_argv(self.options, self.endpoint.path, self.wait, listing, mine),
                        self.endpoint.url())
        offering = None
        try:
            source = offer() if offer is not None else None
            offering = _Offer(far, source, self.options.verify) if source is not None else None
            line = far.stdout.readline()
            answered = Hello.parse_far(line)
            agreed = agree(mine, answered) if answered is not None else None
            if agreed is None or not agreed.ok:
                if offering is not None:        # a far side that goes no further may read no offer: end it
                    offering.stop(kill=agreed is not None and not agreed.far_older)
                raise self._refused(far, line, agreed)
            self.hello = answered
            if listing:
                self._listing = _read_listing(far)
            if offering is not None:
                self._begun, self.declined_bytes = offering.outcome(self._listing == b"")
        except BaseException as exc:
            interrupted = isinstance(exc, KeyboardInterrupt)    # SIGINT, SIGTERM: nothing is waited for
            if interrupted:
                far.interrupt()
            if offering is not None:            # its write may wait on a far side that reads no more
                offering.stop(kill=True, wait=not interrupted)
            far.close(0)
            raise
        return far

    def _refused(self, far: FarStager, line: bytes, agreed: Agreement | None) -> PalletError:
        """The error of a far side that answered ``line`` and is not to be spoken with: a hello of versions this
        pallet does not share (``agreed``), something else, or nothing (then its exit status says why)."""
        url = self.endpoint.url()
        if agreed is not None and agreed.far_older:     # it ends as its input does, releasing DEST's lock for
            far.close(_OFFER_GRACE_S)                   # the separate commands that replace it
            return SessionUnavailable(agreed.problem(client_side=True), url)
        if line:                    # it would wait for requests it cannot serve: end it at once
            far.abandon()
            far.close()
            if agreed is not None:
                return WireVersionError(agreed.problem(client_side=True), url, install_hint(url))
            return StreamError(f"the far side answered {line[:60]!r} instead of a session hello", url,
                               install_hint(url))
        far.close()
        status = far.process.returncode
        if status == LOCKED:
            return locked_error(self.endpoint)
        if status == USAGE_ERROR:           # no hello and a usage error: a pallet before sessions
            return SessionUnavailable("the far side's pallet has no session command", url)
        return far.failure()

    def _send(self, request: SessionRequest, payload: bytes = b"") -> None:
        self._send_all([request.encode() + payload])

    def _send_all(self, requests: list[bytes]) -> None:
        try:
            self._far.stdin.write(b"".join(requests))
            self._far.stdin.flush()
        except (BrokenPipeError, ConnectionResetError):
            raise self._far.failure() from None

    def _queue(self, request: SessionRequest, payload: bytes = b"") -> None:
        if self._broken:
            raise StreamError("the far-side session ended with a failed stream", self.endpoint.url())
        self._queued.append(request.encode() + payload)


class _Offer:
    """``receive-new`` and a stream's prelude and skeleton written to a session on a thread of their own (the
    far side reads them only after it has listed DEST, and the listing may fill the pipe the other way)."""

    def __init__(self, far: FarStager, source: StreamSource, verify: bool):
        self.far, self.source, self.verify = far, source, verify
        self.begun: BegunStream | None = None
        self._thread = threading.Thread(target=self._write, name="pallet-offer", daemon=True)
        far.writer = self._thread
        self._thread.start()

    def _write(self) -> None:
        try:
            self.far.stdin.write(SessionRequest("receive-new", self.verify).encode())
            self.begun = begin_stream(self.source, self.far.stdin)
        except (OSError, ValueError):       # the far side went away: reading its answers says why
            self.begun = None

    def stop(self, kill: bool, wait: bool = True) -> None:
        """End the offer's thread: a write blocked on a far side that will not read ends when the session is
        abandoned (at once with ``kill``, else after a grace period in which a far side that exits ends it);
        with ``wait``, for a grace period until it has ended (a daemon thread, it never holds pallet's exit)."""
        if not kill:
            self._thread.join(_OFFER_GRACE_S)
        if self._thread.is_alive():
            self.far.abandon()
        if wait:
            self._thread.join(_OFFER_GRACE_S)

    def outcome(self, taken: bool) -> tuple[BegunStream | None, int]:
        """Once the listing is read: ``(the begun stream, 0)`` when the far side takes it (``taken``: DEST listed
        empty), else ``(None, the bytes offered)`` after reading its ``declined``."""
        self._thread.join()
        if self.begun is None:
            raise self.far.failure()
        if taken:
            return self.begun, 0
        if self.far.stdout.readline() != DECLINED:
            raise self.far.failure()
        return None, self.begun.wire.bytes_written


class SessionStream:
    """The stream side of a :class:`FarSession` as :func:`staging_core.far_side.streaming.stream_push` uses a
    FarStager: its stdin, the receiver's answer, its summary (the session then goes on) and its errors.

    ``holds_no_shards``: the session listed DEST unmarked, so no interrupted stream left shards there (a
    receiver that finds no INCOMPLETE marker drops every journal, see bundles.journal.untrusted_journals). The
    sender then need not wait for the receiver's resume answer before its first shard: :meth:`handshake`
    answers "none" at once, and a thread reads the answer as it comes (so that a long one never blocks the
    receiver while the sender writes), which is checked before the summary. Were it to name shards anyway,
    they are only received again.
    """

    def __init__(self, session: FarSession, holds_no_shards: bool = False, begun: BegunStream | None = None):
        self.session, self.far = session, session._far
        self.process, self.stdin, self.stdout = self.far.process, self.far.stdin, self.far.stdout
        self.holds_no_shards, self.begun = holds_no_shards, begun
        self._answer: threading.Thread | None = None
        self._answer_line = b""
        self._stream_id = ""

    def handshake(self, stream_id: str) -> dict[int, bytes]:
        if not self.holds_no_shards:
            return self.far.handshake(stream_id)
        self._stream_id = stream_id
        self._answer = threading.Thread(target=self._read_answer, name="pallet-resume-answer", daemon=True)
        self._answer.start()
        return {}

    def _read_answer(self) -> None:
        """On the answer's thread: read its line, nothing else (the pipes and errors are the caller's)."""
        try:
            self._answer_line = self.stdout.readline()
        except (OSError, ValueError):        # the caller closed the pipe after a failure it reports
            self._answer_line = b""

    def summary(self) -> ReceiveSummary:
        """The receiver's summary line; the session is then ready for its next request. No line: the far side's
        error; a line that is no receive summary: SummaryError (the session then ends)."""
        self.stdin.flush()
        self.session._end_after(self)
        if self._answer is not None:
            self._answer.join()
            if not self._answer_line:
                raise self.failure()
            decode_resume_reply(self._answer_line, self._stream_id, self.far.url)
        line = self.stdout.readline()
        if not line.strip():
            raise self.failure()
        summary = decode_summary(line, "receive", self.far.url)
        self.session._broken = False
        return summary

    def failure(self) -> PalletError:
        return self.far.failure()

    def interrupt(self) -> None:
        """On an interrupt: stop the session's far side at once (see FarStager.interrupt)."""
        self.far.interrupt()

    def close(self) -> None:
        """Nothing to do: the session outlives its streams (a failed one ends when the session is closed)."""


def session_argv(options: StagingOptions, dest: str, wait: bool, listing: bool, hello: Hello | None = None
                 ) -> list[str]:
    """The far-side command: ``env PALLET_HELLO=HELLO remote_python -m mpi_stager session [--wait] [--list] DEST``,
    ``hello`` the client's (None: the one for these flags, offering no stream)."""
    flags = (["--wait"] if wait else []) + (["--list"] if listing else [])
    hello = hello or client_hello(wanted_caps(listing, wait, False))
    return [*hello_env(hello), *shlex.split(options.remote_python), "-m", "mpi_stager", "session", *flags, dest]


def wanted_caps(listing: bool, wait: bool, offering: bool) -> set[str]:
    """The session capabilities a push asks for: receive, dirs and clear, and as it lists, waits or offers."""
    optional = {"listing": listing, "wait": wait, "receive-new": offering}
    return {"receive", "dirs", "clear", *(cap for cap, wanted in optional.items() if wanted)}


def _read_listing(far: FarStager) -> bytes:
    header = far.stdout.readline(MAX_LISTING_HEADER)
    size = listing_size(header)
    if size is None:
        raise far.failure() if not header else StreamError(f"unexpected session reply {header[:40]!r}", far.url,
                                                            install_hint(far.url))
    block = _read_declared(far.stdout, size)
    if len(block) != size:
        raise far.failure()
    return decode_listing(block, far.url)


def _read_declared(stream, size: int, chunk: int = 1 << 20) -> bytes:
    """Up to ``size`` bytes of ``stream``, read a chunk at a time: memory follows the bytes that arrive, never
    the size the far side declared."""
    parts, got = [], 0
    while got < size:
        part = stream.read(min(chunk, size - got))
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


@contextmanager
def destination_lock(endpoint: Endpoint, transport: Transport, options: StagingOptions, session: bool,
                     wait: bool, listing: bool, offer: Callable[[], StreamSource | None] | None = None
                     ) -> Iterator[FarSession | DestinationLock]:
    """DEST locked for one push: by a :class:`FarSession` when ``session`` (an ssh far side with pallet that
    streams) and its pallet has sessions, else by a :class:`DestinationLock`. ``offer`` gives the stream the
    session offers for an empty DEST (None: no offer; see FarSession)."""
    if session:
        try:
            opened = FarSession(transport, endpoint, options, wait, listing, offer if listing else None)
        except SessionUnavailable:
            opened = None
        if opened is not None:
            with opened:
                yield opened
            return
    with DestinationLock(endpoint, transport, wait) as lock:
        yield lock
