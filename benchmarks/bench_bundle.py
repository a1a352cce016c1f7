"""Benchmark `pallet pack`/`unpack` (each engine) against tar + zstd and the read/create floors, and the peak RSS
of a 1,000,000-entry index."""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))           # import this checkout's bundles/, whatever is installed

from workloads import MIB, Workload, common_parser, ensure_workload, workloads  # noqa: E402
TARGETS = {("pack", "W1"): 0.9, ("pack", "W2"): 1.0, ("unpack", "W1"): 0.7}     # pallet seconds / peer seconds
RSS_TARGET_MB = 300.0       # peak RSS, MB = 10**6 bytes (the bound for a 1,000,000-entry index)
GNU_TIME = shutil.which("time", path="/usr/bin:/bin")     # reports each process's own peak RSS
NOISE_LIMIT = 0.25          # a run during which other processes used more than this share of a CPU is rerun
INDEX_ENTRIES = 1_000_000


@dataclass
class Run:
    """One timed command or pipeline: wall/CPU seconds, max RSS, CPU the rest of the machine used, output."""

    seconds: float
    cpu_seconds: float
    max_rss_kb: int
    other_cpu_seconds: float
    output: str


@dataclass
class Measurement:
    """Repeated runs of one command line (``discarded``: runs redone because the machine was busy)."""

    tool: str
    argv: list[list[str]]
    env: dict[str, str] = field(default_factory=dict)      # added to the children's environment
    runs: list[Run] = field(default_factory=list)
    discarded: list[Run] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(r.seconds for r in self.runs)

    @property
    def cpu_median(self) -> float:
        return statistics.median(r.cpu_seconds for r in self.runs)

    @property
    def noise(self) -> float:
        return max(r.other_cpu_seconds / r.seconds for r in self.runs)


@dataclass
class Comparison:
    """pallet (one engine) vs the peer pipeline on one workload; ``ratio`` is pallet median / peer median,
    ``floor_ratio`` pallet median / the floor's (reading the tree, or creating it from an uncompressed tar)."""

    name: str
    workload: str
    engine: str
    files: int
    pallet: Measurement
    peer: Measurement
    floor: Measurement
    target: float

    @property
    def ratio(self) -> float:
        return self.pallet.median / self.peer.median

    @property
    def floor_ratio(self) -> float:
        return self.pallet.median / self.floor.median

    @property
    def cpu_us_per_file(self) -> float:
        return self.pallet.cpu_median / self.files * 1e6

    @property
    def passed(self) -> bool:
        return self.ratio <= self.target


@dataclass(frozen=True)
class Settings:
    """Where run outputs go (unpacks: ``unpack_dir``), repetitions, idle wait before each run, reruns allowed
    for a noisy run."""

    runs_dir: Path
    repeat: int
    idle_wait: float
    retries: int
    unpack_dir: Path
    engines: tuple[str, ...]


@dataclass
class RssResult:
    """Peak RSS of one fresh subprocess working on the synthetic index."""

    name: str
    entries: int
    seconds: float
    max_rss_kb: int

    @property
    def max_rss_mb(self) -> float:
        return self.max_rss_kb * 1024 / 1e6

    @property
    def passed(self) -> bool:
        return self.max_rss_mb < RSS_TARGET_MB


def run(stages: list[list[str]], stdout_path: str | None = None, env: dict[str, str] | None = None) -> Run:
    """Run ``stages`` as a pipeline (no shell), timed with perf_counter; CPU via wait4, peak RSS via GNU time."""
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp, "log"), "w+b") as log, \
            open(stdout_path or os.devnull, "wb") as sink:
        busy, started, procs = machine_busy_seconds(), time.perf_counter(), []
        for n, argv in enumerate(stages):
            stdin = procs[-1].stdout if procs else subprocess.DEVNULL
            stdout = (sink if stdout_path else log) if n == len(stages) - 1 else subprocess.PIPE
            wrap = [GNU_TIME, "-f", "%M", "-o", str(Path(tmp, f"rss{n}"))] if GNU_TIME else []
            procs.append(subprocess.Popen(wrap + argv, stdin=stdin, stdout=stdout, stderr=log,
                                          env={**child_env(), **(env or {})}))
            if n:
                stdin.close()
        rss, cpu, codes = _wait_all(procs)
        seconds = time.perf_counter() - started
        other = max(0.0, machine_busy_seconds() - busy - cpu)
        if GNU_TIME:    # wait4 alone would also count this process's own peak, inherited through fork and exec
            rss = max(int(Path(tmp, f"rss{n}").read_text().split()[-1]) for n in range(len(stages)))
        output = Path(tmp, "log").read_bytes().decode(errors="replace")
    if any(codes):
        raise RuntimeError(f"command failed (exit {codes}): {' | '.join(map(' '.join, stages))}\n{output}")
    return Run(seconds, cpu, rss, other, output)


