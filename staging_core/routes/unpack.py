"""Routes: where a bundle is unpacked at a destination and by which command (pack routes: pack_routes.py)."""
from __future__ import annotations

import os
import posixpath
import shlex
import subprocess
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext

from bundles.errors import PalletError, UsageError
from bundles.state import prune
from mpi_stager.comm import SerialComm
from mpi_stager.summaries import StagerSummary, decode
from mpi_stager.unpack import StagerOptions, unpack_parallel

from staging_core.options import StagingOptions
from staging_core.routes.tar_tools import TarToolsRoute
from staging_core.far_side.probe import FarSide
from staging_core.far_side.slurm import SCRIPT_NAME, UnpackJob, echo_for, run_job, write_script
from staging_core.transports.base import Direction, Endpoint, Transport, parse_url
from staging_core.transports.errors import NotSupportedError
from staging_core.routes.registry import RouteQuery, RouteSpec, has_route, open_route, register_route
from staging_core.transports.registry import open_endpoint, transport_class

INCOMING = ".pallet/incoming"
JOB_KINDS = ("slurm",)
# remove the given files, then the incoming directory ($1) and DEST/.pallet while they are empty
_DISCARD_SCRIPT = 'incoming=$1; shift; rm -f -- "$@" && rmdir --ignore-fail-on-non-empty -- "$incoming" "${incoming%/*}"'

