"""The Snakemake storage plugin: the interface's conformance suite, batching in process, and real snakemake runs."""
from __future__ import annotations

import asyncio
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("snakemake")
from snakemake_interface_common.exceptions import WorkflowError  # noqa: E402
from snakemake_interface_storage_plugins.tests import TestStorageBase  # noqa: E402

from snakemake_storage_plugin_pallet import StorageProvider, StorageProviderSettings  # noqa: E402
from staging_core.testing import snapshot  # noqa: E402
from tests.programs import program, user_env  # noqa: E402
from tests.servers import count_invocations, count_transfers, start_sshd  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "snakemake" / "Snakefile"
T0 = 1_600_000_000_123_456_789


def ssh_settings(sshd, **extra) -> StorageProviderSettings:
    return StorageProviderSettings(ssh_options=shlex.join(sshd.ssh_options), remote_python=sys.executable, **extra)


def make_inputs(directory: Path, count: int) -> Path:
    """s00000.csv ... holding ``n,3n``, with distinct sub-second mtimes."""
    directory.mkdir(parents=True, exist_ok=True)
    for n in range(count):
        path = directory / f"s{n:05d}.csv"
        path.write_text(f"{n},{3 * n}\n")
        os.utime(path, ns=(T0, T0 + n * 1_000_001))
    return directory


# ---------------------------------------------------------------- the interface's conformance suite

class _Conformance(TestStorageBase):
    __test__ = False

    def get_storage_provider_cls(self):
        return StorageProvider

    def get_query(self, tmp_path) -> str:
        return self.url(tmp_path / "remote" / "data" / "object")

    def get_query_not_existing(self, tmp_path) -> str:
        return self.url(tmp_path / "remote" / "nowhere" / "object.csv")


class _Local(_Conformance):
    def url(self, path: Path) -> str:
        return f"file://{path}"


class _SSH(_Conformance):
    @pytest.fixture(autouse=True)
    def _server(self, sshd):
        self.sshd = sshd

    def url(self, path: Path) -> str:
        return self.sshd.url(str(path))

    def get_storage_provider_settings(self):
        return ssh_settings(self.sshd)


class TestLocalFiles(_Local):
    __test__ = True
    files_only = True


class TestLocalFilesAndDirectories(_Local):
    __test__ = True
    files_only = False


class TestSSHFiles(_SSH):
    __test__ = True
    files_only = True


class TestSSHFilesAndDirectories(_SSH):
    __test__ = True
    files_only = False


# ---------------------------------------------------------------- queries

@pytest.mark.parametrize("query", [
    "ssh://login.hpc/proj/data/{sample}.csv", "me@login.hpc:/proj/{sample}/x.csv", "ssh://u@h:2222/d/",
    "gsiftp://gridftp.example.org:2811/scratch/{s}.csv", "ftp://h/pub/x", "file:///scratch/{sample}.csv",
    "globus://6c54cade-bde5-45c1-bdea-f4bd71dba2cc/p/{s}.csv", "ssh://{host}/d/x.csv", "ssh://h:{port}/d/x",
])
def test_valid_queries(query):
    assert StorageProvider.is_valid_query(query)


@pytest.mark.parametrize("query, reason", [
    ("data/{sample}.csv", "not a pallet URL"), ("/abs/x.csv", "file:///abs/x.csv"),
    ("s3://bucket/x", "unknown URL scheme"), ("host:relative/x", "must be absolute"),
    ("file://host/x", "no host"), ("ssh://h/", "root directory"), ("ssh://u:secret@h/x", "passwords"),
])
def test_invalid_queries_say_why(query, reason):
    result = StorageProvider.is_valid_query(query)
    assert not result and reason in str(result)


# ---------------------------------------------------------------- batching, in process

def provider(tmp_path: Path, settings: StorageProviderSettings | None = None) -> StorageProvider:
    return StorageProvider(local_prefix=tmp_path / "local", logger=logging.getLogger("pallet-test"),
                           settings=settings or StorageProviderSettings())


async def in_one_round(method: str, objects) -> None:
    async with asyncio.TaskGroup() as group:
        for obj in objects:
            group.create_task(getattr(obj, method)())


def inline_operations(log: str) -> int:
    """The operations the plugin's log reports as moved inline over a host session (no process of their own)."""
    return log.count(": inline, 1 transfer(s)")


