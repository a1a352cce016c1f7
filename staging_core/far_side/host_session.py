"""A warm host session: one ssh connection and one `mpi_stager serve` per host, shared by a run's operations."""
from __future__ import annotations

import os
import shlex
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace

from bundles.errors import PalletError
from mpi_stager.wire import (HOST_HELLO_ENV, MAX_LINE, HostHello, decode_error, frame, host_client_text,
                             install_hint, parse_header, parse_records, read_exactly)

from staging_core.far_side.far_process import FarStager
from staging_core.options import StagingOptions
from staging_core.transports.declarations import KEEP_S
from staging_core.transports.base import EarlyConnection, Endpoint, RemoteEntry, Transport
from staging_core.transports.errors import RemotePathMissingError, TransportError
from staging_core.transports.registry import open_endpoint
from staging_core.transports.ssh_master import SSHMaster, ssh_options_for


PIPELINED_MAX = 64 << 10     # a first request this small is sent with the far side's start, before its hello


class SessionLost(TransportError):
    """The connection or the far side of a host session ended during an operation: that operation failed
    (nothing it wrote is left in place half-done); the next request starts a new far side."""

    retryable = True


class NoHostSession(PalletError):
    """The far side cannot serve a host session (no pallet there, or one without `mpi_stager serve`, or of a
    host-session version this one does not speak): the caller moves files the usual way."""


@dataclass(frozen=True)
class HostKey:
    """What one host session serves: user, host, port, ssh options and the far side's Python."""

    user: str | None
    host: str | None
    port: int | None
    ssh_options: tuple[str, ...]
    remote_python: str


