"""A push's phases as public steps — open and lock the destination, compare and plan, finish — that push() composes."""
from __future__ import annotations

import os
import posixpath
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace

from bundles.scan import SourceTree, scan
from bundles.state import STATE_DIR, remove_state
from mpi_stager.send import StreamSource, prepare_source

from staging_core.far_side.probe import far_side_options
from staging_core.far_side.session import FarSession, destination_lock
from staging_core.operations.individual import uncarried_link
from staging_core.locking import DestinationLock
from staging_core.operations.push_strategies import can_stream, stream_codec
from staging_core.operations.repair import (Comparison, compare_with_dest, compare_with_dest_entries, delete_extra,
                                            dirs_to_restore,
                     fix_directories, listed_extra, stamp_top)
from staging_core.operations.strategy_base import resolve_strategy
from staging_core.options import StagingOptions
from staging_core.planning.inventory import Inventory, compress_ratio, tree_inventory
from staging_core.planning.local_profile import route_profile
from staging_core.planning.planner import Plan, plan
from staging_core.routes.base import HYBRID, INDIVIDUAL, Route, carries, route_streams
from staging_core.routes.tar_tools import session_lock
from staging_core.routes.unpack import closing, unpack_route
from staging_core.transports.base import EarlyConnection, Endpoint, Transport, parse_url
from staging_core.transports.registry import open_endpoint


class OpenDestination:
    """A push destination opened and locked: its transport, the options as the probe left them (``far``: what
    the probe found), the route that unpacks bundles there (None: files only go individually) and the lock,
    which is a far-side session (``session``) when the push may stream over ssh, else a DestinationLock.
    ``wait``: wait for another run's lock instead of failing; ``listing``: the session sends DEST's listing.

    ``walked`` (the whole source, scanned and surveyed; it may wait for the
    walk) lets a listing session offer the stream of the whole tree before
    DEST is listed, when the plan for an empty DEST streams it; if DEST was
    empty the session takes it, and :attr:`taken_plan` is that plan.

    ``early_connection``: a connection to DEST's host already started (``Transport.connect_early``), which its
    transport takes over.

    Use it as a context manager; it releases the lock, then closes the route and the transport.
    """

    def __init__(self, dest_url: str | Endpoint, options: StagingOptions, wait: bool = False, listing: bool = True,
                 walked: Callable[[], tuple[SourceTree, SourceSurvey]] | None = None,
                 early_connection: EarlyConnection | None = None):
        self.endpoint = dest_url if isinstance(dest_url, Endpoint) else parse_url(dest_url)
        self._stack = ExitStack()
        self.offered: PushPlan | None = None
        try:
            self.transport: Transport = self._stack.enter_context(open_endpoint(self.endpoint, options,
                                                                                 early_connection))
            self.options, self.far = far_side_options(self.transport, self.endpoint, options)
            self.route: Route | None = self._stack.enter_context(
                closing(unpack_route(self.endpoint, self.transport, self.options, self.far)))
            offer = (lambda: self._stream_offer(*walked())) if walked is not None else None
            own = session_lock(self.route, self.endpoint, self.transport, wait)     # the tar tools lock in a session
            self.lock: DestinationLock | FarSession = self._stack.enter_context(
                own if own is not None else destination_lock(self.endpoint, self.transport, self.options,
                                                             self.streams, wait=wait, listing=listing, offer=offer))
        except BaseException:
            self._stack.close()
            raise

    @property
    def taken_plan(self) -> PushPlan | None:
        """The plan whose stream the session offered and the far side took (DEST was empty), else None."""
        return self.offered if self.session is not None and self.session.offer_taken else None

    def _stream_offer(self, tree: SourceTree, surveyed: SourceSurvey) -> StreamSource | None:
        """The stream a push of the whole ``tree`` sends into an empty DEST, when its plan there streams it."""
        planned = plan_tree(self, tree, None, surveyed)
        if planned.strategy != "bundle" or not can_stream(self.transport, self.route, self.options):
            return None
        self.offered = planned
        return prepare_source(os.fsdecode(tree.root), stream_codec(self.options, planned.chosen), self.options.jobs,
                              self.options.shard_size, tree)

    @property
    def streams(self) -> bool:
        """Whether bundles may stream into the route there (so one far-side session may serve the push)."""
        return route_streams(self.route) and self.transport.capabilities.streaming and self.options.stream != "off"

    @property
    def session(self) -> FarSession | None:
        return self.lock if isinstance(self.lock, FarSession) else None

    def __enter__(self) -> OpenDestination:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)      # the lock and route learn of an error on its way (theirs is only an echo)


