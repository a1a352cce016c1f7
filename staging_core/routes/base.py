"""The Route type: what every bundle route declares, read by the operations instead of the route's class.

A route declares the strategies it carries, the transport capabilities it needs and what it does itself.

A route is how a bundle turns into the tree where it must land: an ``UnpackRoute`` (push, routes/unpack.py), a
``PackRoute`` (pull, routes/pack.py) or the ``TarToolsRoute`` (either, routes/tar_tools.py). Each derives from
:class:`Route`, and the policy above (staging_core.operations) reads only what :class:`Route` declares; it never
asks which class a route is. docs/adding-a-route.md is the guide.
"""
from __future__ import annotations

import dataclasses
from abc import ABC
from contextlib import AbstractContextManager
from typing import ClassVar

from bundles.errors import PalletError

from staging_core.transports.base import Capabilities, Transport
from staging_core.transports.registry import capable
from staging_core.transports.errors import NotSupportedError

# The strategies pallet ships (staging_core.operations.push_strategies / pull_strategies register them under these
# names); a route lists those it carries in ``Route.strategies``. A plugin's strategy may add a name of its own.
INDIVIDUAL = "individual"
STREAM = "stream"
STORE_AND_FORWARD = "store-and-forward"
HYBRID = "hybrid"
TAR_TOOLS = "tar-tools"

# The Capabilities flags a route may name in ``needs``: the boolean ones.
CAPABILITY_FLAGS = frozenset(f.name for f in dataclasses.fields(Capabilities) if f.type in ("bool", bool))


class Route(AbstractContextManager, ABC):
    """What every bundle route declares; the contract the operations rely on.

    Class attributes, read by the operations (never the route's class):

    ``strategies``
        The names of the strategies that may carry a bundle through this route (``stream``,
        ``store-and-forward``, ``hybrid``, ``tar-tools``, or a plugin's own). Listing one is a promise that the
        route implements what that strategy calls on it: a push's ``store-and-forward`` and ``hybrid`` call
        the ``UnpackRoute`` interface, a pull's ``store-and-forward`` the ``PackRoute`` interface, ``tar-tools``
        is the ``TarToolsRoute``; ``stream`` reads only :attr:`streams` (the stream itself runs through the
        endpoint's transport), and a route that lists it is one that ``--stream`` speaks to: ``--stream on``
        where :attr:`streams` is False is a usage error. A route that lists ``hybrid`` takes a hybrid plan (large
        files individually beside the bundle); a hybrid plan through any other route runs as a bundle. The
        individual strategy needs no route and is not listed.
    ``needs``
        The Capabilities flags (staging_core.transports.base) the endpoint's transport must declare for this
        route to serve it (``remote_exec``, ``posix_shell``, ``streaming``, ``local_copy`` ...). A route
        registered with :func:`staging_core.routes.unpack.endpoint_routes` is opened, and counted as possible
        by ``pallet plan``, only where they hold (:func:`capable`).
    ``compares_dest_itself``
        The route's strategy lists and compares DEST itself and sends only what differs (the tar tools): push
        and pull do not compare DEST with the source before a bundle goes through it. Files one by one are
        still compared by the operation.
    ``clears_state_itself``
        A bundle through this route leaves no DEST/.pallet behind (its strategy cleared it): a push does not
        clear it again afterwards.
    ``source_is_bundle``
        (pull) The source is a bundle with its index beside it: nothing is listed, compared or planned before
        the pull; the route's ``inventory()`` gives what it holds and the fixed plan, and its ``paths`` every
        entry (``--delete``); see :class:`staging_core.routes.pack.BundleSource`.

    Per instance: :attr:`description` names the route for summaries (``--json``'s ``route``), :attr:`streams`
    says whether a bundle stream can go through it now (read only when ``stream`` is in ``strategies``), and
    :meth:`run_there` runs a command where the endpoint's files are, when the route has a way (clean-up,
    ``--delete``). A route is a context manager; :meth:`close` releases what it opened.
    """

    strategies: ClassVar[frozenset[str]] = frozenset()
    needs: ClassVar[frozenset[str]] = frozenset()
    compares_dest_itself: ClassVar[bool] = False
    clears_state_itself: ClassVar[bool] = False
    source_is_bundle: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        unknown = set(cls.needs) - CAPABILITY_FLAGS
        if unknown:
            raise TypeError(f"{cls.__name__}.needs names no Capabilities flag: {', '.join(sorted(unknown))} "
                            f"(flags: {', '.join(sorted(CAPABILITY_FLAGS))})")
        if not isinstance(cls.strategies, frozenset) or not isinstance(cls.needs, frozenset):
            raise TypeError(f"{cls.__name__}: strategies and needs are frozensets of names")

    @property
    def description(self) -> str:
        return "in place"

    @property
    def streams(self) -> bool:
        """Whether a bundle stream can go through the route now (only read when it lists ``stream``)."""
        return False

    def run_there(self, argv: list[str], stdin: bytes | None = None) -> bytes:
        """Run ``argv`` (fed ``stdin``) on a host that sees the endpoint's files and return its stdout;
        NotSupportedError where the route has no such host (the default)."""
        raise NotSupportedError(f"the {self.description} route runs nothing at the far side")

    def close(self) -> None:  # noqa: B027 - a hook: a route that opened nothing has nothing to release
        """Release what the route opened (e.g. its own ssh connection)."""

    def __exit__(self, *exc) -> None:
        self.close()


def carries(route: Route | None, strategy: str) -> bool:
    """Whether ``route`` lists ``strategy`` among those that may carry a bundle through it."""
    return route is not None and strategy in route.strategies


def route_streams(route: Route | None) -> bool:
    """Whether a bundle stream can go through ``route`` now: it carries ``stream`` and :attr:`Route.streams`."""
    return route is not None and STREAM in route.strategies and route.streams


def declaring(route: Route | None, strategy: str) -> Route:
    """``route``, which lists ``strategy``: the strategy may then call on it the interface that listing
    promises (see :class:`Route`). PalletError when it does not list it (a strategy chosen for a route that
    does not carry it: pallet's fault)."""
    if route is None or strategy not in route.strategies:
        raise PalletError(f"the {strategy} strategy was chosen for a route that does not carry it "
                          f"({'no route' if route is None else route.description})",
                          hint="this is a bug in pallet or in a plugin's route: please report it")
    return route


def transport_capable(transport: Transport, needs: frozenset[str]) -> bool:
    """Whether the open ``transport`` declares every flag of ``needs``."""
    return capable(transport.capabilities, needs)
