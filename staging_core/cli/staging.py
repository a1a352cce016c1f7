"""The staging commands of `pallet`: plan, push, pull and calibrate."""
from __future__ import annotations

import argparse
import json
import os
import shlex
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Iterator

from bundles.errors import UsageError

from staging_core.cli.display import human_bytes, jobs_arg, make_progress, report, seconds_range, size_arg, summary_line
from staging_core.planning.planner import LARGE_FILE_BYTES
from staging_core.transports.base import local_or_url

if TYPE_CHECKING:
    from staging_core.options import StagingOptions

EXIT_OK = 0
_STAGING_EPILOG = """\
routes for bundles (the planner bundles only when one exists):
  ssh:// and local destinations unpack in place (`python -m mpi_stager` there);
  gsiftp://, ftp:// and globus:// need --unpack-via ssh://HOST (a host that mounts the same
  file system under the same paths), optionally with --unpack-job slurm, or --keep-packed
  (any destination); pulls from them need --pack-via ssh://HOST, or a published bundle URL.
resume: rerun the same command after an interruption; finished shards and files are skipped.
Ctrl-C (SIGINT) or SIGTERM stops it at once: DEST stays marked incomplete, and a rerun resumes.
exit status: 0 done, 1 failure, 2 usage error, 3 transport failure, 4 destination locked,
130 interrupted (SIGINT), 143 (SIGTERM).
See docs/cli.md."""


def add_parsers(commands) -> None:
    """Add plan, push, pull and calibrate to the `pallet` sub-command set."""
    _add_plan(commands)
    _add_push(commands)
    _add_pull(commands)
    _add_calibrate(commands)


def _add_plan(commands) -> None:
    p = commands.add_parser("plan", help="show how pallet would move SRC to DEST, and why",
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            description="Inventory SRC (a local directory), sample how well it compresses, and "
                                        "predict the seconds of every strategy: individual files, one bundle, or "
                                        "a hybrid (large files individually, the rest bundled).",
                            epilog="example:\n  pallet plan data/ ssh://login.hpc/scratch/me/data --json")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dest", metavar="DEST", type=local_or_url,
                   help="destination URL or local path (an ssh host is probed once: see --reprobe)")
    p.add_argument("--ranks", type=int, default=1, metavar="N", help="ranks available to unpack (default 1)")
    p.add_argument("--remote-python", default="python3", metavar="CMD", help="as for push")
    p.add_argument("--ssh-option", action="append", default=[], metavar="OPT", help="as for push")
    p.add_argument("--reprobe", action="store_true", help="probe the ssh far side again (findings are cached an hour)")
    p.add_argument("--profile", metavar="NAME", help="link profile from `pallet calibrate` (default: generic)")
    p.add_argument("--unpack-via", metavar="SSH_URL", help="as for push: gives GridFTP/Globus destinations a route")
    p.add_argument("--keep-packed", action="store_true", help="as for push: gives any destination a route")
    p.add_argument("--json", action="store_true", help='print {"strategy", "candidates", "reason", "details"}')
    p.set_defaults(run=_run_plan)


