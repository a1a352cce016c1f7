"""The GridFTP transport against a real globus-gridftp-server on 127.0.0.1, driven by the real globus-url-copy."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from staging_core.testing import ConformanceTarget, TransportConformance
from staging_core.transports.base import Direction
from staging_core.transports.errors import (AuthenticationError, HostUnreachableError, NotSupportedError,
                                           RemotePathMissingError, RemotePermissionError)
from staging_core.transports.registry import open_transport
from tests.servers import count_invocations, free_port, start_gridftp

pytestmark = pytest.mark.skipif(shutil.which("globus-url-copy") is None or not (
    shutil.which("globus-gridftp-server") or os.path.exists("/usr/sbin/globus-gridftp-server")),
    reason="globus-url-copy and globus-gridftp-server are not installed (apt-get install globus-gass-copy-progs "
           "globus-gridftp-server-progs)")


@pytest.fixture(scope="module")
def gridftp(tmp_path_factory):
    """One anonymous GridFTP server for the module, stopped by PID."""
    server = start_gridftp(tmp_path_factory.mktemp("gridftp"))
    yield server
    server.stop()


@pytest.fixture
def remote(tmp_path):
    path = tmp_path / "remote"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def gsiftp(tmp_path_factory):
    """One GridFTP server with GSI (a throw-away CA, host and user certificates), stopped by PID."""
    server = start_gridftp(tmp_path_factory.mktemp("gsiftp"), gsi=True)
    yield server
    server.stop()


class TestGridFTPConformance(TransportConformance):
    scheme = "ftp"

    @pytest.fixture
    def conformance_target(self, gridftp, remote):
        with open_transport(gridftp.url(str(remote))) as transport:
            yield ConformanceTarget(transport, str(remote))


class TestGSIFTPConformance(TransportConformance):
    scheme = "gsiftp"

    @pytest.fixture
    def conformance_target(self, gsiftp, remote, monkeypatch):
        for name, value in gsiftp.client_env.items():
            monkeypatch.setenv(name, value)
        with open_transport(gsiftp.url(str(remote)), options=gsiftp.options) as transport:
            yield ConformanceTarget(transport, str(remote))


def write_files(root, count: int) -> list[str]:
    items = []
    for n in range(count):
        path = root / f"d{n % 3}" / f"file {n}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"%d\n" % n)
        items.append(str(path.relative_to(root)))
    return items


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """Every globus-url-copy invocation, logged by a PATH shim before the real one runs."""
    return count_invocations(tmp_path / "shim", "globus-url-copy", monkeypatch)


def test_a_batch_runs_globus_url_copy_once_with_a_list_file(gridftp, remote, tmp_path, counted):
    src = tmp_path / "src"
    items = ["d0", "d1", "d2"] + sorted(write_files(src, 30))
    transport = open_transport(gridftp.url(str(remote)), concurrency=3, parallel=2)
    result = transport.transfer(Direction.PUSH, str(src), str(remote), items)
    assert result.ok and result.done == items
    calls = counted()
    assert len(calls) == 1, calls
    assert " -f " in calls[0] and "-cc 3" in calls[0] and "-p 2" in calls[0] and "-pp" in calls[0]
    assert (remote / "d1" / "file 1.txt").read_bytes() == b"1\n"
    (src / "empty").mkdir()                     # an empty directory: its MKD is checked by one listing
    assert transport.transfer(Direction.PUSH, str(src), str(remote), ["empty"]).ok
    assert len(counted()) == 3 and (remote / "empty").is_dir()


def test_concurrency_defaults_from_the_capabilities(gridftp, remote):
    transport = open_transport(gridftp.url(str(remote)))
    assert transport.concurrency == transport.capabilities.concurrency == 4
    assert open_transport(gridftp.url(str(remote)), concurrency=16).capabilities.concurrency == 16


def test_unreachable_port_is_a_host_error(tmp_path):
    transport = open_transport(f"ftp://127.0.0.1:{free_port()}/tmp")
    with pytest.raises(HostUnreachableError) as info:
        transport.transfer(Direction.PUSH, str(tmp_path), "/tmp/x", write_files(tmp_path, 3))
    assert info.value.retryable and "connection refused" in info.value.stderr.lower()
    with pytest.raises(HostUnreachableError):
        transport.list("/tmp")
    with pytest.raises(HostUnreachableError):
        transport.mkdir("/tmp/pallet-never")


def test_gsi_without_credentials_or_trust(gsiftp, remote, tmp_path, monkeypatch):
    items = write_files(tmp_path / "src", 3)
    monkeypatch.setenv("X509_USER_PROXY", str(tmp_path / "no-proxy"))
    monkeypatch.setenv("X509_CERT_DIR", gsiftp.client_env["X509_CERT_DIR"])
    transport = open_transport(gsiftp.url(str(remote)), options=gsiftp.options)
    with pytest.raises(AuthenticationError):
        transport.transfer(Direction.PUSH, str(tmp_path / "src"), str(remote), items)
    monkeypatch.setenv("X509_USER_PROXY", gsiftp.client_env["X509_USER_PROXY"])
    monkeypatch.setenv("X509_CERT_DIR", str(tmp_path))            # the server's CA is not trusted
    with pytest.raises(AuthenticationError):
        transport.list(str(remote))


def test_missing_remote_paths(gridftp, remote, tmp_path):
    transport = open_transport(gridftp.url(str(remote)))
    with pytest.raises(RemotePathMissingError) as info:
        transport.list(str(remote / "no-such-dir"))
    assert "no-such-dir" in str(info.value)
    assert transport.stat(str(remote / "no-such-dir" / "deeper")) is None
    (remote / "here.txt").write_bytes(b"here")
    result = transport.transfer(Direction.PULL, str(tmp_path / "back"), str(remote), ["here.txt", "gone.txt"])
    assert result.done == ["here.txt"] and list(result.failed) == ["gone.txt"]
    assert isinstance(result.failed["gone.txt"], RemotePathMissingError)
    assert not (tmp_path / "back" / "gone.txt").exists()          # no empty file left behind


def test_pulled_leaf_directories_and_stat_of_a_directory(gridftp, remote, tmp_path):
    (remote / "a" / "empty").mkdir(parents=True)
    (remote / "a" / "f.txt").write_bytes(b"f")
    transport = open_transport(gridftp.url(str(remote)))
    result = transport.transfer(Direction.PULL, str(tmp_path / "back"), str(remote), ["a", "a/empty", "a/f.txt"])
    assert result.ok and (tmp_path / "back" / "a" / "empty").is_dir()
    assert transport.stat(str(remote / "a")).kind == "d"
    assert transport.stat(str(remote / "a" / "f.txt")).size == 1


def test_names_and_links_that_cannot_cross_fail_alone(gridftp, remote, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("ok.txt", "ü.txt", "line\nbreak"):
        (src / name).write_bytes(b"x")
    (src / "link").symlink_to("ok.txt")
    transport = open_transport(gridftp.url(str(remote)))
    result = transport.transfer(Direction.PUSH, str(src), str(remote), ["ok.txt", "ü.txt", "line\nbreak", "link"])
    assert result.done == ["ok.txt"] and sorted(result.failed) == sorted(["ü.txt", "line\nbreak", "link"])
    assert all(isinstance(error, NotSupportedError) for error in result.failed.values())
    assert sorted(os.listdir(remote)) == ["ok.txt"]


def test_long_paths_beyond_the_list_file_limit(gridftp, remote, tmp_path):
    src = tmp_path / "src"
    long = os.path.join("a" * 200, "b" * 200, "c" * 150 + ".txt")
    (src / long).parent.mkdir(parents=True)
    (src / long).write_bytes(b"long")
    items = write_files(src, 2) + [long]
    transport = open_transport(gridftp.url(str(remote)))
    assert transport.transfer(Direction.PUSH, str(src), str(remote), items).ok
    assert (remote / long).read_bytes() == b"long"


def test_checksum_verification_and_restart_options(gridftp, remote, tmp_path, counted):
    src = tmp_path / "src"
    items = write_files(src, 4)
    transport = open_transport(gridftp.url(str(remote)), verify_checksum=True, restart=True, pipeline=False)
    assert transport.transfer(Direction.PUSH, str(src), str(remote), items).ok
    (call,) = counted()
    assert "-verify-checksum -checksum-alg MD5" in call and "-rst" in call and "-pp" not in call


def test_permission_denied_on_the_far_side(tmp_path):
    """A server whose anonymous sessions run as nobody, writing into a directory of root's."""
    if os.getuid() != 0:
        pytest.skip("needs root to start a server that maps sessions to another account")
    server = start_gridftp(tmp_path / "server", user="nobody")
    try:
        shared = tmp_path / "shared"
        (shared / "locked").mkdir(parents=True)
        for path in (tmp_path, shared, shared / "locked"):
            path.chmod(0o755)
        src = tmp_path / "src"
        items = write_files(src, 2)
        transport = open_transport(server.url(str(shared / "locked")))
        result = transport.transfer(Direction.PUSH, str(src), str(shared / "locked"), items)
        assert result.done == [] and sorted(result.failed) == sorted(items)
        assert all(isinstance(e, RemotePermissionError) for e in result.failed.values()), result.failed
        with pytest.raises(RemotePermissionError):
            transport.mkdir(str(shared / "locked" / "sub"))
    finally:
        server.stop()


def test_an_individual_push_kept_packed_to_gridftp_needs_nothing_to_run_there(gridftp, tmp_path):
    """No ssh and no --unpack-via: nothing runs at the far side, so no unpack journal can be there and the
    push drops none; it sends the files (GridFTP keeps neither modes nor directory times, so only names and
    bytes are compared) and leaves nothing of pallet's."""
    from tests.conftest import run_pallet
    from tests.test_hostile_state import small_tree
    src, dest = small_tree(tmp_path / "src"), tmp_path / "dest"
    dest.mkdir()
    done = run_pallet("push", "--keep-packed", "--strategy", "individual", src, gridftp.url(str(dest)))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    sent = {p.relative_to(src): p.read_bytes() for p in Path(src).rglob("*") if p.is_file()}
    assert {p.relative_to(dest): p.read_bytes() for p in dest.rglob("*") if p.is_file()} == sent
    assert not (dest / ".pallet").exists()
