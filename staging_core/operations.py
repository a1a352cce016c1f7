"""push and pull: plan, lock, retry, then run the strategy through the transport and the routes — policy in one place."""
from __future__ import annotations

import os
import posixpath
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from bundles.errors import PalletError, SourceError, UsageError
from bundles.progress import NoProgress, Progress
from bundles.scan import SourceTree, scan
from bundles.state import STATE_DIR, ensure_state_dir, prune, remove_state
from bundles.writer import PackOptions, pack
from mpi_stager.comm import SerialComm
from mpi_stager.unpack import StagerOptions, unpack_parallel

from .inventory import Inventory, compress_ratio, tree_inventory
from .locking import DestinationLock
from .options import STRATEGIES, STREAM_MODES, StagingOptions, StagingResult
from .pack_routes import PackRoute, PublishedBundle
from .plain import PlainRoute
from .plain_push import push_plain
from .plain_pull import pull_plain
from .planner import Plan, plan
from .probe import far_side_options
from .dry_run import pull_dry_run, push_dry_run
from .local_profile import observe, route_profile, uses_local_copy
from .far_session import FarSession, SessionStream, destination_lock
from .repair import (COMPARABLE_SCHEMES, Comparison, PullComparison, compare_with_dest, compare_with_dest_entries,
                     compare_with_local, delete_extra, dest_md5, dirs_to_restore, finish_local_pull, fix_directories)
from .route_registry import check_route_options
from .routes import INCOMING, UnpackRoute, bundle_name, closing, unpack_route
from .scratch import scratch_dir
from .pull_phases import OpenSource, move_packed, plan_pull
from .streaming import PullStream, StreamOutcome, stream_pull, stream_push
from .transports.base import Direction, Endpoint, Transport, TransferResult, parse_url
from .transports.errors import TransportError
from .transports.registry import open_endpoint, open_transport


@dataclass
class _Run:
    """What one attempt did: transfers, seconds per stage, shards skipped, the route used."""

    route: str = "in place"
    transfers: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    skipped_shards: int = 0
    bytes_sent: int | None = 0

    def streamed(self, outcome: StreamOutcome) -> None:
        """Record one bundle stream (push or pull)."""
        self.route, self.transfers, self.skipped_shards = "stream", 1, outcome.skipped_shards
        self.bytes_sent = outcome.bytes_sent
        self.stage_seconds.update(outcome.stage_seconds)

    def count(self, result: TransferResult) -> None:
        """Add one transfer and the bytes it moved."""
        self.transfers += 1
        self.bytes_sent = None if self.bytes_sent is None or result.bytes_sent is None \
            else self.bytes_sent + result.bytes_sent


@dataclass(frozen=True)
class PushContext:
    """What every attempt of one push works with: the transport to DEST and its route, the tree to send (only
    ``include`` of it when a selection or the comparison with DEST narrowed it), its inventory and paths, the
    plan, the options, progress, and the far-side session's ``receiver`` of streams when there is one."""

    transport: Transport
    endpoint: Endpoint
    route: UnpackRoute | PlainRoute | None
    tree: SourceTree
    chosen: Plan
    inventory: Inventory
    paths: list[bytes]
    options: StagingOptions
    progress: Progress
    include: frozenset[bytes] | None = None
    receiver: Callable[[], SessionStream] | None = None

    @property
    def src(self) -> str:
        return os.fsdecode(self.tree.root)


