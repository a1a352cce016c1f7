"""The `pallet` command line: pack, unpack, ls, verify, plan, push, pull, calibrate, demo, login, remote and mount."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from bundles.allocator import return_freed_buffers
from bundles.errors import Interrupted, PalletError, UsageError

from staging_core.cli.display import human_bytes, jobs_arg, make_progress, report, size_arg

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType
    from typing import Any

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

_EPILOG = """\
exit status: 0 success, 1 failure (named on stderr), 2 usage error, 3 transport failure
(network, authentication, remote path), 4 destination locked by another push/pull, 130 interrupted
(Ctrl-C, SIGINT), 143 terminated (SIGTERM); a push or pull interrupted resumes when run again.
A bundle is a standard .tar.zst/.tar.gz/.tar: `tar -xf BUNDLE` extracts it too.
See docs/bundle-format.md for the format and docs/cli.md for examples."""


# Commands defined in other modules, each loaded only when its command runs or the whole list is shown:
# command -> (module below staging_core, its function that adds the command's parser).
_ELSEWHERE = {"demo": ("cli.demo", "add_parser"),
              **{name: ("cli.staging", "add_parsers") for name in ("plan", "push", "pull", "calibrate")},
              "remote": ("far_side.install", "add_parser"), "mount": ("in_place.mount", "add_parser")}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `pallet` parser: with every sub-command, or only with ``command`` when that names one (so that a
    command loads only its own modules)."""
    parser = argparse.ArgumentParser(
        prog="pallet", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EPILOG,
        description="Stage datasets made of many tiny files: pack them into an indexed, sharded bundle "
                    "that any tar can read, move it, and unpack it in parallel with every file verified.")
    parser.add_argument("--version", action="version", version=_version_text(),
                        help="show pallet's version and which engine (native or python) runs the per-file loops")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    here = {"pack": _add_pack, "unpack": _add_unpack, "ls": _add_ls, "verify": _add_verify, "login": _add_login}
    adders = list(here.values()) + [_adder(*place) for place in dict.fromkeys(_ELSEWHERE.values())]
    if command in here:
        adders = [here[command]]
    elif command == "--version":
        adders = []
    elif command in _ELSEWHERE:
        adders = [_adder(*_ELSEWHERE[command])]
    for add in adders:
        add(commands)
    parser.set_defaults(command_parsers=commands.choices)     # main() names a command's own usage in errors
    return parser


def _adder(module: str, function: str):
    return lambda commands: getattr(importlib.import_module(f"staging_core.{module}"), function)(commands)


def _version_text() -> str:
    from bundles import native
    engine = native.engine_info()
    return f"pallet 0.1.0\nengine: {engine.name}" + (f" ({engine.reason})" if engine.reason else "")


