"""URLs that would mean a root, malformed URLs and the message defects: one error line, the right exit code, nothing
written — through the installed `pallet`, in a user's environment."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.conftest import run_pallet
from tests.programs import program, user_env
from tests.servers import start_sshd

USAGE, SOURCE = 2, 1


def assert_one_error(done: subprocess.CompletedProcess, code: int, *names: object) -> None:
    """Exit ``code``; stderr is one error line that names the first of ``names`` (then, at most, a hint line,
    the two naming the rest); no traceback and no internal error."""
    assert done.returncode == code, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr, done.stderr
    assert lines and " error: " in lines[0] and len(lines) <= 2, done.stderr
    assert len(lines) == 1 or lines[1].startswith("  hint: "), done.stderr
    assert not names or str(names[0]) in lines[0], (names[0], done.stderr)
    for name in names:
        assert str(name) in done.stderr, (name, done.stderr)


def make_source(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    for n in range(4):
        (root / "sub" / f"f{n}.txt").write_text(f"file {n}\n")
    (root / "top.txt").write_text("top\n")
    return root


@pytest.fixture
def src(tmp_path) -> Path:
    return make_source(tmp_path / "src")


def ssh_env(server) -> dict[str, str]:
    return {"PALLET_SSH_OPTIONS": shlex.join(server.ssh_options)}


def ssh_url(server, path: str) -> str:
    return f"ssh://{server.user}@127.0.0.1:{server.port}{path}"


# ---------------------------------------------------------------- URLs that would mean a root

@pytest.mark.parametrize("command", ["push", "pull", "plan"])
def test_a_remote_url_without_a_path_is_a_usage_error(src, tmp_path, command):
    url = "ssh://127.0.0.1"             # nothing listens at port 22: before, this ended as "host unreachable", 3
    args = [command, url, str(tmp_path / "out")] if command == "pull" else [command, str(src), url]
    done = run_pallet(*args)
    assert_one_error(done, USAGE, url, "absolute path")
    assert "ssh://127.0.0.1/absolute/path" in done.stderr
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_a_file_url_with_a_host_is_a_usage_error_and_writes_nothing(src, tmp_path):
    name = f"pallet-url-test-{uuid.uuid4().hex}"
    url = f"file://relative/{name}"      # before: written to /NAME
    try:
        done = run_pallet("push", str(src), url)
        assert_one_error(done, USAGE, url)
        assert "file:///absolute/path" in done.stderr
        assert not os.path.lexists(f"/{name}")
    finally:
        shutil.rmtree(f"/{name}", ignore_errors=True)
    done = run_pallet("pull", url, str(tmp_path / "out"))
    assert_one_error(done, USAGE, url)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("port", ["abc", "0", "65536", "99999", "", "22x"])
def test_a_bad_port_is_a_usage_error_naming_it(src, tmp_path, port):
    url = f"ssh://127.0.0.1:{port}/tmp/x"
    for args in (["push", str(src), url], ["pull", url, str(tmp_path / "out")]):
        done = run_pallet(*args)
        assert_one_error(done, USAGE, f"bad port {port!r}", url)
        assert "1 to 65535" in done.stderr
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_a_malformed_url_is_a_usage_error_and_never_reaches_ssh(src, tmp_path):
    mark = tmp_path / "injected"
    for url, named in (("ssh://-oProxyCommand=touch${IFS}injected/x", "is not a host name"),
                       ("ssh://a@b@c/x", "malformed host part"), ("ssh://-l@host/x", "is not a user name"),
                       ("ssh:///x", "has no host")):
        done = run_pallet("push", "--dry-run", str(src), url, cwd=tmp_path)
        assert_one_error(done, USAGE, url, named)
    assert not mark.exists() and sorted(os.listdir(tmp_path)) == ["src"]


def test_a_local_dest_of_root_is_refused(src):
    before = set(os.listdir("/"))
    for dest in ("/", "//", "file:///", "/tmp/.."):
        done = run_pallet("push", "--dry-run", str(src), dest)
        assert_one_error(done, USAGE, "root directory", "--allow-root-dest")
    done = run_pallet("pull", "--dry-run", str(src), "/")
    assert_one_error(done, USAGE, "root directory")
    assert set(os.listdir("/")) == before


def test_a_symlink_to_root_as_dest_is_refused(src, tmp_path):
    (tmp_path / "to-root").symlink_to("/")
    done = run_pallet("pull", "--dry-run", str(src), str(tmp_path / "to-root"))
    assert_one_error(done, USAGE, "root directory", "it leads to /")
    assert not os.path.lexists("/.pallet")


def test_home_as_dest_is_refused_unless_allowed(src, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home)}
    for args in (["push", str(src), str(home)], ["push", "--delete", str(src), f"{home}/"],
                 ["pull", str(src), str(home)]):
        done = run_pallet(*args, env=env)
        assert_one_error(done, USAGE, str(home), "home directory", "--allow-root-dest")
        assert os.listdir(home) == []
    run_pallet("push", "--allow-root-dest", str(src), str(home), env=env, check=True)
    assert (home / "sub" / "f3.txt").read_text() == "file 3\n"


def test_help_teaches_the_option():
    for command in ("push", "pull"):
        shown = run_pallet(command, "--help", check=True).stdout
        assert "--allow-root-dest" in shown and "home directory" in shown


def test_a_remote_dest_of_root_or_a_home_is_refused(sshd, src):
    before = set(os.listdir("/"))
    for path, why in (("/", "root directory"), ("/tmp/..", "root directory"), ("/root", "home directory"),
                      ("/home", "home directory"), (f"/home/pallet-test-{uuid.uuid4().hex[:8]}", "home directory")):
        url = ssh_url(sshd, path)
        for extra in (["--dry-run", "--delete"], []):
            done = run_pallet("push", *extra, str(src), url, env=ssh_env(sshd))
            assert_one_error(done, USAGE, why, "--allow-root-dest")
    assert set(os.listdir("/")) == before and not os.path.lexists("/.pallet")


def test_a_relative_src_pushes_individually_over_ssh(sshd, src, tmp_path):
    """A relative SRC is local, as for rsync and cp, on the individual ssh route too (it was a usage error there:
    'the local side of a transfer must be an absolute path')."""
    dest = tmp_path / "dest"
    run_pallet("push", "--strategy", "individual", "src", ssh_url(sshd, str(dest)), env=ssh_env(sshd),
               cwd=tmp_path, check=True)
    assert (dest / "sub" / "f1.txt").read_text() == "file 1\n"


# ---------------------------------------------------------------- messages

def test_a_globus_url_with_a_bad_collection_names_it(src, tmp_path):
    url = "globus://notauuid/x"
    for args in (["push", str(src), url], ["pull", url, str(tmp_path / "out")]):
        done = run_pallet(*args)
        assert_one_error(done, USAGE, "notauuid", "UUID")
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_an_unbalanced_quote_in_ssh_options_is_a_usage_error(src, tmp_path):
    url = "ssh://127.0.0.1:9/tmp/x"
    done = run_pallet("push", str(src), url, env={"PALLET_SSH_OPTIONS": "-o 'ProxyJump=x"})
    assert_one_error(done, USAGE, "PALLET_SSH_OPTIONS", "closing quotation")
    done = run_pallet("pull", "--ssh-option", "-o 'ProxyJump=x", url, str(tmp_path / "out"))
    assert_one_error(done, USAGE, "--ssh-option", "closing quotation")
    assert sorted(os.listdir(tmp_path)) == ["src"]


def _without_read_override() -> list[str]:
    """A prefix that runs a command as root without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH: it then meets file
    permissions as any user does (root otherwise reads everything)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop the capability to read every file")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", "--bounding-set", caps, "--inh-caps", caps]


