"""Benchmark mpi_stager: unpack and pack with 1 and 2 ranks, and 1 rank against zstd -dc | tar -x."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from workloads import common_parser, ensure_workload, workloads

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
       "PYTHONPATH": str(ROOT)}
TARGETS = {"unpack 2 ranks speed-up": 1.6, "pack 2 ranks speed-up": 1.5}


@dataclass
class Series:
    """Repeated timings of one command: wall seconds with mpirun, and the job's own seconds without it."""

    label: str
    wall: list[float] = field(default_factory=list)
    inner: list[float] = field(default_factory=list)

    @property
    def wall_median(self) -> float:
        return statistics.median(self.wall)

    @property
    def inner_median(self) -> float:
        return statistics.median(self.inner) if self.inner else float("nan")


def stager(ranks: int, *args: str) -> list[str]:
    return ["mpirun", "--oversubscribe", "-np", str(ranks), sys.executable, "-m", "mpi_stager", *args, "--json"]


def timed(series: Series, command: list[str], shell_pipeline: list[list[str]] | None = None) -> None:
    started = time.perf_counter()
    if shell_pipeline:
        first = subprocess.Popen(shell_pipeline[0], stdout=subprocess.PIPE)
        second = subprocess.run(shell_pipeline[1], stdin=first.stdout, check=True)
        first.stdout.close()
        if first.wait() != 0 or second.returncode != 0:
            raise SystemExit(f"peer failed: {shell_pipeline}")
    else:
        done = subprocess.run(command, capture_output=True, text=True, env=ENV)
        if done.returncode != 0:
            raise SystemExit(f"failed: {' '.join(command)}\n{done.stderr}")
        series.inner.append(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])
    series.wall.append(time.perf_counter() - started)


def measure(src: Path, work: Path, repeat: int) -> dict[str, Series]:
    bundle, tarball = work / "w1.tar.zst", work / "w1-peer.tar.zst"
    subprocess.run([sys.executable, "-m", "staging_core.cli.main", "pack", "-q", str(src), str(bundle)],
                   check=True, env=ENV, stdout=subprocess.DEVNULL)
    with open(tarball, "wb") as out:
        tar = subprocess.Popen(["tar", "-C", str(src), "-cf", "-", "."], stdout=subprocess.PIPE)
        subprocess.run(["zstd", "-q", "-T2"], stdin=tar.stdout, stdout=out, check=True)
        tar.wait()
    series = {name: Series(name) for name in ("unpack 1 rank", "unpack 2 ranks", "zstd -dc | tar -x",
                                              "pack 1 rank", "pack 2 ranks")}
    for rep in range(repeat):
        for name, ranks in (("unpack 1 rank", 1), ("unpack 2 ranks", 2)):
            timed(series[name], stager(ranks, "unpack", str(bundle), str(work / f"u{ranks}-{rep}")))
        dest = work / f"tar-{rep}"
        dest.mkdir()
        timed(series["zstd -dc | tar -x"], [], [["zstd", "-dc", str(tarball)], ["tar", "-x", "-C", str(dest)]])
        for name, ranks in (("pack 1 rank", 1), ("pack 2 ranks", 2)):
            timed(series[name], stager(ranks, "pack", str(src), str(work / f"p{ranks}-{rep}.tar.zst")))
    return series


def report(series: dict[str, Series]) -> dict[str, float]:
    print(f"\n{'command':22s} {'median wall s':>14s} {'median job s':>13s}  runs (wall)")
    for s in series.values():
        runs = " ".join(f"{v:.2f}" for v in s.wall)
        print(f"{s.label:22s} {s.wall_median:14.2f} {s.inner_median:13.2f}  {runs}")
    ratios = {
        "unpack 2 ranks speed-up": series["unpack 1 rank"].inner_median / series["unpack 2 ranks"].inner_median,
        "unpack 2 ranks speed-up, mpirun included":
            series["unpack 1 rank"].wall_median / series["unpack 2 ranks"].wall_median,
        "unpack 1 rank / zstd|tar": series["unpack 1 rank"].inner_median / series["zstd -dc | tar -x"].wall_median,
        "unpack 1 rank / zstd|tar, mpirun included":
            series["unpack 1 rank"].wall_median / series["zstd -dc | tar -x"].wall_median,
        "pack 2 ranks speed-up": series["pack 1 rank"].inner_median / series["pack 2 ranks"].inner_median,
        "pack 2 ranks speed-up, mpirun included":
            series["pack 1 rank"].wall_median / series["pack 2 ranks"].wall_median,
    }
    print()
    for name, value in ratios.items():
        target = TARGETS.get(name) or (1.3 if name == "unpack 1 rank / zstd|tar" else None)
        verdict = "" if target is None else (
            "PASS" if (value >= target if "speed-up" in name else value <= target) else "MISS")
        print(f"{name:45s} {value:6.2f}  {('target ' + str(target)) if target else '':12s} {verdict}")
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = common_parser(__doc__)
    parser.add_argument("--dest-root", help="where bundles and unpacked trees go (default: under --workdir); "
                                            "e.g. /dev/shm to take the disk's create rate out of the ratios")
    args = parser.parse_args(argv)
    workdir = args.workdir
    src = ensure_workload(workdir, workloads(args.quick)[0])
    work = Path(tempfile.mkdtemp(prefix="runs-", dir=args.dest_root or workdir))
    ratios = report(measure(src, work, args.repeat))
    if args.json:
        Path(args.json).write_text(json.dumps(ratios, indent=2))
    print(f"\noutputs left in {work} (delete them when the disk is idle)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
