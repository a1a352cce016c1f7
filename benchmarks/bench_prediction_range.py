"""How often the local route's measured push time falls inside the range `pallet push` predicted, on disk and tmpfs.

Each place starts with no saved profile (a fresh $XDG_CONFIG_HOME): `pallet plan` measures the local profile
there first, then RUNS pushes of the same tree each go into a new DEST, and each push's own `--json` summary gives
its predicted range and its measured seconds (every push folds its time into the profile, so the ranges move).
The tmpfs is mounted here (as root) and unmounted at the end. Target: at least 9 of 10 runs inside, per place.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bundle import child_env, code_version, pallet_cmd  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from staging_core.cli.demo import make_tree  # noqa: E402

TARGET_INSIDE = 0.9


def pallet(*args: str, config: Path) -> dict:
    """Run `pallet ARGS --json` with its profiles under ``config``; its JSON summary."""
    done = subprocess.run(pallet_cmd() + [*args, "--json"], check=True, capture_output=True, text=True,
                          env={**child_env(), "XDG_CONFIG_HOME": str(config)}, stdin=subprocess.DEVNULL)
    return json.loads(done.stdout)


def run_place(label: str, place: Path, files: int, runs: int, remove: bool) -> int:
    """Push a tree of ``files`` files ``runs`` times into new directories under ``place``; runs inside."""
    work = Path(tempfile.mkdtemp(prefix="pallet-range-", dir=place))
    inside = 0
    try:
        src = work / "src"
        src.mkdir()
        make_tree(str(src), files)
        planned = pallet("plan", str(src), str(work / "planned"), config=work / "config")    # measures the profile
        first = next(c for c in planned["candidates"] if c["strategy"] == planned["strategy"])
        print(f"{label}: profile measured, spread {planned['details']['spread'][0]:.2f}–"
              f"{planned['details']['spread'][1]:.2f}; plan predicts {first['low_seconds']:.2f}–"
              f"{first['high_seconds']:.2f} s", flush=True)
        for run in range(runs):
            dest = work / f"dest-{run}"
            done = pallet("push", str(src), str(dest), config=work / "config")
            low, high = done["predicted_range"]
            hit = low <= done["seconds"] <= high
            inside += hit
            print(f"  {label} run {run + 1:2d}: predicted {low:6.2f}–{high:6.2f} s, measured {done['seconds']:6.2f} s "
                  f"{'inside' if hit else 'OUTSIDE'}", flush=True)
            if remove:
                shutil.rmtree(dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    verdict = "PASS" if inside >= TARGET_INSIDE * runs else "MISS"
    print(f"{verdict} {label}: {inside} of {runs} runs inside the predicted range (target >= {TARGET_INSIDE:.0%})\n",
          flush=True)
    return inside


def mounted_tmpfs(size: str) -> Path:
    """A tmpfs of ``size`` mounted on a new directory (needs root)."""
    point = Path(tempfile.mkdtemp(prefix="pallet-range-tmpfs-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], check=True)
    return point


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=20_000, help="files in the tree (default %(default)s)")
    parser.add_argument("--runs", type=int, default=10, help="pushes per place (default %(default)s)")
    parser.add_argument("--disk", type=Path, default=Path("/var/tmp"), help="a directory on disk (default %(default)s)")
    parser.add_argument("--tmpfs-size", default="2G",
                        help="size of the tmpfs mounted for the run (default %(default)s)")
    args = parser.parse_args(argv)
    print(f"code under test: {code_version()}; {args.files} files, {args.runs} pushes per place")
    point = mounted_tmpfs(args.tmpfs_size)
    try:
        results = {"disk": run_place("disk", args.disk, args.files, args.runs, remove=False),
                   "tmpfs": run_place("tmpfs", point, args.files, args.runs, remove=True)}
    finally:
        subprocess.run(["umount", str(point)], check=False)
        point.rmdir()
    print("; ".join(f"{label}: {inside}/{args.runs} inside" for label, inside in results.items()))
    return 0 if all(inside >= TARGET_INSIDE * args.runs for inside in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
