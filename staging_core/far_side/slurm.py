"""Slurm batch jobs for unpacks: the sbatch script pallet writes, its submission, and waiting for its end."""
from __future__ import annotations

import os
import posixpath
import shlex
import sys
import time
from contextlib import suppress
from dataclasses import dataclass
from collections.abc import Callable

from bundles.errors import PalletError, UsageError

from staging_core.options import StagingOptions
from staging_core.transports.errors import MissingDependencyError, TransportError

SCRIPT_NAME = "unpack.sbatch"
# Every state but these ends the job; COMPLETED is the only good end (squeue/sacct state names).
ACTIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_FED",
                           "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD",
                           "POWER_UP_NODE"})
UNKNOWN_POLLS = 5             # consecutive polls that find the job nowhere before pallet gives up

Runner = Callable[[list[str]], bytes]


class SlurmJobError(PalletError):
    """A Slurm job pallet submitted was refused, failed, was cancelled or vanished; ``job_id``, ``state`` say which."""

    def __init__(self, message: str, path=None, hint=None, job_id: str | None = None, state: str | None = None):
        super().__init__(message, path, hint)
        self.job_id, self.state = job_id, state


@dataclass(frozen=True)
class UnpackJob:
    """One unpack job in the destination's path space: ``bundle`` is unpacked into ``dest``; the script
    (``unpack.sbatch``) and the job's output files (``unpack-JOBID.out``/``.err``) sit beside the bundle."""

    bundle: str
    dest: str

    @property
    def script(self) -> str:
        return posixpath.join(posixpath.dirname(self.bundle), SCRIPT_NAME)

    def output(self, job_id: str = "%j", stream: str = "out") -> str:
        """The job's stdout (``stream='out'``) or stderr (``'err'``) file; ``%j`` is sbatch's job id pattern."""
        return posixpath.join(posixpath.dirname(self.bundle), f"unpack-{job_id}.{stream}")


@dataclass(frozen=True)
class Poll:
    """How often to ask Slurm: ``first`` seconds after submitting, then ``factor`` times longer, at most ``longest``."""

    first: float = 1.0
    factor: float = 1.5
    longest: float = 30.0


def job_resources(options: StagingOptions) -> list[str]:
    """The sbatch options sizing the job: the launcher's task count (``srun -n 64`` → ``--ntasks=64``); without a
    launcher one task with ``--ranks`` CPUs, or a whole node (``--exclusive``) when ranks is 0 (one worker per CPU)."""
    if options.launcher:
        tasks = launcher_tasks(options.launcher)
        return [f"--ntasks={tasks}"] if tasks else []
    if options.ranks:
        return ["--ntasks=1", f"--cpus-per-task={options.ranks}"]
    return ["--nodes=1", "--exclusive"]


def launcher_tasks(launcher: str) -> int | None:
    """The task count a launcher command asks for (``-n N``, ``-nN``, ``-np N``, ``--ntasks[=]N``), or None."""
    words = shlex.split(launcher)
    for n, word in enumerate(words):
        value = None
        if word in ("-n", "-np", "--np", "--ntasks") and n + 1 < len(words):
            value = words[n + 1]
        elif word.startswith("--ntasks="):
            value = word.partition("=")[2]
        elif word.startswith("-n") and word[2:].isdigit():
            value = word[2:]
        if value and value.isdigit():
            return int(value)
    return None


def batch_script(job: UnpackJob, unpack_command: list[str], options: StagingOptions) -> str:
    """The sbatch script running ``unpack_command`` (the mpi_stager unpack; it starts with the launcher when
    ``options.launcher`` is set, else ``srun`` is put in front).

    ``#SBATCH`` lines: the job name, output and error files beside the
    bundle, :func:`job_resources`, then ``options.job_options`` verbatim
    (later lines win, so they can override the sizing). The script exits
    with the unpack's status; running it again resumes the unpack. Raises
    UsageError for a path or option with a line break (it would end a
    ``#SBATCH`` line).
    """
    if any("\n" in text or "\r" in text for text in (job.bundle, job.dest, *options.job_options)):
        raise UsageError("cannot write a batch script for a path or --job-option with a line break", job.dest,
                         "rename the destination, or push without --unpack-job/--keep-packed")
    command = unpack_command if options.launcher else ["srun", *unpack_command]
    options_lines = ["--job-name=pallet-unpack", f"--output={shlex.quote(job.output())}",
                     f"--error={shlex.quote(job.output(stream='err'))}", *job_resources(options),
                     *options.job_options]
    return "\n".join([
        "#!/bin/bash",
        f"# pallet: unpack {job.bundle} into {job.dest}",
        f"# submit with: sbatch {shlex.quote(job.script)}   (a rerun after a failure resumes)",
        *(f"#SBATCH {line}" for line in options_lines),
        "set -euo pipefail",
        shlex.join(command), ""])


