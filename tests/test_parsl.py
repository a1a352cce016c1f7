"""PalletStaging with real Parsl: thread, HTEX and MPI executors over ssh loopback, Globus through the stand-in."""
from __future__ import annotations

import glob
import os
import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import parsl
import pytest
from parsl import python_app
from parsl.config import Config
from parsl.data_provider.files import File
from parsl.dataflow.errors import DependencyError
from parsl.executors import HighThroughputExecutor, MPIExecutor, ThreadPoolExecutor
from parsl.launchers import SimpleLauncher
from parsl.providers import LocalProvider

from pallet_parsl import BatchError, PalletStaging
from staging_core.options import StagingOptions
from tests.docs import doc_block
from tests.programs import BIN
from tests.servers import count_transfers

WORKER_PATH = f"export PATH={BIN}:$PATH"       # interchange.py and process_worker_pool.py, as installed
# Ranks yield when idle: two ranks that spin on two cores beside other work (a busy machine) crawl otherwise.
MPI_ENV = ("export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 "
           "OMPI_MCA_mpi_yield_when_idle=1")
APPS = 5000          # the figure, kept: each executor's run takes well under a minute here

# The apps live in a namespace of their own named __main__, as in a user's workflow script: Parsl (dill) then
# ships them by value, so HTEX workers need nothing from this test tree on their path.
APP_SOURCE = """
import os


def read_text(inputs=()):
    with open(inputs[0]) as handle:
        return handle.read()


def size_of(inputs=()):
    return os.path.getsize(inputs[0])


def total_size(inputs=()):
    return sum(os.path.getsize(path) for path in inputs)


def write_text(text, outputs=()):
    if text == "fail":
        raise ValueError("this app fails on purpose")
    with open(outputs[0], "w") as handle:
        handle.write(text)
    return text
"""
APPS_NAMESPACE: dict = {"__name__": "__main__"}
exec(compile(APP_SOURCE, "<workflow apps>", "exec"), APPS_NAMESPACE)
read_text, size_of, total_size, write_text = (APPS_NAMESPACE[name]
                                              for name in ("read_text", "size_of", "total_size", "write_text"))


def remote_files(root, count: int, size: int = 0) -> list[str]:
    """``count`` files under ``root`` (the far side of the ssh loopback), 100 per directory."""
    paths = []
    for n in range(count):
        path = os.path.join(root, f"d{n // 100:03d}", f"f{n:05d}.txt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(f"file {n}\n".encode() if not size else os.urandom(size))
        paths.append(path)
    return paths


def ssh_options(sshd, **kwargs) -> StagingOptions:
    return StagingOptions(remote_python=sys.executable, ssh_options=tuple(sshd.ssh_options), jobs=1, **kwargs)


@contextmanager
def workflow(tmp_path, *executors, retries: int = 0):
    """A loaded DataFlowKernel, cleaned up (workers and all) afterwards."""
    dfk = parsl.load(Config(executors=list(executors), retries=retries, run_dir=str(tmp_path / "runinfo"),
                            strategy="none"))
    try:
        yield dfk
    finally:
        dfk.cleanup()
        parsl.clear()


def threads(tmp_path, staging, label: str = "threads", work: str = "work") -> ThreadPoolExecutor:
    return ThreadPoolExecutor(label=label, max_threads=4, working_dir=str(tmp_path / work), storage_access=[staging])


def htex(tmp_path, staging) -> HighThroughputExecutor:
    return HighThroughputExecutor(label="htex", address="127.0.0.1", max_workers_per_node=2,
                                  working_dir=str(tmp_path / "work"), storage_access=[staging],
                                  provider=LocalProvider(init_blocks=1, max_blocks=1, worker_init=WORKER_PATH))


@pytest.fixture
def htex_programs(monkeypatch):
    """HTEX starts interchange.py and process_worker_pool.py from PATH."""
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ['PATH']}")


def finished(staging) -> list:
    return [future.result(timeout=120) for future in staging.batches()]


# ---------------------------------------------------------------- many apps, few transfers