def push(src: str, dest_url: str, options: StagingOptions = StagingOptions(),
         progress: Progress | None = None, items: Sequence[str] | None = None) -> StagingResult:
    """Move the tree under local ``src`` to ``dest_url`` and return what was done.

    The planner picks individual, bundle or hybrid unless
    ``options.strategy`` says; bundles stream into the far-side unpacker
    when the transport can (ssh), else they are packed, sent with their
    index in one transfer and unpacked by the destination's route. The
    destination is locked for the whole push; errors marked retryable are
    retried ``options.retries`` times, each attempt resuming (rsync skips
    files already there, the unpack journal skips finished shards). The
    source is only read. ``items`` (relative paths; see
    staging_core.selection) sends only those files and their parent
    directories, stored and forwarded when bundled, and waits for the
    destination's lock instead of failing. Raises UsageError for options
    the destination cannot honour, DestinationLocked, TransportError or
    PalletError naming the cause.
    """
    started = time.monotonic()
    _check_options(options)
    check_route_options(options, Direction.PUSH)
    if not os.path.isdir(src):
        raise SourceError("is not a directory" if os.path.exists(src) else "does not exist", src,
                          "push a directory: pallet push DIR URL")
    endpoint = parse_url(dest_url)
    include = None if items is None else frozenset(os.fsencode(i) for i in items)
    if options.dry_run:
        return push_dry_run(scan(src, "none", 0, include=include), endpoint, options, started)
    with ThreadPoolExecutor(1, thread_name_prefix="pallet-walk") as walker:
        walking = walker.submit(scan, src, "none", 0, include=include)     # while ssh connects, locks and probes
        try:
            with open_endpoint(endpoint, options) as transport:
                options, far = far_side_options(transport, endpoint, options)
                with closing(unpack_route(endpoint, transport, options, far)) as route, \
                        destination_lock(endpoint, transport, options, _session_possible(transport, route, options),
                                         wait=items is not None, listing=include is None) as lock:
                    return _push_locked(walking.result(), endpoint, transport, lock, route, options, progress,
                                        include, started)
        finally:
            walking.cancel()


def _push_locked(tree: SourceTree, endpoint: Endpoint, transport: Transport, lock: DestinationLock | FarSession,
                 route, options: StagingOptions, progress: Progress | None, include: frozenset[bytes] | None,
                 started: float) -> StagingResult:
    """push, once DEST is locked and its route known: compare with DEST (a whole tree sends only what
    differs), plan, run with retries, clear DEST/.pallet, delete extras with ``options.delete``. When ``lock``
    is a far-side session, it also lists DEST, receives streams, sets directory times and clears DEST/.pallet."""
    src, whole, full = os.fsdecode(tree.root), include is None, tree
    session = lock if isinstance(lock, FarSession) else None
    comparison = _comparison(transport, endpoint, tree, route, options, session) if whole else None
    if comparison is not None and not comparison.nothing_to_send:
        include = frozenset(comparison.to_send)
        tree = scan(src, "none", 0, include=include)
    inventory, paths = tree_inventory(tree, options.large_file_bytes)
    profile, bundle_possible = route_profile(endpoint, options, route is not None)
    chosen = plan(inventory.stats, profile, compress_ratio(src, paths), max(1, options.ranks), bundle_possible)
    strategy = _strategy(chosen, options, route, endpoint)
    if strategy == "hybrid" and (include is not None or isinstance(route, PlainRoute)):
        strategy = "bundle"
    if not lock.supported:
        transport.mkdir(endpoint.path)      # the lock made DEST otherwise
    if comparison is not None and comparison.nothing_to_send:
        run, attempts, inventory = _Run(route="already in place"), 0, Inventory(src, [], options.large_file_bytes)
    else:
        if comparison is not None:
            delete_extra(transport, endpoint, comparison.stale)
        receiver = (lambda: session.receiver(options.verify)) if session is not None else None
        context = PushContext(transport, endpoint, route, tree, chosen, inventory, paths, options,
                              progress or NoProgress(), include, receiver)
        run, attempts = _with_retries(lambda: _push_once(context, strategy), options.retries)
    in_place = comparison.in_place if comparison else 0
    if whole and options.delete:
        comparison = comparison or compare_with_dest(transport, endpoint, full) or Comparison()
        delete_extra(transport, endpoint, comparison.extra)
    if comparison is not None:
        fix_directories(session or transport, endpoint, full,
                        dirs_to_restore(full, comparison, whole and options.delete))
    if whole and not options.keep_packed and not isinstance(route, PlainRoute):
        _clear_state(transport, endpoint, route, session)   # a plain-tools session clears DEST/.pallet itself
    result = replace(_result(endpoint.url(), chosen, strategy, inventory, run, attempts, started),
                     in_place=in_place, deleted=len(comparison.extra) if whole and options.delete else 0)
    if strategy == "individual" and not in_place and uses_local_copy(endpoint.scheme, options.profile):
        observe(endpoint.path, result.files, result.file_bytes, result.seconds)
    return result


