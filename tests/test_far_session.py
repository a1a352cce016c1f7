"""A push's far side is one session over one ssh channel: lock, listing, stream and clean-up, with a fallback."""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import stat
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import zstandard

from bundles.errors import DestinationLocked, StreamError
from bundles.progress import NoProgress
from bundles.stream import FrameKind, FrameWriter
from mpi_stager.send import begin_stream, prepare_source, send_stream
from mpi_stager.session import run_session
from mpi_stager.wire import DECLINED, HELLO, OK, encode_dirs, parse_records
from mpi_stager.wire import decode_summary as decode
from staging_core.far_side.session import FarSession
from staging_core.options import StagingOptions
from staging_core.transports.base import parse_url
from staging_core.transports.registry import open_endpoint
from tests.conftest import assert_same_tree, make_nasty_tree, run_pallet
from tests.programs import program, user_env
from tests.servers import count_invocations

_MUX = (" -O exit", " -O check", " -N ", " -G ")  # the connection's own calls: not far-side commands


def ssh_flags(sshd) -> list[str]:
    return [f"--ssh-option={o}" for o in sshd.ssh_options]


def far_commands(calls: list[str]) -> list[str]:
    """The ssh calls that ran a command at the far side (from ``--`` on, when pallet put one), without the
    connection's own calls."""
    return [call.partition(" -- ")[2] or call for call in calls if not any(m in f" {call}" for m in _MUX)]


def pushed(sshd, src: str, dest: Path, *args: str, remote_python: str = sys.executable) -> dict:
    done = run_pallet("push", "--json", "--quiet", "--remote-python", remote_python, *ssh_flags(sshd), *args,
                      src, sshd.url(str(dest)))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_streamed_push_and_its_repair_each_run_one_far_side_command(sshd, tmp_path, monkeypatch):
    src, dest = make_nasty_tree(str(tmp_path / "src")), tmp_path / "dest"
    calls = count_invocations(tmp_path / "shims", "ssh", monkeypatch)
    summary = pushed(sshd, src, dest, "--strategy", "bundle")
    commands = far_commands(calls())
    assert summary["route"] == "stream" and summary["transfers"] == 1
    assert len(commands) == 1 and "mpi_stager session --list" in commands[0], commands     # no flock, find, rm
    assert_same_tree(src, dest)                                    # strict: DEST/.pallet was cleared there
    (dest / "with space.txt").unlink()
    seen = len(calls())
    repaired = pushed(sshd, src, dest, "--strategy", "bundle")
    commands = far_commands(calls()[seen:])
    assert repaired["files"] == 1 and repaired["route"] == "stream", repaired
    assert len(commands) == 1 and "mpi_stager session --list" in commands[0], commands   # directory times too
    assert_same_tree(src, dest)