BUNDLE_SUFFIXES = (".tar.zst", ".tar.gz", ".tar")


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
    host that unpacked it): :func:`mpi_stager.summaries.decode`, SummaryError when there is none."""
    return decode(output, "unpack", where)


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


class UnpackRoute(AbstractContextManager, ABC):
    """How a bundle that has reached the destination becomes the tree there.

    ``description`` names the route for summaries. ``incoming`` is the
    directory, in the destination transport's path space, where the bundle
    and its ``.pidx`` are to be transferred (created by the caller).
    ``extra_files(bundle)`` writes files that must travel with the bundle
    (e.g. ``unpack.sbatch``) beside the local ``bundle`` and returns their
    names; the caller sends them in the same transfer. ``unpack`` turns the
    bundle into the tree at ``dest_path`` resumably (mpi_stager's journal)
    and returns only when that is done, or raises a PalletError naming the
    cause; it returns the number of shards an earlier run had already
    finished. With ``keep_journal`` a far-side unpack leaves DEST/.pallet
    for the caller, which removes it once everything has succeeded. ``removes_bundle`` tells the caller whether to delete the
    bundle afterwards with ``discard`` (False when the route leaves it for
    the user, e.g. ``--keep-packed``); ``streams`` whether a bundle stream
    can be fed straight into the unpacker there (see streaming.py). A
    route is a context manager that closes what it opened.
    """

    description = "in place"
    removes_bundle = True
    streams = False

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

    def close(self) -> None:
        """Release what the route opened (e.g. its own ssh connection)."""

    def __exit__(self, *exc) -> None:
        self.close()


class LocalUnpack(UnpackRoute):
    """The destination is a local directory: mpi_stager runs in this process (or under the launcher)."""

    def unpack(self, bundle_path: str, keep_journal: bool = False) -> int:
        if self.options.launcher:
            return _skipped(run_local(unpack_argv(self.options, bundle_path, self.endpoint.path, keep_journal,
                                                  locked=True)), self.endpoint.url())
        workers = self.options.ranks or os.cpu_count() or 1
        summary = unpack_parallel(SerialComm(), bundle_path, self.endpoint.path,
                                  StagerOptions(self.options.verify, None, workers, lock_held=True))
        return summary.shards_skipped

    def discard(self, paths: list[str]) -> None:
        for path in paths:
            os.unlink(path)
        prune(self.endpoint.path, self.incoming)


class RemoteExecUnpack(UnpackRoute):
    """The destination transport can run commands there (ssh): mpi_stager runs on that host."""

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

    @property
    def description(self) -> str:
        return f"via {self.options.unpack_via}"

    def unpack(self, bundle_path: str, keep_journal: bool = False) -> int:
        return _skipped(self.via.run(unpack_argv(self.options, bundle_path, self.endpoint.path, keep_journal)),
                        self.options.unpack_via)

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
        return f"slurm job {self.job_id} via {self.options.unpack_via}"

    def extra_files(self, bundle: str) -> list[str]:
        return job_files(bundle, self.incoming, self.endpoint.path, self.options)

    def unpack(self, bundle_path: str, keep_journal: bool = False) -> int:
        job = UnpackJob(bundle_path, self.endpoint.path)     # a job cleans up after itself: no journal is kept
        self.job_id, output = run_job(self.via.run, job, self.options.unpack_via, echo_for(self.options.progress))
        return _skipped(output, self.options.unpack_via)

    def discard(self, paths: list[str]) -> None:
        job = UnpackJob(paths[0], self.endpoint.path)
        super().discard([*paths, job.output(self.job_id), job.output(self.job_id, "err")])


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
    """Write ``unpack.sbatch`` (:func:`staging_core.far_side.slurm.write_script`) for the bundle once it is in ``incoming``
    beside local ``bundle``; return its name."""
    job = UnpackJob(posixpath.join(incoming, os.path.basename(bundle)), dest_path)
    return [write_script(os.path.dirname(bundle), job, unpack_argv(options, job.bundle, dest_path), options)]


def unpack_route(endpoint: Endpoint, transport: Transport, options: StagingOptions,
                 far: FarSide | None = None) -> UnpackRoute | TarToolsRoute | None:
    """The registered push route that unpacks bundles at ``endpoint`` (see :func:`register_unpack_routes`), or
    None when there is none (bundling impossible)."""
    return open_route(Direction.PUSH, RouteQuery(endpoint, transport, options, far))


def has_unpack_route(endpoint: Endpoint, options: StagingOptions) -> bool:
    """Whether :func:`unpack_route` would find a route, decided without contacting anything (``pallet plan``)."""
    return has_route(Direction.PUSH, endpoint, options)


def closing(route):
    """``with closing(route) as route:`` closes the route (an unpack, pack or tar-tools route) afterwards; None stays
    None."""
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


def _open_via_route(query: RouteQuery, kind: type[ViaUnpack]) -> ViaUnpack:
    return kind(query.endpoint, query.options, open_via(query.options.unpack_via, "--unpack-via", query.options))


def _runs_commands(endpoint: Endpoint) -> bool:
    """Whether the transport of ``endpoint``'s scheme can run commands there (from its class: no connection)."""
    try:
        return transport_class(endpoint.scheme).capabilities.remote_exec
    except PalletError:
        return False


def _far_pallet(query: RouteQuery) -> bool:
    """The query's transport runs commands there and pallet is there (or was not probed for)."""
    return query.transport.capabilities.remote_exec and (query.far is None or query.far.pallet_usable)


def _far_plain(query: RouteQuery) -> bool:
    """The query's transport runs commands there, the probe found no usable pallet but a decoder for tar."""
    return (query.transport.capabilities.remote_exec and query.far is not None and not query.far.pallet_usable
            and bool(query.far.tar_tools_decoder))


def endpoint_routes(direction: Direction, order: int, local: type, remote: type) -> list[RouteSpec]:
    """The routes of ``direction`` that no option asks for, at ``order``, ``order + 10`` and ``order + 20``: a
    local endpoint (``local(endpoint, options)`` runs here), then one whose transport runs commands (ssh) with
    pallet there (``remote(endpoint, options, transport)``), else with the far side's own tar (TarToolsRoute)."""
    def possible(endpoint: Endpoint, options: StagingOptions) -> bool:
        return _runs_commands(endpoint)
    pulling = direction is Direction.PULL
    return [
        RouteSpec("local", direction, order, lambda q: local(q.endpoint, q.options) if q.endpoint.is_local else None,
                  possible=lambda endpoint, options: endpoint.is_local),
        RouteSpec("remote", direction, order + 10,
                  lambda q: remote(q.endpoint, q.options, q.transport) if _far_pallet(q) else None, possible=possible),
        RouteSpec("tar-tools", direction, order + 20,
                  lambda q: TarToolsRoute(q.endpoint.host, q.far.tar_tools_decoder, pulling) if _far_plain(q) else None,
                  possible=possible),
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
                  lambda q: _open_via_route(q, SlurmJobUnpack) if q.options.unpack_via and q.options.unpack_job
                  else None, _check_unpack_job, lambda endpoint, options: bool(options.unpack_via)),
        RouteSpec("unpack-via", Direction.PUSH, 30,
                  lambda q: _open_via_route(q, ViaUnpack) if q.options.unpack_via else None,
                  _check_unpack_via, lambda endpoint, options: bool(options.unpack_via)),
        *endpoint_routes(Direction.PUSH, 40, LocalUnpack, RemoteExecUnpack),
    ):
        register_route(spec)


def open_via_endpoint(text: str, flag: str) -> Endpoint:
    """The ssh endpoint of a via option (``--unpack-via``/``--pack-via``); UsageError naming the flag otherwise."""
    hint = f"{flag} ssh://[user@]host[:port]: a host that mounts the same file system"
    endpoint = parse_url(text, path_required=False) if text.startswith("ssh://") else None
    if endpoint is None or endpoint.scheme != "ssh":
        raise UsageError(f"{flag} takes an ssh:// URL, not {text!r}", hint=hint)
    return endpoint


def open_via(text: str, flag: str, options: StagingOptions) -> Transport:
    return open_endpoint(open_via_endpoint(text, flag), options)


def bundle_name(codec: str) -> str:
    """The file name a pushed or pulled bundle gets for ``codec``."""
    return "bundle.tar" + {"zstd": ".zst", "gzip": ".gz"}.get(codec, "")


register_unpack_routes()