def _wait_all(procs: list[subprocess.Popen]) -> tuple[int, float, list[int]]:
    """Reap each process; its rusage covers it and its reaped workers (max RSS, user+system CPU)."""
    rss, cpu, codes = 0, 0.0, []
    for proc in procs:
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        codes.append(proc.returncode)
        rss, cpu = max(rss, usage.ru_maxrss), cpu + usage.ru_utime + usage.ru_stime
    return rss, cpu, codes


def machine_busy_seconds() -> float:
    """Non-idle CPU seconds of the whole machine since boot (0 where /proc/stat is missing)."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split()[1:9]]
    except OSError:
        return 0.0
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")      # all but idle and iowait


def child_env() -> dict[str, str]:
    """Environment for children: this checkout first on PYTHONPATH, so it is the code under test."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def code_version() -> str:
    """Commit of the checkout under test, ``-dirty`` if tracked files have uncommitted changes."""
    done = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                          text=True, check=False)
    return done.stdout.strip() or "unknown"


def pallet_cmd() -> list[str]:
    """The `pallet` script of this interpreter's environment (or the module, if there is none)."""
    script = Path(sys.executable).with_name("pallet")
    return [str(script)] if script.exists() else [sys.executable, "-m", "staging_core.cli.main"]


def wait_for_idle(limit: float, threshold: float = 0.1) -> float:
    """Wait up to ``limit`` s for a 1-s window where the machine used < ``threshold`` CPU-s; return the wait."""
    started = time.perf_counter()
    while time.perf_counter() - started < limit:
        before = machine_busy_seconds()
        time.sleep(1.0)
        if machine_busy_seconds() - before < threshold:
            break
    return time.perf_counter() - started


def timed(measurement: Measurement, tag: str, settings: Settings, stdout_path: str | None = None) -> None:
    """Run the command once after a sync and an idle wait (both untimed); redo it if the machine was busy."""
    for attempt in range(settings.retries + 1):
        os.sync()
        waited = wait_for_idle(settings.idle_wait)
        result = run(measurement.argv, stdout_path, measurement.env)
        noisy = result.other_cpu_seconds > NOISE_LIMIT * result.seconds and attempt < settings.retries
        print(f"  {tag:<20} {measurement.tool:<8} {result.seconds:7.3f} s  cpu {result.cpu_seconds:6.2f} s  "
              f"rss {result.max_rss_kb / 1024:6.1f} MiB  other CPU {result.other_cpu_seconds:5.2f} s  "
              f"(idle wait {waited:.0f} s){'  DISCARDED: machine busy, running again' if noisy else ''}", flush=True)
        for line in result.output.splitlines():
            print(f"      | {line}", flush=True)
        if not noisy:
            break
        measurement.discarded.append(result)
    measurement.runs.append(result)


def compare(name: str, load: Workload, settings: Settings, commands: Callable, floor_name: str) -> list[Comparison]:
    """Time pallet (each engine), the peer and the floor: ``commands(rep)`` -> (pallet argv, peer argv, peer
    stdout, floor argv); the order rotates from one repetition to the next."""
    mine = [Measurement(f"pallet-{e}", [], {"PALLET_ENGINE": e}) for e in settings.engines]
    peer, floor = Measurement("tar+zstd", []), Measurement(floor_name, [])
    everyone = [*mine, peer, floor]
    for rep in range(settings.repeat):
        pallet_argv, peer.argv, peer_stdout, floor.argv = commands(rep)
        for m in mine:
            m.argv = pallet_argv(m.env["PALLET_ENGINE"])
        turn = rep % len(everyone)
        for m in everyone[turn:] + everyone[:turn]:
            sink = peer_stdout if m is peer else os.devnull if m is floor else None
            timed(m, f"{name} {load.name} rep {rep + 1}", settings, sink)
    target = TARGETS[(name, load.name)]
    return [Comparison(name, load.label, m.env["PALLET_ENGINE"], load.files, m, peer, floor, target) for m in mine]


