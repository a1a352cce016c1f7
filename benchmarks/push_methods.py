"""The ways bench_push.py moves a tree over the emulated WAN, each timed, each result checked at the destination."""
from __future__ import annotations

import itertools
import json
import os
import shlex
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable

from contextlib import ExitStack

from bench_bundle import child_env, pallet_cmd
from wan import LinkSpec, WanLink, emulated_wan
from wan_servers import NetnsGridFTP, NetnsSSHD, start_netns_gridftp, start_netns_sshd
from workloads import md5_list

Manifest = dict[str, int]          # relative path -> size of every regular file
RUN_TIMEOUT_S = 3 * 3600           # one run taking longer than this counts as failed


@dataclass(frozen=True)
class Outcome:
    """One run's timed seconds and, for pallet, its ``--json`` summary."""

    seconds: float
    summary: dict = field(default_factory=dict)


@dataclass
class Attempt:
    """One repetition: seconds (None when it failed), why it failed, pallet's summary."""

    seconds: float | None
    error: str = ""
    summary: dict = field(default_factory=dict)


@dataclass
class Method:
    """Repeated runs of one way of moving a tree; ``scale`` extrapolates a sample's seconds to the whole tree."""

    name: str
    attempts: list[Attempt] = field(default_factory=list)
    scale: float = 1.0

    @property
    def seconds(self) -> list[float]:
        return [a.seconds * self.scale for a in self.attempts if a.seconds is not None]

    @property
    def median(self) -> float | None:
        return statistics.median(self.seconds) if self.seconds else None

    @property
    def errors(self) -> list[str]:
        return [a.error for a in self.attempts if a.error]

    def to_json(self) -> dict:
        return {"median_s": self.median, "runs_s": self.seconds, "scale": self.scale, "errors": self.errors,
                "pallet": [a.summary for a in self.attempts if a.summary]}


@dataclass
class Rig:
    """The servers in the namespace, where destinations go, and the environment of every pallet run."""

    sshd: NetnsSSHD
    gridftp: NetnsGridFTP | None
    dest_root: Path
    config_home: Path
    remote_python: str
    _numbers: itertools.count = field(default_factory=itertools.count)

    def fresh_dest(self, slug: str) -> Path:
        """A path that does not exist yet under ``dest_root``."""
        return self.dest_root / f"{slug}-{next(self._numbers):03d}"

    def pallet_env(self) -> dict[str, str]:
        """This checkout first, profiles under ``config_home``, the test sshd's key for every ssh pallet opens."""
        return {**child_env(), "XDG_CONFIG_HOME": str(self.config_home),
                "PALLET_SSH_OPTIONS": shlex.join(self.sshd.ssh_options)}

    def clear_destinations(self) -> None:
        """Delete every destination written so far (untimed, between comparisons)."""
        shutil.rmtree(self.dest_root, ignore_errors=True)
        self.dest_root.mkdir(parents=True)


def start_rig(stack: ExitStack, work: Path, spec: LinkSpec, dest_base: Path | None, remote_python: str,
              gridftp: bool = True) -> tuple[WanLink, Rig]:
    """The emulated link ``spec``, an sshd (and with ``gridftp`` a GridFTP server) in its namespace, and the
    Rig over them, its destinations under ``dest_base`` (default: ``work``/dest); ``stack`` tears it all down,
    stopping ssh clients a failed run left connected."""
    link = stack.enter_context(emulated_wan(work, spec))
    sshd = start_netns_sshd(link, work / "sshd")
    stack.callback(sshd.stop)
    stack.callback(_report_stray_clients, sshd)
    server = start_netns_gridftp(link, work / "gridftp") if gridftp else None
    if server is not None:
        stack.callback(server.stop)
    dest_root = dest_base / work.name if dest_base else work / "dest"
    stack.callback(shutil.rmtree, dest_root, True)
    rig = Rig(sshd, server, dest_root, work / "config", remote_python)
    rig.clear_destinations()
    return link, rig


def _report_stray_clients(sshd: NetnsSSHD) -> None:
    if ended := sshd.end_clients():
        print(f"stopped ssh clients left connected to the namespace: PIDs {ended}")


