"""The Globus transport (globus-sdk 4): one Transfer task per batch between a local collection and a remote one."""
from __future__ import annotations

import copy
import datetime
import logging
import os
import posixpath
import stat
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar, cast

import globus_sdk

from bundles.errors import PalletError, UsageError

from .base import Capabilities, Direction, Endpoint, RemoteEntry, Transport, TransferResult
from .declarations import GLOBUS_OPTIONS
from .errors import (AuthenticationError, ItemError, NotSupportedError, RemotePathMissingError, TransportError,
                     classify)
from .globus_mapping import FAIL_FAST, LOGIN_HINT, classify_globus, entry, from_sdk, remote_kind, unsupported

log = logging.getLogger(__name__)

LOCAL_ENDPOINT_ENV = "PALLET_GLOBUS_LOCAL_ENDPOINT"
_LS_LIMIT = 100_000                     # the most entries one operation_ls returns
SyncLevel = Literal["exists", "size", "mtime", "checksum"]
_Error = TypeVar("_Error", bound=PalletError)


@dataclass
class _Batch:
    """One task in the making: item -> (source, destination, recursive); directories made apart; early failures."""

    source: str
    destination: str
    push: bool
    whole: bool = False
    paths: dict[str, tuple[str, str, bool]] = field(default_factory=dict)
    dirs: dict[str, str] = field(default_factory=dict)
    implied: list[str] = field(default_factory=list)
    failed: dict[str, ItemError] = field(default_factory=dict)