def test_a_round_of_retrievals_is_one_transfer_and_keeps_remote_mtimes(sshd, tmp_path, monkeypatch, caplog):
    data = make_inputs(tmp_path / "remote" / "data", 300)
    transfers = count_transfers(tmp_path / "shim", monkeypatch)
    storage = provider(tmp_path, ssh_settings(sshd))
    objects = [storage.object(sshd.url(str(data / f"s{n:05d}.csv"))) for n in range(300)]
    assert all(obj.exists() for obj in objects)
    with caplog.at_level(logging.INFO, logger="pallet-test"):
        asyncio.run(in_one_round("managed_retrieve", objects))
    log = "\n".join(record.getMessage() for record in caplog.records)
    assert log.count("pallet: fetched 300 object(s)") == 1, log
    assert len(transfers()) + inline_operations(log) == 1, (transfers(), log)   # one operation moved them all
    for n, obj in enumerate(objects):
        local = obj.local_path()
        assert local.read_text() == f"{n},{3 * n}\n"
        assert local.stat().st_mtime_ns == T0 + n * 1_000_001
        assert obj.mtime() <= local.stat().st_mtime          # Snakemake will not fetch it again
    assert not [p for p in (tmp_path / "local").iterdir() if p.name.startswith(".pallet-")]


def test_a_round_of_stores_is_one_transfer(sshd, tmp_path, monkeypatch):
    storage = provider(tmp_path, ssh_settings(sshd, strategy="individual"))
    remote = tmp_path / "remote" / "results"
    objects = [storage.object(sshd.url(str(remote / f"r{n}.txt"))) for n in range(50)]
    for n, obj in enumerate(objects):
        obj.local_path().parent.mkdir(parents=True, exist_ok=True)
        obj.local_path().write_text(f"result {n}\n")
    assert not objects[0].exists()
    rsync_calls = count_invocations(tmp_path / "shim", "rsync", monkeypatch)
    asyncio.run(in_one_round("managed_store", objects))
    assert len(rsync_calls()) == 1
    assert sorted(p.name for p in remote.iterdir()) == sorted(f"r{n}.txt" for n in range(50))     # no .pallet
    assert all(obj.exists() for obj in objects)              # this process wrote them: asked afresh


def test_batch_caps_split_a_round(tmp_path, caplog):
    data = make_inputs(tmp_path / "remote" / "data", 250)
    storage = provider(tmp_path, StorageProviderSettings(batch_max_files=100))
    objects = [storage.object(f"file://{data}/s{n:05d}.csv") for n in range(250)]
    with caplog.at_level(logging.INFO, logger="pallet-test"):
        asyncio.run(in_one_round("managed_retrieve", objects))
    fetched = sorted(int(r.getMessage().split()[2]) for r in caplog.records if "pallet: fetched" in r.getMessage())
    assert fetched == [50, 100, 100]
    assert all(obj.local_path().read_text() == f"{n},{3 * n}\n" for n, obj in enumerate(objects))


def test_a_failed_batch_names_the_files_and_leaves_nothing(tmp_path):
    data = make_inputs(tmp_path / "remote" / "data", 5)
    storage = provider(tmp_path)
    objects = [storage.object(f"file://{data}/s{n:05d}.csv") for n in range(5)]
    assert all(obj.exists() for obj in objects)
    (data / "s00003.csv").unlink()                           # gone after the listing, before the fetch
    with pytest.raises(ExceptionGroup) as caught:
        asyncio.run(in_one_round("managed_retrieve", objects))
    error = caught.value.exceptions[0]
    assert isinstance(error, WorkflowError) and "s00003.csv" in str(error) and f"file://{data}/" in str(error)
    assert not any(obj.local_path().exists() for obj in objects)
    assert not [p for p in (tmp_path / "local").iterdir() if p.name.startswith(".pallet-")]


def test_an_unreachable_host_is_named(tmp_path):
    storage = provider(tmp_path)
    obj = storage.object("ssh://127.0.0.1:1/data/x.csv")
    with pytest.raises(WorkflowError, match=r"ssh://127.0.0.1:1/data/x.csv.*host unreachable"):
        obj.exists()


# ---------------------------------------------------------------- real snakemake runs

