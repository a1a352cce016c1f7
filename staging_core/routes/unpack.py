"""Push routes: where a bundle is unpacked at a destination and by which command (pull routes: pack.py)."""
from __future__ import annotations

import os
import posixpath
import shlex
import subprocess
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from typing import ClassVar, Protocol, cast

from bundles.errors import PalletError, UsageError
from bundles.state import prune
from bundles.unpacking import UnpackOptions, unpack as unpack_bundle
from mpi_stager.wire import StagerSummary, decode_summary

from staging_core.options import StagingOptions
from staging_core.far_side.probe import FarSide
from staging_core.far_side.slurm import SCRIPT_NAME, UnpackJob, echo_for, run_job, write_script
from staging_core.routes.base import HYBRID, STORE_AND_FORWARD, STREAM, Route, declaring, transport_capable
from staging_core.routes.registry import RouteQuery, RouteSpec, has_route, open_route, register_route
from staging_core.routes.tar_tools import TarToolsRoute
from staging_core.transports.base import Direction, Endpoint, Transport, parse_url
from staging_core.transports.registry import capable, declared_capabilities
from staging_core.transports.errors import NotSupportedError
from staging_core.transports.registry import open_endpoint, transport_class

INCOMING = ".pallet/incoming"
JOB_KINDS = ("slurm",)
# remove the given files, then the incoming directory ($1) and DEST/.pallet while they are empty
_DISCARD_SCRIPT = ('incoming=$1; shift; rm -f -- "$@" && '
                   'rmdir --ignore-fail-on-non-empty -- "$incoming" "${incoming%/*}"')

BUNDLE_SUFFIXES = (".tar.zst", ".tar.gz", ".tar")
# What the transport of a via host (--unpack-via, --pack-via) must declare: it runs mpi_stager and sh scripts there.
VIA_NEEDS = frozenset({"remote_exec", "posix_shell"})


def stager_argv(options: StagingOptions, command: str, *args: str) -> list[str]:
    """The far-side command ``[launcher] remote_python -m mpi_stager COMMAND ARGS``.

    Without a launcher one process runs ``--workers ranks`` (0: one per CPU
    of that host) for unpacks; with one (``mpirun -n 8``, ``srun -n 64``)
    the launcher decides the ranks.
    """
    launcher = shlex.split(options.launcher) if options.launcher else []
    workers = ["--workers", str(options.ranks)] if command == "unpack" and not launcher else []
    return [*launcher, *shlex.split(options.remote_python), "-m", "mpi_stager", command, *workers, *args]


def unpack_argv(options: StagingOptions, bundle_path: str, dest_path: str, keep_journal: bool = False,
                locked: bool = False) -> list[str]:
    """The far-side unpack command; it prints its summary as JSON (see :func:`unpack_summary`). With
    ``keep_journal`` it leaves DEST/.pallet for the push to remove when all is done (a push killed after the
    unpack finished then resumes without extracting anything again); ``locked``: the push holds DEST's lock
    (without it, mpi_stager takes the lock itself)."""
    flags = ([] if options.verify else ["--no-verify"]) + (["--keep-journal"] if keep_journal else []) \
        + (["--locked-by-caller"] if locked else [])
    return stager_argv(options, "unpack", "--json", *flags, bundle_path, dest_path)


def unpack_summary(output: bytes, where: str) -> StagerSummary:
    """The summary ``mpi_stager unpack --json`` printed last in ``output`` at ``where`` (the destination, or the
    host that unpacked it): :func:`mpi_stager.wire.decode_summary`, SummaryError when there is none."""
    return decode_summary(output, "unpack", where)


def _skipped(output: bytes, where: str) -> int:
    """Shards an earlier run had finished, from :func:`unpack_summary`."""
    return unpack_summary(output, where).shards_skipped


def run_local(argv: list[str]) -> bytes:
    """Run ``argv`` here and return its stdout; raise PalletError with its last stderr line if it fails."""
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True)
    except FileNotFoundError:
        raise UsageError(f"cannot run {argv[0]!r}", hint="check --launcher / --remote-python") from None
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines() or ["(no message)"]
        raise PalletError(f"{shlex.join(argv[:4])} ... failed with status {done.returncode}: {lines[-1]}",
                          hint="see the message; rerun to resume")
    return done.stdout


