"""push/pull policy with real sshd: the destination lock, kill -9 and resume, hybrid runs, bad input, GridFTP."""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from staging_core.locking import DestinationLock, DestinationLocked
from staging_core.operations.push_pull import pull, push
from staging_core.options import StagingOptions
from staging_core.transports.base import parse_url
from staging_core.transports.registry import open_transport
from tests.conftest import assert_same_tree, run_pallet
from tests.programs import program, user_env
from tests.servers import count_invocations


def tiny_tree(root, count: int = 3000, size: int = 1024) -> str:
    for n in range(count):
        path = root / f"d{n % 30:02d}" / f"f{n:05d}.dat"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size // 2).hex().encode()[:size])
    return str(root)


def ssh_flags(sshd) -> list[str]:
    return ["--remote-python", sys.executable, *(f"--ssh-option={o}" for o in sshd.ssh_options)]


def ssh_options(sshd, **kwargs) -> StagingOptions:
    return StagingOptions(jobs=2, remote_python=sys.executable, ssh_options=tuple(sshd.ssh_options), **kwargs)


# ---------------------------------------------------------------- the lock

def test_a_locked_local_destination_refuses_a_second_push(tmp_path):
    src, dest = tiny_tree(tmp_path / "src", 20), tmp_path / "dest"
    endpoint = parse_url(str(dest))
    with DestinationLock(endpoint, open_transport(endpoint)):
        done = run_pallet("push", src, str(dest))
        assert done.returncode == 4 and "another pallet push/pull" in done.stderr and "flock on" in done.stderr
        assert not (dest / "d00").exists()
    run_pallet("push", src, str(dest), check=True)
    assert_same_tree(src, dest)


def test_a_locked_ssh_destination_refuses_and_the_lock_dies_with_its_holder(sshd, tmp_path):
    src, dest = tiny_tree(tmp_path / "src", 20), tmp_path / "dest"
    endpoint = parse_url(sshd.url(str(dest)))
    with (open_transport(endpoint, ssh_options=list(sshd.ssh_options)) as transport,
          DestinationLock(endpoint, transport),
          pytest.raises(DestinationLocked, match="another pallet")):
        push(src, sshd.url(str(dest)), ssh_options(sshd))
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, sshd.url(str(dest)), *sshd.ssh_options],
                              stdout=subprocess.PIPE, start_new_session=True)
    assert holder.stdout.readline().strip() == b"held"
    assert run_pallet("push", *ssh_flags(sshd), src, sshd.url(str(dest))).returncode == 4
    os.killpg(holder.pid, signal.SIGKILL)
    holder.wait()
    deadline = time.monotonic() + 20
    while run_pallet("push", *ssh_flags(sshd), src, sshd.url(str(dest))).returncode == 4:
        assert time.monotonic() < deadline, "the lock outlived its killed holder"
        time.sleep(0.5)
    assert_same_tree(src, dest)


_HOLD_LOCK = """
import sys, time
from staging_core.locking import DestinationLock
from staging_core.transports.base import parse_url
from staging_core.transports.registry import open_transport
endpoint = parse_url(sys.argv[1])
transport = open_transport(endpoint, ssh_options=sys.argv[2:])
with DestinationLock(endpoint, transport):
    print("held", flush=True)
    time.sleep(600)
"""


# ---------------------------------------------------------------- kill -9 and resume

def slow_rsync(shim_dir, monkeypatch, kbytes_per_s: int = 2000) -> None:
    """Put an rsync first on PATH that limits its bandwidth, so a transfer lasts long enough to be killed."""
    real = shutil.which("rsync")
    shim_dir.mkdir(parents=True, exist_ok=True)
    (shim_dir / "rsync").write_text(f'#!/bin/sh\nexec {real} --bwlimit={kbytes_per_s} "$@"\n')
    (shim_dir / "rsync").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim_dir}{os.pathsep}{os.environ['PATH']}")


