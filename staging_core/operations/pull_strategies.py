"""The ways a pull moves a tree here, as strategies: individually, streamed, stored and forwarded, tar tools."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from bundles.progress import NoProgress, Progress
from bundles.state import ensure_state_dir, prune
from mpi_stager.comm import SerialComm
from mpi_stager.unpack import StagerOptions, unpack_parallel

from staging_core.operations.individual import begin, fetch_until_stable, finish_selection
from staging_core.options import StagingOptions
from staging_core.operations.repair import COMPARABLE_SCHEMES
from staging_core.routes.pack import PackRoute
from staging_core.routes.tar_tools import TarToolsRoute
from staging_core.routes.tar_tools_pull import pull_plain
from staging_core.operations.pull_phases import OpenSource, move_packed
from staging_core.routes.unpack import INCOMING
from staging_core.operations.strategy_base import Attempt, Stage, Strategy, streams_where, transfer_all
from staging_core.far_side.streaming import PullStream, stream_pull
from staging_core.transports.base import Direction, Endpoint, Transport


@dataclass(frozen=True)
class PullContext:
    """What one attempt of a pull works with: the opened source, the local ``dest``, progress, the ``items``
    selected (None: the whole tree) and, for the first attempt only, a stream ``begun`` before planning."""

    source: OpenSource
    dest: str
    progress: Progress
    items: Sequence[str] | None = None
    begun: PullStream | None = None
    whole: bool = True          # the whole tree (``items`` then only narrows it to what DEST lacks)

    @property
    def listed(self) -> list[str] | None:
        return None if self.items is None else list(self.items)


class IndividualPull(Strategy[PullContext]):
    """One batch transfer of the files themselves into a DEST marked INCOMPLETE, the transport's temporaries
    in DEST/.pallet; files that changed while read are fetched again."""

    name = "individual"

    def run(self, ctx: PullContext) -> Attempt:
        attempt = Attempt(route="individual")
        source, local = ctx.source, Endpoint("file", ctx.dest)
        marked = begin(source.transport, local, f"an individual pull from {source.endpoint.url()} is unfinished: "
                                                "run it again to finish it")
        with Stage(attempt, ctx.progress, "transfer"):
            for fetched in fetch_until_stable(
                    lambda items: transfer_all(source.transport, Direction.PULL, ctx.dest, source.endpoint, items,
                                               marked.scratch),
                    source.transport, source.endpoint, ctx.dest, ctx.listed,
                    ctx.whole and source.endpoint.scheme in COMPARABLE_SCHEMES):
                attempt.count(fetched)
        if not ctx.whole:
            finish_selection(source.transport, marked)
        return attempt


class TarToolsPull(Strategy[PullContext]):
    """The far side's own ``tar -c`` streams here, checked against its md5sum (staging_core.routes.tar_tools_pull)."""

    name = "tar-tools"

    def run(self, ctx: PullContext) -> Attempt:
        source, attempt = ctx.source, Attempt(route=ctx.source.route.description)
        with Stage(attempt, NoProgress(), "transfer"):
            outcome = pull_plain(source.transport, source.endpoint, source.route, ctx.dest, source.options.jobs,
                                 ctx.progress, ctx.items)
        attempt.transfers, attempt.bytes_sent = outcome.rounds, outcome.bytes_sent
        attempt.compared(outcome)
        return attempt


class StreamPull(Strategy[PullContext]):
    """``mpi_stager send`` at the source streams the bundle, extracted here as its shards arrive, resumably."""

    name = "stream"

    def run(self, ctx: PullContext) -> Attempt:
        source, attempt = ctx.source, Attempt()
        attempt.streamed(ctx.begun.receive_into(ctx.dest, ctx.progress) if ctx.begun is not None
                         else stream_pull(source.route.transport, source.endpoint, ctx.dest,
                                          source.options.codec or "zstd", source.options, ctx.progress, ctx.items))
        return attempt


class StoreAndForwardPull(Strategy[PullContext]):
    """The source's pack route packs a bundle there, it comes here with its index in one transfer (into
    DEST/.pallet/incoming) and is unpacked here, resumably by its journal."""

    name = "store-and-forward"

    def run(self, ctx: PullContext) -> Attempt:
        attempt, options, dest = Attempt(), ctx.source.options, ctx.dest
        ensure_state_dir(dest)
        staging = os.path.join(dest, INCOMING)
        os.makedirs(staging, exist_ok=True)
        with Stage(attempt, ctx.progress, "pack and transfer"):
            moved = move_packed(ctx.source, staging, ctx.items)
        attempt.count(moved.transfer)
        with Stage(attempt, ctx.progress, "unpack"):
            summary = unpack_parallel(SerialComm(), moved.path, dest,
                                      StagerOptions(options.verify, None, max(1, options.jobs or os.cpu_count() or 1),
                                                    lock_held=True))
        attempt.skipped_shards = summary.shards_skipped
        for leftover in (moved.path, moved.path + ".pidx"):
            os.unlink(leftover)
        prune(dest, staging)
        attempt.route = ctx.source.route.description
        return attempt


def pull_strategy(ctx: PullContext, planned: str) -> Strategy[PullContext]:
    """The strategy that carries out ``planned`` (individual or bundle) from ``ctx.source``: a bundle comes
    through the far side's tar tools when that is the route, is streamed where the route can (and
    ``--stream`` allows), else is packed there, stored and forwarded."""
    route = ctx.source.route
    if planned == "individual":
        return IndividualPull()
    if isinstance(route, TarToolsRoute):
        return TarToolsPull()
    if ctx.begun is not None or can_stream_pull(route, ctx.source.options):
        return StreamPull()
    return StoreAndForwardPull()


def can_stream_pull(route: PackRoute, options: StagingOptions) -> bool:
    return streams_where(route.streams, options, f"this source cannot stream ({route.description})",
                         "; streaming needs an ssh source with pallet and no --launcher")


def early_stream(transport: Transport, endpoint: Endpoint, route, options: StagingOptions,
                 items: Sequence[str] | None) -> PullStream | None:
    """A pull that would stream a bundle starts the stream before planning, and plans from its skeleton (the
    far side's own walk) instead of a listing of its own; None when it would not stream."""
    if options.strategy == "individual" or not isinstance(route, PackRoute) or not can_stream_pull(route, options):
        return None
    return PullStream(route.transport, endpoint, options.codec or "zstd", options, items)
