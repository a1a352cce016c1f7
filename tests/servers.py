"""Real servers for tests: sshd, globus-gridftp-server and a one-node Slurm on 127.0.0.1, stopped by PID."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process(process: subprocess.Popen) -> None:
    """Terminate a server we started, by its PID; kill it if it does not exit within 10 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


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
        stop_process(self.process)


def start_sshd(workdir: Path, extra_config: tuple[str, ...] = ()) -> SSHServer:
    """Start sshd on a free loopback port with generated host and user keys (UsePAM no, StrictModes no).
    Sessions accept SLURM_CONF from the client (``-o SetEnv=SLURM_CONF=...``) to reach a test's own Slurm.
    ``extra_config`` lines are added to its sshd_config (e.g. ``SetEnv HOME=DIR``)."""
    port = free_port()
    config, options = sshd_setup(workdir, "127.0.0.1", port, ("AcceptEnv SLURM_CONF", *extra_config))
    process = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_port(port, process)
    return SSHServer(port, os.environ.get("USER") or "root", workdir / "user_ed25519", process, options)


def start_bare_sshd(root: Path) -> SSHServer:
    """An sshd whose sessions run in a home of their own (``server.home``, with ``server.shims``, a directory first
    on PATH, for a test's own programs) with a PATH that has no pallet: python3 there cannot import it (checked;
    sshd gives its sessions an environment of their own, so nothing of the test's reaches them)."""
    home, shims = root / "home", root / "home" / "bin"
    shims.mkdir(parents=True)
    (home / ".bashrc").write_text(f'export PATH="{shims}:/usr/local/bin:/usr/bin:/bin"\n')
    server = start_sshd(root / "sshd", (f"SetEnv HOME={home}",))
    server.home, server.shims = home, shims
    lacks = subprocess.run(["ssh", *server.ssh_options, "-p", str(server.port), f"{server.user}@127.0.0.1",
                            "python3 -c 'import mpi_stager' || echo absent"], capture_output=True, text=True,
                           stdin=subprocess.DEVNULL, timeout=60)
    if lacks.stdout.strip() != "absent":
        server.stop()
        raise AssertionError("the bare far side must not import pallet")
    return server


