"""`python -m mpi_stager`: unpack (resumably) or pack a bundle with every MPI rank, or serially; receive a stream."""
from __future__ import annotations

import contextlib
import os
import sys
from types import SimpleNamespace
from typing import TYPE_CHECKING

from bundles.allocator import return_freed_buffers
from bundles.errors import PalletError, UsageError

from .wire import RECEIVER_GONE

if TYPE_CHECKING:
    import argparse

_EPILOG = """\
run it as:  mpirun -np 8 python -m mpi_stager unpack B.tar.zst /scratch/dest
            srun -n 64 python -m mpi_stager unpack B.tar.zst /lustre/dest
            python -m mpi_stager unpack --workers 4 B.tar.zst dest   (one node, no MPI)
            ... | python -m mpi_stager receive DEST   (a bundle stream on stdin, as pallet push sends it)
            python -m mpi_stager send SRC | ...      (a bundle stream on stdout, as pallet pull reads it)
            python -m mpi_stager session --list DEST  (lock, listing, stream, clean-up: how pallet push uses ssh)
            python -m mpi_stager serve               (stat, list, put, get for a whole run: pallet's host session)
            python -m mpi_stager hello               (the far side's versions and capabilities, docs/wire.md)
While it runs, DEST/.pallet holds the journal and an INCOMPLETE marker; a rerun after a crash
(of this command, `pallet unpack` or `pallet pull`: one driver, one journal) extracts only the shards
the journal does not list as done. A success removes DEST/.pallet.
exit status: 0 success, 1 failure (one summary from rank 0), 2 usage error, 4 DEST is locked by another
pallet operation, 3 (send) SRC does not exist, 5 (send) the receiver went away."""


_LOCKED_HELP = ("the caller holds DEST's lock (pallet push does); otherwise DEST is locked here, and a second "
                "operation on it stops with exit status 4")


def build_parser() -> argparse.ArgumentParser:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m mpi_stager", epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Parallel, resumable unpack of pallet bundles across MPI ranks.")
    parser.add_argument("--version", action=_version_action(), help="print the versions of pallet and its protocols")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_unpack, _add_receive, _add_send, _add_session, _add_serve, _add_hello, _add_pack):
        add(commands)
    return parser


def _add_unpack(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    import argparse
    unpack = commands.add_parser("unpack", help="unpack BUNDLE into DEST with all ranks",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EPILOG)
    unpack.add_argument("bundle", metavar="BUNDLE")
    unpack.add_argument("dest", metavar="DEST")
    unpack.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                        help="check shard and file hashes (default: on)")
    unpack.add_argument("--journal", metavar="DIR", help="journal directory (default: DEST/.pallet/journal-ID)")
    unpack.add_argument("--keep-journal", action="store_true",
                        help="on success, leave DEST/.pallet (journal, marker) for the caller to remove "
                             "(pallet push does, once its whole operation has succeeded)")
    unpack.add_argument("--locked-by-caller", action="store_true", help=_LOCKED_HELP)
    unpack.add_argument("--comm", choices=("auto", "mpi", "serial"), default="auto",
                        help="communicator: mpi when started by mpirun/srun (auto), or serial")
    unpack.add_argument("--workers", type=int, default=1, metavar="N",
                        help="at most N worker processes (threads with the native engine) when running as a single "
                             "rank (default 1; 0: one per CPU; a bundle too small to repay their start is unpacked "
                             "inline)")
    unpack.add_argument("--json", action="store_true", help="print the summary as JSON (rank 0)")


def _add_receive(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    import argparse
    receive = commands.add_parser("receive", help="unpack a bundle stream read from stdin into DEST as it arrives",
                                  description="Read a bundle stream (docs/bundle-format.md, 'Bundle stream v1') "
                                              "on stdin, as `pallet push` sends it over ssh, and unpack each shard "
                                              "as it arrives. Prints one JSON line naming the shards already "
                                              "finished (the sender skips them), and a summary at the end.")
    receive.add_argument("dest", metavar="DEST")
    receive.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                         help="check shard and file hashes (default: on)")
    receive.add_argument("--json", action="store_true", help="print the summary as JSON")
    receive.add_argument("--locked-by-caller", action="store_true", help=_LOCKED_HELP)


