"""A real Snakemake workflow of many small jobs over ssh: one prefetch, inline stores, grouped stores, a rerun."""
from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from tests.programs import program, user_env

JOBS, INPUTS, GROUP = 50, 10, 10

SNAKEFILE = """\
STORE = storage.pallet
JOBS, INPUTS = int(config["jobs"]), int(config["inputs"])
FAIL = str(config.get("fail", ""))

rule all:
    input: STORE(expand(config["prefix"] + "/out/o{n}.txt", n=range(JOBS)))

rule make:
    input: lambda w: STORE([config["prefix"] + f"/in/j{w.n}/i{k}.txt" for k in range(INPUTS)])
    output: STORE(config["prefix"] + "/out/o{n}.txt")
    group: "g"
    params: fail=lambda w: "yes" if str(w.n) == FAIL else ""
    shell: 'test -z "{params.fail}" && cat {input} | wc -c > {output}'
"""


def test_the_prefetch_budget_takes_sizes_and_zero():
    from snakemake_storage_plugin_pallet.settings import StorageProviderSettings
    parse = next(f for f in fields(StorageProviderSettings) if f.name == "prefetch_budget").metadata["type"]
    assert (parse("0"), parse("500M"), parse("1G")) == (0, 500 << 20, 1 << 30)


def remote_inputs(root: Path) -> dict[int, int]:
    """The inputs of each job below ``root``/in; the bytes each job reads."""
    sizes = {}
    for job in range(JOBS):
        directory = root / "in" / f"j{job}"
        directory.mkdir(parents=True)
        for k in range(INPUTS):
            (directory / f"i{k}.txt").write_text(f"{job}-{k}\n" * (1 + job % 3))
        sizes[job] = sum(p.stat().st_size for p in directory.iterdir())
    return sizes


def run(workdir: Path, sshd, remote: Path, *extra: str, config: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    workdir.mkdir(exist_ok=True)
    (workdir / "Snakefile").write_text(SNAKEFILE)
    argv = [program("snakemake"), "--cores", "2", "--storage-pallet-ssh-options", shlex.join(sshd.ssh_options),
            "--storage-pallet-remote-python", sys.executable, "--config", f"prefix={sshd.url(str(remote))}",
            f"jobs={JOBS}", f"inputs={INPUTS}", *config, *extra]
    return subprocess.run(argv, cwd=workdir, env=user_env(), capture_output=True, text=True, timeout=280,
                          stdin=subprocess.DEVNULL)


def operations(log: str, verb: str) -> list[str]:
    """The plugin's log lines of finished operations: ``fetched`` or ``sent``."""
    return [line for line in log.splitlines() if line.startswith(f"pallet: {verb} ")]


def assert_outputs(remote: Path, sizes: dict[int, int]) -> None:
    for job, size in sizes.items():
        assert (remote / "out" / f"o{job}.txt").read_text().strip() == str(size), job
    assert sorted(p.name for p in (remote / "out").iterdir()) == sorted(f"o{job}.txt" for job in sizes)


@pytest.mark.timeout(600)
def test_fifty_local_jobs_one_prefetch_inline_stores_and_a_rerun_after_a_failure(sshd, tmp_path):
    remote = tmp_path / "remote"
    sizes = remote_inputs(remote)
    failed = run(tmp_path / "wf", sshd, remote, config=("fail=25",))
    assert failed.returncode != 0 and "Error in rule make" in failed.stderr, failed.stderr[-3000:]
    assert not (remote / "out" / "o25.txt").exists()
    log = failed.stderr
    # One prefetch: the first retrieval brought every input the DAG names, in one operation.
    assert log.count("pallet: prefetching") == 1, log[-3000:]
    fetched = operations(log, "fetched")
    assert len(fetched) == 1 and f"fetched {JOBS * INPUTS} object(s)" in fetched[0], fetched
    # A local job's output is stored as it ends (Snakemake stores them in turn): one inline request each.
    sent = operations(log, "sent")
    assert sent and all(": inline, 1 transfer(s)" in line for line in sent), sent
    rerun = run(tmp_path / "wf", sshd, remote)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert_outputs(remote, sizes)
    assert not list(remote.rglob(".pallet*")) and not list(remote.rglob("*.pallet-*"))


@pytest.mark.timeout(600)
def test_fifty_jobs_in_groups_store_fewer_operations_than_jobs(sshd, tmp_path):
    """Group jobs (the cluster-generic executor; the job scripts run here, on a shared file system): Snakemake
    stores a group's outputs at once at its end, and the plugin sends them as one operation. (The main process
    also stores, at the workflow's end, every output its jobs made, level by level: a few operations more.)"""
    pytest.importorskip("snakemake_executor_plugin_cluster_generic")
    remote, logs, submit = tmp_path / "remote", tmp_path / "job-logs", tmp_path / "submit.sh"
    sizes = remote_inputs(remote)
    logs.mkdir()
    submit.write_text(f'#!/bin/sh\nsh "$1" >"{logs}/$(basename "$1").log" 2>&1 </dev/null &\necho "local-$!"\n')
    submit.chmod(0o755)
    done = run(tmp_path / "wf", sshd, remote, "--executor", "cluster-generic", "--jobs", "2",
               "--cluster-generic-submit-cmd", str(submit), "--seconds-between-status-checks", "1",
               "--group-components", f"g={GROUP}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_outputs(remote, sizes)
    jobs_log = "".join(p.read_text() for p in logs.iterdir())
    log = done.stderr + jobs_log
    assert log.count("pallet: prefetching") == 1, log[-3000:]
    assert len(operations(log, "fetched")) == 1, operations(log, "fetched")
    in_jobs = operations(jobs_log, "sent")         # each group job stores its outputs together, at its end
    assert len(in_jobs) == JOBS // GROUP and all(f"sent {GROUP} object(s)" in line for line in in_jobs), in_jobs
    assert len(operations(log, "sent")) < JOBS      # with the main process's closing store of what it ran
