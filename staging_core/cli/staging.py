"""The staging commands of `pallet`: plan, push, pull and calibrate."""
from __future__ import annotations

import argparse
import json
import os
import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from bundles.errors import UsageError

from staging_core.cli.display import human_bytes, jobs_arg, make_progress, report, seconds_range, size_arg, summary_line
from staging_core.options import GROUPS, OptionDeclaration, StagingOptions, TransportSetting, declarations, \
    transport_settings
from staging_core.planning.planner import LARGE_FILE_BYTES
from staging_core.transports.base import local_or_url

if TYPE_CHECKING:
    from staging_core.transports.base import EarlyConnection

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
    add_declared_options(p, "plan")
    p.add_argument("--json", action="store_true", help='print {"strategy", "candidates", "reason", "details"}')
    p.set_defaults(run=_run_plan)


def _run_plan(args) -> int:
    from bundles.scan import scan
    from bundles.tarformat import Kind
    from staging_core.operations.dry_run import planned_files
    from staging_core.planning.inventory import compress_ratio
    from staging_core.planning.local_profile import local_profile, uses_local_copy
    from staging_core.planning.planner import plan
    from staging_core.planning.profiles import load_profile
    from staging_core.routes.registry import check_route_options
    from staging_core.routes.unpack import has_unpack_route
    from staging_core.transports.base import Direction, parse_url
    destination = parse_url(args.dest)
    routes = staging_options(args, "plan")
    check_route_options(routes, Direction.PUSH)
    tree = scan(args.src, "none", 0)
    far, comparison = _look_at_dest(destination, routes, tree)
    inventory, paths = planned_files(tree, comparison, LARGE_FILE_BYTES)
    routed = has_unpack_route(destination, routes) if far is None else bool(far.routes())
    profile = load_profile(routes.profile)
    if uses_local_copy(destination.scheme, routes.profile) and not routes.unpack_via and not routes.keep_packed:
        profile, routed = local_profile(destination.path), False
    chosen = plan(inventory.stats, profile, compress_ratio(args.src, paths) if paths else 1.0, max(1, routes.ranks),
                  bundle_possible=routed, in_place=None if comparison is None else comparison.in_place,
                  level=routes.level)
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
    from staging_core.operations.repair import compare_with_dest, lists_exactly
    from staging_core.transports.errors import MissingDependencyError, TransportError
    from staging_core.transports.registry import open_endpoint
    if not lists_exactly(destination):
        return None, None
    try:
        with open_endpoint(destination, options) as transport:
            options, far = far_side_options(transport, destination, options, current_space=True)
            tar_tools = far is not None and far.routes()[:1] == ["tar tools"]     # its tar sets whole seconds
            return far, compare_with_dest(transport, destination, tree, whole_seconds=tar_tools)
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
    add_declared_options(p, "push")
    p.set_defaults(run=_run_staging)


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
    add_declared_options(p, "pull")
    p.set_defaults(run=_run_staging)


# how --delete and --dry-run are worded for each command (OptionDeclaration.help's {lacks}, {rerun}, {listed})
_WORDS = {"push": {"lacks": "SRC lacks (local and ssh destinations)", "rerun": "sends only what differs from SRC",
                   "listed": "sent (and deleted with --delete)"},
          "pull": {"lacks": "the source lacks (ssh and local sources)", "rerun": "fetches only what differs",
                   "listed": "fetched (and deleted with --delete) from one listing of an ssh or local source"}}
_METAVARS: dict[type, str] = {int: "N", float: "SECONDS", str: "VALUE"}


def add_declared_options(p: argparse.ArgumentParser, command: str) -> None:
    """The options ``command`` (plan, push or pull) takes, built from their declarations
    (staging_core.options.OPTION_DECLARATIONS), each in the section of its group; push and pull also take every
    option a transport declares (staging_core.options.transport_settings), as --SCHEME-NAME in the transports
    section, and --json in the policy section."""
    for group in GROUPS:
        chosen = declarations(group.attribute, command=command)
        offered = transport_settings() if group.attribute == "transports" and command != "plan" else ()
        json_here = group.attribute == "policy" and command != "plan"
        if not (chosen or offered or json_here):
            continue
        section = p.add_argument_group(group.section)
        for declared in chosen:
            _add_declared(section, declared, command)
        for setting in offered:
            _add_transport_setting(section, setting)
        if json_here:
            section.add_argument("--json", action="store_true", help="print a summary as JSON")


