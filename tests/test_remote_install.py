"""`pallet remote install/status` against a real loopback sshd whose sessions have a HOME of their own and no
network."""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest

from bundles.stream_reply import STREAM_VERSION
from mpi_stager.wire import SESSION_VERSION
from staging_core.testing import assert_same_tree, make_nasty_tree
from tests.programs import program, user_env
from tests.servers import SSHServer, free_port, start_sshd

# The far side's shell start-up: no pallet on PATH, its own TMPDIR, and a pip that would fail on any use of the
# package index (nothing listens on port 9), so only pallet's --no-index lets the install succeed.
FAR_BASHRC = """\
export PATH=/usr/local/bin:/usr/bin:/bin TMPDIR={tmp}
export PIP_INDEX_URL=http://127.0.0.1:9/simple PIP_RETRIES=0 PIP_TIMEOUT=2
unset PIP_NO_INDEX PIP_FIND_LINKS PYTHONPATH http_proxy https_proxy HTTP_PROXY HTTPS_PROXY all_proxy ALL_PROXY
"""

# A Python that answers like an old one: the real python3 with sys.version_info of 3.6.15 (or without ensurepip).
FAKE_PYTHON = """#!/bin/sh
[ "$1" = -c ] || exit 2
exec python3 -c 'import sys; {patch}; exec(sys.argv[1])' "$2"
"""
OLD = 'sys.version_info = (3, 6, 15, "final", 0)'
NO_VENV = 'sys.modules["ensurepip"] = None'

IMPORTS_PALLET = ("import mpi_stager, bundles.stream; from importlib.metadata import version; "
                  "print(mpi_stager.__file__, version('pallet'), bundles.stream.STREAM_VERSION)")


@dataclass
class FarSide:
    server: SSHServer
    home: Path
    tmp: Path
    cache: Path

    pushed_before: dict | None = None

    def ssh(self) -> list[str]:
        return ["ssh", *self.server.ssh_options, "-p", str(self.server.port), f"{self.server.user}@127.0.0.1"]

    @property
    def host(self) -> str:
        return f"{self.server.user}@127.0.0.1:{self.server.port}"

    def pallet(self, *args: str) -> subprocess.CompletedProcess:
        """`pallet ARGS --ssh-option=... HOST` as a user runs it, with a wheel cache of the test's own."""
        options = [f"--ssh-option={o}" for o in self.server.ssh_options]
        return subprocess.run([program("pallet"), *args, *options, self.host], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, env=user_env(XDG_CACHE_HOME=str(self.cache)), timeout=600)

    def fake_python(self, name: str, patch: str) -> str:
        path = self.home / "bin" / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(FAKE_PYTHON.format(patch=patch))
        path.chmod(0o755)
        return str(path)


