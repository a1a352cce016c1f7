"""bench_workflow.py's runs: their trees, environments and leftovers, and what their logs say pallet did."""
from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from contextlib import suppress
from pathlib import Path

INPUT_BYTES = 1024                 # every input file has exactly this size; an output holds the sum it read

# "pallet: fetched 110 object(s) (110 files, 112640 bytes) from ssh://...: inline, 1 transfer(s), 0.03 s"
OPERATION = re.compile(r"pallet: (fetched|sent) (\d+) object\(s\) \((\d+) files, (\d+) bytes\) (?:from|to) (\S+): "
                       r"(.+), (\d+) transfer\(s\), ([\d.]+) s")
PREFETCH = re.compile(r"pallet: prefetching (\d+) object\(s\)")


# ---------------------------------------------------------------- trees, environment, leftovers

def make_tree(tree: Path, jobs: int, inputs: int) -> None:
    """``tree``/in/jJ/iK.txt: ``inputs`` files of INPUT_BYTES bytes for each of ``jobs`` jobs, every one different."""
    for job in range(jobs):
        folder = tree / "in" / f"j{job}"
        folder.mkdir(parents=True)
        for k in range(inputs):
            head = f"job {job} input {k} "
            (folder / f"i{k}.txt").write_text(head + "x" * (INPUT_BYTES - len(head) - 1) + "\n")


def check_outputs(tree: Path, jobs: int, inputs: int) -> str:
    """'' when ``tree``/out holds every job's output with the bytes its inputs had, else what is wrong."""
    expected = f"{inputs * INPUT_BYTES}"
    wrong = [n for n in range(jobs) if not (tree / "out" / f"o{n}.txt").is_file()
             or (tree / "out" / f"o{n}.txt").read_text().strip() != expected]
    return f"{len(wrong)} of {jobs} outputs missing or wrong (first: o{wrong[0]}.txt)" if wrong else ""


def run_environment(runtime: Path) -> dict[str, str]:
    """The environment of a run's processes: no PYTHON* variables (the plugin and pallet_parsl are found as
    installed), and XDG_RUNTIME_DIR a directory of this run only, so that no kept ssh connection of an earlier
    run serves it (each run starts cold, as a workflow's first run does) and the ones it leaves are found."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTHON")}
    env["XDG_RUNTIME_DIR"] = str(runtime)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def end_processes_mentioning(*marks: Path) -> list[str]:
    """SIGTERM the processes whose command line names one of ``marks`` (a run's own directories: the kept ssh
    connection it left, Parsl workers); SIGKILL those still there after 5 s. Their PIDs and programs."""
    needles = [str(mark).encode() for mark in marks]
    found, said = [], []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if any(needle in cmdline for needle in needles):
            found.append(int(entry.name))
            words = cmdline.split(b"\0")
            said.append(f"{entry.name} {os.path.basename(words[0].decode(errors='replace'))} "
                        f"{' '.join(w.decode(errors='replace') for w in words[1:3])}")
    for pid in found:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in found):
        time.sleep(0.1)
    for pid in found:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return said


def fresh_runtime() -> Path:
    """A private, short directory for XDG_RUNTIME_DIR (a kept connection's socket path must stay short)."""
    return Path(tempfile.mkdtemp(prefix="pwf-", dir="/tmp"))


# ---------------------------------------------------------------- what the logs say

def pallet_counts(text: str) -> dict:
    """From a Snakemake log: prefetch operations (and the objects they added), fetch and store operations by
    strategy, the objects and transfers in them, and the seconds pallet reported for them."""
    counts: dict = {"prefetch_ops": 0, "prefetched_objects": 0}
    for match in PREFETCH.finditer(text):
        counts["prefetch_ops"] += 1
        counts["prefetched_objects"] += int(match[1])
    for verb, key in (("fetched", "fetch"), ("sent", "store")):
        found = [m for m in OPERATION.finditer(text) if m[1] == verb]
        counts[f"{key}_ops"] = len(found)
        counts[f"{key}_strategies"] = dict(Counter(m[6] for m in found))
        counts[f"{key}_objects"] = sum(int(m[2]) for m in found)
        counts[f"{key}_transfers"] = sum(int(m[7]) for m in found)
        counts[f"{key}_seconds"] = round(sum(float(m[8]) for m in found), 2)
    return counts


def describe_counts(counts: dict) -> str:
    if "fetch_ops" in counts:
        text = (f"prefetch {counts['prefetch_ops']} op(s) adding {counts['prefetched_objects']} object(s); "
                f"fetch {counts['fetch_ops']} op(s) {counts['fetch_strategies']} ({counts['fetch_objects']} objects, "
                f"{counts['fetch_seconds']} s); store {counts['store_ops']} op(s) {counts['store_strategies']} "
                f"({counts['store_objects']} objects, {counts['store_seconds']} s)")
        if counts.get("requests"):
            text += (f"; host-session requests {dict(counts['requests'])}, "
                     f"{sum(counts['request_seconds'].values()):.1f} s in them")
    elif "batches_in" in counts:
        text = (f"submit {counts['submit_seconds']} s; in: {counts['batches_in']} batch(es) "
                f"{counts['batches_in_strategies']} ({counts['batches_in_files']} files, "
                f"{counts['batches_in_seconds']} s); out: {counts['batches_out']} batch(es) "
                f"{counts['batches_out_strategies']} ({counts['batches_out_files']} files, "
                f"{counts['batches_out_seconds']} s)")
    else:
        text = f"submit {counts['submit_seconds']} s" if "submit_seconds" in counts else ""
    if counts.get("processes_left"):
        text += f"; left by the run and stopped: {counts['processes_left']}"
    return text
