"""The ways a push moves a tree, as strategies: individually, streamed, stored and forwarded, hybrid, tar tools."""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

from bundles.progress import NoProgress, Progress
from bundles.scan import SourceTree
from bundles.state import ensure_state_dir
from bundles.writer import PackOptions, pack

from staging_core.far_side.session import SessionStream
from staging_core.far_side.far_process import FarStager
from staging_core.far_side.streaming import stream_push
from staging_core.operations.individual import Marked, begin, check_carried, finish_selection, send_until_stable
from staging_core.operations.strategy_base import (Attempt, Stage, Strategy, register_strategy, select_strategy,
                                                   streams_where, transfer_all)
from staging_core.options import StagingOptions
from staging_core.planning.inventory import Inventory
from staging_core.planning.level import FittedLevel, planned_level
from staging_core.planning.planner import Plan
from staging_core.routes.base import (HYBRID, INDIVIDUAL, STORE_AND_FORWARD, STREAM, TAR_TOOLS, Route, carries,
                                      declaring, route_streams)
from staging_core.routes.tar_tools import TarToolsRoute
from staging_core.routes.tar_tools_push import push_tar_tools
from staging_core.routes.unpack import UnpackRoute, bundle_name, unpacker
from staging_core.scratch import scratch_dir
from staging_core.transports.base import Direction, Endpoint, Transport


@dataclass(frozen=True)
class PushContext:
    """What every attempt of one push works with: the transport to DEST and its route, the tree to send (only
    ``include`` of it when a selection or the comparison with DEST narrowed it), its inventory and paths, the
    plan, the options, progress, and the far-side session's ``receiver`` of streams when there is one."""

    transport: Transport
    endpoint: Endpoint
    route: Route | None
    tree: SourceTree
    chosen: Plan
    inventory: Inventory
    paths: list[bytes]
    options: StagingOptions
    progress: Progress
    include: frozenset[bytes] | None = None
    receiver: Callable[[], SessionStream] | None = None
    selection: bool = False     # only some files were asked for (their state is cleared here, not all of .pallet)

    @property
    def src(self) -> str:
        return os.fsdecode(self.tree.root)

    @property
    def codec(self) -> str:
        return stream_codec(self.options, self.chosen)

    @property
    def level(self) -> FittedLevel:
        """The level a streamed bundle starts at (and whether it is fitted as it runs)."""
        return planned_level(self.chosen.details, self.codec, self.options.level)


def stream_codec(options: StagingOptions, chosen: Plan) -> str:
    """A push's bundle codec: the user's, else the plan's, else zstd."""
    return options.codec or chosen.chosen.codec or "zstd"


@register_strategy
class IndividualPush(Strategy[PushContext]):
    """One batch transfer of the entries themselves (rsync over ssh, a parallel copy locally ...), of every
    kind the source has, into a DEST marked INCOMPLETE; files that changed while read are sent again. Runs an
    individual plan (no route needed)."""

    name, direction, order = INDIVIDUAL, Direction.PUSH, 10

    @classmethod
    def applies(cls, ctx: PushContext, planned: str) -> bool:
        return planned == INDIVIDUAL

    def run(self, ctx: PushContext) -> Attempt:
        attempt = Attempt(route="individual")
        check_carried(ctx.tree, ctx.transport)
        marked = begin_writing(ctx, "an individual push")
        listed = None
        if ctx.include is not None or ctx.transport.capabilities.local_copy:     # the scan's names: no second walk
            listed = [os.fsdecode(p) for p in ctx.tree.index.paths]
        with Stage(attempt, ctx.progress, "transfer", len(ctx.inventory.sizes), ctx.inventory.stats.bytes):
            for sent in send_until_stable(lambda items: transfer_all(ctx.transport, Direction.PUSH, ctx.src,
                                                                     ctx.endpoint, items, marked.scratch),
                                          ctx.tree, listed):
                attempt.count(sent)
        if ctx.selection:
            finish_selection(ctx.transport, marked, _run_there(ctx))
        return attempt


