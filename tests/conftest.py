"""Shared fixtures; the tree helpers live in staging_core.testing, shipped with the package."""
from __future__ import annotations

import fcntl
import glob
import os
import shutil
import subprocess
from contextlib import contextmanager, suppress
from pathlib import Path
from collections.abc import Iterator

import pytest

from bundles import pack
from staging_core.testing import (MTIME_NS, assert_same_tree, make_nasty_tree, normalize_groups,  # noqa: F401
                                  snapshot)
from tests.docs import doc_block
from tests.programs import fresh_install, program, user_env
from tests.servers import start_sshd


@pytest.fixture(scope="session", autouse=True)
def probe_cache(tmp_path_factory):
    """Far-side probes are cached under $XDG_CACHE_HOME and local-copy profiles saved under $XDG_CONFIG_HOME:
    the suite's own, never the user's."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("xdg-config"))


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """A real sshd on 127.0.0.1 for the whole session (skipped where sshd is not installed)."""
    if not os.path.exists("/usr/sbin/sshd"):
        pytest.skip("openssh-server is not installed (./bootstrap.sh installs it)")
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def fresh_venv():
    """bin/ of a new virtualenv made by docs/snakemake.md's install command (`pip install '.[snakemake]'`, not
    editable), readable by every user. The suite's parallel workers share one (see :func:`shared_by_workers`)."""
    with shared_by_workers("pallet-fresh-venv") as root:
        bin_dir = root / "venv" / "bin"
        if not (root / "made").exists():
            fresh_install(root / "venv", doc_block("docs/snakemake.md", "pip install '.[snakemake]'").text)
            (root / "made").touch()
    try:
        yield bin_dir
    finally:
        release_shared(root)


@contextmanager
def shared_by_workers(name: str) -> Iterator[Path]:
    """``/tmp/NAME-RUN`` (mode 0755, readable by every user), held under its lock for the block: RUN is the
    test run shared by all pytest-xdist workers (this process alone without xdist). Each entry counts one
    user; :func:`release_shared` drops it and removes the directory after the last."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"{os.getpid()}"
    root = Path(f"/tmp/{name}-{run}")
    with _holding(root) as users:
        users.write_text(str(int(users.read_text() or 0) + 1))
        yield root


def release_shared(root: Path) -> None:
    with _holding(root) as users:
        left = int(users.read_text() or 0) - 1
        users.write_text(str(left))
        if left <= 0:                    # removed under the lock; a waiter finds its lock file gone and retries
            shutil.rmtree(root)


@contextmanager
def _holding(root: Path) -> Iterator[Path]:
    """The flock of ``root/lock`` held (``root`` made if missing); yields the ``users`` count file."""
    while True:
        root.mkdir(mode=0o755, exist_ok=True)
        try:
            lock = open(root / "lock", "a")  # noqa: SIM115 - entered by `with lock:` below; opened apart to retry
        except FileNotFoundError:        # removed by the last user between mkdir and open
            continue
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                current = os.stat(root / "lock").st_ino == os.fstat(lock.fileno()).st_ino
            except FileNotFoundError:
                current = False
            if current:
                users = root / "users"
                users.touch()
                yield users
                return


@pytest.fixture(params=["native", "python"])
def each_engine(request, monkeypatch) -> str:
    """Run the test once with each engine (PALLET_ENGINE reaches in-process calls and the programs the test
    starts); a module opts in with ``pytestmark = pytest.mark.usefixtures("each_engine")``."""
    monkeypatch.setenv("PALLET_ENGINE", request.param)
    return request.param


@pytest.fixture
def nasty_tree(tmp_path) -> str:
    return make_nasty_tree(str(tmp_path / "src"))


@pytest.fixture
def sweep_mpi_segments():
    """Remove the shared-memory segments (/dev/shm/vader_segment.*) that mpirun jobs killed by the test left:
    those made during the test that no live process maps (the suite's parallel workers may run MPI jobs too)."""
    pattern = "/dev/shm/vader_segment.*"
    before = set(glob.glob(pattern))
    yield
    for path in set(glob.glob(pattern)) - before - mapped_files():
        with suppress(FileNotFoundError):
            os.unlink(path)


def mapped_files() -> set[str]:
    """Every file some process on this machine has mapped (from /proc/PID/maps)."""
    found = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as lines:
                found.update(line.split(None, 5)[5].strip() for line in lines if line.count(" ") >= 5)
        except (OSError, IndexError):
            continue
    return found


@pytest.fixture(scope="session")
def good_bundle(tmp_path_factory):
    """A real bundle: top.txt, suid, dir/, dir/file.txt, symlinks sym -> top.txt, sym2 -> dir, hard_a = hard_b."""
    src = tmp_path_factory.mktemp("tamper") / "src"
    (src / "dir").mkdir(parents=True)
    for rel in ("top.txt", "dir/file.txt", "hard_a", "suid"):
        (src / rel).write_bytes(rel.encode())
    os.link(src / "hard_a", src / "hard_b")
    os.symlink("top.txt", src / "sym")
    os.symlink("dir", src / "sym2")
    return pack(src, src.parent / "good.tar.zst").bundle


def make_files(root, count: int, dirs: int, content) -> str:
    """``count`` files ``d<k>/f<n>`` spread over ``dirs`` directories under ``root``, each holding
    ``content(n)`` (bytes); returns ``root`` as a string."""
    for n in range(count):
        path = Path(root) / f"d{n % dirs}" / f"f{n:05d}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content(n))
    return str(root)


def run_pallet(*args: str, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """Run the installed `pallet` command in a user's environment (``env`` adds to it)."""
    env = user_env(**kwargs.pop("env", {}))
    done = subprocess.run([program("pallet"), *args], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          env=env, **kwargs)
    if check and done.returncode != 0:
        raise AssertionError(f"pallet {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return done
