"""A destination whose writes start failing with EIO mid-operation (a FUSE pass-through the test mounts,
tests/faulty_fs.py): one line naming the path, a documented exit status, nothing pallet's left outside
DEST/.pallet, and a rerun on the healed file system converges to the source."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import assert_same_tree, make_files, run_pallet
from tests.programs import program, user_env

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse") or not shutil.which("fusermount3"),
                                reason="FUSE is not available (./bootstrap.sh installs fuse3)")
FAULTY_FS = str(Path(__file__).with_name("faulty_fs.py"))
# changes that succeed before the disk breaks: at once, early (directories made), midway through the files
FAIL_AFTER = (0, 3, 60)


@contextlib.contextmanager
def faulty(backing: Path, mountpoint: Path, fail_after: int, error: str = "EIO"):
    """``mountpoint`` shows ``backing``; after ``fail_after`` changes every change fails with ``error``."""
    backing.mkdir(exist_ok=True)
    mountpoint.mkdir(exist_ok=True)
    process = subprocess.Popen([program("python"), FAULTY_FS, str(backing), str(mountpoint), "--fail-after",
                                str(fail_after), "--errno", error], env=user_env(), stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while not os.path.ismount(mountpoint):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read().decode()
        time.sleep(0.05)
    try:
        yield mountpoint
    finally:
        subprocess.run(["fusermount3", "-u", str(mountpoint)], check=False)
        process.wait(timeout=30)
        process.stderr.close()


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    return make_files(tmp_path_factory.mktemp("eio") / "src", 120, 4, lambda n: os.urandom(1500 + n))


def _failed_cleanly(done: subprocess.CompletedProcess, command: str, cause: str = "input/output error") -> None:
    assert done.returncode in (1, 3), done.stderr
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"pallet {command}: error:"), done.stderr
    assert cause in done.stderr.lower(), done.stderr
    assert len([line for line in done.stderr.splitlines() if not line.startswith("  ")]) == 1, done.stderr


@pytest.mark.parametrize("fail_after", FAIL_AFTER)
def test_unpack_onto_a_failing_disk_then_a_rerun_converges(tmp_path, source, fail_after):
    bundle = tmp_path / "b.tar.zst"
    run_pallet("pack", "--quiet", source, str(bundle), check=True)
    with faulty(tmp_path / "disk", tmp_path / "mnt", fail_after) as mnt:
        _failed_cleanly(run_pallet("unpack", "--quiet", str(bundle), str(mnt / "dest"), timeout=120), "unpack")
    run_pallet("unpack", "--quiet", str(bundle), str(tmp_path / "disk" / "dest"), check=True)
    assert_same_tree(source, tmp_path / "disk" / "dest")


@pytest.mark.parametrize("strategy", ["bundle", "individual"])
@pytest.mark.parametrize("fail_after", FAIL_AFTER)
def test_local_push_onto_a_failing_disk_then_a_rerun_converges(tmp_path, source, strategy, fail_after):
    with faulty(tmp_path / "disk", tmp_path / "mnt", fail_after) as mnt:
        done = run_pallet("push", "--quiet", "--strategy", strategy, source, str(mnt / "dest"), timeout=120)
        _failed_cleanly(done, "push")
    run_pallet("push", "--quiet", "--strategy", strategy, source, str(tmp_path / "disk" / "dest"), check=True)
    assert_same_tree(source, tmp_path / "disk" / "dest")


@pytest.mark.parametrize("fail_after", (0, 1, 3))      # pack makes few changes: the bundle, its index, two renames
def test_pack_onto_a_failing_disk_leaves_no_bundle(tmp_path, source, fail_after):
    with faulty(tmp_path / "disk", tmp_path / "mnt", fail_after) as mnt:
        _failed_cleanly(run_pallet("pack", "--quiet", source, str(mnt / "b.tar.zst"), timeout=120), "pack")
    assert not any(name.endswith(".tar.zst") for name in os.listdir(tmp_path / "disk")), \
        os.listdir(tmp_path / "disk")
    run_pallet("pack", "--quiet", source, str(tmp_path / "disk" / "b.tar.zst"), check=True)
    run_pallet("verify", str(tmp_path / "disk" / "b.tar.zst"), check=True)


@pytest.mark.parametrize("fail_after", (0, 3, 60))
def test_permission_lost_midway_is_one_line_and_a_rerun_converges(tmp_path, source, fail_after):
    bundle = tmp_path / "b.tar.zst"
    run_pallet("pack", "--quiet", source, str(bundle), check=True)
    with faulty(tmp_path / "disk", tmp_path / "mnt", fail_after, "EACCES") as mnt:
        _failed_cleanly(run_pallet("unpack", "--quiet", str(bundle), str(mnt / "a"), timeout=120), "unpack",
                        "permission denied")
        done = run_pallet("push", "--quiet", "--strategy", "bundle", source, str(mnt / "b"), timeout=120)
        _failed_cleanly(done, "push", "permission denied")
    run_pallet("unpack", "--quiet", str(bundle), str(tmp_path / "disk" / "a"), check=True)
    run_pallet("push", "--quiet", "--strategy", "bundle", source, str(tmp_path / "disk" / "b"), check=True)
    for name in ("a", "b"):
        assert_same_tree(source, tmp_path / "disk" / name)


def _senders_of(src: str) -> list[int]:
    """Running `mpi_stager send` processes reading ``src``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
        except OSError:
            continue
        if b"mpi_stager" in argv and b"send" in argv and os.fsencode(src) in argv:
            found.append(int(pid))
    return found


@pytest.mark.parametrize("fail_after", (3, 60))
def test_a_streamed_pull_onto_a_failing_disk_stops_the_sender_and_a_rerun_converges(sshd, tmp_path, source,
                                                                                       fail_after):
    ssh = ["--remote-python", program("python"), *(f"--ssh-option={o}" for o in sshd.ssh_options)]
    with faulty(tmp_path / "disk", tmp_path / "mnt", fail_after) as mnt:
        done = run_pallet("pull", "--quiet", "--strategy", "bundle", "--retries", "0", "--shard-size", "16384",
                          *ssh, sshd.url(source), str(mnt / "dest"), timeout=120)
        _failed_cleanly(done, "pull")
    deadline = time.monotonic() + 10
    while _senders_of(source) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _senders_of(source), "the far side's sender outlived the failed pull"
    run_pallet("pull", "--quiet", "--strategy", "bundle", *ssh, sshd.url(source), str(tmp_path / "disk" / "dest"),
               check=True)
    assert_same_tree(source, tmp_path / "disk" / "dest")
