"""Workflow scale over a warm host session: a Snakemake workflow of N jobs, each reading M remote inputs and
writing one remote output, with pallet over ssh (loopback and an emulated 40 ms / 1 Gbit link), pallet on file://,
snakemake-storage-plugin-fs on the same directory as a local path, and plain local files (the floor); and Parsl
apps of the same shape on a HighThroughputExecutor, with PalletStaging over ssh against the same apps on local
files. Every run gets fresh remote and local trees; variants run side by side, interleaved when repeated."""
from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for entry in (str(ROOT), str(BENCH)):
    if entry not in sys.path:
        sys.path.insert(0, entry)

from bench_bundle import code_version, machine_busy_seconds, wait_for_idle      # noqa: E402
from bench_small_ops import Far, loopback, namespace              # noqa: E402
from push_report import Target                                    # noqa: E402
from wan import LinkSpec, missing_tools                           # noqa: E402
from workflow_support import (INPUT_BYTES, check_outputs, describe_counts, end_processes_mentioning,  # noqa: E402
                              fresh_runtime, make_tree, pallet_counts, run_environment)

RUN_TIMEOUT_S = 3600

# (numerator, denominator, at most): the targets
SNAKEMAKE_TARGETS = (("pallet-ssh", "pallet-file", 1.5), ("pallet-ssh", "fs", 0.3),
                     ("pallet-ssh-40ms", "pallet-file", 2.0))
PARSL_TARGETS = (("pallet-ssh", "local", 1.5),)

SNAKEFILE = '''\
PROVIDER, PREFIX = config["provider"], config["prefix"]
STORE = (lambda paths: paths) if PROVIDER == "none" else getattr(storage, PROVIDER)
JOBS, INPUTS = int(config["jobs"]), int(config["inputs"])


rule all:
    input: STORE(expand(PREFIX + "/out/o{n}.txt", n=range(JOBS)))


rule make:
    input: lambda w: STORE([f"{PREFIX}/in/j{w.n}/i{k}.txt" for k in range(INPUTS)])
    output: STORE(PREFIX + "/out/o{n}.txt")
'''
RULE_BODY = {
    # one shell command per job, run by Snakemake in a thread of its own process
    "shell": '    shell: "cat {input} | wc -c > {output}"\n',
    # a Python `run:` block: Snakemake 9 spawns a new snakemake process for every such job
    "run": ('    run:\n'
            '        with open(output[0], "w") as out:\n'
            '            out.write(f"{sum(len(open(path, \'rb\').read()) for path in input)}\\n")\n'),
}

# Runs snakemake's own command line in this process and counts the requests pallet's host sessions send (stat,
# list, get, put: one round trip each) and their seconds, into argv[1] after each request (snakemake may leave
# without running exit handlers). Only counts: where the class is not there, nothing is counted.
DRIVER = '''\
import collections, json, sys, threading, time
OUT = sys.argv[1]
sys.argv = ["snakemake", *sys.argv[2:]]
counts, spent, lock = collections.Counter(), collections.Counter(), threading.Lock()
try:
    from staging_core.far_side.host_session import HostSession
    original = HostSession.request
except (ImportError, AttributeError):
    original = None


def request(self, op, payload):
    started = time.perf_counter()
    try:
        return original(self, op, payload)
    finally:
        with lock:
            counts[op] += 1
            spent[op] += time.perf_counter() - started
            with open(OUT, "w") as out:
                json.dump({"requests": counts, "request_seconds": {k: round(v, 3) for k, v in spent.items()}}, out)


if original is not None:
    HostSession.request = request
from snakemake.cli import main
main()
'''

@dataclass
class Run:
    """One run of one variant: wall seconds (None: failed), what pallet's log or batches said."""

    variant: str
    round: int
    seconds: float | None
    error: str = ""
    counts: dict = field(default_factory=dict)
    machine_cpus: float = 0.0              # busy CPUs of the whole machine, on average over the run
    own_cpus: float = 0.0                  # of them, the run's own processes that this script waited for


@dataclass
class Variant:
    """A way to run the workload: its name, the link, and what the runner needs."""

    name: str
    what: str
    provider: str = "none"                    # snakemake: none, pallet, fs; parsl: none, pallet
    far: Far | None = None                    # ssh variants: the host
    file_url: bool = False                    # pallet on file://
    runs: list[Run] = field(default_factory=list)

    @property
    def seconds(self) -> list[float]:
        return [r.seconds for r in self.runs if r.seconds is not None]

    @property
    def median(self) -> float | None:
        return statistics.median(self.seconds) if self.seconds else None