def _add_declared(section, declared: OptionDeclaration, command: str) -> None:
    """One declared option as argparse arguments (its value in ``args.NAME``)."""
    words = _WORDS.get(command)
    text = declared.help.format_map(words) if words else declared.help
    default = declared.command_line_default
    if declared.type is bool:
        if declared.negative_flags:              # --progress / --quiet: True, False or not given (None)
            either = section.add_mutually_exclusive_group()
            either.add_argument(*declared.flags, dest=declared.name, action="store_true", default=default,
                                help=text)
            either.add_argument(*declared.negative_flags, dest=declared.name, action="store_false",
                                help=declared.negative_help)
        else:                                    # --no-verify sets False; --keep-packed sets True
            section.add_argument(*declared.flags, dest=declared.name,
                                 action="store_false" if default else "store_true", help=text)
        return
    if declared.multiple:
        text += " (repeatable)"
    elif "default" not in text and default is not None:
        text += f" (default: {default})"
    section.add_argument(*declared.flags, dest=declared.name, metavar=declared.metavar, help=text,
                         choices=declared.choices or None, type=_parser(declared),
                         **({"action": "append", "default": []} if declared.multiple else {"default": default}))


def _parser(declared: OptionDeclaration) -> Callable[[str], Any] | None:
    """The argparse ``type`` of a declared option's values."""
    if declared.size:
        return size_arg
    if declared.type is int:
        return jobs_arg if declared.minimum == 0 else int
    return None


def _transport_dest(setting: TransportSetting) -> str:
    return f"transport:{setting.scheme}:{setting.option.name}"


def _add_transport_setting(section, setting: TransportSetting) -> None:
    """A transport's declared option as --SCHEME-NAME (not given: the transport's default)."""
    option, dest = setting.option, _transport_dest(setting)
    if option.type is bool:
        section.add_argument(setting.flag, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                             help=setting.help)
        return
    section.add_argument(setting.flag, dest=dest, default=None, help=setting.help,
                         action="append" if option.multiple else "store",
                         type=None if option.type is str else option.type, choices=option.choices or None,
                         metavar=None if option.choices else "ARG" if option.multiple else
                         _METAVARS.get(option.type, "VALUE"))


def staging_options(args, command: str | None = None) -> StagingOptions:
    """StagingOptions from parsed plan, push or pull arguments (``command``; None: ``args.command``), following
    the declarations: the options the command does not take keep their defaults, and the transports' options
    given go to ``transport_options``."""
    command = command or args.command
    values: dict[str, Any] = {}
    for declared in declarations(command=command):
        value = getattr(args, declared.name)
        if declared.multiple:
            value = split_ssh_options(value) if declared.shell_split else tuple(value)
        values[declared.name] = value
    options = StagingOptions(**values)
    if command == "plan":
        return options
    given = [(setting, getattr(args, _transport_dest(setting), None)) for setting in transport_settings()]
    given = [(setting, tuple(value) if setting.option.multiple else value) for setting, value in given
             if value is not None]
    return options.with_transport_values(given) if given else options


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
    options = staging_options(args)
    with connecting_early(remote, options) as early:
        from staging_core.operations.push_pull import pull, push                      # loaded while ssh connects
        operation = push if args.command == "push" else pull
        result = operation(args.src, args.dest, options, make_progress(options.progress),
                           early_connection=early)
    report(args.json, result.to_json(), summary_line(args.command, result))
    return EXIT_OK


@contextmanager
def connecting_early(url: str, options: StagingOptions) -> Iterator[EarlyConnection | None]:
    """For a push or pull with these ``options`` whose far side is ``url``: the connection its transport would
    make, already being made (``Transport.connect_early``: an ssh ControlMaster), so that its round trips
    overlap the loading of the rest of pallet. The caller hands it to the operation (the ``early_connection``
    of push and pull), whose transport takes it over; it is ended here if the transport did not take it. None
    for a transport without such a connection, or one whose dependencies are missing (the operation then says
    which)."""
    from staging_core.transports.base import parse_url
    from staging_core.transports.errors import MissingDependencyError
    from staging_core.transports.registry import transport_class
    endpoint = parse_url(url)
    try:
        kind = transport_class(endpoint.scheme)
    except MissingDependencyError:
        yield None
        return
    early = kind.connect_early(endpoint, options) if kind.capabilities.shared_connection else None
    try:
        yield early
    finally:
        if early is not None:
            early.close()


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
            f"{profile.create_rate:.0f} creates/s"
            f"{'' if profile.create_rate_measured else ' (default, not measured)'}, zstd "
            f"{human_bytes(profile.compress_rate)}/s compress, {human_bytes(profile.decompress_rate)}/s decompress")
    return EXIT_OK


