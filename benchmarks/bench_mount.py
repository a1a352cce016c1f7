"""Benchmark reading W1 in place: `pallet mount` against the unpacked tree and against ratarmount on the same bundle."""
from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bundle import child_env, code_version, pallet_cmd  # noqa: E402
from workloads import common_parser, ensure_workload, workloads  # noqa: E402

TARGET_READY_S = 0.5            # mount ready (index only), 65,536 entries
TARGET_FIND_S = 1.0             # find MNT -type f | wc -l
TARGET_READ_ALL = 1.5           # reading every file through the mount / from the unpacked tree
RANDOM_FILES = 1000


@dataclass
class Figures:
    """Seconds per repetition for one way of reading W1."""

    name: str
    ready: list[float] = field(default_factory=list)          # command start until the mount point is mounted
    first_read: list[float] = field(default_factory=list)     # command start until one file's bytes are read
    find: list[float] = field(default_factory=list)
    read_all: list[float] = field(default_factory=list)
    random_read: list[float] = field(default_factory=list)    # RANDOM_FILES files in a fixed random order


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def read_files(root: Path, names: list[str]) -> float:
    """Seconds to read ``names`` under ``root`` once, in that order, in a child `cat` fed by xargs."""
    listing = "\0".join(str(root / name) for name in names).encode()
    started = time.perf_counter()
    subprocess.run(["xargs", "-0", "cat"], input=listing, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


_PYTHON_READ = """
import sys, time
names = sys.stdin.read().split("\\0")
started = time.perf_counter()
if sys.argv[1] == "fsspec":
    import fsspec
    fs = fsspec.filesystem("pallet", fo=sys.argv[2])
    for name in names:
        fs.cat_file(name)
else:
    for name in names:
        with open(sys.argv[2] + "/" + name, "rb") as handle:
            handle.read()
print(time.perf_counter() - started)
"""


def python_read(how: str, where: Path, names: list[str]) -> float:
    """Seconds a Python process takes to read ``names`` once, through pallet:// (``how`` = "fsspec", opening
    the bundle included) or with open() from the unpacked tree ("open")."""
    done = subprocess.run([sys.executable, "-c", _PYTHON_READ, how, str(where)], input="\0".join(names),
                          capture_output=True, text=True, check=True, env=child_env())
    return float(done.stdout)


def timed_find(root: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run(["sh", "-c", 'find "$1" -type f | wc -l', "sh", str(root)], capture_output=True,
                          text=True, check=True)
    seconds = time.perf_counter() - started
    assert int(done.stdout) > 0, f"nothing found under {root}"
    return seconds


def mount_and_time(command: list[str], mountpoint: Path, first: Path) -> tuple[float, float]:
    """Run a mount ``command``; return (seconds until mounted, seconds until ``first`` was read)."""
    started = time.perf_counter()
    subprocess.run(command, check=True, env=child_env(), stdin=subprocess.DEVNULL, capture_output=True)
    while not os.path.ismount(mountpoint):
        if time.perf_counter() - started > 600:
            raise RuntimeError(f"{command[0]} did not mount {mountpoint}")
        time.sleep(0.01)
    ready = time.perf_counter() - started
    first.read_bytes()
    return ready, time.perf_counter() - started


def unmount(mountpoint: Path) -> None:
    subprocess.run(["fusermount3", "-u", str(mountpoint)], check=True)
    while os.path.ismount(mountpoint):
        time.sleep(0.01)


def measure_mount(figures: Figures, command: list[str], mountpoint: Path, names: list[str], sample: list[str]) -> None:
    ready, first = mount_and_time(command, mountpoint, mountpoint / names[0])
    try:
        figures.ready.append(ready)
        figures.first_read.append(first)
        figures.find.append(timed_find(mountpoint))
        figures.read_all.append(read_files(mountpoint, names))
    finally:
        unmount(mountpoint)
    mount_and_time(command, mountpoint, mountpoint / names[0])       # a new mount: no decoded shard cached
    try:
        figures.random_read.append(read_files(mountpoint, sample))
    finally:
        unmount(mountpoint)


def measure_tree(figures: Figures, src: Path, names: list[str], sample: list[str]) -> None:
    read_files(src, names)                                           # warm
    figures.find.append(timed_find(src))
    figures.read_all.append(read_files(src, names))
    figures.random_read.append(read_files(src, sample))


def report(peers: list[Figures]) -> None:
    print(f"\n{'':<22}{'ready s':>9}{'1st read s':>11}{'find s':>9}{'read all s':>11}"
          f"{'random 1000 s':>14}{'files/s':>9}")
    for f in peers:
        rate = RANDOM_FILES / median(f.random_read)
        print(f"{f.name:<22}{median(f.ready):9.3f}{median(f.first_read):11.3f}{median(f.find):9.3f}"
              f"{median(f.read_all):11.3f}{median(f.random_read):14.3f}{rate:9.0f}")
    pallet, tree = peers[0], peers[1]

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    ratio = median(pallet.read_all) / median(tree.read_all)
    print(f"\n{verdict(median(pallet.ready) <= TARGET_READY_S)} mount ready {median(pallet.ready):.3f} s "
          f"(target <= {TARGET_READY_S})")
    print(f"{verdict(median(pallet.find) <= TARGET_FIND_S)} find | wc -l {median(pallet.find):.3f} s "
          f"(target <= {TARGET_FIND_S})")
    print(f"{verdict(ratio <= TARGET_READ_ALL)} read all through the mount / from the tree = {ratio:.2f} "
          f"(target <= {TARGET_READ_ALL})")
    for peer in peers[2:]:
        print(f"pallet / {peer.name}: time to first read {median(pallet.first_read) / median(peer.first_read):.2f}, "
              f"random reads {median(pallet.random_read) / median(peer.random_read):.2f} "
              "(seconds; lower is pallet faster)")


def main(argv: list[str] | None = None) -> int:
    parser = common_parser(__doc__)
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    w1, _ = workloads(args.quick)
    src = ensure_workload(args.workdir, w1)
    bundle = args.workdir / f"{w1.slug}.mount.tar.zst"
    if not bundle.exists():
        subprocess.run(pallet_cmd() + ["pack", "--quiet", str(src), str(bundle)], check=True, env=child_env())
    names = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    sample = random.Random(1).sample(names, min(RANDOM_FILES, len(names)))
    ratarmount = shutil.which("ratarmount") or str(Path(sys.executable).with_name("ratarmount"))
    runs = Path(tempfile.mkdtemp(prefix="mount-", dir=args.workdir))
    mountpoint, index_file = runs / "mnt", runs / "ratarmount.index.sqlite"
    mountpoint.mkdir()
    pallet = Figures("pallet mount")
    tree = Figures("unpacked tree (warm)")
    fsspec_reads, python_reads = Figures("pallet:// in Python"), Figures("tree, Python open()")
    peers = [pallet, tree]
    rat = Figures("ratarmount") if os.path.exists(ratarmount) else None
    print(f"code under test: {code_version()}; {w1.label}; bundle {bundle.stat().st_size / 2**20:.1f} MiB; "
          f"ratarmount: {ratarmount if rat else 'not installed, skipped'}", flush=True)
    try:
        for rep in range(args.repeat):
            measure_mount(pallet, pallet_cmd() + ["mount", "--log", str(runs / "pallet.log"), str(bundle),
                                                  str(mountpoint)], mountpoint, names, sample)
            measure_tree(tree, src, names, sample)
            fsspec_reads.read_all.append(python_read("fsspec", bundle, names))
            python_reads.read_all.append(python_read("open", src, names))
            if rat:
                index_file.unlink(missing_ok=True)           # ratarmount builds its index at each first mount
                measure_mount(rat, [ratarmount, "--index-file", str(index_file), str(bundle), str(mountpoint)],
                              mountpoint, names, sample)
            print(f"  rep {rep + 1}: " + ", ".join(f"{f.name} read all {f.read_all[-1]:.3f} s" for f in peers +
                                                    ([rat] if rat else [])), flush=True)
    finally:
        if os.path.ismount(mountpoint):
            unmount(mountpoint)
        shutil.rmtree(runs, ignore_errors=True)
    report(peers + ([rat] if rat else []))
    print(f"read all in one Python process: pallet:// {median(fsspec_reads.read_all):.3f} s (bundle opened "
          f"included), the tree with open() {median(python_reads.read_all):.3f} s: "
          f"{median(fsspec_reads.read_all) / median(python_reads.read_all):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"version": code_version(), "workload": w1.label,
                                               "figures": [asdict(f) for f in peers + ([rat] if rat else []) +
                                                           [fsspec_reads, python_reads]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