class UnpackRoute(Route, ABC):
    """How a bundle that has reached the destination becomes the tree there: the interface a push's
    ``store-and-forward`` and ``hybrid`` strategies call (see :class:`~staging_core.routes.base.Route` for what
    every route declares).

    ``description`` names the route for summaries. ``incoming`` is the
    directory, in the destination transport's path space, where the bundle
    and its ``.pidx`` are to be transferred (created by the caller).
    ``extra_files(bundle)`` writes files that must travel with the bundle
    (e.g. ``unpack.sbatch``) beside the local ``bundle`` and returns their
    names; the caller sends them in the same transfer. ``unpack`` turns the
    bundle into the tree at ``dest_path`` resumably (the unpack driver's journal, bundles.journal)
    and returns only when that is done, or raises a PalletError naming the
    cause; it returns the number of shards an earlier run had already
    finished. With ``keep_journal`` a far-side unpack leaves DEST/.pallet
    for the caller, which removes it once everything has succeeded.
    ``removes_bundle`` tells the caller whether to delete the bundle
    afterwards with ``discard`` (False when the route leaves it for the
    user, e.g. ``--keep-packed``); ``streams`` whether a bundle stream can
    be fed straight into the unpacker there (see streaming.py). Every
    unpack route carries the ``stream``, ``store-and-forward`` and
    ``hybrid`` strategies unless it declares fewer. A route is a context
    manager that closes what it opened.
    """

    strategies: ClassVar[frozenset[str]] = frozenset({STREAM, STORE_AND_FORWARD, HYBRID})
    removes_bundle = True

    def __init__(self, endpoint: Endpoint, options: StagingOptions):
        self.endpoint = endpoint
        self.options = options

    @property
    def incoming(self) -> str:
        return os.path.join(self.endpoint.path, INCOMING)

    def extra_files(self, bundle: str) -> list[str]:
        """Names of the files written beside local ``bundle`` to send with it (none by default)."""
        return []

    @abstractmethod
    def unpack(self, bundle_path: str, keep_journal: bool = False) -> int: ...

    def discard(self, paths: list[str]) -> None:
        """Delete ``paths`` (bundle, index and extra files in ``incoming``) at the destination after the unpack,
        then ``incoming`` and DEST/.pallet if that leaves them empty; routes that keep the bundle
        (``removes_bundle`` False) delete nothing."""
        if self.removes_bundle:
            self.run_there(["sh", "-c", _DISCARD_SCRIPT, "sh", self.incoming, *paths])

    def run_there(self, argv: list[str], stdin: bytes | None = None) -> bytes:
        """Run ``argv`` (fed ``stdin``) on a host that sees the destination's files (NotSupportedError where none
        does)."""
        raise NotSupportedError(f"nothing runs where {self.endpoint.url()} is", self.endpoint.url())


def unpacker(route: Route | None, strategy: str) -> UnpackRoute:
    """``route`` as the UnpackRoute a push's ``strategy`` (``store-and-forward``, ``hybrid``) calls: a route that
    lists that strategy implements this interface (the Route contract); PalletError when it does not list it."""
    return cast(UnpackRoute, declaring(route, strategy))   # the declaration, not the class, decides


class LocalUnpack(UnpackRoute):
    """The destination is a local directory: the unpack driver runs in this process (mpi_stager under a
    launcher)."""

    needs = frozenset({"local_copy"})

    def unpack(self, bundle_path: str, keep_journal: bool = False) -> int:
        if self.options.launcher:
            return _skipped(run_local(unpack_argv(self.options, bundle_path, self.endpoint.path, keep_journal,
                                                  locked=True)), self.endpoint.url())
        result = unpack_bundle(bundle_path, self.endpoint.path,
                               UnpackOptions(verify=self.options.verify, lock_held=True, max_jobs=self.options.ranks))
        return result.shards_skipped

    def discard(self, paths: list[str]) -> None:
        for path in paths:
            os.unlink(path)
        prune(self.endpoint.path, self.incoming)


