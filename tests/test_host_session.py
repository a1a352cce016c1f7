"""Host sessions against a real sshd: one connection and one far side for a run's operations, kills, threads,
idle ends, the private runtime directory, and a far side without pallet."""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from mpi_stager.wire import parse_records
from staging_core import StagingOptions, fetch, send
from staging_core.testing import assert_same_tree
from staging_core.transports.base import parse_url
from staging_core.transports.errors import TransportError
from staging_core.transports.ssh_socket import socket_path
from tests.conftest import run_pallet
from tests.host_session_rig import (DEADLINE_S, PARTIAL, Rig, assert_same_files, end_rig, far_serves, in_thread, kill,
                                    make_rig, make_tree, masters, open_files, partials, pending_input, read_chars,
                                    serve_clients, wait_until, wrong_files)
from tests.servers import count_invocations, start_bare_sshd


@pytest.fixture
def rig(sshd, tmp_path, monkeypatch):
    made = make_rig(sshd, tmp_path, monkeypatch)
    yield made
    end_rig(made)


# ---------------------------------------------------------------- 1. one connection, one far side

def test_many_operations_use_one_connection_and_one_far_side(rig, tmp_path, monkeypatch):
    calls = count_invocations(tmp_path / "shims", "ssh", monkeypatch)
    src = tmp_path / "src"
    items = make_tree(src, 12, 300)
    first = rig.send(src, items[:2])
    assert (first.strategy, first.route) == ("inline", "host session")
    (serve,), (master,) = far_serves(rig.tag), masters(rig.runtime)
    for n in range(10):
        assert rig.send(src, items[: n + 2]).strategy == "inline"
        done = rig.fetch(items[: n + 2], tmp_path / f"back{n % 3}", tree=src)
        assert (done.strategy, done.files) == ("inline", n + 2)
        listed = rig.session().request("list", str(tmp_path / "dest").encode())
        assert listed[:1] == b"+" and {p.decode() for p, e in parse_records(listed[1:]).items() if e.kind == "f"} \
            == set(items[: n + 2])
        stated = parse_records(rig.session().request("stat", f"{tmp_path}/dest/{items[0]}\0{tmp_path}/none".encode()))
        assert [e.size for e in stated.values()] == [300]
        assert far_serves(rig.tag) == [serve] and masters(rig.runtime) == [master]
    # the usual ways (a push of individual files, a streamed pull) go over the same connection
    usual = StagingOptions(ssh_options=rig.options.ssh_options, remote_python=rig.options.remote_python,
                           strategy="individual")
    assert send(str(src), items, rig.url("dest"), usual, sessions=rig.pool).strategy == "individual"
    pulled = fetch(rig.url("dest"), items, str(tmp_path / "pulled"), StagingOptions(
        ssh_options=rig.options.ssh_options, remote_python=rig.options.remote_python, strategy="bundle"),
        sessions=rig.pool)
    assert pulled.strategy == "bundle"
    assert_same_tree(src, tmp_path / "dest")
    assert_same_tree(src, tmp_path / "pulled")
    assert len([call for call in calls() if " -N " in call]) == 1, calls()
    assert far_serves(rig.tag) == [serve] and masters(rig.runtime) == [master]
    assert rig.session().far_sides_started == 1
    assert [wrong_files(src, tmp_path / f"back{k}") for k in range(3)] == [[], [], []]
    assert not partials(tmp_path / "dest", tmp_path / "back0")


def test_an_inline_fetch_gives_parent_directories_their_times(rig, tmp_path):
    remote = tmp_path / "remote"
    make_tree(remote, 3, 100)
    for directory in remote.iterdir():
        directory.chmod(0o750)
        os.utime(directory, ns=(1_000_000_000_123_456_789, 1_000_000_000_123_456_789))
    items = [str(p.relative_to(remote)) for p in sorted(remote.rglob("*.bin"))]
    done = rig.fetch(items, tmp_path / "back", src="remote", tree=remote)
    assert done.strategy == "inline"
    assert_same_tree(remote, tmp_path / "back")


# ---------------------------------------------------------------- 2. kills between and during operations

def _end_connection(rig: Rig, how: str) -> None:
    if how == "far side":
        (pid,) = far_serves(rig.tag)
        kill(pid)
    elif how == "master killed":
        # the master, or the far side's own ssh connection once there is none (test_a_killed_master_...)
        (pid,) = masters(rig.runtime) or serve_clients(rig.tag)
        kill(pid)
    else:
        (sock,) = (rig.runtime / "pallet").glob("ssh-*")
        subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "x"], capture_output=True, timeout=30)
        wait_until(lambda: not masters(rig.runtime), "the master to exit")
    # between operations: the far side and the local ssh running it are gone before the next one
    wait_until(lambda: not far_serves(rig.tag) and not serve_clients(rig.tag), "the far side and its ssh to end")


