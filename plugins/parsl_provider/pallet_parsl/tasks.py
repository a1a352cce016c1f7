"""The bodies of the Parsl tasks a batch becomes: plan and move, unpack (serially or under MPI), send.

Each also takes ``_parsl_staging_inhibit`` and ``parsl_resource_specification``: Parsl hands a task's
keyword arguments to its function, these two included.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import posixpath
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from staging_core import (DestinationLock, Endpoint, HostSessions, OpenSource, PalletError, RemoteEntry, SourceError,
                          StagingOptions, UsageError, fetch, fetch_if_small, missing_members, move_packed, open_bundle,
                          open_transport, parse_url, plan_pull, run_local, send, unpack_summary)

MARKER = "batch-{}.json"         # in BatchSpec.state_root
INCOMING = "incoming-{}"
KEPT = "packed-{}"               # a keep-packed batch's bundle, kept for its apps


class BatchError(PalletError):
    """A batch could not be staged; every app reading one of its files fails with this as its cause.

    ``number`` is the batch's number in this run, ``files`` how many files
    it held, ``cause`` the error that stopped it (also ``__cause__``).
    """

    def __init__(self, message: str, path=None, hint=None, number: int = 0, files: int = 0,
                 cause: BaseException | None = None):
        super().__init__(message, path, hint)
        self.number, self.files, self.cause = number, files, cause


@dataclass(frozen=True)
class BatchSpec:
    """One sealed batch, as its tasks receive it.

    ``direction`` is 'in' (fetch to this side) or 'out' (send back);
    ``items`` are paths relative to both ``remote_root`` (a pallet URL) and
    ``local_root`` (a local directory: the remote tree is kept below it);
    ``sizes`` are known sizes in the order of ``items``, or None;
    ``batch_id`` depends only on the direction, the roots and the set of
    items, so a rerun of the same batch finds its completion marker;
    ``state_root`` is where markers and bundles in transit live: beside the
    mirrored trees (``ROOT/.pallet/parsl``), never inside one;
    ``packed``: the batch is kept as a bundle (``keep_packed``), not unpacked.
    """

    number: int
    batch_id: str
    direction: str
    remote_root: str
    local_root: str
    items: tuple[str, ...]
    sizes: tuple[int, ...] | None
    options: StagingOptions
    state_root: str
    packed: bool = False

    @staticmethod
    def ident(direction: str, remote_root: str, local_root: str, items, packed: bool = False) -> str:
        how = direction + (" packed" if packed else "")
        digest = hashlib.sha256("\0".join([how, remote_root, local_root, *sorted(items)]).encode())
        return digest.hexdigest()[:20]

    def describe(self) -> str:
        ends = (self.remote_root, self.local_root) if self.direction == "in" else (self.local_root, self.remote_root)
        return f"pallet batch {self.number} ({len(self.items)} file(s) from {ends[0]} to {ends[1]})"


@dataclass(frozen=True)
class UnpackPlan:
    """How the unpack task runs ``mpi_stager unpack``: under ``launcher`` (a template whose ``{ranks}`` becomes
    ``$PARSL_NUM_RANKS``, set by an MPIExecutor) or, when it is None, as one process with ``workers``."""

    launcher: str | None = None
    workers: int = 1


@dataclass(frozen=True)
class KeptBundle:
    """A kept bundle (a local path) and the remote directory, as a URL, that its paths are relative to."""

    bundle: str
    remote_root: str


@dataclass(frozen=True)
class Moved:
    """What the move task did: 'individual' (files already in place), 'bundle' (``bundle`` fetched, to be
    unpacked), 'kept packed' (``bundle`` fetched, holding the ``fresh`` items, to be kept) or 'done before' (the
    completion marker was there, or every file of a keep-packed batch is in a bundle kept before); transport
    transfers made; file bytes sent; its wall seconds; for a keep-packed batch, the bundles kept before that
    hold the rest of its items (``kept``)."""

    spec: BatchSpec
    strategy: str
    transfers: int
    bundle: str | None = None
    bytes_sent: int | None = None
    seconds: float = 0.0
    kept: tuple[KeptBundle, ...] = ()
    fresh: tuple[str, ...] = ()


@dataclass(frozen=True)
class BatchDone:
    """A finished batch: its number, direction, files, strategy, transfers made, file bytes the transport sent
    (None when it cannot tell), shards an earlier run had unpacked, unpack ranks and wall seconds of its tasks;
    for a keep-packed batch, the kept ``bundles`` its apps read (the one it brought first, then those kept
    before that hold the rest of its files), and the first of them as ``bundle`` and its ``remote_root``."""

    number: int
    direction: str
    files: int
    strategy: str
    transfers: int
    bytes_sent: int | None = None
    skipped_shards: int = 0
    ranks: int = 0
    seconds: float = 0.0
    bundle: str | None = None
    remote_root: str = ""
    bundles: tuple[KeptBundle, ...] = ()


def move_batch(spec: BatchSpec, stream: bool = True, _parsl_staging_inhibit: bool = True,
               parsl_resource_specification: dict | None = None, sessions: HostSessions | None = None) -> Moved:
    """First task of an incoming batch: plan it and bring it here.

    Returns at once when the batch's completion marker exists (a rerun).
    The planner chooses (unless ``spec.options.strategy`` says): individual
    fetches the files straight into ``local_root`` in one transfer. A bundle
    from a source that streams (ssh with pallet there), when ``stream`` and
    ``spec.options.stream`` allow it, is streamed and unpacked into
    ``local_root`` by this task (resumable by shard); otherwise the source's
    pack route packs just these items and bundle + index come in one
    transfer into ``state_root/incoming-ID/`` (a rerun finds it there: rsync
    sends no data again), for the unpack task. Sources with no pack route
    (GridFTP, Globus without ``pack_via``) go individually. A ``packed``
    batch finds, for each item, a bundle kept before (by any batch of any
    run into this ROOT) that holds it; only the items none holds are packed
    at the source and brought into ``state_root/packed-ID/``, where they
    stay. A batch small enough travels inline over the source host's
    session (``sessions``: the provider's, when this task runs in its
    process; else one of this task's own, whose ssh connection is still
    the kept one all processes share). Raises BatchError naming the batch
    and the cause.
    """
    done = None if spec.packed else _done_before(spec)
    if done is not None:
        return done
    started = time.monotonic()
    try:
        with _sessions(sessions) as run_sessions:
            moved = _move_kept(spec) if spec.packed else _move(spec, stream, run_sessions)
    except PalletError as exc:
        raise _failed(spec, exc) from exc
    return replace(moved, seconds=time.monotonic() - started)


def unpack_batch(moved: Moved, how: UnpackPlan, _parsl_staging_inhibit: bool = True,
                 parsl_resource_specification: dict | None = None) -> BatchDone:
    """Second task of an incoming batch: unpack its bundle (if any) into ``local_root``, check every file is
    there and write the completion marker. ``python -m mpi_stager unpack`` runs as a subprocess, under the
    MPI launcher when ``how.launcher`` is set; its journal skips shards an earlier attempt finished. The
    bundle is deleted once unpacked. Unpacks into one directory take turns on its pallet lock (as fetches
    do). Raises BatchError naming the batch and the cause."""
    started, spec = time.monotonic(), moved.spec
    if spec.packed:
        return _check_kept(moved, started)
    if moved.strategy == "done before":
        return BatchDone(spec.number, "in", len(spec.items), moved.strategy, 0, 0)
    skipped = ranks = 0
    try:
        if moved.bundle:
            with _local_lock(spec.local_root):
                summary = unpack_summary(run_local(unpack_argv(how, moved.bundle, spec.local_root)), spec.local_root)
            skipped, ranks = summary.shards_skipped, summary.ranks
            shutil.rmtree(os.path.dirname(moved.bundle), ignore_errors=True)
        _check_present(spec)
    except PalletError as exc:
        raise _failed(spec, exc) from exc
    _write_marker(spec, moved.strategy)
    return BatchDone(spec.number, "in", len(spec.items), moved.strategy, moved.transfers, moved.bytes_sent,
                     skipped, ranks, moved.seconds + time.monotonic() - started)


def send_batch(spec: BatchSpec, _parsl_staging_inhibit: bool = True,
               parsl_resource_specification: dict | None = None, sessions: HostSessions | None = None) -> BatchDone:
    """The task of an outgoing batch: send the outputs of the apps that succeeded (``spec.items``) to
    ``remote_root`` in one planned operation (staging_core.operations.selection.send: inline over the host's
    session when small, ``sessions`` as for :func:`move_batch`; rsync skips what is already there, a bundle is
    unpacked by the destination's route, resumably). Raises BatchError."""
    started = time.monotonic()
    if not spec.items:
        return BatchDone(spec.number, "out", 0, "nothing to send", 0, 0)
    try:
        with _sessions(sessions) as run_sessions:
            result = send(spec.local_root, spec.items, spec.remote_root, replace(spec.options, pack_via=None),
                          sessions=run_sessions)
    except PalletError as exc:
        raise _failed(spec, exc) from exc
    return BatchDone(spec.number, "out", len(spec.items), result.strategy, result.transfers, result.bytes_sent,
                     result.skipped_shards, 0, time.monotonic() - started)


def unpack_argv(how: UnpackPlan, bundle: str, dest: str) -> list[str]:
    """``[launcher] python -m mpi_stager unpack --json ...``; UsageError if the launcher needs
    ``$PARSL_NUM_RANKS`` and the task did not run under an MPIExecutor."""
    stager = [sys.executable, "-m", "mpi_stager", "unpack", "--json", "--locked-by-caller"]      # _local_lock
    if how.launcher is None:
        return [*stager, "--workers", str(how.workers), bundle, dest]
    ranks = os.environ.get("PARSL_NUM_RANKS")
    if not ranks:
        raise UsageError("$PARSL_NUM_RANKS is not set: the unpack did not run under an MPIExecutor",
                         hint="unpack_executor must name an MPIExecutor label")
    return [*shlex.split(how.launcher.format(ranks=ranks)), *stager, bundle, dest]


def _local_lock(dest: str) -> DestinationLock:
    """DEST's pallet lock, waited for: unpacks (and fetches) into one directory take turns, since an unpack's
    ``DEST/.pallet/INCOMPLETE`` is per directory, not per bundle."""
    local = Endpoint("file", dest)
    return DestinationLock(local, open_transport(local), wait=True)


def _failed(spec: BatchSpec, exc: BaseException) -> BatchError:
    return BatchError(f"{spec.describe()} failed: {exc}", hint="every app reading these files fails with this "
                      "cause; fix it and rerun: files and shards already staged are not sent again",
                      number=spec.number, files=len(spec.items), cause=exc)


@contextmanager
def _sessions(given: HostSessions | None) -> Iterator[HostSessions]:
    """``given``, or host sessions of this task's own, closed when it ends."""
    if given is not None:
        yield given
        return
    own = HostSessions()
    try:
        yield own
    finally:
        own.close()


def _move(spec: BatchSpec, stream: bool, sessions: HostSessions) -> Moved:
    """The move task's work: a small batch fetched inline over the source host's session; else the source
    opened and the batch planned (staging_core's pull phases), files fetched into ``local_root``
    (individually, streamed, or by the tar-tools route), or a bundle of them packed at the source and brought
    into ``state_root/incoming-ID/`` for the unpack task."""
    options = _fetch_options(spec)
    small = fetch_if_small(spec.remote_root, spec.items, spec.local_root, options, spec.sizes, sessions)
    if small is not None:
        return Moved(spec, small.strategy, small.transfers, None, small.bytes_sent)
    with OpenSource(spec.remote_root, options) as source:
        strategy, sizes = _strategy(spec, source)
        streams = stream and source.options.stream != "off" and source.streams
        if strategy == "individual" or not source.packs or streams:
            aligned = sizes if sizes is not None and len(sizes) == len(spec.items) else None
            result = fetch(spec.remote_root, spec.items, spec.local_root, replace(options, strategy=strategy),
                           aligned)
            return Moved(spec, result.strategy, result.transfers, None, result.bytes_sent)
        incoming = os.path.join(spec.state_root, INCOMING.format(spec.batch_id))
        os.makedirs(incoming, exist_ok=True)
        moved = move_packed(source, incoming, spec.items)
    return Moved(spec, "bundle", 1, moved.path, moved.transfer.bytes_sent)


def _strategy(spec: BatchSpec, source: OpenSource) -> tuple[str, list[int] | None]:
    """'individual' or 'bundle' (a hybrid plan runs as a bundle) and the sizes known or listed to decide it.
    Without a pack route there is no choice; an explicit strategy needs no sizes."""
    options, sizes = spec.options, None if spec.sizes is None else list(spec.sizes)
    if source.route is None or options.strategy == "individual":
        return "individual", sizes
    if options.strategy != "auto":
        return "bundle", sizes
    if sizes is None:
        sizes = _listed_sizes(source.transport.list(source.endpoint.path), spec)
    _, chosen = plan_pull(source, spec.local_root, spec.items, sizes)
    return ("individual" if chosen.strategy == "individual" else "bundle"), sizes


def _listed_sizes(entries: list[RemoteEntry], spec: BatchSpec) -> list[int]:
    """Sizes of the files the items select (one per item when all are files); SourceError names missing ones."""
    kinds = {entry.path: entry for entry in entries}
    missing = [item for item in spec.items if item not in kinds]
    if missing:
        raise SourceError(f"{len(missing)} file(s) not found: {', '.join(missing[:10])}", spec.remote_root,
                          "check the URLs given to the apps")
    if all(kinds[item].kind == "f" for item in spec.items):
        return [kinds[item].size for item in spec.items]
    selected, under = set(spec.items), tuple(item + "/" for item in spec.items)
    return [e.size for e in entries if e.kind == "f" and (e.path in selected or e.path.startswith(under))]


def _check_present(spec: BatchSpec) -> None:
    missing = [item for item in spec.items if not os.path.lexists(os.path.join(spec.local_root, item))]
    if missing:
        raise SourceError(f"{len(missing)} file(s) missing after the transfer: {', '.join(missing[:10])}",
                          spec.local_root, "see the transfer's errors; rerun to fetch the rest")


def _write_marker(spec: BatchSpec, strategy: str, bundle: str | None = None) -> None:
    path = os.path.join(spec.state_root, MARKER.format(spec.batch_id))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as handle:
        json.dump({"remote_root": spec.remote_root, "files": len(spec.items), "strategy": strategy,
                   "bundle": bundle}, handle)
    os.replace(path + ".tmp", path)


def _done_before(spec: BatchSpec) -> Moved | None:
    """A Moved saying 'done before' when the batch's completion marker is there; None when the batch must run."""
    if not spec.items:
        return Moved(spec, "done before", 0)
    try:
        with open(os.path.join(spec.state_root, MARKER.format(spec.batch_id))) as handle:
            json.load(handle)
    except (OSError, ValueError):
        return None
    return Moved(spec, "done before", 0)


def kept_before(spec: BatchSpec) -> tuple[tuple[KeptBundle, ...], tuple[str, ...]]:
    """The bundles kept before under ``spec.state_root`` that hold items of ``spec`` (newest first, each item
    taken from the first that holds it; a bundle is trusted for what its index shows) and the items none
    holds. Kept bundles are named by the markers of the keep-packed batches that brought them."""
    origin, root = _origin(spec.remote_root), parse_url(spec.remote_root).path
    wanted = {posixpath.join(root, item): item for item in spec.items}
    found: list[KeptBundle] = []
    for kept in _kept_bundles(spec.state_root):
        if not wanted or _origin(kept.remote_root) != origin:
            continue
        top = parse_url(kept.remote_root).path
        below = {path: posixpath.relpath(path, top) for path in wanted if path.startswith(top.rstrip("/") + "/")}
        if not below:
            continue
        try:
            with open_bundle(kept.bundle) as view:
                held = [path for path, relative in below.items() if view.lookup(relative) is not None]
        except (PalletError, OSError):
            continue                        # a damaged or vanished bundle is passed over: its files come again
        if held:
            found.append(kept)
            for path in held:
                del wanted[path]
    return tuple(found), tuple(item for item in spec.items if posixpath.join(root, item) in wanted)


def _kept_bundles(state_root: str) -> list[KeptBundle]:
    """Every kept bundle recorded under ``state_root`` that is still there, newest marker first."""
    kept = []
    for marker in glob.glob(os.path.join(glob.escape(state_root), MARKER.format("*"))):
        try:
            with open(marker) as handle:
                record = json.load(handle)
            when = os.stat(marker).st_mtime_ns
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("bundle"), str) and os.path.isfile(record["bundle"]):
            kept.append((when, marker, KeptBundle(record["bundle"], str(record.get("remote_root", "")))))
    return [bundle for *_, bundle in sorted(kept, key=lambda found: (-found[0], found[1]))]