@dataclass(frozen=True)
class MethodSpec:
    """How to run one method: ``run(src, dest)`` times itself; ``expected`` is what must arrive."""

    name: str
    slug: str
    run: Callable[[Path, Path], Outcome]
    expected: Manifest
    scale: float = 1.0


class MethodFailed(RuntimeError):
    """A command of the method exited non-zero."""


def manifest(root: Path) -> Manifest:
    """Every regular file under ``root`` with its size; pallet's own ``.pallet`` directory at the top is left out."""
    found: Manifest = {}
    for folder, dirs, files in os.walk(root):
        if folder == str(root) and ".pallet" in dirs:
            dirs.remove(".pallet")
        for name in files:
            path = os.path.join(folder, name)
            if os.path.isfile(path) and not os.path.islink(path):
                found[os.path.relpath(path, root)] = os.path.getsize(path)
    return found


def check_destination(expected: Manifest, dest: Path) -> str:
    """'' when ``dest`` holds exactly the expected files with the expected sizes, else what differs."""
    found = manifest(dest)
    missing = expected.keys() - found.keys()
    extra = found.keys() - expected.keys()
    wrong = [p for p in expected.keys() & found.keys() if expected[p] != found[p]]
    if not (missing or extra or wrong):
        return ""
    return (f"destination check: {len(missing)} missing, {len(extra)} unexpected, {len(wrong)} of wrong size "
            f"(found {len(found)} files, {sum(found.values())} bytes; expected {len(expected)}, "
            f"{sum(expected.values())})")


def run_once(spec: MethodSpec, src: Path, dest: Path) -> Attempt:
    """Run ``spec`` into the fresh ``dest`` and check what arrived; a failure is recorded, not raised."""
    try:
        outcome = spec.run(src, dest)
    except (MethodFailed, OSError, ValueError) as exc:
        return Attempt(None, str(exc))
    except subprocess.TimeoutExpired as exc:
        return Attempt(None, f"{Path(str(exc.cmd[0])).name} did not finish within {exc.timeout:.0f} s")
    problem = check_destination(spec.expected, dest)
    return Attempt(None if problem else outcome.seconds, problem, outcome.summary)


def measure(rig: Rig, src: Path, specs: list[MethodSpec], repeat: int) -> list[Method]:
    """Every method ``repeat`` times into fresh destinations, alternating which goes first; each run printed."""
    methods = {spec.name: Method(spec.name, scale=spec.scale) for spec in specs}
    for rep in range(repeat):
        for spec in specs if rep % 2 == 0 else reversed(specs):
            attempt = run_once(spec, src, rig.fresh_dest(spec.slug))
            methods[spec.name].attempts.append(attempt)
            shown = f"{attempt.seconds:8.2f} s" if attempt.seconds is not None else f"FAILED {attempt.error}"
            stages = (attempt.summary or {}).get("stage_seconds", {})
            shown += "  " + ", ".join(f"{name} {seconds:.2f}" for name, seconds in stages.items()) if stages else ""
            print(f"    [{rep + 1}/{repeat}] {spec.name:44s} {shown}", flush=True)
    return list(methods.values())


def _checked(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          **kwargs)
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise MethodFailed(f"{Path(argv[0]).name} exited {done.returncode}: {tail}")
    return done


def _timed(argv: list[str], **kwargs) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    done = _checked(argv, **kwargs)
    return time.perf_counter() - started, done


# ---------------------------------------------------------------- pallet

def pallet_push(rig: Rig, strategy: str = "auto", profile: str | None = None,
                gridftp: bool = False, tar_tools: bool = False) -> Callable[[Path, Path], Outcome]:
    """`pallet push --json` over ssh (or to the GridFTP server, unpacked through ssh) with these options;
    ``tar_tools`` names no Python with pallet, so that the far side's own tar is used (the tar-tools route; its probe
    is cached per host, so only the first run pays for it)."""
    def run(src: Path, dest: Path) -> Outcome:
        argv = [*pallet_cmd(), "push", "--quiet", "--json", "--strategy", strategy]
        argv += ["--remote-python", "python3"] if tar_tools else ["--remote-python", rig.remote_python]
        argv += ["--profile", profile] if profile else []
        argv += ["--unpack-via", rig.sshd.url("")] if gridftp else []
        url = rig.gridftp.url(str(dest)) if gridftp else rig.sshd.url(str(dest))
        seconds, done = _timed([*argv, str(src), url], env=rig.pallet_env())
        return Outcome(seconds, _last_json(done.stdout))
    return run