# ---------------------------------------------------------------- Snakemake

def snakemake_once(variant: Variant, run_dir: Path, args: argparse.Namespace, round_: int) -> Run:
    """One Snakemake run of ``variant`` on a fresh tree and a fresh working directory, timed whole."""
    tree, workflow = run_dir / "tree", run_dir / "wf"
    make_tree(tree, args.jobs, args.inputs)
    workflow.mkdir(parents=True)
    (workflow / "Snakefile").write_text(SNAKEFILE + RULE_BODY[args.rule])
    (workflow / "driver.py").write_text(DRIVER)
    prefix = str(tree)
    if variant.far is not None:
        prefix = variant.far.url(tree)
    elif variant.file_url:
        prefix = f"file://{tree}"
    argv = [sys.executable, "driver.py", str(run_dir / "requests.json"), "--cores", str(args.cores), "--config",
            f"provider={variant.provider}", f"prefix={prefix}", f"jobs={args.jobs}", f"inputs={args.inputs}"]
    if variant.far is not None:
        argv += ["--storage-pallet-ssh-options", shlex.join(variant.far.ssh_options),
                 "--storage-pallet-remote-python", variant.far.remote_python]
    if variant.provider == "pallet":
        argv += shlex.split(args.pallet_args)
    runtime = fresh_runtime()
    log = run_dir / "snakemake.log"
    try:
        started = time.perf_counter()
        with open(log, "w") as out:
            done = subprocess.run(argv, cwd=workflow, env=run_environment(runtime), stdout=out,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=RUN_TIMEOUT_S)
        seconds = time.perf_counter() - started
    finally:
        left = end_processes_mentioning(runtime)
        shutil.rmtree(runtime, ignore_errors=True)
    text = log.read_text(errors="replace")
    counts = pallet_counts(text) if variant.provider == "pallet" else {}
    if (run_dir / "requests.json").exists():
        counts |= json.loads((run_dir / "requests.json").read_text())
    if left:
        counts["processes_left"] = left
    if done.returncode != 0:
        tail = " | ".join(text.strip().splitlines()[-4:])
        return Run(variant.name, round_, None, f"snakemake exited {done.returncode}: {tail}", counts)
    problem = check_outputs(tree, args.jobs, args.inputs)
    return Run(variant.name, round_, None if problem else seconds, problem, counts)


def snakemake_variants(far0: Far, far40: Far | None, rtt: str) -> list[Variant]:
    found = [Variant("local", "plain local files, no storage plugin (the floor)"),
             Variant("pallet-file", "pallet on file://", "pallet", file_url=True),
             Variant("pallet-ssh", "pallet over ssh loopback", "pallet", far0),
             Variant("fs", "snakemake-storage-plugin-fs on the same directory as a local path", "fs")]
    if far40 is not None:
        found.append(Variant("pallet-ssh-40ms", f"pallet over ssh, emulated {rtt}", "pallet", far40))
    return found


# ---------------------------------------------------------------- Parsl

# The Parsl run's own process. The apps are defined here, in __main__, so that Parsl sends them to the workers
# by value (the workers cannot import this file).
PARSL_CHILD = '''\
import json, sys
sys.path[:0] = json.loads(sys.argv[2])
import bench_workflow


def combine(inputs=(), outputs=()):
    total = 0
    for path in inputs:
        with open(path, "rb") as handle:
            total += len(handle.read())
    with open(outputs[0], "w") as out:
        out.write(f"{total}\\n")
    return total


def noop():
    return 0


print("RESULT " + json.dumps(bench_workflow.parsl_run(json.loads(sys.argv[1]), combine, noop)), flush=True)
'''