def compare_pack(load: Workload, src: Path, settings: Settings) -> tuple[list[Comparison], Path, Path]:
    """`pallet pack` vs `tar -cf - | zstd -T2` and the reading floor `tar -cf - | cat > /dev/null`, each rep to
    a new file; return the first outputs too."""
    def out(tool: str, rep: int) -> Path:
        return settings.runs_dir / f"pack-{load.name.lower()}-{tool}-{rep}.tar.zst"

    def commands(rep: int):
        return (lambda engine: [pallet_cmd() + ["pack", str(src), str(out(f"pallet-{engine}", rep))]],
                [["tar", "-cf", "-", "-C", str(src), "."], ["zstd", "-T2", "-q"]], str(out("peer", rep)),
                [["tar", "-cf", "-", "-C", str(src), "."], ["cat"]])
    warm_cache(src)
    return (compare("pack", load, settings, commands, "read floor"), out(f"pallet-{settings.engines[0]}", 0),
            out("peer", 0))


def compare_unpack(load: Workload, bundle: Path, tarball: Path, settings: Settings) -> list[Comparison]:
    """`pallet unpack` (verifying) vs `zstd -dc | tar -x` and the creating floor `tar -x` of an uncompressed tar,
    each rep into a fresh directory."""
    def dest(tool: str, rep: int) -> Path:
        path = settings.unpack_dir / f"unpack-{load.name.lower()}-{tool}-{rep}"
        path.mkdir()
        return path

    plain = settings.runs_dir / f"{load.name.lower()}.tar"
    subprocess.run(["zstd", "-dqf", str(tarball), "-o", str(plain)], check=True)

    def commands(rep: int):
        return (lambda engine: [pallet_cmd() + ["unpack", str(bundle), str(dest(f"pallet-{engine}", rep))]],
                [["zstd", "-dc", str(tarball)], ["tar", "-x", "-C", str(dest("peer", rep))]], None,
                [["tar", "-xf", str(plain), "-C", str(dest("floor", rep))]])
    warm_cache(bundle, Path(f"{bundle}.pidx"), tarball, plain)
    return compare("unpack", load, settings, commands, "create floor")


def warm_cache(*paths: Path) -> None:
    """Read the inputs once (untimed), so that no run pays alone for a cold page cache."""
    for file in (f for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()):
        with open(file, "rb", buffering=0) as handle:
            while handle.read(8 * MIB):
                pass


