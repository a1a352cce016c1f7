"""A far side that prints on login (~/.bashrc, a ForceCommand banner): every route skips it, or names it and stops.

Also here: a source file that changes during a tar-tools push is named as the source's fault, not the far
side's tar's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from staging_core.testing import assert_same_tree, make_nasty_tree
from tests.programs import program, user_env
from tests.servers import SSHServer, start_sshd

GUARD_S = 240           # only a guard: a test that gets here has hung
QUIET_PATH = "/usr/local/bin:/usr/bin:/bin"     # no pallet on the far side's PATH (nor does its python3 import it)

# A ~/.bashrc that talks for every shell, interactive or not: a greeting, a notice on stderr, and a terminal
# title set without a newline (so that even the first line of pallet's own output is not a line of its own).
CHATTY_BASHRC = f"""export PATH="{QUIET_PATH}"; unset PYTHONPATH
echo "Welcome to the cluster"
echo "rc: quota check skipped" >&2
printf '\\033]0;cluster\\007'
"""

# An sshd ForceCommand wrapper as sites deploy it: a banner, then the user's command.
BANNER_WRAPPER = """#!/bin/sh
echo '*** Authorized use only: activity is logged ***'
echo '*** Maintenance on Friday ***'
if [ -n "$SSH_ORIGINAL_COMMAND" ]; then exec sh -c "$SSH_ORIGINAL_COMMAND"; fi
exec sh
"""

# The same, sending the command's stderr to its stdout (sites that log what a session prints do).
MERGING_WRAPPER = BANNER_WRAPPER.replace('"$SSH_ORIGINAL_COMMAND"; fi', '"$SSH_ORIGINAL_COMMAND" 2>&1; fi')

# A forced command that prints its banner and never runs the user's command (a site's menu, a broken wrapper).
IGNORING_WRAPPER = """#!/bin/sh
echo '*** Project menu: choose a project first ***'
exit 0
"""

# A forced command that keeps the user waiting, saying so, and never starts the command (it ends once its output
# has nowhere to go).
STUCK_WRAPPER = """#!/bin/sh
echo '*** Waiting for a free login slot ***'
while echo '... still waiting'; do sleep 1; done
"""

# Rewrites FILE in place, whole, alternating all-A and all-B, until killed.
REWRITER = r"""
import os, sys
path, size = sys.argv[1], int(sys.argv[2])
fd, turn = os.open(path, os.O_WRONLY), 0
while True:
    for offset in range(0, size, 1 << 20):
        os.pwrite(fd, (b"AB"[turn % 2:turn % 2 + 1] * (1 << 20))[:size - offset], offset)
    turn += 1
