"""push and pull: plan, lock, retry, then run the strategy through the transport and the routes.

Policy in one place, read from what the transports and routes declare.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from bundles.errors import SourceError, UsageError
from bundles.progress import NoProgress, Progress
from bundles.scan import scan
from bundles.state import remove_state

from staging_core.locking import DestinationLock
from staging_core.operations.repair import (PullComparison, compare_with_local, delete_extra, dest_md5, extra_entries,
                                            finish_local_pull, stamp_top)
from staging_core.operations.strategy_base import Attempt, check_stream_shard_size, resolve_strategy
from staging_core.options import STRATEGIES, STREAM_MODES, StagingOptions
from staging_core.results import StagingResult
from staging_core.planning.inventory import Inventory
from staging_core.planning.local_profile import copies_locally, observe
from staging_core.planning.planner import Plan
from staging_core.routes.base import Route
from staging_core.routes.registry import check_route_options
from staging_core.transports.base import (Direction, EarlyConnection, Endpoint, RemoteEntry, Transport,
                                         check_destination, parse_url)
from staging_core.transports.errors import TransportError
from staging_core.transports.registry import open_transport

# Each direction's own phases and strategies are loaded by its function, so that a push does not load the pull's
# (nor a pull the push's) while its far side starts.
if TYPE_CHECKING:
    from bundles.scan import SourceTree
    from staging_core.far_side.streaming import PullStream
    from staging_core.operations.pull_strategies import PullContext
    from staging_core.operations.push_phases import OpenDestination, PushPlan, SourceSurvey


_DEFAULTS = StagingOptions()


def push(src: str, dest_url: str, options: StagingOptions = _DEFAULTS,
         progress: Progress | None = None, items: Sequence[str] | None = None,
         early_connection: EarlyConnection | None = None) -> StagingResult:
    """Move the tree under local ``src`` to ``dest_url`` and return what was done.

    The planner picks individual, bundle or hybrid unless
    ``options.strategy`` says; bundles stream into the far-side unpacker
    when the transport can (ssh), else they are packed, sent with their
    index in one transfer and unpacked by the destination's route. The
    destination is locked for the whole push; errors marked retryable are
    retried ``options.retries`` times, each attempt resuming (rsync skips
    files already there, the unpack journal skips finished shards). The
    source is only read. ``items`` (relative paths; see
    staging_core.operations.selection) sends only those files and their parent
    directories, stored and forwarded when bundled, and waits for the
    destination's lock instead of failing. ``early_connection``: one to
    DEST's host already started (``Transport.connect_early``; the CLI
    starts it while the rest of pallet loads), which the transport takes
    over; the caller closes it after. Raises UsageError for options the
    destination cannot honour, DestinationLocked, TransportError or
    PalletError naming the cause.
    """
    started = time.monotonic()
    _check_options(options)
    check_route_options(options, Direction.PUSH)
    src = os.path.abspath(src)          # relative to the caller's working directory, as a command line means it
    if not os.path.isdir(src):
        raise SourceError("is not a directory" if os.path.exists(src) else "does not exist", src,
                          "push a directory: pallet push DIR URL")
    endpoint = parse_url(dest_url)
    if items is None:
        check_destination(endpoint, options.allow_root_dest)
    include = None if items is None else frozenset(os.fsencode(i) for i in items)
    from staging_core.operations.push_phases import OpenDestination, scan_and_survey
    if options.dry_run:
        from staging_core.operations.dry_run import push_dry_run
        return push_dry_run(scan(src, "none", 0, include=include), endpoint, options, started)
    walker = ThreadPoolExecutor(1, thread_name_prefix="pallet-walk")     # while ssh connects and locks
    walking, interrupted = walker.submit(scan_and_survey, src, include, options.large_file_bytes), False
    try:
        with OpenDestination(endpoint, options, wait=items is not None, listing=include is None,
                             walked=walking.result if include is None else None,
                             early_connection=early_connection) as dest:
            return _push_locked(*walking.result(), dest, progress, include, started)
    except KeyboardInterrupt:               # SIGINT, SIGTERM: a walk still going is not waited for
        interrupted = True
        raise
    finally:
        walking.cancel()
        walker.shutdown(wait=not interrupted)


def _push_locked(full: SourceTree, surveyed: SourceSurvey, dest: OpenDestination, progress: Progress | None,
                 include: frozenset[bytes] | None, started: float) -> StagingResult:
    """push, once DEST is open and locked: compare and plan (:func:`plan_push`), run the strategy with retries,
    then finish (:func:`finish_push`: deletions, directory times, DEST/.pallet cleared)."""
    from staging_core.operations.push_phases import finish_push, plan_push
    from staging_core.operations.push_strategies import PushContext, push_strategy
    transport, endpoint, options, whole = dest.transport, dest.endpoint, dest.options, include is None
    planned = dest.taken_plan or plan_push(dest, full, include, surveyed)
    inventory, comparison = planned.inventory, planned.comparison
    if not dest.lock.supported:
        transport.mkdir(endpoint.path)      # the lock made DEST otherwise
    if planned.nothing_to_send:
        run, attempts = Attempt(route="already in place"), 0
        inventory = Inventory(os.fsdecode(full.root), [], options.large_file_bytes)
    else:
        if comparison is not None:
            delete_extra(transport, endpoint, comparison.stale, broad_ok=options.allow_root_dest)
        session = dest.session
        receiver = (lambda: session.receiver(options.verify)) if session is not None else None
        if session is not None and _stream_is_last(planned, options, whole):
            session.end_with_stream()
        context = PushContext(transport, endpoint, dest.route, planned.tree, planned.chosen, inventory,
                              planned.paths, options, progress or NoProgress(), planned.include, receiver,
                              selection=not whole)
        way = push_strategy(context, planned.strategy)
        run, attempts = _with_retries(lambda: way.run(context), options.retries)
    deleted = finish_push(dest, full, comparison, whole, planned.strategy)
    declined = dest.session.declined_bytes if dest.session is not None else 0
    result = replace(_result(endpoint.url(), planned.chosen, planned.strategy, inventory, run, attempts, started,
                             comparison.in_place if comparison else 0), deleted=deleted, offered_bytes=declined)
    if planned.strategy == "individual" and not result.in_place and copies_locally(transport.capabilities,
                                                                                     options.profile):
        observe(endpoint.path, result.files, result.file_bytes, result.seconds)
    return result


def _stream_is_last(planned: PushPlan, options: StagingOptions, whole: bool) -> bool:
    """Whether a streamed bundle is all a push asks of its far-side session but clearing DEST/.pallet: a whole
    tree (its directories' times come with it, nothing to restore after a comparison), without --delete (whose
    deletions follow the stream) or --keep-packed. (A bundle that does not stream never ends the session.)"""
    return whole and planned.strategy == "bundle" and planned.comparison is None and not options.delete \
        and not options.keep_packed


def pull(src_url: str, dest: str, options: StagingOptions = _DEFAULTS,
         progress: Progress | None = None, items: Sequence[str] | None = None,
         sizes: Sequence[int] | None = None, early_connection: EarlyConnection | None = None) -> StagingResult:
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
    paths; see staging_core.operations.selection) fetches only those, planned from
    ``sizes`` when given (else from the listing), and waits for the lock.
    ``early_connection``: as for :func:`push`, one to the source's host.
    """
    started = time.monotonic()
    _check_options(options)
    check_route_options(options, Direction.PULL)
    endpoint = parse_url(src_url)
    local = Endpoint("file", os.path.abspath(dest))
    whole, comparison = items is None, None
    if whole:
        check_destination(local, options.allow_root_dest)
    if options.dry_run:
        from staging_core.operations.dry_run import pull_dry_run
        return pull_dry_run(endpoint, local.path, options, started)
    from bundles.extract import prepare_destination
    from staging_core.operations.pull_phases import OpenSource, plan_pull
    from staging_core.operations.pull_strategies import PullContext, early_stream
    from staging_core.routes.pack import bundle_source
    with OpenSource(endpoint, options, early_connection) as source, ExitStack() as stack:
        transport, options, route, early = source.transport, source.options, source.route, None
        if bundle_source(route) is None:           # a published bundle: nothing to compare, list or stream
            comparison = _pull_comparison(transport, endpoint, route, local.path, options.checksum) \
                if whole else None
            if comparison is not None:
                items, sizes = comparison.to_fetch, comparison.sizes
            early = early_stream(transport, endpoint, route, options, items) if sizes is None else None
            if early is not None:
                sizes = stack.enter_context(early).file_sizes()
        root = _SourceRoot(transport, endpoint) if whole and bundle_source(route) is None else None
        inventory, chosen = plan_pull(source, local.path, items, sizes)
        strategy = resolve_strategy(chosen, options, route, endpoint)
        strategy = "bundle" if strategy == "hybrid" else strategy
        if strategy == "individual" and whole and comparison is None and _compares_itself(route):
            comparison = _pull_comparison(transport, endpoint, None, local.path, options.checksum)  # not the tools'
            if comparison is not None:
                items = comparison.to_fetch
                inventory = Inventory(endpoint.path, list(comparison.sizes), options.large_file_bytes)
        if early is not None and strategy != "bundle":
            early.close()                           # the plan is individual: that sender stops now
        prepare_destination(local.path)     # DestinationError naming it when it cannot be made or written
        with DestinationLock(local, open_transport(local), wait=not whole):
            if comparison is not None and not comparison.to_fetch:
                run, attempts = Attempt(route="already in place"), 0
            else:
                context = PullContext(source, local.path, progress or NoProgress(), items, whole=whole)
                run, attempts = _with_retries(_pull_attempts(context, early if strategy == "bundle" else None,
                                                             strategy), options.retries)
            if comparison is None and whole and options.delete:        # a route that listed DEST itself
                comparison = _listed_comparison(transport, endpoint, route, local.path)
            deleted = finish_local_pull(local.path, comparison, options.delete) if comparison else 0
            if whole:
                remove_state(local.path)
                _stamp_from_source(transport, root, local)
    return replace(_result(local.path, chosen, strategy, inventory, run, attempts, started,
                           comparison.in_place if comparison else 0), deleted=deleted)