def _origin(url: str) -> tuple:
    """What two URLs must share for one's files to stand for the other's: scheme, host, port and user."""
    try:
        where = parse_url(url)
    except PalletError:
        return ()
    return where.scheme, where.host, where.port, where.user


def _fetch_options(spec: BatchSpec) -> StagingOptions:
    """The batch's options for a fetch: the provider's, without the routes a push takes (they serve its sends)."""
    return replace(spec.options, unpack_via=None, unpack_job=None, keep_packed=False, job_options=())


def _move_kept(spec: BatchSpec) -> Moved:
    """A keep-packed batch's move: the items no bundle kept before holds packed at the source and brought into
    ``state_root/packed-ID/`` (ID: of those items); nothing opened when every item is held already."""
    kept, fresh = kept_before(spec)
    if not fresh:
        return Moved(spec, "done before", 0, kept=kept)
    options = _fetch_options(spec)
    with OpenSource(spec.remote_root, options) as source:
        if not source.packs:
            raise UsageError("keep_packed needs a source that packs bundles: pallet at an ssh source, or pack_via "
                             "for a GridFTP/Globus one", spec.remote_root,
                             "install pallet there (pallet remote install HOST), set options.pack_via, or drop "
                             "keep_packed")
        into = os.path.join(spec.state_root, KEPT.format(_fresh_spec(spec, fresh).batch_id))
        os.makedirs(into, exist_ok=True)
        moved = move_packed(source, into, fresh)
    return Moved(spec, "kept packed", 1, moved.path, moved.transfer.bytes_sent, kept=kept, fresh=fresh)


