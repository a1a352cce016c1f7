"""Two builds of pallet side by side: pack, unpack and push (ssh loopback) of W1, interleaved, medians.

Each build is a virtualenv's bin directory holding `pallet` and `python` (for example a worktree of an earlier
commit, installed with its own ./bootstrap.sh install). `--engine python` also runs the newer build with
PALLET_ENGINE=python. Ratios are against the first build.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_bundle import ROOT
from workloads import KIB, Workload, common_parser, ensure_workload

sys.path.insert(0, str(ROOT))
from tests.servers import start_sshd          # noqa: E402

OPERATIONS = ("pack", "unpack", "push")


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode:
        raise SystemExit(f"{argv[0]} {argv[1]} failed ({done.returncode}): {done.stderr[-800:]}")
    return time.perf_counter() - started


def one_round(name: str, bindir: Path, env: dict[str, str], src: Path, work: Path, sshd,
              times: dict[tuple[str, str], list[float]]) -> None:
    """Pack, unpack and push once with the build in ``bindir``, adding each time to ``times``."""
    pallet, bundle = str(bindir / "pallet"), work / f"{name}.tar.zst"
    for old in work.glob(f"{name}.tar.zst*"):
        old.unlink()
    times.setdefault(("pack", name), []).append(timed([pallet, "pack", "--quiet", str(src), str(bundle)], env))
    dest = work / f"unpacked-{name}"
    times.setdefault(("unpack", name), []).append(timed([pallet, "unpack", "--quiet", str(bundle), str(dest)], env))
    shutil.rmtree(dest)
    dest = work / f"pushed-{name}"
    ssh = [f"--ssh-option={o}" for o in sshd.ssh_options]
    times.setdefault(("push", name), []).append(timed(
        [pallet, "push", "--quiet", "--strategy", "bundle", "--remote-python", str(bindir / "python"), *ssh,
         str(src), sshd.url(str(dest))], env))
    shutil.rmtree(dest)


def main() -> int:
    parser = common_parser(__doc__, "smoke run: W1 with 8,192 files")
    parser.add_argument("older", type=Path, help="bin directory of the first build (the baseline)")
    parser.add_argument("newer", type=Path, help="bin directory of the second build")
    parser.add_argument("--engine", choices=("default", "python"), default="default",
                        help="also run the second build with the Python engine (python)")
    args = parser.parse_args()
    src = ensure_workload(args.workdir, Workload("W1", 8_192 if args.quick else 65_536, KIB, 256, False))
    base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(Path.home())}
    builds = {"older": (args.older, base), "newer": (args.newer, base)}
    if args.engine == "python":
        builds["newer, Python engine"] = (args.newer, {**base, "PALLET_ENGINE": "python"})
    work = Path(tempfile.mkdtemp(prefix="pallet-versions-", dir="/dev/shm"))
    sshd = start_sshd(work / "sshd")
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for _ in range(args.repeat):
            for name, (bindir, env) in builds.items():
                one_round(name, bindir, env, src, work, sshd, times)
    finally:
        sshd.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"W1 {src.name}, medians of {args.repeat} (ratio to the older build):")
    for operation in OPERATIONS:
        baseline = statistics.median(times[(operation, "older")])
        for name in builds:
            runs = times[(operation, name)]
            median = statistics.median(runs)
            print(f"  {operation:<7} {name:<22} {median:6.3f} s  {median / baseline:5.3f}x   "
                  f"runs {' '.join(f'{t:.2f}' for t in runs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