def test_an_individual_push_holds_the_session_while_rsync_runs(sshd, tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(b"x" * (3 << 20))
    calls = count_invocations(tmp_path / "shims", "ssh", monkeypatch)
    summary = pushed(sshd, str(src), tmp_path / "dest", "--strategy", "individual")
    commands = far_commands(calls())
    assert summary["route"] == "individual"
    assert sum("mpi_stager session" in c for c in commands) == 1 and any("rsync --server" in c for c in commands)
    assert not any("flock" in c or c.startswith("rm ") for c in commands), commands
    assert_same_tree(str(src), tmp_path / "dest")


def test_push_and_pull_take_over_the_connection_the_command_line_starts_early(sshd, tmp_path, monkeypatch):
    src = make_nasty_tree(str(tmp_path / "src"))
    calls = count_invocations(tmp_path / "shims", "ssh", monkeypatch)
    pushed(sshd, src, tmp_path / "dest", "--strategy", "bundle", "--ssh-keep", "0")
    done = run_pallet("pull", "--quiet", "--strategy", "bundle", "--remote-python", sys.executable, "--ssh-keep", "0",
                      *ssh_flags(sshd), sshd.url(str(tmp_path / "dest")), str(tmp_path / "back"))
    assert done.returncode == 0, done.stderr
    masters = [call for call in calls() if " -N " in call]
    assert len(masters) == 2, masters               # one connection each, started before the rest of pallet loads
    assert sum(" -O exit" in call for call in calls()) == 2
    assert_same_tree(src, tmp_path / "back")
    assert not _live_masters(masters)


def test_a_later_command_reuses_the_kept_connection(sshd, tmp_path, monkeypatch):
    src = make_nasty_tree(str(tmp_path / "src"))
    runtime = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))       # short: a socket's path holds 108 bytes
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    calls = count_invocations(tmp_path / "shims", "ssh", monkeypatch)
    pushed(sshd, src, tmp_path / "dest", "--strategy", "bundle", "--ssh-keep", "30")
    done = run_pallet("pull", "--quiet", "--strategy", "bundle", "--remote-python", sys.executable, "--ssh-keep", "30",
                      *ssh_flags(sshd), sshd.url(str(tmp_path / "dest")), str(tmp_path / "back"))
    assert done.returncode == 0, done.stderr
    assert_same_tree(src, tmp_path / "back")
    masters = [call for call in calls() if " -N " in call]
    assert len(masters) == 1 and "ControlPersist=30" in masters[0], masters     # the pull found the push's
    assert not any(" -O exit" in call for call in calls())
    sockets = list((runtime / "pallet").iterdir())
    try:
        assert len(sockets) == 1 and stat.S_ISSOCK(sockets[0].lstat().st_mode) and \
            stat.S_IMODE(sockets[0].parent.stat().st_mode) == 0o700
    finally:
        for socket in sockets:
            subprocess.run(["ssh", "-o", f"ControlPath={socket}", "-O", "exit", "x"], capture_output=True)
        shutil.rmtree(runtime)


def test_a_push_that_fails_before_connecting_leaves_no_connection(sshd, tmp_path, monkeypatch):
    calls = count_invocations(tmp_path / "shims", "ssh", monkeypatch)
    done = run_pallet("push", "--quiet", "--ssh-keep", "0", *ssh_flags(sshd), str(tmp_path / "missing"),
                      sshd.url(str(tmp_path / "d")))
    assert done.returncode == 1 and "missing: does not exist" in done.stderr and "Traceback" not in done.stderr
    masters = [call for call in calls() if " -N " in call]
    assert len(masters) == 1 and not _live_masters(masters)
    assert not (tmp_path / "d").exists()


def _live_masters(calls: list[str]) -> list[str]:
    """The ssh processes still running with a ControlPath of ``calls``, and those paths' directories left."""
    paths = [word.partition("=")[2] for call in calls for word in call.split() if word.startswith("ControlPath=")]
    left = [path for path in paths if os.path.exists(os.path.dirname(path))]
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        left += [f"{entry.name}: {path}" for path in paths if f"ControlPath={path}" in command]
    return left