class GlobusTransport(Transport):
    """Globus Transfer between ``local_endpoint`` and the URL's collection (``globus://COLLECTION_UUID/path``).

    ``local_endpoint`` (or $PALLET_GLOBUS_LOCAL_ENDPOINT) is the collection
    that sees this host's files, e.g. Globus Connect Personal;
    ``local_collection_root`` the host directory it shows as "/". ``client``
    is a ready ``TransferClient``, else one is built from the tokens of
    `pallet login globus`. Each batch is ONE task (``sync_level``,
    ``verify_checksum``, timestamps preserved), submitted with one
    submission id up to ``submit_attempts`` times and polled with backoff
    from ``poll_interval`` to ``poll_max_interval`` until ``timeout``
    seconds (also the task's deadline). ``fail_fast`` cancels a task that
    reports a fault waiting cannot cure (permission, quota, credentials).
    Symbolic links are not carried: link items fail with NotSupportedError;
    a whole-tree transfer (``items=None``, one recursive item) skips them
    like Globus does. Directory items are made with mkdir (remote) or
    os.makedirs (local side), never by a recursive copy.
    """

    scheme = "globus"
    # mtimes are kept to the second only; concurrency and per-file cost are the service's, estimated (no Globus here)
    capabilities = Capabilities(batch=True, streaming=False, remote_exec=False, parallel_streams=True,
                                checksums=("md5",), preserves_mtime=False, preserves_mode=False, symlinks=False,
                                hardlinks=False, per_file_overhead_s=0.02, concurrency=4)
    declared_options = GLOBUS_OPTIONS

    def __init__(self, endpoint: Endpoint, local_endpoint: str | None = None,
                 client: globus_sdk.TransferClient | None = None, local_collection_root: str = "/",
                 sync_level: str | None = None, verify_checksum: bool = True, timeout: float = 86_400.0,
                 poll_interval: float = 2.0, poll_max_interval: float = 60.0, submit_attempts: int = 3,
                 fail_fast: bool = True, label: str = "pallet", data_access: Sequence[str] = ()):
        super().__init__(endpoint)
        self.collection = _uuid(endpoint.host or "", f"collection in {endpoint.url()}",
                                "write globus://COLLECTION_UUID/absolute/path; find the UUID with "
                                "`globus endpoint search` or in the Globus web app")
        self.local_endpoint = _uuid(local_endpoint or os.environ.get(LOCAL_ENDPOINT_ENV, ""), "local_endpoint",
                                    f"set {LOCAL_ENDPOINT_ENV} to the UUID of this machine's collection "
                                    "(Globus Connect Personal), or pass local_endpoint")
        if sync_level not in (None, "exists", "size", "mtime", "checksum"):
            raise UsageError(f"sync_level must be exists, size, mtime or checksum, not {sync_level!r}")
        self.local_collection_root = os.path.abspath(local_collection_root)
        self.sync_level = cast(SyncLevel | None, sync_level)      # one of them: checked just above
        self.verify_checksum, self.label = verify_checksum, label
        self.timeout, self.poll_interval, self.poll_max_interval = timeout, poll_interval, poll_max_interval
        self.submit_attempts, self.fail_fast = max(1, submit_attempts), fail_fast
        self._owns_client = client is None
        if client is None:
            from .globus_auth import transfer_client
            client = transfer_client(collections=[*data_access])
        self.client = client

    # ------------------------------------------------------------ transfers

    def transfer(self, direction: Direction, local_root: str, remote_root: str,
                 items: Sequence[str] | None = None, temp_dir: str | None = None) -> TransferResult:
        items = None if items is None else list(items)
        batch = self._plan(direction, local_root, remote_root, items)
        done = self._make_dirs(batch)
        if batch.paths:
            done |= self._settle(self._run(batch), batch)
        _settle_implied(batch, done)
        if items is None:
            return TransferResult(sorted(done), batch.failed)
        return TransferResult([i for i in items if i in done], {i: batch.failed[i] for i in items if i in batch.failed})

    def _plan(self, direction: Direction, local_root: str, remote_root: str, items: list[str] | None) -> _Batch:
        push = direction is Direction.PUSH
        ends = (self.local_endpoint, self.collection)
        batch = _Batch(*(ends if push else ends[::-1]), push=push, whole=items is None)
        local = self._local_path(local_root)
        src_root, dst_root = (local, remote_root) if push else (remote_root, local)
        if items is None:
            if push and not os.path.isdir(local_root):
                batch.failed["."] = RemotePathMissingError("source directory does not exist", local_root)
            else:
                batch.paths["."] = (src_root.rstrip("/") + "/", dst_root.rstrip("/") + "/", True)
            return batch
        batch.failed = {item: error for item in items if (error := _bad_item(item))}
        good = [item for item in items if item not in batch.failed]
        parents = _ancestors(good)
        kinds = _local_kinds(local_root, good, parents) if push else self._remote_kinds(remote_root, good, parents)
        for item in good:
            kind = kinds[item]
            if isinstance(kind, TransportError):
                batch.failed[item] = kind
            elif kind == "implied":
                batch.implied.append(item)
            elif kind == "d":
                batch.dirs[item] = posixpath.join(remote_root, item) if push else os.path.join(local_root, item)
            else:
                batch.paths[item] = (posixpath.join(src_root, item), posixpath.join(dst_root, item), False)
        return batch

    def _make_dirs(self, batch: _Batch) -> set[str]:
        """Directory items: operation_mkdir on the collection (PUSH) or os.makedirs here (PULL)."""
        done = set()
        for item, path in batch.dirs.items():
            try:
                self.mkdir(path) if batch.push else os.makedirs(path, exist_ok=True)
                done.add(item)
            except TransportError as error:
                batch.failed[item] = _retarget(error, item)
            except OSError as exc:
                batch.failed[item] = classify(exc.strerror or "", exc.errno, None, item, "cannot create directory")
        return done

    def _remote_kinds(self, remote_root: str, items: list[str], parents: set[str]) -> dict:
        kinds: dict = {item: "implied" for item in items if item in parents}
        by_parent: dict[str, list[str]] = {}
        for item in items:
            if item not in kinds:
                by_parent.setdefault(posixpath.dirname(item), []).append(item)
        for parent, members in by_parent.items():
            try:
                listing = {doc["name"]: doc for doc in self._ls(posixpath.join(remote_root, parent))}
            except TransportError as error:
                kinds.update({member: _retarget(error, member) for member in members})
                continue
            for member in members:
                kinds[member] = remote_kind(listing.get(posixpath.basename(member)), member)
        return kinds

    def _local_path(self, local_root: str) -> str:
        rel = os.path.relpath(os.path.abspath(local_root), self.local_collection_root)
        if rel == ".." or rel.startswith("../"):
            raise UsageError(f"{local_root} is outside the local collection root {self.local_collection_root}",
                             hint="pass local_collection_root=DIR, the host directory your local collection shows")
        return "/" if rel == "." else "/" + rel

    def _run(self, batch: _Batch) -> dict:
        deadline = time.monotonic() + self.timeout
        data = self._task_document(batch)
        task_id = self._submit(data)
        log.info("Globus task %s: %d item(s), submission %s", task_id, len(batch.paths), data["submission_id"])
        return self._wait(task_id, deadline)

    def _task_document(self, batch: _Batch) -> globus_sdk.TransferData:
        submission_id = self._call("cannot get a submission id", None, self.client.get_submission_id)["value"]
        expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=self.timeout)
        data = globus_sdk.TransferData(
            source_endpoint=batch.source, destination_endpoint=batch.destination, label=self.label,
            submission_id=submission_id, sync_level=self.sync_level or globus_sdk.MISSING,
            verify_checksum=self.verify_checksum, preserve_timestamp=True, skip_source_errors=True,
            fail_on_quota_errors=True, deadline=expires.strftime("%Y-%m-%dT%H:%M:%S+00:00"))
        for source, destination, recursive in batch.paths.values():
            data.add_item(source, destination, recursive=True if recursive else globus_sdk.MISSING)
        return data

    def _submit(self, data: globus_sdk.TransferData) -> str:
        """Submit ``data``; a retry resends the same document, so the same submission id: never two tasks."""
        for attempt in range(1, self.submit_attempts + 1):
            try:
                return self.client.submit_transfer(data)["task_id"]
            except globus_sdk.GlobusError as exc:
                error = from_sdk(exc, "cannot submit the Globus transfer", self.endpoint.url())
                if not error.retryable or attempt == self.submit_attempts:
                    raise error from exc
                log.warning("submit failed (%s); resending submission %s", error.message, data["submission_id"])
                time.sleep(min(self.poll_max_interval, self.poll_interval * 2 ** (attempt - 1)))
        raise AssertionError("unreachable")

    def _wait(self, task_id: str, deadline: float) -> dict:
        delay = self.poll_interval
        while True:
            task = self._call(f"cannot read Globus task {task_id}", None, self.client.get_task, task_id).data
            if task["status"] in ("SUCCEEDED", "FAILED"):
                return task
            problem = self._problem(task)
            if problem is None and time.monotonic() + delay > deadline:
                problem = TransportError(f"Globus task {task_id} did not finish within {self.timeout:g} s", None,
                                         "raise the timeout, or look at the task in the Globus web app",
                                         retryable=True)
            if problem is not None:
                self._cancel(task_id)
                raise problem
            time.sleep(delay)
            delay = min(delay * 2, self.poll_max_interval)

    def _problem(self, task: dict) -> TransportError | None:
        """The error for a task that will not finish by itself: INACTIVE, or (fail_fast) a fault it keeps hitting."""
        nice = task.get("nice_status") or ""
        detail = task.get("nice_status_short_description") or task.get("nice_status_details") or ""
        error = classify_globus(nice or "INACTIVE", detail)
        if task["status"] == "INACTIVE" and not isinstance(error, AuthenticationError):
            error = AuthenticationError("task suspended (credentials expired or collection not activated)",
                                        hint=LOGIN_HINT, stderr=f"{nice}: {detail}")
        elif task["status"] != "INACTIVE" and not (self.fail_fast and nice and isinstance(error, FAIL_FAST)):
            return None
        error.message = f"Globus task {task['task_id']} cannot proceed: {error.message}"
        return error

    def _cancel(self, task_id: str) -> None:
        try:
            self.client.cancel_task(task_id)
        except globus_sdk.GlobusError as exc:       # the error we raise next says more
            log.warning("could not cancel Globus task %s: %s", task_id, type(exc).__name__)

    def _settle(self, task: dict, batch: _Batch) -> set[str]:
        """Items done; failures (skipped paths, or the task's fatal error) go to batch.failed."""
        task_id = task["task_id"]
        owners = {source.rstrip("/"): item for item, (source, _, _) in batch.paths.items()}
        for doc in self._pages(task_id, "task_skipped_errors"):
            item = _owner(doc.get("source_path", ""), owners, batch.whole)
            if item is not None and item not in batch.failed:
                batch.failed[item] = classify_globus(doc.get("error_code"), doc.get("error_details") or "", item)
        if task["status"] == "SUCCEEDED":
            return {item for item in batch.paths if item not in batch.failed}
        moved = {doc.get("source_path", "") for doc in self._pages(task_id, "task_successful_transfers")}
        fatal = task.get("fatal_error") or {}
        done = set()
        for item, (source, _, recursive) in batch.paths.items():
            if source in moved and not recursive:
                done.add(item)
            elif item not in batch.failed:
                error = classify_globus(fatal.get("code") or "FAILED", fatal.get("description") or "", item)
                error.message = f"Globus task {task_id} failed: {error.message}"
                batch.failed[item] = error
        return done

    def _pages(self, task_id: str, method: str):
        paginated = getattr(self.client.paginated, method)
        return self._call(f"cannot read Globus task {task_id}", None, lambda: list(paginated(task_id).items()))

    # ------------------------------------------------------------ listing

    def _ls(self, path: str):
        offset = 0
        while True:
            page = self._call("cannot list", f"{self.endpoint.scheme}://{self.collection}{path}",
                              self.client.operation_ls, self.collection, path=path, show_hidden=True,
                              limit=_LS_LIMIT, offset=offset)
            docs = page["DATA"]
            yield from docs
            if len(docs) < _LS_LIMIT:
                return
            offset += len(docs)

    def list(self, path: str) -> list[RemoteEntry]:
        entries, pending = [], [""]
        while pending:
            rel = pending.pop()
            for doc in self._ls(posixpath.join(path, rel)):
                found = entry(posixpath.join(rel, doc["name"]), doc)
                entries.append(found)
                if found.kind == "d":
                    pending.append(found.path)
        return entries

    def stat(self, path: str) -> RemoteEntry | None:
        try:
            doc = self._call("cannot stat", path, self.client.operation_stat, self.collection, path)
        except RemotePathMissingError:
            return None
        return entry("", doc)

    def mkdir(self, path: str) -> None:
        path = posixpath.normpath(path)
        error = self._try_mkdir(path)
        if isinstance(error, RemotePathMissingError) and path != "/":
            self.mkdir(posixpath.dirname(path))
            error = self._try_mkdir(path)
        if error is not None:
            raise error

    def _try_mkdir(self, path: str) -> TransportError | None:
        try:
            self.client.operation_mkdir(self.collection, path)
        except globus_sdk.GlobusError as exc:
            if isinstance(exc, globus_sdk.GlobusAPIError) and (exc.code or "").lower().endswith("exists"):
                return None                                  # existing is fine
            return from_sdk(exc, "cannot create directory", path)
        return None

    def _call(self, what: str, where: str | None, function, /, *args, **kwargs):
        """``function(*args, **kwargs)``, its globus-sdk errors turned into TransportErrors about ``where``."""
        try:
            return function(*args, **kwargs)
        except globus_sdk.GlobusError as exc:
            raise from_sdk(exc, what, where) from exc

    def close(self) -> None:
        if self._owns_client:
            self.client.close()
            self._owns_client = False