def parsl_run(spec: dict, combine, noop) -> dict:
    """One Parsl run (in a process of its own): an HTEX with ``workers`` local workers, started and warmed up by
    one ``noop`` app untimed; then ``jobs`` ``combine`` apps of ``inputs`` inputs and one output each, timed from
    the first submission until every app has returned and every output has arrived."""
    import parsl
    from parsl import python_app
    from parsl.config import Config
    from parsl.data_provider.data_manager import default_staging
    from parsl.data_provider.files import File
    from parsl.executors import HighThroughputExecutor
    from parsl.providers import LocalProvider

    tree, work = Path(spec["tree"]), Path(spec["work"])
    staging = None
    storage = list(default_staging)
    if spec["provider"] == "pallet":
        from pallet_parsl import PalletStaging
        staging = PalletStaging(remote_python=spec["remote_python"], ssh_options=spec["ssh_options"])
        storage = [staging, *default_staging]

    def place(path: Path) -> File:
        return File(spec["url_prefix"] + str(path)) if spec["url_prefix"] else File(str(path))

    executor = HighThroughputExecutor(label="htex", address="127.0.0.1", cores_per_worker=1,
                                      max_workers_per_node=spec["workers"], working_dir=str(work / "local"),
                                      provider=LocalProvider(init_blocks=1, min_blocks=1, max_blocks=1),
                                      storage_access=storage)
    dfk = parsl.load(Config(executors=[executor], run_dir=str(work / "runinfo"), strategy="none"))
    try:
        python_app(noop, executors=["htex"])().result(timeout=300)
        app = python_app(combine, executors=["htex"])
        started = time.perf_counter()
        futures = [app(inputs=[place(tree / "in" / f"j{n}" / f"i{k}.txt") for k in range(spec["inputs"])],
                       outputs=[place(tree / "out" / f"o{n}.txt")]) for n in range(spec["jobs"])]
        submitted = time.perf_counter() - started
        totals = [future.result(timeout=RUN_TIMEOUT_S) for future in futures]
        for future in futures:
            future.outputs[0].result(timeout=RUN_TIMEOUT_S)
        seconds = time.perf_counter() - started
        batches = [b.result(timeout=60) for b in staging.batches()] if staging is not None else []
    finally:
        dfk.cleanup()
        parsl.clear()
    if set(totals) != {spec["inputs"] * INPUT_BYTES}:
        raise SystemExit(f"apps read {sorted(set(totals))[:5]} bytes, not {spec['inputs'] * INPUT_BYTES}")
    counts = {"submit_seconds": round(submitted, 2)}
    for direction in ("in", "out") if staging is not None else ():
        mine = [b for b in batches if b.direction == direction]
        counts[f"batches_{direction}"] = len(mine)
        counts[f"batches_{direction}_strategies"] = dict(Counter(b.strategy for b in mine))
        counts[f"batches_{direction}_files"] = sum(b.files for b in mine)
        counts[f"batches_{direction}_transfers"] = sum(b.transfers for b in mine)
        counts[f"batches_{direction}_seconds"] = round(sum(b.seconds for b in mine), 2)
    return {"seconds": seconds, "counts": counts}


