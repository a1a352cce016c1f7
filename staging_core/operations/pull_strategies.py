"""The ways a pull moves a tree here, as strategies: individually, streamed, stored and forwarded, tar tools."""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from bundles.progress import NoProgress, Progress
from bundles.state import ensure_state_dir, prune
from bundles.unpacking import UnpackOptions, unpack

from staging_core.far_side.streaming import PullStream, stream_pull
from staging_core.operations.individual import begin, fetch_until_stable, finish_selection
from staging_core.operations.pull_phases import OpenSource, move_packed
from staging_core.operations.strategy_base import (Attempt, Stage, Strategy, register_strategy, select_strategy,
                                                   streams_where, transfer_all)
from staging_core.options import StagingOptions
from staging_core.routes.base import (INDIVIDUAL, STORE_AND_FORWARD, STREAM, TAR_TOOLS, Route, carries, declaring,
                                      route_streams)
from staging_core.routes.pack import packer
from staging_core.routes.tar_tools import TarToolsRoute
from staging_core.routes.tar_tools_pull import pull_tar_tools
from staging_core.routes.unpack import INCOMING
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


@register_strategy
class IndividualPull(Strategy[PullContext]):
    """One batch transfer of the files themselves into a DEST marked INCOMPLETE, the transport's temporaries
    in DEST/.pallet; files that changed while read are fetched again (where the source's listing is exact).
    Runs an individual plan (no route needed)."""

    name, direction, order = INDIVIDUAL, Direction.PULL, 10

    @classmethod
    def applies(cls, ctx: PullContext, planned: str) -> bool:
        return planned == INDIVIDUAL

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
                    ctx.whole and source.transport.capabilities.exact_listing):
                attempt.count(fetched)
        if not ctx.whole:
            finish_selection(source.transport, marked)
        return attempt


@register_strategy
class TarToolsPull(Strategy[PullContext]):
    """The far side's own ``tar -c`` streams here, checked against its md5sum (staging_core.routes.tar_tools_pull):
    a bundle plan through a route that carries ``tar-tools``."""

    name, direction, order = TAR_TOOLS, Direction.PULL, 20

    @classmethod
    def applies(cls, ctx: PullContext, planned: str) -> bool:
        return planned != INDIVIDUAL and carries(ctx.source.route, TAR_TOOLS)

    def run(self, ctx: PullContext) -> Attempt:
        source = ctx.source
        route = cast(TarToolsRoute, declaring(source.route, self.name))    # what listing tar-tools promises
        attempt = Attempt(route=route.description)
        with Stage(attempt, NoProgress(), "transfer"):
            outcome = pull_tar_tools(source.transport, source.endpoint, route, ctx.dest, source.options.jobs,
                                     ctx.progress, ctx.items)
        attempt.transfers, attempt.bytes_sent = outcome.rounds, outcome.bytes_sent
        attempt.route = outcome.route or attempt.route
        attempt.compared(outcome)
        return attempt


@register_strategy
class StreamPull(Strategy[PullContext]):
    """``mpi_stager send`` at the source (through the source's transport) streams the bundle, extracted here as
    its shards arrive, resumably: a bundle plan whose stream began before planning, or through a route that
    streams (and ``--stream`` allows, see :func:`can_stream_pull`)."""

    name, direction, order = STREAM, Direction.PULL, 30

    @classmethod
    def applies(cls, ctx: PullContext, planned: str) -> bool:
        return planned != INDIVIDUAL and (ctx.begun is not None
                                          or can_stream_pull(ctx.source.route, ctx.source.options))

    def run(self, ctx: PullContext) -> Attempt:
        source, attempt = ctx.source, Attempt()
        attempt.streamed(ctx.begun.receive_into(ctx.dest, ctx.progress) if ctx.begun is not None
                         else stream_pull(source.transport, source.endpoint, ctx.dest,
                                          source.options.codec or "zstd", source.options, ctx.progress, ctx.items))
        return attempt


@register_strategy
class StoreAndForwardPull(Strategy[PullContext]):
    """The source's pack route packs a bundle there, it comes here with its index in one transfer (into
    DEST/.pallet/incoming) and is unpacked here, resumably by its journal: a bundle plan through a route that
    carries ``store-and-forward`` (a PackRoute) and does not stream."""

    name, direction, order = STORE_AND_FORWARD, Direction.PULL, 40

    @classmethod
    def applies(cls, ctx: PullContext, planned: str) -> bool:
        return planned != INDIVIDUAL and carries(ctx.source.route, STORE_AND_FORWARD)

    def run(self, ctx: PullContext) -> Attempt:
        attempt, options, dest = Attempt(), ctx.source.options, ctx.dest
        ensure_state_dir(dest)
        staging = os.path.join(dest, INCOMING)
        os.makedirs(staging, exist_ok=True)
        with Stage(attempt, ctx.progress, "pack and transfer"):
            moved = move_packed(ctx.source, staging, ctx.items)
        attempt.count(moved.transfer)
        with Stage(attempt, ctx.progress, "unpack"):
            summary = unpack(moved.path, dest, UnpackOptions(verify=options.verify, lock_held=True,
                                                             max_jobs=options.jobs))
        attempt.skipped_shards = summary.shards_skipped
        for leftover in (moved.path, moved.path + ".pidx"):
            os.unlink(leftover)
        prune(dest, staging)
        attempt.route = packer(ctx.source.route, self.name).description
        return attempt


def pull_strategy(ctx: PullContext, planned: str) -> Strategy[PullContext]:
    """The registered pull strategy that carries out ``planned`` (individual or bundle) from ``ctx.source``
    (:func:`~staging_core.operations.strategy_base.select_strategy`). pallet's own, in the order asked:
    individual for an individual plan; tar-tools through a route that carries it (the far side's own tar);
    stream where the stream began before planning or the route streams (and ``--stream`` allows); else
    store-and-forward (the source's route packs there)."""
    return select_strategy(Direction.PULL, ctx, planned, ctx.source.route)


def can_stream_pull(route: Route | None, options: StagingOptions) -> bool:
    """Whether a pull's bundle streams from ``route`` (:func:`streams_where`): it carries ``stream`` and streams
    now. A route that does not carry ``stream`` at all (the tar tools) is not one ``--stream`` speaks to."""
    if route is None or STREAM not in route.strategies:
        return False
    return streams_where(route_streams(route), options, f"this source cannot stream ({route.description})",
                         "; streaming needs an ssh source with pallet and no --launcher")


def early_stream(transport: Transport, endpoint: Endpoint, route: Route | None, options: StagingOptions,
                 items: Sequence[str] | None) -> PullStream | None:
    """A pull that would stream a bundle starts the stream before planning (``mpi_stager send`` through the
    source's ``transport``), and plans from its skeleton (the far side's own walk) instead of a listing of its
    own; None when it would not stream."""
    if options.strategy == "individual" or not can_stream_pull(route, options):
        return None
    return PullStream(transport, endpoint, options.codec or "zstd", options, items)
