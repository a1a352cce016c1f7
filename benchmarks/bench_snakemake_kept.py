"""Snakemake remote jobs on one node, each fetching its own inputs against --storage-pallet-keep-packed (one kept
bundle per node, every job copying its inputs out of it): wall time, fetches and files made below the node."""
from __future__ import annotations

import argparse
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench_snakemake import without_pythonpath, make_inputs  # noqa: E402
from tests.servers import start_sshd  # noqa: E402

SNAKEFILE = ROOT / "examples" / "snakemake" / "Snakefile"
MODES = {"fetch per job": [], "keep-packed": ["--storage-pallet-keep-packed"]}
# runs each job script in the background on this machine, as a compute node would
SUBMIT = '#!/bin/sh\nsh "$1" >"{logs}/$(basename "$1").log" 2>&1 </dev/null &\necho "local-$!"\n'


def run_once(work: Path, sshd, data: Path, files: int, jobs: int, flags: list[str]) -> dict:
    """One snakemake run with the cluster-generic executor and no shared file system; returns its wall seconds,
    the fetches its part jobs made of the input directory, and the files left below the node's scratch."""
    if work.exists():
        shutil.rmtree(work)
    logs, scratch, submit = work / "logs", work / "node-scratch", work / "submit.sh"
    logs.mkdir(parents=True)
    submit.write_text(SUBMIT.format(logs=logs))
    submit.chmod(0o755)
    argv = [str(Path(sys.executable).parent / "snakemake"), "--snakefile", str(SNAKEFILE), "--cores", "2",
            "--storage-pallet-ssh-options", shlex.join(sshd.ssh_options),
            "--storage-pallet-remote-python", sys.executable, *flags,
            "--config", f"data={sshd.url(str(data))}", f"samples={files}", f"parts={jobs}",
            "--executor", "cluster-generic", "--jobs", str(jobs), "--cluster-generic-submit-cmd", str(submit),
            "--seconds-between-status-checks", "1", "--default-storage-provider", "pallet",
            "--default-storage-prefix", sshd.url(str(work / "remote-results")),
            "--shared-fs-usage", "persistence", "software-deployment", "sources", "source-cache",
            "--remote-job-local-storage-prefix", str(scratch)]
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=work, env=without_pythonpath(), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=1800)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"snakemake failed:\n{done.stderr[-3000:]}")
    expected = f"{files} {3 * files * (files - 1) // 2}\n"
    if (work / "remote-results" / "results" / "summary.txt").read_text() != expected:
        raise SystemExit("wrong summary")
    output = "".join(p.read_text() for p in logs.iterdir())
    kept = set(re.findall(r"out of the kept bundle of \S+/data \((\S+)\)", output))
    fetched = len(re.findall(r"pallet: fetched \d+ object\(s\) .* from \S+/data:", output))
    return {"seconds": seconds, "fetches": len(kept) if flags else fetched,
            "files_below_node": sum(1 for p in scratch.rglob("*") if p.is_file())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--files", type=int, default=20000, help="inputs of 1 KiB (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=8, help="part jobs sharing them (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "pallet-bench-sm-kept")
    args = parser.parse_args(argv)
    data = args.workdir / "data"
    make_inputs(data, args.files, 1024)
    sshd = start_sshd(args.workdir / "sshd")
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    try:
        for repetition in range(args.repeat):
            for mode, flags in (MODES.items() if repetition % 2 == 0 else reversed(MODES.items())):
                run = run_once(args.workdir / "run", sshd, data, args.files, args.jobs, flags)
                runs[mode].append(run)
                print(f"{mode}: {run['seconds']:.1f} s, {run['fetches']} fetch(es) of the inputs, "
                      f"{run['files_below_node']} files below the node", flush=True)
    finally:
        sshd.stop()
    print(f"\n{args.files} inputs, {args.jobs} jobs on one node, medians of {args.repeat}:")
    for mode, done in runs.items():
        print(f"  {mode:14} {statistics.median(r['seconds'] for r in done):7.1f} s  "
              f"fetches {statistics.median(r['fetches'] for r in done):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