class _SourceRoot:
    """A stat of a whole pull's source root, where it is exact (a transport that declares ``exact_listing``:
    local and ssh sources), made on a thread of its own once the pull is planned (a streamed pull's skeleton is
    in): over ssh it is one more far-side command, whose login and round trips then overlap the transfer
    instead of following it (and no longer compete with the sender's start). Made before the data arrives, it
    is the root as the sender walked it (tar keeps a directory's time as it finds it, too)."""

    def __init__(self, transport: Transport, endpoint: Endpoint):
        self._found: list[RemoteEntry | None] = []
        self._error: list[BaseException] = []
        self._thread: threading.Thread | None = None
        if transport.capabilities.exact_listing:
            self._thread = threading.Thread(target=self._stat, args=(transport, endpoint.path), daemon=True,
                                            name="pallet-source-root")
            self._thread.start()

    def _stat(self, transport: Transport, path: str) -> None:
        try:
            self._found.append(transport.stat(path))
        except BaseException as exc:        # raised by mtime_ns(), in the pull's own thread
            self._error.append(exc)

    def mtime_ns(self) -> int | None:
        """The root's mtime when it is a directory stated exactly; None otherwise. The stat's error, if any."""
        if self._thread is None:
            return None
        self._thread.join()
        if self._error:
            raise self._error[0]
        found = self._found[0] if self._found else None
        return found.mtime_ns if found is not None and found.kind == "d" else None