def _progress_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--progress", dest="progress", action="store_true", default=None,
                       help="always draw the progress bar (default: only on a terminal)")
    group.add_argument("--quiet", "-q", dest="progress", action="store_false", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print a machine-readable summary on stdout")


def _add_pack(commands) -> None:
    p = commands.add_parser("pack", help="pack a directory into a bundle",
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            description="Pack SRC (a directory or one file) into BUNDLE and BUNDLE.pidx.",
                            epilog="examples:\n  pallet pack data/ data.tar.zst\n"
                                   "  pallet pack --codec gzip --level 1 --jobs 8 data/ data.tar.gz\n"
                                   "  pallet pack --codec none --shard-size 256M images/ images.tar")
    p.add_argument("src", metavar="SRC", help="directory (or file) to pack; it is only read")
    p.add_argument("bundle", metavar="BUNDLE", help="bundle to write (written to a temporary name, then renamed)")
    p.add_argument("--codec", choices=("zstd", "gzip", "none"), default="zstd",
                   help="shard compression: zstd (default), gzip (uses pigz when present) or none "
                        "(for incompressible data)")
    p.add_argument("--level", type=int, help="compression level (zstd 1-19 or -5..-1, default 3; gzip 1-9, default 6)")
    p.add_argument("--shard-size", type=size_arg, metavar="SIZE",
                   help="target uncompressed shard size, e.g. 16M (default: 1/64 of the data, 4M..64M)")
    p.add_argument("--jobs", "-j", type=jobs_arg, default=0, metavar="N",
                   help="worker processes (default: one per CPU, none for small work)")
    _progress_flags(p)
    p.set_defaults(run=_run_pack)


def _add_unpack(commands) -> None:
    p = commands.add_parser("unpack", help="unpack a bundle (or plain tar) into a directory",
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            description="Unpack BUNDLE into DEST with N workers, verifying every file. "
                                        "Plain .tar/.tar.gz/.tar.zst archives without an index are "
                                        "extracted sequentially under the same safety rules.",
                            epilog="DEST holds .pallet/INCOMPLETE, and the journal of the shards already written,\n"
                                   "until the unpack has finished; then nothing but the bundle's tree is left there.\n"
                                   "Run it again after a failure or a kill: it extracts only the shards not done\n"
                                   "(the same journal as `pallet pull` and `python -m mpi_stager unpack` keep).\n"
                                   "examples:\n  pallet unpack data.tar.zst /scratch/me/data\n"
                                   "  pallet unpack --jobs 16 data.tar.zst /scratch/me/data")
    p.add_argument("bundle", metavar="BUNDLE")
    p.add_argument("dest", metavar="DEST", help="destination directory (created if missing)")
    p.add_argument("--jobs", "-j", type=jobs_arg, default=0, metavar="N",
                   help="worker processes (default: one per CPU, none for small work)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the shard and file hash checks (faster, unsafe on untrusted copies)")
    p.add_argument("--no-index", dest="use_index", action="store_false",
                   help="ignore the bundle's index and extract it as a plain tar, unverified, mtimes to the "
                        "second (for a bundle whose end is damaged; the same safety rules apply)")
    _progress_flags(p)
    p.set_defaults(run=_run_unpack)


def _add_ls(commands) -> None:
    p = commands.add_parser("ls", help="list a bundle's entries",
                            description="List the entries of BUNDLE from its index (no data is read). BUNDLE may "
                                        "be ssh://HOST/PATH: only the index crosses the network, by byte ranges.")
    p.add_argument("bundle", metavar="BUNDLE")
    p.add_argument("--ssh-option", action="append", default=[], metavar="OPT",
                   help="extra ssh argument for an ssh:// BUNDLE (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object per entry (JSON Lines)")
    p.add_argument("--shards", action="store_true", help="list the shards instead of the entries")
    p.set_defaults(run=_run_ls)


def _add_verify(commands) -> None:
    p = commands.add_parser("verify", help="check a bundle, or a destination against a bundle",
                            description="Check every shard, header and file hash of BUNDLE; with DEST, "
                                        "also check that DEST holds exactly what the bundle describes.")
    p.add_argument("bundle", metavar="BUNDLE")
    p.add_argument("dest", metavar="DEST", nargs="?")
    p.add_argument("--jobs", "-j", type=jobs_arg, default=0, metavar="N",
                   help="worker processes (default: one per CPU, none for small work)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=_run_verify)


def _add_login(commands) -> None:
    p = commands.add_parser("login", help="log in to a transfer service (globus)",
                            description="Log in once per host; later transfers use the stored tokens.")
    services = p.add_subparsers(dest="service", required=True, metavar="SERVICE")
    g = services.add_parser("globus", help="Globus Auth login for globus:// transfers",
                            description="Print a Globus Auth URL, read the code you get there, and store the "
                                        "tokens in $XDG_CONFIG_HOME/pallet/globus-tokens.json (mode 0600).")
    g.add_argument("--collection", action="append", default=[], metavar="UUID",
                   help="a GCS mapped collection that needs a data_access consent (repeatable)")
    g.add_argument("--client-id", help="Globus native-app client id (default: $PALLET_GLOBUS_CLIENT_ID)")
    g.set_defaults(run=_run_login_globus)


def _run_login_globus(args) -> int:
    from staging_core.transports.registry import transport_class
    transport_class("globus")                          # says how to install globus-sdk if it is missing
    from staging_core.transports.globus_auth import login
    path = login(args.client_id, args.collection)
    print(f"logged in to Globus; tokens stored in {path} (readable by you only)")
    return EXIT_OK


def _run_pack(args) -> int:
    from bundles.writer import PackOptions, pack
    options = PackOptions(args.codec, args.level, args.shard_size, args.jobs)
    result = pack(args.src, args.bundle, options, make_progress(args.progress))
    index = result.index
    summary = {"bundle": result.bundle, "index": result.sidecar, "entries": len(index),
               "shards": len(index.shards), "file_bytes": index.total_file_bytes,
               "bundle_bytes": result.bundle_bytes, "codec": index.codec, "seconds": round(result.seconds, 3)}
    report(args.json, summary, f"packed {len(index)} entries ({human_bytes(index.total_file_bytes)}) into "
                           f"{result.bundle}: {len(index.shards)} shard(s), {human_bytes(result.bundle_bytes)}, "
                           f"{result.seconds:.2f} s")
    return EXIT_OK


def _run_unpack(args) -> int:
    from bundles.unpacking import UnpackOptions, unpack
    result = unpack(args.bundle, args.dest, UnpackOptions(args.jobs, args.verify, use_index=args.use_index),
                    make_progress(args.progress))
    checked = "verified" if result.verified else ("not verified (no index)" if not result.indexed else "not verified")
    resumed = f"; {result.shards_skipped} of {result.shards} shard(s) were done before" if result.shards_skipped else ""
    report(args.json, {**result.__dict__, "seconds": round(result.seconds, 3)},
            f"unpacked {result.entries} entries ({result.files} files, {human_bytes(result.file_bytes)}) "
            f"into {result.dest} in {result.seconds:.2f} s, {checked}{resumed}")
    return EXIT_OK


def _run_ls(args) -> int:
    from bundles.reader import Bundle, read_embedded_index

    from staging_core.in_place.remote_bytes import RemoteRanges, is_remote_bundle
    if is_remote_bundle(args.bundle):          # ssh://host/b.tar.zst: the index alone crosses, by byte ranges
        source = RemoteRanges.open_url(args.bundle, tuple(args.ssh_option))
        try:
            return _ls_index(read_embedded_index(source)[1], args)
        finally:
            source.close()
    with Bundle.open(args.bundle) as bundle:
        if bundle.index is None:
            return _ls_plain(bundle, args.json)
        return _ls_index(bundle.index, args)


def _ls_index(index, args) -> int:
    out = sys.stdout
    if args.shards:
        for shard in index.shards:
            doc = {"shard": shard.number, **shard.to_json()}
            out.write(json.dumps(doc) + "\n" if args.json else
                      f"{shard.number:6d} {shard.entry_count:8d} entries {shard.raw_size:14d} raw "
                      f"{shard.length:14d} stored at {shard.offset}\n")
        return EXIT_OK
    for entry in index:
        out.write(json.dumps(entry.to_json()) + "\n" if args.json else _ls_line(entry))
    return EXIT_OK


def _ls_line(entry) -> str:
    kind = "-dlh"[entry.kind]
    target = f" -> {os.fsdecode(entry.link)}" if entry.link else ""
    return f"{kind}{entry.mode:04o} {entry.size:12d} {entry.mtime_ns // 1_000_000_000:12d} {entry.name}{target}\n"


def _ls_plain(bundle, as_json: bool) -> int:
    from bundles.plain import iter_members
    for member, _ in iter_members(bundle):
        doc = {"path": member.name, "type": member.type.decode(errors="replace"), "mode": f"{member.mode:04o}",
               "size": member.size, "mtime": member.mtime}
        sys.stdout.write(json.dumps(doc) + "\n" if as_json else
                         f"{member.type.decode(errors='replace')}{member.mode:04o} {member.size:12d} "
                         f"{int(member.mtime):12d} {member.name}\n")
    return EXIT_OK


def _run_verify(args) -> int:
    from bundles.reader import Bundle
    from bundles.verify import verify_bundle, verify_tree
    with Bundle.open(args.bundle) as bundle:
        report = verify_bundle(bundle, args.jobs)
        if args.dest and report.ok and bundle.index is not None:      # verify_bundle refuses a bundle without one
            tree = verify_tree(bundle.index, args.dest)
            report.problems += tree.problems
    if args.json:
        print(json.dumps({"ok": report.ok, "shards": report.shards, "entries": report.entries,
                          "problems": report.problems}))
    elif report.ok:
        where = f" and {args.dest} matches it" if args.dest else ""
        print(f"{args.bundle}: OK ({report.entries} entries in {report.shards} shard(s) verified){where}")
    else:
        print(f"{args.bundle}: {len(report.problems)} problem(s)", file=sys.stderr)
        for problem in report.problems[:200]:
            print(f"  - {problem}", file=sys.stderr)
    return EXIT_OK if report.ok else EXIT_FAILURE


class _Interrupts:
    """SIGINT and SIGTERM while the command line runs (its main thread only: the library installs no handler).

    The first raises Interrupted in the main thread, whichever thread the
    kernel gave it to: a watcher thread, woken through signal.set_wakeup_fd,
    sends it on to the main thread, so that a blocking wait there (a pipe, a
    lock, a child) ends at once. Later ones are ignored while the first is
    cleaned up; one more than FORCE_AFTER_S after it ends pallet at once.
    Signals ignored when pallet started (a background job's SIGINT) stay ignored.
    With ``keep`` (pallet is the process, about to exit), they are ignored once
    the command has ended: Python's own exit would otherwise die of one.
    """

    def __init__(self, keep: bool) -> None:
        self.command = ""
        self._keep = keep
        self.caught: Interrupted | None = None
        self._seen = 0                                  # a signal the watcher saw, perhaps not yet handled
        self._handled_at: float | None = None
        self._handled = threading.Event()
        self._in_hook = False
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | signal.Handlers | None] = {}
        self._pipe: tuple[int, int] | None = None
        self._wakeup = -1
        self._watcher: threading.Thread | None = None
        self._hook = sys.unraisablehook

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is not threading.main_thread():
            return self
        wanted = [signum for signum in _SIGNALS if signal.getsignal(signum) is not signal.SIG_IGN]
        if not wanted:
            return self
        read, write = self._pipe = os.pipe()
        os.set_blocking(write, False)
        self._wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)      # the watcher starts with them blocked
        try:
            self._watcher = threading.Thread(target=self._watch, args=(read, threading.main_thread().ident),
                                             name="pallet-interrupts", daemon=True)
            self._watcher.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        self._previous = {signum: signal.signal(signum, self._on_signal) for signum in wanted}
        self._hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        return self

    def __exit__(self, *exc) -> None:
        if self._pipe is None:
            return
        sys.unraisablehook = self._hook
        if self._keep:
            for signum in self._previous:
                signal.signal(signum, signal.SIG_IGN)
        else:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)
            signal.set_wakeup_fd(self._wakeup)
            os.close(self._pipe[1])
            assert self._watcher is not None        # started with the pipe, in __enter__
            self._watcher.join()
            os.close(self._pipe[0])

    def run(self, command, args) -> int:
        """``command(args)``, its output flushed; once a signal came meanwhile, its Interrupted instead of what
        the command returned or raised (a child the signal killed may have ended the command first)."""
        try:
            code = command(args)
            sys.stdout.flush()              # while signals are still the command's
        except Exception:
            self._raise_caught()
            raise
        self._raise_caught()
        return code

    def report(self, exc: KeyboardInterrupt) -> int:
        """Say that the command was interrupted (one line); its exit status, 128 + the signal's number."""
        code = getattr(self.caught or exc, "exit_code", 128 + signal.SIGINT)
        self._say(code - 128)
        return code

    def finish(self, code: int) -> int:
        """``code``; after an interrupt, threads still at work (a walk of a large source, say) do not hold the
        exit: past EXIT_WAIT_S the process ends at once."""
        if self.caught is None and not self._seen:
            return code
        busy = [thread for thread in threading.enumerate() if not thread.daemon and thread is not
                threading.current_thread()]
        deadline = time.monotonic() + EXIT_WAIT_S
        for thread in busy:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in busy):
            _exit_now(code)
        return code

    def _on_signal(self, signum: int, frame) -> None:
        if self.caught is not None or self._in_hook:    # in the hook: not handled, so the watcher sends it again
            return
        self.caught = Interrupted(signum)
        self._handled_at = time.monotonic()
        self._handled.set()
        raise self.caught

    def _unraisable(self, unraisable) -> None:
        """The first signal's Interrupted raised where Python cannot raise it (a generator or object the
        collector finalizes, which Python would report as "Exception ignored"): not printed; the watcher sends
        the signal to the main thread again, to be raised there once it runs its own code (should it land in a
        finalizer again, this repeats)."""
        caught = unraisable.exc_value
        if not isinstance(caught, Interrupted) or caught is not self.caught or self._pipe is None:
            self._hook(unraisable)
            return
        self._in_hook = True            # a signal the watcher sends now must not be raised inside this hook
        try:
            self.caught = None
            self._handled.clear()
            with contextlib.suppress(BlockingIOError):  # the pipe is full of signals already: the watcher has them
                os.write(self._pipe[1], bytes([caught.signum]))
        finally:
            self._in_hook = False

    def _say(self, signum: int) -> None:
        said = "interrupted" if signum == signal.SIGINT else f"interrupted ({signal.Signals(signum).name})"
        print(f"pallet {self.command}: {said}" if self.command else f"pallet: {said}", file=sys.stderr)

    def _raise_caught(self) -> None:
        if self.caught is None and self._seen:
            self.caught = Interrupted(self._seen)
        if self.caught is not None:
            raise self.caught from None

    def _watch(self, read: int, main: int) -> None:
        """The watcher: every signal caught anywhere is a byte on ``read``; send the first on to the main
        thread until it is handled there, and end pallet at a later one (see the class)."""
        while data := os.read(read, 64):
            for signum in (signum for signum in data if signum in _SIGNALS):
                if not self._handled.is_set():
                    self._seen = self._seen or signum
                    signal.pthread_kill(main, signum)
                    self._handled.wait(RESEND_S)
                elif ((caught := self.caught) is not None and self._handled_at is not None
                      and time.monotonic() - self._handled_at > FORCE_AFTER_S):
                    self._say(caught.signum)
                    _exit_now(caught.exit_code)