def pallet_pull(rig: Rig) -> Callable[[Path, Path], Outcome]:
    """`pallet pull --json ssh://HOST/SRC DEST`: the tree at the far side (the same path, seen through the
    namespace's sshd) into a local DEST."""
    def run(src: Path, dest: Path) -> Outcome:
        argv = [*pallet_cmd(), "pull", "--quiet", "--json", "--remote-python", rig.remote_python,
                rig.sshd.url(str(src)), str(dest)]
        seconds, done = _timed(argv, env=rig.pallet_env())
        return Outcome(seconds, _last_json(done.stdout))
    return run


def pallet_plan(rig: Rig, src: Path, profile: str | None) -> dict:
    """`pallet plan --json` for an ssh destination: the strategy it would pick and its predictions."""
    argv = [*pallet_cmd(), "plan", "--json", *(["--profile", profile] if profile else []),
            str(src), rig.sshd.url(str(rig.dest_root / "plan"))]
    return _last_json(_checked(argv, env=rig.pallet_env()).stdout)


def pallet_calibrate(rig: Rig, name: str) -> dict:
    """`pallet calibrate --name NAME` against the namespace's sshd; the profile is stored under ``config_home``."""
    scratch = rig.dest_root / "calibrate"
    argv = [*pallet_cmd(), "calibrate", "--json", "--name", name, rig.sshd.url(str(scratch))]
    return _last_json(_checked(argv, env=rig.pallet_env()).stdout)


def _last_json(stdout: str) -> dict:
    lines = stdout.strip().splitlines()
    try:
        return json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError as exc:
        raise MethodFailed(f"no JSON summary in pallet's output: {lines[-1][:200]}") from exc


# ---------------------------------------------------------------- peers

def stream_peer(rig: Rig, tap: list[str] | None = None) -> Callable[[Path, Path], Outcome]:
    """`tar -cf - | zstd -T0 | ssh HOST 'mkdir -p DEST && zstd -dc | tar -xf - -C DEST'`; ``tap``: a far-side
    command that the compressed stream passes through first (a probe)."""
    def run(src: Path, dest: Path) -> Outcome:
        remote = (f"{shlex.join(['mkdir', '-p', str(dest)])} && {shlex.join(tap) + ' | ' if tap else ''}"
                  f"zstd -dcq | {shlex.join(['tar', '-xf', '-', '-C', str(dest)])}")
        return _timed_pipeline([["tar", "-cf", "-", "-C", str(src), "."], ["zstd", "-q", "-T0", "-c"],
                                [*rig.sshd.ssh_argv(), rig.sshd.login, remote]], "tar | zstd | ssh")
    return run


def verified_stream_peer(rig: Rig) -> Callable[[Path, Path], Outcome]:
    """The verified floor: the hand-made stream (whole-second mtimes in ustar headers, as pallet's bundles carry
    them since format 2), then `md5sum -c` at the far side against a list of the source's files made before the
    clock starts (bench_tar_tools.py explains the floor)."""
    def run(src: Path, dest: Path) -> Outcome:
        listing = md5_list(src, src.parent / f"{src.name}.md5")
        remote = (f"{shlex.join(['mkdir', '-p', str(dest)])} && zstd -dcq | "
                  f"{shlex.join(['tar', '-xf', '-', '-C', str(dest)])}"
                  f" && cd {shlex.quote(str(dest))} && "
                  f"{shlex.join(['md5sum', '--quiet', '--strict', '-c', str(listing)])}")
        return _timed_pipeline([["tar", "-cf", "-", "-C", str(src), "."], ["zstd", "-q", "-T0", "-c"],
                                [*rig.sshd.ssh_argv(), rig.sshd.login, remote]], "verified stream")
    return run