def kill_when(argv: list[str], condition, tmpdir, timeout: float = 60) -> None:
    """Start `pallet ARGV`, SIGKILL its whole process group as soon as ``condition()`` holds."""
    process = subprocess.Popen([program("pallet"), *argv], env=user_env(TMPDIR=str(tmpdir)), start_new_session=True,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    try:
        while not condition():
            if process.poll() is not None:
                raise AssertionError(f"pallet ended before the kill point: {process.stderr.read().decode()}")
            assert time.monotonic() < deadline, "kill point never reached"
            time.sleep(0.005)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _packing(tmpdir):
    return lambda: bool(glob.glob(str(tmpdir / "pallet-push-*" / ".bundle*.part-*")))


def _sending(dest):
    def partial_data() -> bool:
        pattern = str(dest / ".pallet" / "incoming" / ".bundle.tar.zst.*")
        return any(os.path.getsize(p) > 64 << 10 for p in glob.glob(pattern) if os.path.isfile(p))
    return partial_data


def _unpacking(dest):
    return lambda: bool(glob.glob(str(dest / ".pallet" / "journal-*" / ("shard-" + "[0-9]" * 6))))


@pytest.mark.parametrize("stage", ["pack", "transfer", "unpack"])
def test_kill_9_during_a_bundle_push_then_rerun_resumes(sshd, tmp_path, monkeypatch, stage):
    src, dest, tmpdir = tiny_tree(tmp_path / "src"), tmp_path / "dest", tmp_path / "tmp"
    tmpdir.mkdir()
    slow_rsync(tmp_path / "shim", monkeypatch)
    argv = ["push", "--strategy", "bundle", "--stream", "off", "--shard-size", "256K", "--json", *ssh_flags(sshd),
            src, sshd.url(str(dest))]
    condition = {"pack": _packing(tmpdir), "transfer": _sending(dest), "unpack": _unpacking(dest)}[stage]
    kill_when(argv, condition, tmpdir)
    if (dest / "d00").exists():
        assert (dest / ".pallet" / "INCOMPLETE").exists()      # a crashed unpack is marked
    rerun = run_pallet(*argv, check=True, env={"TMPDIR": str(tmpdir)})
    summary = json.loads(rerun.stdout)
    assert_same_tree(src, dest)
    assert os.listdir(tmpdir) == []                             # the killed run's staging was swept
    if stage == "unpack":
        assert summary["skipped_shards"] >= 1                     # finished shards were not unpacked again
        assert summary["bytes_sent"] < 64 << 10                   # the complete bundle was not sent again
    elif stage == "transfer":
        assert summary["bytes_sent"] is not None and summary["bytes_sent"] < _bundle_size(src, tmp_path) - (64 << 10)


def _bundle_size(src: str, tmp_path) -> int:
    """Size of the bundle a push of ``src`` sends (packing is deterministic)."""
    reference = tmp_path / "reference.tar.zst"
    run_pallet("pack", "--shard-size", "256K", src, str(reference), check=True)
    return reference.stat().st_size + (tmp_path / "reference.tar.zst.pidx").stat().st_size


# ---------------------------------------------------------------- hybrid

def test_hybrid_push_sends_large_files_individually_and_the_rest_bundled(sshd, tmp_path, monkeypatch):
    src = tiny_tree(tmp_path / "src", 500)
    for name in ("big1.bin", "d03/big2.bin"):
        (tmp_path / "src" / name).write_bytes(os.urandom(3 << 20))
    calls = count_invocations(tmp_path / "shim", "rsync", monkeypatch)
    options = ssh_options(sshd, strategy="hybrid", large_file_bytes=1 << 20, stream="off")
    result = push(src, sshd.url(str(tmp_path / "dest")), options)
    assert result.strategy == "hybrid" and result.transfers == 2 and "2 large file(s)" in result.route
    assert_same_tree(src, tmp_path / "dest")
    listed = [c for c in calls() if "--files-from" in c]
    assert len(listed) == 2          # one rsync for the two large files, one for bundle + index


def test_hybrid_push_to_a_local_destination(tmp_path):
    src = tiny_tree(tmp_path / "src", 300)
    (tmp_path / "src" / "d01" / "big.bin").write_bytes(os.urandom(2 << 20))
    result = push(src, str(tmp_path / "dest"), StagingOptions(strategy="hybrid", large_file_bytes=1 << 20, jobs=2))
    assert result.strategy == "hybrid"
    assert_same_tree(src, tmp_path / "dest")


# ---------------------------------------------------------------- bad input

def test_push_bad_input_is_named_and_the_source_untouched(sshd, tmp_path):
    src = tiny_tree(tmp_path / "src", 50)
    before = sorted(os.walk(src))
    unreachable = run_pallet("push", "--retries", "0", "--ssh-option=-oConnectTimeout=5", src,
                             "ssh://127.0.0.1:1/tmp/x")
    assert unreachable.returncode == 3 and "host unreachable" in unreachable.stderr and "hint:" in unreachable.stderr
    (tmp_path / "file").write_text("not a directory")
    as_file = run_pallet("push", *ssh_flags(sshd), src, sshd.url(str(tmp_path / "file")))
    assert as_file.returncode in (1, 3) and str(tmp_path / "file") in as_file.stderr
    assert (tmp_path / "file").read_text() == "not a directory"
    local_file = run_pallet("push", src, str(tmp_path / "file"))
    assert local_file.returncode != 0 and "file" in local_file.stderr
    missing = run_pallet("push", str(tmp_path / "absent"), str(tmp_path / "d"))
    assert missing.returncode == 1 and "absent" in missing.stderr and "does not exist" in missing.stderr
    scheme = run_pallet("push", src, "s3://bucket/x")
    assert scheme.returncode == 2 and "s3" in scheme.stderr
    assert sorted(os.walk(src)) == before


def test_pull_bad_input(sshd, tmp_path):
    missing = run_pallet("pull", *ssh_flags(sshd), sshd.url(str(tmp_path / "absent")), str(tmp_path / "here"))
    assert missing.returncode == 3 and "absent" in missing.stderr
    (tmp_path / "file").write_text("keep me")
    src = tiny_tree(tmp_path / "src", 10)
    onto_file = run_pallet("pull", *ssh_flags(sshd), sshd.url(src), str(tmp_path / "file"))
    assert onto_file.returncode == 1 and "not a directory" in onto_file.stderr
    assert (tmp_path / "file").read_text() == "keep me"


@pytest.mark.skipif(not os.path.ismount("/dev/shm") or os.geteuid() != 0, reason="needs root to mount a small tmpfs")
@pytest.mark.parametrize("strategy", ["individual", "bundle"])
def test_push_into_a_full_file_system_fails_clearly(sshd, tmp_path, strategy):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        src = tiny_tree(tmp_path / "src", 1500)
        done = run_pallet("push", "--strategy", strategy, "--stream", "off", *ssh_flags(sshd), src,
                          sshd.url(str(small / "dest")))
        assert done.returncode in (1, 3) and "no space" in done.stderr.lower(), done.stderr
        if (small / "dest" / "d00").exists() and strategy == "bundle":
            assert (small / "dest" / ".pallet" / "INCOMPLETE").exists()
    finally:
        subprocess.run(["umount", str(small)], check=True)


# ---------------------------------------------------------------- GridFTP, individually

@pytest.fixture
def gridftp(tmp_path):
    if not shutil.which("globus-url-copy") or not os.path.exists("/usr/sbin/globus-gridftp-server"):
        pytest.skip("GridFTP server/client not installed (./bootstrap.sh installs them)")
    from tests.servers import start_gridftp
    server = start_gridftp(tmp_path / "gridftp")
    yield server
    server.stop()


def test_push_and_pull_over_gridftp(gridftp, tmp_path):
    src = tiny_tree(tmp_path / "src", 400, 256)
    url = gridftp.url(str(tmp_path / "remote"))
    pushed = push(src, url, StagingOptions(jobs=2))
    assert pushed.strategy == "individual" and pushed.files == 400
    assert sorted(_files(tmp_path / "remote")) == sorted(_files(tmp_path / "src"))
    pulled = pull(url, str(tmp_path / "back"), StagingOptions(jobs=2))
    assert pulled.files == 400
    assert sorted(_files(tmp_path / "back")) == sorted(_files(tmp_path / "src"))


def _files(root) -> list[tuple[str, bytes]]:
    found = []
    for directory, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            with open(path, "rb") as handle:
                found.append((os.path.relpath(path, root), handle.read()))
    return found


# ---------------------------------------------------------------- retries

def test_only_retryable_errors_are_retried(monkeypatch):
    from staging_core.operations import push_pull as operations
    from staging_core.transports.errors import HostUnreachableError, RemotePathMissingError
    monkeypatch.setattr(operations.time, "sleep", lambda seconds: None)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise HostUnreachableError("host unreachable", "ssh://h/x", "check the host")
        return "done"

    assert operations._with_retries(flaky, 2) == ("done", 3)
    calls.clear()
    with pytest.raises(HostUnreachableError):
        operations._with_retries(flaky, 1)
    assert len(calls) == 2

    def missing():
        calls.append(1)
        raise RemotePathMissingError("path does not exist", "ssh://h/x", "check the remote path")

    calls.clear()
    with pytest.raises(RemotePathMissingError):
        operations._with_retries(missing, 5)
    assert len(calls) == 1
