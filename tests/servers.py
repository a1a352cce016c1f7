"""Real servers for tests: sshd on 127.0.0.1 with throw-away keys, stopped by PID."""
from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: {process.stderr.read().decode()}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"server did not listen on port {port} within {timeout} s")


@dataclass
class SSHServer:
    """A running sshd: connect as ``user`` to 127.0.0.1:``port`` with ``ssh_options``."""

    port: int
    user: str
    key: Path
    process: subprocess.Popen
    ssh_options: list[str] = field(default_factory=list)

    def url(self, path: str) -> str:
        return f"ssh://{self.user}@127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_sshd(workdir: Path) -> SSHServer:
    """Start sshd on a free loopback port with generated host and user keys (UsePAM no, StrictModes no)."""
    workdir.mkdir(parents=True, exist_ok=True)
    host_key, user_key = workdir / "host_ed25519", workdir / "user_ed25519"
    for key in (host_key, user_key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    (workdir / "authorized_keys").write_text((workdir / "user_ed25519.pub").read_text())
    port = free_port()
    config = workdir / "sshd_config"
    config.write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {host_key}", f"PidFile {workdir}/sshd.pid",
        f"AuthorizedKeysFile {workdir}/authorized_keys", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "PermitRootLogin yes",
        "MaxSessions 100", "MaxStartups 100:30:200", "Subsystem sftp internal-sftp", "LogLevel ERROR", ""]))
    os.makedirs("/run/sshd", exist_ok=True)
    process = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_port(port, process)
    options = ["-i", str(user_key), "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no",
               "-o", f"UserKnownHostsFile={workdir}/known_hosts", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes"]
    return SSHServer(port, os.environ.get("USER") or "root", user_key, process, options)