class RemoteExecUnpack(UnpackRoute):
    """The destination transport can run commands there (ssh): mpi_stager runs on that host."""

    needs = frozenset({"remote_exec", "posix_shell"})

    def __init__(self, endpoint: Endpoint, options: StagingOptions, transport: Transport):
        super().__init__(endpoint, options)
        self.transport = transport

    @property
    def streams(self) -> bool:
        """A stream goes into one far-side process; a launcher asks for MPI ranks, which store and forward."""
        return not self.options.launcher

    def unpack(self, bundle_path: str, keep_journal: bool = False) -> int:
        return _skipped(self.transport.run(unpack_argv(self.options, bundle_path, self.endpoint.path, keep_journal,
                                                       locked=True)), self.endpoint.url())

    def run_there(self, argv: list[str], stdin: bytes | None = None) -> bytes:
        return self.transport.run(argv, stdin)


class ViaUnpack(UnpackRoute):
    """``--unpack-via ssh://HOST``: the bundle arrives through the destination transport (GridFTP, Globus, or
    any other), then mpi_stager unpacks it over ssh on HOST, a node that mounts the destination's file system
    under the same paths: the destination URL's path is used there as it is."""

    def __init__(self, endpoint: Endpoint, options: StagingOptions, via: Transport):
        super().__init__(endpoint, options)
        self.via = via
        self.via_url = options.unpack_via or via.endpoint.url()      # as the user wrote it

    @property
    def description(self) -> str:
        return f"via {self.via_url}"

    def unpack(self, bundle_path: str, keep_journal: bool = False) -> int:
        return _skipped(self.via.run(unpack_argv(self.options, bundle_path, self.endpoint.path, keep_journal)),
                        self.via_url)

    def run_there(self, argv: list[str], stdin: bytes | None = None) -> bytes:
        return self.via.run(argv, stdin)

    def close(self) -> None:
        self.via.close()


class SlurmJobUnpack(ViaUnpack):
    """``--unpack-job slurm --unpack-via ssh://LOGIN``: ``unpack.sbatch`` (see :func:`job_files`) travels with
    the bundle; it is submitted on LOGIN with ``sbatch --parsable`` and pallet waits for the job (squeue, then
    sacct), printing each new state when progress is shown. A job that ends in any state but COMPLETED raises
    SlurmJobError naming its id and state; its script and output stay beside the bundle."""

    job_id: str | None = None

    @property
    def description(self) -> str:
        return f"slurm job {self.job_id} via {self.via_url}"

    def extra_files(self, bundle: str) -> list[str]:
        return job_files(bundle, self.incoming, self.endpoint.path, self.options)

    def unpack(self, bundle_path: str, keep_journal: bool = False) -> int:
        job = UnpackJob(bundle_path, self.endpoint.path)     # a job cleans up after itself: no journal is kept
        self.job_id, output = run_job(self.via.run, job, self.via_url, echo_for(self.options.progress))
        return _skipped(output, self.via_url)

    def discard(self, paths: list[str]) -> None:
        job = UnpackJob(paths[0], self.endpoint.path)
        outputs = [] if self.job_id is None else [job.output(self.job_id), job.output(self.job_id, "err")]
        super().discard([*paths, *outputs])


class KeepPacked(UnpackRoute):
    """``--keep-packed``: the bundle, its ``.pidx`` and a ready-to-submit ``unpack.sbatch`` (the script
    ``--unpack-job slurm`` would submit) stay in ``DEST/.pallet/incoming``; nothing is unpacked. The user
    submits the script later; it can be run again to resume."""

    removes_bundle = False

    @property
    def description(self) -> str:
        return f"kept packed: sbatch {posixpath.join(self.incoming, SCRIPT_NAME)}"

    def extra_files(self, bundle: str) -> list[str]:
        return job_files(bundle, self.incoming, self.endpoint.path, self.options)

    def unpack(self, bundle_path: str, keep_journal: bool = False) -> int:
        return 0


def job_files(bundle: str, incoming: str, dest_path: str, options: StagingOptions) -> list[str]:
    """Write ``unpack.sbatch`` (:func:`staging_core.far_side.slurm.write_script`) for the bundle once it is in
    ``incoming`` beside local ``bundle``; return its name."""
    job = UnpackJob(posixpath.join(incoming, os.path.basename(bundle)), dest_path)
    return [write_script(os.path.dirname(bundle), job, unpack_argv(options, job.bundle, dest_path), options)]


