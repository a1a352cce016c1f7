"""What exists remotely: one recursive listing per parent directory answers exists/mtime/size for all its siblings."""
from __future__ import annotations

import os
import posixpath
import stat
import threading
from dataclasses import dataclass, field, replace

from staging_core import (Endpoint, HostSession, HostSessions, RemoteEntry, RemotePathMissingError, StagingOptions,
                          Transport, TransportError, open_endpoint)

TIMESTAMP = ".snakemake_timestamp"      # Snakemake's mark of when a directory output was finished
HostKey = tuple[str, str | None, int | None, str | None]


def host_key(endpoint: Endpoint) -> HostKey:
    """What identifies one connection: scheme, host, port and user."""
    return (endpoint.scheme, endpoint.host, endpoint.port, endpoint.user)


def seconds(mtime_ns: int) -> float:
    """An mtime as Snakemake compares it: truncated to whole microseconds, then turned into float seconds the
    way ``os.stat().st_mtime`` does, so a local copy carrying the remote time never looks older."""
    whole, fraction = divmod(mtime_ns // 1000 * 1000, 1_000_000_000)
    return whole + fraction * 1e-9


@dataclass
class Listing:
    """A recursive listing of the directory ``root``: entries by relative path (none if it does not exist).

    ``stale`` holds relative paths this process has written or removed
    since: they, and everything below them, are asked for afresh.
    ``error`` keeps a failed listing's error so that thousands of lookups do
    not retry an unreachable host thousands of times.
    """

    root: str
    entries: dict[str, RemoteEntry] = field(default_factory=dict)
    stale: set[str] = field(default_factory=set)
    error: TransportError | None = None
    _by_dir: dict[str, list[str]] | None = field(default=None, repr=False)

    def siblings(self, rel_dir: str) -> list[str]:
        """The relative paths of the entries directly in ``rel_dir`` ('.' for the root), indexed on first use."""
        if self._by_dir is None:
            self._by_dir = {}
            for rel in self.entries:
                self._by_dir.setdefault(posixpath.dirname(rel) or ".", []).append(rel)
        return self._by_dir.get(rel_dir, [])

    def record(self, rel: str, entry: RemoteEntry) -> None:
        self.entries[rel] = entry
        self._by_dir = None

    def is_stale(self, rel: str) -> bool:
        while rel not in ("", "."):
            if rel in self.stale:
                return True
            rel = posixpath.dirname(rel)
        return False


class RemoteInventory:
    """Transports (one per host) and directory listings shared by all objects of one provider.

    - ``lookup(endpoint, trust_absence)`` returns the RemoteEntry at
      ``endpoint.path`` or None. It answers from a cached listing of any
      ancestor directory; otherwise it lists the parent directory once,
      recursively (the grandparent, when another of its directories was
      listed before: one directory per sample costs two listings, not one
      each), and keeps that listing: every sibling, and everything
      below the parent, is then known without another remote call (the
      root ``/`` is never listed; objects right below it are stat'ed). An
      absence read from a listing made by this very call, or with
      ``trust_absence`` (Snakemake's DAG phase), is final; an absence read
      from an older listing is confirmed by one ``stat``, since remote jobs
      may have written the file since. Paths written or removed through
      :meth:`forget` are always stat'ed (listed, for :meth:`children`).
    - ``children(endpoint)`` lists everything below a directory, paths
      relative to it.
    - Errors are TransportError subclasses naming the path and the cause; a
      failed listing is remembered and raised again until ``forget``.
    - Thread-safe: lookups come from Snakemake's event loop and from batch
      worker threads; calls to one host are serialised on its transport.
    - With ``sessions`` (the provider's host sessions), an ssh host whose far
      side serves one is listed and stat'ed in one request each over its
      warm session, and its transport shares the session's connection.
    """

    def __init__(self, options: StagingOptions, sessions: HostSessions | None = None):
        self.options, self.sessions = options, sessions
        self._transports: dict[HostKey, Transport] = {}
        self._locks: dict[HostKey, threading.RLock] = {}
        self._listings: dict[tuple[HostKey, str], Listing] = {}
        self._listed_below: set[tuple[HostKey, str]] = set()    # directories a child of which was listed
        self._guard = threading.Lock()

    def lookup(self, endpoint: Endpoint, trust_absence: bool = False) -> RemoteEntry | None:
        key = host_key(endpoint)
        with self._lock(key):
            listing, fresh = self._covering(endpoint), False
            if listing is None and posixpath.dirname(endpoint.path) != "/":
                listing, fresh = self._list(replace(endpoint, path=self._directory_to_list(endpoint))), True
            if listing is None:
                return self._stat(endpoint)
            if listing.error is not None:
                raise listing.error.with_traceback(None)
            rel = relative(endpoint.path, listing.root)
            if listing.is_stale(rel):
                return self._stat(endpoint)
            entry = listing.entries.get(rel)
            if entry is None and not fresh and not trust_absence:
                entry = self._stat(endpoint)
                if entry is not None:
                    listing.record(rel, entry)
            return entry

    def lookup_many(self, endpoints: list[Endpoint]) -> dict[str, RemoteEntry | None]:
        """:meth:`lookup` of each of ``endpoints`` (all of one host), by path: those a cached listing answers from
        it, the others (over a host session) in one ``stat`` request and no listing, else one by one."""
        if not endpoints:
            return {}
        key = host_key(endpoints[0])
        found: dict[str, RemoteEntry | None] = {}
        with self._lock(key):
            unknown = []
            for endpoint in endpoints:
                listing = self._covering(endpoint)
                rel = relative(endpoint.path, listing.root) if listing is not None else ""
                if listing is not None and listing.error is None and not listing.is_stale(rel) \
                        and rel in listing.entries:
                    found[endpoint.path] = listing.entries[rel]
                else:
                    unknown.append(endpoint)
            session = self._session(endpoints[0]) if len(unknown) > 1 else None
            if session is not None:
                stated = session.stat_many([endpoint.path for endpoint in unknown])
                found.update({endpoint.path: stated.get(endpoint.path) for endpoint in unknown})
                return found
        found.update({endpoint.path: self.lookup(endpoint) for endpoint in unknown})
        return found

    def stored(self, endpoint: Endpoint, local: str) -> None:
        """Record that the file ``local`` was just stored at ``endpoint`` (its size, mode and mtime, which the
        store keeps): later questions about it are answered without asking the host. Anything else than a
        regular file is forgotten (:meth:`forget`) instead."""
        try:
            info = os.lstat(local)
        except OSError:
            info = None
        if info is None or not stat.S_ISREG(info.st_mode):
            self.forget(endpoint)
            return
        with self._lock(host_key(endpoint)):
            listing = self._covering(endpoint)
            if listing is None or listing.error is not None:
                return
            rel = relative(endpoint.path, listing.root)
            listing.stale.discard(rel)
            if not listing.is_stale(rel):
                listing.record(rel, RemoteEntry(rel, "f", info.st_size, stat.S_IMODE(info.st_mode), info.st_mtime_ns))

    def children(self, endpoint: Endpoint) -> list[RemoteEntry]:
        """Every entry below the directory ``endpoint.path``, paths relative to it (from the cache when known)."""
        key = host_key(endpoint)
        with self._lock(key):
            listing = self._covering(endpoint)
            if listing is None or listing.error is not None or \
                    listing.is_stale(relative(endpoint.path, listing.root)):
                return self._list_remote(endpoint)
            prefix = relative(endpoint.path, listing.root) + "/"
            return [replace(entry, path=rel[len(prefix):]) for rel, entry in listing.entries.items()
                    if rel.startswith(prefix)]

    def siblings(self, endpoint: Endpoint) -> list[tuple[str, RemoteEntry, int]]:
        """(absolute path, entry, Snakemake mtime in ns) of each entry the cache knows in ``endpoint``'s
        directory, the object itself included; empty when that directory is not cached. No remote call."""
        with self._lock(host_key(endpoint)):
            listing = self._covering(endpoint)
            if listing is None or listing.error is not None:
                return []
            rel_dir = posixpath.relpath(posixpath.dirname(endpoint.path), listing.root)
            return [(posixpath.join(listing.root, rel), listing.entries[rel],
                     _timestamp(listing.entries.get(posixpath.join(rel, TIMESTAMP)), listing.entries[rel]))
                    for rel in listing.siblings(rel_dir) if not listing.is_stale(rel)]

    def mtime_ns(self, endpoint: Endpoint, entry: RemoteEntry) -> int:
        """The mtime Snakemake compares for ``entry`` at ``endpoint``: a directory's is that of the
        ``.snakemake_timestamp`` file Snakemake leaves in directory outputs, when there is one."""
        if entry.kind != "d":
            return entry.mtime_ns
        return _timestamp(self.lookup(endpoint.join(TIMESTAMP), trust_absence=True), entry)

    def forget(self, endpoint: Endpoint) -> None:
        """Mark ``endpoint.path`` (and what is below it) as changed by this process: ask for it afresh."""
        key = host_key(endpoint)
        with self._lock(key):
            for (owner, root), listing in list(self._listings.items()):
                if owner == key and endpoint.path.startswith(root.rstrip("/") + "/"):
                    listing.stale.add(relative(endpoint.path, root))
            for owner, root in [k for k in self._listings if k[0] == key and _within(k[1], endpoint.path)]:
                del self._listings[(owner, root)]

    def run(self, endpoint: Endpoint, argv: list[str]) -> bytes:
        """Run ``argv`` on ``endpoint``'s host (NotSupportedError where the transport cannot run commands)."""
        with self._lock(host_key(endpoint)):
            return self._transport(endpoint).run(argv)

    def close(self) -> None:
        """Close every transport (ssh ControlMaster connections); the inventory can still be used after."""
        with self._guard:
            transports, self._transports = list(self._transports.values()), {}
        for transport in transports:
            transport.close()

    # ------------------------------------------------------------ internals (host lock held)

    def _lock(self, key: HostKey) -> threading.RLock:
        """The host's lock: read without the guard once it exists (one dict read; thousands of lookups of a
        round ask for it), made under the guard the first time."""
        lock = self._locks.get(key)
        if lock is None:
            with self._guard:
                lock = self._locks.setdefault(key, threading.RLock())
        return lock

    def _transport(self, endpoint: Endpoint) -> Transport:
        key = host_key(endpoint)
        if key not in self._transports:
            session = self.sessions.session(endpoint, self.options) if self.sessions is not None else None
            self._transports[key] = session.transport() if session is not None else \
                open_endpoint(replace(endpoint, path="/"), self.options)
        return self._transports[key]

    def _session(self, endpoint: Endpoint) -> HostSession | None:
        """The host's warm session when its far side serves one (else None: the transport answers)."""
        session = self.sessions.session(endpoint, self.options) if self.sessions is not None else None
        return session if session is not None and session.serves() else None

    def _stat(self, endpoint: Endpoint) -> RemoteEntry | None:
        session = self._session(endpoint)
        if session is None:
            return self._transport(endpoint).stat(endpoint.path)
        return session.stat_many([endpoint.path]).get(endpoint.path)

    def _list_remote(self, directory: Endpoint) -> list[RemoteEntry]:
        session = self._session(directory)
        return session.list(directory.path) if session is not None else self._transport(directory).list(directory.path)

    def _directory_to_list(self, endpoint: Endpoint) -> str:
        """The directory to list for ``endpoint``: its parent, or, when a sibling of that parent was listed
        already (a layout of one directory per sample), the grandparent, once, so that one listing answers for
        all its directories. Never a directory right below ``/``."""
        parent = posixpath.dirname(endpoint.path)
        grand = posixpath.dirname(parent)
        key = (host_key(endpoint), grand)
        if grand.count("/") >= 2 and key in self._listed_below:
            return grand
        self._listed_below.add(key)
        return parent

    def _covering(self, endpoint: Endpoint) -> Listing | None:
        key, path = host_key(endpoint), endpoint.path
        while path != "/":
            path = posixpath.dirname(path)
            listing = self._listings.get((key, path))
            if listing is not None:
                return listing
        return None

    def _list(self, directory: Endpoint) -> Listing:
        listing = Listing(directory.path)
        try:
            listing.entries = {entry.path: entry for entry in self._list_remote(directory)}
        except RemotePathMissingError:
            pass                                    # the parent does not exist: neither do its children
        except TransportError as exc:
            listing.error = exc
        self._listings[(host_key(directory), directory.path)] = listing
        if listing.error is not None:
            raise listing.error
        return listing


def relative(path: str, root: str) -> str:
    """``path`` relative to its ancestor ``root`` (both normalised): posixpath.relpath, without its cost."""
    return path[len(root) + 1:] if root != "/" else path[1:]


def _timestamp(stamp: RemoteEntry | None, entry: RemoteEntry) -> int:
    return stamp.mtime_ns if stamp is not None and entry.kind == "d" else entry.mtime_ns


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")