@pytest.mark.slow
@pytest.mark.parametrize("kind", ["threads", "htex"])
def test_many_apps_read_tiny_remote_files_in_few_transfers(sshd, tmp_path, monkeypatch, htex_programs, kind):
    paths = remote_files(str(tmp_path / "remote"), APPS)
    transfers = count_transfers(tmp_path / "shim", monkeypatch)
    # batches close at 2,000 files or on flush(), never on the clock: a loaded machine submits slowly
    staging = PalletStaging(options=ssh_options(sshd), window=600.0, max_files=2000)
    executor = threads(tmp_path, staging) if kind == "threads" else htex(tmp_path, staging)
    with workflow(tmp_path, executor):
        read = python_app(read_text, executors=[executor.label])
        futures = [read(inputs=[File(sshd.url(path))]) for path in paths]
        staging.flush()
        assert [f.result(timeout=300) for f in futures] == [f"file {n}\n" for n in range(APPS)]
        batches = finished(staging)
    assert [b.files for b in batches] == [2000, 2000, APPS - 4000]
    inline = sum(b.strategy == "inline" for b in batches)       # one request each over the host's session
    assert len(transfers()) + inline == len(batches) == sum(b.transfers for b in batches)
    streamed = [call for call in transfers() if "mpi_stager send" in call]
    assert len(streamed) == sum(b.strategy == "bundle" for b in batches)         # each bundle batch streamed
    assert {b.strategy for b in batches} <= {"bundle", "individual", "inline"}
    kept = tmp_path / "work" / f"127.0.0.1:{sshd.port}" / paths[-1].lstrip("/")
    assert kept.read_text() == f"file {APPS - 1}\n"            # the remote tree is kept below working_dir


def test_one_wave_of_submissions_is_one_batch_by_default(sshd, tmp_path, monkeypatch, htex_programs):
    """50 apps x 20 inputs, submitted by a loop that does a little work of its own per app (60 ms, as a loop
    reading a manifest does; Parsl's own per-File submit cost does the same with 100 inputs per app): the wave
    takes longer to submit than any fixed window, and is still one batch, with no flush() and no option set."""
    apps, per_app = 50, 20
    paths = remote_files(str(tmp_path / "remote"), apps * per_app)
    transfers = count_transfers(tmp_path / "shim", monkeypatch)
    staging = PalletStaging(options=ssh_options(sshd))
    executor = htex(tmp_path, staging)
    with workflow(tmp_path, executor):
        total = python_app(total_size, executors=[executor.label])
        futures = []
        for n in range(apps):
            futures.append(total(inputs=[File(sshd.url(path)) for path in paths[n * per_app:(n + 1) * per_app]]))
            time.sleep(0.06)
        sizes = [future.result(timeout=300) for future in futures]
        batches = finished(staging)
    assert sizes == [sum(os.path.getsize(path) for path in paths[n * per_app:(n + 1) * per_app]) for n in range(apps)]
    assert [b.files for b in batches] == [apps * per_app]
    assert len(transfers()) + (batches[0].strategy == "inline") == 1 == batches[0].transfers


def test_a_batch_stays_open_while_an_app_is_being_submitted(sshd, tmp_path):
    """Each file's size_hint reads a slow manifest (0.8 s, longer than the 0.5 s pause): while Parsl is inside
    one app's submission the wave has not paused, so 3 apps x 2 inputs are still one batch."""
    paths = remote_files(str(tmp_path / "remote"), 6)

    def slow_manifest(url: str) -> None:
        time.sleep(0.8)

    staging = PalletStaging(options=ssh_options(sshd), size_hint=slow_manifest)
    with workflow(tmp_path, threads(tmp_path, staging)):
        total = python_app(total_size, executors=["threads"])
        futures = [total(inputs=[File(sshd.url(path)) for path in paths[n:n + 2]]) for n in (0, 2, 4)]
        assert [f.result(timeout=120) for f in futures] == [len("file 0\n") * 2] * 3
        batches = finished(staging)
    assert [b.files for b in batches] == [6]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI's mpirun is not installed")