def parsl_once(variant: Variant, run_dir: Path, args: argparse.Namespace, round_: int) -> Run:
    """One Parsl run of ``variant`` in a new Python process, on a fresh tree; its outputs checked."""
    tree = run_dir / "tree"
    make_tree(tree, args.jobs, args.inputs)
    (tree / "out").mkdir()
    far = variant.far
    spec = {"tree": str(tree), "work": str(run_dir), "jobs": args.jobs, "inputs": args.inputs,
            "workers": args.cores, "provider": variant.provider,
            "url_prefix": far.url("") if far is not None else "",
            "ssh_options": shlex.join(far.ssh_options) if far is not None else "",
            "remote_python": far.remote_python if far is not None else sys.executable}
    runtime = fresh_runtime()
    try:
        with open(run_dir / "parsl.log", "w") as out:
            argv = [sys.executable, "-c", PARSL_CHILD, json.dumps(spec), json.dumps([str(BENCH), str(ROOT)])]
            done = subprocess.run(argv, cwd=run_dir, env=run_environment(runtime), stdout=subprocess.PIPE, stderr=out,
                                  stdin=subprocess.DEVNULL, text=True, timeout=RUN_TIMEOUT_S)
    finally:
        left = end_processes_mentioning(runtime, run_dir)
        shutil.rmtree(runtime, ignore_errors=True)
    result = next((json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if done.returncode != 0 or result is None:
        tail = " | ".join((run_dir / "parsl.log").read_text(errors="replace").strip().splitlines()[-4:])
        return Run(variant.name, round_, None, f"exited {done.returncode}: {tail}")
    counts = result["counts"] | ({"processes_left": left} if left else {})
    problem = check_outputs(tree, args.jobs, args.inputs)
    return Run(variant.name, round_, None if problem else result["seconds"], problem, counts)


def parsl_variants(far0: Far, far40: Far | None, rtt: str) -> list[Variant]:
    found = [Variant("local", "the same apps on local files, no staging (the floor)"),
             Variant("pallet-ssh", "PalletStaging over ssh loopback", "pallet", far0)]
    if far40 is not None:
        found.append(Variant("pallet-ssh-40ms", f"PalletStaging over ssh, emulated {rtt}", "pallet", far40))
    return found


# ---------------------------------------------------------------- running and reporting

def measure(kind: str, variants: list[Variant], once, work: Path, args: argparse.Namespace, save) -> None:
    """``args.repeat`` rounds; in each, every variant once, the order reversed every other round; ``save()`` after
    each run (the numbers so far survive an interrupted benchmark)."""
    for round_ in range(args.repeat):
        for variant in variants if round_ % 2 == 0 else list(reversed(variants)):
            run_dir = work / kind / f"{variant.name}-{round_}"
            run_dir.mkdir(parents=True)
            waited = wait_for_idle(args.idle_wait) if args.idle_wait else 0.0
            print(f"  [{kind}] round {round_ + 1}/{args.repeat}: {variant.name} ...", end=" ", flush=True)
            busy, own, started = machine_busy_seconds(), _children_cpu(), time.perf_counter()
            run = once(variant, run_dir, args, round_)
            wall = time.perf_counter() - started
            run.machine_cpus = round((machine_busy_seconds() - busy) / wall, 2)
            run.own_cpus = round((_children_cpu() - own) / wall, 2)
            variant.runs.append(run)
            save()
            print(f"{run.seconds:.1f} s" if run.seconds is not None else f"FAILED: {run.error}",
                  f"(busy CPUs: machine {run.machine_cpus:.2f}, this run's waited-for processes {run.own_cpus:.2f}"
                  f"{f'; idle wait {waited:.0f} s' if args.idle_wait else ''})", flush=True)
            if run.seconds is not None and not args.keep_trees:
                shutil.rmtree(run_dir / "tree", ignore_errors=True)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def targets(variants: list[Variant], wanted) -> list[Target]:
    by_name = {v.name: v for v in variants}
    found = []
    for top, bottom, limit in wanted:
        if top in by_name and bottom in by_name:
            a, b = by_name[top].median, by_name[bottom].median
            found.append(Target(f"{top} / {bottom}", a / b if a is not None and b else None, limit))
    return found


def report(kind: str, title: str, variants: list[Variant], found: list[Target]) -> None:
    floor = next((v.median for v in variants if v.name == "local"), None)
    print(f"\n{title}")
    print(f"  {'variant':16s} {'median s':>9s} {'above floor':>12s}  runs (s)          what")
    for v in variants:
        above = f"{v.median - floor:12.1f}" if v.median is not None and floor is not None else f"{'-':>12s}"
        median = f"{v.median:9.1f}" if v.median is not None else f"{'-':>9s}"
        runs = " ".join(f"{s:.1f}" for s in v.seconds) or "-"
        print(f"  {v.name:16s} {median} {above}  {runs:17s} {v.what}")
        for error in dict.fromkeys(r.error for r in v.runs if r.error):
            print(f"  {'':16s} error: {error}")
    for target in found:
        value = f"{target.value:.2f}" if target.value is not None else "-"
        print(f"  ratio {target.name:30s} {value:>6s}  (target <= {target.limit:g}: {target.verdict})")
    for v in variants:
        for run in v.runs:
            if run.counts:
                print(f"  {kind} {v.name} round {run.round + 1}: {describe_counts(run.counts)}")


def _terminated(*_) -> None:
    print("\nSIGTERM: stopping; the numbers so far are in --json FILE", flush=True)
    sys.exit(143)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", nargs="?", choices=("snakemake", "parsl", "all"), default="all",
                        help="which workflow engine (default: both)")
    parser.add_argument("--jobs", type=int, help="Snakemake jobs / Parsl apps (default 200 / 500)")
    parser.add_argument("--inputs", type=int, default=10, help="remote inputs per job (default 10)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds, variants interleaved (default 1)")
    parser.add_argument("--cores", type=int, default=2, help="snakemake --cores, HTEX workers (default 2)")
    parser.add_argument("--rule", choices=tuple(RULE_BODY), default="shell",
                        help="the Snakemake job: a shell command (default), or a Python run: block, which "
                             "Snakemake 9 runs in a new snakemake process per job")
    parser.add_argument("--pallet-args", default="", metavar="ARGS",
                        help="more snakemake arguments for the pallet runs, one string split like a shell line, "
                             "e.g. '--storage-pallet-prefetch-budget 1' (one byte: nothing is prefetched)")
    parser.add_argument("--only",
                        type=lambda text: text.split(","), metavar="NAME[,NAME...]",
                        help="run only these variants (e.g. local,pallet-ssh); ratios need both of their sides")
    parser.add_argument("--only-loopback", action="store_true", help="skip the emulated link (needs no root)")
    parser.add_argument("--rtt-ms", type=float, default=40.0, help="round trip of the emulated link (default 40)")
    parser.add_argument("--rate", default="1gbit", help="tbf rate cap of the emulated link (default 1gbit)")
    parser.add_argument("--keep-home", action="store_true",
                        help="ssh sessions keep the account's HOME and rc files (default: an empty HOME)")
    parser.add_argument("--idle-wait", type=float, default=0.0, metavar="S",
                        help="before each run, wait up to S seconds for a quiet second on the machine (default 0)")
    parser.add_argument("--keep-trees", action="store_true", help="keep every run's tree (default: failed runs')")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "pallet-bench",
                        help="runs are written below it (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="write every run's numbers to FILE")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)                    # so that the link is torn down
    args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="workflow-", dir=args.workdir))
    os.environ["XDG_CONFIG_HOME"] = str(work / "config")            # profiles and probe findings of this run only
    kinds = ("snakemake", "parsl") if args.what == "all" else (args.what,)
    jobs_asked = args.jobs
    print(f"pallet {code_version()}; {', '.join(kinds)}; {args.inputs} inputs of {INPUT_BYTES} B per job; "
          f"{args.repeat} round(s); --cores {args.cores}; work in {work}", flush=True)
    doc: dict = {"commit": code_version(), "inputs": args.inputs, "input_bytes": INPUT_BYTES, "repeat": args.repeat,
                 "cores": args.cores, "rule": args.rule, "link": None, "results": {}}
    verdicts: list[Target] = []
    started = time.monotonic()
    doc["load_average_at_start"] = os.getloadavg()
    try:
        with ExitStack() as stack:
            far0 = stack.enter_context(loopback(work / "loopback", args.keep_home))
            far40, rtt = None, ""
            if not args.only_loopback:
                spec = LinkSpec(args.rtt_ms, args.rate)
                if os.geteuid() != 0 or missing_tools():
                    print(f"skipping the emulated link: needs root and {', '.join(missing_tools()) or 'its tools'}")
                else:
                    (work / "wan").mkdir()
                    try:
                        far40, measured = stack.enter_context(namespace(work / "wan", spec, args.keep_home))
                    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                        doc["link_error"] = str(exc)
                        print(f"skipping the emulated link, which could not be set up: {exc}", flush=True)
                    else:
                        rtt = spec.label
                        doc["link"] = f"{spec.label}: {measured}"
                        print(f"emulated link {spec.label}: {measured}", flush=True)
            for kind in kinds:
                args.jobs = jobs_asked or (200 if kind == "snakemake" else 500)
                if kind == "snakemake":
                    variants, once, wanted = snakemake_variants(far0, far40, rtt), snakemake_once, SNAKEMAKE_TARGETS
                    title = (f"Snakemake: {args.jobs} jobs ({args.rule}), {args.inputs} remote inputs and 1 remote "
                             f"output each, --cores {args.cores}; wall seconds of the whole snakemake run")
                else:
                    variants, once, wanted = parsl_variants(far0, far40, rtt), parsl_once, PARSL_TARGETS
                    title = (f"Parsl: {args.jobs} apps on a HighThroughputExecutor ({args.cores} workers), "
                             f"{args.inputs} inputs and 1 output each; seconds from the first submission to the "
                             f"last output arrived")
                if args.only:
                    variants = [v for v in variants if v.name in args.only]
                print(f"\n== {kind}: {args.jobs} jobs", flush=True)

                def save(kind=kind, title=title, variants=variants, wanted=wanted) -> list[Target]:
                    found = targets(variants, wanted)
                    doc["results"][kind] = {"jobs": args.jobs, "title": title,
                                            "variants": [{"name": v.name, "what": v.what, "median": v.median,
                                                          "runs": [asdict(r) for r in v.runs]} for v in variants],
                                            "targets": [t.to_json() for t in found]}
                    if args.json:
                        Path(args.json).write_text(json.dumps(doc, indent=2))
                    return found
                measure(kind, variants, once, work, args, save)
                found = save()
                verdicts += found
                report(kind, title, variants, found)
    finally:                    # the sshd and the link are gone: what still names the work directory is ours
        if left := end_processes_mentioning(work):
            print(f"stopped processes left below {work}: {left}")

    doc["total_seconds"] = round(time.monotonic() - started, 1)
    doc["load_average_at_end"] = os.getloadavg()
    print(f"\nwhole benchmark: {doc['total_seconds']:.0f} s; load average (1, 5, 15 min) at the start "
          f"{' '.join(f'{x:.2f}' for x in doc['load_average_at_start'])}, at the end "
          f"{' '.join(f'{x:.2f}' for x in doc['load_average_at_end'])}; logs of every run are in {work}")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"raw numbers written to {args.json}")
    return 0 if all(t.verdict == "PASS" for t in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
