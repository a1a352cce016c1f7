"""--storage-pallet-keep-packed: a remote directory fetched once as one kept bundle; objects are copied out of it."""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from staging_core import (Endpoint, OpenSource, RemoteEntry, SourceError, StagingOptions, UsageError,
                          missing_members, move_packed, private_directory)

from .inventory import host_key

MARKER = "complete"       # in a kept directory: the bundle's file name, written once the bundle is checked
HINT = "give --storage-pallet-packed-dir a directory of yours, on node-local disk"


@dataclass(frozen=True)
class KeptBundle:
    """A local bundle of the remote directory ``root``: its entries' paths are relative to ``root.path``."""

    path: str
    root: Endpoint
    inode: int              # of the bundle file when it was found: discard() removes only that one


class ListingChanged(SourceError):
    """The remote directory changed between its listing and its packing: list it again."""


class KeptBundles:
    """The kept bundles below ``store``, a private directory (mode 0700; a link or another user's directory
    there is refused).

    ``bundle_for(root, listing)`` returns the bundle of the remote
    directory ``root`` as ``listing`` (its recursive listing) shows it. A
    bundle is fetched at most once per listing: it is kept in
    ``STORE/<root key>-<listing key>/`` and found again by every later
    call, in this process or another (jobs on one node share a store), and
    only one of them fetches while the others wait on the directory's lock.
    When the listing changes, the next call fetches a new bundle and
    removes the older ones of that directory (finished or half fetched).
    An interrupted fetch is resumed by the next call (rsync sends only what
    is missing); ``discard`` forgets a bundle found damaged. Raises
    UsageError when the source cannot be packed (no pallet at its far
    side), SourceError when the bundle lacks an entry of the listing, and
    the transfer's error otherwise.
    """

    def __init__(self, store: str, options: StagingOptions):
        self.store, self.options = store, options

    def find(self, root: Endpoint, listing: list[RemoteEntry]) -> KeptBundle | None:
        """The kept bundle of ``root`` as ``listing`` shows it, if one is kept already (nothing is fetched)."""
        private_directory(self.store, HINT)
        kept = os.path.join(self.store, "-".join(_keys(root, listing)))
        name = _finished(kept)
        try:
            return None if name is None else _found(os.path.join(kept, name), root)
        except FileNotFoundError:           # removed since (a damaged one discarded): fetch it again
            return None

    def bundle_for(self, root: Endpoint, listing: list[RemoteEntry]) -> KeptBundle:
        found = self.find(root, listing)
        if found is not None:
            return found
        place, key = _keys(root, listing)
        kept = os.path.join(self.store, f"{place}-{key}")
        with self._locked(f"{place}-{key}"):
            name = _finished(kept) or self._fetch(root, kept, listing)
        self._drop_older(place, key)
        return _found(os.path.join(kept, name), root)

    def discard(self, kept: KeptBundle) -> None:
        """Forget a kept bundle found damaged or cut short: the next :meth:`bundle_for` fetches it again. Only
        the very file ``kept`` named is removed (not one another process has fetched since), and readers that
        have it open keep reading what they opened."""
        directory = os.path.dirname(kept.path)
        with self._locked(os.path.basename(directory)):
            try:
                same = os.stat(kept.path).st_ino == kept.inode
            except FileNotFoundError:
                same = True
            if same:
                shutil.rmtree(directory, ignore_errors=True)

    def _fetch(self, root: Endpoint, kept: str, listing: list[RemoteEntry]) -> str:
        os.makedirs(kept, mode=0o700, exist_ok=True)
        with OpenSource(root, self.options) as source:
            if not source.packs:
                raise UsageError("--storage-pallet-keep-packed needs a source that packs bundles: pallet at an "
                                 "ssh source, or --storage-pallet-pack-via for a GridFTP/Globus one", root.url(),
                                 "install pallet there (pallet remote install HOST), or drop keep-packed")
            moved = move_packed(source, kept)
        missing = missing_members(moved.path, [e.path for e in listing if e.kind != "d"])
        if missing:
            raise ListingChanged(f"{len(missing)} listed file(s) are not in the kept bundle, e.g. {missing[0]}",
                                 root.url(), "the directory changed while it was packed; run the workflow again")
        name = os.path.basename(moved.path)
        partial = os.path.join(kept, MARKER + ".part")
        with suppress(FileNotFoundError):        # left by a process killed here
            os.unlink(partial)
        with open(partial, "x") as out:
            out.write(name)
        os.replace(partial, os.path.join(kept, MARKER))
        return name

    @contextmanager
    def _locked(self, name: str, wait: bool = True) -> Iterator[bool]:
        """Hold the flock of ``STORE/NAME.lock`` (made if missing); with ``wait`` off, yields False at once when
        another holds it or it is gone."""
        descriptor = _lock(os.path.join(self.store, name + ".lock"), wait)
        try:
            yield descriptor is not None
        finally:
            if descriptor is not None:
                os.close(descriptor)

    def _drop_older(self, place: str, key: str) -> None:
        """Remove this directory's bundles of other listings that nobody is fetching (finished, or left half
        fetched by a killed process). A job still copying out of one keeps reading it: its open files outlive
        the names."""
        for name in os.listdir(self.store):
            if name.startswith(place + "-") and not name.endswith(".lock") and name != f"{place}-{key}":
                with self._locked(name, wait=False) as held:
                    if held:
                        shutil.rmtree(os.path.join(self.store, name), ignore_errors=True)
                        with suppress(FileNotFoundError):        # another thread of this process was first
                            os.unlink(os.path.join(self.store, name + ".lock"))


def _lock(path: str, wait: bool) -> int | None:
    """A descriptor of the lock file ``path`` holding its flock, or None (``wait`` off: held elsewhere, or no
    such file). A lock file removed while we waited for it (by :meth:`KeptBundles._drop_older`) is not the
    lock any more: lock the one now at ``path`` instead."""
    while True:
        try:
            flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if wait else 0)
            descriptor = os.open(path, flags, 0o600)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            if os.fstat(descriptor).st_ino == os.stat(path).st_ino:
                return descriptor
        except (BlockingIOError, FileNotFoundError):
            if not wait:
                os.close(descriptor)
                return None
        os.close(descriptor)


def _found(bundle: str, root: Endpoint) -> KeptBundle:
    return KeptBundle(bundle, root, os.stat(bundle).st_ino)


def _finished(kept: str) -> str | None:
    """The bundle's file name if the kept directory ``kept`` holds a checked bundle, else None."""
    try:
        with open(os.path.join(kept, MARKER)) as marker:
            name = marker.read()
    except FileNotFoundError:
        return None
    return name if name and os.path.isfile(os.path.join(kept, name)) else None


def _keys(root: Endpoint, listing: list[RemoteEntry]) -> tuple[str, str]:
    """Short hashes of the remote directory (host and path) and of its listing (paths, types, modes, sizes,
    mtimes, link targets)."""
    place = hashlib.sha256(repr((host_key(root), root.path)).encode()).hexdigest()[:16]
    digest = hashlib.sha256()
    for entry in sorted(listing, key=lambda e: e.path):
        digest.update(f"{entry.path}\0{entry.kind}\0{entry.mode}\0{entry.size}\0{entry.mtime_ns}\0{entry.link}\n"
                      .encode())
    return place, digest.hexdigest()[:16]