def test_an_unreadable_source_file_exits_1_on_every_route(sshd, src, tmp_path):
    """The bundle routes said SourceError (1); the individual routes said a transport failure (3)."""
    victim = src / "sub" / "f2.txt"
    victim.chmod(0)
    prefix = _without_read_override()
    codes = {}
    for where in ("local", "ssh"):
        for strategy in ("individual", "bundle"):
            dest = tmp_path / f"{where}-{strategy}"
            url = str(dest) if where == "local" else ssh_url(sshd, str(dest))
            done = subprocess.run([*prefix, program("pallet"), "push", "--strategy", strategy, str(src), url],
                                  capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                  env=user_env(**ssh_env(sshd)))
            codes[f"{where} {strategy}"] = done.returncode
            if done.returncode == SOURCE:
                assert_one_error(done, SOURCE, victim, "cannot read (Permission denied)")
            assert not (dest / "sub" / "f2.txt").exists()
    assert set(codes.values()) == {SOURCE}, codes


@pytest.fixture(scope="module")
def busybox_far_side(tmp_path_factory):
    """An sshd whose sessions find a `find` without -printf first on PATH, as BusyBox's is (usage text, exit 1)."""
    if not os.path.exists("/usr/sbin/sshd"):
        pytest.skip("openssh-server is not installed (./bootstrap.sh installs it)")
    shim = tmp_path_factory.mktemp("busybox")
    (shim / "find").write_text(
        "#!/bin/sh\nfor a in \"$@\"; do case $a in -printf)\n"
        "  printf 'find: unrecognized: -printf\\nBusyBox v1.36.1 multi-call binary.\\n\\n"
        "Usage: find [-HL] [PATH]... [OPTIONS] [ACTIONS]\\n' >&2; exit 1;; esac; done\n"
        "exec /usr/bin/find \"$@\"\n")
    (shim / "find").chmod(0o755)
    server = start_sshd(tmp_path_factory.mktemp("sshd-busybox"),
                        (f"SetEnv PATH={shim}:/usr/local/bin:/usr/bin:/bin",))
    yield server
    server.stop()