@pytest.mark.parametrize("how", ["far side", "master killed", "master told to exit"])
def test_a_far_side_or_connection_ended_between_operations(rig, tmp_path, how):
    src = tmp_path / "src"
    items = make_tree(src, 9, 500)
    assert rig.send(src, items[:3]).strategy == "inline"
    _end_connection(rig, how)
    assert rig.send(src, items).strategy == "inline"
    assert_same_tree(src, tmp_path / "dest")
    _end_connection(rig, how)
    assert rig.fetch(items, tmp_path / "back", tree=src).strategy == "inline"
    assert_same_files(src, tmp_path / "back")
    assert rig.session().far_sides_started == 3 and not partials(tmp_path / "dest", tmp_path / "back")


@pytest.mark.parametrize("when", ["far side killed while the request arrives", "far side killed while it writes",
                                  "master killed while the request arrives"])
def test_a_kill_during_a_put_leaves_no_wrong_bytes(rig, tmp_path, when):
    src = tmp_path / "src"
    rig.send(src, make_tree(src, 1, 10, prefix="warm"))
    (serve,) = far_serves(rig.tag)
    (master,) = masters(rig.runtime)
    writing = "writes" in when
    items = make_tree(src, 1500, 4096, prefix="w") if writing else make_tree(src, 8, 1 << 20, prefix="big")
    if not writing:
        kill(serve, signal.SIGSTOP)                     # the far side reads nothing: the put stays in flight
        before = read_chars(master)
    thread, box = in_thread(lambda: rig.send(src, items))
    if writing:
        wait_until(lambda: any((tmp_path / "dest" / f"w{k}" / PARTIAL).exists() for k in range(3))
                   or not thread.is_alive(), "the far side to write")
        kill(serve, signal.SIGSTOP)
        assert thread.is_alive() and partials(tmp_path / "dest"), "the put was not caught while writing"
        kill(serve)
    else:
        wait_until(lambda: read_chars(master) - before > (1 << 20), "a MiB of the request on the wire")
        assert thread.is_alive()
        if when.startswith("master"):
            kill(master)
            kill(serve, signal.SIGCONT)                 # it reads the end of its input, mid-request
        else:
            kill(serve)
    thread.join(DEADLINE_S)
    assert not thread.is_alive()
    outcome = box[0]
    # The session sends an interrupted request once more, to a new far side (every request is idempotent): the
    # put then succeeds whole; were the new far side lost too, it would fail as retryable.
    if isinstance(outcome, BaseException):
        assert isinstance(outcome, TransportError) and outcome.retryable, outcome
    else:
        assert outcome.strategy == "inline" and rig.session().far_sides_started == 2, outcome
        assert_same_tree(src, tmp_path / "dest")
    wait_until(lambda: serve not in far_serves(rig.tag), "the killed far side to end")
    assert wrong_files(src, tmp_path / "dest") == []
    again = rig.send(src, items)
    assert again.strategy == "inline" and again.files == len(items)
    assert_same_tree(src, tmp_path / "dest")
    assert not partials(tmp_path / "dest")


def test_an_operation_after_a_far_side_death_not_yet_noticed_succeeds(rig, tmp_path):
    src = tmp_path / "src"
    items = make_tree(src, 6, 200)
    rig.send(src, items[:2])
    (serve,), (client,), (master,) = far_serves(rig.tag), serve_clients(rig.tag), masters(rig.runtime)
    pipe = os.readlink(f"/proc/{client}/fd/0")          # the far side's input, which the master reads too
    kill(client, signal.SIGSTOP)                        # its ssh has not noticed yet (a slow link, a busy host)
    try:
        kill(serve)
        wait_until(lambda: not far_serves(rig.tag) and pipe not in open_files(master), "the master to let go")
        thread, box = in_thread(lambda: rig.send(src, items))
        wait_until(lambda: pending_input(client) > 0 or not thread.is_alive(), "the request to be written")
    finally:
        kill(client, signal.SIGCONT)
    thread.join(DEADLINE_S)
    assert not isinstance(box[0], BaseException), box[0]
    assert_same_tree(src, tmp_path / "dest")


def test_a_killed_master_is_started_again(rig, tmp_path):
    src = tmp_path / "src"
    items = make_tree(src, 4, 200)
    rig.send(src, items[:1])
    _end_connection(rig, "master killed")
    assert rig.send(src, items).strategy == "inline"
    assert_same_tree(src, tmp_path / "dest")
    assert len(masters(rig.runtime)) == 1


# ---------------------------------------------------------------- 3. threads

def test_eight_threads_share_one_pool(rig, tmp_path):
    src = tmp_path / "src"
    common = make_tree(src, 12, 700, prefix="common")
    own = {k: make_tree(src, 6, 300 + k, prefix=f"t{k}_") for k in range(8)}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            rng = random.Random(k)
            sent: list[str] = []
            for round_ in range(6):
                picked = rng.sample(own[k], 3) + rng.sample(common, 4)
                if round_ == 5:
                    picked = own[k] + common
                assert rig.send(src, picked).strategy == "inline"
                sent = sorted(set(sent) | set(picked))
                chosen = rng.sample(sent, min(len(sent), 5))
                assert rig.fetch(chosen, tmp_path / "back", tree=src).strategy == "inline"
                assert rig.fetch(chosen, tmp_path / f"own{k}").strategy == "inline"      # sizes unknown
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE_S * 2)
    assert not any(t.is_alive() for t in threads) and errors == []
    assert_same_tree(src, tmp_path / "dest")
    roots = [tmp_path / "dest", tmp_path / "back", *(tmp_path / f"own{k}" for k in range(8))]
    assert [w for root in roots for w in wrong_files(src, root)] == [] and not partials(*roots)
    assert rig.session().far_sides_started == 1 and len(far_serves(rig.tag)) == 1