def test_individual_push_and_pull_over_ssh_keep_hard_links(sshd, tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    assert pushed(sshd, src, tmp_path / "dest", "--strategy", "individual")["route"] == "individual"
    assert_same_tree(src, tmp_path / "dest")                    # strict: link groups too
    done = run_pallet("pull", "--quiet", "--strategy", "individual", "--remote-python", sys.executable,
                      *ssh_flags(sshd), sshd.url(str(tmp_path / "dest")), str(tmp_path / "back"))
    assert done.returncode == 0, done.stderr
    assert_same_tree(src, tmp_path / "back")


def test_the_first_stream_travels_before_the_far_side_lists_dest(sshd, tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    log = tmp_path / "stdin.log"
    late = tmp_path / "late-python"          # the far side's Python starts a second late, then looks at its stdin
    late.write_text(f"import os, select, sys, time\ntime.sleep(1)\n"
                    f"ready = select.select([sys.stdin], [], [], 0)[0]\n"
                    f"open({str(log)!r}, 'a').write('offered ' if ready else 'nothing ')\n"
                    f"os.execv({sys.executable!r}, [{sys.executable!r}] + sys.argv[1:])\n")
    far = f"{sys.executable} {late}"
    first = pushed(sshd, src, tmp_path / "dest", "--strategy", "bundle", remote_python=far)
    assert log.read_text() == "offered " and first["route"] == "stream" and first["offered_bytes"] == 0
    assert_same_tree(src, tmp_path / "dest")
    os.utime(Path(src) / "with space.txt", ns=(7, 7))
    again = pushed(sshd, src, tmp_path / "dest", "--strategy", "bundle", remote_python=far)
    assert log.read_text() == "offered offered " and again["files"] == 1, again
    assert 0 < again["offered_bytes"] < first["bytes_sent"]         # the declined skeleton, said apart
    assert_same_tree(src, tmp_path / "dest")


def test_a_held_destination_stops_a_second_push_with_status_4(sshd, tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    dest = tmp_path / "dest"
    holder = subprocess.Popen([sys.executable, "-m", "mpi_stager", "session", str(dest)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=user_env())
    try:
        assert holder.stdout.readline() == HELLO
        done = run_pallet("push", "--quiet", "--remote-python", sys.executable, *ssh_flags(sshd), src,
                          sshd.url(str(dest)))
        assert done.returncode == 4 and "another pallet push/pull is writing" in done.stderr
        assert "Traceback" not in done.stderr
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
    assert pushed(sshd, src, dest, "--strategy", "bundle")["route"] == "stream"     # the lock died with it
    assert_same_tree(src, dest)


def test_a_far_side_pallet_without_sessions_gets_separate_commands(sshd, tmp_path, monkeypatch):
    src = make_nasty_tree(str(tmp_path / "src"))
    older = tmp_path / "older-python"
    older.write_text(f"#!/bin/sh\ncase \"$3\" in session)\n"
                     "  echo \"python -m mpi_stager: error: argument COMMAND: invalid choice: 'session' "
                     "(choose from 'unpack', 'receive', 'send', 'pack')\" >&2; exit 2;;\nesac\n"
                     f'exec {sys.executable} "$@"\n')
    older.chmod(0o755)
    calls = count_invocations(tmp_path / "shims", "ssh", monkeypatch)
    summary = pushed(sshd, src, tmp_path / "dest", "--strategy", "bundle", remote_python=str(older))
    commands = far_commands(calls())
    assert summary["route"] == "stream"
    assert any("flock" in c for c in commands) and any("mpi_stager receive" in c for c in commands), commands
    assert_same_tree(src, tmp_path / "dest")


@pytest.mark.timeout(60)
def test_a_far_side_of_another_session_version_is_left_at_once_for_separate_commands(sshd, tmp_path,
                                                                                     monkeypatch):
    src = make_nasty_tree(str(tmp_path / "src"))
    pids = tmp_path / "pids"
    other = tmp_path / "other-python"     # its session says version 1, then reads nothing and never exits
    other.write_text(f"import os, sys, time\nif 'session' in sys.argv:\n"
                     f"    open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
                     f"    print('pallet-session 1', flush=True)\n    time.sleep(600)\n"
                     f"os.execv({sys.executable!r}, [{sys.executable!r}] + sys.argv[1:])\n")
    calls = count_invocations(tmp_path / "shims", "ssh", monkeypatch)
    try:
        summary = pushed(sshd, src, tmp_path / "dest", "--strategy", "bundle",
                         remote_python=f"{sys.executable} {other}")
    finally:
        left = [int(pid) for pid in pids.read_text().split()] if pids.exists() else []
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
    commands = far_commands(calls())
    assert summary["route"] == "stream" and len(left) == 1
    assert any("flock" in c for c in commands) and any("mpi_stager receive" in c for c in commands), commands
    assert_same_tree(src, tmp_path / "dest")


_STUCK_FAR_SIDE = """\
import fcntl, os, struct, sys, termios, time
open(sys.argv[1], "a").write(f"{os.getpid()}\\n")
while struct.unpack("i", fcntl.ioctl(0, termios.FIONREAD, b"0000"))[0] < 32768:    # never read; filling
    time.sleep(0.01)
open(sys.argv[1] + ".full", "w").close()
time.sleep(600)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("target", ["pallet", "a helper thread"])
def test_ctrl_c_while_a_big_offer_waits_for_a_stuck_far_side_ends_the_push(sshd, tmp_path, target):
    src = tmp_path / "src"              # 50,000 long random names: a skeleton of MBs, more than ssh buffers
    for n in range(50):
        folder = src / f"d{n:02d}"
        folder.mkdir(parents=True)
        for _ in range(1000):
            (folder / os.urandom(75).hex()).touch()
    stuck, pids = tmp_path / "stuck-python", tmp_path / "pids"      # a far side that never says hello, nor reads
    stuck.write_text(_STUCK_FAR_SIDE)
    argv = [program("pallet"), "push", "--quiet", "--strategy", "bundle", "--remote-python",
            f"{sys.executable} {stuck} {pids}", *ssh_flags(sshd), str(src), sshd.url(str(tmp_path / "dest"))]
    pushing = subprocess.Popen(argv, env=user_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    try:
        while not Path(f"{pids}.full").exists():        # the offer is filling the far side's input: it will wait
            assert pushing.poll() is None, pushing.communicate()
            time.sleep(0.01)
        os.kill(_signal_taker(pushing.pid) if target != "pallet" else pushing.pid, signal.SIGINT)
        _, err = pushing.communicate(timeout=60)        # a guard only: the push ends at once
    finally:
        pushing.kill()
        for pid in (int(pid) for pid in pids.read_text().split()) if pids.exists() else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
    assert pushing.returncode == 130, err.decode()
    assert err.decode().strip() == "pallet push: interrupted", err.decode()


def _signal_taker(pid: int) -> int:
    """A thread of process ``pid`` other than its main thread that does not block SIGINT (a signal sent to it is
    the process's, handled there: as when the kernel picks a helper thread); ``pid`` when there is none."""
    for task in sorted(os.listdir(f"/proc/{pid}/task"), key=int, reverse=True):
        status = Path(f"/proc/{pid}/task/{task}/status").read_text()
        blocked = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
        if int(task) != pid and not blocked & 1 << (signal.SIGINT - 1):
            return int(task)
    return pid


def session_over(dest: Path, requests: bytes, listing: bool = True) -> bytes:
    out = io.BytesIO()
    run_session(str(dest), io.BytesIO(requests), out, listing=listing)
    return out.getvalue()


def answers_after_listing(out: bytes) -> list[bytes]:
    """The answer lines a session wrote after its hello and listing."""
    header, _, rest = out[len(HELLO):].partition(b"\n")
    return rest[int(header.split()[1]):].splitlines()


def listing_in(out: bytes) -> bytes:
    """The listing a session wrote after its hello: ``listing N``, then N bytes of one zstd frame."""
    assert out.startswith(HELLO)
    header, _, block = out[len(HELLO):].partition(b"\n")
    assert header == b"listing %d" % len(block)
    return zstandard.ZstdDecompressor().decompress(block)


def test_the_session_lists_dest_then_sets_directory_times_and_clears(tmp_path):
    dest = tmp_path / "dest"
    (dest / ".pallet" / "old").mkdir(parents=True)
    (dest / "sub").mkdir()
    (dest / "a.txt").write_text("a")
    os.symlink(tmp_path, dest / "link")
    dirs = encode_dirs([(b"sub", 0o6750, 5_000_000_123), (b"link", 0o700, 7), (b"../x", 0o700, 7)])
    out = session_over(dest, b"dirs %d\n" % len(dirs) + dirs + b"clear\n")
    assert out.startswith(HELLO) and out.endswith(OK + OK)
    listed = parse_records(listing_in(out[:-2 * len(OK)]))
    assert sorted(listed) == [b"a.txt", b"link", b"sub"]          # DEST/.pallet is left out
    assert listed[b"a.txt"].kind == "f" and listed[b"link"].target == os.fsencode(tmp_path)
    info = os.stat(dest / "sub")
    assert (info.st_mode & 0o7777, info.st_mtime_ns) == (0o750, 5_000_000_123)       # no setuid/setgid
    assert os.stat(tmp_path).st_mtime_ns != 7, "a directory reached through a link was changed"
    assert not (dest / ".pallet").exists() and (dest / "a.txt").exists()


def test_finishing_requests_go_with_the_sessions_end_and_a_failed_end_drops_them(sshd, tmp_path):
    dest = tmp_path / "dest"
    (dest / ".pallet" / "old").mkdir(parents=True)
    (dest / "sub").mkdir()
    endpoint = parse_url(sshd.url(str(dest)))
    options = StagingOptions(remote_python=sys.executable, ssh_options=tuple(sshd.ssh_options))
    with open_endpoint(endpoint, options) as transport:
        failed = FarSession(transport, endpoint, options)
        failed.clear()
        failed.close(failed=True)
        assert (dest / ".pallet" / "old").is_dir(), "a session closed as failed ran a queued request"
        session = FarSession(transport, endpoint, options, listing=True)
        session.set_directories([(b"sub", 0o750, 5_000_000_123)])
        session.clear()
        assert (dest / ".pallet").is_dir() and os.stat(dest / "sub").st_mtime_ns != 5_000_000_123    # queued
        session.close()
    info = os.stat(dest / "sub")
    assert (info.st_mode & 0o7777, info.st_mtime_ns) == (0o750, 5_000_000_123)
    assert not (dest / ".pallet").exists()


def test_a_session_receives_a_stream_then_goes_on_serving(tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    stream = io.BytesIO()
    send_stream(prepare_source(src, "zstd", 1, 16 << 10), stream, lambda stream_id: {}, NoProgress())
    out = session_over(tmp_path / "dest", b"receive\n" + stream.getvalue() + b"clear\n", listing=False)
    lines = out[len(HELLO):].splitlines()
    assert json.loads(lines[0])["done"] == {}                     # the receiver's answer
    assert decode(lines[1], "receive", "session").files > 0 and lines[2] + b"\n" == OK
    assert_same_tree(src, tmp_path / "dest")


def test_receive_new_is_received_into_an_empty_dest_and_declined_elsewhere(tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    stream = io.BytesIO()
    send_stream(prepare_source(src, "zstd", 1, 16 << 10), stream, lambda stream_id: {}, NoProgress())
    out = session_over(tmp_path / "new", b"receive-new\n" + stream.getvalue() + b"clear\n")
    answer, summary, cleared = answers_after_listing(out)
    assert json.loads(answer)["done"] == {} and decode(summary, "receive", "session").files > 0
    assert cleared + b"\n" == OK
    assert_same_tree(src, tmp_path / "new")
    offer = io.BytesIO()
    begin_stream(prepare_source(src, "zstd", 1, 16 << 10), offer)           # prelude and skeleton only
    (tmp_path / "held" / "old").mkdir(parents=True)
    out = session_over(tmp_path / "held", b"receive-new\n" + offer.getvalue() + b"receive\n" + stream.getvalue())
    declined, answer, summary = answers_after_listing(out)
    assert declined + b"\n" == DECLINED and json.loads(answer)["done"] == {}
    assert decode(summary, "receive", "session").files > 0
    assert os.path.isdir(tmp_path / "held" / "old") and os.path.exists(tmp_path / "held" / "with space.txt")
    not_a_skeleton = io.BytesIO()
    wire = FrameWriter(not_a_skeleton)
    wire.prelude()
    wire.frame(FrameKind.INDEX, 0, b"")
    with pytest.raises(StreamError, match="not followed by a stream's skeleton"):
        session_over(tmp_path / "held", b"receive-new\n" + not_a_skeleton.getvalue())


def test_the_session_marks_an_incomplete_dest_and_refuses_bad_requests(tmp_path):
    dest = tmp_path / "dest"
    (dest / ".pallet").mkdir(parents=True)
    (dest / ".pallet" / "INCOMPLETE").write_text("")
    assert listing_in(session_over(dest, b"")) == b"INCOMPLETE"
    with pytest.raises(StreamError, match="unknown session request"):
        session_over(dest, b"delete everything\n")
    with pytest.raises(StreamError, match="ends after 3 of 10 bytes"):
        session_over(dest, b"dirs 10\nabc")


def test_a_second_session_on_a_held_destination_is_refused(tmp_path):
    dest = tmp_path / "dest"
    holder = subprocess.Popen([sys.executable, "-m", "mpi_stager", "session", str(dest)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=user_env())
    try:
        assert holder.stdout.readline() == HELLO
        with pytest.raises(DestinationLocked):
            session_over(dest, b"")
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_a_launcher_stores_and_forwards_and_refuses_stream_on(sshd, tmp_path):
    src, dest = make_nasty_tree(str(tmp_path / "src")), tmp_path / "dest"
    log = tmp_path / "launch.log"
    launcher = tmp_path / "launch"
    launcher.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\nexec "$@"\n')
    launcher.chmod(0o755)
    summary = pushed(sshd, src, dest, "--strategy", "bundle", "--launcher", str(launcher))
    assert summary["route"] != "stream" and summary["transfers"] == 1, summary
    launched = log.read_text().splitlines()
    assert len(launched) == 1 and "-m mpi_stager unpack" in launched[0], launched   # the launcher is obeyed
    assert_same_tree(src, dest)
    refused = run_pallet("push", "--quiet", "--strategy", "bundle", "--stream", "on", "--launcher", str(launcher),
                         "--remote-python", sys.executable, *ssh_flags(sshd), src, sshd.url(str(tmp_path / "d2")))
    assert refused.returncode == 2 and "no --launcher" in refused.stderr and "Traceback" not in refused.stderr


ANSWER_GATE = Path(__file__).with_name("answer_gate.py")
STREAM_GATE = Path(__file__).with_name("stream_gate.py")


def test_into_a_fresh_destination_the_first_shard_does_not_wait_for_the_resume_answer(sshd, tmp_path):
    src, dest, log = make_nasty_tree(str(tmp_path / "src")), tmp_path / "dest", tmp_path / "gate.log"
    gated = f"{sys.executable} {ANSWER_GATE} {log} {sys.executable}"
    summary = pushed(sshd, src, dest, "--strategy", "bundle", "--shard-size", "16K", remote_python=gated)
    assert summary["route"] == "stream" and log.read_text() == "shard first"
    assert_same_tree(src, dest)


def test_into_an_interrupted_destination_the_sender_waits_for_the_resume_answer(sshd, tmp_path):
    src, dest, log = make_nasty_tree(str(tmp_path / "src")), tmp_path / "dest", tmp_path / "gate.log"
    killing = f"{sys.executable} {STREAM_GATE} kill {dest}"
    done = run_pallet("push", "--json", "--quiet", "--remote-python", killing, *ssh_flags(sshd), "--strategy", "bundle",
                      "--shard-size", "16K", "--retries", "0", src, sshd.url(str(dest)))
    assert done.returncode != 0 and (dest / ".pallet" / "INCOMPLETE").exists(), done.stderr
    gated = f"{sys.executable} {ANSWER_GATE} {log} {sys.executable}"
    summary = pushed(sshd, src, dest, "--strategy", "bundle", "--shard-size", "16K", remote_python=gated)
    assert log.read_text() == "held out" and summary["skipped_shards"] >= 1, summary
    assert_same_tree(src, dest)
