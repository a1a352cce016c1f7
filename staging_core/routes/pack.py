"""How the tree at a pull source becomes a bundle there: packed here, over ssh, via another host, or published."""
from __future__ import annotations

import os
import posixpath
import shutil
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, Protocol, cast

from bundles.errors import PalletError, SourceError, UsageError
from bundles.index import Index
from bundles.tarformat import Kind
from bundles.writer import PackOptions, pack

from staging_core.far_side.probe import FarSide
from staging_core.options import StagingOptions
from staging_core.planning.inventory import Inventory
from staging_core.planning.planner import Candidate, Plan
from staging_core.routes.base import STORE_AND_FORWARD, STREAM, Route, declaring
from staging_core.routes.registry import RouteQuery, RouteSpec, open_route, register_route
from staging_core.routes.unpack import (BUNDLE_SUFFIXES, bundle_name, endpoint_routes, open_via, open_via_endpoint,
                                        stager_argv)
from staging_core.scratch import scratch, scratch_dir
from staging_core.transports.base import Direction, Endpoint, Transport
from staging_core.transports.errors import TransportError


class PackRoute(Route, ABC):
    """How the tree at a pull source becomes a bundle there: the interface a pull's ``store-and-forward``
    strategy (and :func:`staging_core.operations.pull_phases.move_packed`) calls; see
    :class:`~staging_core.routes.base.Route` for what every route declares.

    ``pack`` returns the path, in the source transport's path space, of a
    bundle with its ``.pidx`` beside it: written under ``outgoing`` (a
    directory the route creates), or the source itself for a published
    bundle; ``items`` (relative paths) packs only those files and their
    parent directories instead of the whole tree. ``cleanup`` removes what
    ``pack`` made.
    The bytes depend only on the tree and the codec, so a rerun sends the
    same bundle and the local unpack skips finished shards. ``streams``
    (False unless a route says otherwise): ``mpi_stager send`` can stream
    the tree from the source through the source's transport (ssh). Every
    pack route carries the ``stream`` and ``store-and-forward`` strategies
    unless it declares fewer. A route is a context manager that closes what
    it opened.
    """

    strategies: ClassVar[frozenset[str]] = frozenset({STREAM, STORE_AND_FORWARD})

    def __init__(self, endpoint: Endpoint, options: StagingOptions):
        self.endpoint = endpoint
        self.options = options
        self.outgoing: str | None = None

    @abstractmethod
    def pack(self, codec: str, items: Sequence[str] | None = None) -> str: ...

    @abstractmethod
    def cleanup(self) -> None: ...


def packer(route: Route | None, strategy: str = STORE_AND_FORWARD) -> PackRoute:
    """``route`` as the PackRoute a pull's ``strategy`` calls: a route that lists that strategy implements this
    interface (the Route contract); PalletError when it does not list it."""
    return cast(PackRoute, declaring(route, strategy))     # the declaration, not the class, decides


class LocalPack(PackRoute):
    """The source is local: pack in this process into a temporary directory."""

    needs = frozenset({"local_copy"})

    def pack(self, codec: str, items: Sequence[str] | None = None) -> str:
        self.outgoing = scratch_dir("pallet-outgoing-")
        bundle = os.path.join(self.outgoing, bundle_name(codec))
        include = None if items is None else frozenset(os.fsencode(i) for i in items)
        pack(self.endpoint.path, bundle, PackOptions(codec=codec, shard_size=self.options.shard_size,
                                                     jobs=self.options.jobs, include=include))
        return bundle

    def cleanup(self) -> None:
        if self.outgoing:
            shutil.rmtree(self.outgoing, ignore_errors=True)


# Far side of a pull: remove the outgoing directories ($1/$2*) that no session holds any more (a killed pull's;
# older than a minute, so that one just made and not yet locked is spared), then make a new one and hold an
# flock on it for as long as our pipe is open, which ends with this process, even after kill -9.
_OUTGOING_SCRIPT = (
    'parent=${1:-${TMPDIR:-/tmp}}; '
    'for old in "$parent/$2"*; do [ -d "$old" ] && [ -n "$(find "$old" -maxdepth 0 -mmin +1)" ] '
    '&& flock -n "$old" rm -rf -- "$old"; done; '
    'new=$(mktemp -d -p "$parent" "$2XXXXXX") && exec flock "$new" sh -c \'echo "$0"; exec cat >/dev/null\' "$new"')