@register_strategy
class TarToolsPush(Strategy[PushContext]):
    """Bundles into the far side's own ``tar -x``, checked with its md5sum (staging_core.routes.tar_tools_push):
    any bundle or hybrid plan through a route that carries ``tar-tools``."""

    name, direction, order = TAR_TOOLS, Direction.PUSH, 20

    @classmethod
    def applies(cls, ctx: PushContext, planned: str) -> bool:
        return planned != INDIVIDUAL and carries(ctx.route, TAR_TOOLS)

    def run(self, ctx: PushContext) -> Attempt:
        route = cast(TarToolsRoute, declaring(ctx.route, self.name))   # what listing tar-tools promises
        outcome = push_tar_tools(ctx.transport, ctx.tree, ctx.endpoint, route, ctx.options.jobs, ctx.progress,
                                 clear_state=ctx.include is None and not ctx.options.keep_packed)
        attempt = Attempt(outcome.route or route.description, outcome.rounds, dict(outcome.stage_seconds))
        attempt.bytes_sent = outcome.bytes_sent
        attempt.compared(outcome)
        return attempt


@register_strategy
class StreamPush(Strategy[PushContext]):
    """The bundle streamed into the far side's unpacker as it is packed (the far-side session's receiver when
    the push runs one), resumable by shard: a bundle plan where the transport and the route stream (and
    ``--stream`` allows, see :func:`can_stream`)."""

    name, direction, order = STREAM, Direction.PUSH, 40

    @classmethod
    def applies(cls, ctx: PushContext, planned: str) -> bool:
        return planned != INDIVIDUAL and can_stream(ctx.transport, ctx.route, ctx.options)

    def run(self, ctx: PushContext) -> Attempt:
        attempt = Attempt()
        # a session's SessionStream serves stream_push as a FarStager does (duck-typed, see far_side.session)
        receiver = cast("Callable[[], FarStager] | None", ctx.receiver)
        attempt.streamed(stream_push(ctx.transport, ctx.src, ctx.endpoint, ctx.codec, ctx.options, ctx.progress,
                                     ctx.tree, receiver, ctx.level))
        return attempt


@register_strategy
class StoreAndForwardPush(Strategy[PushContext]):
    """Pack here, one transfer of bundle and index into the route's incoming directory, unpack there: a bundle
    plan through a route that carries ``store-and-forward`` (an UnpackRoute) and does not stream."""

    name, direction, order = STORE_AND_FORWARD, Direction.PUSH, 50

    @classmethod
    def applies(cls, ctx: PushContext, planned: str) -> bool:
        return planned != INDIVIDUAL and carries(ctx.route, STORE_AND_FORWARD)

    def run(self, ctx: PushContext) -> Attempt:
        attempt = Attempt()
        push_bundle(ctx, frozenset(), attempt, unpacker(ctx.route, self.name))
        return attempt


@register_strategy
class HybridPush(Strategy[PushContext]):
    """Large files go individually while the rest is packed; the bundle is unpacked last (it sets directory
    times). Only for a whole tree: a narrowed one goes as a bundle, as does a hybrid plan through a route that
    does not carry ``hybrid`` (push_phases.plan_tree)."""

    name, direction, order = HYBRID, Direction.PUSH, 30

    @classmethod
    def applies(cls, ctx: PushContext, planned: str) -> bool:
        return planned == HYBRID and carries(ctx.route, HYBRID)

    def run(self, ctx: PushContext) -> Attempt:
        route = unpacker(ctx.route, self.name)
        attempt = Attempt()
        marked = begin_writing(ctx, "a hybrid push")           # the large files go one by one
        large = [p for p, size in zip(ctx.paths, ctx.inventory.sizes, strict=True)
                 if size >= ctx.options.large_file_bytes]
        with ThreadPoolExecutor(1) as pool:
            sending = pool.submit(send_until_stable, lambda items: transfer_all(ctx.transport, Direction.PUSH,
                                                                                ctx.src, ctx.endpoint, items,
                                                                                marked.scratch),
                                  ctx.tree, [os.fsdecode(p) for p in large])
            push_bundle(ctx, frozenset(large), attempt, route)
            for sent in sending.result():
                attempt.count(sent)
        attempt.route = f"hybrid: {len(large)} large file(s) individually, the rest {route.description}"
        return attempt