def sshd_setup(workdir: Path, address: str, port: int, extra_config: tuple[str, ...] = ()) -> tuple[Path, list[str]]:
    """Generate host and user keys in ``workdir`` and an sshd_config listening on ``address``:``port``;
    return the config's path and the ssh client options that log in with the user key."""
    workdir.mkdir(parents=True, exist_ok=True)
    host_key, user_key = workdir / "host_ed25519", workdir / "user_ed25519"
    for key in (host_key, user_key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    (workdir / "authorized_keys").write_text((workdir / "user_ed25519.pub").read_text())
    config = workdir / "sshd_config"
    config.write_text("\n".join([
        f"Port {port}", f"ListenAddress {address}", f"HostKey {host_key}", f"PidFile {workdir}/sshd.pid",
        f"AuthorizedKeysFile {workdir}/authorized_keys", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "PermitRootLogin yes",
        "MaxSessions 100", "MaxStartups 100:30:200", "Subsystem sftp internal-sftp", "LogLevel ERROR",
        *extra_config, ""]))
    os.makedirs("/run/sshd", exist_ok=True)
    options = ["-i", str(user_key), "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no",
               "-o", f"UserKnownHostsFile={workdir}/known_hosts", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes"]
    return config, options


@dataclass
class GridFTPServer:
    """A running globus-gridftp-server on 127.0.0.1:``port`` (anonymous clear-text FTP, mapped to root)."""

    port: int
    process: subprocess.Popen
    scheme: str = "ftp"
    client_env: dict = field(default_factory=dict)     # GSI trust roots and credential for globus-url-copy
    options: list[str] = field(default_factory=list)   # -s SUBJECT: the host certificate's name

    def url(self, path: str) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        """Terminate the server by its PID (children serving closed connections exit on their own)."""
        stop_process(self.process)


def start_gridftp(workdir: Path, gsi: bool = False, user: str = "root") -> GridFTPServer:
    """Start globus-gridftp-server in the foreground on a free loopback port, control and data channels on
    127.0.0.1 only. Its default mode is a daemon that does not detach (-no-detach says so) and forks one
    child per connection; -debug would stop forking, and then a root server serves one connection only.
    Errors go to ``workdir/gridftp.log`` (a stderr pipe nobody reads could fill and stall the server);
    stderr keeps what it prints before logging starts, such as a bad option. Anonymous sessions run as
    ``user``; ``gsi`` makes a throw-away CA and serves gsiftp:// to its user certificate instead."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    program = shutil.which("globus-gridftp-server") or "/usr/sbin/globus-gridftp-server"
    server_env, client_env = make_gsi_credentials(workdir) if gsi else ({}, {})
    access = [] if gsi else ["-aa", "-anonymous-user", user]
    argv = [program, *access, "-allow-root", "-p", str(port),
            "-control-interface", "127.0.0.1", "-data-interface", "127.0.0.1", "-no-detach",
            "-log-level", "error", "-logfile", str(workdir / "gridftp.log")]
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, cwd=workdir, env={**os.environ, **server_env})
    wait_for_port(port, process)
    if not gsi:
        return GridFTPServer(port, process)
    return GridFTPServer(port, process, "gsiftp", client_env, ["-s", GSI_HOST_SUBJECT])


GSI_HOST_SUBJECT = "/O=Pallet Test/CN=host/localhost"
GSI_USER_SUBJECT = "/O=Pallet Test/CN=pallet user"
_GSI_EXTENSIONS = """[ee]
basicConstraints=critical,CA:false
keyUsage=critical,digitalSignature,keyEncipherment,dataEncipherment
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid
"""


def make_gsi_credentials(workdir: Path) -> tuple[dict, dict]:
    """A throw-away CA (with its signing policy), a host and a user certificate, and a grid-mapfile mapping
    the user to root, made with the openssl command; the environments of the server and the client."""
    gsi = workdir / "gsi"
    (gsi / "certificates").mkdir(parents=True)
    (gsi / "ext.cnf").write_text(_GSI_EXTENSIONS)
    openssl = ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-days", "2"]
    quiet = {"check": True, "capture_output": True}
    subprocess.run([*openssl, "-x509", "-keyout", gsi / "ca.key", "-out", gsi / "ca.pem", "-subj",
                    "/O=Pallet Test/CN=Pallet Test CA", "-addext", "basicConstraints=critical,CA:true",
                    "-addext", "keyUsage=critical,keyCertSign,cRLSign"], **quiet)
    for name, subject in (("host", GSI_HOST_SUBJECT), ("user", GSI_USER_SUBJECT)):
        subprocess.run([*openssl, "-keyout", gsi / f"{name}.key", "-out", gsi / f"{name}.csr",
                        "-subj", subject.replace("host/", "host\\/")], **quiet)
        subprocess.run(["openssl", "x509", "-req", "-in", gsi / f"{name}.csr", "-CA", gsi / "ca.pem", "-CAkey",
                        gsi / "ca.key", "-CAcreateserial", "-days", "2", "-out", gsi / f"{name}.pem",
                        "-extfile", gsi / "ext.cnf", "-extensions", "ee"], **quiet)
    digest = subprocess.run(["openssl", "x509", "-in", gsi / "ca.pem", "-noout", "-subject_hash"],
                            **quiet, text=True).stdout.strip()
    shutil.copy(gsi / "ca.pem", gsi / "certificates" / f"{digest}.0")
    (gsi / "certificates" / f"{digest}.signing_policy").write_text(
        "access_id_CA X509 '/O=Pallet Test/CN=Pallet Test CA'\npos_rights globus CA:sign\n"
        "cond_subjects globus '\"/O=Pallet Test/*\"'\n")
    (gsi / "grid-mapfile").write_text(f'"{GSI_USER_SUBJECT}" root\n')
    (gsi / "usercred.pem").write_bytes((gsi / "user.pem").read_bytes() + (gsi / "user.key").read_bytes())
    for key in ("host.key", "user.key", "usercred.pem", "ca.key"):
        (gsi / key).chmod(0o600)
    trust = {"X509_CERT_DIR": str(gsi / "certificates")}
    return ({**trust, "X509_USER_CERT": str(gsi / "host.pem"), "X509_USER_KEY": str(gsi / "host.key"),
             "GRIDMAP": str(gsi / "grid-mapfile")}, {**trust, "X509_USER_PROXY": str(gsi / "usercred.pem")})


def count_invocations(shim_dir: Path, program: str, monkeypatch):
    """Put a shim for ``program`` first on PATH that logs each call's arguments; return a reader of the log."""
    real, log = shutil.which(program), shim_dir / f"{program}.calls"
    shim_dir.mkdir(parents=True, exist_ok=True)
    shim = shim_dir / program
    shim.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\nexec {real} "$@"\n')
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim_dir}{os.pathsep}{os.environ['PATH']}")
    return lambda: log.read_text().splitlines() if log.exists() else []


def count_transfers(shim_dir: Path, monkeypatch):
    """Shims for rsync and ssh (see :func:`count_invocations`); return a reader of the transfers made since: rsync
    batches plus streamed pulls (ssh sessions running ``mpi_stager send``)."""
    rsync_calls = count_invocations(shim_dir, "rsync", monkeypatch)
    ssh_calls = count_invocations(shim_dir, "ssh", monkeypatch)
    return lambda: rsync_calls() + [call for call in ssh_calls() if "mpi_stager send" in call]


@dataclass
class SlurmCluster:
    """A one-node Slurm (munged, slurmctld, slurmd as children of the test) configured by ``conf``.

    Clients find it through ``env`` (SLURM_CONF); ssh sessions through
    ``ssh_options`` (sshd accepts SLURM_CONF, see :func:`start_sshd`).
    """

    conf: Path
    processes: list[subprocess.Popen]

    @property
    def env(self) -> dict:
        return {"SLURM_CONF": str(self.conf)}

    @property
    def ssh_options(self) -> list[str]:
        return ["-o", f"SetEnv=SLURM_CONF={self.conf}"]

    def stop(self) -> None:
        """Stop slurmd, slurmctld and munged by their PIDs, in that order."""
        for process in reversed(self.processes):
            stop_process(process)


SLURM_PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "srun")


