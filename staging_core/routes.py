"""Routes: where a bundle is unpacked at a destination, or packed at a source, and by which command."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tempfile
from abc import ABC, abstractmethod

from bundles.errors import PalletError, UsageError
from bundles.writer import PackOptions, pack
from mpi_stager.comm import SerialComm
from mpi_stager.unpack import StagerOptions, unpack_parallel

from .options import StagingOptions
from .transports.base import Endpoint, Transport

INCOMING = ".pallet/incoming"


def stager_argv(options: StagingOptions, command: str, *args: str) -> list[str]:
    """The far-side command ``[launcher] remote_python -m mpi_stager COMMAND ARGS``.

    Without a launcher one process runs ``--workers ranks`` (0: one per CPU
    of that host) for unpacks; with one (``mpirun -n 8``, ``srun -n 64``)
    the launcher decides the ranks.
    """
    launcher = shlex.split(options.launcher) if options.launcher else []
    workers = ["--workers", str(options.ranks)] if command == "unpack" and not launcher else []
    return [*launcher, *shlex.split(options.remote_python), "-m", "mpi_stager", command, *workers, *args]


def unpack_argv(options: StagingOptions, bundle_path: str, dest_path: str) -> list[str]:
    """The far-side unpack command; it prints its summary as JSON (see :func:`_skipped`)."""
    verify = [] if options.verify else ["--no-verify"]
    return stager_argv(options, "unpack", "--json", *verify, bundle_path, dest_path)


def _skipped(output: bytes) -> int:
    """Shards an earlier run had finished, from the JSON summary mpi_stager printed last."""
    lines = output.decode(errors="replace").strip().splitlines()
    try:
        return int(json.loads(lines[-1])["shards_skipped"])
    except (IndexError, ValueError, KeyError, TypeError):
        raise PalletError("mpi_stager unpack printed no summary", hint="check the far side's pallet version") from None


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


class UnpackRoute(ABC):
    """How a bundle that has reached the destination becomes the tree there.

    ``description`` names the route for summaries. ``incoming`` is the
    directory, in the destination transport's path space, where the bundle
    and its ``.pidx`` are to be transferred (created by the caller).
    ``unpack`` turns the bundle into the tree at ``dest_path`` resumably
    (mpi_stager's journal) and returns only when that is done, or raises a
    PalletError naming the cause; it returns the number of shards an
    earlier run had already finished. ``removes_bundle`` tells the caller
    whether to delete the bundle afterwards (False when the route leaves it
    for the user, e.g. ``--keep-packed``); ``streams`` whether a bundle
    stream can be fed straight into the unpacker there (see streaming.py).
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

    @abstractmethod
    def unpack(self, bundle_path: str) -> int: ...

    def close(self) -> None:
        """Release what the route opened (e.g. its own ssh connection)."""


class LocalUnpack(UnpackRoute):
    """The destination is a local directory: mpi_stager runs in this process (or under the launcher)."""

    def unpack(self, bundle_path: str) -> int:
        if self.options.launcher:
            return _skipped(run_local(unpack_argv(self.options, bundle_path, self.endpoint.path)))
        workers = self.options.ranks or os.cpu_count() or 1
        summary = unpack_parallel(SerialComm(), bundle_path, self.endpoint.path,
                                  StagerOptions(self.options.verify, None, workers))
        return summary.shards_skipped


class RemoteExecUnpack(UnpackRoute):
    """The destination transport can run commands there (ssh): mpi_stager runs on that host."""

    def __init__(self, endpoint: Endpoint, options: StagingOptions, transport: Transport):
        super().__init__(endpoint, options)
        self.transport = transport

    def unpack(self, bundle_path: str) -> int:
        return _skipped(self.transport.run(unpack_argv(self.options, bundle_path, self.endpoint.path)))


def unpack_route(endpoint: Endpoint, transport: Transport, options: StagingOptions) -> UnpackRoute | None:
    """The route that unpacks bundles at ``endpoint``, or None when there is none (bundling impossible)."""
    if endpoint.is_local:
        return LocalUnpack(endpoint, options)
    if transport.capabilities.remote_exec:
        return RemoteExecUnpack(endpoint, options, transport)
    return None


class PackRoute(ABC):
    """How the tree at a pull source becomes a bundle there.

    ``pack`` writes the bundle and its ``.pidx`` under ``outgoing`` (a
    directory in the source transport's path space that the route creates)
    and returns the bundle's path; ``cleanup`` removes what ``pack`` made.
    The bytes depend only on the tree and the codec, so a rerun sends the
    same bundle and the local unpack skips finished shards.
    """

    description = "in place"

    def __init__(self, endpoint: Endpoint, options: StagingOptions):
        self.endpoint = endpoint
        self.options = options
        self.outgoing: str | None = None

    @abstractmethod
    def pack(self, codec: str) -> str: ...

    @abstractmethod
    def cleanup(self) -> None: ...


class LocalPack(PackRoute):
    """The source is local: pack in this process into a temporary directory."""

    def pack(self, codec: str) -> str:
        self.outgoing = tempfile.mkdtemp(prefix="pallet-outgoing-")
        bundle = os.path.join(self.outgoing, bundle_name(codec))
        pack(self.endpoint.path, bundle, PackOptions(codec=codec, jobs=self.options.jobs))
        return bundle

    def cleanup(self) -> None:
        if self.outgoing:
            shutil.rmtree(self.outgoing, ignore_errors=True)


class RemoteExecPack(PackRoute):
    """The source transport can run commands there (ssh): mpi_stager packs into a mktemp directory."""

    def __init__(self, endpoint: Endpoint, options: StagingOptions, transport: Transport):
        super().__init__(endpoint, options)
        self.transport = transport

    def pack(self, codec: str) -> str:
        self.outgoing = self.transport.run(["mktemp", "-d", "-t", "pallet-outgoing-XXXXXX"]).decode().strip()
        bundle = os.path.join(self.outgoing, bundle_name(codec))
        comm = [] if self.options.launcher else ["--comm", "serial"]
        self.transport.run(stager_argv(self.options, "pack", *comm, "--codec", codec, self.endpoint.path, bundle))
        return bundle

    def cleanup(self) -> None:
        if self.outgoing:
            self.transport.run(["rm", "-rf", "--", self.outgoing])


def pack_route(endpoint: Endpoint, transport: Transport, options: StagingOptions) -> PackRoute | None:
    """The route that packs the tree at ``endpoint``, or None when there is none (bundling impossible)."""
    if endpoint.is_local:
        return LocalPack(endpoint, options)
    if transport.capabilities.remote_exec:
        return RemoteExecPack(endpoint, options, transport)
    return None


def bundle_name(codec: str) -> str:
    """The file name a pushed or pulled bundle gets for ``codec``."""
    return "bundle.tar" + {"zstd": ".zst", "gzip": ".gz"}.get(codec, "")
