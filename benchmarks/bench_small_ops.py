"""Small operations over ssh: pallet send and fetch of 1-20 small files over a run's warm host session against
`rsync -a` over a warm ssh ControlMaster; the first operation of a run (a new Python process, a new connection)
against rsync with a fresh ssh; and the fixed cost of a query. Over ssh loopback (0 ms) and an emulated
40 ms / 1 Gbit link (a network namespace; needs root)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench_bundle import child_env, code_version
from push_report import Target
from wan import NS_IP, LinkSpec, WanLink, emulated_wan, missing_tools
from wan_servers import SSH_USER, NetnsSSHD, _start, _wait_for_port

from staging_core import HostSessions, StagingOptions, fetch, parse_url, send
from tests.servers import free_port, sshd_setup, start_sshd, stop_process

TARGET = 1.2                    # pallet / rsync, warm and first operation (the goal)
RUN_TIMEOUT_S = 120
NO_MASTER = ("-o", "ControlMaster=no", "-o", "ControlPath=none")   # a fresh connection, whatever ssh_config says

# The first operation of a run, as a user's script pays for it: a new interpreter, pallet imported, a new pool
# with no kept connection, one send or fetch, the pool closed. Prints its own timings as JSON.
FIRST_OP = """import json, sys, time
started = time.perf_counter()
from staging_core import HostSessions, StagingOptions, fetch, send
args = json.loads(sys.argv[1])
options = StagingOptions(ssh_options=tuple(args["ssh_options"]), remote_python=args["remote_python"],
                         transport_options={"ssh": {"keep": 0}})
pool = HostSessions()
imported = time.perf_counter()
if args["op"] == "send":
    result = send(args["local"], args["items"], args["url"], options, sessions=pool)
else:
    result = fetch(args["url"], args["items"], args["local"], options, sessions=pool)
done = time.perf_counter()
pool.close()
closed = time.perf_counter()
print(json.dumps({"import_s": imported - started, "op_s": done - imported, "close_s": closed - done,
                  "strategy": result.strategy}))
"""


@dataclass(frozen=True)
class Far:
    """The sshd measured against: where it listens, how to log in, and the Python with pallet there."""

    host: str
    port: int
    user: str
    ssh_options: tuple[str, ...]
    remote_python: str

    @property
    def login(self) -> str:
        return f"{self.user}@{self.host}"

    def url(self, path: Path | str) -> str:
        return f"ssh://{self.login}:{self.port}{path}"

    def ssh(self, *extra: str) -> list[str]:
        """``ssh`` with port, login options and ``extra``, ready for a destination and a command."""
        return ["ssh", "-p", str(self.port), *self.ssh_options, *extra]

    def options(self) -> StagingOptions:
        """pallet's options for this host; no kept connection (keep 0), so that none outlives the run."""
        return StagingOptions(ssh_options=self.ssh_options, remote_python=self.remote_python,
                              transport_options={"ssh": {"keep": 0}})


