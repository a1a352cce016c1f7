"""Push orchestration above the transports: plan, then move files individually or as a bundle, verified."""
from __future__ import annotations

import os
import shlex
import shutil
import tempfile
import time
from dataclasses import dataclass

from bundles.errors import PalletError, UsageError
from bundles.writer import PackOptions, pack
from mpi_stager.comm import SerialComm
from mpi_stager.unpack import StagerOptions, unpack_parallel

from .inventory import compress_ratio, local_inventory, remote_inventory
from .planner import Plan, plan
from .profiles import load_profile
from .transports.base import Direction, Endpoint, Transport, parse_url
from .transports.errors import TransportError
from .transports.registry import open_transport

STRATEGIES = ("auto", "individual", "bundle")
INCOMING = ".pallet/incoming"


@dataclass(frozen=True)
class PushOptions:
    """How to push: strategy ('auto' asks the planner), codec, local workers, unpack ranks, remote Python,
    extra ssh options, verification, and the link profile the planner uses (None: the generic default)."""

    strategy: str = "auto"
    codec: str | None = None
    jobs: int = 0
    ranks: int = 1
    remote_python: str = "python3"
    ssh_options: tuple[str, ...] = ()
    verify: bool = True
    profile: str | None = None


@dataclass(frozen=True)
class PushResult:
    """What a push did: the plan, the strategy run, files and bytes, transfers made, seconds."""

    dest: str
    plan: Plan
    strategy: str
    files: int
    file_bytes: int
    transfers: int
    seconds: float


def push(src: str, dest_url: str, options: PushOptions = PushOptions()) -> PushResult:
    """Move the tree under local ``src`` to ``dest_url`` and return what was done.

    The planner picks individual or bundle unless ``options.strategy`` says;
    a bundle is packed locally, sent with its index in one transfer and
    unpacked at the destination by mpi_stager (locally, or over ssh with
    ``remote_python -m mpi_stager``), so a rerun after an interruption
    re-sends the deterministic bundle and unpacks only unfinished shards.
    The source is only read. Raises UsageError for a strategy the
    destination cannot run, TransportError/PalletError naming the cause.
    """
    started = time.monotonic()
    if options.strategy not in STRATEGIES:
        raise UsageError(f"unknown strategy {options.strategy!r}", hint=f"use one of {', '.join(STRATEGIES)}")
    if not os.path.isdir(src):
        raise PalletError("source is not a directory", src, "push a directory (pallet push DIR URL)")
    endpoint = parse_url(dest_url)
    inventory, paths = local_inventory(src)
    can_unpack = endpoint.scheme in ("file", "ssh")
    if options.strategy == "bundle" and not can_unpack:
        raise UsageError(f"--strategy bundle needs a way to unpack at {endpoint.url()}",
                         hint="use an ssh:// or local destination, or --strategy individual")
    chosen = plan(inventory.stats, load_profile(options.profile), compress_ratio(src, paths), options.ranks, can_unpack)
    strategy = chosen.strategy if options.strategy == "auto" else options.strategy
    strategy = "bundle" if strategy == "hybrid" else strategy
    with _open(endpoint, options) as transport:
        transport.mkdir(endpoint.path)
        transfers = (_push_individual(transport, src, endpoint) if strategy == "individual"
                     else _push_bundle(transport, src, endpoint, chosen, options))
    return PushResult(endpoint.url(), chosen, strategy, len(inventory.sizes), inventory.stats.bytes, transfers,
                      time.monotonic() - started)


def _open(endpoint: Endpoint, options: PushOptions) -> Transport:
    if endpoint.scheme == "ssh":
        return open_transport(endpoint, ssh_options=list(options.ssh_options))
    return open_transport(endpoint)


def _push_individual(transport: Transport, src: str, endpoint: Endpoint) -> int:
    result = transport.transfer(Direction.PUSH, src, endpoint.path, None)
    if not result.ok:
        names = ", ".join(sorted(result.failed)[:10])
        raise TransportError(f"{len(result.failed)} file(s) failed: {names}", endpoint.url(),
                             "see the first error above; rerun to send the rest", retryable=False)
    return 1


def _push_bundle(transport: Transport, src: str, endpoint: Endpoint, chosen: Plan, options: PushOptions) -> int:
    codec = options.codec or (chosen.chosen.codec if chosen.chosen.codec else "zstd")
    staging = tempfile.mkdtemp(prefix="pallet-push-")
    try:
        bundle = os.path.join(staging, "bundle" + {"zstd": ".tar.zst", "gzip": ".tar.gz"}.get(codec, ".tar"))
        pack(src, bundle, PackOptions(codec=codec, jobs=options.jobs))
        incoming = os.path.join(endpoint.path, INCOMING)
        transport.mkdir(incoming)
        names = [os.path.basename(bundle), os.path.basename(bundle) + ".pidx"]
        sent = transport.transfer(Direction.PUSH, staging, incoming, names)
        if not sent.ok:
            raise next(iter(sent.failed.values()))
        _unpack_there(transport, endpoint, os.path.join(incoming, names[0]), options)
        _remove_incoming(transport, endpoint, incoming, names)
        return 1
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _unpack_there(transport: Transport, endpoint: Endpoint, bundle: str, options: PushOptions) -> None:
    stager = StagerOptions(options.verify, None, max(1, options.jobs or os.cpu_count() or 1))
    if endpoint.is_local:
        unpack_parallel(SerialComm(), bundle, endpoint.path, stager)
        return
    argv = [*shlex.split(options.remote_python), "-m", "mpi_stager", "unpack", "--workers", str(stager.workers),
            *([] if options.verify else ["--no-verify"]), bundle, endpoint.path]
    transport.run(argv)


