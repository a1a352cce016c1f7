"""push and pull: plan, lock, retry, then run the strategy through the transport and the routes — policy in one place."""
from __future__ import annotations

import os
import posixpath
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import replace
from typing import Callable, Sequence

from bundles.errors import PalletError, SourceError, UsageError
from bundles.progress import NoProgress, Progress
from bundles.scan import SourceTree, scan
from bundles.state import STATE_DIR, remove_state

from .dry_run import pull_dry_run, push_dry_run
from .far_session import FarSession, destination_lock
from .inventory import Inventory, compress_ratio, tree_inventory
from .local_profile import observe, route_profile, uses_local_copy
from .locking import DestinationLock
from .options import STRATEGIES, STREAM_MODES, StagingOptions, StagingResult
from .pack_routes import PublishedBundle
from .plain import PlainRoute
from .planner import Plan, plan
from .probe import far_side_options
from .pull_phases import OpenSource, plan_pull
from .pull_strategies import PullContext, early_stream, pull_strategy
from .push_strategies import PushContext, push_strategy
from .repair import (COMPARABLE_SCHEMES, Comparison, PullComparison, compare_with_dest, compare_with_dest_entries,
                     compare_with_local, delete_extra, dest_md5, dirs_to_restore, finish_local_pull, fix_directories)
from .route_registry import check_route_options
from .routes import UnpackRoute, closing, unpack_route
from .strategy_base import Attempt
from .streaming import PullStream
from .transports.base import Direction, Endpoint, Transport, parse_url
from .transports.errors import TransportError
from .transports.registry import open_endpoint, open_transport


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
        run, attempts, inventory = Attempt(route="already in place"), 0, Inventory(src, [], options.large_file_bytes)
    else:
        if comparison is not None:
            delete_extra(transport, endpoint, comparison.stale)
        receiver = (lambda: session.receiver(options.verify)) if session is not None else None
        context = PushContext(transport, endpoint, route, tree, chosen, inventory, paths, options,
                              progress or NoProgress(), include, receiver)
        way = push_strategy(context, strategy)
        run, attempts = _with_retries(lambda: way.run(context), options.retries)
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
            early = early_stream(transport, endpoint, route, options, items) if sizes is None else None
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
                run, attempts = Attempt(route="already in place"), 0
            else:
                context = PullContext(source, local.path, progress or NoProgress(), items)
                run, attempts = _with_retries(_pull_attempts(context, early if strategy == "bundle" else None,
                                                             strategy), options.retries)
            deleted = finish_local_pull(local.path, comparison, options.delete) if comparison else 0
            if whole:
                remove_state(local.path)
    return replace(_result(local.path, chosen, strategy, inventory, run, attempts, started),
                   in_place=comparison.in_place if comparison else 0, deleted=deleted)


def _pull_attempts(context: PullContext, begun: PullStream | None, planned: str) -> Callable[[], Attempt]:
    """One attempt of the pull's strategy per call: the first one receives the stream ``begun`` before planning
    (if any), later ones start their own."""
    waiting = [begun] if begun is not None else []

    def attempt() -> Attempt:
        ctx = replace(context, begun=waiting.pop() if waiting else None)
        return pull_strategy(ctx, planned).run(ctx)
    return attempt


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


def _with_retries(attempt, retries: int) -> tuple[Attempt, int]:
    """Run ``attempt`` until it succeeds, retrying only retryable TransportErrors, with 1, 2, 4 ... s pauses."""
    for number in range(retries + 1):
        try:
            return attempt(), number + 1
        except TransportError as exc:
            if not exc.retryable or number == retries:
                raise
            time.sleep(min(30, 2 ** number))
    raise AssertionError("unreachable")


def _result(dest: str, chosen: Plan, strategy: str, inventory: Inventory, run: Attempt, attempts: int,
            started: float) -> StagingResult:
    return StagingResult(dest, chosen, strategy, run.route, len(inventory.sizes), inventory.stats.bytes,
                         run.transfers, time.monotonic() - started, run.stage_seconds, run.skipped_shards, attempts,
                         run.bytes_sent)