class ControlMaster:
    """``ssh -M -N`` with its own ControlPath, in the foreground (its PID is ours to stop); rsync and ssh reach
    the host through it with :meth:`client`."""

    def __init__(self, far: Far, socket: Path):
        self.far, self.socket = far, socket
        self.process = subprocess.Popen([*far.ssh("-M", "-N", "-o", f"ControlPath={socket}", "-o",
                                                  "ControlPersist=no"), far.login],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while subprocess.run([*self.client(), "-O", "check", far.login], capture_output=True).returncode != 0:
            if self.process.poll() is not None or time.monotonic() > deadline:
                if self.process.poll() is None:
                    self.process.kill()
                said = self.process.communicate()[1].decode(errors="replace").strip()
                raise RuntimeError(f"ssh ControlMaster did not come up: {said or 'no message'}")
            time.sleep(0.05)

    def client(self) -> list[str]:
        return self.far.ssh("-o", f"ControlPath={self.socket}", "-o", "ControlMaster=no")

    def stop(self) -> None:
        if self.process.poll() is None:
            subprocess.run([*self.client(), "-O", "exit", self.far.login], capture_output=True, timeout=30)
        stop_process(self.process)
        if self.process.stderr is not None:
            self.process.stderr.close()


@dataclass
class Sample:
    """One timed run: seconds (None: failed), why it failed, extra timings (the first operation's own)."""

    seconds: float | None
    error: str = ""
    extra: dict = field(default_factory=dict)


@dataclass
class Side:
    """Repeated runs of one side of a case."""

    name: str
    samples: list[Sample] = field(default_factory=list)

    @property
    def seconds(self) -> list[float]:
        return [s.seconds for s in self.samples if s.seconds is not None]

    @property
    def median(self) -> float | None:
        return statistics.median(self.seconds) if self.seconds else None

    def extra_median(self, key: str) -> float | None:
        values = [s.extra[key] for s in self.samples if s.seconds is not None and key in s.extra]
        return statistics.median(values) if values else None

    @property
    def errors(self) -> list[str]:
        return list(dict.fromkeys(s.error for s in self.samples if s.error))


@dataclass
class Case:
    """pallet and its peer doing the same thing; ``prepare`` (untimed) runs before each pair."""

    name: str
    pallet: Side
    peer: Side
    run_pallet: Callable[[], Sample]
    run_peer: Callable[[], Sample]
    prepare: Callable[[int], None] = lambda _round: None
    limit: float | None = TARGET


@dataclass
class Row:
    """A line of the table: ``pallet`` over ``peer`` medians (seconds) against ``limit``."""

    link: str
    case: str
    pallet: float | None
    peer_name: str
    peer: float | None
    limit: float | None
    errors: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        return self.pallet / self.peer if self.pallet is not None and self.peer else None

    @property
    def verdict(self) -> str:
        return Target(self.case, self.ratio, self.limit).verdict


# ---------------------------------------------------------------- the files

def sizes_for(count: int, round_: int) -> list[int]:
    """A few KiB each (2-6 KiB), every size different from the previous round's, so that rsync's quick check
    (size and whole-second mtime) never skips a file."""
    return [2048 + (i * 997 + round_ * 131) % 4096 for i in range(count)]


def items_of(count: int) -> list[str]:
    return [f"a/f{i:02d}.dat" for i in range(count)]


def refresh(root: Path, count: int, round_: int) -> None:
    """New content (and size) for ``root``/a/f*.dat."""
    (root / "a").mkdir(parents=True, exist_ok=True)
    for item, size in zip(items_of(count), sizes_for(count, round_), strict=True):
        (root / item).write_bytes(os.urandom(size))


def same_files(src: Path, dest: Path, count: int) -> str:
    """'' when ``dest`` holds ``src``'s selection byte for byte, else what differs."""
    wrong = [item for item in items_of(count)
             if not (dest / item).is_file() or (dest / item).read_bytes() != (src / item).read_bytes()]
    return f"{len(wrong)} of {count} file(s) missing or different at {dest}" if wrong else ""


def timed(action: Callable[[], object], check: Callable[[], str]) -> Sample:
    """Run ``action``; its seconds when it succeeded and ``check`` finds nothing wrong."""
    started = time.perf_counter()
    try:
        outcome = action()
    except Exception as exc:  # noqa: BLE001 -- a failed run is recorded, the benchmark goes on
        return Sample(None, f"{type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - started
    problem = check()
    if not problem and isinstance(outcome, str) and outcome != "inline":
        problem = f"pallet ran {outcome}, not inline"
    return Sample(None if problem else seconds, problem)


def run_checked(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          **kwargs)
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"{Path(argv[0]).name} exited {done.returncode}: {tail}")
    return done


# ---------------------------------------------------------------- the cases

def cases(far: Far, pool: HostSessions, master: ControlMaster, work: Path, counts: list[int]) -> list[Case]:
    """Warm push and pull, first push and pull (each per file count), and the query."""
    options = far.options()
    warm_rsh = shlex.join(master.client())
    fresh_rsh = shlex.join(far.ssh(*NO_MASTER))
    found: list[Case] = []
    for count in counts:
        src, far_src = work / "local" / f"n{count}", work / "far" / f"src-n{count}"
        items = items_of(count)
        label = f"{count} file{'s' if count > 1 else ''}"
        for when, rsh in (("warm", warm_rsh), ("first", fresh_rsh)):
            push_p, push_r = (work / "far" / f"{when}-push-{who}-n{count}" for who in ("pallet", "rsync"))
            pull_p, pull_r = (work / "local" / f"{when}-pull-{who}-n{count}" for who in ("pallet", "rsync"))
            if when == "warm":
                run_push = _warm_send(pool, options, far, src, items, push_p)
                run_pull = _warm_fetch(pool, options, far, far_src, items, pull_p)
                peer = "rsync -a, warm ControlMaster"
            else:
                run_push = _first_op(far, "send", str(src), far.url(push_p), items, src, push_p)
                run_pull = _first_op(far, "fetch", str(pull_p), far.url(far_src), items, far_src, pull_p)
                peer = "rsync -a, fresh ssh"
            found.append(Case(f"{when} push, {label}", Side("pallet send"), Side(peer), run_push,
                              _rsync(rsh, f"{src}/", f"{far.login}:{push_r}/", src, push_r, count),
                              _refresher(src, count)))
            found.append(Case(f"{when} pull, {label}", Side("pallet fetch"), Side(peer), run_pull,
                              _rsync(rsh, f"{far.login}:{far_src}/", f"{pull_r}/", far_src, pull_r, count),
                              _refresher(far_src, count)))
    query_src = work / "far" / f"src-n{max(counts)}"
    paths = [str(query_src / item) for item in items_of(max(counts))]
    found.append(Case(f"query: stat of {len(paths)} paths", Side("host session stat, one request"),
                      Side("ssh host true, warm ControlMaster"), _stat(pool, options, far, paths),
                      _command([*master.client(), far.login, "true"]), limit=None))
    found.append(Case("query, fresh connection", Side("-"), Side("ssh host true, fresh ssh"), lambda: Sample(None),
                      _command([*far.ssh(*NO_MASTER), far.login, "true"]), limit=None))
    return found


def _refresher(root: Path, count: int) -> Callable[[int], None]:
    return lambda round_: refresh(root, count, round_)


def _warm_send(pool: HostSessions, options: StagingOptions, far: Far, src: Path, items: list[str],
               dest: Path) -> Callable[[], Sample]:
    return lambda: timed(lambda: send(str(src), items, far.url(dest), options, sessions=pool).strategy,
                         lambda: same_files(src, dest, len(items)))


def _warm_fetch(pool: HostSessions, options: StagingOptions, far: Far, src: Path, items: list[str],
                dest: Path) -> Callable[[], Sample]:
    return lambda: timed(lambda: fetch(far.url(src), items, str(dest), options, sessions=pool).strategy,
                         lambda: same_files(src, dest, len(items)))


def _first_op(far: Far, op: str, local: str, url: str, items: list[str], src: Path,
              dest: Path) -> Callable[[], Sample]:
    """A new interpreter running :data:`FIRST_OP`: the whole process timed, its own timings as extras."""
    spec = json.dumps({"op": op, "local": local, "url": url, "items": items, "ssh_options": list(far.ssh_options),
                       "remote_python": far.remote_python})

    def run() -> Sample:
        holder: dict = {}

        def action() -> str:
            done = run_checked([sys.executable, "-c", FIRST_OP, spec], env=child_env())
            holder.update(json.loads(done.stdout.strip().splitlines()[-1]))
            return str(holder["strategy"])
        sample = timed(action, lambda: same_files(src, dest, len(items)))
        sample.extra = {k: v for k, v in holder.items() if k.endswith("_s")}
        return sample
    return run


def _rsync(rsh: str, source: str, target: str, src: Path, dest: Path, count: int) -> Callable[[], Sample]:
    return lambda: timed(lambda: run_checked(["rsync", "-a", "-e", rsh, source, target]),
                         lambda: same_files(src, dest, count))


def _stat(pool: HostSessions, options: StagingOptions, far: Far, paths: list[str]) -> Callable[[], Sample]:
    """One batched stat of ``paths`` over the warm session, as the inventory asks it (``stat_many``, or the bare
    ``stat`` request where the session has no such method)."""
    session = pool.session(parse_url(far.url("/")), options)
    assert session is not None
    payload = b"\0".join(os.fsencode(p) for p in paths)

    def query() -> int:
        if hasattr(session, "stat_many"):
            return len(session.stat_many(paths))
        return session.request("stat", payload).count(b"\0") // 8     # eight NUL-ended fields a record (serve.py)

    def run() -> Sample:
        found: list[int] = []
        return timed(lambda: found.append(query()), lambda: "" if found == [len(paths)] else
                     f"stat found {found} of {len(paths)} paths")
    return run


def _command(argv: list[str]) -> Callable[[], Sample]:
    return lambda: timed(lambda: run_checked(argv), lambda: "")


# ---------------------------------------------------------------- running

def measure(link: str, found: list[Case], repeat: int) -> list[Row]:
    """One untimed round (the warm-up: the pool's first operation starts its connection and far side), then
    ``repeat`` rounds; in each, every case's pallet and peer run back to back, which goes first alternating."""
    for round_ in range(repeat + 1):
        ordered = found if round_ % 2 == 0 else list(reversed(found))
        for case in ordered:
            case.prepare(round_)
            pair = [(case.pallet, case.run_pallet), (case.peer, case.run_peer)]
            for side, run in pair if round_ % 2 == 0 else reversed(pair):
                sample = run()
                if round_ == 0:
                    if sample.error:
                        print(f"  warm-up {case.name} / {side.name}: FAILED {sample.error}", flush=True)
                    continue
                side.samples.append(sample)
        if round_:
            print(f"  [{link}] round {round_}/{repeat} done", flush=True)
    rows = []
    for case in found:
        pallet = case.pallet.median if case.pallet.name != "-" else None
        rows.append(Row(link, case.name, pallet, case.peer.name, case.peer.median, case.limit,
                        case.pallet.errors + case.peer.errors))
        if case.name.startswith("first"):
            for key, what in (("import_s", "interpreter + import"), ("op_s", "in-process first op"),
                              ("close_s", "pool close")):
                timed_op = key == "op_s"
                rows.append(Row(link, f"  {case.name}: {what}", case.pallet.extra_median(key),
                                case.peer.name if timed_op else "", case.peer.median if timed_op else None, None))
    return rows


def run_link(link_label: str, far: Far, work: Path, counts: list[int], repeat: int) -> list[Row]:
    """Files, a warm pool (its first operation in the warm-up round) and a ControlMaster for rsync; measure."""
    for count in counts:
        refresh(work / "local" / f"n{count}", count, 0)
        refresh(work / "far" / f"src-n{count}", count, 0)
    pool = HostSessions()
    master = ControlMaster(far, work / "cm.sock")
    try:
        started = time.perf_counter()
        first = send(str(work / "local" / f"n{counts[0]}"), items_of(counts[0]), far.url(work / "far" / "warm-up"),
                     far.options(), sessions=pool)
        print(f"  [{link_label}] the pool's first operation (connection + far side + send, interpreter warm): "
              f"{(time.perf_counter() - started) * 1000:.0f} ms, {first.strategy}", flush=True)
        return measure(link_label, cases(far, pool, master, work, counts), repeat)
    finally:
        pool.close()
        master.stop()


def login_config(work: Path, keep_home: bool) -> tuple[str, ...]:
    """sshd_config lines for the sessions: HOME an empty directory, so that the login shell reads no rc file of
    this machine's account (bash sources ~/.bashrc under sshd; one that runs e.g. `pyenv init` adds its time to
    every remote command), unless ``keep_home``."""
    if keep_home:
        return ()
    (home := work / "home").mkdir(parents=True, exist_ok=True)
    return (f"SetEnv HOME={home}",)


@contextmanager
def loopback(work: Path, keep_home: bool) -> Iterator[Far]:
    server = start_sshd(work / "sshd", login_config(work, keep_home))
    try:
        yield Far("127.0.0.1", server.port, server.user, tuple(server.ssh_options), sys.executable)
    finally:
        server.stop()


def start_netns_sshd(link: WanLink, workdir: Path, extra_config: tuple[str, ...]) -> NetnsSSHD:
    """wan_servers.start_netns_sshd with ``extra_config`` lines in its sshd_config."""
    port = free_port()
    config, options = sshd_setup(workdir, NS_IP, port, extra_config)
    process = _start(link.ns(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)]), workdir / "sshd.log", workdir)
    _wait_for_port(NS_IP, port, process, workdir / "sshd.log")
    return NetnsSSHD(NS_IP, port, SSH_USER, process, options)