def _comparison(transport: Transport, endpoint: Endpoint, tree: SourceTree, route, options: StagingOptions,
                session: FarSession | None) -> Comparison | None:
    """DEST compared with the whole source, where a push compares (not into a plain-tools route, which lists
    DEST itself, nor for --keep-packed), from the session's listing when there is one."""
    if options.keep_packed or isinstance(route, PlainRoute):
        return None
    if session is not None:
        return compare_with_dest_entries(session.entries(), transport, endpoint, tree, options.checksum)
    return compare_with_dest(transport, endpoint, tree, options.checksum)


def _session_possible(transport: Transport, route, options: StagingOptions) -> bool:
    """Whether a push may run through one far-side session (staging_core.far_session): where it would stream."""
    return isinstance(route, UnpackRoute) and transport.capabilities.streaming and route.streams \
        and options.stream != "off"


def pull(src_url: str, dest: str, options: StagingOptions = StagingOptions(),
         progress: Progress | None = None, items: Sequence[str] | None = None,
         sizes: Sequence[int] | None = None) -> StagingResult:
    """Move the tree at ``src_url`` into local ``dest``; the mirror of :func:`push`.

    Individual: one batch transfer of the whole tree. Bundle from an ssh
    source with pallet: streamed (``mpi_stager send`` there, received here
    as it arrives, resumably; the planner reads the stream's skeleton as
    its listing, and a plan for individual stops that sender). Other
    bundles: the source's pack route (``mpi_stager pack`` over ssh with
    ``--stream off`` or a launcher) writes a deterministic bundle, it comes
    back with its index in one transfer and is unpacked here, resumably;
    sources without remote execution (GridFTP, Globus) pack through
    ``options.pack_via``. A hybrid plan runs as a bundle. Otherwise the
    planner sees one remote listing; without a local sample it assumes the
    data compresses to half. A ``src_url`` naming a bundle with its
    ``.pidx`` beside it (a published bundle) is fetched and unpacked as
    it is: the inventory comes from its index, nothing is planned or
    packed. ``dest`` is locked for the whole pull. ``items`` (relative
    paths; see staging_core.selection) fetches only those, planned from
    ``sizes`` when given (else from the listing), and waits for the lock.
    """
    started = time.monotonic()
    _check_options(options)
    check_route_options(options, Direction.PULL)
    endpoint = parse_url(src_url)
    local = Endpoint("file", os.path.abspath(dest))
    whole, comparison = items is None, None
    if options.dry_run:
        return pull_dry_run(endpoint, local.path, options, started)
    with OpenSource(endpoint, options) as source, ExitStack() as stack:
        transport, options, route, early = source.transport, source.options, source.route, None
        if not isinstance(route, PublishedBundle):
            comparison = _pull_comparison(transport, endpoint, route, local.path, options.checksum) \
                if whole else None
            if comparison is not None:
                items, sizes = comparison.to_fetch, comparison.sizes
            early = _early_stream(transport, endpoint, route, options, items) if sizes is None else None
            if early is not None:
                sizes = stack.enter_context(early).file_sizes()
        inventory, chosen = plan_pull(source, local.path, items, sizes)
        strategy = _strategy(chosen, options, route, endpoint)
        strategy = "bundle" if strategy == "hybrid" else strategy
        if early is not None and strategy != "bundle":
            early.close()                           # the plan is individual: that sender stops now
        _prepare_local_dest(dest)
        with DestinationLock(local, open_transport(local), wait=not whole):
            if comparison is not None and not comparison.to_fetch:
                run, attempts = _Run(route="already in place"), 0
            else:
                begun = [early] if early is not None and strategy == "bundle" else []
                run, attempts = _with_retries(
                    lambda: _pull_once(strategy, source, local.path, progress or NoProgress(), items,
                                       begun.pop() if begun else None),
                    options.retries)
            deleted = finish_local_pull(local.path, comparison, options.delete) if comparison else 0
            if whole:
                remove_state(local.path)
    return replace(_result(local.path, chosen, strategy, inventory, run, attempts, started),
                   in_place=comparison.in_place if comparison else 0, deleted=deleted)