_SIGNALS = (signal.SIGINT, signal.SIGTERM)
RESEND_S = 0.25         # a signal not yet handled in the main thread is sent to it again after this
FORCE_AFTER_S = 1.0     # a signal this long after the first ends pallet at once (cleaning up hangs)
EXIT_WAIT_S = 0.3       # after an interrupt, threads still at work are waited for this long


# Commands that end the process as soon as they have ended, when pallet is the process: their output is flushed, their
# connections, far sides and threads are ended by then, and the interpreter's finalization (collecting every object
# the walk, the index and the plan made: 20-60 ms) only delays the exit that scripts and workflow engines wait for.
_ENDS_AT_ONCE = frozenset({"push", "pull"})


def _exit_now(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """Run the `pallet` command line ``argv`` (default: sys.argv's); its exit status. SIGINT and SIGTERM end a
    command with 130 and 143 (see _Interrupts)."""
    whole_process = argv is None
    if whole_process:
        return_freed_buffers()             # the process's peak memory stays that of its buffers
    interrupts = _Interrupts(keep=whole_process)
    argv = sys.argv[1:] if argv is None else argv
    try:
        with interrupts:
            code = _main(argv, interrupts)
    except KeyboardInterrupt as exc:       # while the command loads, or one still pending as it ends
        code = interrupts.report(exc)
    code = interrupts.finish(code)
    if whole_process and interrupts.command in _ENDS_AT_ONCE:
        _exit_now(code)
    return code


def _main(argv: list[str], interrupts: _Interrupts) -> int:
    parser = build_parser(argv[0] if argv else None)
    args, unknown = parser.parse_known_args(argv)
    if unknown:                 # an unknown option of a command gets that command's usage, not the top level's
        args.command_parsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    interrupts.command = args.command
    try:
        return interrupts.run(args.run, args)
    except UsageError as exc:
        parser.exit(EXIT_USAGE, f"pallet {args.command}: error: {exc}\n")
    except PalletError as exc:
        print(f"pallet {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:       # SIGINT or SIGTERM: Interrupted
        return interrupts.report(exc)
    except BrokenPipeError:        # e.g. `pallet ls BUNDLE | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:       # a defect of pallet's: one line for the user, the traceback on request
        if os.environ.get("PALLET_DEBUG"):
            raise
        print(f"pallet {args.command}: internal error: {type(exc).__name__}: {exc}\n"
              "  hint: this is a defect in pallet; rerun with PALLET_DEBUG=1 for the traceback and report it",
              file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