def build_index(entries: int):
    """Build a synthetic Index of ``entries`` entries laid out as `pallet pack` would lay them out."""
    from bundles.index import Index
    from bundles.tarformat import Kind
    try:
        from bundles.shards import auto_shard_size, plan_shards
    except ImportError:
        from bundles.writer import auto_shard_size, plan_shards
    rng = random.Random(11)
    index = Index("zstd", 3, 0)
    dirs = min(1_000, max(1, entries // 2))
    files, number = entries - dirs, 0
    for d in range(dirs):
        _add(index, f"d{d:04d}".encode(), Kind.DIR, 0o755, 0, bytes(16), rng)
        for _ in range(files // dirs + (d < files % dirs)):
            _add(index, b"d%04d/f%07d.csv" % (d, number), Kind.FILE, 0o644, rng.randint(200, 4000),
                 rng.randbytes(16), rng)
            number += 1
    index.shard_size = auto_shard_size(index)
    _assign_shards(index, plan_shards(index, index.shard_size), rng)
    return index


def _add(index, path: bytes, kind, mode: int, size: int, digest: bytes, rng: random.Random) -> None:
    mtime = 1_700_000_000_000_000_000 + rng.randrange(10**15)
    for column, value in ((index.paths, path), (index.kinds, kind), (index.modes, mode), (index.mtimes, mtime),
                          (index.sizes, size), (index.links, b""), (index.link_groups, -1)):
        column.append(value)
    index.hashes += digest


def _assign_shards(index, plans, rng: random.Random) -> None:
    """Fill shard_of/offsets/data_offsets with real tar header sizes and plausible compressed lengths."""
    from bundles.index import Shard
    from bundles.tarformat import member_header, padding
    stored = 0
    for plan in plans:
        position = file_bytes = 0
        for i in range(plan.first, plan.first + plan.count):
            header = len(member_header(index.paths[i], index.kinds[i], index.modes[i], index.mtimes[i],
                                       index.sizes[i], index.links[i]))
            index.shard_of.append(plan.number)
            index.offsets.append(position)
            index.data_offsets.append(position + header)
            position += header + index.sizes[i] + padding(index.sizes[i])
            file_bytes += index.sizes[i]
        position += 1024 if plan.last else 0
        length = position * 3 // 10
        index.shards.append(Shard(plan.number, stored, length, position, plan.first, plan.count, file_bytes,
                                  rng.randbytes(16)))
        stored += length


def child_encode(path: str, entries: str) -> None:
    """Subprocess body: build the synthetic index, encode it, write it to ``path`` (and where its shards end)."""
    index = build_index(int(entries))
    Path(path).write_bytes(index.to_bytes())
    Path(f"{path}.end").write_text(str(max(s.offset + s.length for s in index.shards)))


def child_decode(path: str) -> None:
    """Subprocess body: decode the index and emit every entry as `pallet ls --json` does."""
    from bundles.index import Index
    index = Index.from_bytes(Path(path).read_bytes(), path)
    with open(os.devnull, "w") as out:
        for entry in index:
            out.write(json.dumps(entry.to_json()) + "\n")


def index_only_bundle(pidx: Path, bundle: Path) -> None:
    """Write a bundle laid out as pack does, but with its shards left as a hole: `pallet ls` reads only the index."""
    from bundles import container
    payload, end = pidx.read_bytes(), int(Path(f"{pidx}.end").read_text())
    with open(bundle, "wb") as out:
        out.write(b"\x28\xb5\x2f\xfd")      # zstd magic, for readers that sniff the first bytes
        out.seek(end)
        out.write(container.index_section("zstd", payload, end))
    Path(f"{bundle}{container.SIDECAR_SUFFIX}").write_bytes(payload)


def index_rss(runs_dir: Path, entries: int) -> list[RssResult]:
    """Peak RSS of encoding, decoding+listing, and `pallet ls --json` on a bundle holding only the index."""
    pidx, bundle = runs_dir / "index.pidx", runs_dir / "index-only.tar.zst"
    me = [sys.executable, str(Path(__file__).resolve())]
    results = []
    for name, argv, sink in (("build + Index.to_bytes", me + ["_encode", str(pidx), str(entries)], None),
                             ("Index.from_bytes + ls --json", me + ["_decode", str(pidx)], None),
                             ("`pallet ls --json` (CLI)", pallet_cmd() + ["ls", "--json", str(bundle)], os.devnull)):
        if sink:
            index_only_bundle(pidx, bundle)
        os.sync()
        done = run([argv], sink)
        results.append(RssResult(name, entries, done.seconds, done.max_rss_kb))
        print(f"  {name:<32} {done.seconds:7.2f} s  peak RSS {results[-1].max_rss_mb:7.1f} MB", flush=True)
        for line in done.output.splitlines():
            print(f"      | {line}", flush=True)
    print(f"  index file: {pidx.stat().st_size / 1e6:.1f} MB compressed for {entries:,} entries")
    return results


def print_report(comparisons: list[Comparison], rss: list[RssResult], version: str) -> None:
    print("\n" + "=" * 110 + f"\ncode under test: {version}; medians of wall seconds (CPU: user+system, all processes)")
    print(f"{'benchmark':<7} {'workload':<20} {'engine':<7} {'pallet s':>8} {'peer s':>7} {'ratio':>6} "
          f"{'floor s':>7} {'/floor':>6} {'pallet CPU':>10} {'CPU us/file':>11} {'peer CPU':>8} {'noise':>5}  "
          f"{'pallet runs':<16} peer runs")
    for c in comparisons:
        print(f"{c.name:<7} {c.workload:<20} {c.engine:<7} {c.pallet.median:8.3f} {c.peer.median:7.3f} "
              f"{c.ratio:6.2f} {c.floor.median:7.3f} {c.floor_ratio:6.2f} {c.pallet.cpu_median:10.2f} "
              f"{c.cpu_us_per_file:11.1f} {c.peer.cpu_median:8.2f} {max(c.pallet.noise, c.peer.noise):5.2f}  "
              f"{_runs(c.pallet):<16} {_runs(c.peer)}")
    print("floor: reading (`tar -cf - | cat > /dev/null`) for pack, creating (`tar -xf` of an uncompressed tar) "
          "for unpack")
    print("noise: largest share of a CPU that other processes (and kernel threads) used during any one run")
    print(f"\n{'index (synthetic)':<32} {'entries':>10} {'seconds':>8} {'peak RSS MB':>12}")
    for r in rss:
        print(f"{r.name:<32} {r.entries:>10,} {r.seconds:8.2f} {r.max_rss_mb:12.1f}")
    print()
    for c in comparisons:
        print(f"{'PASS' if c.passed else 'MISS'} {c.name} {c.workload} ({c.engine} engine): ratio {c.ratio:.2f} "
              f"(target <= {c.target})")
    for r in rss:
        print(f"{'PASS' if r.passed else 'MISS'} peak RSS {r.name}: {r.max_rss_mb:.1f} MB "
              f"(target < {RSS_TARGET_MB:.0f} MB)")


def _runs(m: Measurement) -> str:
    return " ".join(f"{r.seconds:.2f}" for r in m.runs)


def write_json(path: str, args: argparse.Namespace, version: str, comparisons: list[Comparison],
               rss: list[RssResult]) -> None:
    doc = {
        "command": sys.argv, "code": version, "options": {k: str(v) for k, v in vars(args).items()},
        "targets": {"ratio": {f"{k[0]} {k[1]}": v for k, v in TARGETS.items()}, "rss_mb": RSS_TARGET_MB,
                    "noise_limit": NOISE_LIMIT},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "comparisons": [{**asdict(c), "pallet_median": c.pallet.median, "peer_median": c.peer.median,
                         "pallet_cpu_median": c.pallet.cpu_median, "peer_cpu_median": c.peer.cpu_median,
                         "noise": max(c.pallet.noise, c.peer.noise),
                         "ratio": c.ratio, "floor_ratio": c.floor_ratio, "cpu_us_per_file": c.cpu_us_per_file,
                         "passed": c.passed} for c in comparisons],
        "index_rss": [{**asdict(r), "max_rss_mb": r.max_rss_mb, "passed": r.passed} for r in rss],
    }
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"raw numbers written to {path}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common_parser(__doc__)
    parser.add_argument("--index-entries", type=int, default=INDEX_ENTRIES, help="synthetic index size")
    parser.add_argument("--idle-wait", type=float, default=0.0, metavar="S",
                        help="before each timed run, wait up to S seconds for the machine to go idle (default: 0)")
    parser.add_argument("--unpack-into", type=Path, metavar="DIR",
                        help="unpack into new directories under DIR (e.g. /dev/shm, which takes the disk's file "
                             "create rate out of the comparison); default: the run directory under --workdir")
    parser.add_argument("--engines", default="native,python", metavar="LIST",
                        help="pallet engines to time, comma-separated (default: %(default)s)")
    parser.add_argument("--retries", type=int, default=2, metavar="N",
                        help=f"rerun a timed run up to N times if other processes used > {NOISE_LIMIT} CPU meanwhile")
    args = parser.parse_args(argv)
    args.engines = tuple(e for e in args.engines.split(",") if e)
    if args.repeat < 1 or args.index_entries < 2 or args.retries < 0:
        parser.error("--repeat must be >= 1, --index-entries >= 2, --retries >= 0")
    if not args.engines or set(args.engines) - {"native", "python"}:
        parser.error("--engines takes native and/or python")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (shutil.which("tar") and shutil.which("zstd")):
        sys.exit("bench_bundle: needs `tar` and `zstd` on PATH")
    args.workdir.mkdir(parents=True, exist_ok=True)
    version = code_version()
    print(f"code under test: {ROOT} at {version}; pallet command: {' '.join(pallet_cmd())}")
    w1, w2 = workloads(args.quick)
    sources = {w.name: ensure_workload(args.workdir, w) for w in (w1, w2)}
    runs_dir = Path(tempfile.mkdtemp(prefix="runs-", dir=args.workdir))
    unpack_dir = Path(tempfile.mkdtemp(prefix="unpacks-", dir=args.unpack_into)) if args.unpack_into else runs_dir
    try:
        print(f"\nruns in {runs_dir}, unpacks in {unpack_dir} ({args.repeat} repetitions, {os.cpu_count()} CPUs)")
        settings = Settings(runs_dir, args.repeat, args.idle_wait, args.retries, unpack_dir, args.engines)
        pack1, bundle1, tarball1 = compare_pack(w1, sources["W1"], settings)
        pack2, _, _ = compare_pack(w2, sources["W2"], settings)
        unpack1 = compare_unpack(w1, bundle1, tarball1, settings)
        print(f"\nsynthetic index of {args.index_entries:,} entries")
        rss = index_rss(runs_dir, args.index_entries)
    finally:        # only after every timing: deleting big trees slows file creation for a while
        shutil.rmtree(runs_dir, ignore_errors=True)
        shutil.rmtree(unpack_dir, ignore_errors=True)
    comparisons = [*pack1, *pack2, *unpack1]
    print_report(comparisons, rss, version)
    if args.json:
        write_json(args.json, args, version, comparisons, rss)
    return 0


if __name__ == "__main__":
    CHILDREN = {"_encode": child_encode, "_decode": child_decode}      # subprocess bodies of index_rss
    sys.exit(CHILDREN[sys.argv[1]](*sys.argv[2:]) if sys.argv[1:2] and sys.argv[1] in CHILDREN else main())
