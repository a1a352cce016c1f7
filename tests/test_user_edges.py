"""The edges a new user meets: local DEST problems, unknown options, a far-side Python without pallet, relative
paths."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.conftest import run_pallet
from tests.programs import program, user_env

DESTINATION = 1     # DestinationError's exit status
USAGE = 2


def assert_one_error(done: subprocess.CompletedProcess, status: int, *words: str) -> None:
    """Exit ``status``, no traceback or internal error, and the error line names every one of ``words``."""
    assert done.returncode == status, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr, done.stderr
    error = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert error and all(word in error[0] for word in words), done.stderr


@pytest.fixture
def src(tmp_path):
    tree = tmp_path / "src"
    (tree / "sub").mkdir(parents=True)
    for n in range(5):
        (tree / "sub" / f"f{n}.txt").write_text(f"file {n}\n")
    return tree


def _without_write_override() -> list[str]:
    """A prefix running a command as root without CAP_DAC_OVERRIDE: it meets directory permissions as a user
    does (root otherwise writes anywhere)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop the capability to write everywhere")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", "--bounding-set", caps, "--inh-caps", caps]


def test_a_pull_into_a_dest_under_a_regular_file_is_named(src, tmp_path):
    (tmp_path / "afile").write_text("keep me\n")
    done = run_pallet("pull", str(src), str(tmp_path / "afile" / "dest"))
    assert_one_error(done, DESTINATION, "afile/dest", "Not a directory")
    assert (tmp_path / "afile").read_text() == "keep me\n"


@pytest.mark.parametrize("strategy", ["individual", "bundle"])
def test_a_pull_into_a_read_only_parent_is_named(src, tmp_path, strategy):
    parent = tmp_path / "read-only"
    parent.mkdir(mode=0o555)
    done = subprocess.run([*_without_write_override(), program("pallet"), "pull", "--strategy", strategy, str(src),
                           str(parent / "dest")], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          env=user_env())
    assert_one_error(done, DESTINATION, "read-only/dest", "Permission denied")
    assert os.listdir(parent) == []


@pytest.mark.parametrize("strategy", ["individual", "bundle"])
def test_a_local_push_into_a_read_only_dest_names_it_as_the_destination(src, tmp_path, strategy):
    dest = tmp_path / "dest"
    dest.mkdir(mode=0o555)
    done = subprocess.run([*_without_write_override(), program("pallet"), "push", "--strategy", strategy, str(src),
                           str(dest)], capture_output=True, text=True, stdin=subprocess.DEVNULL, env=user_env())
    assert_one_error(done, DESTINATION, str(dest), "Permission denied")
    assert "remote" not in done.stderr
    assert os.listdir(dest) == []


def test_an_unknown_option_gets_the_commands_own_usage(src, tmp_path):
    done = run_pallet("push", "--dleete", str(src), str(tmp_path / "dest"))
    assert done.returncode == USAGE and "Traceback" not in done.stderr
    assert "usage: pallet push" in done.stderr and "pallet push: error: unrecognized arguments: --dleete" \
        in done.stderr, done.stderr
    assert not (tmp_path / "dest").exists()


def test_mounting_onto_a_missing_directory_says_it_does_not_exist(src, tmp_path):
    bundle = tmp_path / "b.tar.zst"
    run_pallet("pack", "--quiet", str(src), str(bundle), check=True)
    done = run_pallet("mount", str(bundle), str(tmp_path / "nowhere"))
    assert_one_error(done, USAGE, "nowhere", "does not exist")
    assert "mkdir -p" in done.stderr


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_a_remote_python_without_pallet_says_how_to_go_on(sshd, src, tmp_path, direction):
    flags = [*(f"--ssh-option={option}" for option in sshd.ssh_options), "--remote-python", "/usr/bin/python3"]
    here, there = str(tmp_path / "here"), sshd.url(str(tmp_path / "there"))
    argv = [direction, "--strategy", "bundle", *flags, *((str(src), there) if direction == "push" else
                                                         (sshd.url(str(src)), here))]
    done = run_pallet(*argv)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert "/usr/bin/python3" in done.stderr and "has no pallet" in done.stderr, done.stderr
    assert "--remote-python" in done.stderr and "pallet remote install" in done.stderr, done.stderr


def test_the_library_takes_a_relative_source(sshd, src, tmp_path):
    """``operations.push`` with a relative SRC, sent individually over ssh (it said "must be an absolute path")."""
    script = ("import sys\nfrom staging_core.operations.push_pull import push\n"
              "from staging_core.options import StagingOptions\n"
              "options = StagingOptions(strategy='individual', ssh_options=tuple(sys.argv[2:]))\n"
              "print(push('src', sys.argv[1], options).strategy)\n")
    done = subprocess.run([program("python"), "-c", script, sshd.url(str(tmp_path / "dest")), *sshd.ssh_options],
                          cwd=tmp_path, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=user_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "individual"
    assert sorted(os.listdir(tmp_path / "dest" / "sub")) == [f"f{n}.txt" for n in range(5)]