def _stamp_from_source(transport: Transport, root: _SourceRoot | None, local: Endpoint) -> None:
    """Give a whole pull's DEST the source root's mtime (``root``'s stat: not of a published bundle, a file)."""
    mtime_ns = root.mtime_ns() if root is not None else None
    if mtime_ns is not None:
        stamp_top(transport, local, mtime_ns)


def _pull_attempts(context: PullContext, begun: PullStream | None, planned: str) -> Callable[[], Attempt]:
    """One attempt of the pull's strategy per call: the first one receives the stream ``begun`` before planning
    (if any), later ones start their own."""
    from staging_core.operations.pull_strategies import pull_strategy
    waiting = [begun] if begun is not None else []

    def attempt() -> Attempt:
        ctx = replace(context, begun=waiting.pop() if waiting else None)
        return pull_strategy(ctx, planned).run(ctx)
    return attempt


def _compares_itself(route: Route | None) -> bool:
    return route is not None and route.compares_dest_itself


def _pull_comparison(transport: Transport, endpoint: Endpoint, route: Route | None, dest: str,
                     checksum: bool) -> PullComparison | None:
    """The local DEST compared with the source's listing, where a pull compares: sources whose transport
    declares ``exact_listing`` (local and ssh: their listings carry exact mtimes), not through a route that
    compares DEST itself (the tar tools, which list and hash themselves)."""
    if not transport.capabilities.exact_listing or _compares_itself(route) or not os.path.isdir(dest):
        return None
    hashes = (lambda paths: dest_md5(transport, endpoint, paths)) if checksum else None
    return compare_with_local(transport.list(endpoint.path), dest, hashes)


def _listed_comparison(transport: Transport, endpoint: Endpoint, route: Route | None,
                       dest: str) -> PullComparison | None:
    """After a whole pull whose route compared nothing, DEST against the source (DEST's marker is the pull's
    own): from the bundle's index for a published bundle, else from a listing where one carries exact times."""
    from staging_core.routes.pack import bundle_source
    published = bundle_source(route)
    if published is not None:
        return PullComparison(extra=extra_entries(dest, published.paths))
    listed = transport.list(endpoint.path)
    if transport.capabilities.exact_listing:
        return compare_with_local(listed, dest, own_mark=True)
    return PullComparison(extra=extra_entries(dest, {os.fsencode(entry.path) for entry in listed}))


def _check_options(options: StagingOptions) -> None:
    if options.strategy not in STRATEGIES:
        raise UsageError(f"unknown strategy {options.strategy!r}", hint=f"use one of {', '.join(STRATEGIES)}")
    if options.stream not in STREAM_MODES:
        raise UsageError(f"unknown stream mode {options.stream!r}", hint=f"use one of {', '.join(STREAM_MODES)}")
    if options.ranks < 0 or options.retries < 0:
        raise UsageError("--ranks and --retries must not be negative")
    check_stream_shard_size(options)


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
            started: float, in_place: int = 0) -> StagingResult:
    """The summary, counted by one rule on every route: ``files`` (``file_bytes``) the regular files sent, i.e.
    what the comparison with DEST left to send (``inventory``; all of them when DEST was not compared), or what
    a route that compares DEST itself found differing; ``in_place`` those found at DEST as they are."""
    files, file_bytes = len(inventory.sizes), inventory.stats.bytes
    if run.files_sent is not None:
        files, file_bytes, in_place = run.files_sent, run.file_bytes, run.in_place
    return StagingResult(dest, chosen, strategy, run.route, files, file_bytes, run.transfers,
                         time.monotonic() - started, run.stage_seconds, run.skipped_shards, attempts, run.bytes_sent,
                         in_place, shard_levels=run.shard_levels)
