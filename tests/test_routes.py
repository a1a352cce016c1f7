"""Routes for far sides without remote execution, against a real GSI GridFTP server, sshd and one-node Slurm."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from bundles.errors import SourceError, UsageError
from bundles.writer import PackOptions, pack
from staging_core.operations.push_pull import pull, push
from staging_core.options import StagingOptions
from staging_core.routes.unpack import run_local
from staging_core.far_side.slurm import (Poll, SlurmJobError, UnpackJob, batch_script, job_resources, launcher_tasks,
                                submit, wait)
from staging_core.transports.errors import TransportError
from tests.conftest import assert_same_tree, run_pallet
from tests.servers import SLURM_PROGRAMS, count_invocations, start_gridftp, start_slurm

needs_gridftp = pytest.mark.skipif(shutil.which("globus-url-copy") is None or not (
    shutil.which("globus-gridftp-server") or os.path.exists("/usr/sbin/globus-gridftp-server")),
    reason="globus-url-copy and globus-gridftp-server are not installed (./bootstrap.sh installs them)")


def tiny_tree(root, count: int) -> str:
    for n in range(count):
        path = root / f"d{n % 40:02d}" / f"f{n:05d}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{n},{n * 7}\n" * 5)
    os.chmod(root / "d00" / "f00000.csv", 0o600)        # modes and mtimes only survive a bundle over GridFTP
    return str(root)


def without_kept_bundle(dest) -> str:
    """DEST after a kept bundle was unpacked by its script: the bundle stays in .pallet/incoming until the user
    removes it (nothing else of pallet's may be left); remove it for the comparison."""
    assert os.listdir(os.path.join(dest, ".pallet")) == ["incoming"]
    shutil.rmtree(os.path.join(dest, ".pallet"))
    return str(dest)


@pytest.fixture(scope="module")
def gsiftp_server(tmp_path_factory):
    """One GridFTP server with GSI for the module (a throw-away CA), stopped by PID."""
    server = start_gridftp(tmp_path_factory.mktemp("gsiftp"), gsi=True)
    yield server
    server.stop()


@pytest.fixture
def gsiftp(gsiftp_server, monkeypatch):
    """The server, with this test's globus-url-copy runs trusting it ($PALLET_GRIDFTP_OPTIONS: -s SUBJECT)."""
    for name, value in gsiftp_server.client_env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PALLET_GRIDFTP_OPTIONS", shlex.join(gsiftp_server.options))
    return gsiftp_server


def via_url(sshd) -> str:
    return f"ssh://{sshd.user}@127.0.0.1:{sshd.port}"


def options(sshd, **overrides) -> StagingOptions:
    """Far-side commands run with this Python (pallet installed) over the test sshd."""
    return StagingOptions(**{"jobs": 2, "ranks": 2, "remote_python": sys.executable,
                             "ssh_options": tuple(sshd.ssh_options), **overrides})


def logging_shim(path, log) -> str:
    """A program that logs its arguments to ``log`` and runs them: a launcher (or, with sys.executable, a Python)."""
    path.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\nexec "$@"\n')
    path.chmod(0o755)
    return str(path)


# ---------------------------------------------------------------- push --unpack-via

@needs_gridftp
def test_push_to_gsiftp_unpacks_via_ssh_with_the_launcher(gsiftp, sshd, tmp_path, monkeypatch):
    src = tiny_tree(tmp_path / "src", 2000)
    calls = count_invocations(tmp_path / "shim", "globus-url-copy", monkeypatch)
    launcher = logging_shim(tmp_path / "launch", tmp_path / "launch.log")
    dest = tmp_path / "dest"
    result = push(src, gsiftp.url(str(dest)), options(sshd, unpack_via=via_url(sshd), launcher=launcher))
    assert (result.plan.strategy, result.strategy, result.transfers) == ("bundle", "bundle", 1)
    assert result.route == f"via {via_url(sshd)}" and result.files == 2000
    # GridFTP keeps neither modes nor mtimes: an identical tree can only come from the bundle's unpack
    assert_same_tree(src, dest)                 # strict: no bundle, journal or .pallet left
    assert len(calls()) < 10          # mkdir runs and one batch of two files, never 2,000 items
    launched = (tmp_path / "launch.log").read_text().splitlines()
    assert len(launched) == 1 and "-m mpi_stager unpack" in launched[0] and str(dest) in launched[0]


@needs_gridftp
def test_a_rerun_via_ssh_resumes_and_converges(gsiftp, sshd, tmp_path):
    src = tiny_tree(tmp_path / "src", 300)
    dest = tmp_path / "dest"
    first = push(src, gsiftp.url(str(dest)), options(sshd, strategy="bundle", unpack_via=via_url(sshd)))
    assert first.skipped_shards == 0
    assert_same_tree(src, dest)
    (dest / "d00" / "f00000.csv").unlink()          # the tree is damaged, and the state of a failed run
    (dest / ".pallet" / "journal-x").mkdir(parents=True)    # (another bundle's journal) lies in DEST
    second = push(src, gsiftp.url(str(dest)), options(sshd, strategy="bundle", unpack_via=via_url(sshd)))
    assert second.skipped_shards == 0
    assert_same_tree(src, dest)                     # repaired, and the stale state swept


# ---------------------------------------------------------------- --keep-packed

def stager_command(script: str) -> list[str]:
    """The mpi_stager command of a generated unpack.sbatch, without the srun in front."""
    line = next(line for line in script.splitlines() if " -m mpi_stager unpack " in line)
    argv = shlex.split(line)
    return argv[argv.index(sys.executable):]


@needs_gridftp
def test_keep_packed_leaves_bundle_index_and_script_whose_command_unpacks(gsiftp, sshd, tmp_path):
    src = tiny_tree(tmp_path / "src", 500)
    dest = tmp_path / "dest"
    result = push(src, gsiftp.url(str(dest)), options(sshd, strategy="bundle", keep_packed=True,
                                                      job_options=("--partition=io", "--time=0:30:00")))
    incoming = dest / ".pallet" / "incoming"
    assert result.route == f"kept packed: sbatch {incoming}/unpack.sbatch" and result.skipped_shards == 0
    bundle, index, script_name = sorted(p.name for p in incoming.iterdir())
    assert bundle.startswith("bundle.tar") and index == bundle + ".pidx" and script_name == "unpack.sbatch"
    assert sorted(p.name for p in dest.iterdir()) == [".pallet"]          # nothing unpacked
    script = (incoming / "unpack.sbatch").read_text()
    assert script.startswith("#!/bin/bash\n") and "#SBATCH --partition=io\n" in script
    assert "#SBATCH --ntasks=1\n#SBATCH --cpus-per-task=2\n" in script and "\nsrun " in script
    subprocess.run(stager_command(script), check=True, capture_output=True)
    assert_same_tree(src, without_kept_bundle(dest))


def test_keep_packed_to_a_local_destination_from_the_cli(tmp_path):
    src = tiny_tree(tmp_path / "src", 50)
    done = run_pallet("push", "--json", "--strategy", "bundle", "--keep-packed", "--launcher", "mpirun -n 4",
                      src, str(tmp_path / "dest"), check=True)
    summary = json.loads(done.stdout)
    script = tmp_path / "dest" / ".pallet" / "incoming" / "unpack.sbatch"
    assert summary["route"] == f"kept packed: sbatch {script}" and summary["strategy"] == "bundle"
    text = script.read_text()
    assert "#SBATCH --ntasks=4\n" in text and "\nmpirun -n 4 python3 -m mpi_stager unpack --json " in text


# ---------------------------------------------------------------- pull --pack-via and published bundles

@needs_gridftp
def test_pull_from_gsiftp_packs_via_ssh_beside_the_source(gsiftp, sshd, tmp_path):
    src = tiny_tree(tmp_path / "published" / "tree", 1500)
    result = pull(gsiftp.url(src), str(tmp_path / "here"), options(sshd, pack_via=via_url(sshd)))
    assert result.strategy == "bundle" and result.route == f"packed via {via_url(sshd)}" and result.files == 1500
    assert_same_tree(src, tmp_path / "here")
    assert sorted(p.name for p in (tmp_path / "published").iterdir()) == ["tree"]     # outgoing removed


def publish(tmp_path, count: int) -> tuple[str, str]:
    src = tiny_tree(tmp_path / "tree", count)
    bundle = str(tmp_path / "pub" / "data.tar.zst")
    os.makedirs(os.path.dirname(bundle))
    pack(src, bundle, PackOptions(codec="zstd", jobs=2))
    return src, bundle


@needs_gridftp
def test_published_bundle_is_fetched_over_gsiftp_and_unpacked_here(gsiftp, tmp_path):
    src, bundle = publish(tmp_path, 800)
    result = pull(gsiftp.url(bundle), str(tmp_path / "here"), StagingOptions(jobs=2))
    assert (result.strategy, result.route, result.files, result.transfers) == ("bundle", "published bundle", 800, 1)
    assert result.plan.reason.startswith("published bundle")
    assert_same_tree(src, tmp_path / "here")
    assert sorted(os.listdir(tmp_path / "pub")) == ["data.tar.zst", "data.tar.zst.pidx"]


def test_published_bundle_over_ssh_runs_no_pack_at_the_source(sshd, tmp_path):
    src, bundle = publish(tmp_path, 400)
    python = logging_shim(tmp_path / "python", tmp_path / "python.log")
    result = pull(sshd.url(bundle), str(tmp_path / "here"),
                  options(sshd, remote_python=f"{python} {sys.executable}"))
    assert (result.strategy, result.route, result.files) == ("bundle", "published bundle", 400)
    assert not (tmp_path / "python.log").exists()        # no mpi_stager ran at the source
    assert_same_tree(src, tmp_path / "here")


def test_published_bundle_from_a_local_path_and_its_errors(tmp_path):
    src, bundle = publish(tmp_path, 30)
    done = run_pallet("pull", "--json", bundle, str(tmp_path / "here"), check=True)
    assert json.loads(done.stdout)["route"] == "published bundle"
    assert_same_tree(src, tmp_path / "here")
    with pytest.raises(UsageError, match="published bundle"):
        pull(bundle, str(tmp_path / "again"), StagingOptions(strategy="individual"))
    os.unlink(bundle + ".pidx")
    with pytest.raises(SourceError, match="without its index"):
        pull(bundle, str(tmp_path / "again"))


# ---------------------------------------------------------------- usage errors

@pytest.mark.parametrize("overrides, message", [
    ({"unpack_job": "slurm"}, "--unpack-job slurm needs --unpack-via"),
    ({"unpack_via": "gsiftp://login/x"}, "--unpack-via takes an ssh:// URL"),
    ({"unpack_via": "login:/x"}, "--unpack-via takes an ssh:// URL"),
    ({"unpack_via": "ssh://login", "unpack_job": "pbs"}, "unknown --unpack-job"),
    ({"unpack_via": "ssh://login", "keep_packed": True}, "--keep-packed leaves the bundle packed"),
    ({"job_options": ("--partition=io",)}, "--job-option needs"),
    ({"pack_via": "ssh://login"}, "--pack-via is for pull"),
])
def test_route_options_that_make_no_sense_are_usage_errors(tmp_path, overrides, message):
    (tmp_path / "src").mkdir()
    with pytest.raises(UsageError, match=message):
        push(str(tmp_path / "src"), "gsiftp://127.0.0.1:9/x", StagingOptions(**overrides))


def test_usage_errors_from_the_cli(tmp_path):
    src = tiny_tree(tmp_path / "src", 20)
    no_via = run_pallet("push", "--unpack-job", "slurm", src, "gsiftp://127.0.0.1:9/x")
    assert no_via.returncode == 2 and "--unpack-via" in no_via.stderr and "hint:" in no_via.stderr
    not_ssh = run_pallet("push", "--unpack-via", "ftp://127.0.0.1:9", src, "gsiftp://127.0.0.1:9/x")
    assert not_ssh.returncode == 2 and "ssh://" in not_ssh.stderr
    no_route = run_pallet("push", "--strategy", "bundle", src, "gsiftp://127.0.0.1:9/x")
    assert no_route.returncode == 2 and "--unpack-via" in no_route.stderr
    pull_via = run_pallet("pull", "--pack-via", "gsiftp://127.0.0.1:9/", "gsiftp://127.0.0.1:9/x", str(tmp_path / "d"))
    assert pull_via.returncode == 2 and "--pack-via takes an ssh:// URL" in pull_via.stderr
    plan_bad = run_pallet("plan", "--unpack-via", "login:/x", src, "gsiftp://127.0.0.1:9/x")
    assert plan_bad.returncode == 2


def test_plan_offers_a_bundle_to_gsiftp_only_with_a_route(tmp_path):
    src = tiny_tree(tmp_path / "src", 20)
    strategies = {}
    for flags in ([], ["--keep-packed"], ["--unpack-via", "ssh://login.hpc"]):
        done = run_pallet("plan", "--json", *flags, src, "gsiftp://gridftp.hpc/x", check=True)
        strategies[" ".join(flags)] = sorted(c["strategy"] for c in json.loads(done.stdout)["candidates"])
    assert strategies[""] == ["individual"]
    assert strategies["--keep-packed"] == strategies["--unpack-via ssh://login.hpc"] == ["bundle", "individual"]


# ---------------------------------------------------------------- --unpack-job slurm (real Slurm)

@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A real one-node Slurm (munged, slurmctld, slurmd) for the module, stopped by PID."""
    missing = [p for p in SLURM_PROGRAMS if shutil.which(p) is None and not os.path.exists(f"/usr/sbin/{p}")]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing; ./bootstrap.sh installs slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("a test Slurm needs root: slurmd starts the jobs")
    cluster = start_slurm(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


def job_options(sshd, slurm, **overrides) -> StagingOptions:
    return options(sshd, strategy="bundle", unpack_via=via_url(sshd), unpack_job="slurm",
                   ssh_options=(*sshd.ssh_options, *slurm.ssh_options), **overrides)


@needs_gridftp
def test_unpack_job_runs_in_slurm_and_pallet_waits_for_it(gsiftp, sshd, slurm, tmp_path, capfd):
    src = tiny_tree(tmp_path / "src", 600)
    dest = tmp_path / "dest"
    result = push(src, gsiftp.url(str(dest)), job_options(sshd, slurm, progress=True, job_options=("--time=10",)))
    job_id = result.route.split()[2]
    assert result.route == f"slurm job {job_id} via {via_url(sshd)}" and job_id.isdigit()
    states = [line for line in capfd.readouterr().err.splitlines() if line.startswith(f"pallet: slurm job {job_id}")]
    assert states[0].startswith(f"pallet: slurm job {job_id} submitted") and states[-1].endswith(": COMPLETED")
    assert_same_tree(src, dest)                 # bundle, script and job output removed too


@needs_gridftp
def test_a_failed_unpack_job_names_its_id_and_state(gsiftp, sshd, slurm, tmp_path):
    src = tiny_tree(tmp_path / "src", 20)
    dest = tmp_path / "dest"
    failing = "sh -c 'echo the unpack exploded >&2; exit 3' sh"
    with pytest.raises(SlurmJobError) as caught:
        push(src, gsiftp.url(str(dest)), job_options(sshd, slurm, remote_python=failing))
    error = caught.value
    assert error.state == "FAILED" and f"slurm job {error.job_id} ended FAILED: the unpack exploded" in str(error)
    incoming = dest / ".pallet" / "incoming"
    assert {"unpack.sbatch", f"unpack-{error.job_id}.err"} <= set(os.listdir(incoming))


def test_a_kept_script_submits_to_slurm_as_it_is(slurm, tmp_path, monkeypatch):
    src = tiny_tree(tmp_path / "src", 200)
    dest = tmp_path / "dest"
    push(src, str(dest), StagingOptions(strategy="bundle", keep_packed=True, ranks=1, remote_python=sys.executable))
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    bundle = next(p for p in (dest / ".pallet" / "incoming").iterdir() if p.suffix not in (".pidx", ".sbatch"))
    job = UnpackJob(str(bundle), str(dest))
    job_id = submit(run_local, job, "this host")           # sbatch DEST/.pallet/incoming/unpack.sbatch
    assert wait(run_local, job_id, "this host", lambda line: None, Poll(first=0.5)) == "COMPLETED"
    assert_same_tree(src, without_kept_bundle(dest))


# ---------------------------------------------------------------- the job waiter, with scripted Slurm answers

class ScriptedSlurm:
    """A command runner answering squeue/sacct from scripted states; a state of None makes the command fail."""

    def __init__(self, squeue: list, sacct: list | None = None):
        self.squeue, self.sacct, self.ran = list(squeue), list(sacct or []), []

    def __call__(self, argv: list[str]) -> bytes:
        self.ran.append(argv)
        answers = {"squeue": self.squeue, "sacct": self.sacct}.get(argv[0])
        state = answers.pop(0) if answers else None
        if state is None:
            raise TransportError("remote command failed with status 1", status=1,
                                 stderr="slurm_load_jobs error: Invalid job id specified")
        return f"{state}\n".encode()


def test_waiting_backs_off_echoes_new_states_and_falls_back_to_sacct():
    slurm, slept, echoed = ScriptedSlurm(["PENDING", "PENDING", "RUNNING", None], ["CANCELLED by 0"]), [], []
    state = wait(slurm, "42", "ssh://login", echoed.append, Poll(first=1, factor=2, longest=3), slept.append)
    assert state == "CANCELLED" and slept == [1, 2, 3]
    assert echoed == ["slurm job 42: PENDING", "slurm job 42: RUNNING", "slurm job 42: CANCELLED"]
    assert slurm.ran[-1] == ["sacct", "-n", "-X", "-P", "-j", "42", "-o", "State"]


def test_a_job_nobody_knows_fails_without_a_retryable_error():
    with pytest.raises(SlurmJobError, match="cannot tell its state") as caught:
        wait(ScriptedSlurm([]), "7", "ssh://login", lambda line: None, Poll(), lambda seconds: None)
    assert caught.value.job_id == "7" and not getattr(caught.value, "retryable", False)


def test_an_interrupted_wait_cancels_the_job():
    slurm = ScriptedSlurm(["RUNNING"])

    def interrupted(seconds):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        wait(slurm, "9", "ssh://login", lambda line: None, Poll(), interrupted)
    assert slurm.ran[-1] == ["scancel", "9"]


@pytest.mark.parametrize("launcher, tasks", [("srun -n 64", 64), ("srun -n64 --mpi=pmix", 64), ("mpirun -np 8", 8),
                                             ("srun --ntasks=16", 16), ("srun --ntasks 4", 4), ("mpiexec", None)])
def test_the_launcher_sizes_the_job(launcher, tasks):
    assert launcher_tasks(launcher) == tasks
    expected = [f"--ntasks={tasks}"] if tasks else []
    assert job_resources(StagingOptions(launcher=launcher)) == expected


def test_a_line_break_cannot_reach_a_batch_script():
    with pytest.raises(UsageError, match="line break"):
        batch_script(UnpackJob("/x/.pallet/incoming/b.tar", "/x"), ["true"], StagingOptions(job_options=("-p a\nrm",)))


# ---------------------------------------------------------------- globus:// through the stand-in service

@pytest.fixture
def globus_site(monkeypatch):
    """The real globus-sdk client against tests/globus_standin.py, both collections showing this host's / (so the
    via host sees the destination's paths as they are); pallet finds the client as after `pallet login globus`."""
    globus_sdk = pytest.importorskip("globus_sdk")
    responses = pytest.importorskip("responses")
    from staging_core.transports import globus_auth
    from tests.globus_standin import GlobusStandIn
    local, remote = "11111111-2222-4333-8444-555555555555", "66666666-7777-4888-8999-aaaaaaaaaaaa"
    client = globus_sdk.TransferClient(authorizer=globus_sdk.AccessTokenAuthorizer("stand-in-token"))
    monkeypatch.setattr(globus_auth, "transfer_client", lambda **kwargs: client)
    monkeypatch.setenv("PALLET_GLOBUS_LOCAL_ENDPOINT", local)
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        GlobusStandIn(mock, {local: "/", remote: "/"})
        yield lambda path: f"globus://{remote}{path}"


def test_globus_takes_the_same_routes(globus_site, sshd, tmp_path):
    src, bundle = publish(tmp_path, 300)
    dest = tmp_path / "dest"
    pushed = push(src, globus_site(str(dest)), options(sshd, strategy="bundle", unpack_via=via_url(sshd)))
    assert pushed.route == f"via {via_url(sshd)}" and pushed.transfers == 1
    assert_same_tree(src, dest)
    pulled = pull(globus_site(bundle), str(tmp_path / "here"), StagingOptions(jobs=2))
    assert (pulled.route, pulled.files) == ("published bundle", 300)
    assert_same_tree(src, tmp_path / "here")