def test_mpi_executor_unpacks_each_batch_with_two_ranks(sshd, tmp_path, htex_programs):
    paths = remote_files(str(tmp_path / "remote"), 300)
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("localhost\n")
    staging = PalletStaging(options=ssh_options(sshd, strategy="bundle"), window=60, unpack_executor="mpi",
                            mpi_ranks=2, mpi_launcher="mpirun --oversubscribe -n {ranks}")
    mpi = MPIExecutor(label="mpi", address="127.0.0.1", max_workers_per_block=1, provider=LocalProvider(
        launcher=SimpleLauncher(), worker_init=f"export PBS_NODEFILE={nodefile}; {MPI_ENV}; {WORKER_PATH}"))
    with workflow(tmp_path, threads(tmp_path, staging), mpi):
        read = python_app(read_text, executors=["threads"])
        futures = [read(inputs=[File(sshd.url(path))]) for path in paths]
        staging.flush()
        assert [f.result(timeout=240) for f in futures] == [f"file {n}\n" for n in range(300)]   # a guard
        (done,) = finished(staging)
    assert (done.strategy, done.ranks, done.files, done.transfers) == ("bundle", 2, 300, 1)


# ---------------------------------------------------------------- Globus

LOCAL, REMOTE = "11111111-2222-4333-8444-555555555555", "66666666-7777-4888-8999-aaaaaaaaaaaa"


@pytest.fixture
def globus(monkeypatch):
    """The real globus-sdk client against the stand-in, both collections showing this host's /."""
    globus_sdk = pytest.importorskip("globus_sdk")
    responses = pytest.importorskip("responses")
    from staging_core.transports import globus_auth
    from tests.globus_standin import GlobusStandIn
    client = globus_sdk.TransferClient(authorizer=globus_sdk.AccessTokenAuthorizer("stand-in-token"))
    monkeypatch.setattr(globus_auth, "transfer_client", lambda **kwargs: client)
    monkeypatch.setenv("PALLET_GLOBUS_LOCAL_ENDPOINT", LOCAL)
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        standin = GlobusStandIn(mock, {LOCAL: "/", REMOTE: "/"})
        standin.polls_before_done = 0
        yield standin


def test_a_thousand_globus_inputs_are_one_transfer_task(globus, tmp_path):
    paths = remote_files(str(tmp_path / "remote"), 1000)
    staging = PalletStaging(window=60)
    with workflow(tmp_path, threads(tmp_path, staging)):
        read = python_app(read_text, executors=["threads"])
        futures = [read(inputs=[File(f"globus://{REMOTE}{path}")]) for path in paths]
        staging.flush()
        assert [f.result(timeout=120) for f in futures] == [f"file {n}\n" for n in range(1000)]
        (done,) = finished(staging)
    assert (done.files, done.strategy, done.transfers) == (1000, "individual", 1)
    assert len(globus.submissions) == 1 and len(globus.tasks) == 1 and len(globus.submissions[0]["DATA"]) >= 1000


def test_a_failed_batch_fails_each_dependent_app_naming_the_cause(globus, tmp_path):
    paths = remote_files(str(tmp_path / "remote"), 40)
    globus.denied.add((REMOTE, str(tmp_path / "remote")))
    staging = PalletStaging(window=60)
    with workflow(tmp_path, threads(tmp_path, staging), retries=1):
        read = python_app(read_text, executors=["threads"])
        futures = [read(inputs=[File(f"globus://{REMOTE}{path}")]) for path in paths]
        staging.flush()
        errors = [f.exception(timeout=120) for f in futures]
    assert all(isinstance(e, DependencyError) for e in errors)
    causes = {id(e.__cause__): e.__cause__ for e in errors}
    (cause,) = causes.values()
    assert isinstance(cause, BatchError) and cause.files == 40
    assert "pallet batch 1 (40 file(s)" in str(cause) and "PermissionDenied" in str(cause)
    sample = doc_block("docs/parsl.md", "parsl.dataflow.errors.DependencyError").text   # the guide's example
    hints = [line.strip() for line in sample.splitlines() if line.strip().startswith("hint:")]
    assert hints and all(hint in str(cause) for hint in hints), str(cause)


# ---------------------------------------------------------------- stage-out, upstream outputs, de-duplication