def _pull_comparison(transport: Transport, endpoint: Endpoint, route, dest: str,
                     checksum: bool) -> PullComparison | None:
    """The local DEST compared with the source's listing, where a pull compares: ssh and local sources (their
    listings carry exact mtimes), not through the plain-tools route (which lists and hashes itself)."""
    if endpoint.scheme not in COMPARABLE_SCHEMES or isinstance(route, PlainRoute) or not os.path.isdir(dest):
        return None
    hashes = (lambda paths: dest_md5(transport, endpoint, paths)) if checksum else None
    return compare_with_local(transport.list(endpoint.path), dest, hashes)


def _clear_state(transport: Transport, endpoint: Endpoint, route: UnpackRoute | None,
                 session: FarSession | None = None) -> None:
    """After a whole-tree push: remove DEST/.pallet, with any state older runs left (the lock is still held)."""
    state = posixpath.join(endpoint.path, STATE_DIR)
    if session is not None:
        session.clear()
    elif endpoint.is_local:
        remove_state(endpoint.path)
    elif transport.capabilities.remote_exec:
        transport.run(["rm", "-rf", "--", state])
    elif route is not None:
        route.run_there(["rm", "-rf", "--", state])


def _check_options(options: StagingOptions) -> None:
    if options.strategy not in STRATEGIES:
        raise UsageError(f"unknown strategy {options.strategy!r}", hint=f"use one of {', '.join(STRATEGIES)}")
    if options.stream not in STREAM_MODES:
        raise UsageError(f"unknown stream mode {options.stream!r}", hint=f"use one of {', '.join(STREAM_MODES)}")
    if options.ranks < 0 or options.retries < 0:
        raise UsageError("--ranks and --retries must not be negative")


def _strategy(chosen: Plan, options: StagingOptions, route, endpoint: Endpoint) -> str:
    if options.strategy == "auto":
        return chosen.strategy
    if options.strategy != "individual" and route is None:
        raise UsageError(f"--strategy {options.strategy} needs a way to run pallet at {endpoint.url()}",
                         hint="add --unpack-via ssh://HOST (a host that mounts that file system), "
                              "--keep-packed, or use --strategy individual")
    return options.strategy


def _prepare_local_dest(dest: str) -> None:
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise PalletError("destination exists and is not a directory", dest, "choose another destination")
    os.makedirs(dest, exist_ok=True)


def _with_retries(attempt, retries: int) -> tuple[_Run, int]:
    """Run ``attempt`` until it succeeds, retrying only retryable TransportErrors, with 1, 2, 4 ... s pauses."""
    for number in range(retries + 1):
        try:
            return attempt(), number + 1
        except TransportError as exc:
            if not exc.retryable or number == retries:
                raise
            time.sleep(min(30, 2 ** number))
    raise AssertionError("unreachable")


def _result(dest: str, chosen: Plan, strategy: str, inventory: Inventory, run: _Run, attempts: int,
            started: float) -> StagingResult:
    return StagingResult(dest, chosen, strategy, run.route, len(inventory.sizes), inventory.stats.bytes,
                         run.transfers, time.monotonic() - started, run.stage_seconds, run.skipped_shards, attempts,
                         run.bytes_sent)


class _Stage:
    """Time one stage and show it on ``progress``."""

    def __init__(self, run: _Run, progress: Progress, name: str, files: int = 0, nbytes: int = 0):
        self.run, self.progress, self.name, self.files, self.nbytes = run, progress, name, files, nbytes

    def __enter__(self):
        self.started = time.monotonic()
        self.progress.start(self.name, self.files, self.nbytes)
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None and self.files:
            self.progress.advance(self.files, self.nbytes)
        self.progress.finish()
        self.run.stage_seconds[self.name] = self.run.stage_seconds.get(self.name, 0.0) + time.monotonic() - self.started


# ---------------------------------------------------------------- push strategies

