"""The least wall time any packer of W1 can take on this machine, against `tar -cf - | zstd -T2` and `pallet pack`.

A packer must at least read every file and compress the bytes it writes. Measured here, each alone and CPU-bound:

- read: `tar -cf - SRC | cat > /dev/null` (CPU seconds of reading the tree, with a pipe copy: generous);
- compress: `zstd -T2` of pallet's own uncompressed stream (`pallet pack --codec none`, pax headers included), from
  tmpfs to /dev/null.

With N cores, no packer of those bytes finishes in less than (read CPU + compress CPU) / N, nor in less than the
compression alone. The script prints that floor against the peer's measured time: when the floor is above a target
ratio, no implementation meets the target here.
"""
from __future__ import annotations

import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from workloads import KIB, Workload, common_parser, ensure_workload

TARGET = 0.9       # pack W1 at most this times `tar -cf - | zstd -T2` (issue 14)


def timed(argv: list[str], stdout=subprocess.DEVNULL) -> tuple[float, float]:
    """Wall and CPU (user + system of the children) seconds of one run of ``argv`` (a shell pipeline: bash -c)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=stdout, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    parser = common_parser(__doc__, "smoke run: W1 with 8,192 files")
    args = parser.parse_args()
    files = 8_192 if args.quick else 65_536
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
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in methods}
        for _ in range(args.repeat):
            for name, argv in methods.items():
                for leftover in work.glob("pallet.tar.zst*"):
                    leftover.unlink()
                runs[name].append(timed(argv))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wall = {name: statistics.median(w for w, _ in r) for name, r in runs.items()}
    cpu = {name: statistics.median(c for _, c in r) for name, r in runs.items()}
    cores = os.cpu_count() or 1
    print(f"W1 {files:,} x 1 KiB, medians of {args.repeat}, {cores} cores:")
    for name in methods:
        print(f"  {name:<40} wall {wall[name]:6.3f} s   CPU {cpu[name]:6.3f} s")
    peer = wall["tar -cf - | zstd -T2"]
    floor = max(wall["compress (zstd -T2 of pallet's stream)"],
                (cpu["read (tar -cf - | cat)"] + cpu["compress (zstd -T2 of pallet's stream)"]) / cores)
    print(f"pallet pack / peer: {wall['pallet pack'] / peer:.2f} (target <= {TARGET})")
    print(f"floor (read + compress CPU over {cores} cores) / peer: {floor / peer:.2f}"
          f"{'  -- above the target: no packer of these bytes meets it here' if floor / peer > TARGET else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