def test_outputs_go_back_in_batches_and_come_back(sshd, tmp_path):
    remote = tmp_path / "remote" / "out"
    urls = [sshd.url(f"{remote}/d{n % 5}/o{n:03d}.txt") for n in range(200)]
    staging = PalletStaging(options=ssh_options(sshd), window=60)
    with workflow(tmp_path, threads(tmp_path, staging)):
        write = python_app(write_text, executors=["threads"])
        apps = [write("fail" if n == 7 else f"out {n}\n", outputs=[File(url)]) for n, url in enumerate(urls)]
        staging.flush()
        outputs = [app.outputs[0].exception(timeout=120) for app in apps]
        (done,) = finished(staging)
    assert isinstance(outputs[7], ValueError) and outputs.count(None) == 199
    assert (done.direction, done.files, done.transfers) == ("out", 199, 1)
    assert not (remote / "d2" / "o007.txt").exists() and (remote / "d3" / "o008.txt").read_text() == "out 8\n"
    again = PalletStaging(options=ssh_options(sshd), window=60)
    with workflow(tmp_path, threads(tmp_path, again, work="elsewhere")):
        read = python_app(read_text, executors=["threads"])
        futures = [read(inputs=[File(url)]) for n, url in enumerate(urls) if n != 7]
        again.flush()
        assert [f.result(timeout=120) for f in futures] == [f"out {n}\n" for n in range(200) if n != 7]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["threads", "htex"])
def test_four_batches_out_and_four_in_run_concurrently_with_the_right_contents(sshd, tmp_path, htex_programs, kind):
    """Bundled batches on 8 executor threads (or 2 HTEX workers): packs, streams and unpacks of batches overlap."""
    per_batch, remote = 60, tmp_path / "remote"
    inputs = [remote_files(str(remote / f"in{k}"), per_batch) for k in range(4)]
    for k, paths in enumerate(inputs):
        for n, path in enumerate(paths):
            with open(path, "w") as handle:
                handle.write(f"input {k}/{n}\n" * (1 + n % 9))
    options = ssh_options(sshd, strategy="bundle", shard_size=4096)
    staging = PalletStaging(options=replace(options, jobs=2), window=60, max_files=per_batch)
    executor = htex(tmp_path, staging) if kind == "htex" else \
        ThreadPoolExecutor(label="threads", max_threads=8, working_dir=str(tmp_path / "work"), storage_access=[staging])
    with workflow(tmp_path, executor):
        write, read = (python_app(app, executors=[executor.label]) for app in (write_text, read_text))
        written = [write(f"output {k}/{n}\n" * (1 + n % 7), outputs=[File(sshd.url(f"{remote}/out{k}/o{n:03d}.txt"))])
                   for k in range(4) for n in range(per_batch)]
        reads = [read(inputs=[File(sshd.url(path))]) for paths in inputs for path in paths]
        staging.flush()
        for app in written:
            app.outputs[0].result(timeout=120)
        assert [r.result(timeout=120) for r in reads] == [f"input {k}/{n}\n" * (1 + n % 9)
                                                        for k in range(4) for n in range(per_batch)]
        batches = finished(staging)
    assert sorted((b.direction, b.files, b.strategy) for b in batches) == \
        [("in", per_batch, "bundle")] * 4 + [("out", per_batch, "bundle")] * 4
    for k in range(4):
        assert sorted(os.listdir(remote / f"out{k}")) == [f"o{n:03d}.txt" for n in range(per_batch)]  # no .pallet
        for n in range(per_batch):
            assert (remote / f"out{k}" / f"o{n:03d}.txt").read_text() == f"output {k}/{n}\n" * (1 + n % 7)


def test_upstream_outputs_wait_and_urls_are_fetched_once(sshd, tmp_path):
    (tmp_path / "remote").mkdir()
    shared = remote_files(str(tmp_path / "remote" / "shared"), 1)[0]
    middle = sshd.url(f"{tmp_path}/remote/mid/m.txt")
    staging = PalletStaging(options=ssh_options(sshd), window=0.5)
    with workflow(tmp_path, threads(tmp_path, staging, "a", "work-a"), threads(tmp_path, staging, "b", "work-b")):
        write_a = python_app(write_text, executors=["a"])
        read_a, read_b = (python_app(read_text, executors=[label]) for label in "ab")
        upstream = write_a("from a\n", outputs=[File(middle)])
        same_side = read_a(inputs=[upstream.outputs[0]])          # written under a's root: nothing to fetch
        other_side = read_b(inputs=[upstream.outputs[0]])         # waits for the upstream output, then fetched
        readers = [read_b(inputs=[File(sshd.url(shared))]) for _ in range(30)]
        assert same_side.result(timeout=60) == other_side.result(timeout=60) == "from a\n"
        assert {r.result(timeout=60) for r in readers} == {"file 0\n"}
        batches = finished(staging)
    incoming = sorted((b.files, b.direction) for b in batches if b.direction == "in")
    assert incoming == [(1, "in"), (1, "in")]                    # the shared URL once, the middle file once