class RemoteExecPack(PackRoute):
    """The source transport can run commands there (ssh): mpi_stager packs into a new ``pallet-outgoing-*``
    directory in the far side's $TMPDIR, which this session holds (an flock) until ``cleanup`` removes it;
    the next pull there removes the ones killed sessions left."""

    needs = frozenset({"remote_exec", "posix_shell", "streaming"})
    prefix = "pallet-outgoing-"

    def __init__(self, endpoint: Endpoint, options: StagingOptions, transport: Transport):
        super().__init__(endpoint, options)
        self.transport = transport
        self._holder: subprocess.Popen | None = None

    @property
    def parent(self) -> str:
        """Where the outgoing directory is made: "" is the far side's ${TMPDIR:-/tmp}."""
        return ""

    @property
    def streams(self) -> bool:
        """``mpi_stager send`` can stream from there: the transport streams and no launcher asks for MPI ranks."""
        return self.transport.capabilities.streaming and not self.options.launcher

    def pack(self, codec: str, items: Sequence[str] | None = None) -> str:
        self.outgoing = self._make_outgoing()
        bundle = os.path.join(self.outgoing, bundle_name(codec))
        comm = [] if self.options.launcher else ["--comm", "serial"]
        selection = [] if items is None else ["--files-from", "-"]
        listing = None if items is None else b"\0".join(os.fsencode(i) for i in items)
        shards = [] if self.options.shard_size is None else ["--shard-size", str(self.options.shard_size)]
        try:
            self.transport.run(stager_argv(self.options, "pack", *comm, *selection, *shards, "--codec", codec,
                                           self.endpoint.path, bundle), stdin=listing)
        except TransportError as exc:
            refused = unselectable(exc, self.endpoint.url())
            if refused is None:
                raise
            raise refused from exc
        return bundle

    def _make_outgoing(self) -> str:
        holder: subprocess.Popen = self.transport.stream_into(["sh", "-c", _OUTGOING_SCRIPT, "sh", self.parent,
                                                               self.prefix])
        self._holder = holder
        assert holder.stdin is not None and holder.stdout is not None and holder.stderr is not None   # pipes
        line = holder.stdout.readline().decode(errors="replace").strip()
        if line:
            return line
        holder.stdin.close()
        error = holder.stderr.read().decode(errors="replace").strip()
        holder.wait()
        self._holder = None
        raise PalletError(f"cannot make a directory for the bundle at the source ({error or 'no reason given'})",
                          self.endpoint.url(), "check that mktemp and flock exist there and its $TMPDIR is writable")

    def cleanup(self) -> None:
        if self._holder is not None:
            if self._holder.stdin is not None:
                self._holder.stdin.close()
            self._holder.wait()
            self._holder = None
        if self.outgoing:
            self.transport.run(["rm", "-rf", "--", self.outgoing])


def unselectable(error: TransportError, url: str) -> SourceError | None:
    """The far-side packer's refusal of a selection naming missing items (``cannot select:``), as a SourceError
    naming them, rather than the "path does not exist" the transport read into its stderr; None otherwise."""
    said = getattr(error, "stderr", "") or ""
    if "cannot select:" not in said:
        return None
    problems = [line.strip()[2:] for line in said.splitlines() if line.strip().startswith("- ")]
    return SourceError(f"cannot select {len(problems)} item(s): {'; '.join(problems[:10])}", url,
                       "list files that exist under the source, relative to it")


class ViaPack(RemoteExecPack):
    """``--pack-via ssh://HOST``: mpi_stager packs over ssh on HOST, a node that mounts the source's file
    system under the same paths, into ``.pallet-outgoing-XXXXXX`` beside the source directory (in its parent,
    so the bundle is not part of the tree it packs, and on the file system the source transport reads); the
    source transport then fetches the bundle, and ``cleanup`` removes the directory over ssh."""

    needs = frozenset()             # nothing of the source's transport: the via host runs the commands
    prefix = ".pallet-outgoing-"

    @property
    def description(self) -> str:
        return f"packed via {self.options.pack_via}"

    streams = False                 # the bundle travels by the source's own transport (GridFTP, Globus)

    @property
    def parent(self) -> str:
        return posixpath.dirname(self.endpoint.path.rstrip("/")) or "/"

    def close(self) -> None:
        self.transport.close()


