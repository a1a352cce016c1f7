"""Benchmark local staging (`pallet push SRC /local/DEST`) against cp -a, rsync -a, tar | tar and dcp, and check the
planner's prediction for the route against the measured time."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bundle import child_env, code_version, pallet_cmd  # noqa: E402
from workloads import common_parser, ensure_workload, workloads  # noqa: E402

TARGET_VS_CP = 0.7              # pallet seconds / cp -a seconds
PREDICTION_TOLERANCE = 0.25     # |predicted - measured| / measured


@dataclass
class Tool:
    """One way to copy SRC to a new DEST, and its wall seconds per repetition."""

    name: str
    argv: list[str]             # with {src} and {dest} placeholders
    seconds: list[float] = field(default_factory=list)
    own_seconds: list[float] = field(default_factory=list)      # pallet's: what `--json` reports

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def tools(dcp: str | None) -> list[Tool]:
    found = [Tool("pallet push", pallet_cmd() + ["push", "--json", "{src}", "{dest}"]),
             Tool("cp -a", ["cp", "-a", "{src}", "{dest}"]),
             Tool("rsync -a", ["rsync", "-a", "{src}/", "{dest}/"]),
             Tool("tar | tar", ["sh", "-c", 'mkdir "$2" && tar -cf - -C "$1" . | tar -xf - -C "$2"', "sh",
                                "{src}", "{dest}"])]
    if dcp:
        found.append(Tool("dcp -np 2", ["mpirun", "--allow-run-as-root", "-np", "2", dcp, "-q", "{src}", "{dest}"]))
    return found


def time_once(tool: Tool, src: Path, dest: Path, remove: bool) -> float:
    """Run ``tool`` into the new ``dest`` and return its wall seconds. With ``remove`` (tmpfs) ``dest`` is removed
    afterwards (untimed), so every run starts from the same state; on disk all outputs stay until the end,
    because creating files right after deleting a large tree is several times slower there."""
    argv = [a.replace("{src}", str(src)).replace("{dest}", str(dest)) for a in tool.argv]
    os.sync()
    started = time.perf_counter()
    done = subprocess.run(argv, check=True, env=child_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if tool.name.startswith("pallet"):
        tool.own_seconds.append(json.loads(done.stdout)["seconds"])
    if remove:
        shutil.rmtree(dest)
    return seconds


def predicted(src: Path, dest: Path) -> tuple[float, str]:
    """The planner's prediction for pushing ``src`` to a new ``dest``, and the strategy it picks."""
    done = subprocess.run(pallet_cmd() + ["plan", "--json", str(src), str(dest)], check=True, capture_output=True,
                          text=True, env=child_env())
    chosen = json.loads(done.stdout)
    seconds = next(c["predicted_seconds"] for c in chosen["candidates"] if c["strategy"] == chosen["strategy"])
    return seconds, chosen["strategy"]


def run_place(label: str, place: Path, src: Path, repeat: int, dcp: str | None, remove: bool) -> None:
    runs = Path(tempfile.mkdtemp(prefix="local-", dir=place))
    try:
        guess, strategy = predicted(src, runs / "planned")     # first: measures the local profile if none is saved
        measured = tools(dcp)
        for rep in range(repeat):
            for tool in measured[rep % len(measured):] + measured[:rep % len(measured)]:
                tool.seconds.append(time_once(tool, src, runs / f"{tool.name.split()[0]}-{rep}", remove))
                print(f"  {label} rep {rep + 1} {tool.name:<12} {tool.seconds[-1]:7.3f} s", flush=True)
        own = statistics.median(measured[0].own_seconds)
    finally:
        shutil.rmtree(runs, ignore_errors=True)
    cp = next(t for t in measured if t.name == "cp -a")
    print(f"\n{label}: medians of {repeat} (wall seconds, each into a new directory"
          f"{', removed after the run' if remove else ''})")
    for tool in measured:
        print(f"  {tool.name:<12} {tool.median:7.3f} s   / cp -a {tool.median / cp.median:5.2f}")
    ratio = measured[0].median / cp.median
    error = abs(guess - own) / own
    print(f"  {'PASS' if ratio <= TARGET_VS_CP else 'MISS'} pallet / cp -a = {ratio:.2f} (target <= {TARGET_VS_CP})")
    print(f"  {'PASS' if error <= PREDICTION_TOLERANCE else 'MISS'} plan predicted {guess:.3f} s ({strategy}), "
          f"push measured {own:.3f} s by itself: off by {error:.0%} (target <= {PREDICTION_TOLERANCE:.0%})\n")


def main(argv: list[str] | None = None) -> int:
    parser = common_parser(__doc__)
    parser.add_argument("--tmpfs", type=Path, default=Path("/dev/shm"),
                        help="a tmpfs to copy into (default: %(default)s)")
    parser.add_argument("--disk", type=Path, help="a directory on disk to copy into (default: the --workdir)")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    w1, _ = workloads(args.quick)
    src = ensure_workload(args.workdir, w1)
    dcp = shutil.which("dcp")
    print(f"code under test: {code_version()}; {w1.label}; dcp: {dcp or 'not on PATH (mpiFileUtils), skipped'}")
    for label, place, remove in (("tmpfs", args.tmpfs, True), ("disk", args.disk or args.workdir, False)):
        run_place(label, place, src, args.repeat, dcp, remove)
    return 0


if __name__ == "__main__":
    sys.exit(main())