def test_size_hints_close_batches_at_the_byte_cap(sshd, tmp_path):
    paths = remote_files(str(tmp_path / "remote"), 25)
    staging = PalletStaging(options=ssh_options(sshd), window=60, max_bytes=10_000,
                            size_hint=lambda url: 1_000)
    with workflow(tmp_path, threads(tmp_path, staging)):
        read = python_app(read_text, executors=["threads"])
        futures = [read(inputs=[File(sshd.url(path))]) for path in paths]
        staging.flush()
        assert [f.result(timeout=60) for f in futures] == [f"file {n}\n" for n in range(25)]
        batches = finished(staging)
    assert [b.files for b in batches] == [10, 10, 5] and sum(b.transfers for b in batches) == 3


# ---------------------------------------------------------------- a killed batch, rerun

def _children_of(pid: int) -> list[int]:
    """Children of every thread of ``pid`` (a child belongs to the thread that started it)."""
    children = []
    for listing in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(listing) as handle:
                children += [int(c) for c in handle.read().split()]
        except OSError:
            continue
    return children


def _journalled(dest) -> int:
    """Shards the unpack journal under ``dest`` records as finished (``shard-N``; ``shard-N.tmpR`` are not)."""
    return len([p for p in glob.glob(f"{dest}/.pallet/journal-*/shard-*") if p.rpartition("-")[2].isdigit()])


def _kill_unpack_after_first_shard(dest, stop: threading.Event) -> list[int]:
    """Watch the unpack journal; once a shard is finished, SIGKILL the `mpi_stager unpack` this test started."""
    killed: list[int] = []
    while not stop.is_set() and not killed:
        if _journalled(dest):
            for pid in _all_children(os.getpid()):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as handle:
                        command = handle.read()
                except OSError:
                    continue
                if b"mpi_stager" in command and b"unpack" in command:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
        time.sleep(0.001)
    return killed


def _all_children(pid: int) -> list[int]:
    found, stack = [], [pid]
    while stack:
        children = _children_of(stack.pop())
        found += children
        stack += children
    return found


@pytest.mark.slow
def test_rerun_after_a_killed_batch_sends_no_finished_shard_again(sshd, tmp_path):
    paths = remote_files(str(tmp_path / "remote"), 1000, size=64 * 1024)     # ~16 shards of 4 MiB
    dest = tmp_path / "work" / f"127.0.0.1:{sshd.port}" / str(tmp_path / "remote").lstrip("/")
    stop, killed = threading.Event(), []
    watcher = threading.Thread(target=lambda: killed.extend(
        _kill_unpack_after_first_shard(dest, stop)))

    def run() -> tuple[list, list]:
        options = ssh_options(sshd, strategy="bundle", codec="none", stream="off")      # stored and forwarded
        staging = PalletStaging(options=options, window=60)
        with workflow(tmp_path, threads(tmp_path, staging)):
            size = python_app(size_of, executors=["threads"])
            futures = [size(inputs=[File(sshd.url(path))]) for path in paths]
            staging.flush()
            return [f.exception(timeout=120) for f in futures], staging.batches()

    watcher.start()
    try:
        errors, (first,) = run()
    finally:
        stop.set()
        watcher.join()
    assert killed, "the unpack finished before it could be killed"
    assert isinstance(errors[0], DependencyError) and isinstance(first.exception(), BatchError)
    finished_before = _journalled(dest)
    errors, (second,) = run()
    assert errors == [None] * len(paths)
    done = second.result()
    assert done.transfers == 1 and done.bytes_sent == 0                        # rsync matched the bundle left
    assert done.skipped_shards == finished_before >= 1
    assert (dest / "d009" / "f00999.txt").read_bytes() == Path(paths[-1]).read_bytes()