def _add_send(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    send = commands.add_parser("send", help="write SRC as a bundle stream on stdout, for a receiver that replies "
                                            "on stdin",
                               description="Write the tree under SRC as a bundle stream (docs/bundle-format.md, "
                                           "'Bundle stream v1') on stdout, as `pallet pull` reads it over ssh. "
                                           "After the skeleton, one JSON line on stdin names the shards the "
                                           "receiver already holds; those are only announced.")
    send.add_argument("src", metavar="SRC")
    send.add_argument("--codec", choices=("zstd", "gzip", "none"), default="zstd")
    send.add_argument("--shard-size", type=int, metavar="BYTES", help="target uncompressed shard size")
    send.add_argument("--jobs", type=int, default=0, metavar="N",
                      help="threads building shards (default 0: one per CPU)")
    send.add_argument("--files-from", metavar="FILE",
                      help="send only these paths relative to SRC (and their parent directories): one per line, "
                           "or NUL-separated; '-' reads from stdin, before the reply, a line with the list's "
                           "length in bytes and then the NUL-separated list")


def _add_session(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    session = commands.add_parser("session", help="lock DEST, list it, then serve a push's requests",
                                  description="Serve one `pallet push` over one ssh channel (docs/wire.md, "
                                              "'The session'): lock DEST, write a hello line (the versions and "
                                              "capabilities it answers the client's hello in $PALLET_HELLO with) "
                                              "and (--list) "
                                              "DEST's listing, then serve requests read on stdin until it ends: "
                                              "`receive` (a bundle stream follows, as for `receive`), `receive-new` "
                                              "(the same into a DEST it listed empty; else the stream's skeleton "
                                              "is dropped and the answer is `declined`), `dirs N` "
                                              "(directory modes and times) and `clear` (remove DEST/.pallet). The "
                                              "lock is released when it exits.")
    session.add_argument("dest", metavar="DEST")
    session.add_argument("--list", action="store_true", help="send DEST's listing after the hello line")
    session.add_argument("--wait", action="store_true",
                         help="wait for another operation's lock on DEST instead of exiting with status 4")


def _add_serve(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    commands.add_parser("serve", help="serve a workflow run's small operations until stdin ends",
                        description="Serve the host session (docs/wire.md, 'The host session'): a hello line "
                                    "(the host-session version it answers $PALLET_HOST_HELLO with, and its "
                                    "capabilities), then requests read on stdin until it ends, each answered in "
                                    "turn: `stat` (batched), `list`, `put` (small files inline, under their "
                                    "DEST's lock) and `get`. A failed operation is answered as an error and the "
                                    "session goes on. Exit status 1 when the client shares no version.")


def _add_hello(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    commands.add_parser("hello", help="print the hello line a session answers with: versions and capabilities",
                        description="Print the line a session opens with (docs/wire.md, 'The hello'): the session "
                                    "version it speaks, the session, summary and bundle stream versions it speaks, "
                                    "and its capabilities; given the client's hello in $PALLET_HELLO, as answered "
                                    "to that client. Exit status 1 when they share no version.")


def _add_pack(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    pack = commands.add_parser("pack", help="pack SRC into BUNDLE with all ranks (same bytes as `pallet pack`)")
    pack.add_argument("src", metavar="SRC")
    pack.add_argument("bundle", metavar="BUNDLE")
    pack.add_argument("--codec", choices=("zstd", "gzip", "none"), default="zstd")
    pack.add_argument("--level", type=int)
    pack.add_argument("--shard-size", type=int, metavar="BYTES", help="target uncompressed shard size")
    pack.add_argument("--comm", choices=("auto", "mpi", "serial"), default="auto")
    pack.add_argument("--files-from", metavar="FILE",
                      help="pack only these paths relative to SRC (and their parent directories): one per line, "
                           "or NUL-separated; '-' reads stdin (rank 0)")
    pack.add_argument("--json", action="store_true", help="print the summary as JSON (rank 0)")


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names, loading only that command's modules (a far-side session starts fast)."""
    if argv is None:
        return_freed_buffers()            # the process's peak memory stays that of its buffers
    words = sys.argv[1:] if argv is None else argv
    session = _session_args(words)
    if session is not None:
        return _run_session(session)
    sending = _send_args(words)
    if sending is not None:
        return _run_send(sending)
    args = build_parser().parse_args(argv)
    if args.command == "receive":
        return _run_receive(args)
    if args.command == "send":
        return _run_send(args)
    if args.command == "session":
        return _run_session(args)
    if args.command == "serve":
        return _run_serve()
    if args.command == "hello":
        return _run_hello()
    from .comm import get_communicator
    try:
        comm = get_communicator(args.comm)
    except PalletError as exc:
        print(f"mpi_stager: error: {exc}", file=sys.stderr)
        return exc.exit_code
    rank0 = comm.rank == 0
    if args.command == "pack":
        return _run_pack(comm, args)
    from .unpack import StagerOptions, unpack_parallel
    try:
        summary = unpack_parallel(comm, args.bundle, args.dest,
                                  StagerOptions(args.verify, args.journal, max(1, args.workers or os.cpu_count() or 1),
                                                args.keep_journal, args.locked_by_caller))
    except PalletError as exc:      # the same on every rank: rank 0 says it
        if rank0:
            print(f"mpi_stager unpack: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if rank0:
        print(encode(summary) if args.json else
              f"unpacked {summary.files} files ({summary.file_bytes} bytes) into {summary.dest} with "
              f"{summary.ranks} rank(s) in {summary.seconds:.2f} s: {summary.shards_done} shard(s) extracted, "
              f"{summary.shards_skipped} already done")
    return 0


def encode(summary) -> str:
    """``summary`` as its JSON line (the summaries' module loads only for a command that prints one)."""
    from .wire import encode_summary
    return encode_summary(summary)


def _run_receive(args) -> int:
    from .receive import receive
    try:
        summary = receive(sys.stdin.buffer, sys.stdout.buffer, args.dest, args.verify, args.locked_by_caller)
        print(encode(summary) if args.json else
              f"received {summary.files} files ({summary.file_bytes} bytes) into {summary.dest} in "
              f"{summary.seconds:.2f} s: {summary.shards_received} shard(s) received, "
              f"{summary.shards_skipped} already done", flush=True)
    except PalletError as exc:
        print(f"mpi_stager receive: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        return RECEIVER_GONE        # the sender went away before the summary; it reports what happened
    return 0


def _version_action() -> type[argparse.Action]:
    """``--version``: pallet's version and those of the protocols it speaks (docs/wire.md), looked up only when
    asked for (a far-side session starts without reading package metadata)."""
    import argparse

    class VersionAction(argparse.Action):
        def __init__(self, option_strings, dest, **kwargs):
            super().__init__(option_strings, dest, nargs=0, **kwargs)

        def __call__(self, parser, namespace, values, option_string=None):
            from importlib.metadata import version

            from . import wire
            print(f"mpi_stager (pallet {version('pallet')}): session protocol v{wire.SESSION_VERSION}, summary "
                  f"v{wire.SUMMARY_VERSION}, bundle stream v{wire.STREAM_VERSION}, tar tools "
                  f"v{wire.TAR_TOOLS_VERSION}, host session v{wire.HOST_VERSION}")
            parser.exit()
    return VersionAction


def _run_hello() -> int:
    from .wire import client_hello_in, far_hello_for
    hello, agreed = far_hello_for(client_hello_in(os.environ))
    sys.stdout.buffer.write(hello.far_line())
    if not agreed.ok:
        print(f"mpi_stager hello: error: {agreed.problem(client_side=False)}", file=sys.stderr)
        return 1
    return 0


class _SessionArgs:
    """The arguments of `session` (as argparse would give them), read without argparse: a push waits for them."""

    def __init__(self, dest: str, listing: bool, wait: bool):
        self.dest, self.list, self.wait = dest, listing, wait


def _session_args(argv: list[str]) -> _SessionArgs | None:
    """``session [--list] [--wait] DEST``, each flag at most once, DEST not an option: its arguments; anything
    else (help, another command, a usage error): None, and argparse reads it."""
    if not argv or argv[0] != "session":
        return None
    flags = [word for word in argv[1:] if word.startswith("-")]
    places = [word for word in argv[1:] if not word.startswith("-")]
    if len(places) != 1 or len(set(flags)) != len(flags) or not set(flags) <= {"--list", "--wait"}:
        return None
    return _SessionArgs(places[0], "--list" in flags, "--wait" in flags)


_SEND_OPTIONS = {"--codec": ("zstd", "gzip", "none"), "--shard-size": int, "--jobs": int, "--files-from": str}


def _send_args(argv: list[str]) -> SimpleNamespace | None:
    """``send [--codec C] [--shard-size N] [--jobs N] [--files-from FILE] SRC`` as a pull writes it, each option
    at most once: its arguments, as argparse would give them; anything else: None, and argparse reads it."""
    if not argv or argv[0] != "send":
        return None
    values: dict[str, object] = {"codec": "zstd", "shard_size": None, "jobs": 0, "files_from": None}
    places, seen, words = [], set(), iter(argv[1:])
    for word in words:
        if not word.startswith("-") or word == "-":
            places.append(word)
            continue
        kind, value = _SEND_OPTIONS.get(word), next(words, None)
        if kind is None or value is None or word in seen or (value.startswith("-") and value != "-"):
            return None
        if (kind is int and not value.isdigit()) or (isinstance(kind, tuple) and value not in kind):
            return None
        seen.add(word)
        values[word[2:].replace("-", "_")] = int(value) if kind is int else value
    return SimpleNamespace(src=places[0], **values) if len(places) == 1 else None


def _run_session(args) -> int:
    from .session import run_session
    from .wire import client_hello_in
    try:
        run_session(args.dest, sys.stdin.buffer, sys.stdout.buffer, args.wait, args.list, client_hello_in(os.environ))
    except PalletError as exc:
        print(f"mpi_stager session: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        return RECEIVER_GONE        # the caller went away; it reports what happened
    return 0


def _run_serve() -> int:
    from .serve import run_serve
    from .wire import HOST_HELLO_ENV
    try:
        return run_serve(sys.stdin.buffer, sys.stdout.buffer, os.environ.get(HOST_HELLO_ENV))
    except PalletError as exc:
        print(f"mpi_stager serve: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        return RECEIVER_GONE        # the client went away


def _run_send(args) -> int:
    from .send import read_selection_block, send
    try:
        inp = sys.stdin.buffer
        include: frozenset[bytes] | None = None
        if args.files_from == "-":
            include = read_selection_block(inp, args.src)
        elif args.files_from:
            include = read_selection(args.files_from)
        send(args.src, inp, sys.stdout.buffer, args.codec, args.shard_size, args.jobs, include)
    except PalletError as exc:
        print(f"mpi_stager send: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


def read_selection(source: str) -> frozenset[bytes]:
    """Relative paths from FILE or stdin ('-'): NUL-separated when the data holds a NUL, else one per line."""
    try:
        if source == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(source, "rb") as handle:
                data = handle.read()
    except OSError as exc:
        raise UsageError(f"cannot read the file list ({exc.strerror})", source, "give a readable file or '-'") from None
    return frozenset(name for name in data.split(b"\0" if b"\0" in data else b"\n") if name)


def _run_pack(comm, args) -> int:
    from bundles.writer import PackOptions

    from .pack import pack_parallel
    try:
        reads = args.files_from and (comm.rank == 0 or args.files_from != "-")   # every rank fails alike
        include = read_selection(args.files_from) if reads else None
        options = PackOptions(args.codec, args.level, args.shard_size, 1, include=include)
        summary = pack_parallel(comm, args.src, args.bundle, options)
    except PalletError as exc:
        if comm.rank == 0:
            print(f"mpi_stager pack: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if comm.rank == 0:
        print(encode(summary) if args.json else
              f"packed {summary.entries} entries into {summary.bundle} with {summary.ranks} rank(s): "
              f"{summary.shards} shard(s), {summary.bundle_bytes} bytes, {summary.seconds:.2f} s")
    return 0


def end_process(status: int) -> None:
    """Flush stdout and stderr, then end the process with ``status`` without finalizing the interpreter.

    `receive` and `session` read stdin on a read-ahead thread. When they
    stop on an error, that thread may still be blocked in a read of stdin;
    finalization would then abort the process (exit 134), as CPython cannot
    take stdin's buffer lock from a daemon thread. Nothing else is pending:
    their workers are joined and their files closed before they return.
    `send` ends so too: its peer waits for it to exit, and finalization
    (collecting what the walk and the index made) would only add to that.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    status = main()
    if sys.argv[1:2] in (["receive"], ["session"], ["send"]):
        end_process(status)
    sys.exit(status)
