"""The individual route's discipline: rsync's temporaries never outlive a run, DEST is marked while files land."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from staging_core.testing import assert_same_tree, snapshot
from tests.conftest import run_pallet
from tests.programs import program, user_env
from tests.servers import start_sshd

# The far side's rsync: the first receiving run is killed with -9 as soon as a temporary file of rsync's
# (".big.XXXXXX", or "big.XXXXXX" in a --temp-dir) appears under the watched directory; later runs are the real one.
KILLING_RSYNC = textwrap.dedent("""\
    #!{python}
    import os, re, signal, subprocess, sys, time
    home = os.environ["HOME"]
    flag, watch = os.path.join(home, "killed"), open(os.path.join(home, "watch")).read().strip()
    if os.path.exists(flag) or "--server" not in sys.argv:
        os.execv("/usr/bin/rsync", ["rsync", *sys.argv[1:]])
    child = subprocess.Popen(["/usr/bin/rsync", *sys.argv[1:]])
    temporary = re.compile(r"^\\.?big\\.[A-Za-z0-9]{{6}}$")     # in DEST, or in a --temp-dir (no dot)
    while child.poll() is None:
        for top, dirs, files in os.walk(watch):
            if any(temporary.match(name) for name in files):
                child.send_signal(signal.SIGKILL)
                child.wait()
                open(flag, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)     # as a far-side rsync killed with -9 ends
    sys.exit(child.returncode)
""")


@pytest.fixture
def killing_far_side(tmp_path):
    """An sshd whose sessions find KILLING_RSYNC first on PATH (set by a quiet ~/.bashrc)."""
    home, shims = tmp_path / "home", tmp_path / "home" / "bin"
    shims.mkdir(parents=True)
    (shims / "rsync").write_text(KILLING_RSYNC.format(python=sys.executable))
    (shims / "rsync").chmod(0o755)
    (home / ".bashrc").write_text(f'export PATH="{shims}:/usr/local/bin:/usr/bin:/bin"\n')
    server = start_sshd(tmp_path / "sshd", (f"SetEnv HOME={home}",))
    server.home = home
    yield server
    server.stop()


def test_a_killed_far_side_rsync_leaves_no_temporary_in_dest(killing_far_side, tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "big").write_bytes(os.urandom(48 << 20))
    for n in range(20):
        (src / f"small{n}").write_bytes(b"small %d\n" % n)
    dest = tmp_path / "dest"
    (killing_far_side.home / "watch").write_text(str(dest))
    flags = [f"--ssh-option={option}" for option in killing_far_side.ssh_options]
    done = run_pallet("push", "--json", "--strategy", "individual", *flags, str(src),
                      killing_far_side.url(str(dest)), timeout=600)
    assert (killing_far_side.home / "killed").exists(), f"the far side rsync was never killed:\n{done.stderr}"
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["attempts"] >= 2
    assert_same_tree(str(src), str(dest))       # strict: no ".big.XXXXXX", no .pallet


def test_files_land_only_in_a_dest_marked_incomplete(tmp_path):
    """Caught as its first files land, an individual push has DEST marked INCOMPLETE."""
    src = tmp_path / "src"
    for n in range(6000):
        path = src / f"d{n % 20}" / f"f{n}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"%d\n" % n)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep").write_bytes(b"there before\n")        # not empty: the push compares, then goes individual
    process = subprocess.Popen([program("pallet"), "push", "--quiet", "--strategy", "individual", str(src),
                                str(dest)], stdin=subprocess.DEVNULL, env=user_env(), start_new_session=True)
    try:
        landed: list[str] = []
        while process.poll() is None and not landed:
            landed = [name for name in os.listdir(dest) if name not in ("keep", ".pallet")]
        marked = os.path.exists(dest / ".pallet" / "INCOMPLETE")
        running = process.poll() is None
    finally:
        process.kill()
        process.wait()
    assert landed and running, "the push ended before its files were seen landing: give it a bigger tree"
    assert marked, f"{landed[:3]} landed in DEST with no INCOMPLETE marker"


def _swap_until(stop: threading.Event, victim: Path, outside: Path) -> int:
    """Swap ``victim`` (a directory of DEST) for a symbolic link to ``outside`` and back, as fast as it can,
    until ``stop`` is set; the number of swaps."""
    hidden, swaps = victim.with_name(victim.name + ".away"), 0
    while not stop.is_set():
        try:
            victim.rename(hidden)
            victim.symlink_to(outside)
            swaps += 1
            victim.unlink()
            hidden.rename(victim)
        except OSError:
            continue
    return swaps


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_a_dest_directory_swapped_for_a_link_mid_run_leads_nowhere(tmp_path, each_engine, direction):
    """Someone on shared scratch swaps DEST's directories for links to their own while an individual push or
    pull writes there: nothing is written outside DEST, whatever the run's outcome."""
    src = tmp_path / "src"
    for n in range(2000):
        path = src / f"d{n % 20}" / f"f{n}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"%d\n" % n * 100)
    outside = tmp_path / "outside"
    outside.mkdir()
    for n in range(0, 2000, 20):
        (outside / f"f{n}").write_bytes(b"victim\n")
    before = snapshot(str(outside))
    dest = tmp_path / "dest"
    (dest / "d0").mkdir(parents=True)
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        swapping = pool.submit(_swap_until, stop, dest / "d0", outside)
        try:
            done = run_pallet(direction, "--quiet", "--strategy", "individual", "--retries", "0", str(src),
                              str(dest), timeout=300)
        finally:
            stop.set()
        swaps = swapping.result()
    assert swaps, "the swapping thread never swapped"
    assert snapshot(str(outside)) == before, f"{direction} wrote outside DEST through a swapped-in link"
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr, done.stderr