@dataclass(frozen=True)
class PushPlan:
    """What a push will send: the ``tree`` (narrowed to what differs from DEST), ``include`` (None: all of it),
    its inventory and paths, the planner's choice, the strategy to run, and the comparison with DEST (None:
    not compared)."""

    tree: SourceTree
    include: frozenset[bytes] | None
    inventory: Inventory
    paths: list[bytes]
    chosen: Plan
    strategy: str
    comparison: Comparison | None = None

    @property
    def nothing_to_send(self) -> bool:
        return self.comparison is not None and self.comparison.nothing_to_send


def compare_destination(dest: OpenDestination, tree: SourceTree) -> Comparison | None:
    """DEST compared with the whole source, where a push compares (not into a route that compares DEST itself,
    the tar tools, nor for --keep-packed), from the session's listing when there is one."""
    if dest.options.keep_packed or _compares_itself(dest.route):
        return None
    if dest.session is not None:
        return compare_with_dest_entries(dest.session.entries(), dest.transport, dest.endpoint, tree,
                                         dest.options.checksum)
    return compare_with_dest(dest.transport, dest.endpoint, tree, dest.options.checksum)


@dataclass(frozen=True)
class SourceSurvey:
    """What the planner needs of a scanned tree: its inventory, its files' paths and their compression ratio."""

    inventory: Inventory
    paths: list[bytes]
    ratio: float


def survey(tree: SourceTree, large_file_bytes: int) -> SourceSurvey:
    """Survey a scanned tree for the planner (it reads a sample of the files to measure their ratio)."""
    inventory, paths = tree_inventory(tree, large_file_bytes)
    return SourceSurvey(inventory, paths, compress_ratio(os.fsdecode(tree.root), paths))


def scan_and_survey(src: str, include: frozenset[bytes] | None, large_file_bytes: int
                    ) -> tuple[SourceTree, SourceSurvey]:
    """Scan ``src`` (only ``include`` of it, when given) and survey it: what a push does while ssh connects."""
    tree = scan(src, "none", 0, include=include)
    return tree, survey(tree, large_file_bytes)


def plan_push(dest: OpenDestination, tree: SourceTree, include: frozenset[bytes] | None = None,
              surveyed: SourceSurvey | None = None) -> PushPlan:
    """Compare a whole tree (``include`` None) with DEST and narrow it to what differs, then plan what is left:
    the inventory, the planner's choice from the route's profile, and the strategy (a hybrid plan of a
    selection or through a route that does not carry ``hybrid`` runs as a bundle). ``surveyed``: the tree's
    survey, made already (used unless the comparison narrows the tree). Raises UsageError for a strategy the
    destination cannot honour."""
    src, options = os.fsdecode(tree.root), dest.options
    comparison = compare_destination(dest, tree) if include is None else None
    if comparison is not None and not comparison.nothing_to_send:
        include = frozenset(comparison.to_send)
        tree, surveyed = scan_and_survey(src, include, options.large_file_bytes)
    planned = plan_tree(dest, tree, include, surveyed, comparison)
    if planned.strategy == "individual" and include is None and comparison is None \
            and _compares_itself(dest.route) and not options.keep_packed:
        return _narrowed(dest, planned)     # files one by one: not the far side's tools but this push compares
    return planned