class HostSession:
    """``remote_python -m mpi_stager serve`` over one ssh connection to one host (docs/wire.md, "The host
    session"), for every stat, list, put and get of a run.

    :meth:`request` sends one request and returns its answer's payload; the
    requests of several threads are served one after another. The far side
    is started on the first request (a small first request is sent with it,
    before its hello is read and checked) and again after it
    or the connection died: a request that finds it gone, or loses it
    before the answer, is sent once more to a new one (every request is
    idempotent); when that fails too, it raises SessionLost (retryable),
    and the next request starts afresh. An ``error``
    answer raises the PalletError it carries (the session goes on).
    NoHostSession when the far side cannot serve (then every later request
    says so at once, without trying again). :meth:`transport` is an ssh
    transport over the same connection for the operations that move files
    the usual way. :meth:`close_far_side` ends the far side (the connection
    stays); :meth:`close` ends both.
    """

    def __init__(self, key: HostKey, endpoint: Endpoint, options: StagingOptions, keep_s: float):
        self.key, self.options = key, options
        self.endpoint = replace(endpoint, path="/")
        self.master = SSHMaster(self.endpoint, list(key.ssh_options), keep_s=keep_s, shared=True)
        self._transport: Transport | None = None
        self._far: FarStager | None = None
        self._serves: bool | None = None
        self._refusal: NoHostSession | None = None
        self._lock = threading.Lock()
        self.last_used = time.monotonic()
        self.far_sides_started = 0

    @property
    def url(self) -> str:
        return self.endpoint.url()

    def transport(self) -> Transport:
        """An ssh transport to this host over the session's connection (never closing it)."""
        with self._lock:
            return self._raw_transport()

    def serves(self) -> bool:
        """Whether the far side serves host sessions (starting it to find out)."""
        try:
            with self._lock:
                far, started = self._far_side()
                if started:
                    self._hello(far)
        except NoHostSession:
            return False
        return True

    @property
    def refused(self) -> bool:
        """Whether the far side was found unable to serve (asking costs nothing)."""
        return self._refusal is not None

    def request(self, op: str, payload: bytes) -> bytes:
        """Send ``op`` with ``payload``; the ``ok`` answer's payload (see the class for errors)."""
        with self._lock:
            self.last_used = time.monotonic()
            try:
                tag, body = self._exchange(op, payload)
            finally:
                self.last_used = time.monotonic()
        if tag == "error":
            raise decode_error(body, self.url)
        return body

    def _exchange(self, op: str, payload: bytes) -> tuple[str, bytes]:
        """One request and its answer. A far side kept from an earlier request that ends before answering (it
        died meanwhile, or during this request) is replaced and the request sent once more: every request is
        idempotent (``put`` renames whole files into place). SessionLost when that fails too, or a far side
        started for this request ends."""
        for attempt in (1, 2):
            far, started = self._far_side()
            pipelined = started and len(payload) <= PIPELINED_MAX
            if started and not pipelined:
                self._hello(far)
            try:
                far.stdin.write(frame(op, payload))
                far.stdin.flush()
            except OSError as exc:
                if pipelined:
                    self._hello(far)                # a far side that cannot serve says so before it ends
                self._drop()
                if not started and attempt == 1:
                    continue                        # the pipe to a far side that had ended broke on the write
                raise self._lost(op, exc) from None
            if pipelined:
                self._hello(far)
            try:
                line = far.stdout.readline(MAX_LINE)
                if not line and not started and attempt == 1:
                    self._drop()
                    continue
                tag, size = parse_header(line or b"(the far side ended)", self.url)
                return tag, read_exactly(far.stdout, size, self.url)
            except (OSError, ValueError, PalletError) as exc:
                self._drop()
                raise self._lost(op, exc) from None
        raise self._lost(op, None)

    def _lost(self, op: str, exc: BaseException | None) -> SessionLost:
        said = f" ({_said(exc)})" if exc is not None else ""
        return SessionLost(f"the host session ended during `{op}`{said}", self.url,
                           "run the operation again: the next one starts a new far side")

    def list(self, path: str) -> list[RemoteEntry]:
        """Every entry below the directory ``path``, paths relative to it (as ``Transport.list`` gives them), in
        one request; RemotePathMissingError when it does not exist."""
        body = self.request("list", os.fsencode(path))
        if body[:1] != b"+":
            raise RemotePathMissingError("path does not exist", f"{self.url.rstrip('/')}{path}",
                                         "check the remote path")
        return remote_entries(body[1:])

    def stat_many(self, paths: Sequence[str]) -> dict[str, RemoteEntry]:
        """The entries of those ``paths`` (absolute) that exist, by path, in one request."""
        if not paths:
            return {}
        return {entry.path: entry for entry in
                remote_entries(self.request("stat", b"\0".join(os.fsencode(p) for p in paths)))}

    @property
    def active(self) -> bool:
        """Whether a far side is running (an idle one is ended by the pool's reaper)."""
        return self._far is not None

    def close_far_side(self, idle_s: float = 0.0) -> None:
        """End the far side at once (it exits as its input ends), when no request has been made for ``idle_s``
        seconds (checked under the session's lock: a request under way is never cut); the connection is left
        to :meth:`close`."""
        with self._lock:
            if time.monotonic() - self.last_used >= idle_s:
                self._drop(wait=False)

    def close(self) -> None:
        """End the far side and the connection (a kept connection stays for its idle time)."""
        self.close_far_side()
        self.master.close()

    def _far_side(self) -> tuple[FarStager, bool]:
        """The running far side, or one started now, whose hello the caller reads (:meth:`_hello`); whether it was
        started now."""
        if self._refusal is not None:
            raise self._refusal
        if self._far is not None and self._far.process.poll() is None and not _ended(self._far):
            return self._far, False
        self._drop()
        self.master.ready()
        argv = ["env", f"{HOST_HELLO_ENV}={host_client_text()}", *shlex.split(self.key.remote_python), "-m",
                "mpi_stager", "serve"]
        self._far = FarStager(self._raw_transport(), argv, self.url)
        self.far_sides_started += 1
        return self._far, True

    def _hello(self, far: FarStager) -> None:
        """Read a new far side's hello; NoHostSession (kept for every later request) when it cannot serve."""
        try:
            hello = HostHello.parse(far.stdout.readline(MAX_LINE))
        except BaseException:
            self._drop(wait=False)
            raise
        if hello is None or not hello.speaks:
            self._far = None
            far.close(5)
            said = "it has no host session" if hello is None else \
                f"it speaks host-session v{hello.low} to v{hello.high}"
            self._refusal = NoHostSession(f"the far side's pallet cannot serve this one ({said})", self.url,
                                          install_hint(self.url))
            raise self._refusal

    def _raw_transport(self) -> Transport:
        if self._transport is None:
            self._transport = open_endpoint(self.endpoint, self.options, early=EarlyConnection("master", self.master))
        return self._transport

    def _drop(self, wait: bool = True) -> None:
        """Forget the far side: its input ended, and (``wait``) its exit waited for up to 5 s, else its ssh
        stopped at once (the far side then ends as its input does; nothing is in flight)."""
        far, self._far = self._far, None
        if far is None:
            return
        if wait:
            far.close(5)
        else:
            far.close_input()
            far.abandon()


