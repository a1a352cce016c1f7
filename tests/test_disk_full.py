"""A destination file system that fills up, or is read-only: a clear error and exit status, nothing lost, and a
rerun converges once there is room. The file system is a small tmpfs the test mounts (root only), grows and
remounts read-only."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import assert_same_tree, make_files, run_pallet

SMALL, ROOMY = "256k", "16m"


@pytest.fixture
def small_fs(tmp_path):
    """A 256 KiB tmpfs at tmp_path/small; ``grow()`` gives it room."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL}", "tmpfs", str(mount_point)]).returncode:
        pytest.skip("this machine does not let the test mount a tmpfs")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def grow(mount_point) -> None:
    subprocess.run(["mount", "-o", f"remount,size={ROOMY}", str(mount_point)], check=True)


def fill(mount_point) -> None:
    """Take every free byte and inode-free block of the file system with one file."""
    with open(mount_point / "filler", "wb") as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError:
            pass


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    """About 1 MiB in 400 files: four times the small file system."""
    return make_files(tmp_path_factory.mktemp("full") / "src", 400, 4, lambda n: os.urandom(2500))


def _failed_cleanly(done: subprocess.CompletedProcess, status: int, path) -> None:
    assert done.returncode == status, done.stderr
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr, done.stderr
    assert "space" in done.stderr.lower() and str(path) in done.stderr, done.stderr


@pytest.mark.parametrize("full_from_the_start", [False, True], ids=["fills-midway", "full-at-start"])
def test_unpack_into_a_full_file_system_then_a_rerun_converges(tmp_path, source, small_fs, full_from_the_start):
    bundle = tmp_path / "b.tar.zst"
    run_pallet("pack", "--quiet", "--codec", "none", source, str(bundle), check=True)
    dest = small_fs / "dest"
    if full_from_the_start:
        fill(small_fs)
    _failed_cleanly(run_pallet("unpack", "--quiet", str(bundle), str(dest)), 1, dest)
    assert (dest / ".pallet" / "INCOMPLETE").exists() or not any(dest.iterdir()), "a half-unpacked DEST unmarked"
    os.unlink(small_fs / "filler") if full_from_the_start else None
    grow(small_fs)
    run_pallet("unpack", "--quiet", str(bundle), str(dest), check=True)
    assert_same_tree(source, dest)


@pytest.mark.parametrize("strategy", ["bundle", "individual"])
def test_local_push_into_a_full_file_system_then_a_rerun_converges(source, small_fs, strategy):
    dest = small_fs / "dest"
    done = run_pallet("push", "--quiet", "--strategy", strategy, source, str(dest))
    assert done.returncode in (1, 3), done.stderr
    _failed_cleanly(done, done.returncode, dest)
    grow(small_fs)
    run_pallet("push", "--quiet", "--strategy", strategy, source, str(dest), check=True)
    assert_same_tree(source, dest)


def test_pack_onto_a_full_file_system_leaves_no_partial_bundle(source, small_fs):
    bundle = small_fs / "b.tar.zst"
    _failed_cleanly(run_pallet("pack", "--quiet", "--codec", "none", source, str(bundle)), 1, bundle)
    assert sorted(os.listdir(small_fs)) == [], "a failed pack left files behind"


def test_ssh_push_into_a_full_far_side_then_a_rerun_converges(sshd, source, small_fs):
    dest = small_fs / "dest"
    flags = ["--remote-python", sys.executable, *(f"--ssh-option={o}" for o in sshd.ssh_options)]
    done = run_pallet("push", "--quiet", "--strategy", "bundle", *flags, source, sshd.url(str(dest)))
    assert done.returncode in (1, 3), done.stderr
    _failed_cleanly(done, done.returncode, dest)
    grow(small_fs)
    run_pallet("push", "--quiet", "--strategy", "bundle", *flags, source, sshd.url(str(dest)), check=True)
    assert_same_tree(source, dest)


@pytest.fixture
def read_only_fs(small_fs):
    """The small tmpfs, grown, holding an empty directory ``dest``, then remounted read-only."""
    grow(small_fs)
    (small_fs / "dest").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    try:
        yield small_fs
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)


def _refused_read_only(done: subprocess.CompletedProcess, path) -> None:
    assert done.returncode in (1, 3), done.stderr
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr, done.stderr
    assert any(word in done.stderr.lower() for word in ("read-only", "permission", "not writable")), done.stderr
    assert str(path) in done.stderr, done.stderr


def test_a_read_only_destination_is_refused_in_one_line(tmp_path, source, read_only_fs):
    dest = read_only_fs / "dest"
    bundle = tmp_path / "b.tar.zst"
    run_pallet("pack", "--quiet", source, str(bundle), check=True)
    _refused_read_only(run_pallet("unpack", "--quiet", str(bundle), str(dest)), dest)
    for strategy in ("bundle", "individual"):
        _refused_read_only(run_pallet("push", "--quiet", "--strategy", strategy, source, str(dest)), dest)
    _refused_read_only(run_pallet("pack", "--quiet", source, str(read_only_fs / "b.tar.zst")), read_only_fs)
    assert os.listdir(dest) == []
