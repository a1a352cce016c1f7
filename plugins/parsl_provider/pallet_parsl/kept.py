"""keep_packed: batches land as bundles that stay; each app copies just its own inputs out onto node-local scratch."""
from __future__ import annotations

import functools
import os
import posixpath
import shutil
import threading
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from staging_core import SetupError, copy_out, open_bundle, parse_url, private_directory


class PackedBatch:
    """Where the apps of one keep-packed batch find their inputs: ``bundles``, pairs of a local bundle and the
    remote directory its paths are relative to — the one the batch brought, then those kept before that hold
    the rest of its files. Empty until the batch's tasks have finished; filled on the submitting side before
    Parsl launches any app reading the batch (its apps wait for the batch), so a wrapper pickled at launch
    carries them. Apps that share this object (threads of one process) share one open view of each bundle,
    whose index is read once; a pickled copy opens its own."""

    def __init__(self):
        self.bundles: tuple[tuple[str, str], ...] = ()
        self._views: dict[str, Any] = {}
        self._lock = threading.Lock()

    def fill(self, done: Future) -> None:
        """The done-callback of the batch's last task (registered before any app's DataFuture)."""
        if done.exception() is None:
            self.bundles = tuple((kept.bundle, parse_url(kept.remote_root).path) for kept in done.result().bundles)

    def find(self, remote_path: str) -> tuple[object, str] | None:
        """The open view of the bundle holding ``remote_path`` and the path's name in it; None if none does."""
        for bundle, root in self.bundles:
            if remote_path.startswith(root.rstrip("/") + "/"):
                view, relative = self.view(bundle), posixpath.relpath(remote_path, root)
                if view.lookup(relative) is not None:
                    return view, relative
        return None

    def view(self, bundle: str):
        """``bundle``, opened once for every app sharing this object; it closes when this object goes."""
        with self._lock:
            if bundle not in self._views:
                self._views[bundle] = open_bundle(bundle)
                weakref.finalize(self, self._views[bundle].close)
            return self._views[bundle]

    def __getstate__(self) -> dict:
        return {"bundles": self.bundles}

    def __setstate__(self, state: dict) -> None:
        PackedBatch.__init__(self)
        self.bundles = state["bundles"]


def private_copy_path(scratch: str, remote_path: str) -> str:
    """Where one app's copy of ``remote_path`` goes: a fresh directory of its own below ``scratch`` (made when
    the app runs), keeping the file's name."""
    return os.path.join(scratch, uuid.uuid4().hex[:16], posixpath.basename(remote_path.rstrip("/")) or "input")


class ReadsKeptInputs:
    """An app function wrapped so that, on the worker, its input ``remote_path`` is first copied out of its
    batch's bundle to ``local_path`` (checked against the shard hashes), and removed with its private
    directory once the app returns or raises. A picklable class, not a closure: HTEX ships it to workers."""

    def __init__(self, func: Callable, batch: PackedBatch, remote_path: str, local_path: str):
        functools.update_wrapper(self, func)
        self.func, self.batch, self.remote_path, self.local_path = func, batch, remote_path, local_path

    def __call__(self, *args, **kwargs):
        private = os.path.dirname(self.local_path)
        _make_private_directory(private)
        try:
            found = self.batch.find(self.remote_path)
            if found is None:
                raise SetupError("no kept bundle of this input's batch is known to hold it", self.remote_path,
                                 "the batch did not finish; see its error")
            copy_out(*found, self.local_path)
            return self.func(*args, **kwargs)
        finally:
            shutil.rmtree(private, ignore_errors=True)


def _make_private_directory(path: str) -> None:
    """Make ``path`` (new, mode 0700) below its parent, the scratch root, which must be a real directory of this
    user's: a link or another user's directory planted there is refused, never written through."""
    private_directory(os.path.dirname(path), "give PalletStaging(scratch=...) a node-local directory of yours")
    os.mkdir(path, 0o700)
