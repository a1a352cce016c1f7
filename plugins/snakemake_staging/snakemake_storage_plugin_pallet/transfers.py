"""Blocking batch work: the objects of a batch fetched or sent with one planned pallet operation per location."""
from __future__ import annotations

import errno
import logging
import os
import posixpath
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from itertools import groupby

from staging_core import (BundleError, DestinationError, Endpoint, HostSessions, PalletError, RemoteEntry,
                          SourceError, StagingOptions, StagingResult, UsageError, copy_out, fetch, local_tree_items,
                          open_bundle, scratch_space, send)

from .inventory import RemoteInventory, host_key, relative
from .kept import KeptBundle, KeptBundles, ListingChanged

SHOWN = 5           # objects named in one error message
MAX_CONCURRENT = 8  # groups of one batch (different hosts or top-level directories) staged at the same time


@dataclass(frozen=True)
class Request:
    """One object of a batch: its query (for messages), where it lives remotely, and its absolute local path."""

    query: str
    remote: Endpoint
    local: str


class BatchFailed(PalletError):
    """A batch's operation failed: ``queries`` are the objects it was moving, ``cause`` the error."""

    def __init__(self, action: str, queries: list[str], cause: Exception):
        self.action, self.queries, self.cause = action, queries, cause
        super().__init__(f"could not {action} {len(queries)} object(s)")

    def for_object(self, query: str) -> str:
        """The message for one object of the batch: it first, then some of the others, then the cause."""
        others = [q for q in self.queries[:SHOWN + 1] if q != query][:SHOWN]
        more = len(self.queries) - 1 - len(others)
        text = f"pallet could not {self.action} {query}"
        if others:
            listed = ", ".join(others) + (f" and {more} more" if more > 0 else "")
            text += f" (the same operation also carried {listed})"
        return f"{text}: {self.cause}"


