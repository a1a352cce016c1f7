"""A pull's phases as public steps — open the source, plan, move a bundle here — that pull() and the plugins compose."""
from __future__ import annotations

import os
import posixpath
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

from bundles.errors import PalletError

from staging_core.far_side.probe import far_side_options
from staging_core.options import StagingOptions
from staging_core.planning.inventory import Inventory, remote_inventory
from staging_core.planning.local_profile import route_profile
from staging_core.planning.planner import Plan, plan
from staging_core.routes.base import STORE_AND_FORWARD, Route, carries, route_streams
from staging_core.routes.pack import bundle_source, pack_route, packer
from staging_core.routes.unpack import closing
from staging_core.transports.base import Direction, EarlyConnection, Endpoint, Transport, TransferResult, parse_url
from staging_core.transports.registry import open_endpoint

UNKNOWN_RATIO = 0.5          # compressed / original size assumed for a source not sampled here


class OpenSource:
    """A pull source opened: its transport, the options as its probe left them (``remote_python`` found
    there), and the route that packs it (None: it cannot be bundled, only fetched individually).
    ``early_connection``: a connection to its host already started (``Transport.connect_early``), which
    its transport takes over.

    Use it as a context manager; it closes the route and the transport.
    """

    def __init__(self, src_url: str | Endpoint, options: StagingOptions,
                 early_connection: EarlyConnection | None = None):
        self.endpoint = src_url if isinstance(src_url, Endpoint) else parse_url(src_url)
        self._stack = ExitStack()
        try:
            self.transport: Transport = self._stack.enter_context(open_endpoint(self.endpoint, options,
                                                                                 early_connection))
            self.options, far = far_side_options(self.transport, self.endpoint, options)
            self.route: Route | None = self._stack.enter_context(
                closing(pack_route(self.endpoint, self.transport, self.options, far)))
        except BaseException:
            self._stack.close()
            raise

    @property
    def packs(self) -> bool:
        """The route packs a bundle at the source that :func:`move_packed` brings here (it carries
        ``store-and-forward``). False without a route, and for one whose bundles come some other way (the
        tar-tools route: the far side's own tar, no pallet there); a caller that keeps bundles needs it."""
        return carries(self.route, STORE_AND_FORWARD)

    @property
    def streams(self) -> bool:
        """``mpi_stager send`` can stream from there (ssh with pallet, no launcher): the route carries
        ``stream`` and streams now."""
        return route_streams(self.route)

    def __enter__(self) -> OpenSource:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


def plan_pull(source: OpenSource, local_dest: str | None, items: Sequence[str] | None = None,
              sizes: Sequence[int] | None = None) -> tuple[Inventory, Plan]:
    """The inventory of what a pull of ``items`` (None: the whole tree) moves, from ``sizes`` when given, else
    from one listing of the source, and the planner's choice for it (``local_dest``: where it lands, for the
    local route's measured profile). A published bundle's inventory and plan come from its index."""
    options = source.options
    published = bundle_source(source.route)
    if published is not None:
        return published.inventory()
    inventory = (Inventory(source.endpoint.path, list(sizes), options.large_file_bytes) if sizes is not None
                 else remote_inventory(source.transport, source.endpoint.path, options.large_file_bytes, items))
    profile, bundle_possible = route_profile(source.endpoint, options, source.route is not None, local_dest)
    return inventory, plan(inventory.stats, profile, UNKNOWN_RATIO, max(1, options.ranks), bundle_possible)


@dataclass(frozen=True)
class MovedBundle:
    """A bundle packed at the source and brought here: its local path (its ``.pidx`` beside it) and the
    transfer that brought both."""

    path: str
    transfer: TransferResult


def move_packed(source: OpenSource, into: str, items: Sequence[str] | None = None,
                codec: str | None = None) -> MovedBundle:
    """Have the source's pack route pack ``items`` (None: the whole tree) with ``codec`` (default: the
    options', else zstd), and bring the bundle and its index into the local directory ``into`` in one
    transfer; what the route made there is removed either way. The bundle's bytes depend only on the tree
    and the codec, so a rerun into the same ``into`` is sent nothing again by rsync. Raises the transfer's
    error, or PalletError when the source cannot be packed."""
    if not carries(source.route, STORE_AND_FORWARD):
        raise PalletError("this source has no pack route", source.endpoint.url(),
                          "fetch it individually (--strategy individual)")
    route = packer(source.route)
    try:
        bundle = route.pack(codec or source.options.codec or "zstd", None if items is None else list(items))
        name = posixpath.basename(bundle)
        fetched = source.transport.transfer(Direction.PULL, into, posixpath.dirname(bundle), [name, name + ".pidx"])
        if not fetched.ok:
            raise next(iter(fetched.failed.values()))
    finally:
        route.cleanup()
    return MovedBundle(os.path.join(into, name), fetched)