def start_far_side(root: Path, cache: Path) -> FarSide:
    home, tmp = root / "home", root / "tmp"
    home.mkdir(parents=True)
    tmp.mkdir()
    (home / ".bashrc").write_text(FAR_BASHRC.format(tmp=tmp))
    server = start_sshd(root / "sshd", (f"SetEnv HOME={home}",))
    far = FarSide(server, home, tmp, cache)
    lacks = subprocess.run([*far.ssh(), "echo $HOME; python3 -c 'import mpi_stager' 2>/dev/null || echo absent"],
                           capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert lacks.stdout.split() == [str(home), "absent"], "the far side must have its own HOME and no pallet"
    return far


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("wheel-cache")


@pytest.fixture(scope="module")
def bare(tmp_path_factory, cache):
    """A far side where nothing gets installed."""
    far = start_far_side(tmp_path_factory.mktemp("bare"), cache)
    yield far
    far.server.stop()


@pytest.fixture(scope="module")
def installed(tmp_path_factory, cache):
    """A far side after one `pallet remote install --json`; yields it with that run (a push before the install
    has cached the probe's findings there: no pallet)."""
    far = start_far_side(tmp_path_factory.mktemp("far"), cache)
    try:
        far.pushed_before = push(far, tmp_path_factory.mktemp("before"))
        yield far, far.pallet("remote", "install", "--json")
    finally:
        far.server.stop()


def push(far: FarSide, root: Path) -> dict:
    """Push a small nasty tree to ``root``/dest on the far side as a bundle; return the summary."""
    src = make_nasty_tree(str(root / "src"))
    done = subprocess.run([program("pallet"), "push", "--json", "--strategy", "bundle",
                           *[f"--ssh-option={o}" for o in far.server.ssh_options], src,
                           far.server.url(str(root / "dest"))], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, env=user_env(XDG_CACHE_HOME=str(far.cache)), timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert_same_tree(src, root / "dest", whole_seconds="tar tools" in summary["route"])     # the far side's tar
    return summary


@pytest.mark.slow
def test_install_works_without_network_there_and_is_recorded(installed):
    far, done = installed
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    progress = done.stderr.splitlines()
    assert progress[0] == f"pallet: checking python3 on {far.host} ..."
    assert any(line.startswith("pallet: shipping ") and " wheels (" in line and "MiB) to" in line for line in progress)
    assert progress[-1].startswith(f"pallet: installed pallet {version('pallet')} at ")
    summary = json.loads(done.stdout)
    prefix = far.home / ".local" / "share" / "pallet" / "venv"
    assert summary["prefix"] == str(prefix) and summary["venv"] == "created" and summary["downloaded"] is True
    recorded = (far.home / ".config" / "pallet" / "python").read_text()
    assert recorded == f"{prefix}/bin/python\n" == summary["remote_python"] + "\n"
    found = subprocess.run([recorded.strip(), "-c", IMPORTS_PALLET], capture_output=True, text=True, cwd=far.home,
                           env={"PATH": "/usr/bin:/bin", "HOME": str(far.home)}, check=True).stdout.split()
    assert found[0].startswith(str(prefix)) and found[1:] == [version("pallet"), str(STREAM_VERSION)]
    assert list(far.tmp.iterdir()) == [], "the shipped wheels must be removed there"
    poisoned = subprocess.run([*far.ssh(), f"{prefix}/bin/python -m pip download --no-deps -d ~/poison rich"],
                              capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert poisoned.returncode != 0 and "No matching distribution" in poisoned.stderr, "pip there must be offline"


@pytest.mark.slow
def test_push_finds_the_recorded_pallet_at_once(installed, tmp_path):
    far, done = installed
    assert done.returncode == 0, done.stderr
    assert far.pushed_before["route"].startswith("tar tools")        # no pallet there yet (and cached so)
    assert not push(far, tmp_path)["route"].startswith("tar tools")  # the install dropped those findings


@pytest.mark.slow
def test_status_reports_the_installed_pallet(installed):
    far, _ = installed
    done = far.pallet("remote", "status")
    assert done.returncode == 0, done.stderr
    assert f"pallet {version('pallet')} (stream protocol v{STREAM_VERSION}, session protocol v{SESSION_VERSION})" \
        in done.stdout
    assert "the same as here" in done.stdout and "python3 there: 3." in done.stdout
    report = json.loads(far.pallet("remote", "status", "--json").stdout)
    assert report["usable"] and report["matches"] and report["recorded"] == report["pallet_python"]


@pytest.mark.slow
def test_a_second_install_keeps_the_venv_and_uses_the_wheel_cache(installed):
    far, _ = installed
    done = far.pallet("remote", "install", "--json", "--quiet")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    summary = json.loads(done.stdout)
    assert summary["venv"] == "kept" and summary["downloaded"] is False
    assert summary["pallet_version"] == version("pallet")
    assert list(far.tmp.iterdir()) == []


def test_a_too_old_python_there_is_refused_in_one_line(bare):
    old = bare.fake_python("python3.6", OLD)
    done = bare.pallet("remote", "install", "--python", old, "--prefix", "old-venv")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    progress, message = done.stderr.splitlines()           # the first line is the progress line "checking ..."
    assert progress.startswith(f"pallet: checking {old} on ")
    assert "Python 3.6.15" in message and "--python" in message and ">=3.11" in message
    assert not (bare.home / "old-venv").exists()


def test_a_python_without_venv_there_is_refused_with_the_fix(bare):
    done = bare.pallet("remote", "install", "--python", bare.fake_python("python-no-venv", NO_VENV))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "cannot create virtualenvs" in done.stderr and "python3-venv" in done.stderr
    assert not (bare.home / ".local").exists()


def test_status_of_a_host_without_pallet_says_how_to_install(bare):
    done = bare.pallet("remote", "status")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "no pallet" in done.stdout and "recorded in ~/.config/pallet/python: nothing" in done.stdout
    assert f"pallet remote install {bare.host}" in done.stderr


def test_bad_hosts_are_usage_errors_and_unreachable_ones_transport_failures(tmp_path):
    env = user_env(XDG_CACHE_HOME=str(tmp_path))
    usage = subprocess.run([program("pallet"), "remote", "install", "login.hpc:/scratch"], capture_output=True,
                           text=True, env=env, stdin=subprocess.DEVNULL)
    assert usage.returncode == 2 and "not an ssh host" in usage.stderr
    closed = subprocess.run([program("pallet"), "remote", "status", "--ssh-option=-oBatchMode=yes",
                             f"127.0.0.1:{free_port()}"], capture_output=True, text=True, env=env,
                            stdin=subprocess.DEVNULL, timeout=120)
    assert closed.returncode == 3 and "Traceback" not in closed.stderr
