"""The wire: one hello exchanges versions and capabilities; older and newer far sides are recognised from it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bundles.errors import StreamError
from mpi_stager import wire
from mpi_stager.wire import (HELLO, SESSION_CAPS, SESSION_VERSION, STREAM_VERSION, SUMMARY_VERSION, TAR_TOOLS_LINE,
                             Hello, Versions, agree, client_hello)
from staging_core.far_side.probe import parse_probe
from staging_core.far_side.session import FarSession
from staging_core.options import StagingOptions
from staging_core.transports.base import parse_url
from staging_core.transports.registry import open_endpoint
from tests.conftest import assert_same_tree, make_nasty_tree, run_pallet
from tests.programs import python_module, user_env
from tests.servers import count_invocations

FIXTURES = Path(__file__).with_name("wire_fixtures")
_MUX = (" -O exit", " -O check", " -N ", " -G ")  # the connection's own calls: not far-side commands


def far_commands(calls: list[str]) -> list[str]:
    return [call.partition(" -- ")[2] or call for call in calls if not any(m in f" {call}" for m in _MUX)]


def push(sshd, src: str, dest: Path, remote_python: str) -> subprocess.CompletedProcess:
    return run_pallet("push", "--json", "--quiet", "--strategy", "bundle", "--remote-python", remote_python,
                      *[f"--ssh-option={o}" for o in sshd.ssh_options], src, sshd.url(str(dest)), timeout=240)


def fixture_python(name: str, log: Path) -> str:
    return f"{sys.executable} {FIXTURES / name} {log}"


# ---------------------------------------------------------------- the hello, read and agreed on

def test_each_hello_line_reads_back_as_the_versions_and_capabilities_it_says():
    assert Hello.parse_far(HELLO) == wire.FAR_HELLO
    assert HELLO == (b"pallet-session %d session=%d summary=%d stream=%d caps=clear,dirs,listing,receive,"
                     b"receive-new,wait\n" % (SESSION_VERSION, SESSION_VERSION, SUMMARY_VERSION, STREAM_VERSION))
    mine = client_hello({"listing", "receive"})
    assert Hello.parse_client(mine.client_text()) == mine
    assert mine.client_text() == f"session={SESSION_VERSION} summary=0-{SUMMARY_VERSION} stream={STREAM_VERSION} " \
                                 "want=listing,receive"
    older = Hello.parse_far(b"pallet-session 2\n")             # a v2 far side said its version only
    assert older == Hello(Versions(2, 2), speaks=2)
    later = Hello.parse_far(b"pallet-session 5 session=4-5 stream=1 caps=receive,store future=yes\n")
    assert later is not None and later.session == Versions(4, 5) and later.caps == {"receive", "store"}
    assert Hello.parse_far(b"pallet-session x\n") is None and Hello.parse_far(b"Welcome to the cluster\n") is None


def test_agreement_picks_the_newest_common_version_and_says_who_is_older():
    mine = client_hello({"receive", "dirs"})
    assert agree(mine, wire.FAR_HELLO).ok and agree(mine, wire.FAR_HELLO).session == SESSION_VERSION
    newer_but_kind = Hello(Versions(SESSION_VERSION, SESSION_VERSION + 1), Versions.one(SUMMARY_VERSION),
                           Versions.one(STREAM_VERSION), SESSION_CAPS, SESSION_VERSION)
    assert agree(mine, newer_but_kind).session == SESSION_VERSION          # it still speaks ours
    older = agree(mine, Hello(Versions.one(2), speaks=2))
    assert not older.ok and older.far_older
    assert older.problem(client_side=True) == ("the far side's pallet speaks session protocol v2; this pallet "
                                               f"speaks v{SESSION_VERSION}")
    newer = agree(mine, Hello(Versions.one(SESSION_VERSION + 1), speaks=SESSION_VERSION + 1))
    assert not newer.ok and not newer.far_older
    other_stream = agree(mine, Hello(Versions.one(SESSION_VERSION), Versions.one(1), Versions.one(99), SESSION_CAPS))
    assert not other_stream.ok and not other_stream.far_older and "bundle stream protocol v99" in \
        other_stream.problem(client_side=True)
    lacking = agree(client_hello({"receive", "store"}), wire.FAR_HELLO)
    assert not lacking.ok and lacking.far_older and "lacks store" in lacking.problem(client_side=True)


def test_the_far_side_answers_each_client_hello_and_refuses_one_it_shares_no_version_with():
    asked = subprocess.run([*python_module("mpi_stager"), "hello"], capture_output=True, env=user_env(),
                           stdin=subprocess.DEVNULL, timeout=60)
    assert asked.returncode == 0 and asked.stdout == HELLO, asked.stderr
    newer_client = user_env(PALLET_HELLO=f"session={SESSION_VERSION + 1} stream={STREAM_VERSION} want=receive")
    refused = subprocess.run([*python_module("mpi_stager"), "hello"], capture_output=True, text=True,
                             env=newer_client, stdin=subprocess.DEVNULL, timeout=60)
    assert refused.returncode == 1 and refused.stdout.startswith("pallet-session "), refused
    assert refused.stderr.strip() == (f"mpi_stager hello: error: the client's pallet speaks session protocol "
                                      f"v{SESSION_VERSION + 1}; this far side speaks v{SESSION_VERSION}")
    wanting = user_env(PALLET_HELLO=f"session={SESSION_VERSION} want=receive,store")
    lacking = subprocess.run([*python_module("mpi_stager"), "hello"], capture_output=True, text=True, env=wanting,
                             stdin=subprocess.DEVNULL, timeout=60)
    assert lacking.returncode == 1 and "lacks store" in lacking.stderr, lacking
    version = subprocess.run([*python_module("mpi_stager"), "--version"], capture_output=True, text=True,
                             env=user_env(), stdin=subprocess.DEVNULL, timeout=60)
    assert f"session protocol v{SESSION_VERSION}, summary v{SUMMARY_VERSION}" in version.stdout, version


def test_a_session_refuses_a_client_it_shares_no_version_with_after_its_hello(tmp_path):
    client = user_env(PALLET_HELLO=f"session={SESSION_VERSION + 1} want=receive")
    done = subprocess.run([*python_module("mpi_stager"), "session", "--list", str(tmp_path / "dest")],
                          capture_output=True, text=True, env=client, stdin=subprocess.DEVNULL, timeout=60)
    assert done.returncode == 1 and done.stdout.startswith("pallet-session ") and done.stdout.count("\n") == 1
    assert "mpi_stager session: error:" in done.stderr and f"v{SESSION_VERSION + 1}" in done.stderr, done.stderr


def test_the_probe_reads_the_session_version_of_a_pallet_with_wire_and_none_of_an_older_one():
    endpoint = parse_url("ssh://me@login.hpc/scratch/dest")
    found = parse_probe(endpoint, f"pallet=python3\t/usr/bin/python3\t0.2.0\t{STREAM_VERSION}\t{SESSION_VERSION}\n",
                        0.0)
    assert (found.pallet_python, found.stream_version, found.session_version) == ("python3", STREAM_VERSION,
                                                                                 SESSION_VERSION)
    assert f"(stream v{STREAM_VERSION}, session v{SESSION_VERSION})" in found.summary()[0]
    older = parse_probe(endpoint, f"pallet=python3\t/usr/bin/python3\t0.1.0\t{STREAM_VERSION}\n", 0.0)
    assert older.pallet_usable and older.session_version == 0 and "session v" not in older.summary()[0]
    format_1 = parse_probe(endpoint, "pallet=python3\t/usr/bin/python3\t0.3.0\t1\t3\n", 0.0)
    assert format_1.stream_version == 1 and not format_1.pallet_usable     # its receiver checks format 1 headers


# ---------------------------------------------------------------- the hello over ssh, with far sides of each version

def test_the_hello_rides_on_the_sessions_command_and_reports_the_far_sides_capabilities(sshd, tmp_path):
    dest = tmp_path / "dest"
    endpoint = parse_url(sshd.url(str(dest)))
    options = StagingOptions(remote_python=sys.executable, ssh_options=tuple(sshd.ssh_options))
    with open_endpoint(endpoint, options) as transport, \
            FarSession(transport, endpoint, options, listing=True) as session:
        hello = session.hello
        assert hello is not None and hello.speaks == SESSION_VERSION
        assert hello.caps == SESSION_CAPS and {"listing", "receive-new", "dirs"} <= hello.caps
        assert (hello.session, hello.summary, hello.stream) == (Versions(wire.MIN_SESSION_VERSION, SESSION_VERSION),
                                                                Versions.one(SUMMARY_VERSION),
                                                                Versions.one(STREAM_VERSION))
        assert session.entries() == {}


def test_a_push_sends_its_hello_with_its_one_far_side_command(sshd, tmp_path, monkeypatch):
    src = make_nasty_tree(str(tmp_path / "src"))
    calls = count_invocations(tmp_path / "shims", "ssh", monkeypatch)
    done = push(sshd, src, tmp_path / "dest", sys.executable)
    assert done.returncode == 0 and json.loads(done.stdout)["route"] == "stream", done.stderr
    commands = far_commands(calls())
    assert len(commands) == 1, commands                     # no round trip of its own
    assert f"'PALLET_HELLO=session={SESSION_VERSION} summary=0-{SUMMARY_VERSION}" in commands[0], commands
    assert "mpi_stager session --list" in commands[0]
    assert_same_tree(src, tmp_path / "dest")


@pytest.mark.timeout(240)
def test_a_far_side_one_session_version_older_is_left_for_its_separate_commands(sshd, tmp_path, monkeypatch):
    src, dest, log = make_nasty_tree(str(tmp_path / "src")), tmp_path / "dest", tmp_path / "far.log"
    calls = count_invocations(tmp_path / "shims", "ssh", monkeypatch)
    done = push(sshd, src, dest, fixture_python("far_side_v2.py", log))
    assert done.returncode == 0 and json.loads(done.stdout)["route"] == "stream", done.stderr
    commands = far_commands(calls())
    assert sum("mpi_stager session" in c for c in commands) == 1, commands          # one try, then the fallback
    assert any("flock" in c for c in commands) and any("mpi_stager receive" in c for c in commands), commands
    events = log.read_text().splitlines()
    assert events[0] == f"hello from the client: session={SESSION_VERSION} summary=0-{SUMMARY_VERSION} " \
                        f"stream={STREAM_VERSION} want=clear,dirs,listing,receive,receive-new", events
    assert events[1] == "session v2 started" and events[2].startswith("session ended"), events
    assert "command: receive" in events, events
    assert_same_tree(src, dest)


@pytest.mark.timeout(240)
def test_a_far_side_one_session_version_newer_stops_the_push_naming_both_versions_and_the_fix(sshd, tmp_path,
                                                                                          monkeypatch):
    src, dest, log = make_nasty_tree(str(tmp_path / "src")), tmp_path / "dest", tmp_path / "far.log"
    calls = count_invocations(tmp_path / "shims", "ssh", monkeypatch)
    done = push(sshd, src, dest, fixture_python("far_side_v4.py", log))
    assert done.returncode == 1, done.stderr
    message = done.stderr.strip()
    assert "Traceback" not in message and len(message.splitlines()) <= 2, message
    head = message.splitlines()[0]
    assert head.startswith("pallet push: error: ssh://") and head.endswith(
        f"the far side's pallet speaks session protocol v{SESSION_VERSION + 1}; this pallet speaks "
        f"v{SESSION_VERSION}"), message
    assert f"pallet remote install ssh://{sshd.user}@127.0.0.1:{sshd.port}" in message, message
    commands = far_commands(calls())
    assert len(commands) == 1 and "mpi_stager session" in commands[0], commands     # no fallback, no retry
    assert not any("refused command" in line for line in log.read_text().splitlines())


def test_a_far_side_too_old_for_sessions_is_recognised_by_its_status_not_its_words(sshd, tmp_path):
    src, dest = make_nasty_tree(str(tmp_path / "src")), tmp_path / "dest"
    older = tmp_path / "older-python"           # exits 2 with no hello and a message in another language
    older.write_text(f'#!/bin/sh\ncase "$3" in session) echo "Befehl unbekannt" >&2; exit 2;; esac\n'
                     f'exec {sys.executable} "$@"\n')
    older.chmod(0o755)
    done = push(sshd, src, dest, str(older))
    assert done.returncode == 0 and json.loads(done.stdout)["route"] == "stream", done.stderr
    assert_same_tree(src, dest)


# ---------------------------------------------------------------- the tar-tools scripts carry their version

@pytest.mark.parametrize("name", ["list", "send", "session"])
def test_each_tar_tools_script_prints_its_version_first(tmp_path, name):
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "a.txt").write_text("a")
    args = {"list": [str(tmp_path / "tree")], "send": [str(tmp_path / "tree"), "cat"],
            "session": [str(tmp_path / "tree"), "cat"]}[name]
    done = subprocess.run(["sh", "-c", wire.tar_tools_script(name), f"pallet-{name}", *args], capture_output=True,
                          input=b"./a.txt\0" if name == "send" else b"", timeout=60)
    assert done.stdout.startswith(TAR_TOOLS_LINE), done
    assert wire.tar_tools_script(name).startswith(f"# pallet tar-tools {name} script, version "
                                                  f"{wire.TAR_TOOLS_VERSION}\n")
    if name == "list":
        listed = wire.parse_records(wire.strip_tar_tools_line(done.stdout, "here").partition(wire.MANIFEST_END)[0])
        assert list(listed) == [b"a.txt"] and listed[b"a.txt"].size == 1


def test_a_tar_tools_answer_of_another_version_is_named():
    wire.check_tar_tools_line(TAR_TOOLS_LINE, "there")
    wire.check_tar_tools_line(b"", "there")                 # a far side that failed first: its status says why
    expected = f"answered 'pallet-tar-tools 0', not 'pallet-tar-tools {wire.TAR_TOOLS_VERSION}'"
    with pytest.raises(StreamError, match=expected):
        wire.check_tar_tools_line(b"pallet-tar-tools 0\n", "there")
    with pytest.raises(StreamError, match="Welcome"):
        wire.strip_tar_tools_line(b"Welcome to the cluster\n" + TAR_TOOLS_LINE, "there")
    assert os.fsencode(wire.FIND_RECORDS) in wire.tar_tools_script("list").encode()   # one listing record