def start_slurm(workdir: Path) -> SlurmCluster:
    """Start munged (own key and socket), slurmctld and slurmd in the foreground with a slurm.conf for
    NodeName=localhost (this machine's CPUs, one partition), state and spool under ``workdir``, free loopback
    ports, no accounting, no cgroups; wait until the node is idle. Needs root (slurmd launches the jobs)."""
    munge, state = workdir / "munge", workdir / "state"
    for directory in (munge, state, workdir / "spool"):
        directory.mkdir(parents=True, exist_ok=True)
    munge.chmod(0o711)
    (munge / "munge.key").write_bytes(os.urandom(1024))
    (munge / "munge.key").chmod(0o400)
    socket_path = munge / "munge.socket"
    processes = [_start(["munged", "-F", "--force", f"--socket={socket_path}", f"--key-file={munge}/munge.key",
                         f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/munged.seed",
                         f"--log-file={munge}/munged.log"], workdir / "munged.out")]
    _wait_for(socket_path.exists, processes[0], "munged socket")
    conf = workdir / "slurm.conf"
    conf.write_text(_slurm_conf(workdir, socket_path))
    cluster = SlurmCluster(conf, processes)
    env = {**os.environ, **cluster.env}
    processes.append(_start(["slurmctld", "-D", "-i", "-f", str(conf)], workdir / "slurmctld.out", env))
    processes.append(_start(["slurmd", "-D", "-N", "localhost", "-f", str(conf)], workdir / "slurmd.out", env))

    def idle() -> bool:
        done = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
        return done.stdout.strip() == "idle"
    try:
        _wait_for(idle, processes[-1], "an idle Slurm node", timeout=60)
    except RuntimeError:
        cluster.stop()
        raise
    return cluster


def _slurm_conf(workdir: Path, munge_socket: Path) -> str:
    user = os.environ.get("USER") or "root"
    return "\n".join([
        "ClusterName=pallet-test", "SlurmctldHost=localhost", f"SlurmUser={user}", f"SlurmdUser={user}",
        f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={workdir}/state", f"SlurmdSpoolDir={workdir}/spool",
        f"SlurmctldPidFile={workdir}/slurmctld.pid", f"SlurmdPidFile={workdir}/slurmd.pid",
        f"SlurmctldLogFile={workdir}/slurmctld.log", f"SlurmdLogFile={workdir}/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none", "MailProg=/bin/true",
        "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "MpiDefault=none", "ReturnToService=2",
        f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN",
        "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP", ""])


def _start(argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)


def _wait_for(ready, process: subprocess.Popen, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode} before {what} was ready")
        if ready():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready within {timeout} s")