def _run_plan(args) -> int:
    from bundles.scan import scan
    from bundles.tarformat import Kind
    from staging_core.operations.dry_run import planned_files
    from staging_core.planning.inventory import compress_ratio
    from staging_core.planning.local_profile import local_profile, uses_local_copy
    from staging_core.options import StagingOptions
    from staging_core.planning.planner import plan
    from staging_core.planning.profiles import load_profile
    from staging_core.routes.registry import check_route_options
    from staging_core.routes.unpack import has_unpack_route
    from staging_core.transports.base import Direction, parse_url
    destination = parse_url(args.dest)
    routes = StagingOptions(unpack_via=args.unpack_via, keep_packed=args.keep_packed, reprobe=args.reprobe,
                            remote_python=args.remote_python,
                            ssh_options=split_ssh_options(args.ssh_option))
    check_route_options(routes, Direction.PUSH)
    tree = scan(args.src, "none", 0)
    far, comparison = _look_at_dest(destination, routes, tree)
    inventory, paths = planned_files(tree, comparison, LARGE_FILE_BYTES)
    routed = has_unpack_route(destination, routes) if far is None else bool(far.routes())
    profile = load_profile(args.profile)
    if uses_local_copy(destination.scheme, args.profile) and not args.unpack_via and not args.keep_packed:
        profile, routed = local_profile(destination.path), False
    chosen = plan(inventory.stats, profile, compress_ratio(args.src, paths) if paths else 1.0, max(1, args.ranks),
                  bundle_possible=routed, in_place=None if comparison is None else comparison.in_place)
    source_files = sum(1 for kind in tree.index.kinds if kind == Kind.FILE)
    if args.json:
        print(json.dumps({**chosen.to_json(), "histogram": inventory.histogram(), "dest": destination.url(),
                          "far_side": None if far is None else far.to_json(), "source_files": source_files,
                          "dest_compared": comparison is not None, "files": len(inventory.sizes),
                          "file_bytes": inventory.stats.bytes,
                          "in_place": 0 if comparison is None else comparison.in_place}))
        return EXIT_OK
    print(f"{source_files} files, {human_bytes(sum(tree.index.sizes))} -> {destination.url()}")
    if comparison is not None:
        print(f"DEST compared: {comparison.in_place} files already in place, {len(inventory.sizes)} to send "
              f"({human_bytes(inventory.stats.bytes)})")
    for line in [] if far is None else far.summary():
        print(line)
    for candidate in sorted(chosen.candidates, key=lambda c: c.predicted_seconds):
        mark = "*" if candidate.strategy == chosen.strategy else " "
        extra = f" codec={candidate.codec} ranks={candidate.ranks}" if candidate.codec else ""
        print(f" {mark} {candidate.strategy:10s} predicted "
              f"{seconds_range(candidate.low_seconds, candidate.high_seconds):>14s}{extra} {candidate.note}".rstrip())
    print(f"reason: {chosen.reason}")
    return EXIT_OK


def _look_at_dest(destination, options, tree):
    """Over one connection: the far side's findings for an ssh destination without an explicit route, and DEST
    compared with ``tree`` as push compares it (local and ssh destinations holding entries). (None, None)
    where it cannot be reached: the plan is then made without them, and stderr says why."""
    import sys

    from staging_core.far_side.probe import far_side_options
    from staging_core.operations.repair import COMPARABLE_SCHEMES, compare_with_dest
    from staging_core.transports.errors import MissingDependencyError, TransportError
    from staging_core.transports.registry import open_endpoint
    if destination.scheme not in COMPARABLE_SCHEMES:
        return None, None
    try:
        with open_endpoint(destination, options) as transport:
            options, far = far_side_options(transport, destination, options, current_space=True)
            return far, compare_with_dest(transport, destination, tree)
    except (TransportError, MissingDependencyError) as exc:
        print(f"pallet plan: far side not probed, DEST not compared: {str(exc).splitlines()[0]}", file=sys.stderr)
        return None, None