def _push_once(ctx: PushContext, strategy: str) -> _Run:
    run, transport, route, options, progress = _Run(), ctx.transport, ctx.route, ctx.options, ctx.progress
    codec = options.codec or ctx.chosen.chosen.codec or "zstd"
    if strategy == "individual":
        run.route = "individual"
        listed = None if ctx.include is None else [os.fsdecode(p) for p in ctx.paths]
        if listed is None and transport.scheme == "file":        # the scan's names: no second walk of SRC
            listed = [os.fsdecode(p) for p in ctx.tree.index.paths]
        with _Stage(run, progress, "transfer", len(ctx.inventory.sizes), ctx.inventory.stats.bytes):
            run.count(_send_items(transport, ctx.src, ctx.endpoint, listed))
    elif isinstance(route, PlainRoute):
        outcome = push_plain(transport, ctx.tree, ctx.endpoint, route, options.jobs, progress,
                             clear_state=ctx.include is None and not options.keep_packed)
        run.route, run.transfers, run.bytes_sent = route.description, outcome.rounds, outcome.bytes_sent
        run.stage_seconds.update(outcome.stage_seconds)
    elif strategy == "hybrid":
        _push_hybrid(ctx, codec, run)
    elif _can_stream(transport, route, options):
        run.streamed(stream_push(transport, ctx.src, ctx.endpoint, codec, options, progress, ctx.tree, ctx.receiver))
    else:
        _push_bundle(ctx, codec, frozenset(), run)
    return run


def _can_stream(transport: Transport, route: UnpackRoute, options: StagingOptions) -> bool:
    return _streams(transport.capabilities.streaming and route.streams, options,
                    f"{transport.scheme} to this destination cannot stream",
                    "; streaming needs an ssh destination with pallet and no --launcher")


def _can_stream_pull(route: PackRoute, options: StagingOptions) -> bool:
    return _streams(route.streams, options, f"this source cannot stream ({route.description})",
                    "; streaming needs an ssh source with pallet and no --launcher")


def _streams(capable: bool, options: StagingOptions, why_not: str, needs: str = "") -> bool:
    """Whether ``options.stream`` (auto, on, off) streams where ``capable`` says it can; UsageError for 'on'
    where it cannot."""
    if options.stream == "on" and not capable:
        raise UsageError(f"--stream on: {why_not}", hint=f"use --stream auto or off{needs}")
    return capable and options.stream != "off"


def _send_items(transport: Transport, src: str, endpoint: Endpoint, items: list[str] | None) -> TransferResult:
    return _transfer_all(transport, Direction.PUSH, src, endpoint, items)


def _transfer_all(transport: Transport, direction: Direction, local: str, endpoint: Endpoint,
                  items: list[str] | None) -> TransferResult:
    """One batch transfer; raise a TransportError naming the files, and the first one's error, if any failed."""
    result = transport.transfer(direction, local, endpoint.path, items)
    if not result.ok:
        first = sorted(result.failed)[0]
        names = ", ".join(sorted(result.failed)[:10])
        rest = "send" if direction is Direction.PUSH else "fetch"
        raise TransportError(f"{len(result.failed)} file(s) failed: {names} (first: {first}: "
                             f"{_one_line(result.failed[first])})", endpoint.url(),
                             f"fix that cause; a rerun then {rest}s the rest", retryable=False)
    return result


def _one_line(error: BaseException) -> str:
    """An error's message without its path and hint (those are the transfer's own), with the last line of what
    the tool said when there is one (``copy failed (Input/output error)``)."""
    message = getattr(error, "message", None) or str(error).splitlines()[0]
    said = getattr(error, "stderr", "").strip().splitlines()
    return f"{message} ({said[-1][:200]})" if said and said[-1] not in message else message