# ---------------------------------------------------------------- 4. idle sessions end

def test_idle_far_sides_and_connections_end_and_leave_nothing(sshd, tmp_path, monkeypatch):
    idle = make_rig(sshd, tmp_path, monkeypatch, idle_s=0.5, keep=1.0)
    try:
        src = tmp_path / "src"
        items = make_tree(src, 10, 400)
        assert idle.send(src, items).strategy == "inline"
        assert idle.fetch(items, tmp_path / "back", tree=src).strategy == "inline"
        assert far_serves(idle.tag) and masters(idle.runtime)
        assert list((idle.runtime / "pallet").glob("ssh-*"))
        wait_until(lambda: not far_serves(idle.tag) and not serve_clients(idle.tag), "the idle far side to end")
        wait_until(lambda: not masters(idle.runtime), "the idle connection to end")
        wait_until(lambda: not os.listdir(idle.runtime / "pallet"), "the connection's socket to go")
        assert_same_tree(src, tmp_path / "dest")
        assert_same_files(src, tmp_path / "back")
        assert sorted(os.listdir(tmp_path)) == ["back", "dest", "src"]
        assert os.listdir(idle.runtime) == ["pallet"]
        assert not idle.session().active
        assert idle.send(src, items[:2]).strategy == "inline"               # and it starts again
        assert idle.session().far_sides_started == 2
    finally:
        end_rig(idle)


# ---------------------------------------------------------------- 5. the runtime directory is private

@pytest.mark.parametrize("case", ["directory 0755", "directory of nobody", "socket of nobody"])
def test_the_cli_refuses_a_runtime_directory_open_to_others(sshd, tmp_path, case):
    runtime = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    directory = runtime / "pallet"
    directory.mkdir(mode=0o700)
    src = tmp_path / "src"
    make_tree(src, 3, 100)
    dest = tmp_path / "dest"
    planted = None
    try:
        if case == "directory 0755":
            directory.chmod(0o755)
            refused, fix = directory, f"chmod 700 {directory}"
        elif case == "directory of nobody":
            os.chown(directory, 65534, 65534)
            refused, fix = directory, "remove it"
        else:
            refused = Path(socket_path(str(directory), parse_url(sshd.url(str(dest))), sshd.ssh_options))
            planted = socket.socket(socket.AF_UNIX)
            planted.bind(str(refused))
            os.chmod(refused, 0o600)
            os.chown(refused, 65534, 65534)
            fix = "remove it"
        done = run_pallet("push", "--quiet", "--remote-python", sys.executable,
                          *[f"--ssh-option={o}" for o in sshd.ssh_options], str(src), sshd.url(str(dest)),
                          env={"XDG_RUNTIME_DIR": str(runtime)}, timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        assert len(lines) <= 2 and lines[0].startswith("pallet push: error: ") and str(refused) in lines[0], lines
        assert "refused" in lines[0] and fix in done.stderr, done.stderr
        assert not dest.exists()
        assert refused.exists()                                     # refused, not removed
        assert not masters(runtime)
    finally:
        if planted is not None:
            planted.close()
        shutil.rmtree(runtime)


# ---------------------------------------------------------------- 6. no pallet at the far side

@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """An sshd whose sessions have a PATH without pallet (as tests/test_tar_tools_route.py's): python3 there
    cannot import it."""
    root = tmp_path_factory.mktemp("bare")
    server = start_bare_sshd(root)
    try:
        yield server
    finally:
        server.stop()


def test_a_far_side_without_pallet_is_served_the_usual_way(bare, tmp_path, monkeypatch):
    plain = make_rig(bare, tmp_path, monkeypatch, remote_python="python3")      # the default: probed there
    try:
        src = tmp_path / "src"
        items = make_tree(src, 6, 300)
        sent = plain.send(src, items)
        assert sent.strategy != "inline" and sent.route != "host session", sent
        assert_same_tree(src, tmp_path / "dest")
        back = plain.fetch(items, tmp_path / "back", tree=src)
        assert back.strategy != "inline" and back.route != "host session", back
        assert_same_tree(src, tmp_path / "back")
        again = plain.send(src, items[:2])
        assert again.strategy != "inline" and again.bytes_sent == 0             # nothing changed: nothing sent
        assert not plain.session().serves() and plain.session().far_sides_started == 1   # asked once, remembered
        assert len([c for c in (tmp_path / "dest").rglob("*")]) == 9 and not partials(tmp_path / "dest")
    finally:
        end_rig(plain)
