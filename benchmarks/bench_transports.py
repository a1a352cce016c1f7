"""Benchmark transports on loopback: ssh vs rsync -a, parallel vs single rsync, GridFTP batch vs globus-url-copy -r."""
from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_bundle import ROOT
from workloads import common_parser, ensure_workload, workloads

sys.path.insert(0, str(ROOT))
from staging_core.transports import Direction, open_transport    # noqa: E402
from staging_core.transports.base import local_tree_items         # noqa: E402
from tests.servers import start_gridftp, start_sshd               # noqa: E402


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def rsync_peer(sshd, src: Path, dest: Path) -> None:
    ssh = shlex.join(["ssh", "-p", str(sshd.port), *sshd.ssh_options])
    subprocess.run(["rsync", "-a", "-e", ssh, f"{src}/", f"root@127.0.0.1:{dest}/"], check=True)


def pallet_push(sshd, src: Path, dest: Path, items: list[str] | None, parallel: int) -> None:
    with open_transport(sshd.url(str(dest)), ssh_options=sshd.ssh_options, parallel=parallel) as transport:
        transport.mkdir(str(dest))
        result = transport.transfer(Direction.PUSH, str(src), str(dest), items)
    if not result.ok:
        raise SystemExit(f"transfer failed: {list(result.failed.items())[:3]}")


def gridftp_peer(server, src: Path, dest: Path) -> None:
    subprocess.run(["globus-url-copy", "-r", "-pp", "-cc", "4", "-cd", f"file://{src}/", server.url(f"{dest}/")],
                   check=True, stdout=subprocess.DEVNULL)


def pallet_gridftp(server, src: Path, dest: Path, concurrency: int) -> None:
    with open_transport(server.url(str(dest)), concurrency=concurrency) as transport:
        result = transport.transfer(Direction.PUSH, str(src), str(dest), None)
    if not result.ok:
        raise SystemExit(f"gridftp transfer failed: {list(result.failed.items())[:3]}")


def measure_gridftp(server, src: Path, work: Path, repeat: int) -> dict[str, list[float]]:
    runs: dict[str, list[float]] = {"globus-url-copy -r -pp -cc 4": [], "pallet gridftp batch": []}
    for rep in range(repeat):
        runs["globus-url-copy -r -pp -cc 4"].append(
            timed(lambda rep=rep: gridftp_peer(server, src, work / f"gpeer-{rep}")))
        runs["pallet gridftp batch"].append(timed(lambda rep=rep: pallet_gridftp(server, src, work / f"gftp-{rep}", 4)))
    return runs


def per_file_overhead(sshd, src: Path, work: Path, items: list[str]) -> float:
    """Seconds one more tiny file costs in a batch: slope between 1/8 of the files and all of them."""
    small = [i for i in items[: len(items) // 8]]
    t_small = timed(lambda: pallet_push(sshd, src, work / "ovh-small", small, 1))
    t_all = timed(lambda: pallet_push(sshd, src, work / "ovh-all", items, 1))
    return (t_all - t_small) / max(1, len(items) - len(small))


def measure(sshd, src: Path, work: Path, repeat: int) -> dict[str, list[float]]:
    items = local_tree_items(str(src))
    runs: dict[str, list[float]] = {"rsync -a over ssh": [], "pallet ssh whole tree": [], "pallet ssh batch": [],
                                    "pallet parallel rsync x2": []}
    for rep in range(repeat):
        runs["rsync -a over ssh"].append(timed(lambda rep=rep: rsync_peer(sshd, src, work / f"peer-{rep}")))
        runs["pallet ssh whole tree"].append(
            timed(lambda rep=rep: pallet_push(sshd, src, work / f"tree-{rep}", None, 1)))
        runs["pallet ssh batch"].append(timed(lambda rep=rep: pallet_push(sshd, src, work / f"batch-{rep}", items, 1)))
        runs["pallet parallel rsync x2"].append(
            timed(lambda rep=rep: pallet_push(sshd, src, work / f"par-{rep}", items, 2)))
    return runs


def report(runs: dict[str, list[float]], overhead: float) -> dict:
    medians = {name: statistics.median(values) for name, values in runs.items()}
    gridftp = medians.get("pallet gridftp batch", 0) / medians.get("globus-url-copy -r -pp -cc 4", 1)
    for name, values in runs.items():
        print(f"{name:28s} median {medians[name]:6.2f} s   runs {' '.join(f'{v:.2f}' for v in values)}")
    peer = medians["rsync -a over ssh"]
    ratios = {"ssh whole tree / rsync -a": medians["pallet ssh whole tree"] / peer,
              "ssh batch / rsync -a": medians["pallet ssh batch"] / peer,
              "parallel x2 / single rsync": medians["pallet parallel rsync x2"] / medians["pallet ssh batch"]}
    targets = {"ssh whole tree / rsync -a": 1.1, "ssh batch / rsync -a": 1.1, "parallel x2 / single rsync": 1.0,
               "gridftp batch / globus-url-copy -r": 1.0}
    if "pallet gridftp batch" in medians:
        ratios["gridftp batch / globus-url-copy -r"] = gridftp
    for name, value in ratios.items():
        verdict = "PASS" if value <= targets[name] else "MISS"
        print(f"{name:28s} {value:6.2f}  target <= {targets[name]}  {verdict}")
    print(f"ssh per-file overhead in a batch: {overhead * 1e6:.1f} µs")
    return {"medians": medians, "ratios": ratios, "per_file_overhead_s": {"ssh": overhead}}


def main(argv: list[str] | None = None) -> int:
    parser = common_parser(__doc__)
    args = parser.parse_args(argv)
    workdir = args.workdir
    src = ensure_workload(workdir, workloads(args.quick)[0])
    work = Path(tempfile.mkdtemp(prefix="transports-", dir=workdir))
    sshd, gridftp = start_sshd(work / "sshd"), start_gridftp(work / "gridftp")
    try:
        runs = measure(sshd, src, work, args.repeat)
        runs.update(measure_gridftp(gridftp, src, work, args.repeat))
        result = report(runs, per_file_overhead(sshd, src, work, local_tree_items(str(src))))
    finally:
        sshd.stop()
        gridftp.stop()
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, **result}, indent=2))
    print(f"outputs left in {work} (delete them when the disk is idle)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