def _push_bundle(ctx: PushContext, codec: str, exclude: frozenset[bytes], run: _Run) -> None:
    """Store and forward: pack here (``ctx.include`` of the tree, without ``exclude``), one transfer of bundle +
    index into the route's incoming, unpack there."""
    transport, endpoint, route, options, include = ctx.transport, ctx.endpoint, ctx.route, ctx.options, ctx.include
    staging = scratch_dir("pallet-push-")
    try:
        bundle = os.path.join(staging, bundle_name(codec))
        with _Stage(run, NoProgress(), "pack"):          # pack draws its own bar
            pack(ctx.src, bundle, PackOptions(codec=codec, shard_size=options.shard_size, jobs=options.jobs,
                                              exclude=exclude, include=include), ctx.progress)
        if endpoint.is_local:
            ensure_state_dir(endpoint.path)     # never follow a link planted at DEST/.pallet
        transport.mkdir(route.incoming)
        names = [os.path.basename(bundle), os.path.basename(bundle) + ".pidx", *route.extra_files(bundle)]
        with _Stage(run, ctx.progress, "transfer", 0, os.path.getsize(bundle)):
            sent = transport.transfer(Direction.PUSH, staging, route.incoming, names)
        if not sent.ok:
            raise next(iter(sent.failed.values()))
        run.count(sent)
        with _Stage(run, ctx.progress, "unpack"):
            run.skipped_shards += route.unpack(os.path.join(route.incoming, names[0]), keep_journal=include is None)
        run.route = route.description
        if include is not None:     # a selection; a whole-tree push clears all of DEST/.pallet at the end
            route.discard([os.path.join(route.incoming, n) for n in names])
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _push_hybrid(ctx: PushContext, codec: str, run: _Run) -> None:
    """Large files go individually while the rest is packed; the bundle is unpacked last (it sets directory times).
    Only for a whole tree (``ctx.include`` None): a narrowed one goes as a bundle."""
    large = [p for p, size in zip(ctx.paths, ctx.inventory.sizes) if size >= ctx.options.large_file_bytes]
    with ThreadPoolExecutor(1) as pool:
        sending = pool.submit(_send_items, ctx.transport, ctx.src, ctx.endpoint, [os.fsdecode(p) for p in large])
        _push_bundle(ctx, codec, frozenset(large), run)
        run.count(sending.result())
    run.route = f"hybrid: {len(large)} large file(s) individually, the rest {ctx.route.description}"


# ---------------------------------------------------------------- pull strategies

def _early_stream(transport: Transport, endpoint: Endpoint, route, options: StagingOptions,
                  items: Sequence[str] | None) -> PullStream | None:
    """A pull that would stream a bundle starts the stream before planning, and plans from its skeleton (the
    far side's own walk) instead of a listing of its own; None when it would not stream."""
    if options.strategy == "individual" or not isinstance(route, PackRoute) or not _can_stream_pull(route, options):
        return None
    return PullStream(route.transport, endpoint, options.codec or "zstd", options, items)


def _pull_once(strategy, source: OpenSource, dest: str, progress, items: Sequence[str] | None,
               begun: PullStream | None = None) -> _Run:
    run, transport, endpoint, route, options = _Run(), source.transport, source.endpoint, source.route, source.options
    if strategy == "individual":
        run.route = "individual"
        with _Stage(run, progress, "transfer"):
            result = _transfer_all(transport, Direction.PULL, dest, endpoint, None if items is None else list(items))
        run.count(result)
        return run
    if isinstance(route, PlainRoute):
        with _Stage(run, NoProgress(), "transfer"):
            outcome = pull_plain(transport, endpoint, route, dest, options.jobs, progress, items)
        run.route, run.transfers, run.bytes_sent = route.description, outcome.rounds, outcome.bytes_sent
        return run
    if begun is not None or _can_stream_pull(route, options):
        run.streamed(begun.receive_into(dest, progress) if begun is not None
                      else stream_pull(route.transport, endpoint, dest, options.codec or "zstd", options, progress,
                                       items))
        return run
    ensure_state_dir(dest)
    staging = os.path.join(dest, INCOMING)
    os.makedirs(staging, exist_ok=True)
    with _Stage(run, progress, "pack and transfer"):
        moved = move_packed(source, staging, items)
    run.count(moved.transfer)
    with _Stage(run, progress, "unpack"):
        summary = unpack_parallel(SerialComm(), moved.path, dest,
                                  StagerOptions(options.verify, None, max(1, options.jobs or os.cpu_count() or 1),
                                                lock_held=True))
    run.skipped_shards = summary.shards_skipped
    for leftover in (moved.path, moved.path + ".pidx"):
        os.unlink(leftover)
    prune(dest, staging)
    run.route = route.description
    return run
