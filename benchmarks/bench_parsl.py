"""Parsl staging of many tiny inputs over ssh loopback: PalletStaging (unpacked, kept packed) against RSyncStaging."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import parsl                                                           # noqa: E402
from parsl import python_app                                           # noqa: E402
from parsl.config import Config                                        # noqa: E402
from parsl.data_provider.file_noop import NoOpFileStaging              # noqa: E402
from parsl.data_provider.files import File                             # noqa: E402
from parsl.data_provider.rsync import RSyncStaging                     # noqa: E402
from parsl.executors import ThreadPoolExecutor                         # noqa: E402

from pallet_parsl import PalletStaging                                 # noqa: E402
from staging_core.options import StagingOptions                        # noqa: E402
from tests.servers import start_sshd                                   # noqa: E402

TARGET = 50.0          # PalletStaging must be this many times faster than RSyncStaging


def size_of(inputs=()):
    return os.path.getsize(inputs[0])


def make_inputs(root: Path, count: int, size: int) -> list[str]:
    """``count`` files of ``size`` bytes, 100 per directory, names unique (RSyncStaging keeps only basenames)."""
    paths = []
    for n in range(count):
        path = root / f"d{n // 100:03d}" / f"f{n:05d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
        paths.append(str(path))
    return paths


def run_apps(work: Path, staging, files: list[File], threads: int) -> tuple[float, float]:
    """One Parsl run of one app per input: seconds to submit them all (staging's cost on the submitting
    thread included), and seconds until every app has read its input. Cleaned up after."""
    executor = ThreadPoolExecutor(label="threads", max_threads=threads, working_dir=str(work / "local"),
                                  storage_access=[staging])
    dfk = parsl.load(Config(executors=[executor], run_dir=str(work / "runinfo"), strategy="none"))
    try:
        app = python_app(size_of, executors=["threads"])
        started = time.perf_counter()
        futures = [app(inputs=[file]) for file in files]
        submitted = time.perf_counter() - started
        if isinstance(staging, PalletStaging):
            staging.flush()
        sizes = [future.result() for future in futures]
        seconds = time.perf_counter() - started
    finally:
        dfk.cleanup()
        parsl.clear()
    if len(set(sizes)) != 1:
        raise SystemExit(f"apps saw different input sizes: {sorted(set(sizes))[:5]}")
    return submitted, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--size", type=int, default=1024, help="bytes per input file")
    parser.add_argument("--rsync-sample", type=int, default=1000,
                        help="inputs RSyncStaging stages; its time is extrapolated to --files (0: all of them)")
    parser.add_argument("--threads", type=int, default=4, help="ThreadPoolExecutor threads for both runs")
    parser.add_argument("--clean-home", action="store_true",
                        help="give the far side's sessions an empty HOME, so their shell reads no ~/.bashrc "
                             "(each ssh command pays the login shell's start-up: per-file staging once per file)")
    parser.add_argument("--workdir", type=Path, help="where its scratch directory goes, removed at the end "
                                                     "(default: $TMPDIR)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-parsl-", dir=args.workdir))
    (workdir / "home").mkdir()
    sshd = start_sshd(workdir / "sshd", (f"SetEnv HOME={workdir / 'home'}",) if args.clean_home else ())
    try:
        figures = measure(sshd, workdir, args)
    finally:
        sshd.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


def ssh_round_trip(sshd, times: int = 10) -> float:
    """Seconds one `ssh HOST true` takes: what every per-file transfer pays at least once."""
    command = ["ssh", "-p", str(sshd.port), *sshd.ssh_options, f"{sshd.user}@127.0.0.1", "true"]
    started = time.perf_counter()
    for _ in range(times):
        subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       check=True)
    return (time.perf_counter() - started) / times


def measure(sshd, workdir: Path, args) -> dict:
    paths = make_inputs(workdir / "remote", args.files, args.size)
    options = StagingOptions(remote_python=sys.executable, ssh_options=tuple(sshd.ssh_options))
    staging = PalletStaging(options=options, window=60, max_files=args.files)
    pallet_submit, pallet_s = run_apps(workdir / "pallet", staging, [File(sshd.url(p)) for p in paths], args.threads)
    batches = [future.result() for future in staging.batches()]
    kept = PalletStaging(options=options, window=60, max_files=args.files, keep_packed=True,
                         scratch=str(workdir / "node-local"))
    _, kept_s = run_apps(workdir / "kept", kept, [File(sshd.url(p)) for p in paths], args.threads)
    kept_batches = [future.result() for future in kept.batches()]
    # RSyncStaging runs `rsync HOST:PATH LOCAL` per file in the app's task; rsync takes the ssh options from RSYNC_RSH
    os.environ["RSYNC_RSH"] = shlex.join(["ssh", "-p", str(sshd.port), *sshd.ssh_options])
    sample = paths[:args.rsync_sample or args.files]
    _, rsync_s = run_apps(workdir / "rsync", RSyncStaging(f"{sshd.user}@127.0.0.1"), [File(p) for p in sample],
                          args.threads)
    rsync_full = rsync_s * args.files / len(sample)
    # the same apps reading the same files where they are, staged by nobody: what Parsl itself costs
    floor_submit, floor_s = run_apps(workdir / "floor", NoOpFileStaging(), [File(p) for p in paths], args.threads)
    return {"files": args.files, "bytes_per_file": args.size, "threads": args.threads,
            "clean_home": args.clean_home, "ssh_round_trip_seconds": round(ssh_round_trip(sshd), 3),
            "parsl_floor_seconds": round(floor_s, 2), "parsl_floor_submit_seconds": round(floor_submit, 2),
            "pallet_seconds": round(pallet_s, 2), "pallet_submit_seconds": round(pallet_submit, 2),
            "pallet_batches": [{"files": b.files, "strategy": b.strategy, "transfers": b.transfers,
                                "seconds": round(b.seconds, 2)} for b in batches],
            "pallet_files_created": files_under(workdir / "pallet" / "local"),
            "kept_seconds": round(kept_s, 2), "kept_files_created": files_under(workdir / "kept" / "local"),
            "kept_batches": [{"files": b.files, "strategy": b.strategy, "transfers": b.transfers,
                              "seconds": round(b.seconds, 2)} for b in kept_batches],
            "rsync_sample_files": len(sample), "rsync_sample_seconds": round(rsync_s, 2),
            "rsync_seconds" + ("" if len(sample) == args.files else "_extrapolated"): round(rsync_full, 1),
            "speedup": round(rsync_full / pallet_s, 1), "target": TARGET,
            "result": "PASS" if rsync_full / pallet_s >= TARGET else "MISS"}


def files_under(root: Path) -> int:
    """Files the run left below ``root`` (its local copies, markers and kept bundles): the creates it cost."""
    return sum(len(names) for _, _, names in os.walk(root))


if __name__ == "__main__":
    main()
