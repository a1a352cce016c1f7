"""Snakemake with the pallet plugin against snakemake-storage-plugin-fs: stage-in of 20,000 x 1 KiB inputs, and
(``--outputs N``) N one-output jobs whose outputs go to storage one after another."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.servers import start_sshd      # noqa: E402

TARGET_RATIO = 50.0
STREAM_TARGET = 1.5      # pallet-ssh stage-in / the hand-made stream of the same files, at most

SNAKEFILE = '''\
import os

STORE = getattr(storage, config["provider"])
FILES, PARTS = int(config["files"]), int(config["parts"])


def part_inputs(wildcards):
    return STORE([f"{config['prefix']}/s{n:05d}.csv" for n in range(int(wildcards.part), FILES, PARTS)])


rule all:
    input: expand("results/part{part}.txt", part=range(PARTS))


rule part:
    input: part_inputs
    output: "results/part{part}.txt"
    run:
        with open(output[0], "w") as out:
            out.write(f"{len(input)} {sum(os.path.getsize(path) for path in input)}\\n")
'''

OUTPUTS_SNAKEFILE = '''\
STORE = getattr(storage, config["provider"])
JOBS = int(config["jobs"])


rule all:
    input: STORE(expand(f"{config['prefix']}/o{{n}}.txt", n=range(JOBS)))


rule make:
    output: STORE(f"{config['prefix']}/o{{n}}.txt")
    run:
        with open(output[0], "w") as out:
            out.write(f"{wildcards.n}\\n")
'''

# Runs snakemake's own command line in this process, timing every DAG.retrieve_storage_inputs call (the stage-in
# of a scheduler round: existence checks, the plugin's retrievals, Snakemake's bookkeeping) into argv[1]
# after each call (snakemake may leave without running exit handlers).
DRIVER = '''\
import json, sys, time
from snakemake.cli import main
import snakemake.dag

spent, original = [], snakemake.dag.DAG.retrieve_storage_inputs


async def timed(self, *args, **kwargs):
    started = time.perf_counter()
    try:
        return await original(self, *args, **kwargs)
    finally:
        spent.append(time.perf_counter() - started)
        with open(OUT, "w") as out:
            out.write(json.dumps(spent))


OUT = sys.argv[1]
snakemake.dag.DAG.retrieve_storage_inputs = timed
sys.argv = ["snakemake", *sys.argv[2:]]
main()
'''


@dataclass
class Run:
    """One snakemake run: which plugin and source, seconds in stage-in and in total, the transfer log line."""

    name: str
    stage_in_s: float
    total_s: float
    pallet_log: str


def make_inputs(directory: Path, count: int, size: int) -> None:
    """``count`` files of exactly ``size`` bytes (reused when already there)."""
    marker = directory / f".made-{count}x{size}"
    if marker.exists():
        return
    directory.mkdir(parents=True, exist_ok=True)
    for n in range(count):
        line = f"{n},{3 * n},"
        (directory / f"s{n:05d}.csv").write_text(line + "x" * (size - len(line) - 1) + "\n")
    marker.touch()


def run_workflow(work: Path, name: str, provider: str, prefix: str, files: int, extra: list[str]) -> Run:
    """One fresh working directory, one snakemake run; the outputs are checked."""
    workdir = work / "runs" / name
    workdir.mkdir(parents=True)
    (workdir / "Snakefile").write_text(SNAKEFILE)
    (workdir / "driver.py").write_text(DRIVER)
    env = without_pythonpath()          # the plugin is found as installed, as users find it
    argv = [sys.executable, "driver.py", "stage-in.json", "--cores", "4", "--config", f"provider={provider}",
            f"prefix={prefix}", f"files={files}", "parts=4", *extra]
    started = time.perf_counter()
    with open(workdir / "snakemake.log", "w") as log:
        done = subprocess.run(argv, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL)
    total = time.perf_counter() - started
    text = (workdir / "snakemake.log").read_text()
    if done.returncode != 0:
        raise SystemExit(f"{name}: snakemake failed ({done.returncode}):\n{text[-3000:]}")
    counted = sum(int((workdir / "results" / f"part{p}.txt").read_text().split()[0]) for p in range(4))
    if counted != files:
        raise SystemExit(f"{name}: the workflow read {counted} inputs, not {files}")
    pallet_log = next((line for line in text.splitlines() if "pallet: fetched" in line), "")
    return Run(name, sum(json.loads((workdir / "stage-in.json").read_text())), total, pallet_log.strip())


def hand_stream(sshd, inputs: Path, dest: Path) -> float:
    """Seconds of ``ssh HOST 'tar -cf - -C INPUTS . | zstd -T0 -c' | zstd -dc | tar -x -C DEST``: the
    hand-made stream a user could type instead; the copy is checked by its file count."""
    dest.mkdir(parents=True)
    remote = f"tar -cf - -C {shlex.quote(str(inputs))} . | zstd -q -T0 -c"
    started = time.perf_counter()
    sender = subprocess.Popen(["ssh", "-p", str(sshd.port), *sshd.ssh_options, f"{sshd.user}@127.0.0.1", remote],
                              stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    decoder = subprocess.Popen(["zstd", "-q", "-dc"], stdin=sender.stdout, stdout=subprocess.PIPE)
    sender.stdout.close()
    extract = subprocess.run(["tar", "-xf", "-", "-C", str(dest)], stdin=decoder.stdout)
    decoder.stdout.close()
    statuses = (sender.wait(), decoder.wait(), extract.returncode)
    seconds = time.perf_counter() - started
    if any(statuses) or len(list(dest.glob("s*.csv"))) != len(list(inputs.glob("s*.csv"))):
        raise SystemExit(f"the hand-made stream failed (statuses {statuses})")
    return seconds


def without_pythonpath() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if not name.startswith("PYTHON")}


def run_outputs(work: Path, name: str, provider: str, prefix: str, jobs: int, extra: list[str]) -> Run:
    """``jobs`` one-output jobs in the main process: Snakemake stores each output as its job ends."""
    workdir = work / "runs" / name
    workdir.mkdir(parents=True)
    (workdir / "Snakefile").write_text(OUTPUTS_SNAKEFILE)
    argv = [str(Path(sys.executable).with_name("snakemake")), "--cores", "4", "--config", f"provider={provider}",
            f"prefix={prefix}", f"jobs={jobs}", *extra]
    started = time.perf_counter()
    with open(workdir / "snakemake.log", "w") as log:
        done = subprocess.run(argv, cwd=workdir, env=without_pythonpath(), stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL)
    total = time.perf_counter() - started
    text = (workdir / "snakemake.log").read_text()
    if done.returncode != 0:
        raise SystemExit(f"{name}: snakemake failed ({done.returncode}):\n{text[-3000:]}")
    stores = sum(1 for line in text.splitlines() if "pallet: sent" in line)
    return Run(name, 0.0, total, f"{stores} pallet store operation(s)" if provider == "pallet" else "")


def outputs_main(args: argparse.Namespace) -> int:
    """The many-small-outputs comparison: N one-output jobs, outputs stored to a directory, pallet vs fs."""
    work = args.workdir
    if (work / "runs").exists():
        subprocess.run(["rm", "-rf", "--", str(work / "runs")], check=True)
    runs = []
    for name, provider, prefix in (("pallet-local", "pallet", f"file://{work}/out-pallet"),
                                   ("fs-local", "fs", f"{work}/out-fs")):
        subprocess.run(["rm", "-rf", "--", prefix.removeprefix("file://")], check=True)
        runs.append(run_outputs(work, name, provider, prefix, args.outputs, []))
        stored = sorted(os.listdir(prefix.removeprefix("file://")))
        if stored != sorted(f"o{n}.txt" for n in range(args.outputs)):
            raise SystemExit(f"{name}: the destination holds {len(stored)} names, not the {args.outputs} outputs")
    print(f"{args.outputs} one-output jobs, each output stored as its job ends (local jobs, 4 cores)")
    for run in runs:
        print(f"  {run.name:<13} whole run {run.total_s:8.2f} s  ({run.total_s / args.outputs * 1000:.0f} ms per job)"
              f"   {run.pallet_log}")
    if args.json:
        args.json.write_text(json.dumps({"outputs": args.outputs, "runs": [asdict(r) for r in runs]}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--files", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "pallet-bench-snakemake")
    parser.add_argument("--no-ssh", dest="ssh", action="store_false", help="skip the ssh-loopback runs")
    parser.add_argument("--no-fs", dest="fs", action="store_false",
                        help="skip the two local runs (snakemake-storage-plugin-fs alone takes minutes)")
    parser.add_argument("--json", type=Path, help="write the runs and the ratio here")
    parser.add_argument("--outputs", type=int, metavar="N",
                        help="instead: N one-output jobs storing their outputs (the many-small-outputs case)")
    args = parser.parse_args(argv)
    if args.outputs:
        return outputs_main(args)
    work = args.workdir
    inputs = work / "inputs"
    make_inputs(inputs, args.files, args.size)
    for previous in ("runs", "sshd"):                     # outputs and server keys of an earlier run
        if (work / previous).exists():
            subprocess.run(["rm", "-rf", "--", str(work / previous)], check=True)
    runs = [run_workflow(work, "pallet-local", "pallet", f"file://{inputs}", args.files, []),
            run_workflow(work, "fs-local", "fs", str(inputs), args.files, [])] if args.fs else []
    streams: list[float] = []
    if args.ssh:
        sshd = start_sshd(work / "sshd")
        try:
            flags = ["--storage-pallet-ssh-options", shlex.join(sshd.ssh_options),
                     "--storage-pallet-remote-python", sys.executable]
            for attempt in range(3):        # alternating with the hand-made stream; medians
                runs.append(run_workflow(work, f"pallet-ssh-{attempt}", "pallet", sshd.url(str(inputs)),
                                         args.files, flags))
                streams.append(hand_stream(sshd, inputs, work / "runs" / f"stream-{attempt}"))
        finally:
            sshd.stop()
    print(f"stage-in of {args.files:,} x {args.size} B inputs (4 jobs, one scheduler round), local disk to local disk")
    for run in runs:
        print(f"  {run.name:<13} stage-in {run.stage_in_s:8.2f} s   whole run {run.total_s:8.2f} s   {run.pallet_log}")
    verdicts, doc = [], {"files": args.files, "size": args.size, "runs": [asdict(r) for r in runs], "streams": streams}
    if args.fs:
        ratio = runs[1].stage_in_s / runs[0].stage_in_s
        verdicts.append(ratio >= TARGET_RATIO)
        doc["ratio"] = ratio
        print(f"ratio fs / pallet (stage-in): {ratio:.1f}x  (target >= {TARGET_RATIO:.0f}x: "
              f"{'PASS' if verdicts[-1] else 'MISS'})")
    if streams:
        pallet_ssh = statistics.median(r.stage_in_s for r in runs if r.name.startswith("pallet-ssh"))
        versus = pallet_ssh / statistics.median(streams)
        verdicts.append(versus <= STREAM_TARGET)
        doc["stream_ratio"] = versus
        print(f"  hand-made stream (ssh tar | zstd, zstd -d | tar x): {', '.join(f'{s:.2f}' for s in streams)} s")
        print(f"ratio pallet-ssh stage-in / hand-made stream (medians of 3): {versus:.2f}  (target <= "
              f"{STREAM_TARGET}: {'PASS' if verdicts[-1] else 'MISS'})")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