def unpack_route(endpoint: Endpoint, transport: Transport, options: StagingOptions,
                 far: FarSide | None = None) -> Route | None:
    """The registered push route that unpacks bundles at ``endpoint`` (see :func:`register_unpack_routes`), or
    None when there is none (bundling impossible)."""
    return open_route(Direction.PUSH, RouteQuery(endpoint, transport, options, far))


def has_unpack_route(endpoint: Endpoint, options: StagingOptions) -> bool:
    """Whether :func:`unpack_route` would find a route, decided without contacting anything (``pallet plan``)."""
    return has_route(Direction.PUSH, endpoint, options)


def closing(route: Route | None) -> AbstractContextManager:
    """``with closing(route) as route:`` closes the route afterwards; None stays None."""
    return nullcontext() if route is None else route


def _push_only(options: StagingOptions, direction: Direction) -> None:
    if direction is Direction.PULL and (options.unpack_via or options.unpack_job or options.keep_packed
                                        or options.job_options):
        raise UsageError("--unpack-via, --unpack-job, --job-option and --keep-packed are for push",
                         hint="a pull unpacks here; --pack-via ssh://HOST packs at a GridFTP/Globus source")


def _check_keep_packed(options: StagingOptions, direction: Direction) -> None:
    _push_only(options, direction)
    if options.keep_packed and (options.unpack_via or options.unpack_job):
        raise UsageError("--keep-packed leaves the bundle packed: it does not go with --unpack-via/--unpack-job",
                         hint="choose one: unpack now (--unpack-via) or later (--keep-packed, then sbatch)")


def _check_unpack_job(options: StagingOptions, direction: Direction) -> None:
    _push_only(options, direction)
    if options.unpack_job is not None and options.unpack_job not in JOB_KINDS:
        raise UsageError(f"unknown --unpack-job {options.unpack_job!r}", hint=f"use one of {', '.join(JOB_KINDS)}")
    if options.unpack_job and not options.unpack_via:
        raise UsageError(f"--unpack-job {options.unpack_job} needs --unpack-via",
                         hint="name the login node that runs sbatch: --unpack-via ssh://login.hpc")
    if options.job_options and not (options.unpack_job or options.keep_packed):
        raise UsageError("--job-option needs --unpack-job slurm or --keep-packed",
                         hint="job options go into the unpack.sbatch script those write")


def _check_unpack_via(options: StagingOptions, direction: Direction) -> None:
    _push_only(options, direction)
    if options.unpack_via:
        open_via_endpoint(options.unpack_via, "--unpack-via")


def _open_via_route(query: RouteQuery, kind: type[ViaUnpack]) -> ViaUnpack | None:
    text = query.options.unpack_via
    return kind(query.endpoint, query.options, open_via(text, "--unpack-via", query.options)) if text else None


def serves(endpoint: Endpoint, needs: frozenset[str]) -> bool:
    """Whether the transport of ``endpoint``'s scheme declares every capability of ``needs`` and can be opened
    here (its programs are installed), decided from its class, without connecting (``pallet plan``)."""
    try:
        return capable(transport_class(endpoint.scheme).capabilities, needs)
    except PalletError:
        return False


def _far_pallet(query: RouteQuery, needs: frozenset[str]) -> bool:
    """The query's transport declares ``needs`` and pallet is there (or was not probed for)."""
    return transport_capable(query.transport, needs) and (query.far is None or query.far.pallet_usable)


def _open_tar_tools(query: RouteQuery, pulling: bool) -> TarToolsRoute | None:
    """The tar-tools route where the query's transport declares what it needs and the probe found no usable
    pallet there but a decoder for tar."""
    far = query.far
    if far is None or far.pallet_usable or not far.tar_tools_decoder \
            or not transport_capable(query.transport, TarToolsRoute.needs):
        return None
    return TarToolsRoute(query.endpoint.host or "", far.tar_tools_decoder, pulling)


