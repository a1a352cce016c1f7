"""The ssh transport against a real sshd: one rsync per batch, clear errors per cause, remote exec and streaming."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import time

import pytest

from staging_core.transports import Direction, open_transport
from staging_core.operations.push_pull import _with_retries
from staging_core.transports.errors import (AuthenticationError, HostUnreachableError, MissingDependencyError,
                                            RemoteDiskFullError, RemotePathMissingError, RemotePermissionError,
                                            StoppedBySignal, classify)
from staging_core.transports import ssh_master
from staging_core.transports.ssh import partition
from tests.servers import count_invocations, free_port


@pytest.fixture
def transport(sshd, tmp_path):
    with open_transport(sshd.url(str(tmp_path)), ssh_options=sshd.ssh_options) as opened:
        yield opened


@pytest.fixture
def rsync_calls(tmp_path, monkeypatch):
    """Count rsync invocations through a shim first on PATH."""
    calls = count_invocations(tmp_path / "shim", "rsync", monkeypatch)
    return lambda: len(calls())


def make_files(root, count: int) -> list[str]:
    items = []
    for n in range(count):
        path = root / f"d{n % 7}" / f"f{n}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * n)
        items.append(os.path.relpath(path, root))
    return items


@pytest.mark.parametrize("parallel,expected_calls", [(1, 1), (3, 3)])
def test_a_batch_runs_one_rsync_per_stream(sshd, tmp_path, rsync_calls, parallel, expected_calls):
    items = make_files(tmp_path / "src", 300)
    with open_transport(sshd.url(str(tmp_path / "dst")), ssh_options=sshd.ssh_options, parallel=parallel) as t:
        t.mkdir(str(tmp_path / "dst"))
        result = t.transfer(Direction.PUSH, str(tmp_path / "src"), str(tmp_path / "dst"), items)
    assert result.ok and len(result.done) == 300
    assert rsync_calls() == expected_calls
    assert all((tmp_path / "dst" / item).read_bytes() == (tmp_path / "src" / item).read_bytes() for item in items)


def test_partitions_balance_bytes_and_keep_every_item():
    items = [f"f{n}" for n in range(100)]
    sizes = [10_000_000 if n < 4 else 1000 for n in range(100)]
    parts = partition(items, sizes, 4)
    assert sorted(i for p in parts for i in p) == sorted(items)
    assert [sum(1 for i in p if int(i[1:]) < 4) for p in parts] == [1, 1, 1, 1]


def test_partitions_keep_the_names_of_a_hard_linked_file_together():
    items = [f"f{n}" for n in range(40)]
    keys = [("dev", n % 3) if n % 4 == 0 else None for n in range(40)]     # three files of several names each
    parts = partition(items, [1000] * 40, 4, link_keys=keys)
    assert sorted(i for p in parts for i in p) == sorted(items)
    for group in {key for key in keys if key is not None}:
        names = {items[n] for n, key in enumerate(keys) if key == group}
        assert sum(1 for p in parts if names & set(p)) == 1, group


@pytest.mark.parametrize("parallel", [1, 3])
def test_a_push_keeps_hard_links(sshd, tmp_path, parallel):
    src, dst = tmp_path / "src", tmp_path / "dst"
    items = make_files(src, 30)
    for n, item in enumerate(list(items)):
        if n % 5 == 0:
            link = f"{item}.link"
            os.link(src / item, src / link)
            items.append(link)
    with open_transport(sshd.url(str(dst)), ssh_options=sshd.ssh_options, parallel=parallel) as t:
        t.mkdir(str(dst))
        assert t.transfer(Direction.PUSH, str(src), str(dst), items).ok
    for item in items:
        if item.endswith(".link"):
            assert os.stat(dst / item).st_ino == os.stat(dst / item.removesuffix(".link")).st_ino, item


def test_a_master_that_idled_out_is_started_again(sshd, tmp_path, monkeypatch):
    idle = ssh_master.MASTER_IDLE_S
    monkeypatch.setattr(ssh_master, "MASTER_IDLE_S", 1)           # the first master idles out at once
    calls = count_invocations(tmp_path / "shim", "ssh", monkeypatch)
    with open_transport(sshd.url(str(tmp_path)), ssh_options=sshd.ssh_options, keep=0) as t:
        assert t.run(["echo", "one"]) == b"one\n"
        socket = t._master._socket
        deadline = time.monotonic() + 60                            # a guard only: the wait is for the event
        while os.path.exists(socket):
            assert time.monotonic() < deadline, "the master did not idle out"
            time.sleep(0.05)
        # The next master idles as a real one does: on a busy machine its client may take more than a second to
        # start, or the check below to run, and a master that idled out again would fail them.
        monkeypatch.setattr(ssh_master, "MASTER_IDLE_S", idle)
        assert t.run(["echo", "two"]) == b"two\n"
        assert os.path.exists(socket)                 # a master again, not a direct connection
    masters = [call for call in calls() if " -N " in call]
    assert len(masters) == 2 and all("BatchMode=yes" in call for call in calls() if " -O " not in call), calls()


@pytest.mark.parametrize("stderr, status", [
    ("", -signal.SIGINT), ("", -signal.SIGTERM), ("", 130), ("", 143),      # killed; a shell's 128 + N
    ("Killed by signal 2.\n", 255),                                         # ssh (LogLevel VERBOSE)
    ("rsync error: received SIGINT, SIGTERM, or SIGHUP (code 20) at rsync.c(713)\n"
     "Connection closed by 127.0.0.1 port 22\n", 20),                       # rsync, and its ssh's last words
])
def test_a_program_a_signal_stopped_is_never_retried(stderr, status):
    error = classify(stderr, status, ["rsync"], "ssh://host/dest", "rsync failed")
    assert isinstance(error, StoppedBySignal) and not error.retryable and "stopped by" in str(error), error
    attempts = []

    def attempt():
        attempts.append(1)
        raise error
    with pytest.raises(StoppedBySignal):
        _with_retries(attempt, retries=2)
    assert len(attempts) == 1


def test_unreachable_host_is_named_and_retryable(tmp_path):
    with (open_transport(f"ssh://root@127.0.0.1:{free_port()}/tmp", ssh_options=["-o", "ConnectTimeout=5"]) as t,
          pytest.raises(HostUnreachableError) as caught):
        t.list("/tmp")
    assert caught.value.retryable and "127.0.0.1" in str(caught.value)


def test_authentication_failure_is_distinct(sshd, tmp_path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "wrong")], check=True)
    options = [o if o != str(sshd.key) else str(tmp_path / "wrong") for o in sshd.ssh_options]
    with open_transport(sshd.url("/tmp"), ssh_options=options) as t, pytest.raises(AuthenticationError) as caught:
        t.list("/tmp")
    assert not caught.value.retryable and "hint:" in str(caught.value)


def test_missing_remote_path(transport, tmp_path):
    with pytest.raises(RemotePathMissingError):
        transport.list(str(tmp_path / "nowhere"))
    assert transport.stat(str(tmp_path / "nowhere")) is None
    result = transport.transfer(Direction.PULL, str(tmp_path / "back"), str(tmp_path), ["nowhere.txt"])
    assert isinstance(result.failed["nowhere.txt"], RemotePathMissingError)


def test_permission_denied(transport, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    subprocess.run(["chattr", "+i", str(locked)], check=True)     # refuses even root
    try:
        with pytest.raises(RemotePermissionError):
            transport.mkdir(str(locked / "sub"))
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=True)


def test_remote_disk_full(transport, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(full)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (tmp_path / "src").mkdir()
        (tmp_path / "src" / "big").write_bytes(os.urandom(1 << 20))
        with pytest.raises(RemoteDiskFullError) as caught:
            transport.transfer(Direction.PUSH, str(tmp_path / "src"), str(full), ["big"])
        assert "no space" in str(caught.value).lower()
    finally:
        subprocess.run(["umount", str(full)], check=True)


def test_remote_commands_and_a_missing_remote_program(sshd, transport, tmp_path):
    assert transport.run(["printf", "%s", "a b; $(echo no)"]) == b"a b; $(echo no)"
    with pytest.raises(MissingDependencyError) as caught:
        transport.run(["pallet-not-here", "--version"])
    assert "`pallet-not-here` is not installed on 127.0.0.1" in str(caught.value)


def test_streaming_into_a_remote_command(transport, tmp_path):
    target = tmp_path / "streamed.bin"
    payload = os.urandom(3 << 20)
    process = transport.stream_into(["sh", "-c", f"cat > {target}"])
    _, stderr = process.communicate(payload, timeout=60)
    assert process.returncode == 0, stderr
    assert target.read_bytes() == payload


def test_listing_reports_modes_mtimes_and_links(transport, tmp_path):
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "f").write_bytes(b"abc")
    os.chmod(tmp_path / "tree" / "f", 0o640)
    os.utime(tmp_path / "tree" / "f", ns=(1_700_000_000_123_456_789,) * 2)
    os.symlink("f", tmp_path / "tree" / "l")
    entries = {e.path: e for e in transport.list(str(tmp_path / "tree"))}
    assert entries["f"].size == 3 and entries["f"].mode == 0o640 and entries["f"].kind == "f"
    assert entries["f"].mtime_ns == 1_700_000_000_123_456_789
    assert entries["l"].kind == "l" and entries["l"].link == "f"
    assert stat.S_IMODE(os.stat(tmp_path / "tree" / "f").st_mode) == 0o640
