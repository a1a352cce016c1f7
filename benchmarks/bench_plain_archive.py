"""Benchmark `pallet unpack` of plain archives (no pallet index) against GNU tar: time and peak memory."""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bundle import code_version, pallet_cmd, run  # noqa: E402
from workloads import KIB, common_parser, ensure_workload, workloads  # noqa: E402

TARGET_VS_TAR = 1.2
MIB = 1 << 20


@dataclass
class Case:
    """One plain archive: how to make its tree, and the tar flag of its compression."""

    name: str
    archive: Path
    tar_flag: str
    pallet: list[float] = field(default_factory=list)
    tar: list[float] = field(default_factory=list)
    pallet_rss_mb: list[float] = field(default_factory=list)
    tar_rss_mb: list[float] = field(default_factory=list)


def make_archive(tree: Path, archive: Path, tar_flag: str) -> None:
    """A plain archive of ``tree`` written by GNU tar (the way users get them)."""
    if not archive.exists():
        subprocess.run(["tar", tar_flag, "-cf", str(archive), "-C", str(tree), "."], check=True)


def one_file_tree(root: Path, size: int, zeros: bool) -> Path:
    if not root.exists():
        root.mkdir(parents=True)
        with open(root / "data.bin", "wb") as handle:
            if zeros:
                handle.truncate(size)
            else:
                for _ in range(size // MIB):
                    handle.write(os.urandom(MIB))
    return root


def many_files_tree(root: Path, count: int, size: int) -> Path:
    """``count`` files of ``size`` random bytes in 16 directories: members between W1's and the single files."""
    if not root.exists():
        for n in range(count):
            path = root / f"d{n % 16:02d}" / f"f{n:05d}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(os.urandom(size))
    return root


def time_case(case: Case, runs: Path, rep: int) -> None:
    for tool in ("pallet", "tar"):
        dest = runs / f"{case.name}-{tool}-{rep}"
        dest.mkdir()
        argv = (pallet_cmd() + ["unpack", "--quiet", str(case.archive), str(dest)] if tool == "pallet"
                else ["tar", case.tar_flag, "-xf", str(case.archive), "-C", str(dest)])
        done = run([argv])
        getattr(case, tool).append(done.seconds)
        getattr(case, f"{tool}_rss_mb").append(done.max_rss_kb / 1024)
        shutil.rmtree(dest)


def main(argv: list[str] | None = None) -> int:
    parser = common_parser(__doc__)
    parser.add_argument("--into", type=Path, default=Path("/dev/shm"), help="where to unpack (default: %(default)s)")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    w1, _ = workloads(args.quick)
    small = ensure_workload(args.workdir, w1)
    random_tree = one_file_tree(args.workdir / "plain-128m-random", 128 * MIB, False)
    zeros_tree = one_file_tree(args.workdir / "plain-1g-zeros", 1024 * MIB, True)
    cases = [Case("128 MiB random .tar.gz", args.workdir / "plain-128m.tar.gz", "-z"),
             Case("1 GiB zeros .tar.gz", args.workdir / "plain-1g-zeros.tar.gz", "-z"),
             Case("1 GiB zeros .tar.zst", args.workdir / "plain-1g-zeros.tar.zst", "--zstd"),
             Case(f"{w1.label} .tar.zst", args.workdir / f"plain-{w1.slug}.tar.zst", "--zstd"),
             Case(f"{w1.label} .tar.gz", args.workdir / f"plain-{w1.slug}.tar.gz", "-z"),
             Case("16,384 x 64 KiB .tar.zst", args.workdir / "plain-16384x64k.tar.zst", "--zstd"),
             Case("512 x 2 MiB .tar.zst", args.workdir / "plain-512x2m.tar.zst", "--zstd")]
    middling = [many_files_tree(args.workdir / "plain-16384x64k", 16_384, 64 * KIB),
                many_files_tree(args.workdir / "plain-512x2m", 512, 2 * MIB)]
    for case, tree in zip(cases, [random_tree, zeros_tree, zeros_tree, small, small, *middling], strict=True):
        make_archive(tree, case.archive, case.tar_flag)
    print(f"code under test: {code_version()}; unpacking into {args.into}", flush=True)
    runs = Path(tempfile.mkdtemp(prefix="plain-archive-", dir=args.into))
    try:
        for rep in range(args.repeat):
            for case in cases:
                time_case(case, runs, rep)
                print(f"  rep {rep + 1} {case.name:<28} pallet {case.pallet[-1]:6.2f} s  tar {case.tar[-1]:6.2f} s",
                      flush=True)
    finally:
        shutil.rmtree(runs, ignore_errors=True)
    print(f"\nmedians of {args.repeat}: pallet unpack of plain archives against GNU tar")
    print(f"{'archive':<30}{'pallet s':>9}{'tar s':>8}{'ratio':>7}{'pallet MB':>11}{'tar MB':>8}")
    for case in cases:
        ratio = statistics.median(case.pallet) / statistics.median(case.tar)
        print(f"{case.name:<30}{statistics.median(case.pallet):9.2f}{statistics.median(case.tar):8.2f}{ratio:7.2f}"
              f"{max(case.pallet_rss_mb):11.0f}{max(case.tar_rss_mb):8.0f}  "
              f"{'PASS' if ratio <= TARGET_VS_TAR else 'MISS'} (target <= {TARGET_VS_TAR})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