def _remove_incoming(transport: Transport, endpoint: Endpoint, incoming: str, names: list[str]) -> None:
    if endpoint.is_local:
        for name in names:
            os.unlink(os.path.join(incoming, name))
    else:
        transport.run(["rm", "-f", "--", *(os.path.join(incoming, n) for n in names)])



def pull(src_url: str, dest: str, options: PushOptions = PushOptions()) -> PushResult:
    """Move the tree at ``src_url`` into local ``dest``; the mirror of :func:`push`.

    Individual: one batch transfer of the whole tree. Bundle (ssh sources
    only): the far side packs with ``remote_python -m mpi_stager pack`` into
    ``SRC/.pallet/outgoing/`` (the bytes are deterministic, so a rerun
    re-sends identical data), the bundle and its index come back in one
    transfer, and mpi_stager unpacks them here, resumably. The planner sees
    the remote listing; without a local sample it assumes the data
    compresses to half.
    """
    started = time.monotonic()
    if options.strategy not in STRATEGIES:
        raise UsageError(f"unknown strategy {options.strategy!r}", hint=f"use one of {', '.join(STRATEGIES)}")
    endpoint = parse_url(src_url)
    can_pack = endpoint.scheme in ("file", "ssh")
    if options.strategy == "bundle" and not can_pack:
        raise UsageError(f"--strategy bundle needs a way to pack at {endpoint.url()}",
                         hint="use an ssh:// or local source, or --strategy individual")
    with _open(endpoint, options) as transport:
        inventory = remote_inventory(transport, endpoint.path)
        chosen = plan(inventory.stats, load_profile(options.profile), 0.5, options.ranks, can_pack)
        strategy = chosen.strategy if options.strategy == "auto" else options.strategy
        strategy = "bundle" if strategy == "hybrid" else strategy
        os.makedirs(dest, exist_ok=True)
        if strategy == "individual":
            _pull_individual(transport, endpoint, dest)
        else:
            _pull_bundle(transport, endpoint, dest, options)
    return PushResult(os.path.abspath(dest), chosen, strategy, len(inventory.sizes), inventory.stats.bytes, 1,
                      time.monotonic() - started)


def _pull_individual(transport: Transport, endpoint: Endpoint, dest: str) -> None:
    result = transport.transfer(Direction.PULL, dest, endpoint.path, None)
    if not result.ok:
        names = ", ".join(sorted(result.failed)[:10])
        raise TransportError(f"{len(result.failed)} file(s) failed: {names}", endpoint.url(),
                             "see the first error above; rerun to fetch the rest")


def _pull_bundle(transport: Transport, endpoint: Endpoint, dest: str, options: PushOptions) -> None:
    codec = options.codec or "zstd"
    name = "bundle.tar" + {"zstd": ".zst", "gzip": ".gz"}.get(codec, "")
    outgoing = (tempfile.mkdtemp(prefix="pallet-outgoing-") if endpoint.is_local
                else transport.run(["mktemp", "-d", "-t", "pallet-outgoing-XXXXXX"]).decode().strip())
    staging = os.path.join(dest, INCOMING)
    try:
        _pack_there(transport, endpoint, os.path.join(outgoing, name), codec, options)
        os.makedirs(staging, exist_ok=True)
        fetched = transport.transfer(Direction.PULL, staging, outgoing, [name, name + ".pidx"])
        if not fetched.ok:
            raise next(iter(fetched.failed.values()))
        stager = StagerOptions(options.verify, None, max(1, options.jobs or os.cpu_count() or 1))
        unpack_parallel(SerialComm(), os.path.join(staging, name), dest, stager)
        for leftover in (name, name + ".pidx"):
            os.unlink(os.path.join(staging, leftover))
    finally:
        if endpoint.is_local:
            shutil.rmtree(outgoing, ignore_errors=True)
        else:
            transport.run(["rm", "-rf", "--", outgoing])


def _pack_there(transport: Transport, endpoint: Endpoint, bundle: str, codec: str, options: PushOptions) -> None:
    if endpoint.is_local:
        pack(endpoint.path, bundle, PackOptions(codec=codec, jobs=options.jobs))
        return
    transport.run([*shlex.split(options.remote_python), "-m", "mpi_stager", "pack", "--comm", "serial",
                   "--codec", codec, endpoint.path, bundle])