"""


def talkative_server(root: Path, bashrc: str, wrapper: str | None = None) -> SSHServer:
    """An sshd whose sessions use HOME ``root/home`` (with ``bashrc``), and ``wrapper`` as ForceCommand."""
    home = root / "home"
    home.mkdir(parents=True)
    (home / ".bashrc").write_text(bashrc)
    config = [f"SetEnv HOME={home}"]
    if wrapper is not None:
        script = root / "wrapper.sh"
        script.write_text(wrapper)
        script.chmod(0o755)
        config.append(f"ForceCommand {script}")
    server = start_sshd(root / "sshd", tuple(config))
    server.home = home
    return server


@pytest.fixture(scope="module", params=["bashrc", "forcecommand", "merged-stderr"])
def chatty(request, tmp_path_factory):
    """A far side that prints on login, without pallet on its PATH: by its ~/.bashrc, or by a ForceCommand (one
    that also sends the command's stderr to its stdout)."""
    root = tmp_path_factory.mktemp(f"chatty-{request.param}")
    wrapper = {"bashrc": None, "forcecommand": BANNER_WRAPPER, "merged-stderr": MERGING_WRAPPER}[request.param]
    if wrapper is None:
        server = talkative_server(root, CHATTY_BASHRC)
    else:
        server = talkative_server(root, f'export PATH="{QUIET_PATH}"; unset PYTHONPATH\n', wrapper)
    server.kind = request.param
    try:
        login = subprocess.run(["ssh", *server.ssh_options, "-p", str(server.port), f"{server.user}@127.0.0.1",
                                "echo ready"], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                               timeout=GUARD_S)
        assert login.stdout.endswith("ready\n") and login.stdout != "ready\n", login   # it does talk
        yield server
    finally:
        server.stop()


def pallet(*args: str, timeout: float = GUARD_S) -> subprocess.CompletedProcess:
    return subprocess.run([program("pallet"), *args], capture_output=True, text=True, env=user_env(),
                          stdin=subprocess.DEVNULL, timeout=timeout)


def ssh_flags(server: SSHServer) -> list[str]:
    return [f"--ssh-option={option}" for option in server.ssh_options]


def with_pallet() -> list[str]:
    """The far side's pallet: this environment's Python, named as a user names one there."""
    return ["--remote-python", sys.executable]


def succeeded(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return json.loads(done.stdout)


def push(server: SSHServer, src, dest: Path, *flags: str) -> dict:
    return succeeded(pallet("push", "--json", *flags, *ssh_flags(server), str(src), server.url(str(dest))))


def pull(server: SSHServer, src: Path, dest, *flags: str) -> dict:
    return succeeded(pallet("pull", "--json", *flags, *ssh_flags(server), server.url(str(src)), str(dest)))


def test_tar_tools_push_and_pull_skip_the_login_output(chatty, tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    pushed = push(chatty, src, tmp_path / "there", "--strategy", "bundle", "--reprobe")
    assert pushed["route"].startswith("tar tools"), pushed["route"]
    assert_same_tree(src, tmp_path / "there", whole_seconds=True)     # the far side's tar set them
    pulled = pull(chatty, tmp_path / "there", tmp_path / "back", "--strategy", "bundle")
    assert pulled["route"].startswith("tar tools"), pulled["route"]
    assert_same_tree(src, tmp_path / "back", whole_seconds=True)


def test_individual_push_and_pull_without_pallet_there_run_rsync_past_the_login_output(chatty, tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    push(chatty, src, tmp_path / "there", "--strategy", "individual", "--reprobe")
    assert_same_tree(src, tmp_path / "there")
    pull(chatty, tmp_path / "there", tmp_path / "back", "--strategy", "individual", "--reprobe")
    assert_same_tree(src, tmp_path / "back")


def test_individual_push_with_pallet_there_holds_its_session_past_the_login_output(chatty, tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    push(chatty, src, tmp_path / "there", "--strategy", "individual", *with_pallet())
    assert_same_tree(src, tmp_path / "there")


def test_bundle_push_and_pull_with_pallet_there_stream_past_the_login_output(chatty, tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    pushed = push(chatty, src, tmp_path / "there", "--strategy", "bundle", *with_pallet())
    assert pushed["route"] != "" and not pushed["route"].startswith("tar tools"), pushed["route"]
    assert_same_tree(src, tmp_path / "there")
    pull(chatty, tmp_path / "there", tmp_path / "back", "--strategy", "bundle", *with_pallet())
    assert_same_tree(src, tmp_path / "back")


def test_remote_status_reads_its_answer_past_the_login_output(chatty):
    record = chatty.home / ".config" / "pallet" / "python"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(sys.executable + "\n")
    try:
        done = pallet("remote", "status", "--json", *ssh_flags(chatty), f"{chatty.user}@127.0.0.1:{chatty.port}")
    finally:
        record.unlink()
    found = succeeded(done)
    assert found["usable"] and found["recorded"] == sys.executable, found


@pytest.fixture(scope="module")
def ignoring(tmp_path_factory):
    """A far side whose forced command prints a banner and exits without running the command it was given."""
    server = talkative_server(tmp_path_factory.mktemp("ignoring"), f'export PATH="{QUIET_PATH}"\n',
                              IGNORING_WRAPPER)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stuck(tmp_path_factory):
    """A far side whose forced command prints a banner and then waits, printing, without ever running the
    command; pallet is told (ssh's ConnectTimeout) to give it 3 s."""
    server = talkative_server(tmp_path_factory.mktemp("stuck"), f'export PATH="{QUIET_PATH}"\n', STUCK_WRAPPER)
    server.ssh_options = [*server.ssh_options, "-o", "ConnectTimeout=3"]
    yield server
    server.stop()


@pytest.mark.parametrize("flags", [("--strategy", "bundle"), ("--strategy", "individual"),
                                   ("--strategy", "bundle", *with_pallet())], ids=["plain", "individual", "pallet"])
def test_a_far_side_that_never_runs_the_command_is_named_in_one_line(ignoring, tmp_path, flags):
    src = make_nasty_tree(str(tmp_path / "src"))
    done = pallet("push", "--reprobe", *flags, *ssh_flags(ignoring), src, ignoring.url(str(tmp_path / "there")))
    assert done.returncode == 3, done
    assert "Traceback" not in done.stderr
    first = done.stderr.strip().splitlines()[0]
    assert "printed '*** Project menu: choose a project first ***'" in first, done.stderr
    assert "ended without running pallet's command" in first, done.stderr
    assert not os.path.exists(tmp_path / "there")


@pytest.mark.parametrize("flags", [("--strategy", "bundle"), ("--strategy", "individual", *with_pallet())],
                         ids=["probe", "session"])
def test_a_far_side_that_never_starts_the_command_is_left_after_its_time(stuck, tmp_path, flags):
    """The probe (a command run to its end) and the session (a command pallet streams into) both give up after
    ConnectTimeout, naming what the login printed."""
    src = make_nasty_tree(str(tmp_path / "src"))
    done = pallet("push", "--reprobe", *flags, *ssh_flags(stuck), src, stuck.url(str(tmp_path / "there")))
    assert done.returncode == 3, done
    assert "Traceback" not in done.stderr
    first = done.stderr.strip().splitlines()[0]
    assert "printed '*** Waiting for a free login slot *** ... still waiting" in first, done.stderr
    assert "did not start pallet's command within 3 s" in first, done.stderr


@pytest.mark.parametrize("server", ["ignoring", "stuck"])
def test_an_rsync_whose_login_never_starts_it_is_named(request, tmp_path, server):
    """rsync run first on a connection (its -e filter is the one that sees the login) ends with the same error."""
    from staging_core.transports import Direction, Endpoint
    from staging_core.transports.ssh import SSHTransport
    from staging_core.transports.ssh_master import LoginOutputError
    far = request.getfixturevalue(server)
    src = make_nasty_tree(str(tmp_path / "src"))
    transport = SSHTransport(Endpoint("ssh", str(tmp_path / "there"), "127.0.0.1", far.port, far.user),
                             far.ssh_options)
    try:
        with pytest.raises(LoginOutputError) as raised:
            transport.transfer(Direction.PUSH, src, str(tmp_path / "there"))
    finally:
        transport.close()
    assert "Project menu" in str(raised.value) or "free login slot" in str(raised.value), raised.value
    assert raised.value.exit_code == 3


def test_rsync_run_first_on_a_talkative_connection_skips_the_login_output(chatty, tmp_path):
    from staging_core.transports import Direction, Endpoint
    from staging_core.transports.ssh import SSHTransport
    src = make_nasty_tree(str(tmp_path / "src"))
    transport = SSHTransport(Endpoint("ssh", str(tmp_path / "there"), "127.0.0.1", chatty.port, chatty.user),
                             chatty.ssh_options)
    try:
        transport.transfer(Direction.PUSH, src, str(tmp_path / "there"))
        transport.transfer(Direction.PULL, str(tmp_path / "back"), str(tmp_path / "there"))
    finally:
        transport.close()
    assert_same_tree(src, tmp_path / "there")
    assert_same_tree(src, tmp_path / "back")


@pytest.mark.parametrize("chatty", ["bashrc"], indirect=True)
def test_a_source_file_changing_during_a_tar_tools_push_is_named_as_the_sources_fault(chatty, tmp_path):
    """Not the far side's zstd (exit 3) that saw its stream cut: the local file, as a SourceError (exit 1)."""
    src, size = tmp_path / "src", 64 << 20
    src.mkdir()
    (src / "small.txt").write_bytes(b"steady\n")
    (src / "big").write_bytes(b"A" * size)
    writer = subprocess.Popen([sys.executable, "-c", REWRITER, str(src / "big"), str(size)])
    try:
        for number in range(10):            # until a read sees the file change (the writer never stops)
            dest = tmp_path / f"dest{number}"
            done = pallet("push", "--quiet", "--strategy", "bundle", *ssh_flags(chatty), str(src),
                          chatty.url(str(dest)))
            if done.returncode != 0:
                break
            assert (dest / "big").read_bytes() in (b"A" * size, b"B" * size), "a push landed a mix"
    finally:
        writer.kill()
        writer.wait()
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith(f"pallet push: error: {src / 'big'}: changed while being read"), done.stderr
    assert "zstd" not in done.stderr and "tar session" not in done.stderr, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("chatty", ["bashrc"], indirect=True)
def test_remote_install_and_the_push_that_finds_it_read_past_the_login_output(chatty, tmp_path):
    """The install's query and its streamed wheels, then the probe that finds the recorded Python."""
    record = chatty.home / ".config" / "pallet" / "python"
    try:
        done = pallet("remote", "install", "--json", "--quiet", "--prefix", str(chatty.home / "venv"),
                      *ssh_flags(chatty), f"{chatty.user}@127.0.0.1:{chatty.port}", timeout=600)
        assert succeeded(done)["remote_python"] == str(chatty.home / "venv" / "bin" / "python")
        src = make_nasty_tree(str(tmp_path / "src"))
        pushed = push(chatty, src, tmp_path / "there", "--strategy", "bundle", "--reprobe")
        assert not pushed["route"].startswith("tar tools"), pushed["route"]
        assert_same_tree(src, tmp_path / "there")
    finally:
        record.unlink(missing_ok=True)          # the other tests' far side has no pallet