class Stager:
    """Runs the batches of one provider.

    ``retrieve(requests)`` / ``store(requests)`` group the requests by
    location (host, and top-level directory so that no operation is rooted
    at ``/``) and run one ``staging_core.operations.selection.fetch`` / ``send`` per
    group, rooted at the deepest directory the group's objects share. A
    retrieval lands in a scratch directory under ``scratch_root`` and is
    renamed into each object's local path only when the whole group is
    there, carrying the remote modes and mtimes; if anything fails, the
    group's local paths are removed. With ``kept`` (keep-packed), the
    group's root directory is fetched whole as one kept bundle instead, at
    most once per listing, and each object is copied out of it into its
    local path. Both return ``{index: BatchFailed}``
    for the requests of failed groups and never raise. The groups of a
    batch run at the same time (up to MAX_CONCURRENT), and so may batches
    from other threads; operations into one destination queue on its lock.
    ``sessions``: the provider's host sessions, over which every fetch and
    send to an ssh host runs (a small one inline, in one round trip);
    ``extend(group, log)``: the objects to retrieve with a group (the
    group itself, or more: see prefetch.py); if the extended group fails,
    the group alone is retrieved again.
    """

    def __init__(self, inventory: RemoteInventory, options: StagingOptions, scratch_root: str,
                 logger: logging.Logger, wait_for_space: int | None = None, kept: KeptBundles | None = None,
                 sessions: HostSessions | None = None, extend=None):
        self.inventory, self.options, self.scratch_root, self.logger = inventory, options, scratch_root, logger
        self.wait_for_space, self.kept, self.sessions = wait_for_space, kept, sessions
        self.extend = extend or (lambda group, log: group)

    def retrieve(self, requests: list[Request]) -> dict[int, BatchFailed]:
        return self._each_group(requests, "retrieve", self._retrieve_group)

    def store(self, requests: list[Request]) -> dict[int, BatchFailed]:
        return self._each_group(requests, "store", self._store_group)

    def _each_group(self, requests: list[Request], action: str, work) -> dict[int, BatchFailed]:
        indexed = sorted(enumerate(requests), key=lambda pair: location(pair[1]))
        groups = [list(members) for _, members in groupby(indexed, key=lambda pair: location(pair[1]))]
        if len(groups) == 1:
            return _run_group(groups[0], action, work)
        failures: dict[int, BatchFailed] = {}
        with ThreadPoolExecutor(min(len(groups), MAX_CONCURRENT), thread_name_prefix="pallet-group") as pool:
            for outcome in pool.map(lambda members: _run_group(members, action, work), groups):
                failures.update(outcome)
        return failures

    # ------------------------------------------------------------ retrieval

    def _retrieve_group(self, group: list[Request]) -> None:
        extended = self.extend(group, self.logger.info) if self.kept is None else group
        if len(extended) > len(group):
            try:
                self._fetch_group(extended)
                return
            except (PalletError, OSError) as exc:
                self.logger.warning(f"pallet: the prefetch with this retrieval failed ({exc}); retrieving only "
                                    "what was asked for")
        self._fetch_group(group)

    def _fetch_group(self, group: list[Request]) -> None:
        root = _common_root(group)
        items, sizes, directories = self._selection(group, root)
        if self.kept is not None:
            self._retrieve_kept(group, root, sum(sizes))
            return
        self._ensure_space(sum(sizes), self.scratch_root)
        source = replace(group[0].remote, path=root).url()
        self.logger.info(f"pallet: fetching {len(group)} object(s) from {source}")
        try:
            with scratch_space(".pallet-fetch-", self.scratch_root) as landing:
                result = fetch(source, items, landing, self.options, sizes=sizes, sessions=self.sessions)
                _place(group, root, landing, directories)
        except Exception:
            for request in group:
                remove_local(request.local)
            raise
        self._report("fetched", len(group), source, result)

    def _retrieve_kept(self, group: list[Request], root: str, nbytes: int) -> None:
        """Copy each object out of the kept bundle of ``root``; on failure, the group's local paths are
        removed."""
        if root == "/":
            raise UsageError("--storage-pallet-keep-packed does not pack the root directory /",
                             group[0].query, "keep the inputs of one job below one directory")
        self._ensure_space(nbytes, self.scratch_root)
        directory = replace(group[0].remote, path=root)
        started = time.monotonic()
        try:
            kept = self._copy_out_of_kept(group, directory)
        except Exception:
            for request in group:
                remove_local(request.local)
            raise
        self.logger.info(f"pallet: copied {len(group)} object(s) out of the kept bundle of {directory.url()} "
                         f"({kept.path}), {time.monotonic() - started:.2f} s")

    def _copy_out_of_kept(self, group: list[Request], directory: Endpoint) -> KeptBundle:
        """Copy the group's objects out of the kept bundle of ``directory``: found, or fetched whole first. One
        more try with a fresh listing when the directory changed while it was packed, and with a new fetch when
        the kept bundle turns out damaged, cut short or gone."""
        tries, bundles = 2, self.kept
        if bundles is None:
            raise UsageError("pallet: objects are copied out of kept bundles only with --storage-pallet-keep-packed")
        while True:
            tries -= 1
            listing, kept = self.inventory.children(directory), None
            try:
                kept = bundles.find(directory, listing)
                if kept is None:
                    self._ensure_space(sum(e.size for e in listing), bundles.store)
                    kept = bundles.bundle_for(directory, listing)
                _copy_objects_out(kept.path, group, directory.path, self.scratch_root)
                return kept
            except ListingChanged:
                if not tries:
                    raise
                self.inventory.forget(directory)
            except BundleError as exc:
                if not tries or kept is None:
                    raise
                self.logger.warning(f"pallet: the kept bundle {kept.path} cannot be read ({exc}); fetching it "
                                    "again")
                bundles.discard(kept)

    def _selection(self, group: list[Request], root: str) -> tuple[list[str], list[int], set[str]]:
        """The items to fetch, their sizes, and the remote paths of the directory objects: a file is its own
        item; a directory brings everything below it that is not a parent of something else (parents come
        along). SourceError names the objects that do not exist."""
        items, sizes, missing, directories = [], [], [], set()
        known = self.inventory.lookup_many([request.remote for request in group])
        for request in group:
            entry = known[request.remote.path]
            rel = relative(request.remote.path, root)
            if entry is None:
                missing.append(request.query)
            elif entry.kind == "d":
                directories.add(request.remote.path)
                leaves = _leaves(self.inventory.children(request.remote))
                items += [posixpath.join(rel, e.path) for e in leaves] or [rel]
                sizes += [e.size for e in leaves] or [0]
            else:
                items.append(rel)
                sizes.append(entry.size)
        if missing:
            raise SourceError(f"{len(missing)} object(s) do not exist: {', '.join(missing[:SHOWN])}"
                              + (" ..." if len(missing) > SHOWN else ""),
                              hint="check the URL, and that the rule making it has run")
        return items, sizes, directories

    def _ensure_space(self, nbytes: int, where: str) -> None:
        """Wait up to ``wait_for_space`` seconds (Snakemake's --wait-for-free-local-storage) for ``nbytes`` to
        fit below ``where``; DestinationError if they do not."""
        deadline = time.monotonic() + (self.wait_for_space or 0)
        while (free := shutil.disk_usage(where).free) < nbytes:
            if time.monotonic() >= deadline:
                raise DestinationError(f"{nbytes} bytes to fetch, {free} bytes free", where,
                                       "free space, wait for it with --wait-for-free-local-storage SECONDS, or cap "
                                       "batches with --storage-pallet-batch-max-bytes")
            self.logger.info(f"pallet: waiting for {nbytes} bytes of free space below {where}")
            time.sleep(60 if (self.wait_for_space or 0) > 60 else 1)

    # ------------------------------------------------------------ stores

    def _store_group(self, group: list[Request]) -> None:
        root = _common_root(group)
        rels = [relative(r.remote.path, root) for r in group]
        absent = [r.local for r in group if not os.path.lexists(r.local)]
        if absent:
            raise SourceError(f"local file(s) missing: {', '.join(absent[:SHOWN])}", hint="the job did not write them")
        items = [item for rel, r in zip(rels, group, strict=True) for item in _expand_local(rel, r.local)]
        dest = replace(group[0].remote, path=root).url()
        base = _shared_base(group, rels)
        self.logger.info(f"pallet: sending {len(group)} object(s) to {dest}")
        try:
            if base is not None:
                result = send(base, items, dest, self.options, sessions=self.sessions)
            else:
                with scratch_space(".pallet-send-", self.scratch_root) as staged:
                    for rel, request in zip(rels, group, strict=True):
                        _link_copy(request.local, os.path.join(staged, rel))
                    result = send(staged, items, dest, self.options, sessions=self.sessions)
        except BaseException:
            for request in group:
                self.inventory.forget(request.remote)
            raise
        for request in group:
            self.inventory.stored(request.remote, request.local)
        self._report("sent", len(group), dest, result)

    def _report(self, verb: str, objects: int, where: str, result: StagingResult) -> None:
        self.logger.info(f"pallet: {verb} {objects} object(s) ({result.files} files, {result.file_bytes} bytes) "
                         f"{'from' if verb == 'fetched' else 'to'} {where}: {result.strategy}, "
                         f"{result.transfers} transfer(s), {result.seconds:.2f} s")