class HostSessions:
    """The host sessions of one run (a Snakemake provider's, a Parsl provider's, a script's): one per
    :class:`HostKey`, shared by every thread.

    A session whose far side has been idle ``idle_s`` seconds has its far
    side ended by a reaper thread (the next request starts another); the
    connection stays for the ssh transport's ``keep`` seconds more, so
    that later operations and later `pallet` commands find it. :meth:`close`
    (the plugins' cleanup, or interpreter exit through a finalizer) ends
    every far side and every connection that is not kept.
    """

    def __init__(self, idle_s: float = 60.0):
        self.idle_s = idle_s
        self._sessions: dict[HostKey, HostSession] = {}
        self._wake = threading.Condition(threading.Lock())
        self._closed = threading.Event()
        self._reaper: threading.Thread | None = None
        weakref.finalize(self, _close_all, self._sessions, self._wake, self._closed)

    def session(self, endpoint: Endpoint, options: StagingOptions) -> HostSession | None:
        """The session to ``endpoint``'s host for ``options`` (made on first use); None where host sessions do
        not apply (not an ssh URL)."""
        if endpoint.scheme != "ssh":
            return None
        given = open_options(options)
        key = HostKey(endpoint.user, endpoint.host, endpoint.port, tuple(ssh_options_for(given["ssh_options"])),
                      options.remote_python)
        with self._wake:
            session = self._sessions.get(key)
            if session is None:
                session = self._sessions[key] = HostSession(key, endpoint, options, given["keep"])
            self._closed.clear()
            if self._reaper is None or not self._reaper.is_alive():
                self._reaper = threading.Thread(target=_reap, args=(self._sessions, self._wake, self._closed,
                                                                    self.idle_s),
                                                name="pallet-host-sessions", daemon=True)
                self._reaper.start()
            return session

    def all(self) -> list[HostSession]:
        with self._wake:
            return list(self._sessions.values())

    def close(self) -> None:
        """End every session (its far side and its connection, unless kept); the pool can be used again."""
        _close_all(self._sessions, self._wake, self._closed)


def _reap(sessions: dict[HostKey, HostSession], wake: threading.Condition, closed: threading.Event,
          idle_s: float) -> None:
    """The reaper thread: end far sides idle for ``idle_s``, looking again when the soonest could be; return once
    the pool is closed or empty (it holds no reference to the pool, which may then be collected)."""
    with wake:
        while not closed.is_set() and sessions:
            now = time.monotonic()
            active = [s for s in sessions.values() if s.active]
            idle = [s for s in active if now - s.last_used >= idle_s]
            if idle:
                wake.release()
                try:
                    for session in idle:
                        session.close_far_side(idle_s)
                finally:
                    wake.acquire()
                continue
            soonest = min((s.last_used for s in active), default=now) + idle_s
            wake.wait(max(0.05, soonest - now))


def _close_all(sessions: dict[HostKey, HostSession], wake: threading.Condition, closed: threading.Event) -> None:
    """Close and forget every session (the pool's close, and its finalizer at exit), waking the reaper to end."""
    with wake:
        closing = list(sessions.values())
        sessions.clear()
        closed.set()
        wake.notify_all()
    for session in closing:
        session.close()


def open_options(options: StagingOptions) -> dict:
    """The ssh transport's keyword arguments for ``options`` (ssh options, keep)."""
    from staging_core.transports.ssh import SSHTransport
    given = SSHTransport.options_from(options)
    given.setdefault("ssh_options", ())
    given.setdefault("keep", KEEP_S)
    return given


def remote_entries(records: bytes) -> list[RemoteEntry]:
    """Listing records (mpi_stager.wire.LISTING_FIELDS) as RemoteEntry values (a size for files only)."""
    return [RemoteEntry(os.fsdecode(path), e.kind, e.size if e.kind == "f" else 0, e.mode, e.mtime_ns,
                        os.fsdecode(e.target)) for path, e in parse_records(records).items()]


def _ended(far: FarStager) -> bool:
    """Whether an idle far side's output has ended (or holds what no request asked for): it cannot serve."""
    ended = getattr(far.process, "output_ended", None)
    return bool(ended()) if ended is not None else False


def _said(exc: BaseException) -> str:
    return getattr(exc, "message", None) or str(exc) or type(exc).__name__