def _add_push(commands) -> None:
    p = commands.add_parser("push", help="move a local directory to a destination URL, planned and verified",
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            description="Plan the transfer of SRC to DEST_URL (see `pallet plan`), then send the "
                                        "files individually (one batch), as one bundle unpacked at the far side by "
                                        "`python -m mpi_stager` (streamed over ssh, stored and forwarded otherwise), "
                                        "or hybrid (large files individually, the rest bundled).",
                            epilog="examples:\n  pallet push data/ /scratch/me/data\n"
                                   "  pallet push --remote-python /opt/pallet/bin/python data/ ssh://login.hpc/scratch/me/data\n"
                                   "  pallet push --unpack-via ssh://dtn.hpc --launcher 'srun -n 16' "
                                   "data/ gsiftp://gridftp.hpc/scratch/me/data\n"
                                   "  pallet push --unpack-via ssh://login.hpc --unpack-job slurm --ranks 16 "
                                   "--job-option=--partition=io data/ gsiftp://gridftp.hpc/scratch/me/data\n"
                                   "  pallet push --keep-packed data/ globus://ENDPOINT-UUID/scratch/me/data\n"
                                   "  pallet push --dry-run --delete data/ ssh://login.hpc/scratch/me/data   "
                                   "(what a mirror would change)\n\n"
                                   + _STAGING_EPILOG)
    p.add_argument("src", metavar="SRC", type=os.path.abspath, help="the local directory to send (only read)")
    p.add_argument("dest", metavar="DEST_URL", type=local_or_url,
                   help="a local path (relative ones too), file://, ssh://[user@]host[:port]/abs, host:/abs, "
                        "gsiftp://, ftp://, globus://")
    routes = _staging_options(p, "SRC lacks (local and ssh destinations)", "sends only what differs from SRC",
                              "sent (and deleted with --delete)")
    routes.add_argument("--unpack-via", metavar="SSH_URL",
                        help="ssh://[user@]host[:port] of a node that mounts the destination's file system "
                             "under the same paths; mpi_stager unpacks there")
    routes.add_argument("--unpack-job", choices=("slurm",),
                        help="submit the unpack as a batch job through --unpack-via (a login node) and wait for it")
    routes.add_argument("--job-option", action="append", default=[], metavar="OPT",
                        help="extra #SBATCH line for the unpack.sbatch of --unpack-job and --keep-packed, "
                             "repeatable (e.g. --job-option=--partition=io --job-option=--time=1:00:00)")
    routes.add_argument("--keep-packed", action="store_true",
                        help="leave the bundle, its index and a ready-to-submit unpack.sbatch in "
                             "DEST/.pallet/incoming (any destination); submit it later with sbatch")


def _add_pull(commands) -> None:
    p = commands.add_parser("pull", help="move a remote directory here, planned and verified",
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            description="The mirror of push: plan from one remote listing, then fetch the files "
                                        "in one batch, or have the far side pack them (`python -m mpi_stager pack`) "
                                        "and unpack the bundle here. A bundle already at the source (a .tar.zst/.gz "
                                        "with its .pidx) is fetched and unpacked without repacking.",
                            epilog="examples:\n  pallet pull --remote-python /opt/pallet/bin/python "
                                   "ssh://login.hpc/project/data data/\n"
                                   "  pallet pull --pack-via ssh://dtn.hpc gsiftp://gridftp.hpc/project/data data/\n"
                                   "  pallet pull gsiftp://gridftp.hpc/project/published.tar.zst data/\n\n"
                                   + _STAGING_EPILOG)
    p.add_argument("src", metavar="SRC_URL", type=local_or_url,
                   help="a remote directory (or a local path), or a bundle whose .pidx sits beside it")
    p.add_argument("dest", metavar="DEST", help="local destination directory (created if missing)")
    routes = _staging_options(p, "the source lacks (ssh and local sources)", "fetches only what differs",
                              "fetched (and deleted with --delete) from one listing of an ssh or local source")
    routes.add_argument("--pack-via", metavar="SSH_URL",
                        help="ssh://[user@]host[:port] of a node that mounts the source's file system under the "
                             "same paths; mpi_stager packs there into a temporary directory beside the source")


