"""The ways a push moves a tree, as strategies: individually, streamed, stored and forwarded, hybrid, tar tools."""
from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from bundles.progress import NoProgress, Progress
from bundles.scan import SourceTree
from bundles.state import ensure_state_dir
from bundles.writer import PackOptions, pack

from staging_core.far_side.session import SessionStream
from staging_core.operations.individual import Marked, begin, check_carried, finish_selection, send_until_stable
from staging_core.planning.inventory import Inventory
from staging_core.options import StagingOptions
from staging_core.routes.tar_tools import TarToolsRoute
from staging_core.routes.tar_tools_push import push_plain
from staging_core.planning.planner import Plan
from staging_core.routes.unpack import UnpackRoute, bundle_name
from staging_core.scratch import scratch_dir
from staging_core.operations.strategy_base import Attempt, Stage, Strategy, streams_where, transfer_all
from staging_core.far_side.streaming import stream_push
from staging_core.transports.base import Direction, Endpoint, Transport


@dataclass(frozen=True)
class PushContext:
    """What every attempt of one push works with: the transport to DEST and its route, the tree to send (only
    ``include`` of it when a selection or the comparison with DEST narrowed it), its inventory and paths, the
    plan, the options, progress, and the far-side session's ``receiver`` of streams when there is one."""

    transport: Transport
    endpoint: Endpoint
    route: UnpackRoute | TarToolsRoute | None
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


def stream_codec(options: StagingOptions, chosen: Plan) -> str:
    """A push's bundle codec: the user's, else the plan's, else zstd."""
    return options.codec or chosen.chosen.codec or "zstd"


class IndividualPush(Strategy[PushContext]):
    """One batch transfer of the entries themselves (rsync over ssh, a parallel copy locally ...), of every
    kind the source has, into a DEST marked INCOMPLETE; files that changed while read are sent again."""

    name = "individual"

    def run(self, ctx: PushContext) -> Attempt:
        attempt = Attempt(route="individual")
        check_carried(ctx.tree, ctx.transport)
        marked = begin_writing(ctx, "an individual push")
        listed = None
        if ctx.include is not None or ctx.transport.scheme == "file":       # the scan's names: no second walk
            listed = [os.fsdecode(p) for p in ctx.tree.index.paths]
        with Stage(attempt, ctx.progress, "transfer", len(ctx.inventory.sizes), ctx.inventory.stats.bytes):
            for sent in send_until_stable(lambda items: transfer_all(ctx.transport, Direction.PUSH, ctx.src,
                                                                     ctx.endpoint, items, marked.scratch),
                                          ctx.tree, listed):
                attempt.count(sent)
        if ctx.selection:
            finish_selection(ctx.transport, marked, _run_there(ctx))
        return attempt


class TarToolsPush(Strategy[PushContext]):
    """Bundles into the far side's own ``tar -x``, checked with its md5sum (staging_core.routes.tar_tools_push)."""

    name = "tar-tools"

    def run(self, ctx: PushContext) -> Attempt:
        outcome = push_plain(ctx.transport, ctx.tree, ctx.endpoint, ctx.route, ctx.options.jobs, ctx.progress,
                             clear_state=ctx.include is None and not ctx.options.keep_packed)
        attempt = Attempt(ctx.route.description, outcome.rounds, dict(outcome.stage_seconds))
        attempt.bytes_sent = outcome.bytes_sent
        attempt.compared(outcome)
        return attempt


class StreamPush(Strategy[PushContext]):
    """The bundle streamed into the far side's unpacker as it is packed (the far-side session's receiver when
    the push runs one), resumable by shard."""

    name = "stream"

    def run(self, ctx: PushContext) -> Attempt:
        attempt = Attempt()
        attempt.streamed(stream_push(ctx.transport, ctx.src, ctx.endpoint, ctx.codec, ctx.options, ctx.progress,
                                     ctx.tree, ctx.receiver))
        return attempt