@pytest.mark.parametrize("command,strategy", [("push", "individual"), ("push", "bundle"), ("pull", "individual")])
def test_a_far_side_find_without_printf_is_named_in_one_line(busybox_far_side, src, tmp_path, command, strategy):
    dest = tmp_path / "dest"
    remote = ssh_url(busybox_far_side, str(dest if command == "push" else src))
    args = [str(src), remote] if command == "push" else [remote, str(dest)]
    done = run_pallet(command, "--strategy", strategy, *args, env=ssh_env(busybox_far_side))
    assert_one_error(done, SOURCE, "find lacks -printf", "GNU findutils")
    assert "BusyBox" not in done.stderr and "Usage:" not in done.stderr
    assert not dest.exists() or os.listdir(dest) == []


# ---------------------------------------------------------------- what the lexical check cannot see

@pytest.fixture
def homed(tmp_path):
    """An sshd whose sessions have a home of their own (a scratch directory standing in for a user's home)."""
    home = tmp_path / "far-home"
    home.mkdir()
    server = start_sshd(tmp_path / "sshd-homed", (f"SetEnv HOME={home}",))
    server.home = home
    yield server
    server.stop()


def test_delete_never_empties_a_dest_that_leads_to_the_home_there(homed, src, tmp_path):
    """A DEST reached through a link to the far side's home passes the check of its name; --delete there is
    refused by the far side once it resolves DEST, and nothing there is removed."""
    (homed.home / "precious.txt").write_text("mine\n")
    link = tmp_path / "innocent-looking"
    link.symlink_to(homed.home)
    done = run_pallet("push", "--delete", "--strategy", "individual", str(src), ssh_url(homed, str(link)),
                      env=ssh_env(homed))
    assert done.returncode != 0 and "--allow-root-dest" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr, done.stderr
    assert (homed.home / "precious.txt").read_text() == "mine\n"


@pytest.mark.parametrize("text", ["file:/tmp/x", "file:relative", "ssh://a b@127.0.0.1/x"])
def test_urls_that_are_neither_file_nor_ssh_urls_are_usage_errors(src, text):
    done = run_pallet("push", str(src), text)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "host unreachable" not in done.stderr, done.stderr