def begin_writing(ctx: PushContext, what: str) -> Marked:
    """Mark DEST INCOMPLETE before entries are written into it one by one, and drop the journals an interrupted
    unpack or stream left there (those files would make them lie; bundles.journal.untrusted_journals): one
    command over ssh or on the ``--unpack-via`` host; where nothing runs at the far side, no unpack runs
    there either, so there is no journal to drop."""
    return begin(ctx.transport, ctx.endpoint, f"{what} from {ctx.src} is unfinished: run it again to finish it",
                 _run_there(ctx))


def _run_there(ctx: PushContext) -> Callable[[list[str]], bytes] | None:
    return ctx.route.run_there if ctx.route is not None else None


def push_strategy(ctx: PushContext, planned: str) -> Strategy[PushContext]:
    """The registered push strategy that carries out ``planned`` (individual, bundle or hybrid) where ``ctx``
    leads (:func:`~staging_core.operations.strategy_base.select_strategy`). pallet's own, in the order asked:
    individual for an individual plan; tar-tools for any other through a route that carries it (the far
    side's own tar); hybrid for a hybrid plan through a route that carries it; stream where the transport and
    the route can (and ``--stream`` allows); else store-and-forward."""
    return select_strategy(Direction.PUSH, ctx, planned, ctx.route)


def can_stream(transport: Transport, route: Route | None, options: StagingOptions) -> bool:
    """Whether a push's bundle streams through ``route`` over ``transport`` (:func:`streams_where`): the transport
    declares ``streaming`` and the route carries ``stream`` and streams now. A route that does not carry
    ``stream`` at all (the tar tools) is not one ``--stream`` speaks to: False, whatever it says."""
    if route is None or STREAM not in route.strategies:
        return False
    return streams_where(transport.capabilities.streaming and route_streams(route), options,
                         f"{transport.scheme} to this destination cannot stream",
                         "; streaming needs an ssh destination with pallet and no --launcher")


def push_bundle(ctx: PushContext, exclude: frozenset[bytes], attempt: Attempt, route: UnpackRoute) -> None:
    """Store and forward: pack here (``ctx.include`` of the tree, without ``exclude``), one transfer of bundle +
    index into ``route``'s incoming, unpack there."""
    transport, endpoint, options, include = ctx.transport, ctx.endpoint, ctx.options, ctx.include
    staging = scratch_dir("pallet-push-")
    try:
        bundle = os.path.join(staging, bundle_name(ctx.codec))
        with Stage(attempt, NoProgress(), "pack"):          # pack draws its own bar
            pack(ctx.src, bundle, PackOptions(codec=ctx.codec, level=options.level, shard_size=options.shard_size,
                                              jobs=options.jobs, exclude=exclude, include=include), ctx.progress)
        if endpoint.is_local:
            ensure_state_dir(endpoint.path)     # never follow a link planted at DEST/.pallet
        transport.mkdir(route.incoming)
        names = [os.path.basename(bundle), os.path.basename(bundle) + ".pidx", *route.extra_files(bundle)]
        with Stage(attempt, ctx.progress, "transfer", 0, os.path.getsize(bundle)):
            sent = transport.transfer(Direction.PUSH, staging, route.incoming, names)
        if not sent.ok:
            raise next(iter(sent.failed.values()))
        attempt.count(sent)
        with Stage(attempt, ctx.progress, "unpack"):
            attempt.skipped_shards += route.unpack(os.path.join(route.incoming, names[0]),
                                                   keep_journal=include is None)
        attempt.route = route.description
        if include is not None:     # a selection; a whole-tree push clears all of DEST/.pallet at the end
            route.discard([os.path.join(route.incoming, n) for n in names])
    finally:
        shutil.rmtree(staging, ignore_errors=True)