class StoreAndForwardPush(Strategy[PushContext]):
    """Pack here, one transfer of bundle and index into the route's incoming directory, unpack there."""

    name = "store-and-forward"

    def run(self, ctx: PushContext) -> Attempt:
        attempt = Attempt()
        push_bundle(ctx, frozenset(), attempt)
        return attempt


class HybridPush(Strategy[PushContext]):
    """Large files go individually while the rest is packed; the bundle is unpacked last (it sets directory
    times). Only for a whole tree: a narrowed one goes as a bundle."""

    name = "hybrid"

    def run(self, ctx: PushContext) -> Attempt:
        attempt = Attempt()
        marked = begin_writing(ctx, "a hybrid push")           # the large files go one by one
        large = [p for p, size in zip(ctx.paths, ctx.inventory.sizes) if size >= ctx.options.large_file_bytes]
        with ThreadPoolExecutor(1) as pool:
            sending = pool.submit(send_until_stable, lambda items: transfer_all(ctx.transport, Direction.PUSH,
                                                                                ctx.src, ctx.endpoint, items,
                                                                                marked.scratch),
                                  ctx.tree, [os.fsdecode(p) for p in large])
            push_bundle(ctx, frozenset(large), attempt)
            for sent in sending.result():
                attempt.count(sent)
        attempt.route = f"hybrid: {len(large)} large file(s) individually, the rest {ctx.route.description}"
        return attempt


def begin_writing(ctx: PushContext, what: str) -> Marked:
    """Mark DEST INCOMPLETE before entries are written into it one by one, and drop the journals an interrupted
    unpack or stream left there (those files would make them lie; bundles.state.untrusted_journals): one
    command over ssh or on the ``--unpack-via`` host; where nothing runs at the far side, no unpack runs
    there either, so there is no journal to drop."""
    return begin(ctx.transport, ctx.endpoint, f"{what} from {ctx.src} is unfinished: run it again to finish it",
                 _run_there(ctx))


def _run_there(ctx: PushContext) -> Callable[[list[str]], bytes] | None:
    return ctx.route.run_there if isinstance(ctx.route, UnpackRoute) else None


def push_strategy(ctx: PushContext, planned: str) -> Strategy[PushContext]:
    """The strategy that carries out ``planned`` (individual, bundle or hybrid) where ``ctx`` leads: a bundle
    goes through the far side's tar tools when that is the route, is streamed where the transport and the
    route can (and ``--stream`` allows), else is stored and forwarded."""
    if planned == "individual":
        return IndividualPush()
    if isinstance(ctx.route, TarToolsRoute):
        return TarToolsPush()
    if planned == "hybrid":
        return HybridPush()
    if can_stream(ctx.transport, ctx.route, ctx.options):
        return StreamPush()
    return StoreAndForwardPush()


def can_stream(transport: Transport, route: UnpackRoute, options: StagingOptions) -> bool:
    return streams_where(transport.capabilities.streaming and route.streams, options,
                         f"{transport.scheme} to this destination cannot stream",
                         "; streaming needs an ssh destination with pallet and no --launcher")


def push_bundle(ctx: PushContext, exclude: frozenset[bytes], attempt: Attempt) -> None:
    """Store and forward: pack here (``ctx.include`` of the tree, without ``exclude``), one transfer of bundle +
    index into the route's incoming, unpack there."""
    transport, endpoint, route, options, include = ctx.transport, ctx.endpoint, ctx.route, ctx.options, ctx.include
    staging = scratch_dir("pallet-push-")
    try:
        bundle = os.path.join(staging, bundle_name(ctx.codec))
        with Stage(attempt, NoProgress(), "pack"):          # pack draws its own bar
            pack(ctx.src, bundle, PackOptions(codec=ctx.codec, shard_size=options.shard_size, jobs=options.jobs,
                                              exclude=exclude, include=include), ctx.progress)
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