@contextmanager
def namespace(work: Path, spec: LinkSpec, keep_home: bool) -> Iterator[tuple[Far, str]]:
    with ExitStack() as stack:
        link = stack.enter_context(emulated_wan(work, spec))
        check = link.checked()
        sshd = start_netns_sshd(link, work / "sshd", login_config(work, keep_home))
        stack.callback(sshd.stop)
        stack.callback(_end_clients, sshd)
        yield (Far(sshd.host, sshd.port, sshd.user, tuple(sshd.ssh_options), sys.executable),
               f"ping -U {check.ping_ms:.1f} ms, one TCP stream {check.stream_mbit:.0f} Mbit/s")


def _end_clients(sshd) -> None:
    if ended := sshd.end_clients():
        print(f"stopped ssh clients left connected to the namespace: PIDs {ended}")


# ---------------------------------------------------------------- report

def print_table(rows: list[Row]) -> None:
    print(f"\n{'link':8s} {'case':44s} {'pallet ms':>10s}  {'peer':34s} {'peer ms':>8s} {'ratio':>6s}  "
          f"{'target':8s} verdict")
    for row in rows:
        pallet = f"{row.pallet * 1000:10.1f}" if row.pallet is not None else f"{'-':>10s}"
        peer = f"{row.peer * 1000:8.1f}" if row.peer is not None else f"{'-':>8s}"
        ratio = f"{row.ratio:6.2f}" if row.ratio is not None else f"{'-':>6s}"
        limit = f"<= {row.limit:g}" if row.limit is not None else ""
        print(f"{row.link:8s} {row.case:44s} {pallet}  {row.peer_name:34s} {peer} {ratio}  {limit:8s} "
              f"{row.verdict if row.limit is not None else ''}")
        for error in row.errors:
            print(f"{'':8s}   error: {error}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5, help="measured rounds per link (default 5; medians)")
    parser.add_argument("--files", type=lambda text: [int(n) for n in text.split(",")], default=[1, 5, 20],
                        metavar="N[,N...]", help="files per operation (default 1,5,20)")
    parser.add_argument("--rtt-ms", type=float, default=40.0, help="round trip of the emulated link (default 40)")
    parser.add_argument("--rate", default="1gbit", help="tbf rate cap of the emulated link (default 1gbit)")
    parser.add_argument("--only-loopback", action="store_true", help="skip the emulated link (needs no root)")
    parser.add_argument("--keep-home", action="store_true",
                        help="sessions keep the account's HOME, and so its shell rc files (default: an empty HOME)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "pallet-bench",
                        help="runs are written below it (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="write the raw numbers to FILE")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))       # so that the link is torn down
    args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="small-ops-", dir=args.workdir))
    os.environ["XDG_CONFIG_HOME"] = str(work / "config")            # profiles and probe findings of this run only
    print(f"pallet {code_version()}; {args.files} files per operation, {args.repeat} rounds; work in {work}")
    rows: list[Row] = []
    failed = ""
    print("\n== ssh loopback (0 ms)", flush=True)
    with loopback(work / "loopback", args.keep_home) as far:
        rows += run_link("0 ms", far, work / "loopback", args.files, args.repeat)
    if not args.only_loopback:
        spec = LinkSpec(args.rtt_ms, args.rate)
        if os.geteuid() != 0 or missing_tools():
            print(f"\nskipping the emulated link: needs root and {', '.join(missing_tools()) or 'its tools'}")
        else:
            print(f"\n== emulated link {spec.label}", flush=True)
            (work / "wan").mkdir()
            try:
                with namespace(work / "wan", spec, args.keep_home) as (far, measured):
                    print(f"  {measured}", flush=True)
                    rows += run_link(f"{spec.rtt_ms:g} ms", far, work / "wan", args.files, args.repeat)
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                failed = f"the emulated link failed: {exc}"
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"commit": code_version(), "repeat": args.repeat, "rows": [
            {**vars(row), "ratio": row.ratio, "verdict": row.verdict} for row in rows]}, indent=2))
        print(f"raw numbers written to {args.json}")
    print(f"keys and server logs of this run are in {work}")
    if failed:
        print(failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
