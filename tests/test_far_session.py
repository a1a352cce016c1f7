"""A push's far side is one session over one ssh channel: lock, listing, stream and clean-up, with a fallback."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bundles.errors import DestinationLocked, StreamError
from mpi_stager.session import CLEARED, HELLO, run_session
from tests.conftest import assert_same_tree, make_nasty_tree, run_pallet
from tests.programs import user_env
from tests.servers import count_invocations

_MUX = ("-O exit", " -N ")          # ControlMaster start and stop: not commands at the far side


def ssh_flags(sshd) -> list[str]:
    return [f"--ssh-option={o}" for o in sshd.ssh_options]


def far_commands(calls: list[str]) -> list[str]:
    """The ssh calls that ran a command at the far side (from ``--`` on, when pallet put one), without the
    connection's own calls."""
    return [call.partition(" -- ")[2] or call for call in calls if not any(m in call for m in _MUX)]


def pushed(sshd, src: str, dest: Path, *args: str, remote_python: str = sys.executable) -> dict:
    done = run_pallet("push", "--json", "--quiet", "--remote-python", remote_python, *ssh_flags(sshd), *args,
                      src, sshd.url(str(dest)))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_streamed_push_runs_one_far_side_command(sshd, tmp_path, monkeypatch):
    src = make_nasty_tree(str(tmp_path / "src"))
    calls = count_invocations(tmp_path / "shims", "ssh", monkeypatch)
    summary = pushed(sshd, src, tmp_path / "dest", "--strategy", "bundle")
    commands = far_commands(calls())
    assert summary["route"] == "stream" and summary["transfers"] == 1
    assert len(commands) == 1 and "mpi_stager session --list" in commands[0], commands     # no flock, find, rm
    assert_same_tree(src, tmp_path / "dest")                      # strict: DEST/.pallet was cleared there


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


def session_over(dest: Path, requests: bytes, listing: bool = True) -> tuple[bytes, object]:
    out = io.BytesIO()
    summary = run_session(str(dest), io.BytesIO(requests), out, listing=listing)
    return out.getvalue(), summary


def test_the_session_lists_dest_then_holds_and_clears(tmp_path):
    dest = tmp_path / "dest"
    (dest / ".pallet" / "old").mkdir(parents=True)
    (dest / "a.txt").write_text("a")
    out, summary = session_over(dest, b"hold\nclear\n")
    assert summary is None and out.startswith(HELLO) and out.endswith(CLEARED)
    header, _, rest = out[len(HELLO):].partition(b"\n")
    assert header == b"listing %d" % (len(rest) - len(CLEARED))
    assert rest.split(b"\0")[:8] == [b"f", b"644", rest.split(b"\0")[2], b"1", b"", rest.split(b"\0")[5], b"1",
                                     b"a.txt"]                      # .pallet is left out of the listing
    assert not (dest / ".pallet").exists() and (dest / "a.txt").exists()


def test_the_session_marks_an_incomplete_dest_and_refuses_unknown_requests(tmp_path):
    dest = tmp_path / "dest"
    (dest / ".pallet").mkdir(parents=True)
    (dest / ".pallet" / "INCOMPLETE").write_text("")
    out, summary = session_over(dest, b"")
    assert out == HELLO + b"listing 10\nINCOMPLETE" and summary is None
    with pytest.raises(StreamError, match="unknown session command"):
        session_over(dest, b"delete everything\n")
    with pytest.raises(StreamError, match="unknown session request"):
        session_over(dest, b"hold\nrm -rf /\n")


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