def _fresh_spec(spec: BatchSpec, fresh: tuple[str, ...]) -> BatchSpec:
    """``spec`` narrowed to the items it packs: its id names their bundle's directory and marker."""
    ident = BatchSpec.ident(spec.direction, spec.remote_root, spec.local_root, fresh, spec.packed)
    return replace(spec, batch_id=ident, items=fresh, sizes=None)


def _check_kept(moved: Moved, started: float) -> BatchDone:
    """A keep-packed batch's second task: the bundle it brought holds its fresh items, and its marker names that
    bundle for later runs."""
    spec = moved.spec
    if not spec.items:
        return BatchDone(spec.number, "in", 0, moved.strategy, 0, 0)
    bundles = moved.kept
    if moved.bundle:
        try:
            missing = missing_members(moved.bundle, moved.fresh)
            if missing:
                raise SourceError(f"{len(missing)} file(s) not in the kept bundle: {', '.join(missing[:10])}",
                                  moved.bundle, "check the URLs given to the apps")
        except PalletError as exc:
            raise _failed(spec, exc) from exc
        _write_marker(_fresh_spec(spec, moved.fresh), moved.strategy, moved.bundle)
        bundles = (KeptBundle(moved.bundle, spec.remote_root), *bundles)
    return BatchDone(spec.number, "in", len(spec.items), moved.strategy, moved.transfers, moved.bytes_sent,
                     seconds=moved.seconds + time.monotonic() - started, bundle=bundles[0].bundle,
                     remote_root=bundles[0].remote_root, bundles=bundles)