def _staging_options(p: argparse.ArgumentParser, lacks: str, rerun: str, listed: str):
    """Options push and pull share, in the sections of StagingOptions' groups (``lacks``, ``rerun`` and ``listed``
    word --delete and --dry-run for the command); return the routing section, to which each command adds its
    own routes."""
    plan = p.add_argument_group("planning: what the planner decides with, and the bundle it makes")
    plan.add_argument("--strategy", choices=("auto", "individual", "bundle", "hybrid"), default="auto",
                      help="override the planner (default: auto)")
    plan.add_argument("--codec", choices=("zstd", "gzip", "none"),
                      help="bundle codec (default: the plan's for push, zstd for pull)")
    plan.add_argument("--shard-size", type=size_arg, metavar="SIZE",
                      help="target uncompressed shard size, e.g. 16M (default: automatic, 4-64 MiB; "
                           "above 64M the bundle is stored and forwarded, not streamed)")
    plan.add_argument("--large-file", type=size_arg, default=LARGE_FILE_BYTES, metavar="SIZE",
                      help="hybrid: files at least this big travel individually (default 64M)")
    plan.add_argument("--profile", metavar="NAME", help="link profile from `pallet calibrate` (default: generic)")
    plan.add_argument("--jobs", "-j", type=jobs_arg, default=0, metavar="N",
                      help="local worker processes (default: one per CPU, none for small work)")
    far = p.add_argument_group("far side: how pallet runs there, and how it is reached")
    far.add_argument("--remote-python", default="python3", metavar="CMD",
                     help="Python with pallet on an ssh far side, used as given. By default pallet is looked for: "
                          "where `pallet remote install` put it, as python3, behind `pallet` on the login PATH or "
                          "in ~/.local/bin; without pallet there, bundles go into the far side's own tar (plain "
                          "tools)")
    far.add_argument("--ranks", type=jobs_arg, default=0, metavar="N",
                     help="far-side unpack/pack processes without a launcher (default 0: one per CPU there)")
    far.add_argument("--launcher", metavar="CMD",
                     help="start mpi_stager through this, e.g. 'mpirun -n 8' or 'srun -n 64'")
    far.add_argument("--reprobe", action="store_true",
                     help="probe the ssh far side again (its findings are cached for an hour)")
    far.add_argument("--ssh-option", action="append", default=[], metavar="OPT",
                     help="extra ssh argument, repeatable (also $PALLET_SSH_OPTIONS)")
    policy = p.add_argument_group("policy: what is checked, retried and shown")
    policy.add_argument("--no-verify", dest="verify", action="store_false", help="skip hash checks at unpack")
    policy.add_argument("--checksum", "-c", action="store_true",
                        help="when DEST already holds files, compare those whose size, mtime and mode match by "
                             "md5 too (both sides are read; md5sum runs at an ssh far side)")
    policy.add_argument("--retries", type=jobs_arg, default=2, metavar="N",
                        help="retries after network errors, each resuming (default 2)")
    shown = policy.add_mutually_exclusive_group()
    shown.add_argument("--progress", dest="progress", action="store_true", default=None,
                       help="always show per-stage progress (default: only on a terminal)")
    shown.add_argument("--quiet", "-q", dest="progress", action="store_false", help="no progress")
    policy.add_argument("--json", action="store_true", help="print a summary as JSON")
    policy.add_argument("--delete", action="store_true",
                        help=f"remove what DEST holds that {lacks}; without it such entries are kept. A rerun "
                             f"always {rerun} (type, size, mtime, mode, link target)")
    policy.add_argument("--dry-run", "-n", action="store_true", help=f"list what would be {listed}; change nothing")
    policy.add_argument("--allow-root-dest", action="store_true",
                        help="let DEST be the root directory / or a home directory itself (/root, /home, "
                             "/home/NAME, /Users/NAME, and your own $HOME for a local DEST); refused by default, "
                             "since pallet would list and mark all of it, and --delete would empty it of all else")
    routes = p.add_argument_group("routing: how bundles travel, and where they are unpacked or packed")
    routes.add_argument("--stream", choices=("auto", "on", "off"), default="auto",
                        help="stream bundles into the far-side unpacker when the transport can (default: auto)")
    p.set_defaults(run=_run_staging)
    return routes


def staging_options(args) -> StagingOptions:
    """StagingOptions from parsed push/pull arguments."""
    from staging_core.options import StagingOptions
    split = split_ssh_options(args.ssh_option)
    return StagingOptions(
        strategy=args.strategy, codec=args.codec, shard_size=args.shard_size, large_file_bytes=args.large_file,
        jobs=args.jobs, ranks=args.ranks, launcher=args.launcher,
        remote_python=args.remote_python, ssh_options=split, verify=args.verify, profile=args.profile,
        stream=args.stream, unpack_via=getattr(args, "unpack_via", None), unpack_job=getattr(args, "unpack_job", None),
        job_options=tuple(getattr(args, "job_option", ())), keep_packed=getattr(args, "keep_packed", False),
        pack_via=getattr(args, "pack_via", None), retries=args.retries, progress=args.progress,
        reprobe=args.reprobe, delete=getattr(args, "delete", False), dry_run=getattr(args, "dry_run", False),
        checksum=args.checksum, allow_root_dest=args.allow_root_dest)


