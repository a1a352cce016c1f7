"""sshd and globus-gridftp-server started inside an emulated WAN's namespace, listening on its address."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from wan import NS_IP, WanLink

from tests.servers import free_port, sshd_setup, stop_process

SSH_USER = os.environ.get("USER") or "root"


@dataclass
class NetnsSSHD:
    """A running sshd at ``host``:``port``; connect as ``user`` with ``ssh_options``."""

    host: str
    port: int
    user: str
    process: subprocess.Popen
    ssh_options: list[str] = field(default_factory=list)

    @property
    def login(self) -> str:
        return f"{self.user}@{self.host}"

    def url(self, path: str) -> str:
        return f"ssh://{self.login}:{self.port}{path}"

    def end_clients(self) -> list[int]:
        """Stop ssh clients still connected with this server's user key (e.g. a ControlMaster left by a failed
        run); their PIDs."""
        key = self.ssh_options[self.ssh_options.index("-i") + 1].encode()
        ended = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid() and key in _cmdline(entry):
                with suppress(ProcessLookupError):
                    os.kill(int(entry.name), signal.SIGTERM)
                    ended.append(int(entry.name))
        return ended

    def ssh_argv(self) -> list[str]:
        """``ssh`` with port and options, ready for a destination and a command."""
        return ["ssh", "-p", str(self.port), *self.ssh_options]

    def stop(self) -> None:
        stop_process(self.process)


@dataclass
class NetnsGridFTP:
    """A running globus-gridftp-server at ``host``:``port`` (anonymous clear-text ftp://, mapped to root)."""

    host: str
    port: int
    process: subprocess.Popen

    def url(self, path: str) -> str:
        return f"ftp://{self.host}:{self.port}{path}"

    def stop(self) -> None:
        stop_process(self.process)


def start_netns_sshd(link: WanLink, workdir: Path) -> NetnsSSHD:
    """sshd in the namespace on NS_IP with generated host and user keys (UsePAM no, StrictModes no)."""
    port = free_port()
    config, options = sshd_setup(workdir, NS_IP, port)
    process = _start(link.ns(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)]), workdir / "sshd.log", workdir)
    _wait_for_port(NS_IP, port, process, workdir / "sshd.log")
    return NetnsSSHD(NS_IP, port, SSH_USER, process, options)


def start_netns_gridftp(link: WanLink, workdir: Path) -> NetnsGridFTP:
    """globus-gridftp-server in the namespace, control and data channels on NS_IP, anonymous users as root."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    program = shutil.which("globus-gridftp-server") or "/usr/sbin/globus-gridftp-server"
    argv = [program, "-aa", "-anonymous-user", "root", "-allow-root", "-p", str(port),
            "-control-interface", NS_IP, "-data-interface", NS_IP, "-no-detach",
            "-log-level", "error", "-logfile", str(workdir / "gridftp.log")]
    process = _start(link.ns(argv), workdir / "gridftp.err", workdir)
    _wait_for_port(NS_IP, port, process, workdir / "gridftp.err")
    return NetnsGridFTP(NS_IP, port, process)


def _cmdline(proc_entry: Path) -> bytes:
    try:
        return (proc_entry / "cmdline").read_bytes()
    except OSError:
        return b""


def _start(argv: list[str], log: Path, cwd: Path) -> subprocess.Popen:
    """Start a server with its stderr in ``log`` (a pipe nobody reads could fill and stall it)."""
    with open(log, "wb") as errors:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors, cwd=cwd)


def _wait_for_port(host: str, port: int, process: subprocess.Popen, log: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: {log.read_text(errors='replace')}")
        with socket.socket() as sock:
            sock.settimeout(2)
            if sock.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"server did not listen on {host}:{port} within {timeout} s")