def _uuid(text: str, what: str, hint: str) -> str:
    """``text`` as a canonical UUID; UsageError naming ``what`` and ``text`` otherwise."""
    try:
        return str(uuid.UUID(text))
    except ValueError:
        raise UsageError(f"the {what} must be a Globus collection UUID, not {text!r}", hint=hint) from None


def _ancestors(items: list[str]) -> set[str]:
    parents = set()
    for item in items:
        parent = posixpath.dirname(item)
        while parent and parent not in parents:
            parents.add(parent)
            parent = posixpath.dirname(parent)
    return parents


def _bad_item(item: str) -> TransportError | None:
    if not item or item.startswith("/") or ".." in item.split("/"):
        return TransportError("item must be a relative path inside the root", item)
    if "\r\n" in item:
        return NotSupportedError("Globus refuses names containing CR LF", item, "rename it, or bundle the tree")
    return None


def _retarget(error: _Error, path: str) -> _Error:
    clone = copy.copy(error)
    clone.path = path
    return clone


def _local_kinds(local_root: str, items: list[str], parents: set[str]) -> dict:
    kinds: dict[str, str | TransportError] = {}
    for item in items:
        try:
            mode = os.lstat(os.path.join(local_root, item)).st_mode
        except OSError as exc:
            kinds[item] = RemotePathMissingError(f"source cannot be read ({exc.strerror})", item, "check the path")
            continue
        problem = unsupported(item, mode)
        kinds[item] = problem or ("implied" if item in parents else "d" if stat.S_ISDIR(mode) else "f")
    return kinds


def _owner(path: str, owners: dict[str, str], whole: bool) -> str | None:
    """The item a task path belongs to; for a whole-tree task, its path relative to the root."""
    path = path.rstrip("/")
    if whole:
        root = next(iter(owners)) or "/"
        return posixpath.relpath(path, root) if path.startswith(root) else None
    while path and path not in owners:
        parent = posixpath.dirname(path)
        path = "" if parent == path else parent
    return owners.get(path)


def _settle_implied(batch: _Batch, done: set[str]) -> None:
    """A directory implied by its entries is done when one of them is; else it fails like they did."""
    reached = _ancestors(list(done))
    causes: dict[str, ItemError] = {}
    for failed_item, error in batch.failed.items():
        for parent in _ancestors([failed_item]):
            causes.setdefault(parent, error)
    for item in batch.implied:
        if item in reached:
            done.add(item)
        else:
            cause = causes.get(item)
            batch.failed[item] = (_retarget(cause, item) if cause
                                  else TransportError("no entry under this directory was transferred", item))