def write_script(directory: str, job: UnpackJob, unpack_command: list[str], options: StagingOptions) -> str:
    """Write :func:`batch_script` into local ``directory`` (to travel to ``job.script``); return its file name."""
    with open(os.path.join(directory, SCRIPT_NAME), "w") as handle:
        handle.write(batch_script(job, unpack_command, options))
    return SCRIPT_NAME


def submit(run: Runner, job: UnpackJob, where: str) -> str:
    """Submit ``job.script`` with ``sbatch --parsable`` through ``run`` (a command runner on ``where``); return
    the job id. Raises SlurmJobError if sbatch refuses it (retryable TransportErrors pass through)."""
    try:
        printed = run(["sbatch", "--parsable", job.script]).decode(errors="replace").strip()
    except TransportError as exc:
        if exc.retryable:
            raise
        raise SlurmJobError(f"sbatch refused the unpack job: {_last_line(exc.stderr)}", job.script,
                            f"check sbatch on {where} and the --job-option values; the script is {job.script}") \
            from exc
    job_id = printed.splitlines()[-1].split(";")[0] if printed else ""
    if not job_id.isdigit():
        raise SlurmJobError(f"sbatch printed no job id ({printed!r})", job.script, f"check sbatch on {where}")
    return job_id


def job_state(run: Runner, job_id: str) -> str | None:
    """The job's state from ``squeue -h -j ID -t all -o %T`` (jobs slurmctld still holds), else from
    ``sacct -n -X -P -j ID -o State`` (accounting), else None (not known, or the host did not answer).
    ``CANCELLED by 0`` reads as CANCELLED."""
    for argv in (["squeue", "-h", "-j", job_id, "-t", "all", "-o", "%T"],
                 ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"]):
        try:
            words = run(argv).decode(errors="replace").split()
        except (TransportError, MissingDependencyError):
            continue
        if words:
            return words[0].upper()
    return None


def wait(run: Runner, job_id: str, where: str, echo: Callable[[str], None], poll: Poll = Poll(),
         sleep: Callable[[float], None] = time.sleep) -> str:
    """Poll the job with backoff until it leaves the active states and return its final state, calling ``echo``
    with each new state.

    Raises SlurmJobError (never a retryable error: a retry would submit a
    second job) when ``UNKNOWN_POLLS`` polls in a row learn nothing. An
    interrupt cancels the job (``scancel``) before it propagates, so a
    rerun does not race a forgotten job.
    """
    delay, seen, unknown = poll.first, None, 0
    try:
        while True:
            state = job_state(run, job_id)
            unknown = unknown + 1 if state is None else 0
            if unknown >= UNKNOWN_POLLS:
                raise SlurmJobError(f"slurm job {job_id}: cannot tell its state (last seen: {seen or 'none'})",
                                    where, f"check `squeue -j {job_id}` or `sacct -j {job_id}` there; rerun once "
                                    "it has ended (finished shards are skipped)", job_id, seen)
            if state is not None and state != seen:
                echo(f"slurm job {job_id}: {state}")
                seen = state
            if state is not None and state not in ACTIVE_STATES:
                return state
            sleep(delay)
            delay = min(poll.longest, delay * poll.factor)
    except KeyboardInterrupt:
        with suppress(TransportError):
            run(["scancel", job_id])
        raise


def run_job(run: Runner, job: UnpackJob, where: str, echo: Callable[[str], None],
            poll: Poll = Poll()) -> tuple[str, bytes]:
    """Submit ``job`` (its script is already in place), wait for it, and return the job id and its stdout.

    Raises SlurmJobError naming the job id, its final state and the last
    line of its stderr when it ends in any state but COMPLETED.
    """
    job_id = submit(run, job, where)
    echo(f"slurm job {job_id} submitted on {where}: {job.script}")
    state = wait(run, job_id, where, echo, poll)
    if state != "COMPLETED":
        raise SlurmJobError(f"slurm job {job_id} ended {state}{_cause(run, job.output(job_id, 'err'))}", job.script,
                            f"see {job.output(job_id, 'err')} on {where}; fix the cause and rerun "
                            "(finished shards are skipped)", job_id, state)
    return job_id, run(["cat", "--", job.output(job_id)])


def _cause(run: Runner, errors: str) -> str:
    """The last line of the job's stderr that is not srun's own report, or ''."""
    try:
        text = run(["tail", "-n", "20", "--", errors]).decode(errors="replace")
    except (TransportError, MissingDependencyError):
        return ""                 # a job cancelled while pending wrote no output
    lines = [line for line in text.strip().splitlines() if line.strip()]
    ours = [line for line in lines if not line.startswith("srun: ")] or lines
    return f": {ours[-1][:300]}" if ours else ""


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1][:300] if lines else ""


def echo_for(progress: bool | None) -> Callable[[str], None]:
    """Print job states on stderr when progress is shown (``progress``, as StagingOptions; None: on a terminal)."""
    if not (sys.stderr.isatty() if progress is None else progress):
        return lambda line: None
    return lambda line: print(f"pallet: {line}", file=sys.stderr, flush=True)