def snakemake(workdir: Path, *args: str, snakefile: Path = EXAMPLE,
              timeout: float = 240) -> subprocess.CompletedProcess:
    """Run the installed snakemake in a user's environment: it must find the plugin by itself."""
    workdir.mkdir(parents=True, exist_ok=True)
    return subprocess.run([program("snakemake"), "--snakefile", str(snakefile), "--cores", "4", *args],
                          cwd=workdir, env=user_env(), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def storage_flags(sshd) -> list[str]:
    return ["--storage-pallet-ssh-options", shlex.join(sshd.ssh_options),
            "--storage-pallet-remote-python", sys.executable]


def test_workflow_with_2000_remote_inputs_over_ssh(sshd, tmp_path, monkeypatch):
    data = make_inputs(tmp_path / "remote" / "data", 2000)
    transfers = count_transfers(tmp_path / "shim", monkeypatch)
    args = [*storage_flags(sshd), "--config", f"data={sshd.url(str(data))}", "samples=2000", "parts=4"]
    first = snakemake(tmp_path / "wf", *args)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "wf" / "results" / "summary.txt").read_text() == f"2000 {3 * 2000 * 1999 // 2}\n"
    operations = len(transfers()) + inline_operations(first.stderr)
    assert operations == 1, (transfers(), first.stderr[-3000:])  # 4 jobs, 2,000 inputs, one round: one operation
    assert "pallet: fetched 2000 object(s)" in first.stderr
    again = snakemake(tmp_path / "wf", *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Nothing to be done" in again.stderr
    assert len(transfers()) + inline_operations(again.stderr) == 0    # nothing fetched again


def remote_jobs(sshd, tmp_path: Path, data: Path, *flags: str) -> tuple[subprocess.CompletedProcess, Path]:
    """Run the example (120 inputs, 2 part jobs) with the cluster-generic executor and no shared file system:
    each job script runs here in the background, as on a compute node, retrieves its own inputs into
    tmp_path/node-scratch and stores its output to tmp_path/remote/wf. Returns the run and the jobs' log
    directory."""
    pytest.importorskip("snakemake_executor_plugin_cluster_generic")
    logs, submit = tmp_path / "job-logs", tmp_path / "submit.sh"
    logs.mkdir()
    submit.write_text(f'#!/bin/sh\n# runs the job script here in the background, as a compute node would\n'
                      f'sh "$1" >"{logs}/$(basename "$1").log" 2>&1 </dev/null &\necho "local-$!"\n')
    submit.chmod(0o755)
    done = snakemake(tmp_path / "wf", *storage_flags(sshd), *flags, "--config", f"data={sshd.url(str(data))}",
                     "samples=120", "parts=2", "--executor", "cluster-generic", "--jobs", "2",
                     "--cluster-generic-submit-cmd", str(submit), "--seconds-between-status-checks", "1",
                     "--default-storage-provider", "pallet",
                     "--default-storage-prefix", sshd.url(str(tmp_path / "remote" / "wf")),
                     "--shared-fs-usage", "persistence", "software-deployment", "sources", "source-cache",
                     "--remote-job-local-storage-prefix", str(tmp_path / "node-scratch"))
    return done, logs


def test_remote_job_mode_with_cluster_generic(sshd, tmp_path):
    data = make_inputs(tmp_path / "remote" / "data", 120)
    done, logs = remote_jobs(sshd, tmp_path, data)
    scratch = tmp_path / "node-scratch"
    assert done.returncode == 0, done.stderr[-3000:]
    stored = tmp_path / "remote" / "wf" / "results"
    assert (stored / "summary.txt").read_text() == f"120 {3 * 120 * 119 // 2}\n"
    assert (stored / "part0.txt").read_text() == f"60 {sum(3 * n for n in range(0, 120, 2))}\n"
    job_output = "".join(p.read_text() for p in logs.iterdir())
    assert job_output.count("pallet: fetched 60 object(s)") == 2          # each part job fetched its own inputs
    assert scratch.is_dir() and not any(p.is_file() for p in (tmp_path / "wf" / ".snakemake" / "storage").rglob("*"))


TWO_HOSTS = """
rule all:
    input:
        a=[storage.pallet(f"{a}/a{n:03d}.csv") for n in range(40)],
        b=[storage.pallet(f"{b}/b{n:03d}.csv") for n in range(40)],
    output: "both.txt"
    run:
        with open(output[0], "w") as out:
            for path in [*input.a, *input.b]:
                with open(path) as handle:
                    out.write(handle.read())
"""


def test_inputs_from_two_hosts_in_one_round_are_fetched_at_the_same_time(sshd, tmp_path):
    second = start_sshd(tmp_path / "sshd2")
    try:
        # one client key for both servers, so that one --storage-pallet-ssh-options reaches both
        (tmp_path / "sshd2" / "authorized_keys").write_text(Path(str(sshd.key) + ".pub").read_text())
        roots = {}
        for name, server in (("a", sshd), ("b", second)):
            (tmp_path / name).mkdir()
            for n in range(40):
                (tmp_path / name / f"{name}{n:03d}.csv").write_text(f"{name},{n}\n")
            roots[name] = server.url(str(tmp_path / name))
        (tmp_path / "Snakefile").write_text(TWO_HOSTS.replace("{a}", roots["a"]).replace("{b}", roots["b"]))
        done = snakemake(tmp_path / "wf", *storage_flags(sshd), "--storage-pallet-strategy", "bundle",
                         snakefile=tmp_path / "Snakefile", timeout=180)
    finally:
        second.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    expected = "".join(f"{name},{n}\n" for name in "ab" for n in range(40))
    assert (tmp_path / "wf" / "both.txt").read_text() == expected
    events = [line.split(" object(s)")[0].split("pallet: ")[1] for line in done.stderr.splitlines()
              if "pallet: fetch" in line]
    assert events[:2] == ["fetching 40", "fetching 40"], events      # both started before either finished
    assert events[2:] == ["fetched 40", "fetched 40"], events


TAGGED = """
import os

storage remote:
    provider="pallet",
    strategy="individual",

rule all:
    input: "count.txt"

rule make:
    output: storage.remote(directory("file://{out}/tree"))
    run:
        os.makedirs(f"{output[0]}/sub")
        for n in range(5):
            with open(f"{output[0]}/sub/f{n}.txt", "w") as f:
                f.write(str(n))

rule count:
    input: storage.remote("file://{out}/tree")
    output: "count.txt"
    run:
        with open(output[0], "w") as f:
            f.write(str(sum(len(names) for _, _, names in os.walk(input[0]))))
"""


def test_tagged_provider_stores_and_retrieves_a_directory(tmp_path):
    (tmp_path / "Snakefile").write_text(TAGGED.replace("{out}", str(tmp_path / "remote")))
    made = snakemake(tmp_path / "wf", "make", snakefile=tmp_path / "Snakefile", timeout=120)
    assert made.returncode == 0, made.stderr[-3000:]
    tree = tmp_path / "remote" / "tree"
    assert sorted(p.name for p in (tree / "sub").iterdir()) == [f"f{n}.txt" for n in range(5)]
    counted = snakemake(tmp_path / "wf", snakefile=tmp_path / "Snakefile", timeout=120)
    assert counted.returncode == 0, counted.stderr[-3000:]
    assert "pallet: fetched 1 object(s) (6 files" in counted.stderr        # the tree and its timestamp file
    assert (tmp_path / "wf" / "count.txt").read_text() == "6"


BAD = """
rule all:
    input: storage.pallet("{query}")
    output: "out.txt"
    shell: "cp {{input}} {{output}}"
"""


@pytest.mark.parametrize("query, message", [
    ("relative/data.csv", "is invalid: not a pallet URL"),
    ("ssh://127.0.0.1:1/data/x.csv", "host unreachable"),
    ("file://{data}/missing.csv", "Missing input files"),
])
def test_bad_inputs_fail_clearly_naming_the_file(tmp_path, query, message):
    data = make_inputs(tmp_path / "remote", 2)
    query = query.format(data=data)
    (tmp_path / "Snakefile").write_text(BAD.replace("{query}", query))
    done = snakemake(tmp_path / "wf", snakefile=tmp_path / "Snakefile", timeout=120)
    assert done.returncode != 0
    named = query.removeprefix("file://")
    assert message in done.stderr and named in done.stderr, done.stderr[-3000:]
    assert not any(p.is_file() for p in (tmp_path / "wf" / ".snakemake" / "storage").rglob("*"))


ON_DEMAND = """
rule all:
    input: "linked.txt", "copied.txt"

rule linked:
    input: access.sequential(storage.pallet("file://{data}/s00000.csv"))
    output: "linked.txt"
    run:
        with open(output[0], "w") as f:
            f.write(f"{os.path.islink(input[0])} {os.path.realpath(input[0])} {open(input[0]).read()}")

rule copied:
    input: storage.pallet("file://{data}/s00001.csv")
    output: "copied.txt"
    run:
        with open(output[0], "w") as f:
            f.write(f"{os.path.islink(input[0])} {os.path.realpath(input[0])} {open(input[0]).read()}")
"""


@pytest.mark.parametrize("flags, linked", [((), True), (("--storage-pallet-no-ondemand-links",), False)])
def test_an_on_demand_eligible_file_input_is_linked_in_place(tmp_path, flags, linked):
    data = make_inputs(tmp_path / "remote", 2)
    before = snapshot(data)
    (tmp_path / "Snakefile").write_text("import os\n" + ON_DEMAND.replace("{data}", str(data)))
    done = snakemake(tmp_path / "wf", *flags, snakefile=tmp_path / "Snakefile", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    is_link, path, text = (tmp_path / "wf" / "linked.txt").read_text().split(" ", 2)
    assert (is_link, path == str(data / "s00000.csv")) == (str(linked), linked)
    assert text == (data / "s00000.csv").read_text()
    is_link, path, text = (tmp_path / "wf" / "copied.txt").read_text().split(" ", 2)
    assert is_link == "False" and text == (data / "s00001.csv").read_text()       # not annotated: copied
    assert snapshot(data) == before                        # Snakemake removed its local copies, never the source
    assert not any(p.is_file() or p.is_symlink() for p in (tmp_path / "wf" / ".snakemake" / "storage").rglob("*"))
