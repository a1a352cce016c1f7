"""Benchmark workloads W1/W2 (generated once, reused) and the options every benchmark script shares."""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

KIB, MIB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class Workload:
    """A generated source tree: ``files`` files of ``file_size`` bytes in ``dirs`` directories."""

    name: str
    files: int
    file_size: int
    dirs: int
    random_bytes: bool

    @property
    def label(self) -> str:
        return f"{self.name} {self.files:,} x {_size(self.file_size)}"

    @property
    def slug(self) -> str:
        return f"{self.name.lower()}-{self.files}x{self.file_size}-{self.dirs}d"

    def fill(self, src: Path) -> None:
        (_fill_random if self.random_bytes else _fill_csv)(src, self)


@dataclass(frozen=True)
class MixedWorkload:
    """A tree of two workloads: ``small`` under small/ and ``large`` under large/."""

    name: str
    small: Workload
    large: Workload

    @property
    def files(self) -> int:
        return self.small.files + self.large.files

    @property
    def label(self) -> str:
        return (f"{self.name} {self.small.files:,} x {_size(self.small.file_size)}"
                f" + {self.large.files} x {_size(self.large.file_size)}")

    @property
    def slug(self) -> str:
        return f"{self.name.lower()}-{self.small.slug}-{self.large.slug}"

    def fill(self, src: Path) -> None:
        self.small.fill(src / "small")
        self.large.fill(src / "large")


def md5_list(src: Path, listing: Path) -> Path:
    """Write md5sum's lines for every file of ``src`` (relative ``./`` names) to ``listing``, unless it is there:
    the list a verified floor checks with `md5sum -c`, made before any clock starts."""
    if not listing.exists():
        names = subprocess.run(["find", ".", "-type", "f", "-print0"], cwd=src, capture_output=True, check=True)
        listing.write_bytes(subprocess.run(["xargs", "-0", "md5sum", "--"], cwd=src, input=names.stdout,
                                           capture_output=True, check=True).stdout)
    return listing


def _size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def ensure_workload(workdir: Path, load: Workload | MixedWorkload) -> Path:
    """Return the workload's tree, generating it unless its marker file says it is complete."""
    slug = load.slug
    src, marker = workdir / slug, workdir / f"{slug}.ready"
    spec = json.dumps(asdict(load), sort_keys=True)
    if marker.exists() and marker.read_text() == spec and src.is_dir():
        print(f"reusing {load.label} at {src}")
        return src
    shutil.rmtree(src, ignore_errors=True)
    print(f"generating {load.label} at {src} ...", flush=True)
    started = time.perf_counter()
    load.fill(src)
    os.sync()
    marker.write_text(spec)
    print(f"  generated in {time.perf_counter() - started:.1f} s")
    return src


def _fill_csv(src: Path, load: Workload) -> None:
    rng = random.Random(20240611)
    number = 0
    for d in range(load.dirs):
        (folder := src / f"d{d:03d}").mkdir(parents=True)
        for _ in range(load.files // load.dirs + (d < load.files % load.dirs)):
            (folder / f"f{number:06d}.csv").write_bytes(_csv_text(rng, load.file_size))
            number += 1


def _csv_text(rng: random.Random, size: int) -> bytes:
    rows = ["id,timestamp,sensor,value,flag"]
    total = len(rows[0]) + 1
    while total < size:
        row = (f"{rng.randrange(10**7)},{1_700_000_000 + rng.randrange(10**6)},"
               f"s{rng.randrange(64):02d},{rng.uniform(-50, 150):.4f},{rng.choice('ABCD')}")
        rows.append(row)
        total += len(row) + 1
    return ("\n".join(rows)[:size - 1] + "\n").encode()


def _fill_random(src: Path, load: Workload) -> None:
    src.mkdir(parents=True)
    for n in range(load.files):
        with open(src / f"blob{n:02d}.bin", "wb") as out:
            for done in range(0, load.file_size, 8 * MIB):
                out.write(os.urandom(min(8 * MIB, load.file_size - done)))


def workloads(quick: bool) -> tuple[Workload, Workload]:
    small_files, big_size = (8_192, 32 * MIB) if quick else (65_536, 256 * MIB)
    return Workload("W1", small_files, KIB, 256, False), Workload("W2", 4, big_size, 1, True)


def common_parser(description: str, quick_help: str = "smoke run: W1 8,192 files, W2 4 x 32 MiB"
                  ) -> argparse.ArgumentParser:
    """The options every benchmark script shares: --workdir, --quick, --repeat, --json."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "pallet-bench",
                        help="where data sets live (reused) and runs are written (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--repeat", type=int, default=3, help="repetitions per command (default: 3)")
    parser.add_argument("--json", metavar="FILE", help="write the raw numbers to FILE")
    return parser


def wan_w1_parser(description: str) -> argparse.ArgumentParser:
    """:func:`common_parser` plus what the W1-over-an-emulated-WAN scripts share: --files, --rtt-ms, --rate,
    --dest-root (see :func:`wan_w1_args`)."""
    parser = common_parser(description, "smoke run, 1 repetition: W1 of 4,096 files")
    parser.add_argument("--files", type=int, help="W1 file count (default 65,536; 4,096 with --quick)")
    parser.add_argument("--rtt-ms", type=float, default=40.0, help="round trip added by the link (default 40)")
    parser.add_argument("--rate", default="1gbit", help="tbf rate cap of the link (default 1gbit)")
    parser.add_argument("--dest-root", type=Path, help="where the far side writes (default: under --workdir)")
    return parser


def wan_w1_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; --quick means one repetition of 4,096 files."""
    args = parser.parse_args(argv)
    if args.quick:
        args.repeat = 1
    args.files = args.files or (4_096 if args.quick else 65_536)
    return args
