"""Benchmark the tar-tools route on ssh loopback: a far side without pallet, against tar|zstd|ssh, pallet, rsync."""
from __future__ import annotations

import json
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_bundle import ROOT
from workloads import KIB, Workload, common_parser, ensure_workload, md5_list

sys.path.insert(0, str(ROOT))
from staging_core.testing import assert_same_snapshot, normalize_groups, snapshot     # noqa: E402
from tests.servers import start_sshd          # noqa: E402

TARGET = 1.2      # tar-tools route, verification included, at most this times the hand-made stream


def far_side_without_pallet(work: Path):
    """An sshd whose sessions get a home of their own and a PATH with no pallet on it."""
    home = work / "far-home"
    home.mkdir(parents=True, exist_ok=True)
    (home / ".bashrc").write_text('export PATH="/usr/local/bin:/usr/bin:/bin"; unset PYTHONPATH\n')
    return start_sshd(work / "sshd", (f"SetEnv HOME={home}",))


STREAM = "tar | zstd | ssh | zstd -d | tar x"
FLOOR = "the same, md5sum -c there"
TAR_TOOLS = "pallet push, tar tools (verified)"
FLOOR_TARGET = 1.15        # the tar-tools route over its verified floor (issue 37)
# The verified floor: the hand-made stream with what the tar-tools route must add that is not pallet's own work:
# an md5sum of every file at the far side, checked against a list made before the clock starts. (Its tar writes
# whole-second mtimes, as the far side's tar restores them from pallet's format 2 bundles.) No verified route can
# take less on this machine.


def same_tree(expected: dict, dest: Path, whole_seconds: bool) -> bool:
    """Whether ``dest`` holds the tree ``expected`` snapshots (mtimes to the second where its tar wrote them)."""
    try:
        assert_same_snapshot(normalize_groups(expected), normalize_groups(snapshot(dest)), whole_seconds)
    except AssertionError:
        return False
    return True


def methods(sshd, python: str) -> dict[str, list[str] | None]:
    """Each method's command, with DEST and SRC filled in by :func:`command`; None marks a shell pipeline."""
    options = [f"--ssh-option={o}" for o in sshd.ssh_options]
    pallet = [str(Path(python).parent / "pallet"), "push", "--quiet", "--json", "--strategy", "bundle", *options]
    return {STREAM: None,
            FLOOR: None,
            TAR_TOOLS: pallet,
            "pallet push, pallet there": [*pallet, "--remote-python", python],
            "rsync -a over ssh": ["rsync", "-a", "-e", shlex.join(["ssh", "-p", str(sshd.port), *sshd.ssh_options])]}


def pipeline(sshd, src: Path, dest: Path, checked: Path | None) -> list[str]:
    """The hand-made stream into ``dest`` (with ``checked``: the verified floor, checked against that list)."""
    q = shlex.quote
    remote = f"mkdir -p {q(str(dest))} && zstd -dcq | tar -xf - -C {q(str(dest))}"
    if checked is not None:
        remote += f" && cd {q(str(dest))} && md5sum --quiet --strict -c {q(str(checked))}"
    ssh = shlex.join(["ssh", "-p", str(sshd.port), *sshd.ssh_options, f"{sshd.user}@127.0.0.1", remote])
    return ["bash", "-o", "pipefail", "-c", f"tar -cf - -C {q(str(src))} . | zstd -q -T0 -c | {ssh}"]


def run_one(name: str, argv: list[str] | None, sshd, src: Path, dest: Path,
            checked: Path | None = None) -> tuple[float, dict]:
    if argv is None:
        argv = pipeline(sshd, src, dest, checked if name == FLOOR else None)
    elif argv[0] == "rsync":
        argv = [*argv, f"{src}/", f"{sshd.user}@127.0.0.1:{dest}/"]
    else:
        argv = [*argv, str(src), sshd.url(str(dest))]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}): {done.stderr[-2000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip().startswith("{") else {}
    return seconds, summary


def main() -> int:
    parser = common_parser(__doc__, "smoke run: W1 with 8,192 files")
    parser.add_argument("--files", type=int, help="W1 file count (default 65,536)")
    parser.add_argument("--dest-root", type=Path, help="where the far side writes (default: under --workdir; a "
                                                       "tmpfs such as /dev/shm takes a noisy disk out of the ratio)")
    args = parser.parse_args()
    files = args.files or (8_192 if args.quick else 65_536)
    src = ensure_workload(args.workdir, Workload("W1", files, KIB, max(1, min(256, files // 256)), False))
    expected = snapshot(src)
    work = args.workdir / "tar-tools-runs"
    shutil.rmtree(work, ignore_errors=True)
    sshd = far_side_without_pallet(work)
    checked = md5_list(src, work / "w1.md5")
    results: dict[str, list[float]] = {}
    routes: dict[str, str] = {}
    try:
        for repeat in range(args.repeat):
            for number, (name, argv) in enumerate(methods(sshd, sys.executable).items()):
                dest = (args.dest_root or work) / f"pallet-tar-tools-dest-{repeat}-{number}"
                seconds, summary = run_one(name, argv, sshd, src, dest, checked)
                if argv is not None and not same_tree(expected, dest, whole_seconds=name == TAR_TOOLS):
                    raise SystemExit(f"{name}: the destination differs from the source")
                results.setdefault(name, []).append(seconds)
                routes[name] = summary.get("route", "")
                stages = ", ".join(f"{k} {v:.2f}" for k, v in summary.get("stage_seconds", {}).items())
                shutil.rmtree(dest)
                print(f"  {name:<40} {seconds:7.2f} s  {stages}", flush=True)
    finally:
        sshd.stop()
    medians = {name: statistics.median(times) for name, times in results.items()}
    stream = medians[STREAM]
    print(f"W1 {files:,} x 1 KiB over ssh loopback, medians of {args.repeat}:")
    for name, median in medians.items():
        print(f"  {name:<40} {median:7.2f} s   {median / stream:5.2f}x the stream")
    tar_tools_ratio = medians[TAR_TOOLS] / stream
    floor_ratio, over_floor = medians[FLOOR] / stream, medians[TAR_TOOLS] / medians[FLOOR]
    print(f"tar tools / stream: {tar_tools_ratio:.2f}x "
          f"(target <= {TARGET}x: {'PASS' if tar_tools_ratio <= TARGET else 'MISS'})")
    print(f"verified floor / stream: {floor_ratio:.2f}x; tar tools / verified floor: {over_floor:.2f}x "
          f"(target <= {FLOOR_TARGET}x: {'PASS' if over_floor <= FLOOR_TARGET else 'MISS'})")
    if args.json:
        Path(args.json).write_text(json.dumps({"files": files, "runs": results, "medians": medians,
                                               "routes": routes, "tar_tools_over_stream": tar_tools_ratio,
                                               "floor_over_stream": floor_ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
