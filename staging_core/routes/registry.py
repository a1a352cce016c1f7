"""The registry of bundle routes: how a bundle is unpacked at a push's destination or packed at a pull's source."""
from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

from bundles.errors import UsageError

from staging_core.far_side.probe import FarSide
from staging_core.options import StagingOptions
from staging_core.routes.base import Route
from staging_core.transports.base import Direction, Endpoint, Transport

# The modules whose routes pallet ships; imported (and so registered) on the registry's first use.
BUILT_IN = ("staging_core.routes.unpack", "staging_core.routes.pack")
_NAME = re.compile(r"^[a-z][a-z0-9-]*$")


@dataclass(frozen=True)
class RouteQuery:
    """What a route decides from: the endpoint, its open transport, the operation's options, and the far-side
    probe's findings (None: not probed, e.g. a local endpoint or an explicit route)."""

    endpoint: Endpoint
    transport: Transport
    options: StagingOptions
    far: FarSide | None = None


@dataclass(frozen=True)
class RouteSpec:
    """One route, as it registers itself.

    - ``name``: how docs, errors and the conformance suite call it
      (lower-case words joined by ``-``); unique per direction.
    - ``direction``: PUSH for a route that unpacks at a destination, PULL
      for one that packs at a source.
    - ``order``: routes of a direction are asked in increasing order.
    - ``open(query)``: the :class:`~staging_core.routes.base.Route` when
      this route serves the query, else None. What the route declares (its
      strategies, the capabilities it needs ...) is all the operations read
      of it. ``open`` may ask the transport (a ``stat``) but must not change
      anything; it raises PalletError when the route is asked for
      explicitly and cannot be had.
    - ``check(options, direction)``: raise UsageError for this route's
      options that do not fit one another or the operation's direction;
      called for every registered route before any operation starts,
      whatever the direction, so a route also refuses its options in the
      direction it does not serve.
    - ``possible(endpoint, options)``: whether ``open`` could serve, decided
      without contacting anything (``pallet plan``).
    """

    name: str
    direction: Direction
    order: int
    open: Callable[[RouteQuery], Route | None]
    check: Callable[[StagingOptions, Direction], None] = lambda options, direction: None
    possible: Callable[[Endpoint, StagingOptions], bool] = lambda endpoint, options: False


class RouteRegistry:
    """Routes by direction; registration happens at import time (built-in modules on first use, plugins when
    they are imported), lookups after. Not a place for per-operation state."""

    def __init__(self, modules: tuple[str, ...]):
        self._specs: dict[tuple[Direction, str], RouteSpec] = {}
        self._modules = modules
        self._loaded = False
        self._loading = threading.Lock()

    def register(self, spec: RouteSpec) -> None:
        """Add ``spec``, or replace the route of that name and direction."""
        if not _NAME.match(spec.name):
            raise UsageError(f"{spec.name!r} is not a route name", hint="use lower-case words joined by -")
        self._specs[(spec.direction, spec.name)] = spec

    def unregister(self, direction: Direction, name: str) -> None:
        """Remove a route (nothing if there is none)."""
        self._specs.pop((direction, name), None)

    def routes(self, direction: Direction) -> list[RouteSpec]:
        """The routes of ``direction`` in the order they are asked."""
        self._load()
        return sorted((s for s in self._specs.values() if s.direction is direction), key=lambda s: (s.order, s.name))

    def _load(self) -> None:
        with self._loading:             # no thread sees the built-in routes half registered
            if not self._loaded:
                for module in self._modules:
                    importlib.import_module(module)
                self._loaded = True


REGISTRY = RouteRegistry(BUILT_IN)


def register_route(spec: RouteSpec) -> None:
    """Register a route (see :class:`RouteSpec`); pallet's own routes do so when their modules are imported."""
    REGISTRY.register(spec)


def unregister_route(direction: Direction, name: str) -> None:
    REGISTRY.unregister(direction, name)


def registered_routes(direction: Direction) -> list[RouteSpec]:
    return REGISTRY.routes(direction)


def open_route(direction: Direction, query: RouteQuery) -> Route | None:
    """The first route of ``direction`` that serves ``query`` (its ``open`` result), or None: no bundle can go
    there, and files go individually."""
    for spec in registered_routes(direction):
        route = spec.open(query)
        if route is not None:
            return route
    return None


def check_route_options(options: StagingOptions, direction: Direction) -> None:
    """Every registered route's ``check``: raise UsageError for route options that do not fit together or the
    operation's direction."""
    for spec in [*registered_routes(Direction.PUSH), *registered_routes(Direction.PULL)]:
        spec.check(options, direction)


def has_route(direction: Direction, endpoint: Endpoint, options: StagingOptions) -> bool:
    """Whether some route of ``direction`` could serve ``endpoint``, decided without contacting anything."""
    return any(spec.possible(endpoint, options) for spec in registered_routes(direction))