def split_ssh_options(given: list[str]) -> tuple[str, ...]:
    """The ``--ssh-option`` values, each split as a shell would (``"-o ConnectTimeout=5"`` is two arguments);
    UsageError naming the value that cannot be (an unbalanced quote)."""
    split: list[str] = []
    for option in given:
        try:
            split += shlex.split(option)
        except ValueError as exc:
            raise UsageError(f"--ssh-option {option!r} cannot be split as a shell would: {exc}",
                             hint="balance its quotes, as in --ssh-option='-o \"ProxyJump=me@gate\"'") from None
    return tuple(split)


def _run_staging(args) -> int:
    """Run push or pull (the same options and summary)."""
    remote = args.dest if args.command == "push" else args.src
    with connecting_early(remote, staging_options(args)) as options:
        from staging_core.operations.push_pull import pull, push                      # loaded while ssh connects
        operation = push if args.command == "push" else pull
        result = operation(args.src, args.dest, options, make_progress(args.progress))
    report(args.json, result.to_json(), summary_line(args.command, result))
    return EXIT_OK


@contextmanager
def connecting_early(url: str, options: StagingOptions) -> Iterator[StagingOptions]:
    """``options`` for a push or pull whose far side is ``url``: for an ssh URL, with the connection to its
    host already being made (an SSHMaster in ``transport_options``, which the operation's ssh transport takes
    over), so that ssh's round trips overlap the loading of the rest of pallet; the connection is ended here
    if the operation did not take it. Other URLs: ``options`` as they are."""
    from staging_core.transports.base import parse_url
    endpoint = parse_url(url)
    if endpoint.scheme != "ssh":
        yield options
        return
    from staging_core.transports.ssh_master import SSHMaster, ssh_options_for
    master = SSHMaster(endpoint, ssh_options_for(options.ssh_options)).start()
    given = options.transport_options
    try:
        yield replace(options, transport_options={**given, "ssh": {**given.get("ssh", {}), "master": master}})
    finally:
        master.close()


def _add_calibrate(commands) -> None:
    p = commands.add_parser("calibrate", help="measure a route and store it as a named link profile",
                            description="Measure round-trip time, bandwidth (32 MiB probe), per-file cost (a batch "
                                        "of 400 tiny files), the far side's file-create rate (2,000 files by one "
                                        "process, where commands can run there), the local pack cost per file and "
                                        "zstd rates, and store them as a profile that "
                                        "`pallet plan/push/pull --profile NAME` use.",
                            epilog="example: pallet calibrate --name hpc ssh://login.hpc/scratch/me")
    p.add_argument("url", metavar="URL", type=local_or_url,
                   help="a directory on the far side; a scratch subdirectory is used there")
    p.add_argument("--name", required=True, help="profile name (letters, digits, - _ .)")
    p.add_argument("--ssh-option", action="append", default=[], metavar="OPT", help="extra ssh argument, repeatable")
    p.add_argument("--remote-python", default="python3", metavar="CMD",
                   help="Python at the far side that measures its file-create rate (default: python3)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(run=_run_calibrate)


def _run_calibrate(args) -> int:
    from staging_core.options import StagingOptions
    from staging_core.planning.profiles import calibrate, save_profile
    from staging_core.transports.base import parse_url
    from staging_core.transports.registry import open_endpoint
    endpoint = parse_url(args.url)
    options = StagingOptions(ssh_options=split_ssh_options(args.ssh_option))
    with open_endpoint(endpoint, options) as transport:
        profile = calibrate(transport, os.path.join(endpoint.path, f".pallet-calibrate-{os.getpid()}"), args.name,
                            args.remote_python)
    path = save_profile(profile)
    doc = {k: v for k, v in profile.__dict__.items() if k != "is_default"}
    report(args.json, {**doc, "path": path},
            f"profile {profile.name} saved to {path}: rtt {profile.rtt_s * 1e3:.1f} ms, "
            f"{human_bytes(profile.bandwidth)}/s, {profile.per_file_s * 1e3:.2f} ms per file, "
            f"{profile.create_rate:.0f} creates/s{'' if profile.create_rate_measured else ' (default, not measured)'}, zstd "
            f"{human_bytes(profile.compress_rate)}/s compress, {human_bytes(profile.decompress_rate)}/s decompress")
    return EXIT_OK