def _narrowed(dest: OpenDestination, planned: PushPlan) -> PushPlan:
    """``planned`` (individual, of the whole tree) narrowed to what differs from DEST, as a compared push is."""
    comparison = compare_with_dest(dest.transport, dest.endpoint, planned.tree, dest.options.checksum)
    if comparison is None or comparison.nothing_to_send:
        return replace(planned, comparison=comparison)
    include = frozenset(comparison.to_send)
    tree, surveyed = scan_and_survey(os.fsdecode(planned.tree.root), include, dest.options.large_file_bytes)
    return replace(planned, tree=tree, include=include, inventory=surveyed.inventory, paths=surveyed.paths,
                   comparison=comparison)


def plan_tree(dest: OpenDestination, tree: SourceTree, include: frozenset[bytes] | None,
              surveyed: SourceSurvey | None, comparison: Comparison | None = None) -> PushPlan:
    """The plan for sending ``tree`` (``include`` of it) to ``dest``, from its survey (made here if None)."""
    options = dest.options
    surveyed = surveyed or survey(tree, options.large_file_bytes)
    inventory, paths = surveyed.inventory, surveyed.paths
    profile, bundle_possible = route_profile(dest.endpoint, options, dest.route is not None)
    chosen = plan(inventory.stats, profile, surveyed.ratio, max(1, options.ranks), bundle_possible)
    strategy = resolve_strategy(chosen, options, dest.route, dest.endpoint)
    if strategy == "individual" and options.strategy == "auto" and dest.route is not None \
            and uncarried_link(tree, dest.transport) is not None:
        strategy = "bundle"                 # one by one, the transport would leave the links out
    if strategy == HYBRID and (include is not None or not carries(dest.route, HYBRID)):
        strategy = "bundle"
    return PushPlan(tree, include, inventory, paths, chosen, strategy, comparison)


def _compares_itself(route: Route | None) -> bool:
    return route is not None and route.compares_dest_itself


def finish_push(dest: OpenDestination, full: SourceTree, comparison: Comparison | None, whole: bool,
                strategy: str = "bundle") -> int:
    """After the strategy (``strategy``: the one that ran): with ``--delete`` remove DEST entries the source
    lacks, give directories their source times again, and clear DEST/.pallet after a whole-tree push (the lock
    is still held; a bundle through a route that ``clears_state_itself``, the tar tools, has cleared it);
    return the entries deleted."""
    deleted = 0
    if whole and dest.options.delete:
        comparison = comparison or compare_with_dest(dest.transport, dest.endpoint, full, own_mark=True) \
            or Comparison(extra=listed_extra(dest.transport, dest.endpoint, set(full.index.paths)))
        run_there = dest.route.run_there if dest.route is not None else None
        delete_extra(dest.transport, dest.endpoint, comparison.extra, run_there, dest.options.allow_root_dest)
        deleted = len(comparison.extra)
    if comparison is not None:
        fix_directories(dest.session or dest.transport, dest.endpoint, full,
                        dirs_to_restore(full, comparison, whole and dest.options.delete))
    cleared = dest.route is not None and dest.route.clears_state_itself and strategy != INDIVIDUAL
    if whole and not dest.options.keep_packed and not cleared:
        clear_state(dest)
    stamped = cleared and not dest.options.delete       # the tar tools' session gave DEST its time as it finished
    if whole and not dest.options.keep_packed and dest.session is None and not stamped:
        stamp_top(dest.transport, dest.endpoint, os.stat(full.root).st_mtime_ns)
    return deleted


def clear_state(dest: OpenDestination) -> None:
    """Remove DEST/.pallet, with any state older runs left."""
    state = posixpath.join(dest.endpoint.path, STATE_DIR)
    if dest.session is not None:
        dest.session.clear()
    elif dest.endpoint.is_local:
        remove_state(dest.endpoint.path)
    elif dest.transport.capabilities.remote_exec:
        dest.transport.run(["rm", "-rf", "--", state])
    elif dest.route is not None:
        dest.route.run_there(["rm", "-rf", "--", state])
