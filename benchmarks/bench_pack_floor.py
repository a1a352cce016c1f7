"""The least wall time any packer of W1 can take on this machine, against `tar -cf - | zstd -T2` and `pallet pack`.

A packer must at least read every file and compress the bytes it writes. Measured here, each alone and CPU-bound:

- read: `tar -cf - SRC | cat > /dev/null` (CPU seconds of reading the tree, with a pipe copy: generous);
- compress: `zstd -T2` of pallet's own uncompressed stream (`pallet pack --codec none`: its tar headers as the
  bundle format carries them), from tmpfs to /dev/null.

With N cores, no packer of those bytes finishes in less than (read CPU + compress CPU) / N, nor in less than the
compression alone. The script prints that floor against the peer's measured time: when the floor is above a target
ratio, no implementation meets the target here. Each command's peak memory (the largest RSS of it and its children)
is printed too; `--files 1000000` measures the million-file pack (target: at most 1.0x the peer, in at most 300 MB).
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from workloads import KIB, Workload, common_parser, ensure_workload

TARGET = 0.9                 # pack W1 at most this times `tar -cf - | zstd -T2` (issues 14 and 37)
MILLION_TARGET = 1.0         # pack 1,000,000 files at most this times the peer (issue 37) ...
MILLION_PEAK_MB = 300        # ... with at most this peak memory


@dataclass(frozen=True)
class Run:
    """One run of a command: wall and CPU seconds, and the peak RSS of it and its children in MB."""

    wall: float
    cpu: float
    peak_mb: float


def timed(argv: list[str]) -> Run:
    """One run of ``argv`` (a shell pipeline: bash -c), waited for with wait4 so its usage is its own."""
    started = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise subprocess.CalledProcessError(child.returncode, argv)
    return Run(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024)


def main() -> int:
    parser = common_parser(__doc__, "smoke run: W1 with 8,192 files")
    parser.add_argument("--files", type=int, help="how many 1 KiB files (default 65,536: W1; 1000000 for the "
                                                  "million-file target)")
    args = parser.parse_args()
    files = args.files or (8_192 if args.quick else 65_536)
    src = ensure_workload(args.workdir, Workload("W1", files, KIB, 256, False))
    pallet = str(Path(sys.executable).parent / "pallet")
    work = Path(tempfile.mkdtemp(prefix="pack-floor-", dir="/dev/shm"))
    try:
        raw = work / "raw.tar"
        subprocess.run([pallet, "pack", "--quiet", "--codec", "none", str(src), str(raw)], check=True,
                       stdout=subprocess.DEVNULL)
        q = str(src)
        methods = {
            "tar -cf - | zstd -T2": ["bash", "-c", f"tar -cf - -C '{q}' . | zstd -q -T2 -c > '{work}/peer.tzst'"],
            "pallet pack": [pallet, "pack", "--quiet", q, str(work / "pallet.tar.zst")],
            "read (tar -cf - | cat)": ["bash", "-c", f"tar -cf - -C '{q}' . | cat > /dev/null"],
            "compress (zstd -T2 of pallet's stream)": ["zstd", "-q", "-T2", "-c", str(raw)],
        }
        runs: dict[str, list[Run]] = {name: [] for name in methods}
        for _ in range(args.repeat):
            for name, argv in methods.items():
                for leftover in work.glob("pallet.tar.zst*"):
                    leftover.unlink()
                runs[name].append(timed(argv))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(runs, files, args.repeat)
    return 0


def report(runs: dict[str, list[Run]], files: int, repeat: int) -> None:
    """Print each command's medians, pallet's ratio to the peer, and the floor's."""
    wall = {name: statistics.median(r.wall for r in rs) for name, rs in runs.items()}
    cpu = {name: statistics.median(r.cpu for r in rs) for name, rs in runs.items()}
    peak = {name: max(r.peak_mb for r in rs) for name, rs in runs.items()}
    cores = os.cpu_count() or 1
    print(f"{files:,} x 1 KiB (W1 at 65,536), medians of {repeat}, {cores} cores:")
    for name in runs:
        print(f"  {name:<40} wall {wall[name]:6.3f} s   CPU {cpu[name]:6.3f} s   peak {peak[name]:6.1f} MB")
    target = MILLION_TARGET if files >= 1_000_000 else TARGET
    peer = wall["tar -cf - | zstd -T2"]
    floor = max(wall["compress (zstd -T2 of pallet's stream)"],
                (cpu["read (tar -cf - | cat)"] + cpu["compress (zstd -T2 of pallet's stream)"]) / cores)
    print(f"pallet pack / peer: {wall['pallet pack'] / peer:.2f} (target <= {target})")
    if files >= 1_000_000:
        print(f"pallet pack peak: {peak['pallet pack']:.0f} MB (target <= {MILLION_PEAK_MB})")
    print(f"floor (read + compress CPU over {cores} cores) / peer: {floor / peer:.2f}"
          f"{'  -- above the target: no packer of these bytes meets it here' if floor / peer > target else ''}")


if __name__ == "__main__":
    sys.exit(main())