def _run_group(members: list[tuple[int, Request]], action: str, work) -> dict[int, BatchFailed]:
    """Run ``work`` on one group of (index, request) pairs; its failure, by index, for each request."""
    group = [request for _, request in members]
    try:
        work(group)
    except (PalletError, OSError) as exc:
        failure = BatchFailed(action, [r.query for r in group], exc)
        return {n: failure for n, _ in members}
    return {}


def _copy_objects_out(bundle: str, group: list[Request], root: str, scratch_root: str) -> None:
    """Copy each object of ``group`` out of the local ``bundle`` of the remote directory ``root`` into a scratch
    directory below ``scratch_root``, then rename it over its local path: a local path holds its old content
    or the whole new one, never a part (a killed run's scratch is swept by the next)."""
    with scratch_space(".pallet-copy-", scratch_root) as landing, open_bundle(bundle) as view:
        for number, request in enumerate(group):
            landed = os.path.join(landing, str(number))
            copy_out(view, relative(request.remote.path, root), landed)
            _move(landed, request.local)


def _leaves(entries: list[RemoteEntry]) -> list[RemoteEntry]:
    parents = {posixpath.dirname(e.path) for e in entries}
    return [e for e in entries if e.kind != "d" or e.path not in parents]


def location(request: Request) -> tuple:
    """Where a request's operation is rooted: its host, and its top-level directory (never ``/`` itself)."""
    top = request.remote.path.split("/")[1]
    return tuple("" if part is None else str(part) for part in host_key(request.remote)) + (top,)


def _common_root(group: list[Request]) -> str:
    return posixpath.commonpath([posixpath.dirname(r.remote.path) for r in group])


def _place(group: list[Request], root: str, landing: str, directories: set[str]) -> None:
    """Move each object from ``landing`` to its local path; objects inside a directory object of the group,
    or asked for twice, are copied."""
    nested = [r for r in group if directories and any(r.remote.path.startswith(d + "/") for d in directories)]
    inside = set(nested)
    placed: dict[str, str] = {}
    for request in nested + [r for r in group if r not in inside]:
        first = placed.get(request.remote.path)
        if first == request.local:
            continue
        landed = os.path.join(landing, relative(request.remote.path, root))
        if first is not None or request in inside:
            remove_local(request.local)
            _link_copy(first or landed, request.local, link=False)
        else:
            _move(landed, request.local)
        placed.setdefault(request.remote.path, request.local)


def _move(source: str, target: str) -> None:
    """Rename ``source`` to ``target``, replacing whatever is there and making its parent if needed."""
    try:
        os.replace(source, target)                   # the usual case: a file onto nothing or onto its old copy
    except OSError:
        remove_local(target)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.replace(source, target)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            shutil.move(source, target)


def remove_local(path: str) -> None:
    """Remove a local file, symlink or tree if it is there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _link_copy(source: str, target: str, link: bool = True) -> None:
    """Hard-link (else copy) a file or a tree, keeping modes and mtimes."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.isdir(source) and not os.path.islink(source):
        shutil.copytree(source, target, symlinks=True, copy_function=_link_or_copy if link else shutil.copy2)
    elif link:
        _link_or_copy(source, target)
    else:
        shutil.copy2(source, target, follow_symlinks=False)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError:
        shutil.copy2(source, target, follow_symlinks=False)


def _expand_local(rel: str, local: str) -> list[str]:
    """A file's item; for a directory, everything below it that is not a parent of something else."""
    if os.path.isdir(local) and not os.path.islink(local):
        below = local_tree_items(local)
        parents = {posixpath.dirname(item) for item in below}
        return [posixpath.join(rel, item) for item in below if item not in parents] or [rel]
    return [rel]


def _shared_base(group: list[Request], rels: list[str]) -> str | None:
    """The local directory B with B/rel == local path for every object (Snakemake's usual layout), else None."""
    bases = {r.local[:-len(rel)].rstrip("/") if r.local.endswith("/" + rel) else None
             for r, rel in zip(group, rels, strict=True)}
    return bases.pop() if len(bases) == 1 and None not in bases else None
