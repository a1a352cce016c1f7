"""pallet as users install it (plain, default editable, bootstrap's strict editable): `snakemake` finds the plugin,
and `pallet remote install` puts pallet on a loopback host from each."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import release_shared, shared_by_workers
from tests.programs import BIN, fresh_install, user_env
from tests.test_remote_install import start_far_side

EDITABLE = "pip install -e '.[snakemake]'"            # setuptools' default editable mode (not bootstrap's strict)
INSTALLS = ["pip install (not editable)", "pip install -e (default editable)"]

INPUTS = 1000
SNAKEFILE = """
rule all:
    input: [storage.pallet(f"file://{data}/s{{n:04d}}.csv") for n in range({count})]
    output: "sum.txt"
    run:
        total = 0
        for path in input:
            with open(path) as handle:
                total += int(handle.read().split(",")[1])
        with open(output[0], "w") as out:
            out.write(f"{{len(input)}} {{total}}\\n")
"""


def run_snakemake(bin_dir: Path, workdir: Path, data: Path) -> subprocess.CompletedProcess:
    """`env -i PATH=... HOME=... snakemake`: nothing but the install tells it where the plugin is."""
    workdir.mkdir()
    (workdir / "Snakefile").write_text(SNAKEFILE.format(data=data, count=INPUTS))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(workdir)}
    return subprocess.run([str(bin_dir / "snakemake"), "--cores", "1"], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def tiny_inputs(root: Path) -> Path:
    root.mkdir()
    for n in range(INPUTS):
        (root / f"s{n:04d}.csv").write_text(f"{n},{3 * n}\n")
    return root


@pytest.fixture(scope="session")
def editable_venv():
    """bin/ of a new virtualenv made by `pip install -e '.[snakemake]'` in a copy of the source (setuptools'
    default editable mode: an import hook serves the packages), shared by the suite's workers."""
    with shared_by_workers("pallet-editable-venv") as root:
        if not (root / "made").exists():
            fresh_install(root / "venv", EDITABLE)
            (root / "made").touch()
    try:
        yield root / "venv" / "bin"
    finally:
        release_shared(root)


def venv_of(install: str, request) -> Path:
    """The bin/ of the fresh virtualenv that ``install`` (one of INSTALLS) made."""
    return request.getfixturevalue("editable_venv" if " -e " in install else "fresh_venv")


@pytest.mark.slow
@pytest.mark.parametrize("install", [*INSTALLS, "bootstrap (strict editable)"])
def test_a_plain_snakemake_finds_the_plugin_and_reads_1000_inputs(install, request, tmp_path):
    bin_dir = BIN if install.startswith("bootstrap") else venv_of(install, request)
    done = run_snakemake(bin_dir, tmp_path / "wf", tiny_inputs(tmp_path / "data"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "wf" / "sum.txt").read_text() == f"{INPUTS} {3 * INPUTS * (INPUTS - 1) // 2}\n"
    assert f"pallet: fetched {INPUTS} object(s)" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("install", INSTALLS)
def test_snakemake_help_lists_the_plugins_options(install, request):
    bin_dir = venv_of(install, request)
    done = subprocess.run([str(bin_dir / "snakemake"), "--help"], capture_output=True, text=True, cwd="/",
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": "/"}, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--storage-pallet-ssh-options" in done.stdout and "--storage-pallet-keep-packed" in done.stdout


def far_pallet(bin_dir: Path, far, cache: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`pallet ARGS --ssh-option=... HOST` run from the virtualenv ``bin_dir`` (first on PATH)."""
    options = [f"--ssh-option={o}" for o in far.server.ssh_options]
    path = f"{bin_dir}{os.pathsep}{user_env()['PATH']}"
    return subprocess.run([str(bin_dir / "pallet"), *args, *options, far.host], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, env=user_env(PATH=path, XDG_CACHE_HOME=str(cache), **env),
                          timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("install", INSTALLS)
def test_remote_install_works_from_the_install(install, request, tmp_path_factory):
    """pallet's own wheel for the far side: a plain install ships its installed files packed again (no build, so
    no wheel or setuptools-rust needed here); an editable one is built from its source with build isolation."""
    bin_dir = venv_of(install, request)
    far = start_far_side(tmp_path_factory.mktemp("far"), tmp_path_factory.getbasetemp() / "install-wheel-cache")
    try:
        done = far_pallet(bin_dir, far, far.cache, "remote", "install", "--json")
        assert done.returncode == 0, done.stderr[-3000:]
        assert "Traceback" not in done.stderr
        assert json.loads(done.stdout)["wheel_from"] == ("built" if " -e " in install else "installed")
        status = far_pallet(bin_dir, far, far.cache, "remote", "status", "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["usable"] and json.loads(status.stdout)["matches"]
    finally:
        far.server.stop()


@pytest.mark.slow
def test_an_editable_install_that_cannot_build_its_wheel_says_so_in_one_line(editable_venv, tmp_path):
    """No wheel or setuptools-rust here and no package index: one error line and the fix, nothing shipped."""
    far = start_far_side(tmp_path / "far", tmp_path / "cache")
    try:
        done = far_pallet(editable_venv, far, far.cache, "remote", "install", PIP_INDEX_URL="http://127.0.0.1:9/simple",
                          PIP_RETRIES="0", PIP_TIMEOUT="2")
    finally:
        far.server.stop()
    assert done.returncode == 1 and "Traceback" not in done.stderr
    progress, error, hint = done.stderr.splitlines()[-3:]
    assert progress.startswith("pallet: ") and progress.endswith("gathering wheels ...")
    assert error.startswith("pallet remote: error: building pallet's wheel (this Python lacks setuptools, wheel or "
                            "setuptools-rust, so pip builds with isolation, fetching them) failed: "), error
    assert "No matching distribution" in error, error
    assert hint.startswith("  hint: install them into this Python (") and "setuptools wheel setuptools-rust" in hint
    assert not (far.home / ".local").exists()