def stream_pull_peer(rig: Rig) -> Callable[[Path, Path], Outcome]:
    """The reverse hand-made stream: `ssh HOST 'tar -cf - -C SRC . | zstd -T0 -c' | zstd -dc | tar -xf - -C DEST`."""
    def run(src: Path, dest: Path) -> Outcome:
        remote = f"{shlex.join(['tar', '-cf', '-', '-C', str(src), '.'])} | zstd -q -T0 -c"
        dest.mkdir(parents=True)
        return _timed_pipeline([[*rig.sshd.ssh_argv(), rig.sshd.login, remote], ["zstd", "-dcq"],
                                ["tar", "-xf", "-", "-C", str(dest)]], "ssh | zstd -d | tar x")
    return run


def _timed_pipeline(stages: list[list[str]], name: str) -> Outcome:
    """:func:`_pipeline`, timed; MethodFailed naming the pipeline if a stage failed."""
    started = time.perf_counter()
    codes = _pipeline(stages)
    seconds = time.perf_counter() - started
    if any(codes):
        raise MethodFailed(f"{name} exited {codes}")
    return Outcome(seconds)


def _pipeline(stages: list[list[str]]) -> list[int]:
    """Run ``stages`` connected stdout to stdin; the exit codes."""
    processes: list[subprocess.Popen] = []
    for number, argv in enumerate(stages):
        upstream = processes[-1].stdout if processes else subprocess.DEVNULL
        last = number == len(stages) - 1
        processes.append(subprocess.Popen(argv, stdin=upstream, stdout=subprocess.DEVNULL if last else subprocess.PIPE))
        if upstream is not subprocess.DEVNULL:
            upstream.close()
    try:
        return [p.wait(RUN_TIMEOUT_S) for p in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def rsync_peer(rig: Rig, pull: bool = False) -> Callable[[Path, Path], Outcome]:
    """`rsync -a -e 'ssh ...' SRC/ HOST:DEST/`, or with ``pull`` `rsync -a -e 'ssh ...' HOST:SRC/ DEST/`."""
    def run(src: Path, dest: Path) -> Outcome:
        source, target = f"{src}/", f"{dest}/"
        if pull:
            source = f"{rig.sshd.login}:{source}"
        else:
            target = f"{rig.sshd.login}:{target}"
        seconds, _ = _timed(["rsync", "-a", "-e", shlex.join(rig.sshd.ssh_argv()), source, target])
        return Outcome(seconds)
    return run


def gridftp_peer(rig: Rig, concurrency: int) -> Callable[[Path, Path], Outcome]:
    """`globus-url-copy -r -pp -cc N -cd file://SRC/ ftp://HOST:PORT/DEST/`."""
    def run(src: Path, dest: Path) -> Outcome:
        seconds, _ = _timed(["globus-url-copy", "-r", "-pp", "-cc", str(concurrency), "-cd", f"file://{src}/",
                             rig.gridftp.url(f"{dest}/")])
        return Outcome(seconds)
    return run


def scp_sample(rig: Rig, sample: list[str]) -> Callable[[Path, Path], Outcome]:
    """One `scp -p` per file of ``sample`` (each a new ssh connection); directories made beforehand, untimed."""
    def run(src: Path, dest: Path) -> Outcome:
        folders = sorted({str(dest / os.path.dirname(p)) for p in sample})
        _checked([*rig.sshd.ssh_argv(), rig.sshd.login, shlex.join(["mkdir", "-p", *folders])])
        scp = ["scp", "-q", "-p", "-P", str(rig.sshd.port), *rig.sshd.ssh_options]
        started = time.perf_counter()
        for path in sample:
            _checked([*scp, str(src / path), f"{rig.sshd.login}:{dest / path}"])
        return Outcome(time.perf_counter() - started)
    return run


def sample_of(expected: Manifest, count: int) -> list[str]:
    """``count`` paths spread evenly over the sorted tree."""
    paths = sorted(expected)
    step = max(1, len(paths) // max(1, count))
    return paths[::step][:count]