class LocalKind(Protocol):
    """A route class for a local endpoint, made from the endpoint and the options (LocalUnpack, LocalPack)."""

    needs: frozenset[str]

    def __call__(self, endpoint: Endpoint, options: StagingOptions) -> Route: ...


class RemoteKind(Protocol):
    """A route class that runs at the far side through the endpoint's transport (RemoteExecUnpack, ...)."""

    needs: frozenset[str]

    def __call__(self, endpoint: Endpoint, options: StagingOptions, transport: Transport) -> Route: ...


def endpoint_routes(direction: Direction, order: int, local: LocalKind, remote: RemoteKind) -> list[RouteSpec]:
    """The routes of ``direction`` that no option asks for, at ``order``, ``order + 10`` and ``order + 20``: a
    ``local`` route (``local(endpoint, options)``) where the endpoint's transport declares ``local.needs`` (the
    endpoint is this host's file system), then a ``remote`` one (``remote(endpoint, options, transport)``) where
    it declares ``remote.needs`` (it runs commands there: ssh) and pallet is there, else the far side's own tar
    (TarToolsRoute, where it declares ``TarToolsRoute.needs``)."""
    pulling = direction is Direction.PULL
    return [
        RouteSpec("local", direction, order,
                  lambda q: local(q.endpoint, q.options) if transport_capable(q.transport, local.needs) else None,
                  possible=lambda endpoint, options: serves(endpoint, local.needs)),
        RouteSpec("remote", direction, order + 10,
                  lambda q: remote(q.endpoint, q.options, q.transport) if _far_pallet(q, remote.needs) else None,
                  possible=lambda endpoint, options: serves(endpoint, remote.needs)),
        RouteSpec("tar-tools", direction, order + 20, lambda q: _open_tar_tools(q, pulling),
                  possible=lambda endpoint, options: serves(endpoint, TarToolsRoute.needs)),
    ]


def register_unpack_routes() -> None:
    """pallet's push routes, asked in this order: explicit options first (``--keep-packed``, ``--unpack-via``
    with or without ``--unpack-job``), then a local destination unpacks in this process, then a destination
    whose transport runs commands (ssh) unpacks there, with pallet when the probe found it (or was not asked),
    else with the far side's own tar when it can (the tar-tools route, see tar_tools.py)."""
    for spec in (
        RouteSpec("keep-packed", Direction.PUSH, 10,
                  lambda q: KeepPacked(q.endpoint, q.options) if q.options.keep_packed else None,
                  _check_keep_packed, lambda endpoint, options: options.keep_packed),
        RouteSpec("slurm-job", Direction.PUSH, 20,
                  lambda q: _open_via_route(q, SlurmJobUnpack) if q.options.unpack_job else None,
                  _check_unpack_job, lambda endpoint, options: bool(options.unpack_via)),
        RouteSpec("unpack-via", Direction.PUSH, 30, lambda q: _open_via_route(q, ViaUnpack),
                  _check_unpack_via, lambda endpoint, options: bool(options.unpack_via)),
        *endpoint_routes(Direction.PUSH, 40, LocalUnpack, RemoteExecUnpack),
    ):
        register_route(spec)


def open_via_endpoint(text: str, flag: str) -> Endpoint:
    """The endpoint of a via option (``--unpack-via``/``--pack-via``): a ``scheme://host`` URL whose transport
    declares VIA_NEEDS (it runs pallet's commands there: ssh); UsageError naming the flag otherwise."""
    hint = f"{flag} ssh://[user@]host[:port]: a host that mounts the same file system"
    try:
        endpoint = parse_url(text, path_required=False) if "://" in text else None
    except UsageError:
        endpoint = None
    if endpoint is None or not capable(declared_capabilities(endpoint.scheme), VIA_NEEDS):
        raise UsageError(f"{flag} takes an ssh:// URL (a host pallet can run commands on), not {text!r}", hint=hint)
    return endpoint


def open_via(text: str, flag: str, options: StagingOptions) -> Transport:
    return open_endpoint(open_via_endpoint(text, flag), options)


def bundle_name(codec: str) -> str:
    """The file name a pushed or pulled bundle gets for ``codec``."""
    return "bundle.tar" + {"zstd": ".zst", "gzip": ".gz"}.get(codec, "")


register_unpack_routes()