class PublishedBundle(PackRoute):
    """The pull source URL names a bundle (``.tar.zst``/``.tar.gz``/``.tar``) with its ``.pidx`` beside it:
    "publish once, stage many times". Nothing is packed: ``pack`` returns the bundle's own path, and
    ``cleanup`` removes nothing. ``inventory`` fetches only the ``.pidx`` and reads the tree from it."""

    description = "published bundle"
    source_is_bundle = True

    def __init__(self, endpoint: Endpoint, options: StagingOptions, transport: Transport):
        super().__init__(endpoint, options)
        self.transport = transport
        self.paths: frozenset[bytes] = frozenset()      # every entry the bundle holds, once inventory() read it

    def pack(self, codec: str, items: Sequence[str] | None = None) -> str:
        if items is not None:
            raise UsageError("a published bundle is fetched whole", self.endpoint.url(),
                             "pull the bundle, or select files from a directory URL")
        return self.endpoint.path

    def cleanup(self) -> None:
        """Nothing to remove: the bundle is the source."""

    def inventory(self) -> tuple[Inventory, Plan]:
        """The files the bundle holds (from its fetched ``.pidx``) and the fixed plan: the bundle as it is."""
        name = posixpath.basename(self.endpoint.path) + ".pidx"
        with scratch("pallet-pidx-") as workdir:
            fetched = self.transport.transfer(Direction.PULL, workdir, posixpath.dirname(self.endpoint.path), [name])
            if not fetched.ok:
                raise next(iter(fetched.failed.values()))
            with open(os.path.join(workdir, name), "rb") as handle:
                index = Index.from_bytes(handle.read(), self.endpoint.url() + ".pidx")
        self.paths = frozenset(index.paths)
        sizes = [size for kind, size in zip(index.kinds, index.sizes, strict=True) if kind == Kind.FILE]
        reason = "published bundle: fetched with its index and unpacked here as it is, without repacking"
        return Inventory(self.endpoint.path, sizes), Plan("bundle", [Candidate("bundle", 0.0, index.codec)], reason)


class BundleSource(Protocol):
    """What a route that declares ``source_is_bundle`` offers a pull (PublishedBundle does): ``inventory()``, the
    files the bundle holds and the fixed plan, read from its index; then ``paths``, every entry it holds."""

    paths: frozenset[bytes]

    def inventory(self) -> tuple[Inventory, Plan]: ...


def bundle_source(route: Route | None) -> BundleSource | None:
    """``route`` as a :class:`BundleSource` when it declares ``source_is_bundle``, else None."""
    if route is None or not route.source_is_bundle:
        return None
    return cast(BundleSource, route)       # the declaration, not the class, decides


def published_bundle(endpoint: Endpoint, transport: Transport, options: StagingOptions) -> PublishedBundle | None:
    """A PublishedBundle when ``endpoint`` names a bundle file whose ``.pidx`` sits beside it, else None. Only
    a path ending in a bundle suffix costs a ``stat`` (two, when it is a file). Raises SourceError for such a
    file without its index, and UsageError for ``--strategy individual`` (a bundle is always unpacked)."""
    if not endpoint.path.endswith(BUNDLE_SUFFIXES):
        return None
    entry = transport.stat(endpoint.path)
    if entry is None or entry.kind != "f":
        return None
    if transport.stat(endpoint.path + ".pidx") is None:
        raise SourceError("is a bundle without its index (.pidx) beside it", endpoint.url(),
                          "publish BUNDLE.pidx next to it (pallet pack writes both), or fetch the file and "
                          "run pallet unpack")
    if options.strategy == "individual":
        raise UsageError(f"{endpoint.url()} is a published bundle: it is fetched and unpacked as a bundle",
                         hint="drop --strategy individual")
    return PublishedBundle(endpoint, options, transport)


def pack_route(endpoint: Endpoint, transport: Transport, options: StagingOptions,
               far: FarSide | None = None) -> Route | None:
    """The registered pull route that packs the tree at ``endpoint`` (see :func:`register_pack_routes`), or None
    when there is none (bundling impossible)."""
    return open_route(Direction.PULL, RouteQuery(endpoint, transport, options, far))


def _check_pack_via(options: StagingOptions, direction: Direction) -> None:
    if options.pack_via and direction is Direction.PUSH:
        raise UsageError("--pack-via is for pull", hint="a push packs here; use --unpack-via ssh://HOST")
    if options.pack_via:
        open_via_endpoint(options.pack_via, "--pack-via")


def _open_pack_via(query: RouteQuery) -> ViaPack | None:
    text = query.options.pack_via
    return ViaPack(query.endpoint, query.options, open_via(text, "--pack-via", query.options)) if text else None


def register_pack_routes() -> None:
    """pallet's pull routes, asked in this order: a published bundle needs no packing (:func:`published_bundle`);
    then ``--pack-via``; then a local source packs in this process, and a source whose transport runs commands
    (ssh) packs there, with pallet when the probe found it (or was not asked), else with the far side's own
    ``tar -c`` (the tar-tools route)."""
    for spec in (
        RouteSpec("published-bundle", Direction.PULL, 10,
                  lambda q: published_bundle(q.endpoint, q.transport, q.options),
                  possible=lambda endpoint, options: endpoint.path.endswith(BUNDLE_SUFFIXES)),
        RouteSpec("pack-via", Direction.PULL, 20, _open_pack_via, _check_pack_via,
                  lambda endpoint, options: bool(options.pack_via)),
        *endpoint_routes(Direction.PULL, 30, LocalPack, RemoteExecPack),
    ):
        register_route(spec)


register_pack_routes()
